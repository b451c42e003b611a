"""Absorbed MLA decode with V read in the K tile against V loaded, in one
process: flash_attn_with_kvcache with v_cache the view k_cache[..., :512]
(the kernel reads V in the K tile, splitkv_reads_v_in_k) and with v_cache a
contiguous copy of the same values (the kernel loads V as a tile of its own).

Seqlen_q 1, 128 query heads over one latent head of 576 columns, bf16, batch
1 / 16 / 64 at 4k and 32k keys, contiguous and in pages of 64 rows. Each time
is the median of 50 calls (CUDA events, a 256 MB buffer written before each
call), the faster of two rounds; TFLOP/s count 2 x 128 x keys x (576 + 512)
per batch entry, and the share of copy bandwidth counts each latent row once
against --copy-gbs. The split counts are the plan's for each call, so the two
outputs may differ by rounding; tests/test_head_dims_qk_v.py compares them
bit for bit at a fixed split count.

    python benchmarks/microbench/mla_v_in_k.py [--copy-gbs 4221]   (after building the package)
"""

import torch
from event_timing import best_us, setup

from flash_attn_cuda import flash_attn_with_kvcache


def main():
    args, flush = setup(__doc__)
    print("batch  keys  page  view_us  copy_us  view/copy  view_TFLOP/s  view_%copy")
    for batch, keys in [(1, 4096), (1, 32768), (16, 4096), (16, 32768), (64, 4096), (64, 32768)]:
        for page in (None, 64):
            q = torch.randn(batch, 1, 128, 576, device="cuda", dtype=torch.bfloat16)
            table = None
            if page is None:
                k_cache = torch.randn(batch, keys, 1, 576, device="cuda", dtype=torch.bfloat16)
            else:
                pages = batch * keys // page
                k_cache = torch.randn(pages, page, 1, 576, device="cuda", dtype=torch.bfloat16)
                table = torch.randperm(pages, device="cuda", dtype=torch.int32).view(batch, -1)
            seqlens = torch.full((batch,), keys, dtype=torch.int32, device="cuda")
            v_view = k_cache[..., :512]
            v_copy = v_view.contiguous()

            def call(v_cache, k_cache=k_cache, q=q, seqlens=seqlens, table=table):
                return flash_attn_with_kvcache(
                    q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table
                )

            t_view = best_us(lambda: call(v_view), flush)
            t_copy = best_us(lambda: call(v_copy), flush)
            flops = 2 * batch * 128 * keys * (576 + 512)
            share = 100 * batch * keys * 576 * 2 / (t_view * 1e3) / args.copy_gbs
            print(
                f"{batch:5d} {keys:5d} {page or '-':>5} {t_view:8.1f} {t_copy:8.1f} "
                f"{t_view / t_copy:10.3f} {flops / t_view / 1e6:13.1f} {share:11.1f}"
            )
            del k_cache, v_copy


if __name__ == "__main__":
    main()
