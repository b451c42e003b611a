"""CPU tests of fwd_kvcache's varlen form (FA3): a varlen query (cu_seqlens_q,
max_seqlen_q) and varlen new keys (cu_seqlens_k_new), as chunked prefill and
speculative decoding call it over a contiguous or paged cache.

Semantics (docs/serving.md): sequence b's query rows are q rows
cu_seqlens_q[b] .. cu_seqlens_q[b + 1], its new keys k / v rows
cu_seqlens_k_new[b] .. cu_seqlens_k_new[b + 1], appended after
cache_seqlens[b]; everything else is the fixed-length call of that one
sequence. So the float64 reference is test_cpu_kvcache.py's, run sequence by
sequence on the same caches.
"""

import math

import pytest
import torch

from test_cpu_kvcache import (
    apply_rotary,
    cache_capacity,
    expected_caches,
    fwd_kvcache,
    op_args,
    page_cache,
    reference_kvcache,
)

import flash_attn_cuda

# ----------------------------------------------------------------------------
# inputs and the per-sequence reference


def offsets(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)


def varlen_inputs(
    q_lens,
    new_lens,
    capacity=40,
    heads=(6, 2),
    head_dim=32,
    dtype=torch.float32,
    rotary=None,
    page_size=None,
    causal=False,
    window=(-1, -1),
    leftpad=False,
    batch_idx=False,
    varlen_new=True,
):
    """fwd_kvcache arguments (schema names) of a varlen call. new_lens None:
    no new keys; varlen_new False: new keys (batch, new_lens[0], ...)."""
    batch = len(q_lens)
    nheads, nheads_k = heads
    if page_size is not None:
        capacity = page_size * math.ceil(capacity / page_size)
    batch_cache = batch + 2 if batch_idx else batch
    cu_q = offsets(q_lens)
    args = op_args(
        torch.randn(int(cu_q[-1]), nheads, head_dim, dtype=dtype),
        torch.randn(batch_cache, capacity, nheads_k, head_dim, dtype=dtype),
        torch.randn(batch_cache, capacity, nheads_k, head_dim, dtype=dtype),
        causal=causal,
        window=window,
        cu_seqlens_q=cu_q,
        max_seqlen_q=max(q_lens) + 1,  # a bound, not necessarily reached
    )
    if new_lens is not None and not varlen_new:
        new_lens = [new_lens[0]] * batch
    news = [0] * batch if new_lens is None else list(new_lens)
    room = [max(n, ql if rotary else 0) for n, ql in zip(news, q_lens)]
    args["cache_seqlens"] = torch.tensor(
        [int(torch.randint(0, capacity - r + 1, ())) for r in room], dtype=torch.int32
    )
    if new_lens is not None:
        if varlen_new:
            total = sum(news)
            args["k"] = torch.randn(total, nheads_k, head_dim, dtype=dtype)
            args["v"] = torch.randn(total, nheads_k, head_dim, dtype=dtype)
            args["cu_seqlens_k_new"] = offsets(news)
        else:
            args["k"] = torch.randn(batch, news[0], nheads_k, head_dim, dtype=dtype)
            args["v"] = torch.randn(batch, news[0], nheads_k, head_dim, dtype=dtype)
    if rotary:
        angle = torch.rand(capacity, head_dim // 2, dtype=torch.float64) * 2 * math.pi
        args["rotary_cos"] = torch.cos(angle).to(dtype)
        args["rotary_sin"] = torch.sin(angle).to(dtype)
        args["rotary_interleaved"] = rotary == "interleaved"
    if leftpad:
        args["cache_leftpad"] = torch.tensor(
            [int(torch.randint(0, int(e) + 1, ())) for e in args["cache_seqlens"]],
            dtype=torch.int32,
        )
    if batch_idx:
        args["cache_batch_idx"] = torch.randperm(batch_cache)[:batch].to(torch.int32)
    if page_size is not None:
        page_cache(args, page_size)
    return args


def sequence_args(args, b):
    """The fixed-length call (batch 1) of sequence b of a varlen call."""
    cu_q = args["cu_seqlens_q"]
    one = {
        key: value
        for key, value in args.items()
        if key not in ("cu_seqlens_q", "cu_seqlens_k_new", "max_seqlen_q")
    }
    one["q"] = args["q"][int(cu_q[b]) : int(cu_q[b + 1])].unsqueeze(0)
    for name in ("cache_seqlens", "cache_leftpad", "rotary_seqlens"):
        if args.get(name) is not None:
            one[name] = args[name][b : b + 1]
    entry = b if args["cache_batch_idx"] is None else int(args["cache_batch_idx"][b])
    if args["block_table"] is not None:
        one["block_table"] = args["block_table"][entry : entry + 1]
        one["cache_batch_idx"] = None
    else:
        one["cache_batch_idx"] = torch.tensor([entry], dtype=torch.int32)
    if args["alibi_slopes"] is not None and args["alibi_slopes"].dim() == 2:
        one["alibi_slopes"] = args["alibi_slopes"][b : b + 1]
    if args["k"] is not None:
        cu_new = args.get("cu_seqlens_k_new")
        if cu_new is not None:
            rows = slice(int(cu_new[b]), int(cu_new[b + 1]))
            one["k"] = args["k"][rows].unsqueeze(0)
            one["v"] = args["v"][rows].unsqueeze(0)
        else:
            one["k"], one["v"] = args["k"][b : b + 1], args["v"][b : b + 1]
    return one


def rotate_q_alone(one, compute_dtype):
    """A batch-1 call without new keys: q rotated as the op rotates it, and no rotary."""
    capacity = cache_capacity(one["k_cache"], one["block_table"])
    end = int(one["cache_seqlens"][0])
    start = end if one.get("rotary_seqlens") is None else int(one["rotary_seqlens"][0])
    left, right = one["window_size_left"], one["window_size_right"]
    per_row = one["causal"] or 0 <= left < capacity or 0 <= right < capacity
    seqlen_q = one["q"].shape[1]
    rows = torch.arange(seqlen_q) if per_row else torch.zeros(seqlen_q, dtype=torch.long)
    cos, sin = one["rotary_cos"].to(compute_dtype), one["rotary_sin"].to(compute_dtype)
    q = apply_rotary(one["q"], cos, sin, (start + rows).unsqueeze(0), one["rotary_interleaved"])
    return dict(one, q=q, k=None, v=None, rotary_cos=None, rotary_sin=None, rotary_seqlens=None)


def reference_varlen(args, compute_dtype=torch.float64):
    """(out (total_q, nheads, d), lse (nheads, total_q)) sequence by sequence."""
    q = args["q"]
    total_q, nheads, _ = q.shape
    out = torch.zeros(total_q, nheads, args["v_cache"].shape[-1], dtype=compute_dtype)
    lse = torch.full((nheads, total_q), math.inf, dtype=torch.float64)
    cu_q = args["cu_seqlens_q"]
    for b in range(cu_q.numel() - 1):
        lo, hi = int(cu_q[b]), int(cu_q[b + 1])
        if hi == lo:
            continue
        one = sequence_args(args, b)
        if one["rotary_cos"] is not None and (one["k"] is None or one["k"].shape[1] == 0):
            # q is rotated whether or not its sequence appends a key (FA3);
            # the fixed-length reference rotates only with new keys.
            one = rotate_q_alone(one, compute_dtype)
        o, o_lse = reference_kvcache(**one, compute_dtype=compute_dtype)
        out[lo:hi] = o[0]
        lse[:, lo:hi] = o_lse[0]
    sink = args.get("learnable_sink")
    if sink is not None:
        # One more logit per row with no value row (the op contract's sinks):
        # out scales by exp(lse - lse_with_sink); a row with no key gets lse = sink.
        s = sink.double().view(-1, 1).expand_as(lse)
        seen = ~torch.isinf(lse)
        with_sink = torch.where(seen, torch.logaddexp(lse.where(seen, 0), s), s)
        scale = torch.where(seen, torch.exp(lse.where(seen, 0) - with_sink), 0)
        out = out * scale.t().unsqueeze(-1).to(compute_dtype)
        lse = with_sink
    return out, lse


def expected_varlen_caches(args):
    """The caches after every sequence's append (written: the appended rows)."""
    k_after, v_after = args["k_cache"].clone(), args["v_cache"].clone()
    written = torch.zeros(k_after.shape[:2], dtype=torch.bool)
    for b in range(args["cu_seqlens_q"].numel() - 1):
        one = sequence_args(args, b)
        if one["k"].shape[1] == 0:
            continue
        one["k_cache"], one["v_cache"] = k_after, v_after
        k_after, v_after, w = expected_caches(**one)
        written |= w
    return k_after, v_after, written


def run(args, **overrides):
    call = dict(args, **overrides)
    call["k_cache"] = call["k_cache"].clone()
    call["v_cache"] = call["v_cache"].clone()
    out, lse = fwd_kvcache(**call)
    return out, lse, call["k_cache"], call["v_cache"]


def check_against_reference(args, out, lse):
    ref, ref_lse = reference_varlen(args)
    same, same_lse = reference_varlen(args, compute_dtype=args["q"].dtype)
    assert out.shape == ref.shape and lse.shape == ref_lse.shape
    err = (out.double() - ref).abs().max().item() if out.numel() else 0.0
    base = (same.double() - ref).abs().max().item() if out.numel() else 0.0
    assert err <= 2 * base + 1e-5, f"out error {err} vs same-dtype torch error {base}"
    inf = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), inf), "rows without keys must have lse = +inf"
    if (~inf).any():
        lse_err = (lse.double() - ref_lse)[~inf].abs().max().item()
        lse_base = (same_lse - ref_lse)[~inf].abs().max().item()
        assert lse_err <= 2 * lse_base + 1e-4, f"lse error {lse_err} vs {lse_base}"


