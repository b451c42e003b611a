"""vLLM's decode call against flash_attn_with_kvcache on the same paged cache.

vLLM decodes through ``flash_attn_varlen_func`` (one query row per sequence,
``seqused_k``, ``block_table``, no ``cu_seqlens_k``); our KV-cache benchmarks time
``flash_attn_with_kvcache``. Both run the split-KV kernel on the same pages, so the
difference is what the varlen op adds per call (its index-check pass over the
lengths and table, docs/memory_safety.md). Times in microseconds, CUDA events, L2
flushed before every call (event_timing.median_us), median of 50; "b2b" is the
mean over 200 back-to-back calls, launch gaps included. Where a call's host time (b2b)
exceeds the flush kernel's GPU time, the event time includes host time: the batch-1 rows
are then host-bound and only comparable between runs whose kvcache b2b agree. "graph" is the
mean over 200 back-to-back replays of a CUDA graph of 10 calls (vLLM captures its decode
steps), which leaves the host out: the GPU's own time per call, its kernels' launch gaps
included, without the flush.

    python benchmarks/microbench/varlen_paged_decode.py
"""

import torch
from event_timing import median_us, setup

from flash_attn_cuda import flash_attn_varlen_func, flash_attn_with_kvcache

DEVICE = "cuda"
NHEADS, NHEADS_K, HEAD_DIM = 32, 8, 128
SHAPES = [(1, 4096), (1, 8192), (1, 32768), (16, 8192), (64, 4096)]
PAGE_SIZES = (16, 256)


def back_to_back_us(fn, calls=200):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def graph_us(fn, calls=10, replays=200):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # the first call of a process stays outside capture (docs/serving.md)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return back_to_back_us(graph.replay, replays) / calls


def main():
    _, flush = setup(__doc__)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(
        "batch  keys  page  kvcache_us  varlen_us  varlen/kvcache  kvcache_b2b  varlen_b2b"
        "  kvcache_graph  varlen_graph"
    )
    for batch, seqlen_k in SHAPES:
        q = torch.randn(batch, 1, NHEADS, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
        seqlens = torch.full((batch,), seqlen_k, dtype=torch.int32, device=DEVICE)
        cu_q = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)
        for page_size in PAGE_SIZES:
            pages_per_seq = seqlen_k // page_size
            num_pages = batch * pages_per_seq
            k_cache = torch.randn(
                num_pages, page_size, NHEADS_K, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16
            )
            v_cache = torch.randn_like(k_cache)
            table = (
                torch.randperm(num_pages, device=DEVICE).to(torch.int32).view(batch, pages_per_seq)
            )

            def kvcache():
                return flash_attn_with_kvcache(
                    q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table, causal=True
                )

            def varlen():
                return flash_attn_varlen_func(
                    q.view(batch, NHEADS, HEAD_DIM),
                    k_cache,
                    v_cache,
                    cu_q,
                    None,
                    1,
                    seqlen_k,
                    causal=True,
                    seqused_k=seqlens,
                    block_table=table,
                )

            ref = kvcache().view(batch, NHEADS, HEAD_DIM)
            got = varlen()
            # The two ops may split the keys differently: equal to rounding.
            torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)
            t_kv, t_vl = median_us(kvcache, flush), median_us(varlen, flush)
            b_kv, b_vl = back_to_back_us(kvcache), back_to_back_us(varlen)
            g_kv, g_vl = graph_us(kvcache), graph_us(varlen)
            print(
                f"{batch:5d} {seqlen_k:5d} {page_size:5d} {t_kv:11.1f} {t_vl:10.1f} "
                f"{t_vl / t_kv:15.3f} {b_kv:12.1f} {b_vl:11.1f} {g_kv:14.1f} {g_vl:13.1f}"
            )
            del k_cache, v_cache


if __name__ == "__main__":
    main()
