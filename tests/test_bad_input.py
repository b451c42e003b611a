"""Bad input raises a clear error (RuntimeError, ValueError or TypeError) naming the argument.

Every case goes through the raw op (torch.ops.flash_attn.*), and the common
ones also through the Python API. No case may crash the process: a crash fails
the whole file rather than one test.
"""

import pytest
import torch

from test_cpu_kvcache import op_args

from flash_attn_cuda import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

ops = torch.ops.flash_attn
ERRORS = (RuntimeError, ValueError)
BF16 = torch.bfloat16


def rand(*shape, dtype=BF16, device="cpu"):
    return torch.randn(*shape, device=device).to(dtype)


def strided_last_dim(*shape):
    """A tensor of `shape` whose last dim has stride 2."""
    return rand(*shape[:-1], shape[-1] * 2)[..., ::2]


def int32(values, device="cpu"):
    return torch.tensor(values, dtype=torch.int32, device=device)


# ---------------------------------------------------------------------------
# flash_attn.fwd / flash_attn.bwd
# ---------------------------------------------------------------------------


def fwd_kwargs(**changes):
    kwargs = dict(
        q=rand(2, 9, 4, 32),
        k=rand(2, 11, 2, 32),
        v=rand(2, 11, 2, 32),
        alibi_slopes=None,
        dropout_p=0.0,
        softmax_scale=0.2,
        causal=False,
        window_size_left=-1,
        window_size_right=-1,
        softcap=0.0,
        return_softmax=False,
        philox_seed=0,
        philox_offset=0,
        rng_state=None,
    )
    kwargs.update(changes)
    return kwargs


def with_head_dim(d, nheads=4, nheads_k=2):
    return dict(q=rand(2, 9, nheads, d), k=rand(2, 11, nheads_k, d), v=rand(2, 11, nheads_k, d))


FWD_CASES = {
    "q_int_dtype": (dict(q=torch.ones(2, 9, 4, 32, dtype=torch.int32)), r"q must have dtype"),
    "q_float64": (dict(q=rand(2, 9, 4, 32, dtype=torch.float64)), r"q must have dtype"),
    "k_other_dtype": (
        dict(k=rand(2, 11, 2, 32, dtype=torch.float16)),
        r"k must have the same dtype as q",
    ),
    "v_other_dtype": (
        dict(v=rand(2, 11, 2, 32, dtype=torch.float32)),
        r"v must have the same dtype as q",
    ),
    "head_dim_over_1024_on_cpu": (
        with_head_dim(1032),
        r"head dimension \(last dim of q\) must be a multiple of 8 in \[8, 1024\] on the CPU, "
        r"got 1032",
    ),
    "head_dim_not_multiple_of_8": (with_head_dim(20), r"head dimension.*multiple of 8"),
    "nheads_not_divisible": (
        with_head_dim(32, nheads=6, nheads_k=4),
        r"heads of q \(6\).*divisible.*heads of k and v \(4\)",
    ),
    "k_batch_mismatch": (dict(k=rand(3, 11, 2, 32)), r"\bk must have shape"),
    "k_head_dim_mismatch": (dict(k=rand(2, 11, 2, 40)), r"\bk must have shape"),
    "v_shape_mismatch": (dict(v=rand(2, 12, 2, 32)), r"\bv must have the shape of k"),
    "q_3d": (dict(q=rand(9, 4, 32)), r"\bq must be a 4-D"),
    "q_last_dim_strided": (
        dict(q=strided_last_dim(2, 9, 4, 32)),
        r"\bq must have a contiguous last dimension",
    ),
    "k_last_dim_strided": (
        dict(k=strided_last_dim(2, 11, 2, 32)),
        r"\bk must have a contiguous last dimension",
    ),
    "dropout_negative": (dict(dropout_p=-0.1), r"dropout_p must be in \[0, 1\)"),
    "dropout_one": (dict(dropout_p=1.0), r"dropout_p must be in \[0, 1\)"),
    "softcap_negative": (dict(softcap=-1.0), r"softcap"),
    "alibi_wrong_shape": (dict(alibi_slopes=torch.rand(3)), r"alibi_slopes must have shape"),
    "alibi_wrong_batch": (dict(alibi_slopes=torch.rand(3, 4)), r"alibi_slopes must have shape"),
    "alibi_wrong_dtype": (
        dict(alibi_slopes=torch.rand(4).to(BF16)),
        r"alibi_slopes must have dtype float32",
    ),
    "rng_state_wrong_dtype": (dict(rng_state=int32([1, 2])), r"rng_state must have dtype int64"),
    "rng_state_wrong_size": (dict(rng_state=torch.tensor([1, 2, 3])), r"rng_state must hold 2"),
}


