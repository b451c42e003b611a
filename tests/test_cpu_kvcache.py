"""CPU tests of torch.ops.flash_attn.fwd_kvcache (flash_attn_with_kvcache semantics).

The reference below restates the op in plain torch, in float64, from the caches as
they are before the call: new tokens rotated and appended at cache_seqlens[b],
keys [cache_leftpad[b], cache_seqlens[b] + seqlen_new) attended, the causal /
local window aligned to the bottom-right corner of that per-batch key range.
"""

import math

import pytest
import torch

import flash_attn_cuda  # noqa: F401  (registers torch.ops.flash_attn)

fwd_kvcache = torch.ops.flash_attn.fwd_kvcache


# ----------------------------------------------------------------------------
# reference


def apply_rotary(x, cos, sin, positions, interleaved):
    """Rotates the first 2 * cos.shape[1] dims of x (b, s, h, d) at positions (b, s).

    The math runs in cos.dtype; pairs are (2m, 2m+1) when interleaved, else
    (m, m + rotary_dim / 2).
    """
    rotary_dim = 2 * cos.shape[1]
    c = cos[positions].unsqueeze(2)
    s = sin[positions].unsqueeze(2)
    x = x.to(cos.dtype)
    head, tail = x[..., :rotary_dim], x[..., rotary_dim:]
    if interleaved:
        x0, x1 = head[..., 0::2], head[..., 1::2]
        rotated = torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1).flatten(-2)
    else:
        x0, x1 = head[..., : rotary_dim // 2], head[..., rotary_dim // 2 :]
        rotated = torch.cat([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1)
    return torch.cat([rotated, tail], dim=-1)


def cache_capacity(k_cache, block_table):
    return k_cache.shape[1] if block_table is None else block_table.shape[1] * k_cache.shape[1]


def cache_index(b, positions, k_cache, cache_batch_idx, block_table):
    """Index tuple of logical cache positions of batch entry b.

    cache_batch_idx[b] picks b's cache row, or with block_table its table row (FA3).
    """
    row = b if cache_batch_idx is None else int(cache_batch_idx[b])
    if block_table is not None:
        page_size = k_cache.shape[1]
        return block_table[row].long()[positions // page_size], positions % page_size
    return torch.full_like(positions, row), positions


def rotary_start(b, end, rotary_seqlens):
    """Rotary position of b's first new key and query row 0: rotary_seqlens[b], else end."""
    return end if rotary_seqlens is None else int(rotary_seqlens[b])


def reference_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    cache_seqlens=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    alibi_slopes=None,
    softmax_scale=None,
    causal=False,
    window_size_left=-1,
    window_size_right=-1,
    softcap=0.0,
    rotary_interleaved=True,
    num_splits=0,
    learnable_sink=None,
    rotary_seqlens=None,
    compute_dtype=torch.float64,
):
    """Returns (out, lse) in compute_dtype / float64, from the caches before the call."""
    batch, seqlen_q, nheads, head_dim = q.shape
    nheads_k = k_cache.shape[2]
    capacity = cache_capacity(k_cache, block_table)
    seqlen_new = 0 if k is None else k.shape[1]
    scale = softmax_scale if softmax_scale is not None else head_dim**-0.5
    left, right = window_size_left, window_size_right
    if causal:
        right = 0
    # Rotary q rows get their own positions only under a causal / local window
    # (a side reaching past the whole cache counts as no window).
    per_row = causal or 0 <= left < capacity or 0 <= right < capacity

    out = torch.zeros(batch, seqlen_q, nheads, head_dim, dtype=compute_dtype)
    lse = torch.full((batch, nheads, seqlen_q), math.inf, dtype=torch.float64)
    for b in range(batch):
        end = capacity if cache_seqlens is None else int(cache_seqlens[b])
        pad = 0 if cache_leftpad is None else int(cache_leftpad[b])
        old = torch.arange(pad, end)
        idx = cache_index(b, old, k_cache, cache_batch_idx, block_table)
        keys, values = k_cache[idx].to(compute_dtype), v_cache[idx].to(compute_dtype)
        q_b = q[b : b + 1].to(compute_dtype)
        if seqlen_new:
            k_new = k[b : b + 1].to(compute_dtype)
            if rotary_cos is not None:
                cos, sin = rotary_cos.to(compute_dtype), rotary_sin.to(compute_dtype)
                start = rotary_start(b, end, rotary_seqlens)
                k_pos = (start + torch.arange(seqlen_new)).unsqueeze(0)
                k_new = apply_rotary(k_new, cos, sin, k_pos, rotary_interleaved)
                q_pos = start + (
                    torch.arange(seqlen_q) if per_row else torch.zeros(seqlen_q, dtype=torch.long)
                )
                q_b = apply_rotary(q_b, cos, sin, q_pos.unsqueeze(0), rotary_interleaved)
            keys = torch.cat([keys, k_new[0]], 0)
            values = torch.cat([values, v[b].to(compute_dtype)], 0)
        seqlen_k = keys.shape[0]
        group = nheads // nheads_k
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q_b[0], keys) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        row = torch.arange(seqlen_q).view(-1, 1)
        col = torch.arange(seqlen_k).view(1, -1)
        diag = row + seqlen_k - seqlen_q
        if alibi_slopes is not None:
            slopes = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b]
            scores = scores - slopes.to(compute_dtype).view(-1, 1, 1) * (diag - col).abs()
        visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
        if left >= 0:
            visible &= col >= diag - left
        if right >= 0:
            visible &= col <= diag + right
        scores = scores.masked_fill(~visible, -math.inf)
        row_lse = torch.logsumexp(scores.double(), dim=-1)
        seen = visible.any(-1)
        probs = torch.softmax(scores, dim=-1).masked_fill(~seen.view(1, -1, 1), 0)
        out[b] = torch.einsum("hqk,khd->qhd", probs, values)
        lse[b] = torch.where(seen.view(1, -1), row_lse, torch.full_like(row_lse, math.inf))
    return out, lse


