"""Chunked prefill over an FP8 (float8_e4m3fn) KV cache against the same call
over a bfloat16 cache, in one process (issue 58 item 2, the paged varlen form).

flash_attn_varlen_func, causal, GQA 32:8, head dim 128, bf16 q: a chunk of
q_chunk new query rows per sequence against its context (the benchmark's
paged_prefill shapes), keys packed ("-") or in pages behind a shuffled block
table. The e4m3 cache holds the bf16 cache's values quantised with per-(batch,
kv head) descales. Over a bf16 cache the call runs on the Hopper forward; over
an e4m3 cache on the split-KV kernel's e4m3 instances (docs/fp8.md), the only
kernel that reads e4m3 keys today. Each time is the median of 50 calls (CUDA
events, a 256 MB buffer written before each call), the faster of two rounds;
TFLOP/s counts the causal chunk's FLOPs (4 * b * h * q_chunk * d * (context -
q_chunk / 2)). max|diff| is the largest difference between the two outputs
(the quantisation's; tests/test_cuda_fp8_attention.py checks the FP8 result).

    python benchmarks/microbench/fp8_cache_prefill.py [--shapes 4x512x4096,4x2048x16384]
        [--pages=-,16]
    (after building the package)
"""

import torch
from event_timing import best_us, setup

from flash_attn_cuda import flash_attn_varlen_func


def quantise(x, descale_rows):
    """x (rows, nheads_k, d) / descale of each row's (sequence, kv head), in e4m3."""
    return (x.float() / descale_rows[:, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)


def main():
    def add_arguments(parser):
        parser.add_argument("--shapes", default="4x512x4096,4x2048x16384")
        parser.add_argument("--pages", default="-,16")

    args, flush = setup(__doc__, add_arguments)
    nheads, nheads_k, d = 32, 8, 128
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    page_sizes = [None if p == "-" else int(p) for p in args.pages.split(",")]
    print("batch chunk context  page  bf16_us  fp8_us  fp8/bf16  bf16_TF  fp8_TF  max|diff|")
    for batch, chunk, context in shapes:
        q = torch.randn(batch * chunk, nheads, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch * context, nheads_k, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(batch * context, nheads_k, d, device="cuda", dtype=torch.bfloat16)
        k_s = torch.rand(batch, nheads_k, device="cuda") * 0.02 + 0.01
        v_s = torch.rand(batch, nheads_k, device="cuda") * 0.02 + 0.01
        owner = torch.arange(batch, device="cuda").repeat_interleave(context)
        k8, v8 = quantise(k, k_s[owner]), quantise(v, v_s[owner])
        cu_q = torch.arange(0, batch + 1, dtype=torch.int32, device="cuda") * chunk
        cu_k = torch.arange(0, batch + 1, dtype=torch.int32, device="cuda") * context
        flops = 4 * batch * nheads * chunk * d * (context - chunk / 2)
        for page in page_sizes:
            table = None
            k16_in, v16_in, k8_in, v8_in = k, v, k8, v8
            if page is not None:
                per_seq = -(-context // page)
                table = torch.randperm(batch * per_seq, device="cuda", dtype=torch.int32)
                table = table.view(batch, per_seq)
                positions = torch.arange(context, device="cuda")
                pages = table.long()[:, positions // page].flatten()
                rows = (positions % page).repeat(batch)

                def paged(x, pages=pages, rows=rows, n=batch * per_seq, page=page):
                    # Through a uint8 view for e4m3 (index_put has no float8 kernel).
                    fp8 = x.dtype == torch.float8_e4m3fn
                    cache = torch.zeros(n, page, nheads_k, d, device="cuda", dtype=x.dtype)
                    target = cache.view(torch.uint8) if fp8 else cache
                    target[pages, rows] = x.view(torch.uint8) if fp8 else x
                    return cache

                k16_in, v16_in, k8_in, v8_in = paged(k), paged(v), paged(k8), paged(v8)

            def bf16(kk=k16_in, vv=v16_in, t=table):
                return flash_attn_varlen_func(
                    q, kk, vv, cu_q, cu_k, chunk, context, causal=True, block_table=t
                )

            def fp8(kk=k8_in, vv=v8_in, t=table):
                return flash_attn_varlen_func(
                    q, kk, vv, cu_q, cu_k, chunk, context, causal=True, block_table=t,
                    k_descale=k_s, v_descale=v_s,
                )  # fmt: skip

            diff = (bf16().float() - fp8().float()).abs().max().item()
            t16 = best_us(bf16, flush)
            t8 = best_us(fp8, flush)
            print(
                f"{batch:5d} {chunk:5d} {context:7d} {page or '-':>5} {t16:8.1f} {t8:7.1f} "
                f"{t8 / t16:9.3f} {flops / t16 / 1e6:8.1f} {flops / t8 / 1e6:7.1f} {diff:10.3g}"
            )
            del k16_in, v16_in, k8_in, v8_in


if __name__ == "__main__":
    main()