def check_caches(args, k_after, v_after):
    k_expected, v_expected, written = expected_varlen_caches(args)
    for got, expected, before in (
        (k_after, k_expected, args["k_cache"]),
        (v_after, v_expected, args["v_cache"]),
    ):
        rtol = 1e-6 if got.dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got[written], expected[written], atol=1e-6, rtol=rtol)
        assert torch.equal(got[~written], before[~written])


# Sequence lengths: an empty sequence (no query row, no new key), a sequence
# with query rows but no new key, decode-like and prefill-like ones, and a
# causal sequence with more query rows than keys (rows that see no key).
Q_LENS = [3, 0, 1, 7, 5]
NEW_LENS = [2, 0, 0, 7, 4]

MODES = {  # new keys, rotary
    "no_new": (None, None),
    "varlen_new": ("varlen", None),
    "fixed_new": ("fixed", None),
    "varlen_new_rotary_interleaved": ("varlen", "interleaved"),
    "varlen_new_rotary_neox": ("varlen", "neox"),
}
WINDOWS = {"full": (False, (-1, -1)), "causal": (True, (-1, -1)), "local_2_1": (False, (2, 1))}


def mode_inputs(mode, window, **kwargs):
    new, rotary = MODES[mode]
    causal, win = WINDOWS[window]
    new_lens = None if new is None else ([3] if new == "fixed" else NEW_LENS)
    return varlen_inputs(
        Q_LENS,
        new_lens,
        rotary=rotary,
        causal=causal,
        window=win,
        varlen_new=new != "fixed",
        **kwargs,
    )


