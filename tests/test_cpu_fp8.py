"""FP8 (float8_e4m3fn) on the CPU path: docs/fp8.md.

The CPU path dequantises (x * descale of the batch entry and kv head), attends
in fp32 and rounds the output; it must meet the correctness criterion
(docs/architecture.md) against the float64 reference of the dequantised
inputs, with plain torch in bfloat16 (the output dtype) as the same-dtype
baseline. Appends into an fp8 cache must equal torch's own e4m3 conversion
of value / descale saturated to [-448, 448], bit for bit. Descales differ per
(batch entry, kv head) in every test, so a descale read for the wrong entry
or head fails the comparison.
"""

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reference as ref  # noqa: E402

from flash_attn_cuda import (  # noqa: E402
    flash_attn_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
)

FP8 = torch.float8_e4m3fn
ops = torch.ops.flash_attn


def skip_below_sm89(what):
    """Skips the calling CUDA test on a GPU older than FP8's compute capability 8.9."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip(f"{what} needs a GPU of compute capability 8.9 or newer")


def fp8_rand(*shape, amax=6.0):
    """Random e4m3 values spread over [-amax, amax] (normal and subnormal)."""
    return (torch.randn(*shape) * (amax / 3)).clamp(-amax, amax).to(FP8)


def descales(batch, nheads_k):
    """Distinct positive descales per (batch entry, kv head)."""
    return torch.rand(batch, nheads_k) * 0.5 + 0.05


def bits(t):
    return t.view(torch.uint8)


def assert_same_fp8(ours, expected):
    """Bit for bit, except that any NaN matches any NaN (the sign of a NaN is
    not part of the rule)."""
    nan = torch.isnan(expected.float())
    assert torch.equal(torch.isnan(ours.float()), nan)
    assert torch.equal(bits(ours)[~nan], bits(expected)[~nan])


def check_out_lse(out, lse, ref_out, ref_lse, same_out):
    """The criterion on out (bf16 or fp16 against float64, with the same math in
    out's dtype as the baseline) and fp32 against float64 on lse (+inf rows
    equal)."""
    assert torch.isfinite(out).all()
    ref.assert_within_criterion(out, ref_out, same_out, name="out")
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-5)


def fixed_case(batch, seqlen_q, seqlen_k, nheads, nheads_k, d, d_v=None, sink=False):
    d_v = d if d_v is None else d_v
    q = fp8_rand(batch, seqlen_q, nheads, d)
    k = fp8_rand(batch, seqlen_k, nheads_k, d)
    v = fp8_rand(batch, seqlen_k, nheads_k, d_v)
    scales = [descales(batch, nheads_k) for _ in range(3)]
    learnable_sink = torch.randn(nheads) if sink else None
    return q, k, v, scales, learnable_sink


# ---------------------------------------------------------------------------
# flash_attn_func
# ---------------------------------------------------------------------------

FIXED_SHAPES = [
    # batch, seqlen_q, seqlen_k, nheads, nheads_k, d
    (1, 1, 1, 1, 1, 32),
    (2, 17, 113, 4, 2, 64),
    (2, 128, 129, 8, 1, 64),  # MQA
    (1, 129, 17, 8, 8, 96),  # seqlen_q > seqlen_k
    (3, 2, 255, 8, 1, 128),  # decode-like, MQA
    (2, 127, 128, 16, 2, 40),  # GQA 8
]

FEATURES = [
    dict(),
    dict(causal=True),
    dict(window_size=(16, 3)),
    dict(causal=True, window_size=(7, -1)),
    dict(softcap=5.0),
    dict(sink=True),
    dict(causal=True, softcap=3.0, sink=True),
]


@pytest.mark.parametrize("shape", FIXED_SHAPES)
@pytest.mark.parametrize("features", FEATURES, ids=lambda f: ",".join(f) or "plain")
def test_fp8_func_against_float64(shape, features):
    batch, seqlen_q, seqlen_k, nheads, nheads_k, d = shape
    features = dict(features)
    q, k, v, (dq_s, dk_s, dv_s), sink = fixed_case(
        batch, seqlen_q, seqlen_k, nheads, nheads_k, d, sink=features.pop("sink", False)
    )
    out, lse = flash_attn_func(
        q,
        k,
        v,
        **features,
        learnable_sink=sink,
        return_softmax_lse=True,
        q_descale=dq_s,
        k_descale=dk_s,
        v_descale=dv_s,
    )
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert out.shape == (batch, seqlen_q, nheads, d)
    qd, kd, vd = (ref.fp8_dequantize(t, s) for t, s in ((q, dq_s), (k, dk_s), (v, dv_s)))
    ref_out, ref_lse = ref.attention_ref(qd, kd, vd, **features, learnable_sink=sink)
    same_out, _ = ref.attention_ref(
        qd, kd, vd, **features, learnable_sink=sink, compute_dtype=torch.bfloat16
    )
    check_out_lse(out, lse, ref_out, ref_lse, same_out)


@pytest.mark.parametrize("d, d_v", [(36, 36), (64, 32), (192, 128), (72, 40)])
def test_fp8_func_head_dims(d, d_v):
    """Head dims that are not a multiple of 8 (zero-padded fp8) and d_v < d_qk."""
    q, k, v, (dq_s, dk_s, dv_s), _ = fixed_case(2, 33, 65, 4, 2, d, d_v)
    out, lse = flash_attn_func(
        q,
        k,
        v,
        causal=True,
        return_softmax_lse=True,
        q_descale=dq_s,
        k_descale=dk_s,
        v_descale=dv_s,
    )
    assert out.shape == (2, 33, 4, d_v)
    qd, kd, vd = (ref.fp8_dequantize(t, s) for t, s in ((q, dq_s), (k, dk_s), (v, dv_s)))
    ref_out, ref_lse = ref.attention_ref(qd, kd, vd, causal=True)
    same_out, _ = ref.attention_ref(qd, kd, vd, causal=True, compute_dtype=torch.bfloat16)
    check_out_lse(out, lse, ref_out, ref_lse, same_out)


def test_fp8_descales_default_to_one_and_broadcast():
    """Missing descales are 1; an expanded scalar (strides 0, vLLM's form) works."""
    q, k, v, _, _ = fixed_case(2, 17, 40, 4, 2, 64)
    plain = flash_attn_func(q, k, v)
    ones = torch.ones(2, 2)
    assert torch.equal(plain, flash_attn_func(q, k, v, q_descale=ones, k_descale=ones))
    scalar = torch.tensor(0.37).expand(2, 2)
    out = flash_attn_func(q, k, v, v_descale=scalar)
    ref_out, _ = ref.attention_ref(q.double(), k.double(), v.double() * 0.37)
    same_out, _ = ref.attention_ref(
        q.double(), k.double(), v.double() * 0.37, compute_dtype=torch.bfloat16
    )
    ref.assert_within_criterion(out, ref_out, same_out)


def test_fp8_rows_that_see_no_key():
    """seqlen_q > seqlen_k, causal: the first rows see no key: out 0, lse +inf
    (with sinks: lse = the sink)."""
    q, k, v, (dq_s, dk_s, dv_s), _ = fixed_case(2, 40, 9, 4, 2, 32)
    sink = torch.randn(4)
    kw = dict(causal=True, return_softmax_lse=True, q_descale=dq_s, k_descale=dk_s, v_descale=dv_s)
    out, lse = flash_attn_func(q, k, v, **kw)
    assert torch.equal(out[:, :31], torch.zeros_like(out[:, :31]))
    assert torch.isinf(lse[:, :, :31]).all() and (lse[:, :, :31] > 0).all()
    assert torch.isfinite(lse[:, :, 31:]).all()
    out, lse = flash_attn_func(q, k, v, learnable_sink=sink, **kw)
    assert torch.equal(out[:, :31], torch.zeros_like(out[:, :31]))
    torch.testing.assert_close(lse[:, :, :31], sink.view(1, 4, 1).expand(2, 4, 31))


def test_fp8_out_argument():
    q, k, v, (dq_s, dk_s, dv_s), _ = fixed_case(2, 17, 30, 4, 2, 64)
    kw = dict(q_descale=dq_s, k_descale=dk_s, v_descale=dv_s, causal=True)
    expected = flash_attn_func(q, k, v, **kw)
    out = torch.full((2, 17, 4, 64), float("nan"), dtype=torch.bfloat16)
    assert flash_attn_func(q, k, v, out=out, **kw) is out
    assert torch.equal(out, expected)


# ---------------------------------------------------------------------------
# flash_attn_varlen_func, contiguous and paged
# ---------------------------------------------------------------------------


def varlen_case(seqlens_q, seqlens_k, nheads, nheads_k, d):
    cu_q = torch.tensor([0] + seqlens_q).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + seqlens_k).cumsum(0).to(torch.int32)
    q = fp8_rand(int(cu_q[-1]), nheads, d)
    k = fp8_rand(int(cu_k[-1]), nheads_k, d)
    v = fp8_rand(int(cu_k[-1]), nheads_k, d)
    scales = [descales(len(seqlens_q), nheads_k) for _ in range(3)]
    return q, k, v, cu_q, cu_k, scales


