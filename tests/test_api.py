"""The flash-attn 2.x Python API: signatures, results and gradients.

Every result is compared with attention computed here in float64 on upcast
inputs (ref) and with the same math in the input dtype (lowp), following the
project's criterion: max|ours - ref| <= 2 * max|lowp - ref| + 1e-5 for outputs
and 3x for gradients. Gradients flow through the autograd.Functions, i.e. the
backward ops; the references are differentiated by autograd.
"""

import inspect
import math
import re

import pytest
import torch

import s_dmask as s_dmask_reading

import flash_attn_cuda
from flash_attn_cuda import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
LOW_PRECISION = [torch.bfloat16, torch.float16]


# ---------------------------------------------------------------------------
# A small float64 reference, independent of the kernels
# ---------------------------------------------------------------------------


def attention_ref(
    q,
    k,
    v,
    *,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    keep_mask=None,
    dropout_p=0.0,
    compute_dtype=torch.float64,
):
    """q (b, sq, h, d), k / v (b, sk, hk, d) -> out (b, sq, h, d), lse (b, h, sq), probs.

    keep_mask (b, h, sq, sk) of booleans applies dropout (kept / (1 - p)).
    """
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    scale = head_dim ** (-0.5) if softmax_scale is None else softmax_scale
    q, k, v = (t.to(compute_dtype) for t in (q, k, v))
    k = k.repeat_interleave(nheads // nheads_k, dim=2)
    v = v.repeat_interleave(nheads // nheads_k, dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    row = torch.arange(seqlen_q, device=q.device)[:, None]
    col = torch.arange(seqlen_k, device=q.device)[None, :]
    diag = row + seqlen_k - seqlen_q
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(compute_dtype)
        slopes = slopes[None] if slopes.dim() == 1 else slopes
        scores = scores - slopes[:, :, None, None] * (diag - col).abs().to(compute_dtype)
    left, right = window_size
    if causal:
        right = 0
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device)
    if left >= 0:
        visible &= col >= diag - left
    if right >= 0:
        visible &= col <= diag + right
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows that see no key: 0
    lse = lse.masked_fill(torch.isneginf(lse), float("inf"))
    weights = probs
    if keep_mask is not None:
        weights = probs * keep_mask.to(compute_dtype) / (1.0 - dropout_p)
    out = torch.einsum("bhij,bjhd->bihd", weights, v)
    return out.to(q.dtype), lse, probs


def varlen_attention_ref(
    q, k, v, cu_seqlens_q, cu_seqlens_k, *, alibi_slopes=None, keep_masks=None, **kwargs
):
    """Packed (total, h, d) tensors: the fixed-length reference per sequence."""
    outs, lses = [], []
    for b in range(cu_seqlens_q.numel() - 1):
        q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        k0, k1 = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
        slopes = alibi_slopes
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[b]
        out, lse, _ = attention_ref(
            q[None, q0:q1],
            k[None, k0:k1],
            v[None, k0:k1],
            alibi_slopes=slopes,
            keep_mask=None if keep_masks is None else keep_masks[b][None],
            **kwargs,
        )
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs, dim=0), torch.cat(lses, dim=-1)


def assert_within(ours, ref, lowp, factor, name):
    """The project's criterion; +inf entries (rows that see no key) must match exactly."""
    ours, ref, lowp = ours.double(), ref.double(), lowp.double()
    assert ours.shape == ref.shape, f"{name}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    infinite = torch.isinf(ref)
    assert torch.equal(torch.isinf(ours), infinite), f"{name}: infinite entries differ"
    finite = ~infinite
    assert torch.isfinite(ours[finite]).all(), f"{name}: NaN or inf where a value was expected"
    if not finite.any():
        return
    err = (ours[finite] - ref[finite]).abs().max().item()
    base = (lowp[finite] - ref[finite]).abs().max().item()
    assert err <= factor * base + 1e-5, (
        f"{name}: max error {err:.3e} exceeds {factor} x {base:.3e} (the same math in "
        "the input dtype) + 1e-5"
    )


def make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype, device):
    q = torch.randn(batch, seqlen_q, nheads, head_dim, dtype=dtype, device=device)
    k = torch.randn(batch, seqlen_k, nheads_k, head_dim, dtype=dtype, device=device)
    v = torch.randn(batch, seqlen_k, nheads_k, head_dim, dtype=dtype, device=device)
    return q, k, v


def leaves(*tensors, dtype=None):
    return [t.detach().clone().to(dtype or t.dtype).requires_grad_() for t in tensors]


def check_against_reference(run, ref_inputs, ref_kwargs, out, grads, dout, ref_fn=attention_ref):
    """Runs the float64 and the same-dtype reference, compares out and the grads."""
    ref_leaves = leaves(*ref_inputs, dtype=torch.float64)
    ref_out = ref_fn(*ref_leaves, **ref_kwargs)[0]
    ref_grads = torch.autograd.grad(ref_out, ref_leaves, dout.double())
    lowp_leaves = leaves(*ref_inputs)
    lowp_out = ref_fn(*lowp_leaves, compute_dtype=ref_inputs[0].dtype, **ref_kwargs)[0]
    lowp_grads = torch.autograd.grad(lowp_out, lowp_leaves, dout)
    assert_within(out, ref_out, lowp_out, 2, f"{run}: out")
    for name, g, rg, lg in zip("qkv", grads, ref_grads, lowp_grads):
        assert_within(g, rg, lg, 3, f"{run}: d{name}")