@pytest.mark.parametrize("case", sorted(FWD_CASES))
def test_fwd_op(case):
    changes, message = FWD_CASES[case]
    with pytest.raises(ERRORS, match=message):
        ops.fwd(**fwd_kwargs(**changes))


def bwd_kwargs(**changes):
    forward = fwd_kwargs()
    out, softmax_lse, _, _ = ops.fwd(**forward)
    kwargs = dict(
        dout=torch.randn_like(out),
        q=forward["q"],
        k=forward["k"],
        v=forward["v"],
        out=out,
        softmax_lse=softmax_lse,
        alibi_slopes=None,
        dropout_p=0.0,
        softmax_scale=0.2,
        causal=False,
        window_size_left=-1,
        window_size_right=-1,
        softcap=0.0,
        deterministic=False,
        rng_state=None,
    )
    kwargs.update(changes)
    return kwargs


BWD_CASES = {
    "lse_wrong_shape": (dict(softmax_lse=torch.zeros(2, 4, 10)), r"softmax_lse must have shape"),
    "lse_wrong_dtype": (
        dict(softmax_lse=torch.zeros(2, 4, 9, dtype=BF16)),
        r"softmax_lse must have dtype float32",
    ),
    "dout_wrong_shape": (dict(dout=rand(2, 9, 4, 40)), r"dout must have the shape of q"),
    "dout_wrong_dtype": (
        dict(dout=rand(2, 9, 4, 32, dtype=torch.float16)),
        r"dout must have the same dtype as q",
    ),
    "out_wrong_dtype": (
        dict(out=rand(2, 9, 4, 32, dtype=torch.float16)),
        r"out must have the same dtype as q",
    ),
    "dout_last_dim_strided": (
        dict(dout=strided_last_dim(2, 9, 4, 32)),
        r"dout must have a contiguous last dimension",
    ),
    "dropout_without_rng_state": (dict(dropout_p=0.1), r"rng_state"),
    "k_other_dtype": (
        dict(k=rand(2, 11, 2, 32, dtype=torch.float16)),
        r"k must have the same dtype as q",
    ),
}


@pytest.mark.parametrize("case", sorted(BWD_CASES))
def test_bwd_op(case):
    changes, message = BWD_CASES[case]
    kwargs = bwd_kwargs()
    kwargs.update(changes)
    with pytest.raises(ERRORS, match=message):
        ops.bwd(**kwargs)


# ---------------------------------------------------------------------------
# flash_attn.varlen_fwd / flash_attn.varlen_bwd
# ---------------------------------------------------------------------------


def varlen_kwargs(**changes):
    # Two sequences: q lengths 3 and 6, k lengths 5 and 7.
    kwargs = dict(
        q=rand(9, 4, 32),
        k=rand(12, 2, 32),
        v=rand(12, 2, 32),
        cu_seqlens_q=int32([0, 3, 9]),
        cu_seqlens_k=int32([0, 5, 12]),
        block_table=None,
        alibi_slopes=None,
        max_seqlen_q=6,
        max_seqlen_k=7,
        dropout_p=0.0,
        softmax_scale=0.2,
        causal=False,
        window_size_left=-1,
        window_size_right=-1,
        softcap=0.0,
        return_softmax=False,
        philox_seed=0,
        philox_offset=0,
        rng_state=None,
    )
    kwargs.update(changes)
    return kwargs


def paged(**changes):
    # Pages of 4 rows; sequence 0 needs 2 pages, sequence 1 needs 2.
    base = dict(k=rand(6, 4, 2, 32), v=rand(6, 4, 2, 32), block_table=int32([[5, 0], [2, 3]]))
    base.update(changes)
    return base


