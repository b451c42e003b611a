"""A few small fwd_kvcache calls for compute-sanitizer (not a pytest module).

    compute-sanitizer --tool memcheck  python scripts/sanitize_kvcache.py
    compute-sanitizer --tool racecheck python scripts/sanitize_kvcache.py

Odd cache lengths, appends with rotary, contiguous and paged caches, GQA
packing, left padding, cache_batch_idx (paged too: it picks the block_table
row), rotary_seqlens, split counts from one to many (the
combine kernel's thread groups differ per head dim: 64, 96, 128, 256), a
long cache launched for one block per SM, the persistent grid, a grid of
several waves that appends and rotates in the attention kernel, and a value
head dim below the query / key one (v_cache read in place at d_v columns, also
as a column slice of a wider buffer or of k_cache itself, appends written at
d_v columns, the combine writing d_v columns of out); and fixed-length fwd
calls of decode shape, which run the split-KV kernel.
"""

import torch
from sanitize_calls import skips_left_out, summary

import flash_attn_cuda  # noqa: F401  (registers the ops)


@skips_left_out
def call(
    batch,
    seqlen_q,
    capacity,
    nheads,
    nheads_k,
    head_dim,
    dtype,
    *,
    seqlen_new=0,
    rotary=False,
    page_size=None,
    leftpad=False,
    batch_idx=False,
    rotary_seqlens=False,
    causal=False,
    num_splits=0,
    head_dim_v=None,
    v_view=None,
    softcap=0.0,
    fp8_cache=False,
):
    """v_view: None, "wide" (v_cache the first d_v columns of a d_qk-wide
    buffer) or "k" (v_cache = k_cache[..., :d_v], MLA's absorbed cache; no
    append). fp8_cache: the caches in float8_e4m3fn with per-(batch, kv head)
    descales (docs/fp8.md)."""
    dev = "cuda"
    d_v = head_dim_v or head_dim
    batch_cache = batch + 1 if batch_idx else batch
    q = torch.randn(batch, seqlen_q, nheads, head_dim, device=dev, dtype=dtype)
    k_cache = torch.randn(batch_cache, capacity, nheads_k, head_dim, device=dev, dtype=dtype)
    v_cache = torch.randn(batch_cache, capacity, nheads_k, d_v, device=dev, dtype=dtype)
    lengths = torch.randint(0, capacity - seqlen_new + 1, (batch,), dtype=torch.int32)
    lengths[0] = capacity - seqlen_new
    k_new = v_new = cos = sin = None
    if seqlen_new:
        k_new = torch.randn(batch, seqlen_new, nheads_k, head_dim, device=dev, dtype=dtype)
        v_new = torch.randn(batch, seqlen_new, nheads_k, d_v, device=dev, dtype=dtype)
    if rotary:
        angle = torch.rand(capacity + 256, head_dim // 4, device=dev) * 6.28
        cos, sin = torch.cos(angle).to(dtype), torch.sin(angle).to(dtype)
    block_table = None
    if page_size is not None:
        pages_per_seq = -(-capacity // page_size)
        num_pages = batch_cache * pages_per_seq
        k_cache = torch.randn(num_pages, page_size, nheads_k, head_dim, device=dev, dtype=dtype)
        v_cache = torch.randn(num_pages, page_size, nheads_k, d_v, device=dev, dtype=dtype)
        block_table = torch.randperm(num_pages, device=dev, dtype=torch.int32)
        block_table = block_table.view(batch_cache, pages_per_seq)
        if not batch_idx:
            block_table = block_table[:batch].contiguous()
    if v_view == "wide":
        v_cache = torch.randn_like(k_cache)[..., :d_v]
    elif v_view == "k":
        assert not seqlen_new
        v_cache = k_cache[..., :d_v]
    cache_batch_idx = torch.arange(batch, dtype=torch.int32, device=dev) + 1 if batch_idx else None
    rotary_starts = None
    if rotary_seqlens:
        rotary_starts = torch.randint(
            0, capacity - max(seqlen_new, seqlen_q) + 1, (batch,), dtype=torch.int32
        ).to(dev)
    cache_leftpad = torch.minimum(lengths, torch.full_like(lengths, 3)).to(dev) if leftpad else None
    descales = {}
    if fp8_cache:
        k_cache, v_cache = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
        descales = {
            name: torch.rand(batch, nheads_k, device=dev) * 0.5 + 0.05
            for name in ("k_descale", "v_descale")
        }
    return torch.ops.flash_attn.fwd_kvcache(
        q,
        k_cache,
        v_cache,
        k_new,
        v_new,
        lengths.to(dev),
        cos,
        sin,
        cache_batch_idx,
        cache_leftpad,
        block_table,
        None,
        head_dim**-0.5,
        causal,
        -1,
        -1,
        softcap,
        True,
        num_splits,
        rotary_seqlens=rotary_starts,
        **descales,
    )


@skips_left_out
def fwd_call(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, causal):
    """A fixed-length fwd call of decode shape (the split-KV kernel), with a
    strided query."""
    q = torch.randn(batch, nheads, seqlen_q, head_dim, device="cuda", dtype=torch.bfloat16)
    q = q.transpose(1, 2)
    k, v = (
        torch.randn(batch, seqlen_k, nheads_k, head_dim, device="cuda", dtype=torch.bfloat16)
        for _ in range(2)
    )
    scale = head_dim**-0.5
    window_right = 0 if causal else -1
    torch.ops.flash_attn.fwd(
        q, k, v, None, 0.0, scale, causal, -1, window_right, 0.0, False, 0, 0, None
    )


def main():
    torch.manual_seed(0)
    bf16, fp16 = torch.bfloat16, torch.float16
    call(2, 1, 301, 32, 8, 128, bf16)
    call(2, 1, 301, 32, 8, 128, bf16, num_splits=1)
    call(1, 1, 2000, 8, 2, 128, bf16, num_splits=128)
    call(1, 1, 2000, 8, 2, 96, fp16, num_splits=128)
    call(1, 1, 2000, 8, 2, 256, bf16, num_splits=128)
    call(3, 4, 131, 8, 2, 64, fp16, seqlen_new=3, rotary=True, causal=True)
    call(2, 2, 203, 4, 1, 128, bf16, seqlen_new=2, rotary=True, page_size=16)
    call(2, 1, 513, 16, 4, 128, fp16, page_size=256, num_splits=5)
    call(2, 3, 77, 4, 4, 64, bf16, batch_idx=True, leftpad=True, causal=True)
    # FA3's shapes: paged caches with left padding and cache_batch_idx, and
    # rotary_seqlens, through the pre-kernel and the in-kernel append.
    fa3 = dict(rotary=True, leftpad=True, batch_idx=True, rotary_seqlens=True)
    call(3, 4, 131, 8, 2, 64, fp16, seqlen_new=3, causal=True, page_size=1, **fa3)
    call(2, 1, 203, 32, 8, 128, bf16, seqlen_new=1, page_size=16, num_splits=1, **fa3)
    call(2, 2, 300, 16, 4, 128, bf16, seqlen_new=2, page_size=64, num_splits=3, **fa3)
    # 128 key tiles per split over a contiguous cache: launched with shared
    # memory for one block per SM.
    call(1, 1, 8192 + 37, 8, 2, 128, bf16, num_splits=1)
    # More items of 16-63 key tiles than two blocks per SM hold: the
    # persistent grid, whose blocks merge an item while the next one's tiles
    # stream. The random lengths leave items of zero, one and many tiles.
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    call(2 * sms // 4 + 2, 1, 1100, 16, 4, 128, bf16, num_splits=1)
    call(2 * sms // 4 + 2, 1, 3200, 16, 4, 128, bf16, num_splits=3)
    # Items of 66 key tiles, a block each, one per SM in several waves, that
    # append and rotate in the attention kernel.
    call(sms // 4 + 1, 1, 4200, 32, 8, 128, bf16, seqlen_new=1, rotary=True, num_splits=1)
    # d_v < d_qk: one split and many (the partials and the combine at d_v
    # columns), the pre-kernel append and the in-kernel one, paged.
    call(2, 1, 301, 32, 8, 192, bf16, head_dim_v=128)
    call(1, 1, 2000, 8, 2, 256, bf16, num_splits=128, head_dim_v=128, v_view="wide")
    call(3, 4, 131, 8, 2, 128, fp16, seqlen_new=3, rotary=True, causal=True, head_dim_v=64)
    call(2, 2, 203, 4, 1, 96, bf16, seqlen_new=2, page_size=16, head_dim_v=64, v_view="wide")
    call(sms // 4 + 1, 1, 4200, 32, 8, 192, bf16, seqlen_new=1, num_splits=1, head_dim_v=128)
    call(2, 1, 513, 16, 1, 256, bf16, page_size=64, num_splits=5, head_dim_v=128, v_view="k")
    # Head dims above 256 (the d512 kernel: two key slabs x two value halves,
    # 16-row query blocks): split and not, many rows per kv head, the in-kernel
    # append, pages of 1 and 64, softcap, d_v below 512 and v as k's view.
    call(2, 1, 1000, 32, 8, 512, bf16)
    call(1, 1, 3000, 8, 2, 512, fp16, num_splits=16, causal=True)
    call(2, 5, 301, 32, 8, 512, bf16, seqlen_new=1, rotary=True, causal=True, num_splits=1)
    call(2, 2, 203, 8, 2, 320, bf16, seqlen_new=2, page_size=1, num_splits=3)
    call(2, 1, 513, 16, 1, 512, bf16, page_size=64, num_splits=5, head_dim_v=256, v_view="k")
    call(2, 1, 301, 8, 2, 512, bf16, head_dim_v=128, v_view="wide", softcap=30.0)
    # Absorbed MLA (576 / 512, v_cache = k_cache[..., :512]): 128 heads over one
    # latent head, 8 query blocks, pages of 64 and 1, and a contiguous cache;
    # V read in the K tile (splitkv_reads_v_in_k), but with the append or
    # softcap, which load it.
    call(2, 1, 513, 128, 1, 576, bf16, page_size=64, num_splits=5, head_dim_v=512, v_view="k")
    call(2, 2, 200, 128, 1, 576, bf16, page_size=1, head_dim_v=512, v_view="k")
    call(3, 1, 301, 128, 1, 576, fp16, head_dim_v=512, v_view="k", causal=True)
    call(2, 1, 300, 64, 1, 576, bf16, head_dim_v=256, v_view="k", num_splits=3)
    call(2, 1, 300, 64, 1, 576, bf16, head_dim_v=512, v_view="k", softcap=30.0)
    # An e4m3 cache (docs/fp8.md): staged and converted tiles, contiguous and
    # paged, split and not, the 64-row variant, softcap, and the append that
    # quantises into the cache.
    call(2, 1, 301, 32, 8, 128, bf16, fp8_cache=True)
    call(2, 1, 513, 16, 4, 128, fp16, page_size=16, num_splits=5, fp8_cache=True)
    call(1, 1, 2000, 8, 2, 64, bf16, page_size=1, num_splits=16, fp8_cache=True)
    call(2, 8, 300, 8, 2, 128, fp16, causal=True, fp8_cache=True)
    call(2, 1, 301, 8, 2, 256, bf16, softcap=30.0, fp8_cache=True)
    call(3, 4, 131, 8, 2, 64, fp16, seqlen_new=3, rotary=True, causal=True, fp8_cache=True)
    call(2, 2, 203, 4, 1, 128, bf16, seqlen_new=2, page_size=16, fp8_cache=True)
    # Fixed-length fwd calls of decode shape, which run the split-KV kernel
    # (plan_fwd_split): split and not, causal with more queries than keys,
    # GQA and MQA, a strided query.
    for shape in [
        (1, 1, 2000, 32, 8, 128, False),
        (2, 4, 3, 16, 4, 64, True),
        (3, 2, 777, 8, 1, 256, True),
        (2 * sms, 1, 300, 8, 8, 96, False),
    ]:
        fwd_call(*shape)
    torch.cuda.synchronize()
    print(summary("sanitize_kvcache"))


if __name__ == "__main__":
    main()
