"""CPU tests of FA3's call shapes of fwd_kvcache: block_table with cache_leftpad,
block_table with cache_batch_idx, and rotary_seqlens.

Semantics (docs/serving.md, FA3's hopper/seqlen.h and hopper/paged_kv.h):
- paged + cache_leftpad: sequence b attends its logical rows
  [cache_leftpad[b], cache_seqlens[b] + seqlen_new), each found through the
  block table as for any paged row; the append writes at cache_seqlens[b] + i;
- paged + cache_batch_idx: batch entry b uses block_table row cache_batch_idx[b];
- rotary_seqlens[b] replaces cache_seqlens[b] as the rotary position of the
  first new key and of query row 0 (row i under causal / local).
Checked against the float64 reference of test_cpu_kvcache.py.
"""

import pytest
import torch

from test_cpu_kvcache import (
    MODES,
    check_against_reference,
    check_caches,
    make_inputs,
    page_cache,
    run,
    unpage,
)

import flash_attn_cuda

WINDOWS = {  # causal, (left, right)
    "full": (False, (-1, -1)),
    "causal": (True, (-1, -1)),
    "local_3_1": (False, (3, 1)),
}


def paged_leftpad_inputs(page_size, mode, window, dtype=torch.float32, heads=(6, 2), capacity=150):
    seqlen_new, rotary = MODES[mode]
    causal, (left, right) = WINDOWS[window]
    args = make_inputs(
        batch=4,
        seqlen_q=3,
        capacity=capacity,
        nheads=heads[0],
        nheads_k=heads[1],
        dtype=dtype,
        seqlen_new=seqlen_new,
        rotary=rotary,
        leftpad=True,
        page_size=page_size,
        causal=causal,
        window=(left, right),
    )
    # Edge cases: no left padding, and padding up to the end (no old key).
    args["cache_leftpad"][0] = 0
    args["cache_leftpad"][1] = args["cache_seqlens"][1]
    return args


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("window", list(WINDOWS))
def test_paged_leftpad_matches_reference(page_size, mode, window):
    args = paged_leftpad_inputs(page_size, mode, window)
    out, lse, k_after, v_after = run(args)
    check_against_reference(args, out, lse)
    if args["k"] is not None:
        check_caches(args, k_after, v_after)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("mode", ["new", "new_rotary_neox"])
def test_paged_leftpad_matches_contiguous(page_size, mode):
    """The same call on the contiguous cache and on its pages: same bits."""
    args = paged_leftpad_inputs(None, mode, "causal", dtype=torch.bfloat16, capacity=144)
    out, lse, k_after, v_after = run(args)
    paged = dict(args)
    page_cache(paged, page_size)
    out_p, lse_p, k_after_p, v_after_p = run(paged)
    assert torch.equal(out, out_p) and torch.equal(lse, lse_p)
    assert torch.equal(unpage(k_after_p, paged["block_table"]), k_after)
    assert torch.equal(unpage(v_after_p, paged["block_table"]), v_after)


def test_paged_leftpad_ignores_pages_before_the_padding():
    args = paged_leftpad_inputs(4, "new_rotary_interleaved", "causal")
    args["cache_seqlens"] = torch.tensor([9, 20, 30, 12], dtype=torch.int32)
    args["cache_leftpad"] = torch.tensor([0, 8, 13, 12], dtype=torch.int32)
    out, lse, k_after, v_after = run(args)
    table = args["block_table"].clone()
    table[1, :2] = -1  # rows 0..7, all before leftpad 8
    table[2, :3] = 10**6  # rows 0..11
    table[3, :3] = -7
    out_g, lse_g, k_after_g, v_after_g = run(args, block_table=table)
    assert torch.equal(out, out_g) and torch.equal(lse, lse_g)
    assert torch.equal(k_after, k_after_g) and torch.equal(v_after, v_after_g)


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("mode", ["no_new", "new", "new_rotary_interleaved"])
@pytest.mark.parametrize("leftpad", [False, True], ids=["no_pad", "leftpad"])
def test_paged_cache_batch_idx(page_size, mode, leftpad):
    """cache_batch_idx[b] picks b's block_table row, among more rows than the batch."""
    seqlen_new, rotary = MODES[mode]
    cache_batch_idx = torch.tensor([4, 0, 2], dtype=torch.int32)
    contiguous = make_inputs(
        batch=3,
        seqlen_q=2,
        capacity=128,
        batch_cache=5,
        cache_batch_idx=cache_batch_idx,
        seqlen_new=seqlen_new,
        rotary=rotary,
        leftpad=leftpad,
        causal=True,
    )
    paged = dict(contiguous)
    page_cache(paged, page_size)
    assert paged["block_table"].shape[0] == 5
    out, lse, k_after, v_after = run(paged)
    check_against_reference(paged, out, lse)
    if seqlen_new:
        check_caches(paged, k_after, v_after)
    # Same result as the contiguous cache with the same cache_batch_idx.
    out_c, lse_c, k_after_c, v_after_c = run(contiguous)
    torch.testing.assert_close(out, out_c, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, lse_c, atol=1e-6, rtol=1e-6)
    assert torch.equal(unpage(k_after, paged["block_table"]), k_after_c)
    assert torch.equal(unpage(v_after, paged["block_table"]), v_after_c)