def expected_caches(
    k_cache,
    v_cache,
    k,
    v,
    cache_seqlens,
    rotary_cos,
    rotary_sin,
    cache_batch_idx=None,
    block_table=None,
    rotary_interleaved=True,
    rotary_seqlens=None,
    **_,
):
    """The caches after the append (new keys rotated in fp32, rounded once to the
    dtype) and a mask of the rows the append writes."""
    k_after, v_after = k_cache.clone(), v_cache.clone()
    written = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    for b in range(k.shape[0]):
        end = int(cache_seqlens[b])
        positions = end + torch.arange(k.shape[1])
        idx = cache_index(b, positions, k_cache, cache_batch_idx, block_table)
        k_new = k[b : b + 1]
        if rotary_cos is not None:
            start = rotary_start(b, end, rotary_seqlens)
            k_new = apply_rotary(
                k_new,
                rotary_cos.float(),
                rotary_sin.float(),
                (start + torch.arange(k.shape[1])).unsqueeze(0),
                rotary_interleaved,
            )
        k_after[idx] = k_new[0].to(k_cache.dtype)
        v_after[idx] = v[b]
        written[idx] = True
    return k_after, v_after, written


# ----------------------------------------------------------------------------
# inputs


def random_lengths(batch, low, high):
    """Distinct-ish per-batch lengths in [low, high], not multiples of anything."""
    return torch.randint(low, high + 1, (batch,), dtype=torch.int32)


def op_args(q, k_cache, v_cache, *, causal=False, window=(-1, -1), **fields):
    """fwd_kvcache's arguments as a dict (schema names): no optional input, the
    default scale, no split choice; then `fields` on top."""
    args = dict(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        k=None,
        v=None,
        cache_seqlens=None,
        rotary_cos=None,
        rotary_sin=None,
        cache_batch_idx=None,
        cache_leftpad=None,
        block_table=None,
        alibi_slopes=None,
        softmax_scale=q.shape[-1] ** -0.5,
        causal=causal,
        window_size_left=window[0],
        window_size_right=window[1],
        softcap=0.0,
        rotary_interleaved=True,
        num_splits=0,
    )
    args.update(fields)
    return args


