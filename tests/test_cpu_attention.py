"""CPU implementations of torch.ops.flash_attn.{fwd, bwd, varlen_fwd, varlen_bwd}
against the float64 reference in reference.py.

fp32 inputs are held to a tight tolerance (the kernels accumulate in fp32);
fp16 / bf16 inputs to the correctness criterion (docs/architecture.md) relative
to torch doing the same
math in that dtype. Backward results are compared with torch.autograd through
the float64 reference, for every feature that has a backward.
"""

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reference as ref  # noqa: E402
import s_dmask  # noqa: E402

import flash_attn_cuda  # noqa: E402  (registers torch.ops.flash_attn)

ops = torch.ops.flash_attn

FP32_TOL = dict(atol=2e-5, rtol=2e-5)
FP32_GRAD_TOL = dict(atol=5e-5, rtol=5e-5)


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def call_fwd(
    q,
    k,
    v,
    *,
    alibi=None,
    dropout_p=0.0,
    scale=None,
    causal=False,
    window=(-1, -1),
    softcap=0.0,
    return_softmax=False,
    seed=0,
    offset=0,
    rng_state=None,
):
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return ops.fwd(
        q,
        k,
        v,
        alibi,
        dropout_p,
        scale,
        causal,
        window[0],
        window[1],
        softcap,
        return_softmax,
        seed,
        offset,
        rng_state,
    )


def call_bwd(
    dout,
    q,
    k,
    v,
    out,
    lse,
    *,
    alibi=None,
    dropout_p=0.0,
    scale=None,
    causal=False,
    window=(-1, -1),
    softcap=0.0,
    deterministic=False,
    rng_state=None,
):
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return ops.bwd(
        dout,
        q,
        k,
        v,
        out,
        lse,
        alibi,
        dropout_p,
        scale,
        causal,
        window[0],
        window[1],
        softcap,
        deterministic,
        rng_state,
    )


def call_varlen_fwd(
    q,
    k,
    v,
    cu_q,
    cu_k,
    max_q,
    max_k,
    *,
    block_table=None,
    alibi=None,
    dropout_p=0.0,
    scale=None,
    causal=False,
    window=(-1, -1),
    softcap=0.0,
    return_softmax=False,
    seed=0,
    offset=0,
    rng_state=None,
):
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return ops.varlen_fwd(
        q,
        k,
        v,
        cu_q,
        cu_k,
        block_table,
        alibi,
        max_q,
        max_k,
        dropout_p,
        scale,
        causal,
        window[0],
        window[1],
        softcap,
        return_softmax,
        seed,
        offset,
        rng_state,
    )


def call_varlen_bwd(
    dout,
    q,
    k,
    v,
    out,
    lse,
    cu_q,
    cu_k,
    max_q,
    max_k,
    *,
    alibi=None,
    dropout_p=0.0,
    scale=None,
    causal=False,
    window=(-1, -1),
    softcap=0.0,
    deterministic=False,
    rng_state=None,
):
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return ops.varlen_bwd(
        dout,
        q,
        k,
        v,
        out,
        lse,
        cu_q,
        cu_k,
        alibi,
        max_q,
        max_k,
        dropout_p,
        scale,
        causal,
        window[0],
        window[1],
        softcap,
        deterministic,
        rng_state,
    )


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


def make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype=torch.float32):
    return (
        randn(batch, seqlen_q, nheads, head_dim, dtype=dtype),
        randn(batch, seqlen_k, nheads_k, head_dim, dtype=dtype),
        randn(batch, seqlen_k, nheads_k, head_dim, dtype=dtype),
    )


def make_alibi(kind, batch, nheads):
    if kind is None:
        return None
    shape = (nheads,) if kind == "head" else (batch, nheads)
    return torch.rand(*shape, dtype=torch.float32) * 0.5 + 0.05


def reference_with_grads(q, k, v, dout, compute_dtype=torch.float64, **kwargs):
    """Reference output, lse and (dq, dk, dv) by autograd, in compute_dtype."""
    leaves = [t.detach().to(compute_dtype).requires_grad_() for t in (q, k, v)]
    out, lse = ref.attention_ref(*leaves, compute_dtype=compute_dtype, **kwargs)
    out.backward(dout.to(compute_dtype))
    return out.detach(), lse.detach(), tuple(t.grad for t in leaves)


def assert_close64(ours, expected, tol, name):
    torch.testing.assert_close(
        ours.double(), expected.double(), **tol, msg=lambda m: f"{name}: {m}"
    )


def cu_seqlens(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32)


# ---------------------------------------------------------------------------
# Fixed length, fp32: forward and backward against the float64 reference
# ---------------------------------------------------------------------------

