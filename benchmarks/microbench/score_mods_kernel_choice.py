"""Softcap and ALiBi on sm90: the SM80-design kernels against the Hopper ones
(FLASH_ATTN_FWD_KERNEL / FLASH_ATTN_BWD_KERNEL, read per call), with the
plain score rule on the Hopper kernels as the ceiling and, for ALiBi, SDPA
given the bias as a float mask (what PyTorch ships for it), all timed in one
process, median of three rounds in alternating order.

    python benchmarks/microbench/score_mods_kernel_choice.py [--headdims 64,128,256]
        [--seqlens 1024,4096,16384] [--out results.json]

bf16, hidden 2048 (heads = 2048 / head dim), 16k tokens per call (batch =
16384 / seqlen). TFLOP/s count the causal mask's half as flash-attn's
benchmarks do.
"""

import argparse
import json
import math
import os

import torch
import torch.nn.functional as F


def time_us(fn, iters):
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1000


def alibi_bias(slopes, seqlen_q, seqlen_k, causal, dtype):
    """flash-attn's ALiBi as an additive mask: -slope * |row + seqlen_k - seqlen_q - col|,
    -inf above the diagonal when causal."""
    row = torch.arange(seqlen_q, device="cuda")[:, None] + seqlen_k - seqlen_q
    col = torch.arange(seqlen_k, device="cuda")[None, :]
    bias = -slopes[:, None, None] * (row - col).abs()
    if causal:
        bias = bias.masked_fill(col > row, float("-inf"))
    return bias[None].to(dtype)


