#!/usr/bin/env python3
"""End to end: a small transformers Llama-style model on flash_attn_cuda vs PyTorch SDPA.

    python benchmarks/benchmark_e2e.py                       # GPU: 4 layers, hidden 2048, bf16
    python benchmarks/benchmark_e2e.py --device cpu --quick  # tiny CPU smoke run (CI)

Three ways of running the same random-init model (same weights, same inputs):

  sdpa_default     attn_implementation="sdpa", PyTorch's own choice of SDPA kernel
  sdpa_flash       attn_implementation="sdpa" with SDPA's FLASH backend selected
                   (sdpa_kernel(SDPBackend.FLASH_ATTENTION)): torch's built-in kernels
  sdpa_provider    the same with flash_attn_cuda's SDPA provider active
                   (torch.nn.attention.activate_flash_attention_impl(
                   "FLASH_ATTN_CUDA")), which replaces the FLASH backend's kernels;
                   SDPA's default choice may be another backend (cuDNN), so this
                   variant selects FLASH too. Both are skipped, with the reason,
                   off CUDA (the provider overrides CUDA kernels only)
  flash_attn_cuda  attn_implementation="flash_attn_cuda" (transformers integration)

For each sequence length: the time of a training step's forward + backward
(median over --iters, after --warmup), tokens/s, peak memory, and the largest
logit difference from sdpa_default. Then greedy generation with the dynamic cache:
tokens/s of decoding --gen-tokens new tokens after a --gen-prompt prompt.

Then the attention calls of that generation alone (regime decode_loop, --decode-loop):
--gen-tokens steps of --layers calls, one query row per sequence against a cache
that starts at --gen-prompt rows and grows by the step's row, with the model's
heads; us_per_call is the loop's time per attention call, where a short decode
call's host cost shows. host_us_per_call is the time the host takes to issue the
first --host-steps steps (few enough launches for the launch queue to take them
all), per call, without waiting for the GPU: near us_per_call, the loop is bound
by the host; well below it, by the GPU. Variants:

  sdpa_flash       torch's FLASH kernels through F.scaled_dot_product_attention on
                   the cache's first rows (the row appended by a slice copy)
  sdpa_provider    the same with flash_attn_cuda's SDPA provider active
  kvcache_eager    flash_attn_with_kvcache: append and attend in one call,
                   cache_seqlens on the device, advanced in place each step
  kvcache_graph    the same step (every layer's call and the advance) captured in
                   a CUDA graph once and replayed each step

Writes e2e.json (the command, the git commit, the device, versions, the config
and every row) to --out, default benchmarks/out/<device>/e2e/ (ignored by git).
With --profile, one more generate and decode loop per variant runs under
torch.profiler: its op table goes to profile_<regime>_<variant>.txt there, and the
row gets the launches, memsets, synchronisations, allocations and attention ops
per generated token (count and self CPU time).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import statistics
import sys
import time

import torch

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH_DIR)
if BENCH_DIR not in sys.path:  # also when imported from elsewhere (the tests)
    sys.path.insert(0, BENCH_DIR)
from provenance import git_commit  # noqa: E402

VARIANTS = ["sdpa_default", "sdpa_flash", "sdpa_provider", "flash_attn_cuda"]
DECODE_VARIANTS = ["sdpa_flash", "sdpa_provider", "kvcache_eager", "kvcache_graph"]
PROVIDER = "FLASH_ATTN_CUDA"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def sanitize(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "unknown"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument(
        "--quick", action="store_true", help="a tiny model and short sequences (CPU smoke test)"
    )
    p.add_argument(
        "--out", default=None, help="output folder (default benchmarks/out/<device>/e2e/)"
    )
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {VARIANTS}")
    p.add_argument("--seqlens", default=None, help="comma list (default 2048,4096,8192)")
    p.add_argument(
        "--tokens-per-batch",
        type=int,
        default=None,
        help="batch = max(1, this // seqlen) (default 16384)",
    )
    p.add_argument("--layers", type=int, default=None, help="default 4")
    p.add_argument("--hidden", type=int, default=None, help="default 2048")
    p.add_argument("--heads", type=int, default=None, help="default 16")
    p.add_argument("--kv-heads", type=int, default=None, help="default = --heads")
    p.add_argument("--vocab", type=int, default=None, help="default 32000")
    p.add_argument(
        "--dtype", default=None, choices=sorted(DTYPES), help="default bf16 on CUDA, fp32 on CPU"
    )
    p.add_argument("--warmup", type=int, default=None, help="untimed steps (default 2)")
    p.add_argument("--iters", type=int, default=None, help="timed steps (default 5)")
    p.add_argument("--gen-batch", type=int, default=None, help="default 8")
    p.add_argument("--gen-prompt", type=int, default=None, help="prompt length (default 512)")
    p.add_argument("--gen-tokens", type=int, default=None, help="new tokens (default 128)")
    p.add_argument(
        "--profile",
        action="store_true",
        help="also profile one more generate / decode loop per variant (torch.profiler): "
        "a table per variant in --out, and per-token counts of the calls that cost host "
        "time in the rows",
    )
    p.add_argument(
        "--host-steps",
        type=int,
        default=16,
        help="decode_loop steps whose issue time gives host_us_per_call (default 16)",
    )
    p.add_argument(
        "--decode-loop",
        default=",".join(DECODE_VARIANTS),
        help=f"comma list of {DECODE_VARIANTS} for the decode_loop regime ('' for none)",
    )
    return p


def resolve(args) -> torch.device:
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU is available")
    quick = args.quick
    defaults = dict(
        seqlens="32,64" if quick else "2048,4096,8192",
        tokens_per_batch=128 if quick else 16384,
        layers=2 if quick else 4,
        hidden=64 if quick else 2048,
        heads=4 if quick else 16,
        vocab=256 if quick else 32000,
        dtype="fp32" if device.type == "cpu" else "bf16",
        warmup=1 if quick else 2,
        iters=1 if quick else 5,
        gen_batch=2 if quick else 8,
        gen_prompt=16 if quick else 512,
        gen_tokens=4 if quick else 128,
    )
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.kv_heads is None:
        args.kv_heads = args.heads
    args.seqlens = [int(s) for s in str(args.seqlens).split(",") if s]
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown --variants {sorted(unknown)}; choose from {VARIANTS}")
    args.decode_loop = [v for v in args.decode_loop.split(",") if v]
    unknown = set(args.decode_loop) - set(DECODE_VARIANTS)
    if unknown:
        raise SystemExit(f"unknown --decode-loop {sorted(unknown)}; choose from {DECODE_VARIANTS}")
    if args.out is None:
        name = sanitize(torch.cuda.get_device_name(device)) if device.type == "cuda" else "cpu"
        args.out = os.path.join(BENCH_DIR, "out", name, "e2e")
    return device


# --------------------------------------------------------------------------- #
# Variants
# --------------------------------------------------------------------------- #


def provider_unavailable(device: torch.device):
    """Why the SDPA provider variant cannot run here, or None."""
    if device.type != "cuda":
        return "the SDPA provider overrides CUDA kernels only"
    attention = torch.nn.attention
    if not hasattr(attention, "activate_flash_attention_impl"):
        return f"torch {torch.__version__} has no flash-attention registry"
    try:
        import flash_attn_cuda.integrations.sdpa  # noqa: F401  (registers the provider)
    except Exception as exc:  # the module may not exist yet, or fail to import
        return f"flash_attn_cuda.integrations.sdpa unavailable: {type(exc).__name__}: {exc}"
    impls = getattr(attention, "list_flash_attention_impls", lambda: [PROVIDER])()
    if PROVIDER not in impls:
        return f"{PROVIDER} is not registered (registered: {impls})"
    return None


@contextlib.contextmanager
def variant_context(variant: str):
    if variant not in ("sdpa_flash", "sdpa_provider"):
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    attention = torch.nn.attention
    if variant == "sdpa_provider":
        attention.activate_flash_attention_impl(PROVIDER)
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            yield
    finally:
        if variant == "sdpa_provider":
            attention.restore_flash_attention_impl()


def attn_implementation(variant: str) -> str:
    return "flash_attn_cuda" if variant == "flash_attn_cuda" else "sdpa"


# --------------------------------------------------------------------------- #
# Measurements
# --------------------------------------------------------------------------- #


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, warmup, iters):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def issue_time(fn, device):
    """The host's time to return from fn, which only enqueues GPU work, with an
    idle GPU before it (median of three)."""
    times = []
    for _ in range(3):
        sync(device)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    sync(device)
    return statistics.median(times)


def peak_memory_reset(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return None


def build_model(args, device, dtype):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=int(args.hidden * 2.75),
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(max(args.seqlens), args.gen_prompt + args.gen_tokens),
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(
        config, attn_implementation="sdpa", dtype=dtype
    )
    return model.to(device)


def train_step_row(model, variant, seqlen, args, device, reference_logits):
    batch = max(1, args.tokens_per_batch // seqlen)
    gen = torch.Generator().manual_seed(seqlen)
    ids = torch.randint(2, args.vocab, (batch, seqlen), generator=gen).to(device)
    row = dict(regime="train_fwd_bwd", variant=variant, seqlen=seqlen, batch=batch)
    model.set_attn_implementation(attn_implementation(variant))
    model.train()

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    with variant_context(variant):
        peak_memory_reset(device)
        seconds = timed(step, device, args.warmup, args.iters)
        row["peak_mem_gib"] = peak_memory_gib(device)
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=ids[:1]).logits.float()
    row["ms"] = seconds * 1e3
    row["tokens_per_s"] = batch * seqlen / seconds
    if seqlen not in reference_logits:
        reference_logits[seqlen] = logits
    row["max_logit_diff_vs_first"] = (logits - reference_logits[seqlen]).abs().max().item()
    return row


def generation_row(model, variant, args, device, reference_tokens):
    import transformers

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(2, args.vocab, (args.gen_batch, args.gen_prompt), generator=gen).to(device)
    config = transformers.GenerationConfig(
        max_new_tokens=args.gen_tokens,
        min_new_tokens=args.gen_tokens,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    model.set_attn_implementation(attn_implementation(variant))
    model.eval()
    out = {}

    def run():
        with torch.no_grad():
            out["tokens"] = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config
            )

    profiled = {}
    with variant_context(variant):
        peak_memory_reset(device)
        seconds = timed(run, device, 1, max(1, min(args.iters, 3)))
        peak = peak_memory_gib(device)
        if args.profile:
            path = os.path.join(args.out, f"profile_generate_{variant}.txt")
            profiled = profile_run(run, device, path, args.gen_tokens)
    tokens = out["tokens"][:, args.gen_prompt :]
    if reference_tokens is None:
        reference_tokens = tokens
    same = (tokens == reference_tokens).float().mean().item()
    return dict(
        regime="generate",
        variant=variant,
        batch=args.gen_batch,
        prompt=args.gen_prompt,
        new_tokens=args.gen_tokens,
        ms=seconds * 1e3,
        tokens_per_s=args.gen_batch * args.gen_tokens / seconds,
        peak_mem_gib=peak,
        same_tokens_as_first=same,
        **profiled,
    ), reference_tokens


# Calls whose count per generated token tells where host time goes: launches,
# memsets, synchronisations and the attention ops of each path.
PROFILED_CALLS = (
    "cudaLaunchKernel",
    "cudaLaunchKernelExC",
    "cudaMemsetAsync",
    "cudaMemcpyAsync",
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaGetDriverEntryPointByVersion",
    "aten::_local_scalar_dense",
    "aten::empty",
    "aten::empty_strided",
    "aten::fill_",
    "aten::copy_",
    "aten::_scaled_dot_product_flash_attention",
    "flash_attn::fwd",
    "flash_attn::fwd_kvcache",
)


def profile_run(run, device, path, tokens):
    """One more run under torch.profiler: the table of its ops goes to `path`; returns
    the calls of PROFILED_CALLS per token (count and self CPU us)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    sync(device)
    with profile(activities=activities) as prof:
        run()
        sync(device)
    averages = prof.key_averages()
    with open(path, "w") as f:
        f.write(averages.table(sort_by="self_cpu_time_total", row_limit=40))
        if device.type == "cuda":
            f.write("\n")
            f.write(averages.table(sort_by="self_cuda_time_total", row_limit=25))
    per_token = {}
    for event in averages:
        if event.key in PROFILED_CALLS:
            per_token[event.key] = dict(
                count=event.count / tokens, self_cpu_us=event.self_cpu_time_total / tokens
            )
    return dict(profile_table=os.path.basename(path), per_token=per_token)