# (batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, options)
FIXED_CASES = [
    (2, 1, 1, 2, 2, 32, {}),
    (1, 2, 17, 2, 1, 40, {}),
    (2, 17, 2, 2, 2, 32, dict(causal=True)),  # most rows see no key
    (2, 113, 129, 4, 2, 64, dict(causal=True)),
    (1, 129, 113, 2, 2, 64, dict(causal=True)),
    (1, 129, 113, 2, 2, 32, dict(window=(16, 8))),
    (2, 113, 129, 2, 1, 32, dict(causal=True, window=(32, -1))),
    (1, 65, 65, 2, 2, 16, dict(window=(0, 0))),
    (1, 70, 40, 2, 2, 16, dict(window=(-1, 3))),
    (1, 40, 70, 2, 2, 16, dict(window=(5, -1))),
    (2, 65, 80, 4, 4, 32, dict(softcap=2.5)),
    (2, 65, 80, 4, 2, 32, dict(softcap=5.0, causal=True)),
    (2, 65, 80, 4, 4, 32, dict(alibi="head")),
    (2, 80, 65, 4, 2, 32, dict(alibi="batch_head", causal=True)),
    (1, 60, 70, 4, 2, 32, dict(alibi="head", softcap=3.0, window=(20, 10))),
    (3, 33, 47, 8, 1, 32, {}),  # MQA
    (2, 33, 47, 8, 1, 32, dict(causal=True)),
    (1, 33, 47, 16, 2, 24, dict(causal=True)),  # GQA ratio 8
    (1, 50, 50, 2, 2, 64, dict(scale=0.3)),
    (1, 20, 30, 2, 2, 8, {}),
    (1, 20, 30, 2, 1, 72, dict(causal=True)),
    (1, 20, 30, 2, 2, 96, {}),
    (1, 20, 30, 2, 2, 128, dict(softcap=4.0)),
    (1, 20, 30, 2, 2, 160, dict(alibi="head")),
    (1, 20, 30, 2, 1, 224, dict(causal=True)),
    (1, 20, 30, 2, 2, 256, {}),
    (1, 129, 129, 1, 1, 256, dict(causal=True)),
]


def _case_id(case):
    b, sq, sk, h, hk, d, opts = case
    extra = "-".join(f"{k}={v}" for k, v in opts.items())
    return f"b{b}-sq{sq}-sk{sk}-h{h}-hk{hk}-d{d}" + (f"-{extra}" if extra else "")


@pytest.mark.parametrize("case", FIXED_CASES, ids=_case_id)
def test_fixed_length_fp32_matches_reference(case):
    batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, opts = case
    opts = dict(opts)
    alibi = make_alibi(opts.pop("alibi", None), batch, nheads)
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim)
    out, lse, probs, rng_state = call_fwd(q, k, v, alibi=alibi, **opts)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (batch, nheads, seqlen_q) and lse.dtype == torch.float32
    assert probs.shape == (0,)
    assert rng_state.dtype == torch.int64 and rng_state.shape == (2,)

    dout = randn(*q.shape)
    ref_kwargs = dict(
        softmax_scale=opts.get("scale"),
        causal=opts.get("causal", False),
        window_size=opts.get("window", (-1, -1)),
        softcap=opts.get("softcap", 0.0),
        alibi_slopes=alibi,
    )
    out_ref, lse_ref, grads_ref = reference_with_grads(q, k, v, dout, **ref_kwargs)
    assert_close64(out, out_ref, FP32_TOL, "out")
    assert_close64(lse, lse_ref, FP32_TOL, "lse")

    dq, dk, dv = call_bwd(dout, q, k, v, out, lse, alibi=alibi, **opts)
    for name, ours, expected in zip(("dq", "dk", "dv"), (dq, dk, dv), grads_ref):
        assert ours.shape == expected.shape and ours.dtype == q.dtype
        assert_close64(ours, expected, FP32_GRAD_TOL, name)


def test_rows_that_see_no_key():
    # Causal with seqlen_q > seqlen_k: the first seqlen_q - seqlen_k rows see nothing.
    q, k, v = make_qkv(2, 19, 7, 2, 2, 32)
    out, lse, _, _ = call_fwd(q, k, v, causal=True)
    assert torch.all(out[:, :12] == 0)
    assert torch.all(torch.isinf(lse[:, :, :12])) and torch.all(lse[:, :, :12] > 0)
    assert torch.all(torch.isfinite(lse[:, :, 12:]))
    dq, dk, dv = call_bwd(randn(*q.shape), q, k, v, out, lse, causal=True)
    assert torch.all(dq[:, :12] == 0)
    assert all(torch.isfinite(t).all() for t in (dq, dk, dv))

    # A local window that misses every key of some rows.
    q, k, v = make_qkv(1, 30, 10, 2, 2, 16)
    out, lse, _, _ = call_fwd(q, k, v, window=(2, 0))
    visible = ref.visible_mask(30, 10, 2, 0).any(dim=1)
    assert torch.all(out[:, ~visible] == 0) and torch.all(torch.isinf(lse[:, :, ~visible]))


@pytest.mark.parametrize("seqlen_q,seqlen_k,batch", [(0, 5, 2), (5, 0, 2), (0, 0, 2), (4, 4, 0)])
def test_empty_sequences(seqlen_q, seqlen_k, batch):
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, 2, 1, 32)
    out, lse, probs, _ = call_fwd(q, k, v, causal=True, return_softmax=True)
    assert out.shape == q.shape and lse.shape == (batch, 2, seqlen_q)
    assert probs.shape == (batch, 2, seqlen_q, seqlen_k)
    assert torch.all(out == 0) and torch.all(lse == float("inf"))
    dq, dk, dv = call_bwd(randn(*q.shape), q, k, v, out, lse, causal=True)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert all(torch.all(t == 0) for t in (dq, dk, dv))