VARLEN_CASES = {
    "cu_seqlens_q_int64": (
        dict(cu_seqlens_q=torch.tensor([0, 3, 9])),
        r"cu_seqlens_q must have dtype int32",
    ),
    "cu_seqlens_k_float": (
        dict(cu_seqlens_k=torch.tensor([0.0, 5.0, 12.0])),
        r"cu_seqlens_k must have dtype int32",
    ),
    "cu_seqlens_k_wrong_length": (
        dict(cu_seqlens_k=int32([0, 5, 9, 12])),
        r"cu_seqlens_k must have as many entries",
    ),
    "cu_seqlens_q_2d": (dict(cu_seqlens_q=int32([[0, 3, 9]])), r"cu_seqlens_q must be 1-D"),
    "cu_seqlens_q_decreasing": (
        dict(cu_seqlens_q=int32([0, 6, 3])),
        r"cu_seqlens_q must be non-decreasing",
    ),
    "cu_seqlens_k_past_end": (
        dict(cu_seqlens_k=int32([0, 5, 13]), max_seqlen_k=8),
        r"cu_seqlens_k\[2\] = 13 exceeds",
    ),
    "sequence_longer_than_max_seqlen": (dict(max_seqlen_q=5), r"max_seqlen"),
    "max_seqlen_negative": (dict(max_seqlen_k=-1), r"max_seqlen_k must be >= 0"),
    "q_2d": (dict(q=rand(9, 128)), r"\bq must be a 3-D"),
    "head_dim_not_multiple_of_8": (
        dict(q=rand(9, 4, 12), k=rand(12, 2, 12), v=rand(12, 2, 12)),
        r"head dimension.*multiple of 8",
    ),
    "nheads_not_divisible": (dict(k=rand(12, 3, 32), v=rand(12, 3, 32)), r"heads of q \(4\)"),
    "q_last_dim_strided": (
        dict(q=strided_last_dim(9, 4, 32)),
        r"\bq must have a contiguous last dimension",
    ),
    "dropout_too_large": (dict(dropout_p=1.5), r"dropout_p must be in \[0, 1\)"),
    "alibi_wrong_shape": (dict(alibi_slopes=torch.rand(2, 3)), r"alibi_slopes must have shape"),
    "block_table_wrong_batch": (paged(block_table=int32([[5, 0]])), r"block_table must have shape"),
    "block_table_1d": (paged(block_table=int32([5, 0, 2, 3])), r"block_table must have shape"),
    "block_table_int64": (
        paged(block_table=torch.tensor([[5, 0], [2, 3]])),
        r"block_table must have dtype int32",
    ),
    "block_table_bad_index": (
        paged(block_table=int32([[5, 6], [2, 3]])),
        r"block_table\[0, 1\] = 6 is not a valid block index",
    ),
    "block_table_too_narrow": (paged(block_table=int32([[5], [2]])), r"block_table has only"),
    "paged_k_3d": (paged(k=rand(24, 2, 32), v=rand(24, 2, 32)), r"\bk must be a 4-D"),
    # seqused_k: sequence b uses its first seqused_k[b] keys, at most its cu_seqlens_k length
    # (paged: at most min(max_seqlen_k, the rows its block_table row addresses)).
    "seqused_k_int64": (dict(seqused_k=torch.tensor([3, 4])), r"seqused_k must have dtype int32"),
    "seqused_k_wrong_shape": (
        dict(seqused_k=int32([3, 4, 5])),
        r"seqused_k must have shape \(batch,\) = \(2,\)",
    ),
    "seqused_k_2d": (dict(seqused_k=int32([[3, 4]])), r"seqused_k must have shape"),
    "seqused_k_past_sequence": (
        dict(seqused_k=int32([5, 8])),
        r"seqused_k\[1\] = 8 must be in \[0, 7\] \(the keys "
        r"cu_seqlens_k gives sequence 1\)",
    ),
    "seqused_k_negative": (
        dict(seqused_k=int32([-1, 2])),
        r"seqused_k\[0\] = -1 must be in \[0, 5\]",
    ),
    "seqused_k_paged_past_table": (
        paged(seqused_k=int32([3, 9])),
        r"seqused_k\[1\] = 9 must be in \[0, 7\] \(with block_table",
    ),
    "seqused_k_paged_past_max_seqlen": (
        paged(seqused_k=int32([8, 1]), max_seqlen_k=7),
        r"seqused_k\[0\] = 8 must be in \[0, 7\]",
    ),
}


@pytest.mark.parametrize("case", sorted(VARLEN_CASES))
def test_varlen_fwd_op(case):
    changes, message = VARLEN_CASES[case]
    with pytest.raises(ERRORS, match=message):
        ops.varlen_fwd(**varlen_kwargs(**changes))


def test_varlen_seqused_k_replaces_paged_lengths():
    # With block_table, seqused_k gives the keys: cu_seqlens_k's lengths may exceed
    # what the table addresses (pages are then checked for seqused_k's keys only).
    kwargs = varlen_kwargs(**paged(block_table=int32([[5, -1], [2, 3]])))
    kwargs.update(cu_seqlens_k=int32([0, 8, 16]), max_seqlen_k=8, seqused_k=int32([3, 8]))
    ops.varlen_fwd(**kwargs)
    with pytest.raises(ERRORS, match=r"block_table\[0, 1\] = -1 is not a valid block index"):
        ops.varlen_fwd(**{**kwargs, "seqused_k": int32([5, 8])})