def make_inputs(
    batch=3,
    seqlen_q=4,
    capacity=29,
    nheads=4,
    nheads_k=2,
    head_dim=32,
    dtype=torch.float32,
    seqlen_new=0,
    rotary=None,
    rotary_dim=None,
    batch_cache=None,
    cache_batch_idx=None,
    leftpad=False,
    page_size=None,
    causal=False,
    window=(-1, -1),
):
    """Arguments of fwd_kvcache as a dict (schema names). rotary: None, 'interleaved', 'neox'."""
    if page_size is not None:
        capacity = page_size * math.ceil(capacity / page_size)
    batch_cache = batch if batch_cache is None else batch_cache
    q = torch.randn(batch, seqlen_q, nheads, head_dim, dtype=dtype)
    k_cache = torch.randn(batch_cache, capacity, nheads_k, head_dim, dtype=dtype)
    v_cache = torch.randn(batch_cache, capacity, nheads_k, head_dim, dtype=dtype)
    args = op_args(
        q, k_cache, v_cache, causal=causal, window=window, cache_batch_idx=cache_batch_idx
    )
    # Leave room for the new tokens and, with rotary, for q's positions.
    room = max(seqlen_new, seqlen_q if rotary else 0)
    args["cache_seqlens"] = random_lengths(batch, 0, capacity - room)
    if seqlen_new:
        args["k"] = torch.randn(batch, seqlen_new, nheads_k, head_dim, dtype=dtype)
        args["v"] = torch.randn(batch, seqlen_new, nheads_k, head_dim, dtype=dtype)
    if rotary:
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        angle = torch.rand(capacity, rotary_dim // 2, dtype=torch.float64) * 2 * math.pi
        args["rotary_cos"] = torch.cos(angle).to(dtype)
        args["rotary_sin"] = torch.sin(angle).to(dtype)
        args["rotary_interleaved"] = rotary == "interleaved"
    if leftpad:
        ends = args["cache_seqlens"]
        args["cache_leftpad"] = torch.stack([torch.randint(0, int(e) + 1, ()) for e in ends]).to(
            torch.int32
        )
    if page_size is not None:
        page_cache(args, page_size)
    return args


def page_cache(args, page_size, spare_pages=3):
    """Moves the contiguous caches into shuffled pages of a paged cache."""
    k_cache, v_cache = args["k_cache"], args["v_cache"]
    batch, capacity, nheads_k, head_dim = k_cache.shape
    pages_per_seq = capacity // page_size
    num_blocks = batch * pages_per_seq + spare_pages
    order = torch.randperm(num_blocks)[: batch * pages_per_seq]
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        paged = torch.randn(num_blocks, page_size, nheads_k, head_dim, dtype=cache.dtype)
        paged[order] = cache.reshape(batch * pages_per_seq, page_size, nheads_k, head_dim)
        args[name] = paged
    args["block_table"] = order.view(batch, pages_per_seq).to(torch.int32)


def unpage(cache, block_table):
    """(num_blocks, page, h, d) + block_table -> contiguous (batch, capacity, h, d)."""
    gathered = cache[block_table.long()]
    return gathered.reshape(block_table.shape[0], -1, *cache.shape[2:])


def run(args, **overrides):
    call = dict(args, **overrides)
    # The op appends into the caches: work on copies so that args stay reusable.
    call["k_cache"] = call["k_cache"].clone()
    call["v_cache"] = call["v_cache"].clone()
    out, lse = fwd_kvcache(**call)
    return out, lse, call["k_cache"], call["v_cache"]


def check_against_reference(args, out, lse):
    ref, ref_lse = reference_kvcache(**args)
    dtype = args["q"].dtype
    same_dtype, same_dtype_lse = reference_kvcache(**args, compute_dtype=dtype)
    assert out.shape == ref.shape and out.dtype == dtype
    assert lse.shape == ref_lse.shape and lse.dtype == torch.float32
    err = (out.double() - ref).abs().max().item()
    base = (same_dtype.double() - ref).abs().max().item()
    assert err <= 2 * base + 1e-5, f"out error {err} vs same-dtype torch error {base}"
    inf = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), inf), "rows without keys must have lse = +inf"
    assert (lse[inf] > 0).all()
    if (~inf).any():
        lse_err = (lse.double() - ref_lse)[~inf].abs().max().item()
        lse_base = (same_dtype_lse - ref_lse)[~inf].abs().max().item()
        assert lse_err <= 2 * lse_base + 1e-4, f"lse error {lse_err} vs {lse_base}"


