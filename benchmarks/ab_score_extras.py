"""Same-run A/B of the score-extras kernels (softcap, ALiBi) of two builds on one GPU.

benchmark_attention.py times the plain score rule only; this script times what it leaves
out: the SM80-design forward and backward with softcap or ALiBi (FLASH_ATTN_FWD_KERNEL /
FLASH_ATTN_BWD_KERNEL=sm80 force them on Hopper) and split-KV decode with either. The two
source trees, each built in place, run in alternating processes (A B A B ...); every case's
time is the median of its rounds, each round's the median of CUDA-event times.

    python3 benchmarks/ab_score_extras.py --a /path/to/base --b /path/to/new --rounds 3

Event times bracket the host call too, so a decode case of a few microseconds of kernel
time measures the per-call host path as well (PERF_LOG 2026-11-28).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import subprocess
import sys


def median_ms(fn, iters: int) -> float:
    import torch

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def fwd_and_grad(fwd, inputs, grad) -> None:
    import torch

    torch.autograd.grad(fwd(), inputs, grad)


def time_tree(tree: str) -> dict[str, float]:
    """Times every case with the flash_attn_cuda of `tree` (run in a process of its own)."""
    sys.path.insert(0, tree)
    os.environ["FLASH_ATTN_FWD_KERNEL"] = "sm80"
    os.environ["FLASH_ATTN_BWD_KERNEL"] = "sm80"
    import torch

    import flash_attn_cuda as fa

    if not os.path.abspath(fa.__file__).startswith(os.path.abspath(tree)):
        raise SystemExit(f"imported {fa.__file__}, not the tree {tree}")
    torch.manual_seed(0)
    dev, dtype = "cuda", torch.bfloat16
    results = {}
    # Training: (batch 2, seqlen 4096, 16 heads, d128).
    for causal in (False, True):
        for feature in ("softcap", "alibi"):
            q, k, v = (
                torch.randn(2, 4096, 16, 128, device=dev, dtype=dtype, requires_grad=True)
                for _ in range(3)
            )
            kw = {"causal": causal}
            if feature == "softcap":
                kw["softcap"] = 30.0
            else:
                kw["alibi_slopes"] = torch.rand(16, device=dev) * 0.1
            fwd = functools.partial(fa.flash_attn_func, q, k, v, **kw)
            fwd_bwd = functools.partial(fwd_and_grad, fwd, (q, k, v), torch.randn_like(q))
            results[f"fwd {feature} causal={causal}"] = median_ms(fwd, 30)
            results[f"fwd+bwd {feature} causal={causal}"] = median_ms(fwd_bwd, 30)
    # Decode: one query row, 32:8 heads, d128.
    for batch, keys in ((1, 8192), (4, 16384), (16, 8192)):
        q = torch.randn(batch, 1, 32, 128, device=dev, dtype=dtype)
        k_cache = torch.randn(batch, keys, 8, 128, device=dev, dtype=dtype)
        v_cache = torch.randn_like(k_cache)
        seqlens = torch.full((batch,), keys, device=dev, dtype=torch.int32)
        slopes = torch.rand(32, device=dev) * 0.1
        for feature, kw in (("softcap", {"softcap": 30.0}), ("alibi", {"alibi_slopes": slopes})):
            step = functools.partial(
                fa.flash_attn_with_kvcache, q, k_cache, v_cache, cache_seqlens=seqlens, **kw
            )
            results[f"decode {feature} b{batch} sk{keys}"] = median_ms(step, 100)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", help="base source tree, built in place")
    parser.add_argument("--b", help="new source tree, built in place")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # one process: time one tree
    args = parser.parse_args()
    if args.one:
        print(json.dumps(time_tree(args.one)))
        return
    if not (args.a and args.b):
        parser.error("--a and --b are required")
    runs: dict[str, list[dict]] = {"A": [], "B": []}
    for _ in range(args.rounds):
        for name, tree in (("A", args.a), ("B", args.b)):
            out = subprocess.run(
                [sys.executable, __file__, "--one", tree],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            runs[name].append(json.loads(out.strip().splitlines()[-1]))
    ratios = []
    print(f"{'case':40s} {'A ms':>9s} {'B ms':>9s}  B/A")
    for case in runs["A"][0]:
        a = statistics.median(r[case] for r in runs["A"])
        b = statistics.median(r[case] for r in runs["B"])
        ratios.append(b / a)
        print(f"{case:40s} {a:9.4f} {b:9.4f}  {b / a:.3f}")
    geomean = math.exp(sum(map(math.log, ratios)) / len(ratios))
    print(f"geomean B/A {geomean:.4f}  min {min(ratios):.3f} max {max(ratios):.3f}")


if __name__ == "__main__":
    main()
