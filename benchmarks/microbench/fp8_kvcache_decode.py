"""Decode over an FP8 (float8_e4m3fn) KV cache against the same step over a
bfloat16 cache, in one process (issue 58 item 2: at most 0.6x the time at
batch 16, 32k keys, d128).

flash_attn_with_kvcache, seqlen_q 1, GQA 32:8, head dim 128, bf16 q, batch 1 /
16 / 64 at 8k and 32k keys, contiguous and in pages of 16 rows; the e4m3
cache holds the bf16 cache's values quantised with per-(batch, kv head)
descales. Each time is the median of 50 calls (CUDA events, a 256 MB buffer
written before each call), the faster of two rounds. The share of copy
bandwidth counts the cache bytes read once against --copy-gbs; max|diff| is
the largest difference between the two outputs (the quantisation's, not the
kernel's: tests/test_cuda_fp8_kvcache.py checks the FP8 result against
float64).

--q-dtype float16 runs q (and the 16-bit cache it is held against) in float16.
--cells picks (batch x keys) cells, --pages the page sizes ("-" contiguous),
--splits the num_splits values given to both calls (0: the plan's choice),
one row each.

    python benchmarks/microbench/fp8_kvcache_decode.py [--copy-gbs 4221] [--q-dtype float16]
        [--cells 1x8192,16x32768] [--pages=-,1,16,64,256] [--splits 0,16,32]
    (after building the package)
"""

import torch
from event_timing import best_us, setup

from flash_attn_cuda import flash_attn_with_kvcache


def main():
    def add_arguments(parser):
        parser.add_argument("--q-dtype", choices=["bfloat16", "float16"], default="bfloat16")
        parser.add_argument("--cells", default="1x8192,1x32768,16x8192,16x32768,64x8192,64x32768")
        parser.add_argument("--pages", default="-,16")
        parser.add_argument("--splits", default="0")

    args, flush = setup(__doc__, add_arguments)
    dtype = getattr(torch, args.q_dtype)
    nheads, nheads_k, d = 32, 8, 128
    name = {"bfloat16": "bf16", "float16": "fp16"}[args.q_dtype]
    cells = [tuple(int(x) for x in cell.split("x")) for cell in args.cells.split(",")]
    page_sizes = [None if p == "-" else int(p) for p in args.pages.split(",")]
    splits = [int(n) for n in args.splits.split(",")]
    print(f"batch   keys  page splits  {name}_us  fp8_us  fp8/{name}  fp8_%copy  max|diff|")
    for batch, keys in cells:
        for page in page_sizes:
            rows = (batch, keys) if page is None else (batch * keys // page, page)
            k16 = torch.randn(*rows, nheads_k, d, device="cuda", dtype=dtype)
            v16 = torch.randn(*rows, nheads_k, d, device="cuda", dtype=dtype)
            k_s = torch.rand(batch, nheads_k, device="cuda") * 0.02 + 0.01
            v_s = torch.rand(batch, nheads_k, device="cuda") * 0.02 + 0.01
            table = None
            if page is not None:
                pages = rows[0]
                table = torch.randperm(pages, device="cuda", dtype=torch.int32).view(batch, -1)
                # Each page's rows take the descale of the batch entry that reads it.
                owner = torch.empty(pages, dtype=torch.long, device="cuda")
                owner[table.long().flatten()] = torch.arange(
                    batch, device="cuda"
                ).repeat_interleave(keys // page)
                ks, vs = k_s[owner][:, None, :, None], v_s[owner][:, None, :, None]
            else:
                ks, vs = k_s[:, None, :, None], v_s[:, None, :, None]
            k8 = (k16.float() / ks).clamp(-448, 448).to(torch.float8_e4m3fn)
            v8 = (v16.float() / vs).clamp(-448, 448).to(torch.float8_e4m3fn)
            q = torch.randn(batch, 1, nheads, d, device="cuda", dtype=dtype)
            seqlens = torch.full((batch,), keys, dtype=torch.int32, device="cuda")

            for n in splits:

                def bf16(q=q, k=k16, v=v16, s=seqlens, t=table, n=n):
                    return flash_attn_with_kvcache(
                        q, k, v, cache_seqlens=s, block_table=t, num_splits=n
                    )

                def fp8(q=q, k=k8, v=v8, s=seqlens, t=table, ks=k_s, vs=v_s, n=n):
                    return flash_attn_with_kvcache(
                        q, k, v, cache_seqlens=s, block_table=t, k_descale=ks, v_descale=vs,
                        num_splits=n,
                    )  # fmt: skip

                diff = (bf16().float() - fp8().float()).abs().max().item()
                t16 = best_us(bf16, flush)
                t8 = best_us(fp8, flush)
                share = 100 * 2 * batch * keys * nheads_k * d / (t8 * 1e3) / args.copy_gbs
                print(
                    f"{batch:5d} {keys:6d} {page or '-':>5} {n or 'plan':>6} {t16:8.1f} "
                    f"{t8:7.1f} {t8 / t16:9.3f} {share:10.1f} {diff:10.3g}"
                )
            del k16, v16, k8, v8


if __name__ == "__main__":
    main()
