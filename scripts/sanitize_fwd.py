"""A few small forward calls for compute-sanitizer (not a pytest module).

    compute-sanitizer --tool memcheck  python scripts/sanitize_fwd.py
    compute-sanitizer --tool racecheck python scripts/sanitize_fwd.py

Shapes are small and odd so that partial query and key tiles, the padded head
dim, a value head dim below the query / key one (d_v < d_qk: V read and O written at
d_v columns), GQA, varlen (paged too), the mask, the score extras and dropout (over paged keys
too) all run at least once,
on the SM80 forward kernel and, with FLASH_ATTN_FWD_KERNEL=sm90 on an sm90 GPU, on the Hopper one;
FP8 attention and an FP8 KV cache read by the forward (e4m3 k, v under a
16-bit q) on the split-KV kernel's e4m3 instances (sm89 and newer).
"""

import torch
from sanitize_calls import skips_left_out, summary

import flash_attn_cuda  # noqa: F401  (registers the ops)


@skips_left_out
def fixed(
    batch,
    seqlen_q,
    seqlen_k,
    nheads,
    nheads_k,
    head_dim,
    dtype,
    *,
    causal=False,
    window=(-1, -1),
    softcap=0.0,
    alibi=False,
    dropout_p=0.0,
    return_softmax=False,
    head_dim_v=None,
):
    q = torch.randn(batch, seqlen_q, nheads, head_dim, device="cuda", dtype=dtype)
    k = torch.randn(batch, seqlen_k, nheads_k, head_dim, device="cuda", dtype=dtype)
    v = torch.randn(batch, seqlen_k, nheads_k, head_dim_v or head_dim, device="cuda", dtype=dtype)
    slopes = torch.rand(nheads, device="cuda") * 0.3 if alibi else None
    return torch.ops.flash_attn.fwd(
        q,
        k,
        v,
        slopes,
        dropout_p,
        head_dim**-0.5,
        causal,
        window[0],
        window[1],
        softcap,
        return_softmax,
        3,
        1,
        None,
    )