# ----------------------------------------------------------------------------
# results


# Every mode and window over a contiguous cache; over 1-row pages (every key
# through the table) the causal window.
CASES = [(m, w, None) for m in MODES for w in WINDOWS] + [(m, "causal", 1) for m in MODES]


@pytest.mark.parametrize("mode, window, page_size", CASES)
def test_matches_reference(mode, window, page_size):
    args = mode_inputs(mode, window, page_size=page_size)
    out, lse, k_after, v_after = run(args)
    check_against_reference(args, out, lse)
    if args["k"] is not None:
        check_caches(args, k_after, v_after)


@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "page16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_composes_with_every_feature(page_size, dtype):
    """cache_batch_idx, cache_leftpad, rotary_seqlens, softcap, (batch, nheads)
    ALiBi, sinks, GQA, out= and return_softmax_lse in one varlen call."""
    args = mode_inputs(
        "varlen_new_rotary_neox",
        "causal",
        page_size=page_size,
        dtype=dtype,
        leftpad=True,
        batch_idx=True,
        heads=(8, 2),
    )
    batch = len(Q_LENS)
    args["softcap"] = 3.0
    args["alibi_slopes"] = torch.rand(batch, 8) * 0.3
    args["rotary_seqlens"] = torch.randint(0, 10, (batch,), dtype=torch.int32)
    sink = torch.randn(8)
    out_buf = torch.full(args["q"].shape, math.nan, dtype=dtype)
    call = dict(args)
    call["k_cache"], call["v_cache"] = args["k_cache"].clone(), args["v_cache"].clone()
    lse = torch.ops.flash_attn.fwd_kvcache_out(
        *[call[n] for n in SCHEMA_POSITIONAL],
        out=out_buf,
        learnable_sink=sink,
        rotary_seqlens=call["rotary_seqlens"],
        cu_seqlens_q=call["cu_seqlens_q"],
        cu_seqlens_k_new=call["cu_seqlens_k_new"],
        max_seqlen_q=call["max_seqlen_q"],
    )
    check_against_reference(dict(args, learnable_sink=sink), out_buf, lse)
    check_caches(args, call["k_cache"], call["v_cache"])