# ---------------------------------------------------------------------------
# Package surface and signatures
# ---------------------------------------------------------------------------

_COMMON_TAIL = [
    ("dropout_p", 0.0),
    ("softmax_scale", None),
    ("causal", False),
    ("window_size", (-1, -1)),
    ("softcap", 0.0),
    ("alibi_slopes", None),
    ("deterministic", False),
    ("return_attn_probs", False),
]
_REQUIRED = inspect.Parameter.empty

# Written from the flash-attn 2.8 documentation of flash_attn_interface.
EXPECTED_SIGNATURES = {
    "flash_attn_func": [("q", _REQUIRED), ("k", _REQUIRED), ("v", _REQUIRED)] + _COMMON_TAIL,
    "flash_attn_kvpacked_func": [("q", _REQUIRED), ("kv", _REQUIRED)] + _COMMON_TAIL,
    "flash_attn_qkvpacked_func": [("qkv", _REQUIRED)] + _COMMON_TAIL,
    "flash_attn_varlen_func": [
        ("q", _REQUIRED),
        ("k", _REQUIRED),
        ("v", _REQUIRED),
        ("cu_seqlens_q", _REQUIRED),
        ("cu_seqlens_k", _REQUIRED),
        ("max_seqlen_q", _REQUIRED),
        ("max_seqlen_k", _REQUIRED),
    ]
    + _COMMON_TAIL
    + [("block_table", None)],
    "flash_attn_varlen_kvpacked_func": [
        ("q", _REQUIRED),
        ("kv", _REQUIRED),
        ("cu_seqlens_q", _REQUIRED),
        ("cu_seqlens_k", _REQUIRED),
        ("max_seqlen_q", _REQUIRED),
        ("max_seqlen_k", _REQUIRED),
    ]
    + _COMMON_TAIL,
    "flash_attn_varlen_qkvpacked_func": [
        ("qkv", _REQUIRED),
        ("cu_seqlens", _REQUIRED),
        ("max_seqlen", _REQUIRED),
    ]
    + _COMMON_TAIL,
    "flash_attn_with_kvcache": [
        ("q", _REQUIRED),
        ("k_cache", _REQUIRED),
        ("v_cache", _REQUIRED),
        ("k", None),
        ("v", None),
        ("rotary_cos", None),
        ("rotary_sin", None),
        ("cache_seqlens", None),
        ("cache_batch_idx", None),
        ("cache_leftpad", None),
        ("block_table", None),
        ("softmax_scale", None),
        ("causal", False),
        ("window_size", (-1, -1)),
        ("softcap", 0.0),
        ("rotary_interleaved", True),
        ("alibi_slopes", None),
        ("num_splits", 0),
        ("return_softmax_lse", False),
    ],
    # FlashAttention-3's signature (flash-attn 2.8 has no combine).
    "flash_attn_combine": [
        ("out_partial", _REQUIRED),
        ("lse_partial", _REQUIRED),
        ("out", None),
        ("out_dtype", None),
    ],
}


def test_package_exports():
    # One version: __init__.py defines it, the build writes it into the extension.
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", flash_attn_cuda.__version__)
    assert flash_attn_cuda._C.__version__ == flash_attn_cuda.__version__
    assert isinstance(flash_attn_cuda.cuda_built, bool)
    for name in EXPECTED_SIGNATURES:
        assert callable(getattr(flash_attn_cuda, name)), name
        assert getattr(flash_attn_cuda, name).__doc__, f"{name} has no docstring"
    for op in (
        "fwd",
        "bwd",
        "varlen_fwd",
        "varlen_bwd",
        "fwd_kvcache",
        "fwd_out",
        "varlen_fwd_out",
        "fwd_kvcache_out",
        "combine",
        "combine_out",
    ):
        assert hasattr(torch.ops.flash_attn, op), op


# Additions after flash-attn 2.8's parameters, keyword-only so that no positional
# call changes meaning (docs/serving.md).
# The additions after flash-attn 2.8's parameters: serving (docs/serving.md),
# attention sinks (tests/test_sinks.py) and FP8 descales (docs/fp8.md),
# keyword-only.
FP8_DESCALES = [("q_descale", None), ("k_descale", None), ("v_descale", None)]
EXPECTED_KEYWORD_ONLY = {
    "flash_attn_func": [("out", None), ("learnable_sink", None), ("return_softmax_lse", False)]
    + FP8_DESCALES,
    "flash_attn_kvpacked_func": [("learnable_sink", None), ("return_softmax_lse", False)],
    "flash_attn_qkvpacked_func": [("learnable_sink", None), ("return_softmax_lse", False)],
    "flash_attn_varlen_func": [
        ("seqused_k", None),
        ("out", None),
        ("learnable_sink", None),
        ("seqused_q", None),
        ("return_softmax_lse", False),
        ("num_splits", 0),
    ]
    + FP8_DESCALES,
    "flash_attn_varlen_kvpacked_func": [("learnable_sink", None), ("return_softmax_lse", False)],
    "flash_attn_varlen_qkvpacked_func": [("learnable_sink", None), ("return_softmax_lse", False)],
    "flash_attn_with_kvcache": [
        ("out", None),
        ("learnable_sink", None),
        ("rotary_seqlens", None),
        ("cu_seqlens_q", None),
        ("cu_seqlens_k_new", None),
        ("max_seqlen_q", None),
    ]
    + FP8_DESCALES,
}


