#!/usr/bin/env python3
"""One training cell, every provider in one process, framed for a profiler.

    ncu --profile-from-start off --set full -o cell \\
        python3 benchmarks/profile_cell.py --headdim 128 --seqlen 8192 --causal --mode bwd

Builds the benchmark's inputs for each provider (ours, FA4 where ``flash_attn.cute``
imports, cuDNN through SDPA; ``--providers`` picks), checks each against SDPA, warms it
up outside the profiled range (FA4 compiles its kernels there), then runs ``--iters``
calls of each inside ``cudaProfilerStart`` / ``cudaProfilerStop`` with one NVTX range
per provider (``<provider>/<mode>``), so that ncu and nsys see only those calls and can
tell whose kernels they are (``--nvtx --nvtx-include "fa4/bwd/"``). The shape is the
benchmark's training grid cell: batch x seqlen = ``--tokens``, heads = hidden / d.
Without ncu it prints the event time of each provider, a quick cross-check that the
profiled calls are the benchmark's. PERF_LOG's issue-53 design table is what it serves.

``--paged-prefill BxQxK`` frames the benchmark's paged_prefill calls instead (our
``flash_attn_varlen_func`` forward, causal, ``--gqa`` query heads per key head): the
contiguous call and one per ``--page-sizes`` entry, NVTX ranges ``contiguous/fwd`` and
``paged<N>/fwd``, so that ncu can set the paged kernel beside the contiguous one.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import benchmark_attention as bench  # noqa: E402

MODES = ("fwd", "bwd", "fwd_bwd")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--tokens", type=int, default=16384, help="batch x seqlen")
    parser.add_argument("--hidden", type=int, default=2048, help="heads = hidden / headdim")
    parser.add_argument("--gqa", type=int, default=1, help="query heads per key head")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--mode", choices=MODES, default="bwd")
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument(
        "--providers",
        default="ours,fa4,cudnn",
        help="comma list of ours, ours_dropout (dropout_p as the benchmark's dropout "
        "provider), fa4, cudnn (a missing FA4 is reported and skipped)",
    )
    parser.add_argument(
        "--paged-prefill",
        default=None,
        metavar="BxQxK",
        help="frame the paged_prefill regime's calls (batch x q_chunk x context) instead",
    )
    parser.add_argument(
        "--page-sizes", default="1,16,64,256", help="with --paged-prefill: comma list"
    )
    parser.add_argument("--iters", type=int, default=1, help="profiled calls per provider")
    parser.add_argument("--warmup", type=int, default=5)
    return parser.parse_args(argv)


def provider_names(args: argparse.Namespace) -> dict:
    """Short name -> the benchmark's provider name."""
    ours = bench.OURS_DETERMINISTIC if args.deterministic else bench.OURS
    fa4 = bench.FA4_DETERMINISTIC if args.deterministic else bench.FA4
    known = {"ours": ours, "ours_dropout": bench.OURS_DROPOUT, "fa4": fa4, "cudnn": "sdpa_cudnn"}
    names = [p.strip() for p in args.providers.split(",") if p.strip()]
    unknown = [p for p in names if p not in known]
    if unknown:
        raise SystemExit(f"--providers: unknown {unknown}; choose from {sorted(known)}")
    return {p: known[p] for p in names}


def cell_shape(args: argparse.Namespace) -> bench.Shape:
    if args.hidden % args.headdim or args.tokens % args.seqlen:
        raise SystemExit("--hidden must be a multiple of --headdim, --tokens of --seqlen")
    nheads = args.hidden // args.headdim
    if nheads % args.gqa:
        raise SystemExit(f"--gqa {args.gqa} does not divide {nheads} heads")
    return bench.Shape(
        dtype=args.dtype,
        batch=args.tokens // args.seqlen,
        seqlen_q=args.seqlen,
        seqlen_k=args.seqlen,
        nheads=nheads,
        nheads_k=nheads // args.gqa,
        headdim=args.headdim,
        causal=args.causal,
    )


def train_cases(args: argparse.Namespace, shape: bench.Shape, device: torch.device):
    """(short name, Prepared or None where unavailable) per provider."""
    for short, provider in provider_names(args).items():
        try:
            yield short, bench.build_train(provider, shape, device, with_grad=args.mode != "fwd")
        except bench.Unavailable as exc:
            print(f"  {short}: unavailable ({exc})", flush=True)
            yield short, None


def step(prepared: bench.Prepared, mode: str):
    """One call of the mode; the backward's forward runs outside it when mode is bwd."""
    if mode == "fwd":
        return prepared.forward  # inputs built without requires_grad
    out = prepared.forward()
    grad = torch.randn_like(out)
    inputs = prepared.grad_inputs
    if mode == "bwd":
        return lambda: torch.autograd.grad(out, inputs, grad, retain_graph=True)
    return lambda: torch.autograd.grad(prepared.forward(), inputs, grad)


def paged_prefill_shape(args: argparse.Namespace):
    """The paged_prefill shape of --paged-prefill BxQxK (causal, --gqa query heads per
    key head) and the page sizes of --page-sizes, the contiguous call (None) first."""
    try:
        batch, q_chunk, context = (int(x) for x in args.paged_prefill.lower().split("x"))
        sizes = [None] + [int(s) for s in args.page_sizes.split(",") if s.strip()]
    except ValueError as exc:
        raise SystemExit(
            f"--paged-prefill {args.paged_prefill!r} / --page-sizes {args.page_sizes!r}: "
            "want BxQxK (e.g. 2x4096x4096) and a comma list of page sizes"
        ) from exc
    nheads = args.hidden // args.headdim
    if args.hidden % args.headdim or nheads % args.gqa:
        raise SystemExit("--hidden must be a multiple of --headdim, heads of --gqa")
    shape = bench.Shape(
        dtype=args.dtype,
        batch=batch,
        seqlen_q=q_chunk,
        seqlen_k=context,
        nheads=nheads,
        nheads_k=nheads // args.gqa,
        headdim=args.headdim,
        causal=True,
    )
    return shape, sizes


def paged_prefill_cases(args: argparse.Namespace, device: torch.device):
    """(name, Prepared) of the contiguous call and each page size, one shared input set."""
    shape, sizes = paged_prefill_shape(args)
    print(f"profile_cell: paged_prefill {shape}", flush=True)
    inputs: dict = {}
    for size in sizes:
        name = "contiguous" if size is None else f"paged{size}"
        yield name, bench.build_paged_prefill(shape, size, inputs, device, check=size is not None)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_cell: needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    if args.paged_prefill:
        args.mode = "fwd"
        cases = paged_prefill_cases(args, device)
    else:
        shape = cell_shape(args)
        print(f"profile_cell: {shape}, mode {args.mode}", flush=True)
        cases = train_cases(args, shape, device)
    runs = []
    for short, prepared in cases:
        if prepared is None:
            continue
        with prepared.context():
            call = step(prepared, args.mode)
            for _ in range(args.warmup):
                call()
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            stop = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                call()
            stop.record()
            torch.cuda.synchronize()
        print(f"  {short}: {start.elapsed_time(stop) / 10:.3f} ms per call", flush=True)
        runs.append((short, prepared, call))
    torch.cuda.cudart().cudaProfilerStart()
    for short, prepared, call in runs:
        with prepared.context(), torch.cuda.nvtx.range(f"{short}/{args.mode}"):
            for _ in range(args.iters):
                call()
        torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"profile_cell: profiled {[r[0] for r in runs]}", flush=True)
    return 0 if runs else 1


if __name__ == "__main__":
    sys.exit(main())