def decode_loop_unavailable(variant, device):
    """Why a decode_loop variant cannot run here, or None."""
    if variant == "sdpa_provider":
        return provider_unavailable(device)
    if variant == "sdpa_flash" and device.type != "cuda":
        return "SDPA's FLASH backend runs on CUDA only"
    if variant == "kvcache_graph" and device.type != "cuda":
        return "CUDA graphs need a GPU"
    return None


def decode_loop_row(variant, args, device, dtype):
    """The generation's attention calls alone: --gen-tokens steps of --layers calls."""
    import flash_attn_cuda

    batch, layers, steps = args.gen_batch, args.layers, args.gen_tokens
    heads, kv_heads, head_dim = args.heads, args.kv_heads, args.hidden // args.heads
    prompt, capacity = args.gen_prompt, args.gen_prompt + args.gen_tokens
    gen = torch.Generator().manual_seed(2)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    q = rand(batch, 1, heads, head_dim)
    k_new, v_new = rand(batch, 1, kv_heads, head_dim), rand(batch, 1, kv_heads, head_dim)
    if variant.startswith("sdpa"):
        # transformers' layout: (batch, kv_heads, rows, head_dim) caches.
        caches = [
            (rand(batch, kv_heads, capacity, head_dim), rand(batch, kv_heads, capacity, head_dim))
            for _ in range(layers)
        ]
        q_t, k_t, v_t = q.transpose(1, 2), k_new.transpose(1, 2), v_new.transpose(1, 2)
        gqa = heads != kv_heads

        def run(n_steps=steps):
            for pos in range(prompt, prompt + n_steps):
                for k_cache, v_cache in caches:
                    k_cache[:, :, pos : pos + 1].copy_(k_t)
                    v_cache[:, :, pos : pos + 1].copy_(v_t)
                    torch.nn.functional.scaled_dot_product_attention(
                        q_t, k_cache[:, :, : pos + 1], v_cache[:, :, : pos + 1], enable_gqa=gqa
                    )

    else:
        caches = [
            (rand(batch, capacity, kv_heads, head_dim), rand(batch, capacity, kv_heads, head_dim))
            for _ in range(layers)
        ]
        seqlens = torch.full((batch,), prompt, dtype=torch.int32, device=device)

        def step():
            for k_cache, v_cache in caches:
                flash_attn_cuda.flash_attn_with_kvcache(
                    q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, causal=True
                )
            seqlens.add_(1)

        if variant == "kvcache_graph":
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            step = graph.replay

        def run(n_steps=steps):
            seqlens.fill_(prompt)
            for _ in range(n_steps):
                step()

    profiled = {}
    with variant_context(variant), torch.no_grad():
        peak_memory_reset(device)
        seconds = timed(run, device, 1, max(1, min(args.iters, 3)))
        peak = peak_memory_gib(device)
        host_steps = max(1, min(steps, args.host_steps))
        host_seconds = issue_time(lambda: run(host_steps), device)
        if args.profile:
            path = os.path.join(args.out, f"profile_decode_loop_{variant}.txt")
            profiled = profile_run(run, device, path, steps)
    return dict(
        regime="decode_loop",
        variant=variant,
        batch=batch,
        prompt=prompt,
        new_tokens=steps,
        layers=layers,
        ms=seconds * 1e3,
        tokens_per_s=batch * steps / seconds,
        us_per_call=seconds / (steps * layers) * 1e6,
        host_us_per_call=host_seconds / (host_steps * layers) * 1e6,
        peak_mem_gib=peak,
        **profiled,
    )