def test_window_sides_beyond_seqlen_k_are_unbounded():
    # As in flash-attn 2.x: a side >= seqlen_k is normalised to "unbounded",
    # which matters for the right side when seqlen_q > seqlen_k.
    q, k, v = make_qkv(1, 40, 10, 2, 2, 16)
    out_window, _, _, _ = call_fwd(q, k, v, window=(10, 10))
    out_full, _, _, _ = call_fwd(q, k, v)
    torch.testing.assert_close(out_window, out_full, atol=0, rtol=0)
    # Causal forces right = 0 and keeps the left side: local attention.
    out_causal_left, _, _, _ = call_fwd(q, k, v, causal=True, window=(3, 7))
    out_local, _, _, _ = call_fwd(q, k, v, window=(3, 0))
    torch.testing.assert_close(out_causal_left, out_local, atol=0, rtol=0)


def test_strided_views_of_packed_qkv():
    batch, seqlen, nheads, head_dim = 2, 37, 4, 32
    qkv = randn(batch, seqlen, 3, nheads, head_dim)
    q, k, v = qkv.unbind(dim=2)
    assert not q.is_contiguous()
    out, lse, _, _ = call_fwd(q, k, v, causal=True, softcap=3.0)
    out_c, lse_c, _, _ = call_fwd(
        q.contiguous(), k.contiguous(), v.contiguous(), causal=True, softcap=3.0
    )
    torch.testing.assert_close(out, out_c, atol=0, rtol=0)
    torch.testing.assert_close(lse, lse_c, atol=0, rtol=0)

    # (batch, nheads, seqlen, dim) storage seen as (batch, seqlen, nheads, dim),
    # and a dout / out that are slices of wider buffers.
    q_t = randn(batch, nheads, seqlen, head_dim).transpose(1, 2)
    wide = randn(batch, seqlen, nheads, 2 * head_dim)
    dout = wide[..., head_dim:]
    out_buf = torch.empty(batch, seqlen, nheads, 2 * head_dim)
    out, lse, _, _ = call_fwd(q_t, k, v, causal=True)
    out_buf[..., :head_dim] = out
    grads = call_bwd(dout, q_t, k, v, out_buf[..., :head_dim], lse, causal=True)
    grads_c = call_bwd(
        dout.contiguous(), q_t.contiguous(), k.contiguous(), v.contiguous(), out, lse, causal=True
    )
    for ours, expected in zip(grads, grads_c):
        torch.testing.assert_close(ours, expected, atol=0, rtol=0)
    _, _, grads_ref = reference_with_grads(q_t, k, v, dout, causal=True)
    for name, ours, expected in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert_close64(ours, expected, FP32_GRAD_TOL, name)


def test_backward_is_deterministic_and_thread_independent():
    q, k, v = make_qkv(2, 70, 90, 4, 2, 32)
    out, lse, _, _ = call_fwd(q, k, v, causal=True)
    dout = randn(*q.shape)
    first = call_bwd(dout, q, k, v, out, lse, causal=True, deterministic=True)
    second = call_bwd(dout, q, k, v, out, lse, causal=True, deterministic=False)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = call_bwd(dout, q, k, v, out, lse, causal=True)
        out_single, _, _, _ = call_fwd(q, k, v, causal=True)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(out_single, out, atol=0, rtol=0)
    for a, b, c in zip(first, second, single):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
        torch.testing.assert_close(a, c, atol=0, rtol=0)


# ---------------------------------------------------------------------------
# fp16 / bf16: the correctness criterion (docs/architecture.md)
# ---------------------------------------------------------------------------

LOW_PRECISION_CASES = [
    (2, 113, 129, 4, 2, 64, dict(causal=True)),
    (1, 129, 65, 4, 1, 128, {}),
    (1, 60, 75, 4, 4, 32, dict(softcap=3.0, alibi="head")),
    (1, 64, 64, 2, 2, 256, dict(window=(16, 4))),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", LOW_PRECISION_CASES, ids=_case_id)
def test_low_precision_within_criterion(dtype, case):
    batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, opts = case
    opts = dict(opts)
    alibi = make_alibi(opts.pop("alibi", None), batch, nheads)
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype=dtype)
    dout = randn(*q.shape, dtype=dtype)
    ref_kwargs = dict(
        causal=opts.get("causal", False),
        window_size=opts.get("window", (-1, -1)),
        softcap=opts.get("softcap", 0.0),
        alibi_slopes=alibi,
    )
    out_ref, lse_ref, grads_ref = reference_with_grads(q, k, v, dout, **ref_kwargs)
    out_same, _, grads_same = reference_with_grads(q, k, v, dout, compute_dtype=dtype, **ref_kwargs)

    out, lse, _, _ = call_fwd(q, k, v, alibi=alibi, **opts)
    assert out.dtype == dtype and lse.dtype == torch.float32
    ref.assert_within_criterion(out, out_ref, out_same, factor=2.0, name="out")
    # lse is fp32 from fp32 accumulation of rounded inputs: only input rounding remains.
    assert_close64(lse, lse_ref, dict(atol=2e-5, rtol=2e-5), "lse")

    grads = call_bwd(dout, q, k, v, out, lse, alibi=alibi, **opts)
    for name, ours, exact, same in zip(("dq", "dk", "dv"), grads, grads_ref, grads_same):
        assert ours.dtype == dtype
        ref.assert_within_criterion(ours, exact, same, factor=3.0, name=name)


