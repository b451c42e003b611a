"""CUDA tests of fwd_kvcache at head dims above 256 (compiled head dim 512).

The split-KV kernel's d512 instance splits each warp's output columns: its four
warps are two key slabs x two halves of the value dim, the two warps of a slab
computing the same scores (splitkv_tile_config.h, splitkv_warps_v). The forward
ops run on it too (test_cuda_fwd_d512.py), the backward on the SM80 kernel in
head-dim slabs (test_cuda_bwd_d512.py). Inputs and checks are
test_cuda_kvcache.py's: the float64 reference, the CPU op, the caches after an
append.

Every test here needs a GPU and is skipped with a reason without one.
"""

import pytest
import torch
import torch.nn.functional as F

import flash_attn_cuda
from test_cpu_kvcache import check_against_reference, make_inputs, op_args
from test_cuda_kvcache import (
    DTYPE_IDS,
    DTYPES,
    check_all,
    check_matches_cpu_op,
    check_paged_matches_contiguous,
    run_cuda,
)

pytestmark = pytest.mark.cuda

fwd_kvcache = torch.ops.flash_attn.fwd_kvcache


def inputs(head_dim=512, **overrides):
    """make_inputs at head_dim, 8:2 heads, one query, bf16 unless overridden."""
    fields = dict(
        batch=3,
        seqlen_q=1,
        capacity=301,
        nheads=8,
        nheads_k=2,
        head_dim=head_dim,
        dtype=torch.bfloat16,
    )
    fields.update(overrides)
    return make_inputs(**fields)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "seqlen_new,rotary", [(0, None), (3, None), (3, "neox")], ids=["no_new", "new", "new_rotary"]
)
@pytest.mark.parametrize("heads", [(8, 8), (32, 8), (6, 1)], ids=["mha", "gqa4", "mqa6"])
@pytest.mark.parametrize("seqlen_q", [1, 3, 16])
def test_matches_reference(dtype, causal, seqlen_new, rotary, heads, seqlen_q):
    """Query rows of a kv head = seqlen_q x group: 1 to 96, so one to six query
    blocks of 16 rows (d512 has no 64-row variant)."""
    args = inputs(
        seqlen_q=seqlen_q,
        nheads=heads[0],
        nheads_k=heads[1],
        dtype=dtype,
        seqlen_new=seqlen_new,
        rotary=rotary,
        causal=causal,
    )
    check_all(args, run_cuda(args), seqlen_new, rotary)


@pytest.mark.parametrize("head_dim", [264, 320, 384, 448, 504, 512])
def test_head_dims_above_256(head_dim):
    """Every head dim in (256, 512] runs the d512 kernel on zero-padded columns."""
    args = inputs(head_dim=head_dim, seqlen_q=2, seqlen_new=2, rotary="neox", causal=True)
    check_all(args, run_cuda(args), 2, "neox")


@pytest.mark.parametrize("head_dim_v", [128, 256, 264, 384, 504])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_value_dims_below_512(head_dim_v, num_splits):
    """d_v < d_qk = 512: V's columns past d_v are zero-filled in shared memory,
    so a value half past d_v computes zeros, and the merge writes O's d_v
    columns only. Bit for bit the same call on V zero-padded to 512 columns
    (which the float64 reference and the CPU op check), cut to d_v."""
    args = inputs(seqlen_q=2, nheads=16, nheads_k=4, causal=True, seqlen_new=2)
    args["num_splits"] = num_splits
    padded = run_cuda(args)
    check_all(args, padded, 2, None)
    narrow = dict(args, v_cache=args["v_cache"][..., :head_dim_v].contiguous())
    narrow["v"] = args["v"][..., :head_dim_v].contiguous()
    out, lse, k_after, v_after = run_cuda(narrow)
    assert out.shape[-1] == head_dim_v
    assert torch.equal(out, padded[0][..., :head_dim_v]) and torch.equal(lse, padded[1])
    assert torch.equal(k_after, padded[2]) and torch.equal(v_after, padded[3][..., :head_dim_v])


@pytest.mark.parametrize("page_size", [1, 16, 64, 256])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_matches_contiguous(page_size, num_splits):
    capacity = 512 if page_size == 256 else 320
    args = inputs(
        capacity=capacity,
        seqlen_q=2,
        nheads=16,
        nheads_k=4,
        seqlen_new=2,
        rotary="neox",
        causal=True,
    )
    args["cache_seqlens"] = torch.tensor([255, 17, capacity - 2], dtype=torch.int32)
    check_paged_matches_contiguous(args, page_size, num_splits, 2, "neox")


@pytest.mark.parametrize("batch,nheads,nheads_k", [(1, 32, 8), (16, 32, 8), (2, 8, 1)])
def test_long_cache_default_splits(batch, nheads, nheads_k):
    """Decode as served: one query, the op's split count, thousands of keys, so
    that each split streams many 32-key tiles through both stages."""
    args = inputs(
        batch=batch, capacity=4133, nheads=nheads, nheads_k=nheads_k, seqlen_new=1, rotary="neox"
    )
    check_all(args, run_cuda(args), 1, "neox")


@pytest.mark.parametrize("num_splits", [1, 5])
def test_num_splits_agree(num_splits):
    args = inputs(capacity=2000, nheads=16, nheads_k=4, seqlen_q=4, causal=True)
    one = run_cuda(args, num_splits=1)
    got = run_cuda(args, num_splits=num_splits)
    torch.testing.assert_close(got[0].float(), one[0].float(), atol=2e-2, rtol=2e-2)
    check_against_reference(args, got[0], got[1])