def test_varlen_bwd_op():
    forward = varlen_kwargs()
    out, softmax_lse, _, _ = ops.varlen_fwd(**forward)
    kwargs = dict(
        dout=torch.randn_like(out),
        q=forward["q"],
        k=forward["k"],
        v=forward["v"],
        out=out,
        softmax_lse=softmax_lse,
        cu_seqlens_q=forward["cu_seqlens_q"],
        cu_seqlens_k=forward["cu_seqlens_k"],
        alibi_slopes=None,
        max_seqlen_q=6,
        max_seqlen_k=7,
        dropout_p=0.0,
        softmax_scale=0.2,
        causal=False,
        window_size_left=-1,
        window_size_right=-1,
        softcap=0.0,
        deterministic=False,
        rng_state=None,
    )
    bad_cases = [
        (dict(softmax_lse=softmax_lse.t()), r"softmax_lse must have shape"),
        (dict(cu_seqlens_q=forward["cu_seqlens_q"].long()), r"cu_seqlens_q must have dtype int32"),
        (dict(cu_seqlens_k=int32([0, 12])), r"cu_seqlens_k must have as many entries"),
        (dict(dropout_p=0.3), r"rng_state"),
        (dict(dout=rand(9, 4, 24)), r"dout must have the shape of q"),
        (dict(seqused_k=int32([5, 8])), r"seqused_k\[1\] = 8 must be in \[0, 7\]"),
        (dict(seqused_k=torch.tensor([5, 7])), r"seqused_k must have dtype int32"),
    ]
    ops.varlen_bwd(**kwargs)  # the unchanged arguments are valid
    for changes, message in bad_cases:
        with pytest.raises(ERRORS, match=message):
            ops.varlen_bwd(**{**kwargs, **changes})


# ---------------------------------------------------------------------------
# flash_attn.fwd_kvcache
# ---------------------------------------------------------------------------


def kvcache_kwargs(**changes):
    kwargs = op_args(
        rand(2, 1, 4, 32),
        rand(2, 16, 2, 32),
        rand(2, 16, 2, 32),
        causal=True,
        k=rand(2, 1, 2, 32),
        v=rand(2, 1, 2, 32),
        cache_seqlens=int32([3, 7]),
        softmax_scale=0.2,
    )
    kwargs.update(changes)
    return kwargs


KVCACHE_CASES = {
    "q_float64": (dict(q=rand(2, 1, 4, 32, dtype=torch.float64)), r"\bq must have dtype"),
    "k_cache_other_dtype": (
        dict(k_cache=rand(2, 16, 2, 32, dtype=torch.float16)),
        r"k_cache must have the dtype of q",
    ),
    "head_dim_not_multiple_of_8": (
        dict(
            q=rand(2, 1, 4, 20),
            k_cache=rand(2, 16, 2, 20),
            v_cache=rand(2, 16, 2, 20),
            k=rand(2, 1, 2, 20),
            v=rand(2, 1, 2, 20),
        ),
        r"head_dim.*multiple of 8",
    ),
    "nheads_not_divisible": (dict(q=rand(2, 1, 3, 32)), r"nheads of q \(3\)"),
    "v_cache_shape": (dict(v_cache=rand(2, 15, 2, 32)), r"v_cache must have shape"),
    "k_cache_last_dim_strided": (
        dict(k_cache=strided_last_dim(2, 16, 2, 32)),
        r"k_cache must have a contiguous last dimension",
    ),
    "k_without_v": (dict(v=None), r"k and v .* must be given together"),
    "k_wrong_shape": (dict(k=rand(2, 1, 2, 24)), r"\bk must have shape"),
    "append_without_cache_seqlens": (dict(cache_seqlens=None), r"cache_seqlens must be given"),
    "cache_seqlens_int64": (
        dict(cache_seqlens=torch.tensor([3, 7])),
        r"cache_seqlens must have dtype torch.int32",
    ),
    "cache_seqlens_wrong_length": (
        dict(cache_seqlens=int32([3, 7, 1])),
        r"cache_seqlens must have shape",
    ),
    "cache_seqlens_past_end": (dict(cache_seqlens=int32([3, 16])), r"cache_seqlens\[1\]"),
    "cache_batch_idx_out_of_range": (
        dict(cache_batch_idx=int32([0, 2])),
        r"cache_batch_idx\[1\] = 2",
    ),
    "cache_leftpad_past_seqlen": (dict(cache_leftpad=int32([4, 0])), r"cache_leftpad\[0\] = 4"),
    "block_table_wrong_shape": (
        dict(k_cache=rand(8, 4, 2, 32), v_cache=rand(8, 4, 2, 32), block_table=int32([[0, 1]])),
        r"block_table must have shape",
    ),
    "block_table_cache_batch_idx_past_table": (
        dict(
            k_cache=rand(8, 4, 2, 32),
            v_cache=rand(8, 4, 2, 32),
            block_table=int32([[0, 1, 2, 3], [4, 5, 6, 7]]),
            cache_batch_idx=int32([0, 2]),
        ),
        r"cache_batch_idx\[1\] = 2 must be in \[0, 2\) \(the rows of block_table",
    ),
    "block_table_bad_index": (
        dict(
            k_cache=rand(8, 4, 2, 32),
            v_cache=rand(8, 4, 2, 32),
            block_table=int32([[0, 1, 2, 3], [4, 9, 6, 7]]),
        ),
        r"block_table\[1, 1\] = 9",
    ),
    "rotary_cos_without_sin": (dict(rotary_cos=rand(16, 8)), r"rotary_cos and rotary_sin"),
    "rotary_dim_too_large": (dict(rotary_cos=rand(16, 24), rotary_sin=rand(16, 24)), r"rotary_dim"),
    "rotary_too_few_rows": (
        dict(rotary_cos=rand(4, 8), rotary_sin=rand(4, 8)),
        r"rotary_cos / rotary_sin",
    ),
    "alibi_wrong_shape": (dict(alibi_slopes=torch.rand(5)), r"alibi_slopes must have shape"),
}