def varlen_refs(q, k, v, cu_q, cu_k, scales, **features):
    dq_s, dk_s, dv_s = scales
    qd = ref.fp8_dequantize_varlen(q, dq_s, cu_q)
    kd = ref.fp8_dequantize_varlen(k, dk_s, cu_k)
    vd = ref.fp8_dequantize_varlen(v, dv_s, cu_k)
    ref_out, ref_lse = ref.varlen_attention_ref(qd, kd, vd, cu_q, cu_k, **features)
    same_out, _ = ref.varlen_attention_ref(
        qd, kd, vd, cu_q, cu_k, compute_dtype=torch.bfloat16, **features
    )
    return ref_out, ref_lse, same_out


@pytest.mark.parametrize(
    "features", [dict(), dict(causal=True), dict(window_size=(5, 0)), dict(softcap=4.0)]
)
def test_fp8_varlen_with_empty_sequence(features):
    """An empty sequence (no rows at all), one with queries but no keys (rows
    that see no key), GQA 2, differing lengths."""
    seqlens_q, seqlens_k = [5, 0, 17, 3, 1], [9, 0, 40, 0, 129]
    q, k, v, cu_q, cu_k, scales = varlen_case(seqlens_q, seqlens_k, 4, 2, 64)
    out, lse = flash_attn_varlen_func(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max(seqlens_q),
        max(seqlens_k),
        **features,
        return_softmax_lse=True,
        q_descale=scales[0],
        k_descale=scales[1],
        v_descale=scales[2],
    )
    assert out.dtype == torch.bfloat16
    ref_out, ref_lse, same_out = varlen_refs(q, k, v, cu_q, cu_k, scales, **features)
    check_out_lse(out, lse, ref_out, ref_lse, same_out)
    assert torch.equal(out[22:25], torch.zeros_like(out[22:25]))  # sequence 3: no key


