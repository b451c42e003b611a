"""What a check of the index values costs per call, by how it reports.

Three ways to learn of a bad cu_seqlens / cache_seqlens / block_table value on
the CUDA path, timed on the same calls:

* deferred: the default. The kernels guard and record; nothing waits.
* sync: set_sync_index_checks(True). Each call waits for its stream after its
  launches and raises its own error.
* host_item: what flash-attn does on its paged path: one ``.item()`` of a
  reduction of the index tensor before each call (a device-to-host copy that
  waits for the stream).

Time per call is wall time over many back-to-back calls (CUDA events alone
would miss the idle GPU between a synchronisation and the next launch).

    python3 benchmarks/microbench/index_check_cost.py --out index_check_cost.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import flash_attn_cuda


def wall_us(fn, calls: int, repeats: int = 5) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    best = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best.append((time.perf_counter() - start) / calls * 1e6)
    best.sort()
    return best[len(best) // 2]


def decode_case(batch: int, seqlen_k: int, paged: bool):
    nheads, nheads_k, d, page = 32, 8, 128, 256
    q = torch.randn(batch, 1, nheads, d, device="cuda", dtype=torch.bfloat16)
    seqlens = torch.full((batch,), seqlen_k - 1, dtype=torch.int32, device="cuda")
    if paged:
        pages_per_seq = seqlen_k // page
        k_cache = torch.randn(
            batch * pages_per_seq, page, nheads_k, d, device="cuda", dtype=torch.bfloat16
        )
        table = torch.randperm(batch * pages_per_seq, device="cuda", dtype=torch.int32)
        table = table.view(batch, pages_per_seq)
    else:
        k_cache = torch.randn(batch, seqlen_k, nheads_k, d, device="cuda", dtype=torch.bfloat16)
        table = None
    v_cache = torch.randn_like(k_cache)

    def call():
        return flash_attn_cuda.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table
        )

    def host_item():
        limit = seqlens.max().item()
        assert limit <= seqlen_k
        return call()

    return call, host_item


def varlen_step_case(total: int, nseq: int):
    nheads, d = 16, 128
    lengths = torch.full((nseq,), total // nseq)
    cu = torch.zeros(nseq + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    cu = cu.cuda()
    max_len = int(lengths.max())
    q, k, v = (
        torch.randn(total, nheads, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    grad = torch.randn(total, nheads, d, device="cuda", dtype=torch.bfloat16)

    def call():
        out = flash_attn_cuda.flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, causal=True)
        out.backward(grad)

    def host_item():
        assert int((cu[1:] - cu[:-1]).max().item()) <= max_len
        return call()

    return call, host_item


def measure(call, host_item, calls: int) -> dict:
    flash_attn_cuda.set_sync_index_checks(False)
    deferred = wall_us(call, calls)
    flash_attn_cuda.set_sync_index_checks(True)
    sync = wall_us(call, calls)
    flash_attn_cuda.set_sync_index_checks(False)
    item = wall_us(host_item, calls)
    return {
        "deferred_us": deferred,
        "sync_us": sync,
        "host_item_us": item,
        "sync_over_deferred": sync / deferred,
        "host_item_over_deferred": item / deferred,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = []
    for paged in (False, True):
        for batch in (1, 4, 16, 64):
            for seqlen_k in (4096, 16384):
                call, item = decode_case(batch, seqlen_k, paged)
                row = {
                    "case": "decode",
                    "paged": paged,
                    "batch": batch,
                    "seqlen_k": seqlen_k,
                    **measure(call, item, calls=200),
                }
                rows.append(row)
                print(json.dumps(row))
    for total, nseq in ((16384, 8), (16384, 64)):
        call, item = varlen_step_case(total, nseq)
        row = {
            "case": "varlen_fwd_bwd_causal",
            "total_tokens": total,
            "sequences": nseq,
            **measure(call, item, calls=20),
        }
        rows.append(row)
        print(json.dumps(row))
    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "shapes": "decode: sq1 GQA 32:8 d128 bf16, pages of 256; "
        "varlen: 16 heads d128 bf16 causal fwd+bwd",
    }
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