@pytest.mark.parametrize("case", sorted(KVCACHE_CASES))
def test_fwd_kvcache_op(case):
    changes, message = KVCACHE_CASES[case]
    with pytest.raises(ERRORS, match=message):
        ops.fwd_kvcache(**kvcache_kwargs(**changes))


# ---------------------------------------------------------------------------
# The *_out ops: out is the caller's buffer
# ---------------------------------------------------------------------------

OUT_CASES = {
    "float32": (
        lambda like: torch.empty(like.shape, dtype=torch.float32),
        r"out must have the dtype of q \(BFloat16\), got Float",
    ),
    "wrong_shape": (
        lambda like: torch.empty(like.shape[:-1] + (16,), dtype=BF16),
        r"out must have shape",
    ),
    "last_dim_strided": (
        lambda like: strided_last_dim(*like.shape),
        r"out must have a contiguous last dimension",
    ),
    "expanded": (
        lambda like: rand(*like.shape[:-2], 1, like.shape[-1]).expand(like.shape),
        r"out must not have elements that share memory",
    ),
    "is_q": (lambda like: like, r"out must not share memory with an input"),
}


def _out_op_call(op, like_q):
    # One call of each *_out op whose q is like_q.
    if op == "fwd_out":
        return ops.fwd_out, fwd_kwargs(q=like_q)
    if op == "varlen_fwd_out":
        return ops.varlen_fwd_out, varlen_kwargs(q=like_q)
    return ops.fwd_kvcache_out, kvcache_kwargs(q=like_q)


@pytest.mark.parametrize("op", ["fwd_out", "varlen_fwd_out", "fwd_kvcache_out"])
@pytest.mark.parametrize("case", sorted(OUT_CASES))
def test_out_ops_check_out(op, case):
    shapes = {
        "fwd_out": (2, 9, 4, 32),
        "varlen_fwd_out": (9, 4, 32),
        "fwd_kvcache_out": (2, 1, 4, 32),
    }
    q = rand(*shapes[op])
    make_out, message = OUT_CASES[case]
    fn, kwargs = _out_op_call(op, q)
    with pytest.raises(ERRORS, match=message):
        fn(**kwargs, out=make_out(q))
    fn(**kwargs, out=torch.empty_like(q))  # a good out passes


# ---------------------------------------------------------------------------
# The Python API
# ---------------------------------------------------------------------------


def qkv(d=32, nheads=4, nheads_k=2, dtype=BF16):
    return (
        rand(2, 9, nheads, d, dtype=dtype),
        rand(2, 11, nheads_k, d, dtype=dtype),
        rand(2, 11, nheads_k, d, dtype=dtype),
    )