@pytest.mark.parametrize("name", sorted(EXPECTED_SIGNATURES))
def test_signature_matches_flash_attn_2_8(name):
    params = inspect.signature(getattr(flash_attn_cuda, name)).parameters.values()
    positional = [
        (p.name, p.default) for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    ]
    keyword_only = [(p.name, p.default) for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert positional == EXPECTED_SIGNATURES[name]
    assert keyword_only == EXPECTED_KEYWORD_ONLY.get(name, [])
    assert len(positional) + len(keyword_only) == len(params)


# ---------------------------------------------------------------------------
# Fixed-length attention
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "batch,seqlen_q,seqlen_k,nheads,nheads_k,head_dim",
    [
        (1, 1, 1, 2, 2, 32),
        (2, 17, 33, 4, 2, 64),  # GQA, seqlen_q < seqlen_k
        (2, 40, 19, 3, 1, 40),  # MQA, seqlen_q > seqlen_k: causal rows that see no key
        (1, 128, 129, 2, 2, 72),
    ],
)
def test_flash_attn_func(
    device, dtype, causal, batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim
):
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype, device)
    q_, k_, v_ = leaves(q, k, v)
    out = flash_attn_func(q_, k_, v_, causal=causal)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q_, k_, v_), dout)
    check_against_reference("flash_attn_func", (q, k, v), {"causal": causal}, out, grads, dout)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "features",
    [
        {"window_size": (5, 2)},
        {"window_size": (0, 0)},
        {"window_size": (3, -1), "causal": True},
        {"window_size": (-1, 4)},
        {"softcap": 3.0},
        {"softmax_scale": 0.3},
        {"alibi": "per_head"},
        {"alibi": "per_batch_head", "causal": True, "softcap": 5.0},
        {"deterministic": True},
    ],
    ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()),
)
def test_flash_attn_func_features(device, features):
    features = dict(features)
    batch, nheads = 2, 4
    q, k, v = make_qkv(batch, 23, 31, nheads, 2, 32, torch.bfloat16, device)
    alibi = features.pop("alibi", None)
    if alibi == "per_head":
        features["alibi_slopes"] = torch.rand(nheads, device=device) * 0.5
    elif alibi == "per_batch_head":
        features["alibi_slopes"] = torch.rand(batch, nheads, device=device) * 0.5
    deterministic = features.pop("deterministic", False)
    q_, k_, v_ = leaves(q, k, v)
    out = flash_attn_func(q_, k_, v_, deterministic=deterministic, **features)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q_, k_, v_), dout)
    check_against_reference("flash_attn_func", (q, k, v), features, out, grads, dout)


@pytest.mark.parametrize("device", DEVICES)
def test_deterministic_backward_is_reproducible(device):
    q, k, v = make_qkv(2, 33, 47, 4, 1, 64, torch.float16, device)
    dout = torch.randn_like(q)
    runs = []
    for _ in range(2):
        q_, k_, v_ = leaves(q, k, v)
        out = flash_attn_func(q_, k_, v_, causal=True, deterministic=True)
        runs.append(torch.autograd.grad(out, (q_, k_, v_), dout))
    for first, second in zip(*runs):
        assert torch.equal(first, second)


def test_fp32_inputs_on_cpu():
    q, k, v = make_qkv(1, 9, 12, 2, 2, 16, torch.float32, "cpu")
    q_, k_, v_ = leaves(q, k, v)
    out = flash_attn_func(q_, k_, v_, causal=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q_, k_, v_), dout)
    check_against_reference("fp32", (q, k, v), {"causal": True}, out, grads, dout)


@pytest.mark.parametrize("device", DEVICES)
def test_return_attn_probs_without_dropout(device):
    # seqlen_q > seqlen_k with causal: the first rows see no key (out 0, lse +inf).
    q, k, v = make_qkv(2, 13, 7, 2, 2, 32, torch.bfloat16, device)
    out, softmax_lse, s_dmask = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    ref_out, ref_lse, _ = attention_ref(q, k, v, causal=True)
    lowp_out, lowp_lse, _ = attention_ref(q, k, v, causal=True, compute_dtype=q.dtype)
    assert softmax_lse.dtype == torch.float32 and softmax_lse.shape == (2, 2, 13)
    assert_within(out, ref_out, lowp_out, 2, "out")
    assert_within(softmax_lse, ref_lse, lowp_lse, 2, "softmax_lse")
    assert torch.isinf(softmax_lse[:, :, :6]).all() and (softmax_lse[:, :, :6] > 0).all()
    assert (out[:, :6] == 0).all()
    # As in flash-attn, probabilities are only returned together with a dropout pattern.
    assert s_dmask.numel() == 0
    assert not softmax_lse.requires_grad