SCHEMA_POSITIONAL = [
    "q",
    "k_cache",
    "v_cache",
    "k",
    "v",
    "cache_seqlens",
    "rotary_cos",
    "rotary_sin",
    "cache_batch_idx",
    "cache_leftpad",
    "block_table",
    "alibi_slopes",
    "softmax_scale",
    "causal",
    "window_size_left",
    "window_size_right",
    "softcap",
    "rotary_interleaved",
    "num_splits",
]


def test_varlen_equals_fixed_length_calls_bitwise():
    """Each sequence of a varlen call gets the bits of its own fixed-length call."""
    args = mode_inputs("varlen_new_rotary_interleaved", "causal", page_size=16, leftpad=True)
    out, lse, k_after, _ = run(args)
    cu_q = args["cu_seqlens_q"]
    for b in range(len(Q_LENS)):
        one = sequence_args(args, b)
        o, o_lse = fwd_kvcache(
            **dict(one, k_cache=one["k_cache"].clone(), v_cache=one["v_cache"].clone())
        )
        lo, hi = int(cu_q[b]), int(cu_q[b + 1])
        assert torch.equal(out[lo:hi], o[0])
        assert torch.equal(lse[:, lo:hi], o_lse[0])


def test_rows_outside_every_sequence_are_zero():
    args = mode_inputs("varlen_new", "causal")
    # Rows before cu_seqlens_q[0] and after cu_seqlens_q[-1].
    cu = args["cu_seqlens_q"]
    total = int(cu[-1])
    args["q"] = torch.randn(total + 5, *args["q"].shape[1:])
    args["cu_seqlens_q"] = cu + 2
    args["q"][:2] = math.nan
    out, lse, _, _ = run(args)
    assert torch.equal(out[:2], torch.zeros_like(out[:2]))
    assert torch.equal(out[total + 2 :], torch.zeros_like(out[total + 2 :]))
    assert torch.isinf(lse[:, :2]).all() and torch.isinf(lse[:, total + 2 :]).all()
    shifted = dict(args, q=args["q"][2 : total + 2], cu_seqlens_q=cu)
    ref_out, ref_lse, _, _ = run(shifted)
    assert torch.equal(out[2 : total + 2], ref_out)
    assert torch.equal(lse[:, 2 : total + 2], ref_lse)


def test_all_sequences_empty():
    args = varlen_inputs([0, 0], [0, 0], heads=(4, 2))
    args["q"] = torch.randn(3, 4, 32)  # rows outside every sequence
    args["max_seqlen_q"] = 0
    out, lse, k_after, _ = run(args)
    assert out.shape == (3, 4, 32) and torch.equal(out, torch.zeros_like(out))
    assert torch.isinf(lse).all()
    assert torch.equal(k_after, args["k_cache"])