API_CASES = {
    "q_float64": (lambda: flash_attn_func(*qkv(dtype=torch.float64)), r"q must have dtype"),
    "k_other_dtype": (
        lambda: flash_attn_func(qkv()[0], *qkv(dtype=torch.float16)[1:]),
        r"k must have the same dtype as q",
    ),
    "head_dim_over_1024_on_cpu": (
        lambda: flash_attn_func(*qkv(d=1030)),
        r"head dimension \(last dim of q\) must be at most 1024 on the CPU, got 1030",
    ),
    "nheads_not_divisible": (
        lambda: flash_attn_func(*qkv(nheads=6, nheads_k=4)),
        r"heads of q \(6\)",
    ),
    "k_shape_mismatch": (
        lambda: flash_attn_func(qkv()[0], rand(3, 11, 2, 32), rand(3, 11, 2, 32)),
        r"\bk must have shape",
    ),
    "q_3d": (lambda: flash_attn_func(rand(9, 4, 32), *qkv()[1:]), r"\bq must be 4-D"),
    "dropout_negative": (
        lambda: flash_attn_func(*qkv(), dropout_p=-0.5),
        r"dropout_p must be in \[0, 1\)",
    ),
    "dropout_one": (
        lambda: flash_attn_func(*qkv(), dropout_p=1.0),
        r"dropout_p must be in \[0, 1\)",
    ),
    "window_size_not_pair": (
        lambda: flash_attn_func(*qkv(), window_size=(1, 2, 3)),
        r"window_size must be a pair",
    ),
    "alibi_wrong_shape": (
        lambda: flash_attn_func(*qkv(), alibi_slopes=torch.rand(2)),
        r"alibi_slopes must have shape",
    ),
    "k_on_other_device": (
        lambda: flash_attn_func(qkv()[0], *(t.to("meta") for t in qkv()[1:])),
        r"\bk must be on the same device as q",
    ),
    "qkv_wrong_packing": (
        lambda: flash_attn_qkvpacked_func(rand(2, 9, 2, 4, 32)),
        r"qkv must have size 3 at dim 2",
    ),
    "kv_wrong_rank": (
        lambda: flash_attn_kvpacked_func(qkv()[0], rand(2, 11, 2, 32)),
        r"\bkv must be 5-D",
    ),
    "varlen_cu_seqlens_int64": (
        lambda: flash_attn_varlen_func(
            rand(9, 4, 32),
            rand(12, 2, 32),
            rand(12, 2, 32),
            torch.tensor([0, 3, 9]),
            int32([0, 5, 12]),
            6,
            7,
        ),
        r"cu_seqlens_q must have dtype int32",
    ),
    "varlen_cu_seqlens_wrong_length": (
        lambda: flash_attn_varlen_func(
            rand(9, 4, 32),
            rand(12, 2, 32),
            rand(12, 2, 32),
            int32([0, 3, 9]),
            int32([0, 12]),
            6,
            12,
        ),
        r"cu_seqlens_k must have as many entries",
    ),
    "varlen_cu_seqlens_on_other_device": (
        lambda: flash_attn_varlen_func(
            rand(9, 4, 32),
            rand(12, 2, 32),
            rand(12, 2, 32),
            int32([0, 3, 9], device="meta"),
            int32([0, 5, 12]),
            6,
            7,
        ),
        r"cu_seqlens_q must be on the same device as q",
    ),
    "varlen_block_table_wrong_shape": (
        lambda: flash_attn_varlen_func(
            rand(9, 4, 32),
            rand(6, 4, 2, 32),
            rand(6, 4, 2, 32),
            int32([0, 3, 9]),
            int32([0, 5, 12]),
            6,
            7,
            block_table=int32([[0, 1]]),
        ),
        r"block_table must have shape",
    ),
    "varlen_paged_k_without_block_table": (
        lambda: flash_attn_varlen_func(
            rand(9, 4, 32),
            rand(6, 4, 2, 32),
            rand(6, 4, 2, 32),
            int32([0, 3, 9]),
            int32([0, 5, 12]),
            6,
            7,
        ),
        r"\bk must be 3-D",
    ),
    "kvcache_head_dim_over_1024_on_cpu": (
        lambda: flash_attn_with_kvcache(
            rand(2, 1, 4, 1030), rand(2, 8, 2, 1030), rand(2, 8, 2, 1030)
        ),
        r"head dimension \(last dim of q\) must be at most 1024 on the CPU, got 1030",
    ),
    "kvcache_nheads_not_divisible": (
        lambda: flash_attn_with_kvcache(rand(2, 1, 3, 32), rand(2, 8, 2, 32), rand(2, 8, 2, 32)),
        r"nheads of q \(3\)",
    ),
    "kvcache_strided_cache": (
        lambda: flash_attn_with_kvcache(
            rand(2, 1, 4, 32), strided_last_dim(2, 8, 2, 32), rand(2, 8, 2, 32)
        ),
        r"k_cache must have a contiguous last dimension",
    ),
    "kvcache_cache_seqlens_past_end": (
        lambda: flash_attn_with_kvcache(
            rand(2, 1, 4, 32),
            rand(2, 8, 2, 32),
            rand(2, 8, 2, 32),
            rand(2, 1, 2, 32),
            rand(2, 1, 2, 32),
            cache_seqlens=8,
        ),
        r"cache_seqlens\[0\]",
    ),
    "varlen_seqused_k_past_sequence": (
        lambda: flash_attn_varlen_func(
            rand(9, 4, 32),
            rand(12, 2, 32),
            rand(12, 2, 32),
            int32([0, 3, 9]),
            int32([0, 5, 12]),
            6,
            7,
            seqused_k=int32([6, 7]),
        ),
        r"seqused_k\[0\] = 6 must be in \[0, 5\]",
    ),
    "varlen_seqused_k_on_other_device": (
        lambda: flash_attn_varlen_func(
            rand(9, 4, 32),
            rand(12, 2, 32),
            rand(12, 2, 32),
            int32([0, 3, 9]),
            int32([0, 5, 12]),
            6,
            7,
            seqused_k=int32([2, 7], device="meta"),
        ),
        r"seqused_k must be on the same device as q",
    ),
    "varlen_no_cu_seqlens_k_without_paged_seqused": (
        lambda: flash_attn_varlen_func(
            rand(9, 4, 32),
            rand(12, 2, 32),
            rand(12, 2, 32),
            int32([0, 3, 9]),
            None,
            6,
            7,
            seqused_k=int32([2, 7]),
        ),
        r"cu_seqlens_k may be None only with block_table and seqused_k",
    ),
    "func_out_wrong_shape": (
        lambda: flash_attn_func(*qkv(), out=rand(2, 9, 4, 16)),
        r"flash_attn_func: out must have shape \(batch_size, seqlen_q, nheads, headdim\)",
    ),
    "func_out_wrong_dtype": (
        lambda: flash_attn_func(*qkv(), out=rand(2, 9, 4, 32, dtype=torch.float16)),
        r"flash_attn_func: out must have the dtype of q",
    ),
    "func_out_on_other_device": (
        lambda: flash_attn_func(*qkv(), out=rand(2, 9, 4, 32, device="meta")),
        r"out must be on the device of q",
    ),
    "func_out_last_dim_strided": (
        lambda: flash_attn_func(*qkv(), out=strided_last_dim(2, 9, 4, 32)),
        r"out must have a contiguous last dimension",
    ),
    "func_out_with_grad": (
        lambda: flash_attn_func(*(t.requires_grad_() for t in qkv()), out=rand(2, 9, 4, 32)),
        r"out= does not support autograd",
    ),
    "varlen_out_wrong_shape": (
        lambda: flash_attn_varlen_func(
            rand(9, 4, 32),
            rand(12, 2, 32),
            rand(12, 2, 32),
            int32([0, 3, 9]),
            int32([0, 5, 12]),
            6,
            7,
            out=rand(12, 4, 32),
        ),
        r"flash_attn_varlen_func: out must have shape \(total_q, nheads, headdim\)",
    ),
    "kvcache_out_wrong_shape": (
        lambda: flash_attn_with_kvcache(
            rand(2, 1, 4, 32), rand(2, 8, 2, 32), rand(2, 8, 2, 32), out=rand(2, 2, 4, 32)
        ),
        r"flash_attn_with_kvcache: out must have shape",
    ),
    "kvcache_on_other_device": (
        lambda: flash_attn_with_kvcache(
            rand(2, 1, 4, 32), rand(2, 8, 2, 32, device="meta"), rand(2, 8, 2, 32, device="meta")
        ),
        r"k_cache must be on the same device as q",
    ),
}