# ---------------------------------------------------------------------------
# Varlen
# ---------------------------------------------------------------------------

VARLEN_CASES = [
    ([3, 17, 1, 40], [5, 17, 29, 40], 4, 2, 32, {}),
    ([0, 1, 17, 2, 64], [3, 0, 17, 29, 64], 4, 4, 32, dict(causal=True)),
    ([33, 20, 9], [20, 33, 9], 8, 1, 16, dict(causal=True, softcap=4.0)),
    ([33, 20, 9], [20, 33, 9], 4, 2, 40, dict(window=(7, 3), alibi="batch_head")),
    ([50, 0], [10, 70], 2, 2, 64, dict(alibi="head")),
    ([0, 0], [0, 0], 2, 2, 32, {}),
]


def _varlen_id(case):
    lens_q, lens_k, h, hk, d, opts = case
    extra = "-".join(f"{k}={v}" for k, v in opts.items())
    return f"q{lens_q}-k{lens_k}-h{h}-hk{hk}-d{d}" + (f"-{extra}" if extra else "")


def make_varlen(lens_q, lens_k, nheads, nheads_k, head_dim, dtype=torch.float32):
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    q = randn(int(cu_q[-1]), nheads, head_dim, dtype=dtype)
    k = randn(int(cu_k[-1]), nheads_k, head_dim, dtype=dtype)
    v = randn(int(cu_k[-1]), nheads_k, head_dim, dtype=dtype)
    return q, k, v, cu_q, cu_k, max(lens_q + [0]), max(lens_k + [0])


@pytest.mark.parametrize("case", VARLEN_CASES, ids=_varlen_id)
def test_varlen_fp32_matches_reference(case):
    lens_q, lens_k, nheads, nheads_k, head_dim, opts = case
    opts = dict(opts)
    alibi = make_alibi(opts.pop("alibi", None), len(lens_q), nheads)
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen(lens_q, lens_k, nheads, nheads_k, head_dim)
    out, lse, probs, _ = call_varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, alibi=alibi, **opts)
    assert out.shape == q.shape and lse.shape == (nheads, q.shape[0]) and probs.shape == (0,)

    dout = randn(*q.shape)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out_ref, lse_ref = ref.varlen_attention_ref(
        *leaves,
        cu_q,
        cu_k,
        max_seqlen_k=max_k,
        causal=opts.get("causal", False),
        window_size=opts.get("window", (-1, -1)),
        softcap=opts.get("softcap", 0.0),
        alibi_slopes=alibi,
    )
    assert_close64(out, out_ref, FP32_TOL, "out")
    assert_close64(lse, lse_ref, FP32_TOL, "lse")
    if q.shape[0] == 0 or k.shape[0] == 0:
        dq, dk, dv = call_varlen_bwd(
            dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, alibi=alibi, **opts
        )
        assert dq.shape == q.shape and dk.shape == k.shape
        return
    out_ref.backward(dout.double())
    dq, dk, dv = call_varlen_bwd(
        dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, alibi=alibi, **opts
    )
    for name, ours, leaf in zip(("dq", "dk", "dv"), (dq, dk, dv), leaves):
        assert_close64(ours, leaf.grad, FP32_GRAD_TOL, name)