def test_paged_cache_batch_idx_head_dim_v_smaller():
    """d_v < d_qk: the appended v rows go back through the selected table rows."""
    cache_batch_idx = torch.tensor([1, 0], dtype=torch.int32)
    args = make_inputs(
        batch=2, seqlen_q=1, capacity=32, batch_cache=3, cache_batch_idx=cache_batch_idx
    )
    args["k"] = torch.randn(2, 2, 2, 32)
    args["v"] = torch.randn(2, 2, 2, 16)
    args["cache_seqlens"] = torch.tensor([5, 30], dtype=torch.int32)
    page_cache(args, 8)
    args["v_cache"] = args["v_cache"][..., :16].contiguous()
    _, _, _, v_after = run(args)
    table = args["block_table"].long()
    for b, row in enumerate(cache_batch_idx.tolist()):
        end = int(args["cache_seqlens"][b])
        for i in range(2):
            pos = end + i
            assert torch.equal(v_after[table[row, pos // 8], pos % 8], args["v"][b, i])


ROTARY_WINDOWS = ["full", "causal", "local_3_1"]


@pytest.mark.parametrize("rotary", ["interleaved", "neox"])
@pytest.mark.parametrize("window", ROTARY_WINDOWS)
@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "paged16"])
@pytest.mark.parametrize("leftpad", [False, True], ids=["no_pad", "leftpad"])
def test_rotary_seqlens(rotary, window, page_size, leftpad):
    causal, (left, right) = WINDOWS[window]
    args = make_inputs(
        batch=3,
        seqlen_q=3,
        capacity=48,
        nheads=6,
        nheads_k=2,
        seqlen_new=2,
        rotary=rotary,
        rotary_dim=16,
        leftpad=leftpad,
        page_size=page_size,
        causal=causal,
        window=(left, right),
    )
    # Positions unrelated to the cache lengths: 0, the last that fits, and one between.
    room = 3
    args["rotary_seqlens"] = torch.tensor([0, 48 - room, 7], dtype=torch.int32)
    out, lse, k_after, v_after = run(args)
    check_against_reference(args, out, lse)
    check_caches(args, k_after, v_after)
    # It does change the result (the reference is not blind to it).
    out_default, _, k_default, _ = run(args, rotary_seqlens=None)
    assert not torch.equal(out, out_default) or not torch.equal(k_after, k_default)


def test_rotary_seqlens_equal_to_cache_seqlens_changes_nothing():
    args = make_inputs(batch=3, seqlen_q=2, capacity=40, seqlen_new=3, rotary="neox", causal=True)
    out, lse, k_after, v_after = run(args)
    out_r, lse_r, k_after_r, v_after_r = run(args, rotary_seqlens=args["cache_seqlens"].clone())
    assert torch.equal(out, out_r) and torch.equal(lse, lse_r)
    assert torch.equal(k_after, k_after_r) and torch.equal(v_after, v_after_r)


@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "paged16"])
def test_flash_attn_with_kvcache_rotary_seqlens_and_paged_shapes(page_size):
    """The Python API passes rotary_seqlens, and paged leftpad / cache_batch_idx."""
    args = make_inputs(
        batch=2,
        seqlen_q=1,
        capacity=64,
        batch_cache=3,
        cache_batch_idx=torch.tensor([2, 0], dtype=torch.int32),
        seqlen_new=1,
        rotary="neox",
        leftpad=True,
        page_size=page_size,
        causal=True,
    )
    args["rotary_seqlens"] = torch.tensor([5, 11], dtype=torch.int32)
    k_cache, v_cache = args["k_cache"].clone(), args["v_cache"].clone()
    out, lse = flash_attn_cuda.flash_attn_with_kvcache(
        args["q"],
        k_cache,
        v_cache,
        k=args["k"],
        v=args["v"],
        rotary_cos=args["rotary_cos"],
        rotary_sin=args["rotary_sin"],
        cache_seqlens=args["cache_seqlens"],
        cache_batch_idx=args["cache_batch_idx"],
        cache_leftpad=args["cache_leftpad"],
        block_table=args["block_table"],
        causal=True,
        rotary_interleaved=False,
        return_softmax_lse=True,
        rotary_seqlens=args["rotary_seqlens"],
    )
    check_against_reference(args, out, lse)
    check_caches(args, k_cache, v_cache)