def _call_each_api(device, dtype, **kw):
    """Every fixed-length and varlen function on the same attention (2 sequences of
    9 queries over 11 keys, GQA 4:2, d32), with keyword arguments kw."""
    q, k, v = make_qkv(2, 9, 11, 4, 2, 32, dtype, device)
    cu_q = torch.tensor([0, 9, 18], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 11, 22], dtype=torch.int32, device=device)
    qv, kv_, vv = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)
    varlen = (cu_q, cu_k, 9, 11)
    q_self, k_self, v_self = make_qkv(2, 9, 9, 2, 2, 32, dtype, device)
    cu_self = cu_q
    return {
        "flash_attn_func": flash_attn_func(q, k, v, **kw),
        "flash_attn_kvpacked_func": flash_attn_kvpacked_func(q, torch.stack((k, v), 2), **kw),
        "flash_attn_qkvpacked_func": flash_attn_qkvpacked_func(
            torch.stack((q_self, k_self, v_self), 2), **kw
        ),
        "flash_attn_varlen_func": flash_attn_varlen_func(qv, kv_, vv, *varlen, **kw),
        "flash_attn_varlen_kvpacked_func": flash_attn_varlen_kvpacked_func(
            qv, torch.stack((kv_, vv), 1), *varlen, **kw
        ),
        "flash_attn_varlen_qkvpacked_func": flash_attn_varlen_qkvpacked_func(
            torch.stack((q_self, k_self, v_self), 2).flatten(0, 1), cu_self, 9, **kw
        ),
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_return_softmax_lse(device, dropout_p):
    # FA3 / vLLM's flag: (out, softmax_lse), the same two tensors that flash-attn 2.x's
    # return_attn_probs gives first, for every function (same seed: same dropout mask).
    kw = {"causal": True, "dropout_p": dropout_p}
    torch.manual_seed(7)
    pairs = _call_each_api(device, torch.bfloat16, return_softmax_lse=True, **kw)
    torch.manual_seed(7)
    triples = _call_each_api(device, torch.bfloat16, return_attn_probs=True, **kw)
    torch.manual_seed(7)
    plain = _call_each_api(device, torch.bfloat16, **kw)
    for name, pair in pairs.items():
        assert isinstance(pair, tuple) and len(pair) == 2, name
        out, lse = pair
        assert torch.equal(out, triples[name][0]), name
        assert torch.equal(lse, triples[name][1]), name
        assert torch.equal(out, plain[name]), name
        assert lse.dtype == torch.float32 and not lse.requires_grad, name
        expected = (2, 4, 9) if "varlen" not in name else (4, 18)
        if "qkvpacked" in name:
            expected = (2, 2, 9) if "varlen" not in name else (2, 18)
        assert tuple(lse.shape) == expected, name


@pytest.mark.parametrize("device", DEVICES)
def test_return_softmax_lse_with_grad(device):
    # Through the autograd.Function: out differentiable, the lse not, as with return_attn_probs.
    q, k, v = make_qkv(2, 9, 11, 4, 2, 32, torch.bfloat16, device)
    q_, k_, v_ = leaves(q, k, v)
    out, lse = flash_attn_func(q_, k_, v_, causal=True, return_softmax_lse=True)
    ref_out = flash_attn_func(*leaves(q, k, v), causal=True)
    assert torch.equal(out, ref_out) and not lse.requires_grad
    out.float().sum().backward()
    assert q_.grad is not None and torch.isfinite(q_.grad.float()).all()


def test_return_softmax_lse_and_attn_probs_exclude_each_other():
    q, k, v = make_qkv(1, 4, 4, 2, 2, 32, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="return_attn_probs=True and return_softmax_lse=True"):
        flash_attn_func(q, k, v, return_attn_probs=True, return_softmax_lse=True)


def keep_mask_from_s_dmask(s_dmask):
    # Dropped entries are negated; signbit also catches -0.0.
    return ~torch.signbit(s_dmask)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True])
def test_dropout(device, causal):
    dropout_p = 0.17
    q, k, v = make_qkv(2, 64, 48, 4, 2, 32, torch.bfloat16, device)
    q_, k_, v_ = leaves(q, k, v)
    out, softmax_lse, s_dmask = flash_attn_func(
        q_, k_, v_, dropout_p=dropout_p, causal=causal, return_attn_probs=True
    )
    assert s_dmask.shape == (2, 4, 64, 48) and s_dmask.dtype == q.dtype
    keep = keep_mask_from_s_dmask(s_dmask)

    # S_dmask holds undropped softmax numerators in flash-attn's convention
    # (tests/s_dmask.py): the probabilities recovered from it, signs aside,
    # are the reference ones.
    _, ref_lse, ref_probs = attention_ref(q, k, v, causal=causal)
    scores = s_dmask_reading.final_scores(q.cpu(), k.cpu(), window=(-1, 0 if causal else -1))
    width = flash_attn_cuda._get_block_size_n(q.device, q.shape[-1], True, causal)
    recovered = s_dmask_reading.probs_from_numerators(s_dmask.cpu(), scores, width)
    torch.testing.assert_close(recovered, ref_probs.cpu(), atol=1e-2, rtol=0)
    torch.testing.assert_close(softmax_lse.double(), ref_lse, atol=1e-2, rtol=0)

    # About dropout_p of the visible entries are dropped.
    visible = ref_probs > 0
    dropped = (~keep & visible).sum().item() / visible.sum().item()
    assert abs(dropped - dropout_p) < 0.03

    # The backward pass regenerates the forward's mask from the saved rng state.
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q_, k_, v_), dout)
    kwargs = {"causal": causal, "keep_mask": keep, "dropout_p": dropout_p}
    check_against_reference("dropout", (q, k, v), kwargs, out, grads, dout)


def test_dropout_seeding():
    q, k, v = make_qkv(1, 32, 32, 2, 2, 16, torch.float16, "cpu")
    torch.manual_seed(1234)
    first = flash_attn_func(q, k, v, dropout_p=0.5)
    second = flash_attn_func(q, k, v, dropout_p=0.5)
    torch.manual_seed(1234)
    replay = flash_attn_func(q, k, v, dropout_p=0.5)
    assert torch.equal(first, replay), "torch.manual_seed must make dropout reproducible"
    assert not torch.equal(first, second), "each call must draw a fresh dropout mask"
    assert torch.equal(flash_attn_func(q, k, v), flash_attn_func(q, k, v, dropout_p=0.0))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("varlen", [False, True])