def test_varlen_matches_fixed_length_per_sequence():
    # Every sequence of a varlen batch gives what a batch-1 fixed-length call gives.
    lens_q, lens_k = [7, 30, 1], [12, 30, 40]
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen(lens_q, lens_k, 4, 2, 32)
    out, lse, _, _ = call_varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)
    for b in range(3):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        out_b, lse_b, _, _ = call_fwd(q[qs][None], k[ks][None], v[ks][None], causal=True)
        torch.testing.assert_close(out[qs], out_b[0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(lse[:, qs], lse_b[0], atol=1e-6, rtol=1e-6)


def test_varlen_rows_outside_every_sequence():
    # cu_seqlens_q need not cover q: uncovered rows get out 0 / lse +inf / dq 0.
    q = randn(12, 2, 16)
    k = randn(9, 2, 16)
    v = randn(9, 2, 16)
    cu_q = torch.tensor([2, 5, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 9], dtype=torch.int32)
    out, lse, _, _ = call_varlen_fwd(q, k, v, cu_q, cu_k, 4, 5)
    outside = torch.tensor([0, 1, 9, 10, 11])
    assert torch.all(out[outside] == 0) and torch.all(lse[:, outside] == float("inf"))
    out_ref, lse_ref = ref.varlen_attention_ref(q.double(), k.double(), v.double(), cu_q, cu_k)
    assert_close64(out, out_ref, FP32_TOL, "out")
    assert_close64(lse, lse_ref, FP32_TOL, "lse")
    dq, _, _ = call_varlen_bwd(randn(*q.shape), q, k, v, out, lse, cu_q, cu_k, 4, 5)
    assert torch.all(dq[outside] == 0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_varlen_low_precision_within_criterion(dtype):
    lens_q, lens_k = [17, 64, 2], [40, 64, 9]
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen(lens_q, lens_k, 4, 2, 64, dtype=dtype)
    out, lse, _, _ = call_varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)
    exact, _ = ref.varlen_attention_ref(q, k, v, cu_q, cu_k, causal=True)
    same, _ = ref.varlen_attention_ref(q, k, v, cu_q, cu_k, causal=True, compute_dtype=dtype)
    ref.assert_within_criterion(out, exact, same, factor=2.0)


@pytest.mark.parametrize("page_size", [16, 5])
def test_varlen_paged_kv(page_size):
    lens_q, lens_k = [5, 1, 40, 0], [33, 16, 60, 7]
    nheads, nheads_k, head_dim = 4, 2, 32
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen(lens_q, lens_k, nheads, nheads_k, head_dim)
    blocks_per_seq = [(n + page_size - 1) // page_size for n in lens_k]
    max_blocks = max(blocks_per_seq) + 1  # a spare column the kernel must not need
    num_blocks = sum(blocks_per_seq) + 3
    k_cache = randn(num_blocks, page_size, nheads_k, head_dim)
    v_cache = randn(num_blocks, page_size, nheads_k, head_dim)
    block_table = torch.full((len(lens_k), max_blocks), -1, dtype=torch.int32)  # unused: invalid
    free_blocks = torch.randperm(num_blocks).tolist()
    for b, n in enumerate(lens_k):
        for i in range(blocks_per_seq[b]):
            block = free_blocks.pop()
            block_table[b, i] = block
            rows = slice(i * page_size, min((i + 1) * page_size, n))
            count = rows.stop - rows.start
            src = slice(int(cu_k[b]) + rows.start, int(cu_k[b]) + rows.stop)
            k_cache[block, :count] = k[src]
            v_cache[block, :count] = v[src]

    for opts in (dict(causal=True), dict(window=(9, 2), softcap=3.0)):
        out, lse, _, _ = call_varlen_fwd(
            q, k_cache, v_cache, cu_q, cu_k, max_q, max_k, block_table=block_table, **opts
        )
        out_ref, lse_ref = ref.varlen_attention_ref(
            q.double(),
            k.double(),
            v.double(),
            cu_q,
            cu_k,
            causal=opts.get("causal", False),
            window_size=opts.get("window", (-1, -1)),
            softcap=opts.get("softcap", 0.0),
        )
        assert_close64(out, out_ref, FP32_TOL, "out")
        assert_close64(lse, lse_ref, FP32_TOL, "lse")


@pytest.mark.parametrize("page_size", [1, 16])
def test_varlen_paged_kv_with_dropout(page_size):
    """Dropout over paged keys draws the contract's mask by (batch, head, row,
    col), wherever the keys live: the float64 reference with the varlen masks."""
    lens_q, lens_k = [5, 0, 40, 9], [33, 16, 60, 0]
    nheads, nheads_k, head_dim, dropout_p, seed, offset = 4, 2, 32, 0.3, 11, 4
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen(lens_q, lens_k, nheads, nheads_k, head_dim)
    blocks_per_seq = [(n + page_size - 1) // page_size for n in lens_k]
    num_blocks = sum(blocks_per_seq) + 2
    k_cache = randn(num_blocks, page_size, nheads_k, head_dim)
    v_cache = randn(num_blocks, page_size, nheads_k, head_dim)
    block_table = torch.full((len(lens_k), max(blocks_per_seq) + 1), -1, dtype=torch.int32)
    free_blocks = torch.randperm(num_blocks).tolist()
    for b, n in enumerate(lens_k):
        for i in range(blocks_per_seq[b]):
            block = free_blocks.pop()
            block_table[b, i] = block
            count = min(page_size, n - i * page_size)
            src = slice(int(cu_k[b]) + i * page_size, int(cu_k[b]) + i * page_size + count)
            k_cache[block, :count] = k[src]
            v_cache[block, :count] = v[src]
    out, lse, _, _ = call_varlen_fwd(
        q, k_cache, v_cache, cu_q, cu_k, max_q, max_k, block_table=block_table,
        causal=True, dropout_p=dropout_p, seed=seed, offset=offset,
    )  # fmt: skip
    keeps = ref.dropout_keep_masks_varlen(seed, offset, cu_q, cu_k, nheads, dropout_p)
    out_ref, lse_ref = ref.varlen_attention_ref(
        q.double(), k.double(), v.double(), cu_q, cu_k, causal=True,
        dropout_p=dropout_p, keep_masks=keeps,
    )  # fmt: skip
    assert_close64(out, out_ref, FP32_TOL, "out")
    assert_close64(lse, lse_ref, FP32_TOL, "lse")


# ---------------------------------------------------------------------------
# Dropout
# ---------------------------------------------------------------------------


def _visible_fraction_bounds(dropout_p, count):
    # Kept fraction of `count` Bernoulli(1 - p) draws: 6 standard deviations.
    sigma = math.sqrt(dropout_p * (1 - dropout_p) / count)
    return (1 - dropout_p) - 6 * sigma, (1 - dropout_p) + 6 * sigma


@pytest.mark.parametrize("dropout_p", [0.17, 0.5])
@pytest.mark.parametrize("causal", [False, True])
def test_dropout_mask_output_and_backward(dropout_p, causal):
    batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim = 2, 67, 93, 4, 2, 32
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim)
    seed, offset = (1 << 40) + 12345, 96
    out, lse, probs, rng_state = call_fwd(
        q, k, v, dropout_p=dropout_p, causal=causal, return_softmax=True, seed=seed, offset=offset
    )
    assert rng_state.tolist() == [seed, offset]
    assert probs.shape == (batch, nheads, seqlen_q, seqlen_k) and probs.dtype == q.dtype

    keep = ref.dropout_keep_mask_batch(seed, offset, batch, nheads, seqlen_q, seqlen_k, dropout_p)
    visible = ref.visible_mask(seqlen_q, seqlen_k, -1, 0 if causal else -1)
    # The sign of S_dmask is the mask the kernel drew: it must be the Python Philox mask.
    kernel_keep = probs >= 0
    assert torch.equal(kernel_keep[..., visible], keep[..., visible])
    low, high = _visible_fraction_bounds(dropout_p, int(visible.sum()) * batch * nheads)
    kept = keep[..., visible].float().mean().item()
    assert low <= kept <= high, f"kept fraction {kept:.4f} outside [{low:.4f}, {high:.4f}]"

    dout = randn(*q.shape)
    out_ref, lse_ref, grads_ref = reference_with_grads(
        q, k, v, dout, causal=causal, dropout_p=dropout_p, keep_mask=keep
    )
    assert_close64(out, out_ref, FP32_TOL, "out")
    assert_close64(lse, lse_ref, FP32_TOL, "lse")
    # |S_dmask| holds the undropped softmax numerators of flash-attn's
    # convention (tests/s_dmask.py), from which P is recovered; 0 where masked.
    scores = s_dmask.final_scores(q, k, window=(-1, 0 if causal else -1))
    width = flash_attn_cuda._get_block_size_n(q.device, head_dim, True, causal)
    for b in range(batch):
        s_dmask.check_entry(probs[b], scores[b], width, keep[b])

    grads = call_bwd(
        dout, q, k, v, out, lse, dropout_p=dropout_p, causal=causal, rng_state=rng_state
    )
    for name, ours, expected in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert_close64(ours, expected, FP32_GRAD_TOL, name)


def test_dropout_with_every_feature():
    # Dropout together with a local window, softcap, strided (batch, nheads) ALiBi and GQA.
    batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dropout_p = 2, 50, 70, 4, 2, 32, 0.2
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim)
    alibi = (torch.rand(batch, 2 * nheads) * 0.5)[:, :nheads]
    opts = dict(alibi=alibi, dropout_p=dropout_p, scale=0.2, window=(10, 5), softcap=2.0)
    out, lse, _, rng_state = call_fwd(q, k, v, seed=5, offset=9, **opts)
    keep = ref.dropout_keep_mask_batch(5, 9, batch, nheads, seqlen_q, seqlen_k, dropout_p)
    dout = randn(*q.shape)
    out_ref, lse_ref, grads_ref = reference_with_grads(
        q,
        k,
        v,
        dout,
        softmax_scale=0.2,
        window_size=(10, 5),
        softcap=2.0,
        alibi_slopes=alibi,
        dropout_p=dropout_p,
        keep_mask=keep,
    )
    assert_close64(out, out_ref, FP32_TOL, "out")
    assert_close64(lse, lse_ref, FP32_TOL, "lse")
    grads = call_bwd(dout, q, k, v, out, lse, rng_state=rng_state, **opts)
    for name, ours, expected in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert_close64(ours, expected, FP32_GRAD_TOL, name)


def test_dropout_seed_offset_and_rng_state():
    q, k, v = make_qkv(1, 40, 40, 2, 2, 16)
    base = call_fwd(q, k, v, dropout_p=0.3, return_softmax=True, seed=7, offset=3)
    again = call_fwd(q, k, v, dropout_p=0.3, return_softmax=True, seed=7, offset=3)
    torch.testing.assert_close(base[0], again[0], atol=0, rtol=0)
    torch.testing.assert_close(base[2], again[2], atol=0, rtol=0)
    other_offset = call_fwd(q, k, v, dropout_p=0.3, return_softmax=True, seed=7, offset=4)
    other_seed = call_fwd(q, k, v, dropout_p=0.3, return_softmax=True, seed=8, offset=3)
    assert not torch.equal(base[2] >= 0, other_offset[2] >= 0)
    assert not torch.equal(base[2] >= 0, other_seed[2] >= 0)
    # rng_state overrides the seed / offset values, and is returned as given.
    overridden = call_fwd(
        q,
        k,
        v,
        dropout_p=0.3,
        return_softmax=True,
        seed=123,
        offset=456,
        rng_state=torch.tensor([7, 3], dtype=torch.int64),
    )
    torch.testing.assert_close(overridden[0], base[0], atol=0, rtol=0)
    assert overridden[3].tolist() == [7, 3]
    # Seeds above 2^63 travel as negative int64 values.
    big = call_fwd(q, k, v, dropout_p=0.3, return_softmax=True, seed=-5, offset=3)
    keep = ref.dropout_keep_mask(2**64 - 5, 3, 0, 2, 40, 40, 0.3)
    assert torch.equal(big[2][0] >= 0, keep)


def test_return_softmax_without_dropout():
    q, k, v = make_qkv(2, 20, 130, 2, 1, 16)
    out, lse, probs, _ = call_fwd(q, k, v, causal=True, return_softmax=True)
    assert not torch.any(torch.signbit(probs))
    visible = ref.visible_mask(20, 130, -1, 0)
    assert torch.all(probs[..., ~visible] == 0)
    # Numerators (flash-attn's convention), not probabilities: the recovered
    # probabilities sum to 1 per row.
    scores = s_dmask.final_scores(q, k, window=(-1, 0))
    width = flash_attn_cuda._get_block_size_n(q.device, 16, False, True)
    recovered = s_dmask.probs_from_numerators(probs, scores, width)
    torch.testing.assert_close(
        recovered.sum(-1), torch.ones(2, 2, 20, dtype=torch.float64), atol=1e-5, rtol=0
    )
    for b in range(2):
        s_dmask.check_entry(probs[b], scores[b], width)


def test_varlen_dropout():
    lens_q, lens_k = [9, 0, 33, 20], [14, 5, 33, 41]
    nheads, nheads_k, head_dim, dropout_p = 4, 2, 32, 0.25
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen(lens_q, lens_k, nheads, nheads_k, head_dim)
    seed, offset = 99, 1 << 20
    out, lse, probs, rng_state = call_varlen_fwd(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max_q,
        max_k,
        dropout_p=dropout_p,
        causal=True,
        return_softmax=True,
        seed=seed,
        offset=offset,
    )
    assert probs.shape == (len(lens_q), nheads, max_q, max_k)
    keeps = ref.dropout_keep_masks_varlen(seed, offset, cu_q, cu_k, nheads, dropout_p)
    for b, (sq, sk) in enumerate(zip(lens_q, lens_k)):
        visible = ref.visible_mask(sq, sk, -1, 0)
        assert torch.equal((probs[b, :, :sq, :sk] >= 0)[:, visible], keeps[b][:, visible])
        # Padding beyond the sequence stays zero.
        assert torch.all(probs[b, :, sq:] == 0) and torch.all(probs[b, :, :, sk:] == 0)

    dout = randn(*q.shape)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out_ref, lse_ref = ref.varlen_attention_ref(
        *leaves, cu_q, cu_k, causal=True, dropout_p=dropout_p, keep_masks=keeps
    )
    assert_close64(out, out_ref, FP32_TOL, "out")
    assert_close64(lse, lse_ref, FP32_TOL, "lse")
    out_ref.backward(dout.double())
    grads = call_varlen_bwd(
        dout,
        q,
        k,
        v,
        out,
        lse,
        cu_q,
        cu_k,
        max_q,
        max_k,
        dropout_p=dropout_p,
        causal=True,
        rng_state=rng_state,
    )
    for name, ours, leaf in zip(("dq", "dk", "dv"), grads, leaves):
        assert_close64(ours, leaf.grad, FP32_GRAD_TOL, name)


def test_python_philox_known_answer():
    # Known-answer vectors of Philox4x32-10 (Random123's kat_vectors): the
    # reference generator is checked on its own, not only against the kernel.
    words = [torch.tensor([x], dtype=torch.int64) for x in (0, 0, 0, 0)]
    out = ref.philox4x32_10(*words, 0, 0)
    assert [int(w) for w in out] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    words = [torch.tensor([0xFFFFFFFF], dtype=torch.int64)] * 4
    out = ref.philox4x32_10(*words, 0xFFFFFFFF, 0xFFFFFFFF)
    assert [int(w) for w in out] == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]


# ---------------------------------------------------------------------------
# Argument checks
# ---------------------------------------------------------------------------


def _fixed(**overrides):
    args = dict(q=randn(1, 4, 2, 16), k=randn(1, 5, 2, 16), v=randn(1, 5, 2, 16))
    args.update(overrides)
    return args


BAD_FWD = [
    (_fixed(q=randn(1, 4, 2, 16).double()), {}, "q must have dtype"),
    (_fixed(k=randn(1, 5, 2, 16).half()), {}, "k must have the same dtype as q"),
    (_fixed(q=randn(1, 4, 2, 12), k=randn(1, 5, 2, 12), v=randn(1, 5, 2, 12)), {}, "multiple of 8"),
    (
        _fixed(q=randn(1, 4, 2, 1032), k=randn(1, 5, 2, 1032), v=randn(1, 5, 2, 1032)),
        {},
        "multiple of 8",
    ),
    (_fixed(q=randn(1, 4, 3, 16)), {}, "divisible"),
    (_fixed(v=randn(1, 6, 2, 16)), {}, "v must have the shape of k"),
    (_fixed(k=randn(2, 5, 2, 16), v=randn(2, 5, 2, 16)), {}, "k must have shape"),
    (_fixed(q=randn(1, 4, 2, 32)[..., ::2]), {}, "contiguous last dimension"),
    (_fixed(q=randn(4, 2, 16)), {}, "4-D"),
    (_fixed(), dict(dropout_p=1.0), "dropout_p"),
    (_fixed(), dict(dropout_p=-0.1), "dropout_p"),
    (_fixed(), dict(softcap=-1.0), "softcap"),
    (_fixed(), dict(alibi=torch.rand(2).double()), "alibi_slopes must have dtype float32"),
    (_fixed(), dict(alibi=torch.rand(3)), "alibi_slopes must have shape"),
    (_fixed(), dict(alibi=torch.rand(2, 2)), "alibi_slopes must have shape"),
    (
        _fixed(),
        dict(alibi=torch.rand(4)[::2]),
        "alibi_slopes must have a contiguous last dimension",
    ),
    (
        _fixed(),
        dict(rng_state=torch.tensor([1, 2], dtype=torch.int32)),
        "rng_state must have dtype int64",
    ),
    (_fixed(), dict(rng_state=torch.tensor([1, 2, 3])), "2 elements"),
]


@pytest.mark.parametrize("args,kwargs,message", BAD_FWD)
def test_fwd_argument_errors(args, kwargs, message):
    with pytest.raises(RuntimeError, match=message):
        call_fwd(args["q"], args["k"], args["v"], **kwargs)


def test_bwd_argument_errors():
    q, k, v = make_qkv(1, 4, 5, 2, 2, 16)
    out, lse, _, _ = call_fwd(q, k, v)
    dout = randn(*q.shape)
    with pytest.raises(RuntimeError, match="softmax_lse must have shape"):
        call_bwd(dout, q, k, v, out, lse[:, :, :3])
    with pytest.raises(RuntimeError, match="softmax_lse must have dtype float32"):
        call_bwd(dout, q, k, v, out, lse.double())
    with pytest.raises(RuntimeError, match="dout must have the shape of q"):
        call_bwd(dout[:, :3], q, k, v, out, lse)
    with pytest.raises(RuntimeError, match="out must have the same dtype"):
        call_bwd(dout, q, k, v, out.half(), lse)
    with pytest.raises(RuntimeError, match="rng_state"):
        call_bwd(dout, q, k, v, out, lse, dropout_p=0.1)


def test_varlen_argument_errors():
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen([3, 4], [5, 6], 2, 2, 16)
    with pytest.raises(RuntimeError, match="cu_seqlens_q must have dtype int32"):
        call_varlen_fwd(q, k, v, cu_q.long(), cu_k, max_q, max_k)
    with pytest.raises(RuntimeError, match="cu_seqlens_k must have as many entries"):
        call_varlen_fwd(q, k, v, cu_q, cu_k[:2], max_q, max_k)
    with pytest.raises(RuntimeError, match="1-D"):
        call_varlen_fwd(q, k, v, cu_q[None], cu_k, max_q, max_k)
    with pytest.raises(RuntimeError, match="max_seqlen_q must be >= 0"):
        call_varlen_fwd(q, k, v, cu_q, cu_k, -1, max_k)
    with pytest.raises(RuntimeError, match="more than the max_seqlen"):
        call_varlen_fwd(q, k, v, cu_q, cu_k, 3, max_k)
    with pytest.raises(RuntimeError, match="non-decreasing"):
        call_varlen_fwd(q, k, v, torch.tensor([0, 5, 4], dtype=torch.int32), cu_k, 7, max_k)
    with pytest.raises(RuntimeError, match="exceeds the number of rows"):
        call_varlen_fwd(q, k, v, cu_q, torch.tensor([0, 5, 12], dtype=torch.int32), max_q, 7)
    with pytest.raises(RuntimeError, match="3-D"):
        call_varlen_fwd(q[None], k, v, cu_q, cu_k, max_q, max_k)
    k_paged = randn(4, 4, 2, 16)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="block_table must have dtype int32"):
        call_varlen_fwd(q, k_paged, k_paged, cu_q, cu_k, max_q, max_k, block_table=table.long())
    with pytest.raises(RuntimeError, match="block_table must have shape"):
        call_varlen_fwd(q, k_paged, k_paged, cu_q, cu_k, max_q, max_k, block_table=table[:1])
    with pytest.raises(RuntimeError, match="not a valid block index"):
        call_varlen_fwd(
            q,
            k_paged,
            k_paged,
            cu_q,
            cu_k,
            max_q,
            max_k,
            block_table=torch.tensor([[0, 1], [2, 4]], dtype=torch.int32),
        )
    with pytest.raises(RuntimeError, match="columns"):
        call_varlen_fwd(q, k_paged, k_paged, cu_q, cu_k, max_q, max_k, block_table=table[:, :1])
    out, lse, _, _ = call_varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k)
    with pytest.raises(RuntimeError, match=r"softmax_lse must have shape \(nheads, total_q\)"):
        call_varlen_bwd(
            randn(*q.shape), q, k, v, out, lse.t().contiguous(), cu_q, cu_k, max_q, max_k
        )
