#!/usr/bin/env python3
"""Host cost per call of each flash_attn_cuda entry point, on tiny shapes.

    python benchmarks/host_overhead.py                 # the GPU if there is one, else CPU
    python benchmarks/host_overhead.py --device cpu    # the wrapper's cost on the CPU path
    python benchmarks/host_overhead.py --profile       # also: aten ops per call (torch.profiler)

A decode step is a few microseconds of kernel time, so the wall time of a call in a
loop of back-to-back calls is its host cost: Python argument handling, the op's
dispatch, its checks, allocations and launches. Each entry point is timed on a
decode-shaped call (one query row, batch --batch, --heads:--kv-heads heads of
--head-dim, --keys keys; the defaults are small so that on the CPU the kernels cost
little beside the wrapper), beside the raw op it ends in and torch's own SDPA:

  kvcache_op        torch.ops.flash_attn.fwd_kvcache, called directly (no wrapper)
  with_kvcache      flash_attn_with_kvcache(q, caches, k, v, cache_seqlens=tensor)
  with_kvcache_paged  the same over a paged cache (block_table)
  fwd_op            torch.ops.flash_attn.fwd, called directly
  func              flash_attn_func(q, k, v, causal=True)
  varlen_func       flash_attn_varlen_func on the same rows
  transformers      the attn_implementation="flash_attn_cuda" attention function
  sdpa_provider     aten::_scaled_dot_product_flash_attention through the provider's
                    override (on CPU: installed for the CPU key, as the tests do)
  sdpa_torch        F.scaled_dot_product_attention with torch's own kernels (on CUDA:
                    the FLASH backend)
  kvcache_graph     (CUDA) with_kvcache's step captured in a CUDA graph, replayed

--stub-ops measures the Python layer alone: each torch.ops.flash_attn op is replaced by
a stub that returns the result of its first call again (no checks, no kernels).

--profile adds, per call, the aten ops the call issued and which of them allocate,
fill or synchronise (aten::empty*, fill_ / zero_, copy_, item / _local_scalar_dense).
Writes host_overhead.json to --out (default benchmarks/out/<device>/host_overhead/).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import sys
import time
from collections import Counter

import torch
import torch.nn.functional as F

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)
from provenance import git_commit  # noqa: E402

# aten ops whose presence in a call is a per-call cost worth naming.
ALLOC_OPS = ("aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty")
FILL_OPS = ("aten::fill_", "aten::zero_", "aten::zeros", "aten::full", "aten::ones")
SYNC_OPS = ("aten::item", "aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--keys", type=int, default=32, help="cache rows in use before the step")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--calls", type=int, default=200, help="calls per timed round")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--entries", default=None, help="comma list (default: all that run here)")
    p.add_argument("--profile", action="store_true", help="count aten ops per call")
    p.add_argument(
        "--stub-ops",
        action="store_true",
        help="replace the flash_attn ops by stubs that return their first result again: "
        "the time left is the Python layer's own (and, for sdpa_provider, the dispatcher's)",
    )
    p.add_argument("--out", default=None)
    return p


class _Module(torch.nn.Module):
    is_causal = True


def make_entries(args, device):
    """name -> zero-argument callable doing one call, or the reason it cannot run here."""
    import flash_attn_cuda
    from flash_attn_cuda.integrations import sdpa
    from flash_attn_cuda.integrations import transformers as fa_transformers

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    b, h, hk, d, s = args.batch, args.heads, args.kv_heads, args.head_dim, args.keys
    capacity = s + args.calls * args.rounds + 64  # the appends of every timed call fit
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    q = rand(b, 1, h, d)
    k_new, v_new = rand(b, 1, hk, d), rand(b, 1, hk, d)
    k_cache, v_cache = rand(b, capacity, hk, d), rand(b, capacity, hk, d)
    # The appends advance nothing: every call writes row s again, so that every
    # call is the same call (the caches' contents are not what is measured).
    seqlens = torch.full((b,), s, dtype=torch.int32, device=device)
    pages_per_seq = -(-capacity // args.page_size)
    k_paged = rand(b * pages_per_seq, args.page_size, hk, d)
    v_paged = rand(b * pages_per_seq, args.page_size, hk, d)
    block_table = torch.arange(b * pages_per_seq, dtype=torch.int32, device=device).view(b, -1)
    k, v = k_cache[:, : s + 1], v_cache[:, : s + 1]
    scale = d**-0.5

    entries = {}
    entries["kvcache_op"] = lambda: torch.ops.flash_attn.fwd_kvcache(
        q,
        k_cache,
        v_cache,
        k_new,
        v_new,
        seqlens,
        None,
        None,
        None,
        None,
        None,
        None,
        scale,
        True,
        -1,
        0,
        0.0,
        True,
        0,
    )
    entries["with_kvcache"] = lambda: flash_attn_cuda.flash_attn_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, causal=True
    )
    entries["with_kvcache_paged"] = lambda: flash_attn_cuda.flash_attn_with_kvcache(
        q,
        k_paged,
        v_paged,
        k_new,
        v_new,
        cache_seqlens=seqlens,
        block_table=block_table,
        causal=True,
    )
    entries["fwd_op"] = lambda: torch.ops.flash_attn.fwd(
        q, k, v, None, 0.0, scale, True, -1, 0, 0.0, False, 0, 0, None
    )
    entries["func"] = lambda: flash_attn_cuda.flash_attn_func(q, k, v, causal=True)
    cu_q = torch.arange(b + 1, dtype=torch.int32, device=device)
    cu_k = cu_q * (s + 1)
    q_rows, k_rows, v_rows = q.reshape(b, h, d), k.reshape(-1, hk, d), v.reshape(-1, hk, d)
    entries["varlen_func"] = lambda: flash_attn_cuda.flash_attn_varlen_func(
        q_rows, k_rows, v_rows, cu_q, cu_k, 1, s + 1, causal=True
    )
    module = _Module()
    # transformers hands (batch, heads, seqlen, head_dim) views of its projections.
    q_t, k_t, v_t = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    # SDPA's rows take keys of every query head (a model without GQA, as the e2e
    # benchmark's): enable_gqa is not taken by every backend of every torch.
    k_s, v_s = (t.repeat_interleave(h // hk, dim=1) for t in (k_t, v_t))
    entries["transformers"] = lambda: fa_transformers.attention_forward(
        module, q_t, k_t, v_t, None, scaling=scale
    )
    provider_handle = None
    if device.type == "cuda":
        if sdpa.registry_available():

            def provider():
                return F.scaled_dot_product_attention(q_t, k_s, v_s)

            entries["sdpa_provider"] = provider
        else:
            entries["sdpa_provider"] = f"torch {torch.__version__} has no flash-attention registry"
    else:
        provider_handle = sdpa._install(("CPU",))
        entries["sdpa_provider"] = lambda: torch.ops.aten._scaled_dot_product_flash_attention(
            q_t, k_s, v_s
        )
    entries["sdpa_torch"] = lambda: F.scaled_dot_product_attention(q_t, k_s, v_s)
    if device.type == "cuda":
        entries["kvcache_graph"] = graph_entry(entries["with_kvcache"])
    else:
        entries["kvcache_graph"] = "CUDA graphs need a GPU"
    return entries, provider_handle


class StubbedOps:
    """Within the block, each torch.ops.flash_attn op returns its first result again,
    without running (every entry calls it with the same shapes)."""

    NAMES = ("fwd", "fwd_out", "varlen_fwd", "varlen_fwd_out", "fwd_kvcache", "fwd_kvcache_out")

    def __enter__(self):
        namespace = torch.ops.flash_attn
        self.saved = {name: getattr(namespace, name) for name in self.NAMES}
        for name, real in self.saved.items():
            setattr(namespace, name, self._stub(real))
        return self

    def __exit__(self, *exc):
        for name, real in self.saved.items():
            setattr(torch.ops.flash_attn, name, real)

    @staticmethod
    def _stub(real):
        # Every entry calls an op with the same shapes, so one result per op serves.
        results = []

        def stub(*args, **kwargs):
            if not results:
                results.append(real(*args, **kwargs))
            return results[0]

        return stub


def graph_entry(step):
    """A replay of `step` captured in a CUDA graph (after warm-up calls on a side stream)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def run_context(name, device):
    """What the call runs under: the provider active and SDPA's FLASH backend for the
    CUDA SDPA rows."""
    if device.type != "cuda" or name not in ("sdpa_provider", "sdpa_torch"):
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    stack = contextlib.ExitStack()
    if name == "sdpa_provider":
        from flash_attn_cuda.integrations.sdpa import PROVIDER_NAME

        torch.nn.attention.activate_flash_attention_impl(PROVIDER_NAME)
        stack.callback(torch.nn.attention.restore_flash_attention_impl)
    stack.enter_context(sdpa_kernel(SDPBackend.FLASH_ATTENTION))
    return stack


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn, device, calls, rounds):
    """Median over rounds of the wall time per call, in us, of `calls` back-to-back calls."""
    with torch.no_grad():
        for _ in range(10):
            fn()
        per_call = []
        for _ in range(rounds):
            sync(device)
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            sync(device)
            per_call.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(per_call), min(per_call)