def test_inference_call_matches_autograd_call(device, varlen):
    # Without an input that requires grad the functions call the forward op
    # directly instead of through their autograd.Function: the same results,
    # bit for bit (same op, same arguments, same drawn dropout seed), and no
    # graph. An odd head dim covers the padding, dropout the rng state.
    q, k, v = make_qkv(2, 9, 13, 4, 2, 20, torch.bfloat16, device)
    if varlen:
        cu_q = torch.tensor([0, 9, 18], dtype=torch.int32, device=device)
        cu_k = torch.tensor([0, 13, 26], dtype=torch.int32, device=device)

        def call(q, k, v, **kwargs):
            return flash_attn_varlen_func(
                q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k, 9, 13, **kwargs
            )
    else:
        call = flash_attn_func
    kwargs = dict(dropout_p=0.2, causal=True, return_attn_probs=True)
    for grad_mode in (torch.enable_grad, torch.no_grad):
        torch.manual_seed(5)
        with grad_mode():
            direct = call(q, k, v, **kwargs)
        torch.manual_seed(5)
        traced = call(*leaves(q, k, v), **kwargs)
        assert direct[0].grad_fn is None and not direct[0].requires_grad
        assert traced[0].requires_grad
        for a, b in zip(direct, traced):
            assert torch.equal(a, b.detach())
    # ALiBi slopes that require grad keep the autograd.Function (as before).
    slopes = torch.rand(4, device=device, requires_grad=True)
    assert call(q, k, v, alibi_slopes=slopes).requires_grad


# ---------------------------------------------------------------------------
# Packed variants
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True])
def test_qkvpacked(device, causal):
    qkv = torch.randn(2, 19, 3, 4, 32, dtype=torch.bfloat16, device=device)
    (qkv_,) = leaves(qkv)
    out = flash_attn_qkvpacked_func(qkv_, causal=causal)
    dout = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, qkv_, dout)
    assert dqkv.shape == qkv.shape
    check_against_reference(
        "qkvpacked", qkv.unbind(2), {"causal": causal}, out, dqkv.unbind(2), dout
    )
    # Same numbers as the unpacked call on the strided slices.
    assert torch.equal(out, flash_attn_func(*qkv.unbind(2), causal=causal))


@pytest.mark.parametrize("device", DEVICES)
def test_kvpacked(device):
    q = torch.randn(2, 21, 6, 40, dtype=torch.float16, device=device)
    kv = torch.randn(2, 30, 2, 2, 40, dtype=torch.float16, device=device)
    q_, kv_ = leaves(q, kv)
    out, softmax_lse, _ = flash_attn_kvpacked_func(
        q_, kv_, causal=True, window_size=(7, 0), return_attn_probs=True
    )
    dout = torch.randn_like(out)
    dq, dkv = torch.autograd.grad(out, (q_, kv_), dout)
    assert dkv.shape == kv.shape and softmax_lse.shape == (2, 6, 21)
    k, v = kv.unbind(2)
    check_against_reference(
        "kvpacked",
        (q, k, v),
        {"causal": True, "window_size": (7, 0)},
        out,
        (dq, *dkv.unbind(2)),
        dout,
    )


# ---------------------------------------------------------------------------
# Variable-length attention
# ---------------------------------------------------------------------------