@skips_left_out
def varlen(
    lengths_q,
    lengths_k,
    nheads,
    nheads_k,
    head_dim,
    dtype,
    *,
    causal=False,
    softcap=0.0,
    alibi=False,
    pad_q=0,
):
    """pad_q: q rows outside every sequence, that many before the first and after the last."""
    cu_q = torch.tensor([pad_q] + lengths_q, dtype=torch.int32).cumsum(0).int().cuda()
    cu_k = torch.tensor([0] + lengths_k, dtype=torch.int32).cumsum(0).int().cuda()
    q = torch.randn(sum(lengths_q) + 2 * pad_q, nheads, head_dim, device="cuda", dtype=dtype)
    k = torch.randn(sum(lengths_k), nheads_k, head_dim, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    slopes = torch.rand(len(lengths_q), nheads, device="cuda") * 0.3 if alibi else None
    return torch.ops.flash_attn.varlen_fwd(
        q,
        k,
        v,
        cu_q,
        cu_k,
        None,
        slopes,
        max(lengths_q),
        max(lengths_k),
        0.0,
        head_dim**-0.5,
        causal,
        -1,
        -1,
        softcap,
        False,
        0,
        0,
        None,
    )


@skips_left_out
def varlen_paged(
    lengths_q,
    lengths_k,
    page_size,
    nheads,
    nheads_k,
    head_dim,
    dtype,
    *,
    head_dim_v=None,
    dropout_p=0.0,
):
    """Keys in pages of a shuffled pool; unused table entries -1 and one table
    entry out of range past the last page a sequence reaches (never read)."""
    cu_q = torch.tensor([0] + lengths_q, dtype=torch.int32).cumsum(0).int().cuda()
    cu_k = torch.tensor([0] + lengths_k, dtype=torch.int32).cumsum(0).int().cuda()
    pages = [(n + page_size - 1) // page_size for n in lengths_k]
    num_blocks = sum(pages) + 1
    order = torch.randperm(num_blocks).tolist()
    table = torch.full((len(lengths_k), max(pages) + 1), -1, dtype=torch.int32)
    for b, count in enumerate(pages):
        table[b, :count] = torch.tensor([order.pop() for _ in range(count)], dtype=torch.int32)
        table[b, count] = num_blocks + 7
    q = torch.randn(sum(lengths_q), nheads, head_dim, device="cuda", dtype=dtype)
    k = torch.randn(num_blocks, page_size, nheads_k, head_dim, device="cuda", dtype=dtype)
    v = torch.randn(
        num_blocks, page_size, nheads_k, head_dim_v or head_dim, device="cuda", dtype=dtype
    )
    return torch.ops.flash_attn.varlen_fwd(
        q,
        k,
        v,
        cu_q,
        cu_k,
        table.cuda(),
        None,
        max(lengths_q),
        max(lengths_k),
        dropout_p,
        head_dim**-0.5,
        True,
        -1,
        -1,
        0.0,
        False,
        0,
        0,
        None,
    )


def fp8_rand(*shape):
    return (torch.randn(*shape, device="cuda") * 2).clamp(-6, 6).to(torch.float8_e4m3fn)


def fp8_descales(batch, nheads_k, q_dtype=None):
    # q_dtype: None for FP8 attention (e4m3 q, its descale too), a 16-bit dtype
    # for an FP8 KV cache read by the forward (no q_descale).
    names = (
        ("q_descale", "k_descale", "v_descale") if q_dtype is None else ("k_descale", "v_descale")
    )
    return {name: torch.rand(batch, nheads_k, device="cuda") * 0.5 + 0.05 for name in names}


def fp8_or_16_bit_q(*shape, q_dtype=None):
    if q_dtype is None:
        return fp8_rand(*shape)
    return torch.randn(*shape, device="cuda", dtype=q_dtype)


@skips_left_out
def fp8_fixed(
    batch,
    seqlen_q,
    seqlen_k,
    nheads,
    nheads_k,
    head_dim,
    *,
    causal=False,
    softcap=0.0,
    q_dtype=None,
):
    """FP8 attention (e4m3 q, k, v; docs/fp8.md): the split-KV kernel's e4m3
    instances, q converted to bfloat16 by the op; with q_dtype, an FP8 KV
    cache (e4m3 k, v) under a q of that dtype."""
    q = fp8_or_16_bit_q(batch, seqlen_q, nheads, head_dim, q_dtype=q_dtype)
    k = fp8_rand(batch, seqlen_k, nheads_k, head_dim)
    v = fp8_rand(batch, seqlen_k, nheads_k, head_dim)
    return torch.ops.flash_attn.fwd(
        q, k, v, None, 0.0, head_dim**-0.5, causal, -1, -1, softcap, False, 0, 0, None,
        **fp8_descales(batch, nheads_k, q_dtype),
    )  # fmt: skip


@skips_left_out
def fp8_varlen_paged(lengths_q, lengths_k, page_size, nheads, nheads_k, head_dim, q_dtype=None):
    cu_q = torch.tensor([0] + lengths_q, dtype=torch.int32).cumsum(0).int().cuda()
    cu_k = torch.tensor([0] + lengths_k, dtype=torch.int32).cumsum(0).int().cuda()
    pages = [(n + page_size - 1) // page_size for n in lengths_k]
    num_blocks = sum(pages) + 1
    order = torch.randperm(num_blocks).tolist()
    table = torch.full((len(lengths_k), max(pages)), -1, dtype=torch.int32)
    for b, count in enumerate(pages):
        table[b, :count] = torch.tensor([order.pop() for _ in range(count)], dtype=torch.int32)
    q = fp8_or_16_bit_q(sum(lengths_q), nheads, head_dim, q_dtype=q_dtype)
    k = fp8_rand(num_blocks, page_size, nheads_k, head_dim)
    v = fp8_rand(num_blocks, page_size, nheads_k, head_dim)
    return torch.ops.flash_attn.varlen_fwd(
        q, k, v, cu_q, cu_k, table.cuda(), None, max(lengths_q), max(lengths_k), 0.0,
        head_dim**-0.5, True, -1, -1, 0.0, False, 0, 0, None,
        **fp8_descales(len(lengths_q), nheads_k, q_dtype),
    )  # fmt: skip


def main():
    torch.manual_seed(0)
    bf16, fp16 = torch.bfloat16, torch.float16
    fixed(1, 1, 1, 1, 1, 32, bf16)
    fixed(2, 17, 129, 2, 1, 40, fp16, causal=True)
    fixed(1, 130, 70, 4, 2, 64, bf16, softcap=5.0, alibi=True)
    fixed(1, 129, 131, 2, 2, 128, fp16, window=(20, 5), dropout_p=0.2, return_softmax=True)
    fixed(1, 70, 65, 2, 2, 256, bf16, causal=True)
    # The plain score rule runs the Hopper kernel on sm90 (TMA copies, the
    # producer and MMA warpgroups' mbarriers, the zeroed tail of a varlen tile).
    fixed(2, 200, 333, 4, 2, 128, bf16)
    fixed(1, 300, 700, 2, 1, 64, fp16, causal=True)
    varlen([50, 77, 130], [100, 77, 200], 4, 2, 128, bf16, causal=True)
    # More query blocks than SMs, no causal bound: one block per SM walking
    # several (the producer running ahead into the next query block), in
    # fixed shares.
    fixed(2, 1100, 300, 8, 2, 64, fp16)
    # Varlen, or a causal or local bound: the blocks take their query blocks
    # from a counter (an MMA thread publishes each in shared memory).
    varlen([300, 0, 7, 130] * 10, [200, 5, 0, 260] * 10, 4, 2, 128, bf16)
    fixed(2, 1100, 1100, 8, 2, 64, bf16, causal=True)
    fixed(2, 1100, 900, 8, 2, 128, fp16, window=(100, 0))
    varlen([300, 0, 7, 130] * 10, [200, 5, 0, 260] * 10, 8, 2, 128, bf16, causal=True)
    # Softcap and ALiBi run the Hopper kernel's other variant on sm90, on the
    # fixed-share grid and one block per query block.
    fixed(2, 1100, 300, 8, 2, 64, bf16, softcap=10.0, alibi=True)
    fixed(2, 1100, 1100, 8, 2, 128, fp16, causal=True, softcap=10.0)
    fixed(1, 300, 333, 2, 1, 256, bf16, window=(100, 20), alibi=True)
    varlen(
        [300, 0, 7, 130] * 3,
        [200, 5, 0, 260] * 3,
        4,
        2,
        96,
        bf16,
        causal=True,
        softcap=5.0,
        alibi=True,
    )
    fixed(1, 150, 300, 2, 2, 200, bf16, window=(50, 0))
    fixed(1, 33, 97, 2, 2, 200, fp16, dropout_p=0.1)
    # Dropout on the Hopper tiles of their own (plan.h fwd_sm90_dropout_tile):
    # d64's 128 x 128 and d256's 128 x 64, where the table's tiles do not draw.
    fixed(2, 300, 1100, 4, 2, 64, bf16, causal=True, dropout_p=0.2)
    fixed(1, 200, 600, 2, 1, 256, fp16, dropout_p=0.1, return_softmax=True)
    fixed(1, 0, 5, 2, 2, 64, bf16)
    fixed(1, 5, 0, 2, 2, 64, bf16)
    varlen([5, 0, 70], [9, 130, 1], 4, 2, 96, bf16, causal=True)
    # Decode-like rows: the split-KV run, whose combine fills the q rows
    # outside every sequence without reading their partials.
    varlen([1, 1, 0, 1], [700, 5, 9, 1300], 8, 2, 128, bf16, pad_q=3)
    varlen([40, 3], [77, 150], 2, 2, 160, fp16)
    varlen_paged([5, 0, 30], [9, 40, 33], 16, 4, 2, 64, bf16)
    varlen_paged([7], [50], 1, 2, 2, 40, fp16)
    # d_v < d_qk: V loaded with d_v columns (TMA boxes past the tensor's end on
    # sm90, zero-filled cp.async on the SM80 kernel), O stored at d_v columns.
    fixed(2, 130, 200, 4, 2, 192, bf16, causal=True, head_dim_v=128)
    fixed(2, 1100, 300, 8, 2, 128, fp16, head_dim_v=64)
    fixed(1, 129, 131, 2, 2, 96, bf16, dropout_p=0.2, return_softmax=True, head_dim_v=64)
    varlen_paged([5, 0, 30], [9, 40, 33], 16, 4, 2, 256, bf16, head_dim_v=128)
    # Dropout over paged keys: the Hopper dropout tiles' paged instantiations
    # (d64 128 x 128, d256 128 x 64; plan.h fwd_sm90_dropout_tile), by the row
    # gather (16-row pages) and by TMA boxes (64-row pages).
    varlen_paged([70, 0, 130], [90, 40, 200], 16, 4, 2, 64, bf16, dropout_p=0.2)
    varlen_paged([70, 3], [150, 200], 64, 2, 1, 256, fp16, dropout_p=0.15)
    # Head dims 257-512: the SM80 kernel's d512 row in slab passes (many
    # query rows: fixed length, varlen with an empty sequence, paged, dropout
    # with softcap and ALiBi, d_v below d_qk and below one slab) and the
    # split-KV kernel's d512 instance (decode-like rows; varlen with num_splits).
    fixed(2, 130, 200, 8, 2, 512, bf16, causal=True)
    fixed(1, 40, 300, 4, 1, 320, fp16, softcap=5.0, head_dim_v=256)
    fixed(1, 70, 90, 2, 1, 512, bf16, softcap=5.0, alibi=True, dropout_p=0.2)
    fixed(2, 1, 300, 8, 2, 512, fp16)
    varlen([5, 0, 70], [9, 130, 1], 4, 2, 512, bf16, causal=True)
    varlen_paged([5, 0, 30], [9, 40, 33], 16, 4, 2, 512, bf16, head_dim_v=384)
    varlen_paged([70, 3], [150, 200], 3, 2, 1, 512, fp16, dropout_p=0.15)
    # FP8 attention (sm89 and newer): the split-KV kernel's e4m3 instances, a
    # decode-shaped call, a prefill one (the 64-row variant), softcap, paged.
    if torch.cuda.get_device_capability() >= (8, 9):
        fp8_fixed(3, 1, 300, 8, 2, 128)
        fp8_fixed(1, 200, 333, 4, 1, 64, causal=True)
        fp8_fixed(2, 70, 90, 4, 2, 256, softcap=5.0)
        fp8_varlen_paged([5, 0, 30], [9, 40, 33], 16, 4, 2, 128)
        # An FP8 KV cache read by the forward: e4m3 k and v under a 16-bit q,
        # paged (chunked prefill) in pages of 1 and 16, and a fixed-length call.
        fp8_varlen_paged([5, 0, 30], [9, 40, 33], 16, 4, 2, 128, q_dtype=bf16)
        fp8_varlen_paged([3, 17], [70, 1], 1, 8, 2, 64, q_dtype=fp16)
        fp8_fixed(2, 70, 90, 8, 2, 128, causal=True, q_dtype=fp16)
    torch.cuda.synchronize()
    print(summary("sanitize_fwd"))


if __name__ == "__main__":
    main()