@pytest.mark.parametrize("case", sorted(API_CASES))
def test_python_api(case):
    call, message = API_CASES[case]
    with pytest.raises(ERRORS, match=message):
        call()


def test_out_that_is_not_a_tensor():
    with pytest.raises(TypeError, match=r"flash_attn_func: out must be a torch.Tensor, got list"):
        flash_attn_func(*qkv(), out=[1, 2])


@pytest.mark.cuda
def test_tensors_on_different_devices_reach_the_op():
    # Only a GPU gives the op two real devices to compare (CPU next to meta would
    # dispatch to the meta kernel instead of the checks).
    q = rand(2, 9, 4, 32, device="cuda")
    k, v = rand(2, 11, 2, 32), rand(2, 11, 2, 32)
    with pytest.raises(ERRORS, match=r"\bk must be on the same device as q"):
        ops.fwd(**fwd_kwargs(q=q, k=k, v=v))
    with pytest.raises(ERRORS, match=r"cu_seqlens_q must be on the same device as q"):
        ops.varlen_fwd(
            **varlen_kwargs(
                q=rand(9, 4, 32, device="cuda"),
                k=rand(12, 2, 32, device="cuda"),
                v=rand(12, 2, 32, device="cuda"),
            )
        )
    with pytest.raises(ERRORS, match=r"k_cache must be on the same device as q"):
        ops.fwd_kvcache(**kvcache_kwargs(q=rand(2, 1, 4, 32, device="cuda")))