def cu_seqlens(lengths, device):
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    return cu.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_varlen(device, causal, dtype):
    lengths_q, lengths_k = [1, 17, 0, 33], [5, 17, 3, 20]
    nheads, nheads_k, head_dim = 4, 2, 32
    cu_q, cu_k = cu_seqlens(lengths_q, device), cu_seqlens(lengths_k, device)
    q = torch.randn(sum(lengths_q), nheads, head_dim, dtype=dtype, device=device)
    k = torch.randn(sum(lengths_k), nheads_k, head_dim, dtype=dtype, device=device)
    v = torch.randn_like(k)
    slopes = torch.rand(len(lengths_q), nheads, device=device)
    q_, k_, v_ = leaves(q, k, v)
    out, softmax_lse, s_dmask = flash_attn_varlen_func(
        q_,
        k_,
        v_,
        cu_q,
        cu_k,
        max(lengths_q),
        max(lengths_k),
        causal=causal,
        alibi_slopes=slopes,
        return_attn_probs=True,
    )
    assert softmax_lse.shape == (nheads, sum(lengths_q)) and s_dmask.numel() == 0
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q_, k_, v_), dout)

    def ref_fn(q, k, v, **kwargs):
        return varlen_attention_ref(
            q, k, v, cu_q, cu_k, alibi_slopes=slopes, causal=causal, **kwargs
        )

    check_against_reference("varlen", (q, k, v), {}, out, grads, dout, ref_fn=ref_fn)
    ref_lse = ref_fn(q, k, v)[1]
    lowp_lse = ref_fn(q, k, v, compute_dtype=dtype)[1]
    assert_within(softmax_lse, ref_lse, lowp_lse, 2, "varlen softmax_lse")


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_dropout(device):
    dropout_p = 0.25
    lengths_q, lengths_k = [9, 30, 4], [12, 30, 21]
    cu_q, cu_k = cu_seqlens(lengths_q, device), cu_seqlens(lengths_k, device)
    q = torch.randn(sum(lengths_q), 2, 32, dtype=torch.bfloat16, device=device)
    k = torch.randn(sum(lengths_k), 2, 32, dtype=torch.bfloat16, device=device)
    v = torch.randn_like(k)
    q_, k_, v_ = leaves(q, k, v)
    out, _, s_dmask = flash_attn_varlen_func(
        q_,
        k_,
        v_,
        cu_q,
        cu_k,
        30,
        30,
        dropout_p=dropout_p,
        causal=True,
        return_attn_probs=True,
    )
    assert s_dmask.shape == (3, 2, 30, 30)
    keep = keep_mask_from_s_dmask(s_dmask)
    keep_masks = [keep[b, :, :lq, :lk] for b, (lq, lk) in enumerate(zip(lengths_q, lengths_k))]
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q_, k_, v_), dout)

    def ref_fn(q, k, v, **kwargs):
        return varlen_attention_ref(
            q, k, v, cu_q, cu_k, causal=True, keep_masks=keep_masks, dropout_p=dropout_p, **kwargs
        )

    check_against_reference("varlen dropout", (q, k, v), {}, out, grads, dout, ref_fn=ref_fn)


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_packed(device):
    lengths = [7, 1, 26]
    cu = cu_seqlens(lengths, device)
    qkv = torch.randn(sum(lengths), 3, 4, 32, dtype=torch.float16, device=device)
    (qkv_,) = leaves(qkv)
    out = flash_attn_varlen_qkvpacked_func(qkv_, cu, max(lengths), causal=True)
    dout = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, qkv_, dout)
    assert dqkv.shape == qkv.shape

    def ref_fn(q, k, v, **kwargs):
        return varlen_attention_ref(q, k, v, cu, cu, causal=True, **kwargs)

    check_against_reference(
        "varlen qkvpacked", qkv.unbind(1), {}, out, dqkv.unbind(1), dout, ref_fn=ref_fn
    )

    lengths_k = [3, 9, 26]
    cu_k = cu_seqlens(lengths_k, device)
    q = qkv[:, 0]
    kv = torch.randn(sum(lengths_k), 2, 2, 32, dtype=torch.float16, device=device)
    q_, kv_ = leaves(q, kv)
    out = flash_attn_varlen_kvpacked_func(q_, kv_, cu, cu_k, max(lengths), max(lengths_k))
    dq, dkv = torch.autograd.grad(out, (q_, kv_), dout)
    assert dkv.shape == kv.shape

    def ref_fn_kv(q, k, v, **kwargs):
        return varlen_attention_ref(q, k, v, cu, cu_k, **kwargs)

    check_against_reference(
        "varlen kvpacked",
        (q, *kv.unbind(1)),
        {},
        out,
        (dq, *dkv.unbind(1)),
        dout,
        ref_fn=ref_fn_kv,
    )


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_paged_kv(device):
    lengths_q, lengths_k = [3, 11], [20, 9]
    page_size, nheads_k, head_dim = 8, 2, 32
    cu_q, cu_k = cu_seqlens(lengths_q, device), cu_seqlens(lengths_k, device)
    q = torch.randn(sum(lengths_q), 4, head_dim, dtype=torch.bfloat16, device=device)
    k = torch.randn(sum(lengths_k), nheads_k, head_dim, dtype=torch.bfloat16, device=device)
    v = torch.randn_like(k)
    # Scatter each sequence's keys into pages of a shuffled pool.
    max_blocks = math.ceil(max(lengths_k) / page_size)
    num_blocks = 2 * max_blocks + 1
    order = torch.randperm(num_blocks)
    block_table = order[: 2 * max_blocks].reshape(2, max_blocks).to(torch.int32)
    k_pages = torch.randn(num_blocks, page_size, nheads_k, head_dim, dtype=q.dtype)
    v_pages = torch.randn_like(k_pages)
    for b, length in enumerate(lengths_k):
        start = int(cu_k[b])
        for pos in range(length):
            page, row = int(block_table[b, pos // page_size]), pos % page_size
            k_pages[page, row] = k[start + pos].cpu()
            v_pages[page, row] = v[start + pos].cpu()
    k_pages, v_pages = k_pages.to(device), v_pages.to(device)
    block_table = block_table.to(device)

    paged = flash_attn_varlen_func(
        q,
        k_pages,
        v_pages,
        cu_q,
        cu_k,
        max(lengths_q),
        max(lengths_k),
        causal=True,
        block_table=block_table,
    )
    ref_out, _ = varlen_attention_ref(q, k, v, cu_q, cu_k, causal=True)
    lowp_out, _ = varlen_attention_ref(q, k, v, cu_q, cu_k, causal=True, compute_dtype=q.dtype)
    assert_within(paged, ref_out, lowp_out, 2, "paged varlen out")

    # Paged K/V is forward-only, as in flash-attn.
    q_ = q.detach().requires_grad_()
    out = flash_attn_varlen_func(
        q_,
        k_pages,
        v_pages,
        cu_q,
        cu_k,
        max(lengths_q),
        max(lengths_k),
        block_table=block_table,
    )
    with pytest.raises(RuntimeError, match="block_table"):
        out.sum().backward()


# ---------------------------------------------------------------------------
# Head dims that are not a multiple of 8, and strided inputs
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [4, 20, 33, 255])
def test_odd_head_dims_are_padded(device, head_dim):
    seqlen = 9 if head_dim == 255 else 17
    q, k, v = make_qkv(2, seqlen, seqlen + 3, 2, 1, head_dim, torch.bfloat16, device)
    q_, k_, v_ = leaves(q, k, v)
    out = flash_attn_func(q_, k_, v_, causal=True)
    assert out.shape == q.shape
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q_, k_, v_), dout)
    check_against_reference(f"head_dim={head_dim}", (q, k, v), {"causal": True}, out, grads, dout)

    # Packed and varlen variants pad the same way.
    qkv = torch.randn(2, seqlen, 3, 2, head_dim, dtype=torch.bfloat16, device=device)
    (qkv_,) = leaves(qkv)
    out = flash_attn_qkvpacked_func(qkv_)
    (dqkv,) = torch.autograd.grad(out, qkv_, torch.ones_like(out))
    assert out.shape == (2, seqlen, 2, head_dim) and dqkv.shape == qkv.shape
    cu = cu_seqlens([seqlen, seqlen], device)
    packed_out = flash_attn_varlen_qkvpacked_func(qkv.reshape(-1, 3, 2, head_dim), cu, seqlen)
    assert torch.equal(packed_out.reshape(out.shape), out.detach())