def check_caches(args, k_cache_after, v_cache_after):
    k_expected, v_expected, written = expected_caches(**args)
    for got, expected, before in (
        (k_cache_after, k_expected, args["k_cache"]),
        (v_cache_after, v_expected, args["v_cache"]),
    ):
        rtol = 1e-6 if got.dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got[written], expected[written], atol=1e-6, rtol=rtol)
        # Nothing outside the appended rows may change.
        assert torch.equal(got[~written], before[~written])


# ----------------------------------------------------------------------------
# tests

DTYPES = [torch.float32, torch.bfloat16]
MODES = {  # seqlen_new, rotary
    "no_new": (0, None),
    "new": (3, None),
    "new_rotary_interleaved": (3, "interleaved"),
    "new_rotary_neox": (3, "neox"),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("page_size", [None, 3], ids=["contiguous", "paged3"])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (4, 1)], ids=["mha", "gqa3", "mqa"])
def test_matches_reference(dtype, causal, mode, page_size, heads):
    seqlen_new, rotary = MODES[mode]
    args = make_inputs(
        batch=3,
        seqlen_q=5,
        capacity=26,
        nheads=heads[0],
        nheads_k=heads[1],
        head_dim=32,
        dtype=dtype,
        seqlen_new=seqlen_new,
        rotary=rotary,
        page_size=page_size,
        causal=causal,
    )
    out, lse, k_after, v_after = run(args)
    check_against_reference(args, out, lse)
    if seqlen_new:
        check_caches(args, k_after, v_after)
    else:
        assert torch.equal(k_after, args["k_cache"]) and torch.equal(v_after, args["v_cache"])


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("rotary", [None, "interleaved", "neox"])
@pytest.mark.parametrize("rotary_dim", [16, 48])
@pytest.mark.parametrize("page_size", [None, 5], ids=["contiguous", "paged5"])
def test_cache_contents_after_append(dtype, rotary, rotary_dim, page_size):
    args = make_inputs(
        batch=3,
        seqlen_q=2,
        capacity=31,
        nheads=4,
        nheads_k=2,
        head_dim=48,
        dtype=dtype,
        seqlen_new=6,
        rotary=rotary,
        rotary_dim=rotary_dim,
        page_size=page_size,
    )
    out, lse, k_after, v_after = run(args)
    check_caches(args, k_after, v_after)
    check_against_reference(args, out, lse)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("page_size", [1, 3, 16, 256])
def test_paged_matches_contiguous(dtype, page_size):
    capacity = max(40, 2 * page_size) if page_size == 256 else page_size * math.ceil(40 / page_size)
    args = make_inputs(
        batch=2,
        seqlen_q=3,
        capacity=capacity,
        nheads=4,
        nheads_k=2,
        head_dim=32,
        dtype=dtype,
        seqlen_new=3,
        rotary="neox",
        causal=True,
    )
    if page_size == 256:  # exercise lengths that cross a page boundary
        args["cache_seqlens"] = torch.tensor([254, 17], dtype=torch.int32)
    paged = dict(args)
    page_cache(paged, page_size)
    out, lse, k_after, v_after = run(args)
    out_p, lse_p, k_after_p, v_after_p = run(paged)
    torch.testing.assert_close(out_p, out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse_p, lse, atol=1e-6, rtol=1e-6)
    assert torch.equal(unpage(k_after_p, paged["block_table"]), k_after)
    assert torch.equal(unpage(v_after_p, paged["block_table"]), v_after)
    check_against_reference(paged, out_p, lse_p)