def profile_call(fn, calls=20):
    """aten ops per call, by name, from torch.profiler over `calls` calls."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        fn()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(calls):
                fn()
    counts = Counter(e.name for e in prof.events() if e.name.startswith("aten::"))
    top = {name: n / calls for name, n in counts.items()}

    def total(names):
        return sum(v for k, v in top.items() if k in names)

    return dict(
        aten_ops=sum(top.values()),
        allocations=total(ALLOC_OPS),
        fills=total(FILL_OPS),
        syncs=total(SYNC_OPS),
        by_name=dict(sorted(top.items(), key=lambda kv: -kv[1])),
    )


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU is available")
    if device.type == "cpu":
        torch.set_num_threads(1)  # the wrapper's cost, not the thread pool's start-up
    entries, provider_handle = make_entries(args, device)
    wanted = args.entries.split(",") if args.entries else list(entries)
    unknown = set(wanted) - set(entries)
    if unknown:
        raise SystemExit(f"unknown --entries {sorted(unknown)}; choose from {list(entries)}")
    name = (
        re.sub(r"[^A-Za-z0-9._-]+", "_", torch.cuda.get_device_name(device))
        if device.type == "cuda"
        else "cpu"
    )
    out_dir = args.out or os.path.join(BENCH_DIR, "out", name, "host_overhead")
    rows = []
    print(f"device {name}, torch {torch.__version__}, commit {git_commit()}")
    print(f"{'entry':<20} {'us/call':>9} {'min':>9} {'aten ops':>9} {'allocs':>7} {'fills':>6}")
    if args.stub_ops:
        for entry in ("kvcache_op", "fwd_op", "kvcache_graph"):
            entries[entry] = "--stub-ops: no Python layer to measure"
    stubs = StubbedOps() if args.stub_ops else contextlib.nullcontext()
    try:
        stubs.__enter__()
        for entry in wanted:
            fn = entries[entry]
            if isinstance(fn, str):
                rows.append(dict(entry=entry, skipped=fn))
                print(f"{entry:<20} skipped: {fn}")
                continue
            with run_context(entry, device):
                median, best = time_calls(fn, device, args.calls, args.rounds)
                row = dict(entry=entry, us_per_call=median, us_per_call_min=best)
                if args.profile and entry != "kvcache_graph":
                    row["profile"] = profile_call(fn)
            rows.append(row)
            prof = row.get("profile", {})
            print(
                f"{entry:<20} {median:>9.2f} {best:>9.2f} {prof.get('aten_ops', ''):>9} "
                f"{prof.get('allocations', ''):>7} {prof.get('fills', ''):>6}"
            )
    finally:
        stubs.__exit__(None, None, None)
        if provider_handle is not None:
            provider_handle.remove()
    os.makedirs(out_dir, exist_ok=True)
    meta = dict(
        command=" ".join([os.path.basename(sys.executable)] + sys.argv),
        commit=git_commit(),
        device=name,
        torch=torch.__version__,
        shape=dict(
            batch=args.batch,
            heads=args.heads,
            kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            keys=args.keys,
            page_size=args.page_size,
        ),
        calls=args.calls,
        rounds=args.rounds,
        stub_ops=args.stub_ops,
    )
    path = os.path.join(out_dir, "host_overhead.json")
    with open(path, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