@pytest.mark.parametrize("device", DEVICES)
def test_strided_inputs(device):
    # A last dim that is not contiguous is copied; other strides are used as they are.
    q = torch.randn(2, 32, 8, 4, dtype=torch.bfloat16, device=device).transpose(2, 3)
    assert q.stride(-1) != 1
    k = torch.randn(2, 40, 4, 16, dtype=torch.bfloat16, device=device)[:, ::2, :, :8]
    v = torch.randn(2, 20, 8, 8, dtype=torch.bfloat16, device=device)[:, :, 1::2]
    q_, k_, v_ = leaves(q, k, v)
    out = flash_attn_func(q_, k_, v_)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q_, k_, v_), dout)
    check_against_reference("strided", (q, k, v), {}, out, grads, dout)
    # A gradient with stride 0 everywhere (from .sum()) is accepted too.
    q_, k_, v_ = leaves(q, k, v)
    flash_attn_func(q_, k_, v_).sum().backward()
    assert q_.grad.shape == q.shape


# ---------------------------------------------------------------------------
# KV cache
# ---------------------------------------------------------------------------


def apply_rotary_ref(x, cos, sin, positions, interleaved):
    """x (b, s, h, d); positions (b, s) index cos / sin (seqlen_ro, rotary_dim / 2)."""
    rotary_dim = cos.shape[-1] * 2
    cos = cos.double()[positions][:, :, None]  # (b, s, 1, rotary_dim / 2)
    sin = sin.double()[positions][:, :, None]
    x = x.double()
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    if interleaved:
        even, odd = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
        rotated = rotated.flatten(-2)
    else:
        first, second = rot.chunk(2, dim=-1)
        rotated = torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)
    return torch.cat((rotated, rest), dim=-1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("rotary", [None, "interleaved", "half"])
@pytest.mark.parametrize("causal", [False, True])
def test_with_kvcache(device, paged, rotary, causal):
    batch, seqlen_q, seqlen_new, nheads, nheads_k, head_dim = 3, 2, 2, 4, 2, 32
    # Pages of 8 rows on the CPU, 5 on CUDA (any size runs on both).
    seqlen_cache, page_size = (24, 8) if device == "cpu" else (45, 5)
    dtype = torch.bfloat16
    q = torch.randn(batch, seqlen_q, nheads, head_dim, dtype=dtype, device=device)
    k_new = torch.randn(batch, seqlen_new, nheads_k, head_dim, dtype=dtype, device=device)
    v_new = torch.randn_like(k_new)
    k_cache = torch.randn(batch + 1, seqlen_cache, nheads_k, head_dim, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    cache_seqlens = torch.tensor([5, 0, 17], dtype=torch.int32, device=device)
    cache_batch_idx = torch.tensor([2, 0, 3], dtype=torch.int32, device=device)
    rotary_kwargs = {}
    if rotary is not None:
        rotary_dim = 16
        angles = torch.rand(seqlen_cache, rotary_dim // 2, device=device) * 2 * math.pi
        rotary_kwargs = dict(
            rotary_cos=angles.cos().to(dtype),
            rotary_sin=angles.sin().to(dtype),
            rotary_interleaved=rotary == "interleaved",
        )

    # Expected cache contents and attention, built with plain indexing.
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    positions_new = cache_seqlens[:, None].long() + torch.arange(seqlen_new, device=device)
    if causal:
        positions_q = cache_seqlens[:, None].long() + torch.arange(seqlen_q, device=device)
    else:
        positions_q = cache_seqlens[:, None].long().expand(batch, seqlen_q)
    k_rot, q_rot = k_new.double(), q.double()
    if rotary is not None:
        cos, sin, interleaved = (
            rotary_kwargs[n] for n in ("rotary_cos", "rotary_sin", "rotary_interleaved")
        )
        k_rot = apply_rotary_ref(k_new, cos, sin, positions_new, interleaved)
        q_rot = apply_rotary_ref(q, cos, sin, positions_q, interleaved)
    ref_outs, lowp_outs = [], []
    for b in range(batch):
        row, start = int(cache_batch_idx[b]), int(cache_seqlens[b])
        expected_k[row, start : start + seqlen_new] = k_rot[b].to(dtype)
        expected_v[row, start : start + seqlen_new] = v_new[b]
        end = start + seqlen_new
        keys, values = expected_k[row, None, :end], expected_v[row, None, :end]
        ref_outs.append(attention_ref(q_rot[b, None], keys, values, causal=causal)[0])
        lowp_outs.append(
            attention_ref(
                q_rot[b, None].to(dtype), keys, values, causal=causal, compute_dtype=dtype
            )[0]
        )
    ref_out, lowp_out = torch.cat(ref_outs), torch.cat(lowp_outs)

    if paged:
        # Same data in a shuffled page pool; block_table rows follow cache_batch_idx.
        blocks_per_seq = seqlen_cache // page_size
        num_blocks = (batch + 1) * blocks_per_seq
        order = torch.randperm(num_blocks, device=device)
        pool_of = order.reshape(batch + 1, blocks_per_seq)
        k_pool = torch.empty(num_blocks, page_size, nheads_k, head_dim, dtype=dtype, device=device)
        v_pool = torch.empty_like(k_pool)
        k_pool[pool_of.flatten()] = k_cache.reshape(-1, page_size, nheads_k, head_dim)
        v_pool[pool_of.flatten()] = v_cache.reshape(-1, page_size, nheads_k, head_dim)
        block_table = pool_of[cache_batch_idx.long()].to(torch.int32)
        out, softmax_lse = flash_attn_with_kvcache(
            q,
            k_pool,
            v_pool,
            k_new,
            v_new,
            cache_seqlens=cache_seqlens,
            block_table=block_table,
            causal=causal,
            return_softmax_lse=True,
            **rotary_kwargs,
        )
        k_after = k_pool[pool_of.flatten()].reshape(k_cache.shape)
        v_after = v_pool[pool_of.flatten()].reshape(v_cache.shape)
    else:
        out, softmax_lse = flash_attn_with_kvcache(
            q,
            k_cache,
            v_cache,
            k_new,
            v_new,
            cache_seqlens=cache_seqlens,
            cache_batch_idx=cache_batch_idx,
            causal=causal,
            return_softmax_lse=True,
            **rotary_kwargs,
        )
        k_after, v_after = k_cache, v_cache

    assert softmax_lse.shape == (batch, nheads, seqlen_q) and softmax_lse.dtype == torch.float32
    # Rotary math in fp32 vs float64 can round the stored key one ulp apart.
    torch.testing.assert_close(k_after, expected_k, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(v_after, expected_v, atol=0, rtol=0)
    assert_within(out, ref_out, lowp_out, 3 if rotary else 2, "kvcache out")


@pytest.mark.parametrize("device", DEVICES)
def test_with_kvcache_int_seqlens_and_no_append(device):
    q = torch.randn(2, 3, 4, 16, dtype=torch.float16, device=device)
    k_cache = torch.randn(2, 12, 1, 16, dtype=torch.float16, device=device)
    v_cache = torch.randn_like(k_cache)
    before = k_cache.clone()
    out = flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=7, window_size=(2, 1), softcap=4.0
    )
    assert torch.equal(k_cache, before), "no k / v given: the cache must not change"
    kwargs = {"window_size": (2, 1), "softcap": 4.0}
    ref_out, _, _ = attention_ref(q, k_cache[:, :7], v_cache[:, :7], **kwargs)
    lowp_out, _, _ = attention_ref(
        q, k_cache[:, :7], v_cache[:, :7], compute_dtype=q.dtype, **kwargs
    )
    assert_within(out, ref_out, lowp_out, 2, "kvcache int cache_seqlens")
    # Without cache_seqlens the whole cache is attended to.
    full = flash_attn_with_kvcache(q, k_cache, v_cache)
    ref_full, _, _ = attention_ref(q, k_cache, v_cache)
    lowp_full, _, _ = attention_ref(q, k_cache, v_cache, compute_dtype=q.dtype)
    assert_within(full, ref_full, lowp_full, 2, "kvcache full cache")


@pytest.mark.parametrize("device", DEVICES)
def test_with_kvcache_odd_head_dim(device):
    # Padded internally; the appended rows still land in the caller's caches.
    head_dim = 20
    q = torch.randn(2, 2, 4, head_dim, dtype=torch.bfloat16, device=device)
    k_cache = torch.randn(2, 10, 2, head_dim, dtype=torch.bfloat16, device=device)
    v_cache = torch.randn_like(k_cache)
    k_new, v_new = torch.randn_like(k_cache[:, :2]), torch.randn_like(v_cache[:, :2])
    cache_seqlens = torch.tensor([3, 6], dtype=torch.int32, device=device)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for b, start in enumerate(cache_seqlens.tolist()):
        expected_k[b, start : start + 2], expected_v[b, start : start + 2] = k_new[b], v_new[b]
    out = flash_attn_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, cache_seqlens=cache_seqlens, causal=True
    )
    assert out.shape == q.shape
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    for b, start in enumerate(cache_seqlens.tolist()):
        end = start + 2
        ref, _, _ = attention_ref(
            q[b, None], expected_k[b, None, :end], expected_v[b, None, :end], causal=True
        )
        lowp, _, _ = attention_ref(
            q[b, None],
            expected_k[b, None, :end],
            expected_v[b, None, :end],
            causal=True,
            compute_dtype=q.dtype,
        )
        assert_within(out[b, None], ref, lowp, 2, "kvcache head_dim=20")