def describe(device, args, dtype):
    import transformers

    import flash_attn_cuda

    meta = dict(
        command=" ".join([os.path.basename(sys.executable)] + sys.argv),
        commit=git_commit(),
        device=torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else (platform.processor() or platform.machine() or "cpu"),
        device_type=device.type,
        torch=torch.__version__,
        cuda=torch.version.cuda,
        transformers=transformers.__version__,
        flash_attn_cuda=flash_attn_cuda.__version__,
        time=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        model=dict(
            family="llama",
            layers=args.layers,
            hidden=args.hidden,
            heads=args.heads,
            kv_heads=args.kv_heads,
            head_dim=args.hidden // args.heads,
            vocab=args.vocab,
            dtype=str(dtype).replace("torch.", ""),
        ),
        tokens_per_batch=args.tokens_per_batch,
        warmup=args.warmup,
        iters=args.iters,
    )
    return meta


def print_table(rows):
    print(
        f"\n{'regime':<14} {'variant':<16} {'seq':>6} {'batch':>5} {'ms':>10} {'tok/s':>11} "
        f"{'mem GiB':>8}  note"
    )
    for r in rows:
        mem = "" if r.get("peak_mem_gib") is None else f"{r['peak_mem_gib']:.2f}"
        if r.get("skipped"):
            print(
                f"{r['regime']:<14} {r['variant']:<16} {'':>6} {'':>5} {'':>10} {'':>11} "
                f"{'':>8}  skipped: {r['skipped']}"
            )
            continue
        note = ""
        if "max_logit_diff_vs_first" in r:
            note = f"max |logit diff| vs first {r['max_logit_diff_vs_first']:.2e}"
        if "same_tokens_as_first" in r:
            note = f"same tokens as first {100 * r['same_tokens_as_first']:.0f}%"
        if "us_per_call" in r:
            note = f"{r['us_per_call']:.1f} us per attention call, host {r['host_us_per_call']:.1f}"
        seq = r.get("seqlen", r.get("prompt", ""))
        print(
            f"{r['regime']:<14} {r['variant']:<16} {seq:>6} {r['batch']:>5} {r['ms']:>10.2f} "
            f"{r['tokens_per_s']:>11.0f} {mem:>8}  {note}"
        )


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    device = resolve(args)
    try:
        import transformers  # noqa: F401
    except ImportError as exc:
        print(f"benchmark_e2e: needs transformers >= 5 (pip install transformers): {exc}")
        return 2
    from flash_attn_cuda.integrations import transformers as fa_transformers

    fa_transformers.register()
    dtype = DTYPES[args.dtype]
    os.makedirs(args.out, exist_ok=True)
    meta = describe(device, args, dtype)
    print(
        f"device: {meta['device']} ({device.type}); torch {meta['torch']}; "
        f"transformers {meta['transformers']}; commit {meta['commit']}",
        flush=True,
    )
    if device.type == "cpu":
        print("No GPU: these are CPU numbers of a tiny model, a smoke test only.", flush=True)

    skipped = {}
    if "sdpa_provider" in args.variants:
        reason = provider_unavailable(device)
        if reason:
            skipped["sdpa_provider"] = reason
    if "sdpa_flash" in args.variants and device.type != "cuda":
        skipped["sdpa_flash"] = "SDPA's FLASH backend runs on CUDA only"
    variants = [v for v in args.variants if v not in skipped]

    model = build_model(args, device, dtype)
    rows, failures = [], []
    for variant, reason in skipped.items():
        rows.append(dict(regime="all", variant=variant, skipped=reason))
    reference_logits = {}
    for seqlen in args.seqlens:
        for variant in variants:
            try:
                rows.append(train_step_row(model, variant, seqlen, args, device, reference_logits))
            except Exception as exc:  # a failure is a result too; keep measuring the rest
                failures.append(f"{variant} seq {seqlen}: {type(exc).__name__}: {exc}")
                rows.append(
                    dict(
                        regime="train_fwd_bwd", variant=variant, seqlen=seqlen, error=str(exc)[:500]
                    )
                )
            print(f"  train seq {seqlen} {variant}: done", flush=True)
    reference_tokens = None
    for variant in variants:
        try:
            row, reference_tokens = generation_row(model, variant, args, device, reference_tokens)
            rows.append(row)
        except Exception as exc:
            failures.append(f"{variant} generate: {type(exc).__name__}: {exc}")
            rows.append(dict(regime="generate", variant=variant, error=str(exc)[:500]))
        print(f"  generate {variant}: done", flush=True)

    for variant in args.decode_loop:
        reason = decode_loop_unavailable(variant, device)
        if reason:
            rows.append(dict(regime="decode_loop", variant=variant, skipped=reason))
            continue
        try:
            rows.append(decode_loop_row(variant, args, device, dtype))
        except Exception as exc:
            failures.append(f"{variant} decode_loop: {type(exc).__name__}: {exc}")
            rows.append(dict(regime="decode_loop", variant=variant, error=str(exc)[:500]))
        print(f"  decode_loop {variant}: done", flush=True)

    print_table([r for r in rows if "error" not in r])
    path = os.path.join(args.out, "e2e.json")
    with open(path, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"\n{len(rows)} rows written to {path}")
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