# ---------------------------------------------------------------------------
# window_size, head dim 0 and index tensors on every public function
# ---------------------------------------------------------------------------


def _varlen_qkv(d=32):
    return rand(9, 4, d), rand(12, 2, d), rand(12, 2, d)


CU_Q, CU_K = [0, 3, 9], [0, 5, 12]


def _each_function(d=32, **kwargs):
    """{name: call} of every public function with the same extra arguments."""
    q, k, v = qkv(d=d)
    vq, vk, vv = _varlen_qkv(d=d)
    return {
        "func": lambda: flash_attn_func(q, k, v, **kwargs),
        "kvpacked": lambda: flash_attn_kvpacked_func(q, torch.stack([k, v], 2), **kwargs),
        "qkvpacked": lambda: flash_attn_qkvpacked_func(torch.stack([q, q, q], 2), **kwargs),
        "varlen": lambda: flash_attn_varlen_func(
            vq, vk, vv, int32(CU_Q), int32(CU_K), 6, 7, **kwargs
        ),
        "varlen_kvpacked": lambda: flash_attn_varlen_kvpacked_func(
            vq, torch.stack([vk, vv], 1), int32(CU_Q), int32(CU_K), 6, 7, **kwargs
        ),
        "varlen_qkvpacked": lambda: flash_attn_varlen_qkvpacked_func(
            torch.stack([vq, vq, vq], 1), int32(CU_Q), 6, **kwargs
        ),
        "kvcache": lambda: flash_attn_with_kvcache(
            rand(2, 1, 4, d), rand(2, 8, 2, d), rand(2, 8, 2, d), **kwargs
        ),
    }


FUNCTIONS = sorted(_each_function())


@pytest.mark.parametrize("function", FUNCTIONS)
@pytest.mark.parametrize(
    "window_size, message",
    [
        (
            16,
            r"window_size must be a pair \(left, right\) of ints, -1 for an unbounded side, got 16 \(int\)",
        ),
        ((0.5, 1.7), r"window_size must hold ints \(left, right\), got \(0\.5, 1\.7\)"),
        ((4, 2.0), r"window_size must hold ints \(left, right\), got \(4, 2\.0\)"),
        (None, r"window_size must be a pair .* got None \(NoneType\)"),
    ],
    ids=["int", "floats", "one_float", "none"],
)
def test_window_size_must_be_a_pair_of_ints(function, window_size, message):
    with pytest.raises(TypeError, match=message):
        _each_function(window_size=window_size)[function]()


@pytest.mark.parametrize("function", FUNCTIONS)
def test_window_size_of_integer_values_is_taken(function):
    # Not only Python ints: a list, and an integer tensor value, are pairs of ints too.
    out = _each_function(window_size=[torch.tensor(3), -1])[function]()
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("function", FUNCTIONS)
def test_head_dim_zero(function):
    with pytest.raises(
        ValueError, match=r"head dimension \(last dim of q\) must be at least 1, got 0"
    ):
        _each_function(d=0)[function]()


def test_head_dim_of_v_zero():
    q, k, _ = qkv()
    with pytest.raises(
        ValueError, match=r"head dimension of v \(last dim\) must be at least 1, got 0"
    ):
        flash_attn_func(q, k, rand(2, 11, 2, 0))


@pytest.mark.parametrize("which", ["cu_seqlens_q", "cu_seqlens_k"])
def test_cu_seqlens_as_a_list(which):
    cu = {"cu_seqlens_q": int32(CU_Q), "cu_seqlens_k": int32(CU_K)}
    cu[which] = CU_Q if which == "cu_seqlens_q" else CU_K
    with pytest.raises(TypeError, match=rf"{which} must be a torch.Tensor or None, got list"):
        flash_attn_varlen_func(*_varlen_qkv(), cu["cu_seqlens_q"], cu["cu_seqlens_k"], 6, 7)


def test_sdpa_provider_head_dim_zero_and_fractional_windows():
    from flash_attn_cuda.integrations import sdpa

    bhsd = rand(1, 2, 8, 0, dtype=torch.float32)
    with pytest.raises(sdpa.UnsupportedAttentionCall, match=r"head dim must be at least 1, got 0"):
        sdpa.scaled_dot_product_flash_attention(bhsd, bhsd, bhsd, 0.0, False, False)
    bshd = rand(1, 8, 2, 32, dtype=torch.float32)
    for side in ("window_size_left", "window_size_right"):
        with pytest.raises(
            TypeError, match=rf"{side} must be an int \(-1 for no bound\), got 0\.5"
        ):
            sdpa.flash_attention_forward(
                bshd, bshd, bshd, None, None, 8, 8, 0.0, False, False, **{side: 0.5}
            )