def plot(result, path):
    """One panel per (mode, causal): TFLOP/s of each variant per (head dim,
    seqlen, mods) case."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    variants = [
        ("sm80", "SM80 kernel"),
        ("sm90", "Hopper kernel"),
        ("sm90_plain", "Hopper, no softcap / ALiBi"),
        ("sdpa", "SDPA, ALiBi as mask"),
    ]
    fig, axes = plt.subplots(4, 1, figsize=(16, 18))
    panels = [(mode, causal) for mode in ("fwd", "bwd") for causal in (False, True)]
    for ax, (mode, causal) in zip(axes, panels):
        cases = [r for r in rows if r["mode"] == mode and r["causal"] == causal]
        width = 0.2
        for i, (key, label) in enumerate(variants):
            xs, ys = [], []
            for j, r in enumerate(cases):
                if key in r["us"]:
                    flops = 4 * r["batch"] * r["nheads"] * r["seqlen"] ** 2 * r["head_dim"]
                    flops *= (0.5 if causal else 1.0) * (2.5 if mode == "bwd" else 1.0)
                    xs.append(j + (i - 1.5) * width)
                    ys.append(flops / r["us"][key] / 1e6)
            ax.bar(xs, ys, width, label=label)
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels(
            [f"d{r['head_dim']} s{r['seqlen']}\n{r['mods']}" for r in cases], fontsize=7
        )
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"{mode}, {'causal' if causal else 'non-causal'}")
        ax.legend(fontsize=8)
    fig.suptitle(f"softcap / ALiBi, bf16, 16k tokens, hidden 2048: {result['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--headdims", default="64,128,256")
    parser.add_argument("--seqlens", default="1024,4096,16384")
    parser.add_argument(
        "--sdpa-max-seqlen",
        type=int,
        default=4096,
        help="longest seqlen given to SDPA with an ALiBi mask (the mask is s^2)",
    )
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--plot-from", default=None, help="only plot an earlier --out JSON into --plot"
    )
    parser.add_argument("--plot", default=None, help="PNG path")
    args = parser.parse_args()
    if args.plot_from:
        with open(args.plot_from) as f:
            plot(json.load(f), args.plot)
        return
    import flash_attn_cuda  # noqa: F401  (registers torch.ops.flash_attn)

    torch.manual_seed(0)
    device = torch.cuda.get_device_name()
    print(device, "| torch", torch.__version__, "| CUDA", torch.version.cuda)
    print(
        "d causal seqlen mods mode | sm80 us | sm90 us | sm90 plain us | sdpa us |"
        " sm80/sm90 | sm90 TFLOP/s"
    )
    rows = []
    for head_dim in map(int, args.headdims.split(",")):
        nheads = 2048 // head_dim
        for seqlen in map(int, args.seqlens.split(",")):
            batch = max(1, 16384 // seqlen)
            q, k, v = (
                torch.randn(
                    batch,
                    seqlen,
                    nheads,
                    head_dim,
                    device="cuda",
                    dtype=torch.bfloat16,
                    requires_grad=True,
                )
                for _ in range(3)
            )
            dout = torch.randn_like(q)
            slopes = torch.rand(nheads, device="cuda") * 0.3 + 0.01
            scale = head_dim**-0.5
            for causal in (False, True):
                flops = 4 * batch * nheads * seqlen * seqlen * head_dim / (2 if causal else 1)
                for mods in ("softcap", "alibi", "softcap+alibi"):
                    softcap = 30.0 if "softcap" in mods else 0.0
                    alibi = slopes if "alibi" in mods else None

                    def fwd(softcap=softcap, alibi=alibi):
                        return torch.ops.flash_attn.fwd(
                            q, k, v, alibi, 0.0, scale, causal, -1, -1, softcap, False, 0, 0, None
                        )

                    out, lse, _, rng = fwd()

                    def bwd(softcap=softcap, alibi=alibi):
                        return torch.ops.flash_attn.bwd(
                            dout,
                            q,
                            k,
                            v,
                            out,
                            lse,
                            alibi,
                            0.0,
                            scale,
                            causal,
                            -1,
                            -1,
                            softcap,
                            False,
                            rng,
                        )

                    sdpa_fwd = sdpa_bwd = None
                    if mods == "alibi" and seqlen <= args.sdpa_max_seqlen:
                        bias = alibi_bias(slopes, seqlen, seqlen, causal, torch.bfloat16)
                        qt, kt, vt = (
                            x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v)
                        )

                        def sdpa_fwd():
                            return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=bias)

                        sdpa_out = sdpa_fwd()
                        dout_t = dout.transpose(1, 2)

                        def sdpa_bwd():
                            return torch.autograd.grad(
                                sdpa_out, (qt, kt, vt), dout_t, retain_graph=True
                            )

                    for mode, fn, sdpa_fn, env in (
                        ("fwd", fwd, sdpa_fwd, "FLASH_ATTN_FWD_KERNEL"),
                        ("bwd", bwd, sdpa_bwd, "FLASH_ATTN_BWD_KERNEL"),
                    ):
                        plain = (
                            (lambda: fwd(0.0, None)) if mode == "fwd" else (lambda: bwd(0.0, None))
                        )
                        variants = {
                            "sm80": ("sm80", fn),
                            "sm90": ("sm90", fn),
                            "sm90_plain": ("sm90", plain),
                        }
                        if sdpa_fn is not None:
                            variants["sdpa"] = (None, sdpa_fn)
                        times = {name: [] for name in variants}
                        for name, (kernel, f) in variants.items():
                            if kernel:
                                os.environ[env] = kernel
                            for _ in range(3):
                                f()
                        torch.cuda.synchronize()
                        os.environ[env] = "sm90"
                        one = time_us(fn, 3)
                        iters = max(5, min(200, int(30000 / max(one, 1))))
                        for round_ in range(3):
                            order = list(variants.items())
                            order = order[round_ % len(order) :] + order[: round_ % len(order)]
                            for name, (kernel, f) in order:
                                if kernel:
                                    os.environ[env] = kernel
                                times[name].append(time_us(f, iters))
                        os.environ.pop(env)
                        med = {name: sorted(t)[1] for name, t in times.items()}
                        flops_mode = flops * (2.5 if mode == "bwd" else 1.0)
                        row = dict(
                            device=device,
                            head_dim=head_dim,
                            causal=causal,
                            seqlen=seqlen,
                            batch=batch,
                            nheads=nheads,
                            mods=mods,
                            mode=mode,
                            us=med,
                            us_rounds=times,
                            tflops_sm90=flops_mode / med["sm90"] / 1e6,
                        )
                        rows.append(row)
                        sdpa = f"{med['sdpa']:.1f}" if "sdpa" in med else "-"
                        print(
                            f"{head_dim} {int(causal)} {seqlen} {mods} {mode} | "
                            f"{med['sm80']:.1f} | {med['sm90']:.1f} | {med['sm90_plain']:.1f} | "
                            f"{sdpa} | {med['sm80'] / med['sm90']:.2f} | "
                            f"{row['tflops_sm90']:.1f}",
                            flush=True,
                        )
            del q, k, v, dout
    result = dict(device=device, torch=torch.__version__, cuda=torch.version.cuda, rows=rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        plot(result, args.plot)
    sm80_over_sm90 = [r["us"]["sm80"] / r["us"]["sm90"] for r in rows]
    geo = math.exp(sum(map(math.log, sm80_over_sm90)) / len(sm80_over_sm90))
    print(
        f"sm80 / sm90 time: geomean {geo:.2f}, min {min(sm80_over_sm90):.2f}, "
        f"max {max(sm80_over_sm90):.2f}"
    )


if __name__ == "__main__":
    main()