def test_head_dim_v_smaller_appends_varlen_rows():
    """d_v < d_qk: the columns of the full-width call (the attention of each
    column of v is independent), and the same appended rows."""
    args = mode_inputs("varlen_new", "causal", page_size=16, batch_idx=True)
    out, lse, k_after, v_after = run(args)
    check_against_reference(args, out, lse)
    narrow = dict(
        args,
        v_cache=args["v_cache"][..., :16].contiguous(),
        v=args["v"][..., :16].contiguous(),
    )
    out_n, lse_n, k_after_n, v_after_n = run(narrow)
    torch.testing.assert_close(out_n, out[..., :16], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse_n, lse, atol=1e-6, rtol=1e-6)
    assert torch.equal(k_after_n, k_after)
    assert torch.equal(v_after_n, v_after[..., :16])


def test_flash_attn_with_kvcache_varlen():
    """The public function: q (total_q, ...), varlen k / v, return_softmax_lse."""
    args = mode_inputs("varlen_new_rotary_neox", "causal", page_size=16, heads=(4, 4))
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
        block_table=args["block_table"],
        causal=True,
        rotary_interleaved=False,
        return_softmax_lse=True,
        cu_seqlens_q=args["cu_seqlens_q"],
        cu_seqlens_k_new=args["cu_seqlens_k_new"],
        max_seqlen_q=args["max_seqlen_q"],
    )
    check_against_reference(args, out, lse)
    check_caches(args, k_cache, v_cache)


def test_flash_attn_with_kvcache_varlen_odd_head_dim_and_out():
    args = varlen_inputs([2, 4], [1, 3], head_dim=40, heads=(4, 2), causal=True)
    args["q"] = args["q"][..., :36].contiguous()
    k_cache, v_cache = args["k_cache"][..., :36].clone(), args["v_cache"][..., :36].clone()
    k, v = args["k"][..., :36].contiguous(), args["v"][..., :36].contiguous()
    out_buf = torch.full(args["q"].shape, math.nan)
    got = flash_attn_cuda.flash_attn_with_kvcache(
        args["q"],
        k_cache,
        v_cache,
        k=k,
        v=v,
        cache_seqlens=args["cache_seqlens"],
        causal=True,
        out=out_buf,
        cu_seqlens_q=args["cu_seqlens_q"],
        cu_seqlens_k_new=args["cu_seqlens_k_new"],
        max_seqlen_q=4,
    )
    assert got is out_buf
    ref_args = dict(
        args,
        q=args["q"],
        k_cache=args["k_cache"][..., :36].contiguous(),
        v_cache=args["v_cache"][..., :36].contiguous(),
        k=k,
        v=v,
        softmax_scale=36**-0.5,
    )
    check_against_reference(ref_args, out_buf, reference_varlen(ref_args)[1].float())


# ----------------------------------------------------------------------------
# bad input


def expect_error(args, match, **overrides):
    with pytest.raises(RuntimeError, match=match):
        run(args, **overrides)


