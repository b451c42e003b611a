"""SDPA on the same memory as flash_attn_with_kvcache.

benchmark_attention.py hands SDPA a contiguous head-major (b, hk, s, d) copy of
the K/V cache. A user holding flash-attn's (b, s, hk, d) cache would pass SDPA
its transposed view instead. This times, in one process, for the decode shape
of the benchmark (seqlen_q 1, GQA 32:8, d128, bf16):
  ours        flash_attn_with_kvcache on the (b, s, hk, d) cache
  X_view      SDPA backend X on the (b, hk, s, d) view of that cache
  X_hm        SDPA backend X on a contiguous head-major copy
and prints max |SDPA - ours| on the view (X_view_err).

  python benchmarks/microbench/decode_sdpa_view.py
"""

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import flash_attn_cuda as fa

CELLS = [
    (1, 32768),
    (4, 65536),
    (16, 4096),
    (16, 16384),
    (16, 65536),
    (16, 131072),
    (64, 4096),
    (64, 32768),
]
BACKENDS = [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)]


def time_us(fn):
    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def main():
    torch.manual_seed(0)
    d, h, hk = 128, 32, 8
    print(torch.cuda.get_device_name())
    for b, sk in CELLS:
        q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16)
        k_cache = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        cache_seqlens = torch.full((b,), sk, dtype=torch.int32, device="cuda")

        def ours():
            return fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens)

        result = {"ours": time_us(ours)}
        q_heads = q.transpose(1, 2)
        k_view, v_view = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
        for name, backend in BACKENDS:
            with sdpa_kernel(backend):

                def sdpa_view():
                    return F.scaled_dot_product_attention(q_heads, k_view, v_view, enable_gqa=True)

                err = (sdpa_view().transpose(1, 2).float() - ours().float()).abs().max().item()
                result[f"{name}_view_err"] = err
                result[f"{name}_view"] = time_us(sdpa_view)
        q_copy = q_heads.contiguous()
        k_copy, v_copy = k_view.contiguous(), v_view.contiguous()
        for name, backend in BACKENDS:
            with sdpa_kernel(backend):
                result[f"{name}_hm"] = time_us(
                    lambda: F.scaled_dot_product_attention(q_copy, k_copy, v_copy, enable_gqa=True)
                )
        print(
            f"b{b}/{sk // 1024}k "
            + " ".join(
                f"{key}={value}" if key.endswith("err") else f"{key}={value:.1f}"
                for key, value in result.items()
            ),
            flush=True,
        )
        del k_cache, v_cache, k_copy, v_copy, k_view, v_view
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
