"""Decode time against the split count: flash_attn_with_kvcache with explicit
num_splits beside the default (num_splits=0), and SDPA's cuDNN backend on a
head-major copy of the same cache as the anchor, in one process.

Seqlen_q 1, GQA 32:8, head dim 128, bf16, contiguous cache. Each line is two
rounds; each entry the median time in microseconds and, in brackets, cuDNN's
time / ours. It answers whether a split count that fills every SM (33 splits
of 128 or 512 (batch, kv head) items give whole waves on 132 SMs) beats the
default's partly empty last wave.

    python benchmarks/microbench/decode_split_sweep.py     (after building the package)
"""

import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import flash_attn_cuda

CASES = [  # batch, seqlen_k, split counts (0: the default)
    (16, 131072, [0, 2, 4, 8, 33, 66]),
    (16, 65536, [0, 33]),
    (16, 16384, [0, 33]),
    (4, 131072, [0, 33, 66]),
    (64, 131072, [0, 33]),
    (64, 16384, [0, 33]),
    (64, 4096, [0, 33]),
]


def median_us(fn):
    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def main():
    torch.manual_seed(0)
    dev = "cuda"
    for batch, seqlen_k, splits in CASES:
        q = torch.randn(batch, 1, 32, 128, device=dev, dtype=torch.bfloat16)
        k = torch.randn(batch, seqlen_k, 8, 128, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        seqlens = torch.full((batch,), seqlen_k, dtype=torch.int32, device=dev)
        q_hm, k_hm, v_hm = (t.transpose(1, 2).contiguous() for t in (q, k, v))

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q_hm, k_hm, v_hm, enable_gqa=True)

        line = []
        for _ in range(2):
            t_ref = median_us(cudnn)
            line.append(f"cudnn {t_ref:.1f}")
            for s in splits:
                t = median_us(lambda: flash_attn_cuda.flash_attn_with_kvcache(
                    q, k, v, cache_seqlens=seqlens, num_splits=s))
                line.append(f"s{s} {t:.1f} ({t_ref / t:.3f})")
        print(f"b{batch} sk{seqlen_k // 1024}k: " + " | ".join(line), flush=True)
        del q, k, v, q_hm, k_hm, v_hm
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        time.sleep(0.5)  # the GPU streams slower for a while after large releases (PERF_LOG)


if __name__ == "__main__":
    main()