def test_bad_shapes_and_dtypes_name_the_argument():
    args = mode_inputs("varlen_new", "causal")
    cu_q, cu_new = args["cu_seqlens_q"], args["cu_seqlens_k_new"]
    expect_error(
        args, r"cu_seqlens_q must have dtype torch.int32, got Long", cu_seqlens_q=cu_q.long()
    )
    expect_error(
        args,
        r"cu_seqlens_q must have shape \(batch \+ 1,\) with batch >= 1, got \[1\]",
        cu_seqlens_q=cu_q[:1],
    )
    expect_error(
        args,
        r"cu_seqlens_k_new must have shape \(batch \+ 1,\) = \(6,\), got \[5\]",
        cu_seqlens_k_new=cu_new[:5],
    )
    expect_error(
        args, r"cu_seqlens_k_new must have dtype torch.int32", cu_seqlens_k_new=cu_new.float()
    )
    expect_error(args, r"max_seqlen_q must be given with cu_seqlens_q", max_seqlen_q=None)
    expect_error(args, r"max_seqlen_q must be in \[0, 2\^30\], got -1", max_seqlen_q=-1)
    expect_error(
        args, r"max_seqlen_q needs cu_seqlens_q", cu_seqlens_q=None, q=args["q"].unsqueeze(0)
    )
    expect_error(
        args,
        r"with cu_seqlens_q, q must be 3-D \(total_q, nheads, head_dim\)",
        q=args["q"].unsqueeze(0),
    )
    expect_error(args, r"cu_seqlens_k_new needs k / v .* got k = None", k=None, v=None)
    expect_error(
        args,
        r"with cu_seqlens_k_new, k must be 3-D \(total_k_new, nheads_k, head_dim\)",
        k=args["k"].unsqueeze(0),
        v=args["v"].unsqueeze(0),
    )
    expect_error(
        args,
        r"a varlen k of \(total_k_new, nheads_k, head_dim\) needs cu_seqlens_k_new",
        cu_seqlens_k_new=None,
    )
    # out= must have the varlen shape.
    with pytest.raises(RuntimeError, match=r"\(total_q, nheads, head_dim_v\)"):
        torch.ops.flash_attn.fwd_kvcache_out(
            *[args[n] for n in SCHEMA_POSITIONAL],
            out=torch.empty(1, 16, 6, 32),
            cu_seqlens_q=cu_q,
            cu_seqlens_k_new=cu_new,
            max_seqlen_q=args["max_seqlen_q"],
        )


@pytest.mark.parametrize(
    "case",
    [
        "q_negative",
        "q_decreasing",
        "q_longer_than_max",
        "q_past_rows",
        "new_decreasing",
        "new_past_rows",
        "append_past_cache",
        "rotary_past_tables",
    ],
)
def test_bad_index_values_raise_the_shared_messages(case):
    args = mode_inputs("varlen_new_rotary_neox", "causal")
    cu_q, cu_new = args["cu_seqlens_q"].clone(), args["cu_seqlens_k_new"].clone()
    capacity = cache_capacity(args["k_cache"], args["block_table"])
    over = {}
    if case == "q_negative":
        cu_q[0] = -1
        match = r"^fwd_kvcache: cu_seqlens_q\[0\] must be >= 0, got -1"
    elif case == "q_decreasing":
        cu_q[2] = 0
        match = r"cu_seqlens_q must be non-decreasing, got cu_seqlens_q\[1\] = 3 > cu_seqlens_q\[2\] = 0"
    elif case == "q_longer_than_max":
        over["max_seqlen_q"] = 6
        match = r"sequence 3 has length 7 according to cu_seqlens_q, more than the max_seqlen given for it \(6\)"
    elif case == "q_past_rows":
        cu_q[-1] = 17
        match = r"cu_seqlens_q\[5\] = 17 exceeds the number of rows of its tensor \(16\)"
    elif case == "new_decreasing":
        cu_new[4] = 1
        match = r"cu_seqlens_k_new must be non-decreasing, got cu_seqlens_k_new\[3\] = 2 > cu_seqlens_k_new\[4\] = 1"
    elif case == "new_past_rows":
        cu_new[-1] = 14
        match = r"cu_seqlens_k_new\[5\] = 14 exceeds the number of rows of its tensor \(13\)"
    elif case == "append_past_cache":
        seqlens = args["cache_seqlens"].clone()
        seqlens[3] = capacity - 6
        over["cache_seqlens"] = seqlens
        match = rf"cache_seqlens\[3\] \+ seqlen_new = {capacity - 6} \+ 7 must fit in the cache"
    else:
        seqlens = args["rotary_seqlens"] if "rotary_seqlens" in args else None
        over["rotary_seqlens"] = torch.tensor([0, 0, 0, capacity - 6, 0], dtype=torch.int32)
        match = rf"batch 3 needs position {capacity}"
    over.setdefault("cu_seqlens_q", cu_q)
    over.setdefault("cu_seqlens_k_new", cu_new)
    expect_error(args, match, **over)
