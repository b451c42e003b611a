"""Dropout on the Hopper kernels against the SM80-design kernels, in one process of one build.

Issue 57's measure is the time of a call with dropout over the same call without it. This
script times, for each training cell, three calls of one build in one process, each case's
variants one after the other in every round:

- `plain`: no dropout (the Hopper kernels);
- `sm90`: dropout (--dropout-p, default 0.1) on the kernels the plan picks (the Hopper kernels where they serve it);
- `sm80`: the same dropout with FLASH_ATTN_FWD_KERNEL / FLASH_ATTN_BWD_KERNEL=sm80, which the
  ops read on every call (csrc/cuda/ops/op_common.h), so the SM80-design kernels run.

    python3 benchmarks/ab_dropout_kernels.py --headdims 64,128,256 --rounds 3 --out FILE

The cells follow the training grid: hidden size 2048 (heads = 2048 / d), batch x seqlen = 16k,
bf16. A time is the median of CUDA-event times after warm-up, then the median over rounds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics

import torch
from ab_score_extras import median_ms

VARIANTS = ("plain", "sm90", "sm80")


def set_kernels(variant: str) -> None:
    for name in ("FLASH_ATTN_FWD_KERNEL", "FLASH_ATTN_BWD_KERNEL"):
        if variant == "sm80":
            os.environ[name] = "sm80"
        else:
            os.environ.pop(name, None)


def call(fa, q, k, v, grad, causal: bool, variant: str, mode: str, dropout_p: float):
    p = 0.0 if variant == "plain" else dropout_p

    def run():
        set_kernels(variant)
        out = fa.flash_attn_func(q, k, v, dropout_p=p, causal=causal)
        if mode == "fwd_bwd":
            torch.autograd.grad(out, (q, k, v), grad)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--headdims", default="64,128,256")
    parser.add_argument("--seqlens", default="1024,8192")
    parser.add_argument("--modes", default="fwd,fwd_bwd")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--dropout-p", type=float, default=0.1)
    parser.add_argument("--out", help="JSON file of every case's times")
    args = parser.parse_args()

    import flash_attn_cuda as fa

    torch.manual_seed(0)
    cases = []
    for d in map(int, args.headdims.split(",")):
        for seqlen in map(int, args.seqlens.split(",")):
            for causal in (False, True):
                for mode in args.modes.split(","):
                    cases.append((d, seqlen, causal, mode))
    times: dict[str, dict[str, list[float]]] = {}
    for _ in range(args.rounds):
        for d, seqlen, causal, mode in cases:
            batch, heads = 16384 // seqlen, 2048 // d
            shape = (batch, seqlen, heads, d)
            q, k, v = (
                torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                for _ in range(3)
            )
            grad = torch.randn_like(q)
            name = f"d{d} s{seqlen} {'causal' if causal else 'full'} {mode}"
            row = times.setdefault(name, {v: [] for v in VARIANTS})
            for variant in VARIANTS:
                row[variant].append(
                    median_ms(
                        call(fa, q, k, v, grad, causal, variant, mode, args.dropout_p), args.iters
                    )
                )
    set_kernels("plain")
    report = {}
    print(
        f"{'case':28s} {'plain ms':>9s} {'sm90 ms':>9s} {'sm80 ms':>9s}  sm90/plain sm80/plain sm90/sm80"
    )
    for name, row in times.items():
        t = {v: statistics.median(row[v]) for v in VARIANTS}
        report[name] = t
        print(
            f"{name:28s} {t['plain']:9.3f} {t['sm90']:9.3f} {t['sm80']:9.3f}"
            f"  {t['sm90'] / t['plain']:10.2f} {t['sm80'] / t['plain']:10.2f}"
            f" {t['sm90'] / t['sm80']:9.3f}"
        )
    for d in sorted({n.split()[0] for n in report}):
        ratios = [t["sm90"] / t["sm80"] for n, t in report.items() if n.startswith(d + " ")]
        geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
        print(f"{d}: sm90/sm80 geomean {geo:.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(),
                    "dropout_p": args.dropout_p,
                    "times_ms": report,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