@pytest.mark.parametrize("feature", ["softcap", "alibi", "window", "sink"])
def test_score_features(feature):
    """The score-extras instance (softcap, ALiBi) and the mask and sink paths
    of the plain one, at d512."""
    args = inputs(capacity=700, seqlen_q=3, nheads=8, nheads_k=2, causal=True)
    if feature == "softcap":
        args["softcap"] = 30.0
    elif feature == "alibi":
        args["alibi_slopes"] = torch.rand(8, dtype=torch.float32)
    elif feature == "window":
        args["window_size_left"], args["window_size_right"] = 100, 0
    else:
        args["learnable_sink"] = torch.randn(8, dtype=torch.float32)
    for num_splits in (1, 4):
        call = dict(args, num_splits=num_splits)
        got = run_cuda(call)
        if feature == "sink":  # the float64 reference has no sinks; the CPU op has
            check_matches_cpu_op(call, got, None)
        else:
            check_against_reference(call, got[0], got[1])


def test_varlen_query():
    """FA3's varlen query (cu_seqlens_q) over the d512 kernel's query blocks."""
    lens = [3, 0, 20]
    # Not causal: a row's keys then do not depend on its sequence's length.
    args = inputs(batch=3, seqlen_q=max(lens), nheads=8, nheads_k=2)
    q = args["q"]
    packed = torch.cat([q[b, :n] for b, n in enumerate(lens)])
    cu = torch.tensor([0, 3, 3, 23], dtype=torch.int32)
    varlen = dict(args, q=packed, cu_seqlens_q=cu, max_seqlen_q=max(lens))
    out = run_cuda(varlen)[0]
    dense = run_cuda(args)[0]
    for b, n in enumerate(lens):
        start = int(cu[b])
        assert torch.equal(out[start : start + n], dense[b, :n])


def test_v_as_column_slice_of_k():
    """v_cache = k_cache[..., :256] (a view, no copy), as absorbed decode passes it."""
    from flash_attn_cuda import flash_attn_with_kvcache

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(4, 1, 32, 512, device="cuda", dtype=torch.bfloat16, generator=g)
    k_cache = torch.randn(4, 900, 1, 512, device="cuda", dtype=torch.bfloat16, generator=g)
    v_cache = k_cache[..., :256]
    seqlens = torch.tensor([899, 1, 450, 64], dtype=torch.int32, device="cuda")
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)
    padded = flash_attn_with_kvcache(
        q, k_cache.clone(), F.pad(v_cache, (0, 256)), cache_seqlens=seqlens
    )
    assert torch.equal(out, padded[..., :256])


def test_forward_and_larger_head_dims_refused():
    """The forwards serve head dims up to 512 on CUDA; fwd_kvcache above 512
    only absorbed MLA's (d_qk up to 576, d_v up to 512); above 576 nothing."""
    q = torch.randn(1, 4, 2, 520, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"at most 512 on cuda"):
        flash_attn_cuda.flash_attn_func(q, q, q)
    q = torch.randn(1, 1, 2, 520, device="cuda", dtype=torch.bfloat16)
    cache = torch.randn(1, 64, 2, 520, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"d_v .* must be at most 512, got 520"):
        flash_attn_cuda.flash_attn_with_kvcache(q, cache, cache)
    q = torch.randn(1, 1, 2, 584, device="cuda", dtype=torch.bfloat16)
    cache = torch.randn(1, 64, 2, 584, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"at most 576 on cuda"):
        flash_attn_cuda.flash_attn_with_kvcache(q, cache, cache[..., :512])
    with pytest.raises(RuntimeError, match=r"head_dim .* at most 576 on CUDA .*, got 584"):
        fwd_kvcache(**op_args(q, cache, cache[..., :512]))


D512_BAD_INDEX_CASES = [
    "table_entry_1000",
    "seqlens_past_table",
    "append_past_table",
    "append_past_contiguous",
    "batch_idx_7",
    "leftpad_past_seqlens",
    "paged_batch_idx_past_table",
    "varlen_cu_new_past_rows",
]


@pytest.mark.parametrize("num_splits", [0, 3])
@pytest.mark.parametrize("case", D512_BAD_INDEX_CASES)
def test_bad_index_values_at_d512(case, num_splits, monkeypatch):
    """test_cuda_index_safety.py's KV-cache cases at head dim 512: the CPU
    path's error, deferred (check_index_errors) and with sync checks, and no
    write outside the caches."""
    import test_cuda_index_safety as safety

    monkeypatch.setattr(safety, "HEAD_DIM", 512)
    kwargs, buffers, pattern = safety._kvcache_case(case)
    kwargs["num_splits"] = num_splits
    expected = safety._cpu_message(safety._kvcache_call, kwargs)
    assert pattern in expected, expected
    previous = flash_attn_cuda.set_sync_index_checks(False)
    try:
        flash_attn_cuda.check_index_errors()  # nothing recorded before
        safety._kvcache_call(**kwargs)
        with pytest.raises(RuntimeError) as info:
            flash_attn_cuda.check_index_errors()
        assert str(info.value).splitlines()[0] == expected
        flash_attn_cuda.set_sync_index_checks(True)
        with pytest.raises(RuntimeError) as info:
            safety._kvcache_call(**kwargs)
        assert str(info.value).splitlines()[0] == expected
    finally:
        flash_attn_cuda.set_sync_index_checks(previous)
    for buffer in buffers:
        assert (buffer[0] == 7.0).all() and (buffer[-1] == 7.0).all()