def paged_case(seqlens_q, seqlens_k, page_size, nheads, nheads_k, d):
    """A varlen fp8 call over paged K / V in a pool of spare pages, through a
    shuffled block table: (q, k_pages, v_pages, block_table, cu_q, cu_k,
    scales), and the packed keys and values the pages hold (k, v)."""
    _, _, _, cu_q, cu_k, scales = varlen_case(seqlens_q, seqlens_k, nheads, nheads_k, d)
    q = fp8_rand(int(cu_q[-1]), nheads, d)
    pages = [math.ceil(s / page_size) for s in seqlens_k]
    num_blocks = sum(pages) + 3
    k_pages = fp8_rand(num_blocks, page_size, nheads_k, d)
    v_pages = fp8_rand(num_blocks, page_size, nheads_k, d)
    order = torch.randperm(num_blocks)
    block_table = torch.zeros(len(seqlens_k), max(pages), dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages):
        block_table[b, :n] = order[used : used + n]
        used += n
    # The keys of each sequence gathered from its pages, packed end to end.
    k_packed, v_packed = [], []
    for b, seqlen in enumerate(seqlens_k):
        rows = torch.arange(seqlen)
        blocks = block_table[b].long()[rows // page_size]
        k_packed.append(k_pages[blocks, rows % page_size])
        v_packed.append(v_pages[blocks, rows % page_size])
    call = (q, k_pages, v_pages, block_table, cu_q, cu_k, scales)
    return call, (torch.cat(k_packed), torch.cat(v_packed))


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_varlen_paged(page_size, causal):
    """Paged fp8 K/V through a shuffled block table: each sequence dequantises its
    pages with its own descales."""
    seqlens_q, seqlens_k = [3, 1, 20], [37, 1, 50]
    call, (k, v) = paged_case(seqlens_q, seqlens_k, page_size, 8, 2, 64)
    q, k_pages, v_pages, block_table, cu_q, cu_k, scales = call
    out, lse = flash_attn_varlen_func(
        q,
        k_pages,
        v_pages,
        cu_q,
        cu_k,
        max(seqlens_q),
        max(seqlens_k),
        causal=causal,
        block_table=block_table,
        return_softmax_lse=True,
        q_descale=scales[0],
        k_descale=scales[1],
        v_descale=scales[2],
    )
    ref_out, ref_lse, same_out = varlen_refs(q, k, v, cu_q, cu_k, scales, causal=causal)
    check_out_lse(out, lse, ref_out, ref_lse, same_out)


# ---------------------------------------------------------------------------
# An FP8 KV cache through flash_attn_varlen_func and flash_attn_func: e4m3 k
# and v under a 16-bit q (vLLM's chunked prefill over its e4m3 cache)
# ---------------------------------------------------------------------------


def fp8_cache_varlen_case(seqlens_q, seqlens_k, page_size, dtype, nheads=8, nheads_k=2, d=64):
    """A varlen call over e4m3 keys and values, packed (page_size None) or paged
    through a shuffled table, with a q of dtype: (q, k_in, v_in, block_table,
    cu_q, cu_k, (k_descale, v_descale)) and the packed keys and values."""
    if page_size is None:
        _, k, v, cu_q, cu_k, scales = varlen_case(seqlens_q, seqlens_k, nheads, nheads_k, d)
        k_in, v_in, table = k, v, None
    else:
        call, (k, v) = paged_case(seqlens_q, seqlens_k, page_size, nheads, nheads_k, d)
        _, k_in, v_in, table, cu_q, cu_k, scales = call
    q = torch.randn(int(cu_q[-1]), nheads, d).to(dtype)
    return (q, k_in, v_in, table, cu_q, cu_k, (scales[1], scales[2])), (k, v)


def fp8_cache_varlen_refs(q, k, v, cu_q, cu_k, kv_descales, **features):
    """float64 attention of q against the dequantised packed keys and values,
    and the same math in q's dtype (the criterion's baseline)."""
    kd = ref.fp8_dequantize_varlen(k, kv_descales[0], cu_k)
    vd = ref.fp8_dequantize_varlen(v, kv_descales[1], cu_k)
    ref_out, ref_lse = ref.varlen_attention_ref(q.double(), kd, vd, cu_q, cu_k, **features)
    same_out, _ = ref.varlen_attention_ref(
        q.double(), kd, vd, cu_q, cu_k, compute_dtype=q.dtype, **features
    )
    return ref_out, ref_lse, same_out


# Sequence 1 is empty, sequence 3 has queries and no key (its rows see none).
FP8_CACHE_SEQLENS = ([3, 0, 20, 2], [37, 0, 50, 0])
FP8_CACHE_FEATURES = [dict(), dict(causal=True), dict(softcap=4.0, window_size=(9, 0))]


def call_fp8_cache_varlen(case, device="cpu", **features):
    (q, k_in, v_in, table, cu_q, cu_k, (dk_s, dv_s)), _ = case

    def to(t):
        return None if t is None else t.to(device)

    return flash_attn_varlen_func(
        to(q),
        to(k_in),
        to(v_in),
        to(cu_q),
        to(cu_k),
        max(FP8_CACHE_SEQLENS[0]),
        max(FP8_CACHE_SEQLENS[1]),
        block_table=to(table),
        return_softmax_lse=True,
        k_descale=to(dk_s),
        v_descale=to(dv_s),
        **features,
    )


@pytest.mark.parametrize("page_size", [None, 1, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("features", FP8_CACHE_FEATURES, ids=lambda f: ",".join(f) or "plain")
def test_fp8_cache_varlen_with_16_bit_q(page_size, dtype, features):
    """e4m3 k and v (packed or paged) with k_descale / v_descale under a 16-bit
    q: the output in q's dtype, each sequence dequantised with its own
    descales; empty sequences and rows that see no key included."""
    case = fp8_cache_varlen_case(*FP8_CACHE_SEQLENS, page_size, dtype)
    (q, _, _, _, cu_q, cu_k, kv_descales), (k, v) = case
    out, lse = call_fp8_cache_varlen(case, **features)
    assert out.dtype == dtype and out.shape == q.shape
    ref_out, ref_lse, same_out = fp8_cache_varlen_refs(q, k, v, cu_q, cu_k, kv_descales, **features)
    check_out_lse(out, lse, ref_out, ref_lse, same_out)
    assert torch.equal(out[23:25], torch.zeros_like(out[23:25]))  # sequence 3: no key


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("features", [dict(), dict(causal=True), dict(sink=True, softcap=3.0)])
def test_fp8_cache_func_with_16_bit_q(dtype, features):
    """flash_attn_func with e4m3 k and v under a 16-bit q, GQA 4, d_v < d_qk."""
    features = dict(features)
    _, k, v, (_, dk_s, dv_s), sink = fixed_case(
        2, 9, 70, 8, 2, 64, d_v=32, sink=features.pop("sink", False)
    )
    q = torch.randn(2, 9, 8, 64).to(dtype)
    out, lse = flash_attn_func(
        q,
        k,
        v,
        **features,
        learnable_sink=sink,
        return_softmax_lse=True,
        k_descale=dk_s,
        v_descale=dv_s,
    )
    assert out.dtype == dtype and out.shape == (2, 9, 8, 32)
    kd, vd = ref.fp8_dequantize(k, dk_s), ref.fp8_dequantize(v, dv_s)
    ref_out, ref_lse = ref.attention_ref(q.double(), kd, vd, **features, learnable_sink=sink)
    same_out, _ = ref.attention_ref(
        q.double(), kd, vd, **features, learnable_sink=sink, compute_dtype=dtype
    )
    check_out_lse(out, lse, ref_out, ref_lse, same_out)


# ---------------------------------------------------------------------------
# flash_attn_with_kvcache: an FP8 KV cache
# ---------------------------------------------------------------------------


def kvcache_reference(q, k_cache, v_cache, k_descale, v_descale, seqlens_k, block_table, **feat):
    """Per batch entry: keys [0, seqlens_k[b]) of the (fp8) cache, dequantised
    with b's descales; q in float64. Returns (out, lse, same_out)."""
    batch = q.shape[0]
    page_size = k_cache.shape[1]
    outs, lses, sames = [], [], []
    for b in range(batch):
        rows = torch.arange(int(seqlens_k[b]))
        if block_table is None:
            kb, vb = k_cache[b, rows], v_cache[b, rows]
        else:
            blocks = block_table[b].long()[rows // page_size]
            kb, vb = k_cache[blocks, rows % page_size], v_cache[blocks, rows % page_size]
        kd = ref.fp8_dequantize(kb.unsqueeze(0), k_descale[b : b + 1])
        vd = ref.fp8_dequantize(vb.unsqueeze(0), v_descale[b : b + 1])
        qb = q[b : b + 1].double()
        o, lse = ref.attention_ref(qb, kd, vd, **feat)
        same, _ = ref.attention_ref(qb, kd, vd, compute_dtype=q.dtype, **feat)
        outs.append(o)
        lses.append(lse)
        sames.append(same)
    return torch.cat(outs), torch.cat(lses), torch.cat(sames)


def make_cache(batch, capacity, nheads_k, d, page_size):
    """An fp8 cache, contiguous (page_size None) or paged through a shuffled table."""
    if page_size is None:
        return fp8_rand(batch, capacity, nheads_k, d), fp8_rand(batch, capacity, nheads_k, d), None
    per_seq = math.ceil(capacity / page_size)
    num_blocks = batch * per_seq + 2
    table = torch.randperm(num_blocks)[: batch * per_seq].view(batch, per_seq).to(torch.int32)
    k_cache = fp8_rand(num_blocks, page_size, nheads_k, d)
    v_cache = fp8_rand(num_blocks, page_size, nheads_k, d)
    return k_cache, v_cache, table


def cache_rows(cache, b, positions, block_table):
    if block_table is None:
        return cache[b, positions]
    page_size = cache.shape[1]
    return cache[block_table[b].long()[positions // page_size], positions % page_size]


@pytest.mark.parametrize("page_size", [None, 1, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("features", [dict(), dict(causal=True), dict(softcap=4.0, sink=True)])
def test_fp8_kvcache_append_and_attend(page_size, dtype, features):
    features = dict(features)
    batch, capacity, nheads, nheads_k, d, seqlen_new, seqlen_q = 3, 40, 8, 2, 64, 3, 3
    k_cache, v_cache, table = make_cache(batch, capacity, nheads_k, d, page_size)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    cache_seqlens = torch.tensor([0, 17, 37], dtype=torch.int32)
    q = torch.randn(batch, seqlen_q, nheads, d, dtype=dtype)
    # Scaled so that some values saturate: |value| / descale above 448.
    k_new = (torch.randn(batch, seqlen_new, nheads_k, d) * 40).to(dtype)
    v_new = (torch.randn(batch, seqlen_new, nheads_k, d) * 40).to(dtype)
    k_s, v_s = descales(batch, nheads_k) * 0.2, descales(batch, nheads_k) * 0.2
    sink = torch.randn(nheads) if features.pop("sink", False) else None
    out, lse = flash_attn_with_kvcache(
        q,
        k_cache,
        v_cache,
        k_new,
        v_new,
        cache_seqlens=cache_seqlens,
        block_table=table,
        **features,
        learnable_sink=sink,
        return_softmax_lse=True,
        k_descale=k_s,
        v_descale=v_s,
    )
    assert out.dtype == dtype
    saturated = 0
    for b in range(batch):
        new = torch.arange(int(cache_seqlens[b]), int(cache_seqlens[b]) + seqlen_new)
        for cache, before, value, scale in (
            (k_cache, k_before, k_new, k_s),
            (v_cache, v_before, v_new, v_s),
        ):
            expected = ref.quantize_e4m3(value[b], scale[b].view(1, nheads_k, 1))
            assert torch.equal(bits(cache_rows(cache, b, new, table)), bits(expected))
            saturated += int((expected.float().abs() == 448).sum())
            old = torch.arange(int(cache_seqlens[b]))
            assert torch.equal(
                bits(cache_rows(cache, b, old, table)), bits(cache_rows(before, b, old, table))
            )
    assert saturated > 0
    seqlens_k = cache_seqlens + seqlen_new
    ref_out, ref_lse, same_out = kvcache_reference(
        q, k_cache, v_cache, k_s, v_s, seqlens_k, table, **features, learnable_sink=sink
    )
    ref.assert_within_criterion(out, ref_out, same_out)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-5)


def check_append_quantises_what_a_16_bit_cache_holds(device):
    """With rotary, cache_batch_idx and a varlen append, the fp8 cache's new rows
    are the bf16 cache's new rows quantised (value / descale of the batch entry,
    not of its cache row, saturated), bit for bit, a NaN kept as NaN. On
    `device`; tests/test_cuda_fp8_kvcache.py runs it on CUDA."""
    batch, capacity, nheads, nheads_k, d = 3, 32, 4, 2, 64
    k_bf16 = torch.randn(batch + 1, capacity, nheads_k, d, dtype=torch.bfloat16)
    v_bf16 = torch.randn(batch + 1, capacity, nheads_k, d, dtype=torch.bfloat16)
    k_fp8, v_fp8 = (
        fp8_rand(batch + 1, capacity, nheads_k, d),
        fp8_rand(batch + 1, capacity, nheads_k, d),
    )
    cache_batch_idx = torch.tensor([2, 0, 3], dtype=torch.int32)
    cache_seqlens = torch.tensor([4, 0, 20], dtype=torch.int32)
    cu_new = torch.tensor([0, 2, 2, 7], dtype=torch.int32)
    k_new = (torch.randn(7, nheads_k, d) * 30).to(torch.bfloat16)
    v_new = (torch.randn(7, nheads_k, d) * 30).to(torch.bfloat16)
    k_new[3, 1, 5] = float("nan")
    q = torch.randn(batch, 1, nheads, d, dtype=torch.bfloat16)
    cos, sin = (
        torch.randn(capacity, 16, dtype=torch.bfloat16),
        torch.randn(capacity, 16, dtype=torch.bfloat16),
    )
    k_s, v_s = descales(batch, nheads_k) * 0.1, descales(batch, nheads_k) * 0.1
    (k_bf16, v_bf16, k_fp8, v_fp8, cache_batch_idx, cache_seqlens, cu_new, k_new, v_new, q) = (
        t.to(device)
        for t in (
            k_bf16,
            v_bf16,
            k_fp8,
            v_fp8,
            cache_batch_idx,
            cache_seqlens,
            cu_new,
            k_new,
            v_new,
            q,
        )
    )
    cos, sin, k_s, v_s = cos.to(device), sin.to(device), k_s.to(device), v_s.to(device)
    common = dict(
        rotary_cos=cos,
        rotary_sin=sin,
        cache_seqlens=cache_seqlens,
        cache_batch_idx=cache_batch_idx,
        causal=True,
        cu_seqlens_k_new=cu_new,
    )
    flash_attn_with_kvcache(q, k_bf16, v_bf16, k_new, v_new, **common)
    flash_attn_with_kvcache(q, k_fp8, v_fp8, k_new, v_new, **common, k_descale=k_s, v_descale=v_s)
    for b in range(batch):
        row = int(cache_batch_idx[b])
        new = slice(int(cache_seqlens[b]), int(cache_seqlens[b]) + int(cu_new[b + 1] - cu_new[b]))
        for fp8_cache, bf16_cache, scale in ((k_fp8, k_bf16, k_s), (v_fp8, v_bf16, v_s)):
            expected = ref.quantize_e4m3(
                bf16_cache[row, new].cpu(), scale[b].view(1, nheads_k, 1).cpu()
            )
            assert_same_fp8(fp8_cache[row, new].cpu(), expected)
    # The NaN stays NaN (k of sequence 2, its second new row, head 1).
    assert torch.isnan(k_fp8[3, 21, 1].float()).any()


def test_fp8_kvcache_quantises_what_a_16_bit_cache_holds():
    check_append_quantises_what_a_16_bit_cache_holds("cpu")


def test_fp8_kvcache_saturates_to_448():
    """Past the e4m3 range (either sign, inf too) the cache holds +-448, whatever
    the torch version's own conversion does with overflow."""
    k_cache = torch.zeros(1, 8, 1, 8).to(FP8)
    v_cache = torch.zeros(1, 8, 1, 8).to(FP8)
    big = torch.tensor([500.0, -500.0, 1e4, float("inf"), -float("inf"), 448.0, 464.0, 1.0])
    k_new = big.view(1, 1, 1, 8).to(torch.bfloat16)
    flash_attn_with_kvcache(
        torch.randn(1, 1, 1, 8, dtype=torch.bfloat16),
        k_cache,
        v_cache,
        k_new,
        k_new.clone(),
        cache_seqlens=torch.tensor([0], dtype=torch.int32),
        k_descale=torch.full((1, 1), 0.5),
    )
    # value / 0.5: 1000, -1000, 2e4, inf, -inf, 896, 928, 2 -> saturated, then 2.
    expected = torch.tensor([448.0, -448.0, 448.0, 448.0, -448.0, 448.0, 448.0, 2.0])
    assert torch.equal(k_cache[0, 0, 0].float(), expected)
    # v without a descale: 500 -> 448, 448 and 464 -> 448, 1 -> 1.
    assert torch.equal(v_cache[0, 0, 0].float(), big.clamp(-448, 448))


# ---------------------------------------------------------------------------
# The tolerance docs/fp8.md gives a future CUDA kernel
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_fp8_kernel_tolerance_admits_p_rounding_and_rejects_a_wrong_descale(causal):
    """A float64 model of FA3's kernel (P rounded to e4m3 before P·V) stays within
    fp8_kernel_tolerance and uses a visible part of it; the same model reading
    every head's v_descale from kv head 0 does not stay within it. The CPU path
    is inside it too."""
    batch, seqlen, nheads, nheads_k, d = 2, 300, 4, 2, 128
    q, k, _, (dq_s, dk_s, dv_s), _ = fixed_case(batch, seqlen, seqlen, nheads, nheads_k, d)
    # Positive values: the output is a weighted mean of them, so a wrong
    # descale shows however many keys a row averages.
    v = (torch.rand(batch, seqlen, nheads_k, d) * 6).to(FP8)
    dv_s[:, 1] = dv_s[:, 0] * 1.5
    qd, kd, vd = (ref.fp8_dequantize(t, s) for t, s in ((q, dq_s), (k, dk_s), (v, dv_s)))
    scale = d**-0.5
    ref_out, ref_lse = ref.attention_ref(qd, kd, vd, causal=causal)
    ref_abs_out, _ = ref.attention_ref(qd, kd, vd.abs(), causal=causal)
    out_bound, lse_bound = ref.fp8_kernel_tolerance(
        qd, kd, vd, scale, ref_out, ref_abs_out, ref_lse
    )
    model = ref.emulate_fp8_p_kernel(qd, kd, vd, scale, causal=causal).to(torch.bfloat16)
    ratio = (model.double() - ref_out).abs() / out_bound
    assert ratio.max() <= 1.0
    assert ratio.max() > 0.01  # the model does round P: the bound is not vacuous for it
    wrong_v = ref.fp8_dequantize(v, dv_s[:, :1].expand(batch, nheads_k))
    wrong = ref.emulate_fp8_p_kernel(qd, kd, wrong_v, scale, causal=causal)
    assert ((wrong - ref_out).abs() > out_bound).any()
    out, lse = flash_attn_func(
        q,
        k,
        v,
        causal=causal,
        return_softmax_lse=True,
        q_descale=dq_s,
        k_descale=dk_s,
        v_descale=dv_s,
    )
    assert ((out.double() - ref_out).abs() <= out_bound).all()
    assert ((lse.double() - ref_lse).abs() <= lse_bound).all()


# ---------------------------------------------------------------------------
# Forward only
# ---------------------------------------------------------------------------


def test_fp8_backward_raises_a_clear_error():
    q, k, v, (dq_s, dk_s, dv_s), _ = fixed_case(1, 9, 9, 2, 1, 32)
    q.requires_grad_()  # torch lets an fp8 tensor require grad
    out = flash_attn_func(q, k, v, q_descale=dq_s)
    assert out.requires_grad
    with pytest.raises(RuntimeError, match="backward pass does not take float8_e4m3fn"):
        out.float().sum().backward()
    cu = torch.tensor([0, 9], dtype=torch.int32)
    out = flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 9, 9)
    with pytest.raises(RuntimeError, match="flash_attn_varlen_func: the backward pass"):
        out.float().sum().backward()


def test_fp8_backward_op_refuses():
    q, k, v, _, _ = fixed_case(1, 9, 9, 2, 1, 32)
    dout = torch.randn(1, 9, 2, 32, dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 9)
    with pytest.raises(RuntimeError, match="FP8 attention is forward only"):
        ops.bwd(dout, q, k, v, dout, lse, None, 0.0, 0.2, False, -1, -1, 0.0, False, None)
