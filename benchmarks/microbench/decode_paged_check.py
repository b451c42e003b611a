"""Decode with a paged KV cache against the contiguous cache on the same memory.

The paged caches here are views of the contiguous cache's storage
((batch * seqlen_k / page_size, page_size, nheads_k, headdim)), so with the
block table in order (`seq`) the kernel reads exactly the contiguous cache's
addresses and any difference is the cost of the paged code path; `rand`
scatters the pages. cuDNN (SDPA CUDNN_ATTENTION, on a (batch, heads, seqlen,
dim) copy of the same cache) is the anchor. Times in microseconds, CUDA events,
L2 flushed before every call, median of 30.

    python benchmarks/microbench/decode_paged_check.py
"""

import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flash_attn_cuda import flash_attn_with_kvcache

DEVICE = "cuda"
NHEADS, NHEADS_K, HEAD_DIM = 32, 8, 128
SHAPES = [(1, 65536), (4, 16384), (4, 65536), (16, 32768), (64, 16384), (64, 65536)]


def median_us(fn, flush, runs=30):
    fn()
    torch.cuda.synchronize()
    for _ in range(3):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    for i in range(runs):
        flush.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3


def main():
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device=DEVICE)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for batch, seqlen_k in SHAPES:
        q = torch.randn(batch, 1, NHEADS, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
        seqlens = torch.full((batch,), seqlen_k, dtype=torch.int32, device=DEVICE)
        k_cache = torch.randn(
            batch, seqlen_k, NHEADS_K, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16
        )
        v_cache = torch.randn_like(k_cache)
        times = {
            "contiguous": median_us(
                lambda: flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens), flush
            )
        }
        for page_size in (16, 256):
            num_pages = batch * seqlen_k // page_size
            k_pages = k_cache.view(num_pages, page_size, NHEADS_K, HEAD_DIM)
            v_pages = v_cache.view(num_pages, page_size, NHEADS_K, HEAD_DIM)
            for order, table in (
                ("seq", torch.arange(num_pages, device=DEVICE)),
                ("rand", torch.randperm(num_pages, device=DEVICE)),
            ):
                table = table.to(torch.int32).view(batch, -1)
                times[f"paged{page_size}_{order}"] = median_us(
                    lambda: flash_attn_with_kvcache(
                        q, k_pages, v_pages, cache_seqlens=seqlens, block_table=table
                    ),
                    flush,
                )
        q_bhsd = q.transpose(1, 2)
        k_bhsd = k_cache.transpose(1, 2).contiguous()
        v_bhsd = v_cache.transpose(1, 2).contiguous()
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            times["sdpa_cudnn"] = median_us(
                lambda: F.scaled_dot_product_attention(q_bhsd, k_bhsd, v_bhsd, enable_gqa=True),
                flush,
            )
        del k_bhsd, v_bhsd, k_cache, v_cache
        torch.cuda.empty_cache()
        print(
            f"batch {batch} seqlen_k {seqlen_k}: "
            + "  ".join(f"{name} {us:.1f}" for name, us in times.items()),
            flush=True,
        )


if __name__ == "__main__":
    main()
