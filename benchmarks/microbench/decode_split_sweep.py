"""Decode time against the split count and a few other call-side choices:
flash_attn_with_kvcache with explicit num_splits beside the default
(num_splits=0), and SDPA's cuDNN backend on a head-major copy of the same
cache as the anchor, in one process.

Seqlen_q 1, GQA 32:8, head dim 128, bf16, contiguous cache. Each line is two
rounds; each entry the median time in microseconds and, in brackets, cuDNN's
time / ours. By default it answers whether a split count that fills every SM
(33 splits of 128 or 512 (batch, kv head) items give whole waves on 132 SMs)
beats the default's partly empty last wave. Options:

  --cells 16x4096,64x4096   (batch x seqlen_k) cells instead of the default cases;
                            each then runs with --splits (default: 0)
  --seqlens-forms           also cache_seqlens=None and cache_seqlens=<int>
                            (what the per-batch lengths tensor costs)
  --head-major              also our kernel on a head-major (b, hk, s, d)
                            cache passed as a (b, s, hk, d) view: the layout
                            cuDNN is given

    python benchmarks/microbench/decode_split_sweep.py [options]   (after building the package)
"""

import argparse
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


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cells", default=None, help="comma list of BATCHxSEQLEN_K")
    p.add_argument("--splits", default="0", help="comma list of num_splits for --cells")
    p.add_argument("--seqlens-forms", action="store_true")
    p.add_argument("--head-major", action="store_true")
    args = p.parse_args()
    if args.cells:
        splits = [int(s) for s in args.splits.split(",")]
        args.cases = [
            (int(b), int(sk), splits)
            for b, sk in (cell.split("x") for cell in args.cells.split(","))
        ]
    else:
        args.cases = CASES
    return args


def main():
    args = parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    attn = flash_attn_cuda.flash_attn_with_kvcache
    for batch, seqlen_k, splits in args.cases:
        q = torch.randn(batch, 1, 32, 128, device=dev, dtype=torch.bfloat16)
        k = torch.randn(batch, seqlen_k, 8, 128, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        seqlens = torch.full((batch,), seqlen_k, dtype=torch.int32, device=dev)
        q_hm, k_hm, v_hm = (t.transpose(1, 2).contiguous() for t in (q, k, v))

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q_hm, k_hm, v_hm, enable_gqa=True)

        arms = [
            (f"s{s}", lambda s=s: attn(q, k, v, cache_seqlens=seqlens, num_splits=s))
            for s in splits
        ]
        if args.seqlens_forms:
            arms.append(("seqlens=None", lambda: attn(q, k, v)))
            arms.append(("seqlens=int", lambda: attn(q, k, v, cache_seqlens=seqlen_k)))
        if args.head_major:
            k_view, v_view = k_hm.transpose(1, 2), v_hm.transpose(1, 2)
            arms.append(("head-major", lambda: attn(q, k_view, v_view, cache_seqlens=seqlens)))
        line = []
        for _ in range(2):
            t_ref = median_us(cudnn)
            line.append(f"cudnn {t_ref:.1f}")
            for name, fn in arms:
                t = median_us(fn)
                line.append(f"{name} {t:.1f} ({t_ref / t:.3f})")
        print(f"b{batch} sk{seqlen_k // 1024}k: " + " | ".join(line), flush=True)
        del q, k, v, q_hm, k_hm, v_hm, arms
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        time.sleep(0.5)  # the GPU streams slower for a while after large releases (PERF_LOG)


if __name__ == "__main__":
    main()