def test_paged_ignores_unused_block_table_entries():
    args = make_inputs(batch=2, seqlen_q=2, capacity=40, page_size=4, seqlen_new=2)
    args["cache_seqlens"] = torch.tensor([5, 9], dtype=torch.int32)  # 2 and 3 pages used
    out, lse, _, _ = run(args)
    table = args["block_table"].clone()
    table[0, 2:] = -1
    table[1, 3:] = 10**6
    out_g, lse_g, _, _ = run(args, block_table=table)
    assert torch.equal(out, out_g) and torch.equal(lse, lse_g)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("seqlen_new", [0, 4])
def test_cache_batch_idx(dtype, seqlen_new):
    cache_batch_idx = torch.tensor([4, 0, 2], dtype=torch.int32)
    args = make_inputs(
        batch=3,
        seqlen_q=4,
        capacity=23,
        batch_cache=5,
        cache_batch_idx=cache_batch_idx,
        dtype=dtype,
        seqlen_new=seqlen_new,
        rotary="interleaved" if seqlen_new else None,
        causal=True,
    )
    out, lse, k_after, v_after = run(args)
    check_against_reference(args, out, lse)
    if seqlen_new:
        check_caches(args, k_after, v_after)
    for unused in (1, 3):
        assert torch.equal(k_after[unused], args["k_cache"][unused])
        assert torch.equal(v_after[unused], args["v_cache"][unused])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("mode", ["no_new", "new", "new_rotary_neox", "new_rotary_interleaved"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_cache_leftpad(causal, mode, dtype):
    seqlen_new, rotary = MODES[mode]
    args = make_inputs(
        batch=4,
        seqlen_q=3,
        capacity=27,
        dtype=dtype,
        seqlen_new=seqlen_new,
        rotary=rotary,
        leftpad=True,
        causal=causal,
    )
    # One sequence padded up to its end: only new tokens (if any) are seen.
    args["cache_leftpad"][1] = args["cache_seqlens"][1]
    out, lse, k_after, v_after = run(args)
    check_against_reference(args, out, lse)
    if seqlen_new:
        check_caches(args, k_after, v_after)
    else:
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        assert torch.isinf(lse[1]).all()


WINDOWS = {
    "causal": (True, (-1, -1)),
    "local_4_0": (False, (4, 0)),
    "local_2_3": (False, (2, 3)),
    "right_only_1": (False, (-1, 1)),
    "left_only_0": (False, (0, -1)),
    "causal_left_5": (True, (5, -1)),
    "wider_than_cache": (False, (100, 100)),
}


@pytest.mark.parametrize("seqlen_q", [1, 2, 3, 8, 16])
@pytest.mark.parametrize("window", list(WINDOWS))
def test_causal_and_local(seqlen_q, window):
    causal, (left, right) = WINDOWS[window]
    args = make_inputs(
        batch=3,
        seqlen_q=seqlen_q,
        capacity=37,
        nheads=4,
        nheads_k=2,
        seqlen_new=seqlen_q,
        rotary="interleaved",
        causal=causal,
        window=(left, right),
    )
    out, lse, k_after, v_after = run(args)
    check_against_reference(args, out, lse)
    check_caches(args, k_after, v_after)


@pytest.mark.parametrize("seqlen_new", [0, 2])
def test_per_batch_lengths_with_empty_sequence(seqlen_new):
    args = make_inputs(batch=4, seqlen_q=3, capacity=33, seqlen_new=seqlen_new, causal=True)
    args["cache_seqlens"] = torch.tensor([0, 1, 17, 31 - seqlen_new], dtype=torch.int32)
    out, lse, k_after, v_after = run(args)
    check_against_reference(args, out, lse)
    if seqlen_new == 0:
        assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isinf(lse[0]).all()
    else:
        check_caches(args, k_after, v_after)


def test_cache_seqlens_none_attends_whole_cache():
    args = make_inputs(batch=2, seqlen_q=3, capacity=19, causal=True)
    args["cache_seqlens"] = None
    out, lse, _, _ = run(args)
    check_against_reference(args, out, lse)
    full = torch.full((2,), 19, dtype=torch.int32)
    out_full, lse_full, _, _ = run(args, cache_seqlens=full)
    assert torch.equal(out, out_full) and torch.equal(lse, lse_full)


def test_num_splits_does_not_change_results():
    args = make_inputs(
        batch=3, seqlen_q=4, capacity=45, seqlen_new=4, rotary="neox", causal=True, page_size=7
    )
    results = [run(args, num_splits=n) for n in (0, 1, 2, 7, 64)]
    for other in results[1:]:
        for got, first in zip(other, results[0]):
            assert torch.equal(got, first)


@pytest.mark.parametrize("softcap", [0.0, 4.0])
@pytest.mark.parametrize("alibi", [None, "per_head", "per_batch_head"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_softcap_and_alibi(softcap, alibi, causal):
    args = make_inputs(
        batch=3, seqlen_q=4, capacity=30, nheads=4, nheads_k=2, seqlen_new=2, causal=causal
    )
    args["softcap"] = softcap
    if alibi == "per_head":
        args["alibi_slopes"] = torch.rand(4) * 0.5
    elif alibi == "per_batch_head":
        args["alibi_slopes"] = torch.rand(3, 4) * 0.5
    out, lse, _, _ = run(args)
    check_against_reference(args, out, lse)


def test_fp16():
    args = make_inputs(
        batch=2,
        seqlen_q=3,
        capacity=21,
        dtype=torch.float16,
        seqlen_new=3,
        rotary="neox",
        causal=True,
        page_size=4,
    )
    out, lse, k_after, v_after = run(args)
    check_against_reference(args, out, lse)
    check_caches(args, k_after, v_after)


def test_strided_views_append_into_shared_storage():
    batch, capacity, nheads, nheads_k, head_dim, seqlen_new = 2, 24, 4, 2, 32, 3
    qkv = torch.randn(batch, seqlen_new, nheads + 2 * nheads_k, head_dim)
    q, k, v = qkv.split([nheads, nheads_k, nheads_k], dim=2)
    kv_cache = torch.randn(batch, capacity, 2, nheads_k, head_dim)
    args = op_args(
        q,
        kv_cache[:, :, 0],
        kv_cache[:, :, 1],
        causal=True,
        k=k,
        v=v,
        cache_seqlens=torch.tensor([5, 13], dtype=torch.int32),
        rotary_interleaved=False,
    )
    before = {name: args[name].clone() for name in ("k_cache", "v_cache")}
    reference_args = dict(args, **before)
    out, lse = fwd_kvcache(**args)  # appends through the views into kv_cache
    check_against_reference(reference_args, out, lse)
    check_caches(reference_args, kv_cache[:, :, 0], kv_cache[:, :, 1])


# ----------------------------------------------------------------------------
# bad input


def bad_input_cases():
    def base(**kw):
        return make_inputs(
            batch=2, seqlen_q=2, capacity=16, nheads=4, nheads_k=2, head_dim=32, seqlen_new=2, **kw
        )

    def with_(args, **changes):
        args.update(changes)
        return args

    a = base()
    yield "q_dtype", with_(base(), q=a["q"].double()), r"q must have dtype"
    yield (
        "k_cache_dtype",
        with_(base(), k_cache=a["k_cache"].bfloat16()),
        r"k_cache must have the dtype of q",
    )
    yield (
        "v_cache_dtype",
        with_(base(), v_cache=a["v_cache"].half()),
        r"v_cache must have the dtype of q",
    )
    yield "k_dtype", with_(base(), k=a["k"].bfloat16()), r"k must have the dtype of q"
    yield "head_dim", with_(base(), q=torch.randn(2, 2, 4, 12)), r"head_dim"
    yield "head_dim_big", with_(base(), q=torch.randn(2, 2, 4, 264)), r"head_dim"
    yield "heads", with_(base(), q=torch.randn(2, 2, 3, 32)), r"multiple of nheads_k"
    yield "q_rank", with_(base(), q=torch.randn(2, 4, 32)), r"q must be 4-D"
    yield (
        "cache_head_dim",
        with_(base(), v_cache=torch.randn(2, 16, 2, 40)),
        r"v_cache must have shape",
    )
    yield (
        "q_last_dim_strided",
        with_(base(), q=torch.randn(2, 2, 4, 64)[..., ::2]),
        r"q must have a contiguous last dimension",
    )
    yield "k_without_v", with_(base(), v=None), r"k and v .* must be given together"
    yield "v_without_k", with_(base(), k=None), r"k and v .* must be given together"
    yield (
        "k_shape",
        with_(base(), k=torch.randn(2, 2, 4, 32), v=torch.randn(2, 2, 4, 32)),
        r"k must have shape",
    )
    yield (
        "seqlen_q_longer_than_cache",
        with_(base(), q=torch.randn(2, 17, 4, 32)),
        r"seqlen_q \(17\) must be at most the cache length \(16\)",
    )
    yield (
        "k_without_cache_seqlens",
        with_(base(), cache_seqlens=None),
        r"cache_seqlens must be given with k",
    )
    yield (
        "cache_seqlens_dtype",
        with_(base(), cache_seqlens=a["cache_seqlens"].long()),
        r"cache_seqlens must have dtype torch.int32",
    )
    yield (
        "cache_seqlens_shape",
        with_(base(), cache_seqlens=torch.zeros(3, dtype=torch.int32)),
        r"cache_seqlens must have shape \(batch,\)",
    )
    yield (
        "cache_seqlens_overflow",
        with_(base(), cache_seqlens=torch.tensor([3, 15], dtype=torch.int32)),
        r"cache_seqlens\[1\] \+ seqlen_new",
    )
    yield (
        "cache_seqlens_negative",
        with_(base(), cache_seqlens=torch.tensor([-1, 3], dtype=torch.int32)),
        r"cache_seqlens\[0\] = -1",
    )
    yield (
        "cache_batch_idx_dtype",
        with_(base(), cache_batch_idx=torch.tensor([0, 1])),
        r"cache_batch_idx must have dtype torch.int32",
    )
    yield (
        "cache_batch_idx_range",
        with_(base(), cache_batch_idx=torch.tensor([0, 2], dtype=torch.int32)),
        r"cache_batch_idx\[1\] = 2 must be in \[0, 2\)",
    )
    yield (
        "cache_batch_idx_shape",
        with_(base(), cache_batch_idx=torch.tensor([0], dtype=torch.int32)),
        r"cache_batch_idx must have shape",
    )
    yield (
        "small_cache_batch",
        with_(base(), k_cache=a["k_cache"][:1], v_cache=a["v_cache"][:1]),
        r"k_cache must hold at least batch",
    )
    leftpad = with_(base(), cache_leftpad=torch.tensor([0, 9], dtype=torch.int32))
    leftpad["cache_seqlens"] = torch.tensor([3, 5], dtype=torch.int32)
    yield "leftpad_past_end", leftpad, r"cache_leftpad\[1\] = 9"
    yield (
        "leftpad_dtype",
        with_(base(), cache_leftpad=torch.tensor([0, 1])),
        r"cache_leftpad must have dtype torch.int32",
    )
    paged = base(page_size=4)
    yield (
        "block_table_dtype",
        with_(base(page_size=4), block_table=paged["block_table"].long()),
        r"block_table must have dtype torch.int32",
    )
    yield (
        "block_table_shape",
        with_(base(page_size=4), block_table=paged["block_table"][:1]),
        r"block_table must have shape \(batch, max_blocks_per_seq\)",
    )
    yield (
        "block_table_batch_idx_past_table",
        with_(base(page_size=4), cache_batch_idx=torch.tensor([0, 2], dtype=torch.int32)),
        r"cache_batch_idx\[1\] = 2 must be in \[0, 2\) \(the rows of block_table",
    )
    yield (
        "block_table_batch_idx_table_rank",
        with_(
            base(page_size=4),
            cache_batch_idx=torch.tensor([0, 1], dtype=torch.int32),
            block_table=paged["block_table"].flatten(),
        ),
        r"block_table must have shape \(table_rows, max_blocks_per_seq\)",
    )
    paged_pad = with_(base(page_size=4), cache_leftpad=torch.tensor([0, 7], dtype=torch.int32))
    paged_pad["cache_seqlens"] = torch.tensor([3, 5], dtype=torch.int32)
    yield "block_table_leftpad_past_end", paged_pad, r"cache_leftpad\[1\] = 7 must be in \[0, "
    yield (
        "rotary_seqlens_without_rotary",
        with_(base(), rotary_seqlens=torch.tensor([0, 1], dtype=torch.int32)),
        r"rotary_seqlens needs rotary_cos / rotary_sin",
    )
    yield (
        "rotary_seqlens_dtype",
        with_(base(rotary="neox"), rotary_seqlens=torch.tensor([0, 1])),
        r"rotary_seqlens must have dtype torch.int32",
    )
    yield (
        "rotary_seqlens_shape",
        with_(base(rotary="neox"), rotary_seqlens=torch.tensor([0, 1, 2], dtype=torch.int32)),
        r"rotary_seqlens must have shape \(batch,\) = \(2,\)",
    )
    yield (
        "rotary_seqlens_negative",
        with_(base(rotary="neox"), rotary_seqlens=torch.tensor([0, -3], dtype=torch.int32)),
        r"rotary_seqlens\[1\] = -3 must be >= 0",
    )
    yield (
        "rotary_seqlens_past_table",
        with_(base(rotary="neox"), rotary_seqlens=torch.tensor([15, 0], dtype=torch.int32)),
        r"batch 0 needs position 16 \(its positions start at rotary_seqlens\[0\] = 15\)",
    )
    yield (
        "block_table_range",
        with_(base(page_size=4), block_table=torch.full((2, 4), 99, dtype=torch.int32)),
        r"block_table\[0, 0\] = 99",
    )
    yield (
        "block_table_not_paged_cache",
        with_(base(page_size=4), k_cache=torch.randn(8, 4, 2, 16)),
        r"k_cache must have shape \(num_blocks, page_size",
    )
    yield (
        "block_table_paged_v_shape",
        with_(base(page_size=4), v_cache=torch.randn(8, 2, 2, 32)),
        r"v_cache must have shape",
    )
    rot = base(rotary="neox")
    yield (
        "rotary_cos_without_sin",
        with_(base(rotary="neox"), rotary_sin=None),
        r"rotary_cos and rotary_sin must be given together",
    )
    yield (
        "rotary_without_k",
        with_(base(rotary="neox"), k=None, v=None),
        r"rotary_cos / rotary_sin need k / v",
    )
    yield (
        "rotary_dim_too_big",
        with_(base(rotary="neox"), rotary_cos=torch.rand(16, 20), rotary_sin=torch.rand(16, 20)),
        r"rotary_dim .* must be in \[2, head_dim = 32\]",
    )
    yield (
        "rotary_shape_mismatch",
        with_(base(rotary="neox"), rotary_sin=rot["rotary_sin"][:, :4]),
        r"rotary_sin must have shape",
    )
    yield (
        "rotary_too_short",
        with_(
            base(rotary="neox"),
            rotary_cos=rot["rotary_cos"][:10],
            rotary_sin=rot["rotary_sin"][:10],
        ),
        r"rotary_cos / rotary_sin must have at least as many rows",
    )
    past_table = with_(base(rotary="neox"), q=torch.randn(2, 8, 4, 32), causal=True)
    past_table["cache_seqlens"] = torch.tensor([14, 0], dtype=torch.int32)
    yield "rotary_q_position_past_table", past_table, r"batch 0 needs position 21"
    yield (
        "rotary_dtype",
        with_(base(rotary="neox"), rotary_cos=rot["rotary_cos"].double()),
        r"rotary_cos must have the dtype of q",
    )
    yield (
        "rotary_rank",
        with_(
            base(rotary="neox"),
            rotary_cos=rot["rotary_cos"].flatten(),
            rotary_sin=rot["rotary_sin"].flatten(),
        ),
        r"rotary_cos must be 2-D",
    )
    yield (
        "alibi_dtype",
        with_(base(), alibi_slopes=torch.rand(4, dtype=torch.float64)),
        r"alibi_slopes must have dtype torch.float32",
    )
    yield "alibi_shape", with_(base(), alibi_slopes=torch.rand(3)), r"alibi_slopes must have shape"


@pytest.mark.parametrize("case", list(bad_input_cases()), ids=lambda c: c[0])
def test_bad_input_raises(case):
    _, args, message = case
    with pytest.raises(RuntimeError, match=message):
        run(args)
