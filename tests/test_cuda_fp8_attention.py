"""CUDA tests of FP8 attention: flash_attn_func and flash_attn_varlen_func with
q, k and v in float8_e4m3fn (docs/fp8.md).

On CUDA the split-KV kernel's instances over e4m3 keys and values serve every
such call: the op converts q to bfloat16 (exact: every e4m3 value is a
bfloat16 value), the kernel converts each K / V tile the same way, folds
q_descale * k_descale into the scores' scale and v_descale into the merge, and
writes bfloat16. So the result meets the project's criterion against the
float64 attention of the dequantised inputs (tests/test_cpu_fp8.py's cases and
references) and agrees with the CPU op, which computes the same function.
Descales differ per (batch entry, kv head), so a descale read for the wrong
entry or head fails.

Every test needs a GPU of compute capability 8.9 or newer and a build with fp8
(FLASH_ATTN_CUDA_DTYPES); a head dim the build left out is reported as a skip
(conftest.py).
"""

import pytest
import torch

import reference as ref
from flash_attn_cuda import flash_attn_func, flash_attn_varlen_func
from test_cpu_fp8 import (
    skip_below_sm89,
    FEATURES,
    FIXED_SHAPES,
    FP8_CACHE_FEATURES,
    FP8_CACHE_SEQLENS,
    call_fp8_cache_varlen,
    check_out_lse,
    fixed_case,
    fp8_cache_varlen_case,
    fp8_cache_varlen_refs,
    paged_case,
    varlen_case,
    varlen_refs,
)

pytestmark = pytest.mark.cuda

DEVICE = "cuda"


@pytest.fixture(autouse=True)
def _needs_sm89():
    skip_below_sm89("FP8 attention on CUDA")


def cuda(t):
    return None if t is None else t.to(DEVICE)


def func_on(device, q, k, v, scales, **kwargs):
    def to(t):
        return None if t is None else t.to(device)

    dq_s, dk_s, dv_s = scales
    return flash_attn_func(
        to(q),
        to(k),
        to(v),
        return_softmax_lse=True,
        q_descale=to(dq_s),
        k_descale=to(dk_s),
        v_descale=to(dv_s),
        **{
            key: to(value) if isinstance(value, torch.Tensor) else value
            for key, value in kwargs.items()
        },
    )


def check_against_references(out, lse, q, k, v, scales, cpu_out, **features):
    """float64 of the dequantised inputs by the criterion, lse within 1e-4, and
    the CPU op within three times the criterion of each other."""
    assert out.dtype == torch.bfloat16 and out.device.type == DEVICE
    dq_s, dk_s, dv_s = scales
    qd, kd, vd = (ref.fp8_dequantize(t, s) for t, s in ((q, dq_s), (k, dk_s), (v, dv_s)))
    ref_out, ref_lse = ref.attention_ref(qd, kd, vd, **features)
    same_out, _ = ref.attention_ref(qd, kd, vd, **features, compute_dtype=torch.bfloat16)
    check_out_lse(out.cpu(), lse.cpu(), ref_out, ref_lse, same_out)
    ref.assert_within_criterion(out.cpu(), cpu_out.double(), same_out.to(out.dtype), factor=3.0)


@pytest.mark.parametrize("shape", FIXED_SHAPES)
@pytest.mark.parametrize("features", FEATURES, ids=lambda f: ",".join(f) or "plain")
def test_func_against_float64(shape, features):
    batch, seqlen_q, seqlen_k, nheads, nheads_k, d = shape
    features = dict(features)
    q, k, v, scales, sink = fixed_case(
        batch, seqlen_q, seqlen_k, nheads, nheads_k, d, sink=features.pop("sink", False)
    )
    out, lse = func_on(DEVICE, q, k, v, scales, **features, learnable_sink=sink)
    cpu_out, _ = func_on("cpu", q, k, v, scales, **features, learnable_sink=sink)
    assert out.shape == (batch, seqlen_q, nheads, d)
    check_against_references(out, lse, q, k, v, scales, cpu_out, **features, learnable_sink=sink)


@pytest.mark.parametrize(
    "d, d_v", [(36, 36), (64, 32), (128, 128), (192, 128), (256, 256), (512, 512)]
)
def test_head_dims(d, d_v):
    """Head dims that are not a multiple of 8 (zero-padded), d_v < d_qk, and
    the split-KV kernel's head dims up to 512."""
    q, k, v, scales, _ = fixed_case(2, 70, 150, 4, 2, d, d_v=d_v)
    out, lse = func_on(DEVICE, q, k, v, scales, causal=True)
    cpu_out, _ = func_on("cpu", q, k, v, scales, causal=True)
    assert out.shape == (2, 70, 4, d_v)
    check_against_references(out, lse, q, k, v, scales, cpu_out, causal=True)


def test_prefill_shape():
    """A training-size call (many query rows per kv head: the split-KV kernel's
    64-row variant), GQA 4, causal."""
    q, k, v, scales, _ = fixed_case(1, 1024, 1024, 16, 4, 128)
    out, lse = func_on(DEVICE, q, k, v, scales, causal=True)
    cpu_out, _ = func_on("cpu", q, k, v, scales, causal=True)
    check_against_references(out, lse, q, k, v, scales, cpu_out, causal=True)


def test_descales_default_to_one_and_broadcast():
    """No descale is 1; an expanded (stride 0) descale reads as its value."""
    q, k, v, _, _ = fixed_case(2, 9, 33, 4, 2, 64)
    ones = torch.ones(2, 2, device=DEVICE)
    plain = flash_attn_func(cuda(q), cuda(k), cuda(v))
    assert torch.equal(plain, flash_attn_func(cuda(q), cuda(k), cuda(v), k_descale=ones))
    half = torch.tensor(0.5, device=DEVICE).expand(2, 2)
    scales = [half.cpu().expand(2, 2)] * 3
    out, lse = func_on(DEVICE, q, k, v, [half] * 3)
    cpu_out, _ = func_on("cpu", q, k, v, scales)
    check_against_references(out, lse, q, k, v, scales, cpu_out)


def test_out_argument():
    q, k, v, scales, _ = fixed_case(2, 17, 40, 4, 2, 64)
    out = torch.full((2, 17, 4, 64), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    dq_s, dk_s, dv_s = (cuda(s) for s in scales)
    written = flash_attn_func(
        cuda(q), cuda(k), cuda(v), q_descale=dq_s, k_descale=dk_s, v_descale=dv_s, out=out
    )
    assert written.data_ptr() == out.data_ptr()
    expected = flash_attn_func(
        cuda(q), cuda(k), cuda(v), q_descale=dq_s, k_descale=dk_s, v_descale=dv_s
    )
    assert torch.equal(out, expected)
    with pytest.raises(ValueError, match=r"out must have the output dtype .*bfloat16.*float16"):
        flash_attn_func(
            cuda(q),
            cuda(k),
            cuda(v),
            out=torch.empty(2, 17, 4, 64, dtype=torch.float16, device=DEVICE),
        )


@pytest.mark.parametrize(
    "features", [dict(), dict(causal=True), dict(window_size=(5, 0)), dict(softcap=4.0)]
)
def test_varlen_with_empty_sequence(features):
    """An empty sequence, one with queries and no keys (rows that see no key),
    GQA 2, differing lengths."""
    seqlens_q, seqlens_k = [5, 0, 17, 3, 1], [9, 0, 40, 0, 129]
    q, k, v, cu_q, cu_k, scales = varlen_case(seqlens_q, seqlens_k, 4, 2, 64)
    out, lse = flash_attn_varlen_func(
        cuda(q),
        cuda(k),
        cuda(v),
        cuda(cu_q),
        cuda(cu_k),
        max(seqlens_q),
        max(seqlens_k),
        **features,
        return_softmax_lse=True,
        q_descale=cuda(scales[0]),
        k_descale=cuda(scales[1]),
        v_descale=cuda(scales[2]),
    )
    assert out.dtype == torch.bfloat16
    ref_out, ref_lse, same_out = varlen_refs(q, k, v, cu_q, cu_k, scales, **features)
    check_out_lse(out.cpu(), lse.cpu(), ref_out, ref_lse, same_out)
    assert torch.equal(out[22:25].cpu(), torch.zeros(3, 4, 64, dtype=torch.bfloat16))


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_paged(page_size, causal):
    """Paged e4m3 K / V through a shuffled block table, each sequence read with
    its own descales."""
    seqlens_q, seqlens_k = [3, 1, 20], [37, 1, 150]
    call, (k, v) = paged_case(seqlens_q, seqlens_k, page_size, 8, 2, 64)
    q, k_pages, v_pages, block_table, cu_q, cu_k, scales = call
    out, lse = flash_attn_varlen_func(
        *(cuda(t) for t in (q, k_pages, v_pages, cu_q, cu_k)),
        max(seqlens_q),
        max(seqlens_k),
        causal=causal,
        block_table=cuda(block_table),
        return_softmax_lse=True,
        **dict(zip(("q_descale", "k_descale", "v_descale"), (cuda(s) for s in scales))),
    )
    ref_out, ref_lse, same_out = varlen_refs(q, k, v, cu_q, cu_k, scales, causal=causal)
    check_out_lse(out.cpu(), lse.cpu(), ref_out, ref_lse, same_out)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("page_size", [None, 16])
def test_varlen_keys_within_one_block(head_dim, page_size):
    """Every sequence's keys fit one key block: the run still takes two splits
    (the combine writes every row), the second one empty."""
    seqlens_q, seqlens_k = [5, 0, 30], [9, 40, 33]
    features = dict(causal=True)
    if page_size is None:
        q, k, v, cu_q, cu_k, scales = varlen_case(seqlens_q, seqlens_k, 4, 2, head_dim)
        keys = (k, v)
    else:
        call, (k, v) = paged_case(seqlens_q, seqlens_k, page_size, 4, 2, head_dim)
        q, k_pages, v_pages, table, cu_q, cu_k, scales = call
        keys, features["block_table"] = (k_pages, v_pages), cuda(table)
    out, lse = flash_attn_varlen_func(
        cuda(q),
        *(cuda(t) for t in keys),
        cuda(cu_q),
        cuda(cu_k),
        max(seqlens_q),
        max(seqlens_k),
        return_softmax_lse=True,
        **features,
        **dict(zip(("q_descale", "k_descale", "v_descale"), (cuda(s) for s in scales))),
    )
    ref_out, ref_lse, same_out = varlen_refs(q, k, v, cu_q, cu_k, scales, causal=True)
    check_out_lse(out.cpu(), lse.cpu(), ref_out, ref_lse, same_out)


@pytest.mark.parametrize("page_size", [None, 1, 16, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("features", FP8_CACHE_FEATURES, ids=lambda f: ",".join(f) or "plain")
def test_fp8_cache_varlen_with_16_bit_q(page_size, dtype, features):
    """An FP8 KV cache through the varlen forward (vLLM's chunked prefill):
    e4m3 k and v, packed or paged, under a 16-bit q, on the split-KV kernel's
    e4m3 instances of q's dtype; against float64 and the CPU op, empty
    sequences and rows that see no key included."""
    case = fp8_cache_varlen_case(*FP8_CACHE_SEQLENS, page_size, dtype)
    (q, _, _, _, cu_q, cu_k, kv_descales), (k, v) = case
    out, lse = call_fp8_cache_varlen(case, DEVICE, **features)
    cpu_out, _ = call_fp8_cache_varlen(case, "cpu", **features)
    assert out.dtype == dtype and out.device.type == DEVICE
    ref_out, ref_lse, same_out = fp8_cache_varlen_refs(q, k, v, cu_q, cu_k, kv_descales, **features)
    check_out_lse(out.cpu(), lse.cpu(), ref_out, ref_lse, same_out)
    ref.assert_within_criterion(out.cpu(), cpu_out.double(), same_out.to(dtype), factor=3.0)
    assert torch.equal(out[23:25].cpu(), torch.zeros_like(out[23:25].cpu()))  # no key


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_cache_func_with_16_bit_q(dtype):
    """flash_attn_func over e4m3 k and v with a 16-bit q: a decode step (the
    decode variant) and a prefill (many query rows a kv head), GQA 4."""
    for seqlen_q in (1, 70):
        _, k, v, (_, dk_s, dv_s), _ = fixed_case(2, seqlen_q, 300, 8, 2, 128)
        q = torch.randn(2, seqlen_q, 8, 128).to(dtype)
        kw = dict(causal=True, return_softmax_lse=True)
        out, lse = flash_attn_func(
            cuda(q), cuda(k), cuda(v), k_descale=cuda(dk_s), v_descale=cuda(dv_s), **kw
        )
        cpu_out, _ = flash_attn_func(q, k, v, k_descale=dk_s, v_descale=dv_s, **kw)
        assert out.dtype == dtype
        kd, vd = ref.fp8_dequantize(k, dk_s), ref.fp8_dequantize(v, dv_s)
        ref_out, ref_lse = ref.attention_ref(q.double(), kd, vd, causal=True)
        same_out, _ = ref.attention_ref(q.double(), kd, vd, causal=True, compute_dtype=dtype)
        check_out_lse(out.cpu(), lse.cpu(), ref_out, ref_lse, same_out)
        ref.assert_within_criterion(out.cpu(), cpu_out.double(), same_out.to(dtype), factor=3.0)


def test_what_the_split_kv_kernel_does_not_serve_is_refused_by_name():
    """seqused_q (the split-KV kernel has no query-row bound) on CUDA; dropout,
    ALiBi and S_dmask as on the CPU."""
    seqlens = [5, 7]
    q, k, v, cu_q, cu_k, scales = varlen_case(seqlens, seqlens, 4, 2, 64)
    used = torch.tensor([3, 7], dtype=torch.int32, device=DEVICE)
    with pytest.raises(
        RuntimeError,
        match="FP8 attention runs on the split-KV kernel, which does not serve seqused_q",
    ):
        flash_attn_varlen_func(
            cuda(q), cuda(k), cuda(v), cuda(cu_q), cuda(cu_k), 7, 7, seqused_q=used
        )
    qf, kf, vf, _, _ = fixed_case(2, 5, 6, 4, 2, 64)
    with pytest.raises(RuntimeError, match="dropout"):
        flash_attn_func(cuda(qf), cuda(kf), cuda(vf), dropout_p=0.1)
    with pytest.raises(RuntimeError, match="alibi_slopes is not served"):
        flash_attn_func(cuda(qf), cuda(kf), cuda(vf), alibi_slopes=torch.ones(4, device=DEVICE))
    with pytest.raises(RuntimeError, match="q_descale must have shape"):
        flash_attn_func(cuda(qf), cuda(kf), cuda(vf), q_descale=torch.ones(2, 4, device=DEVICE))
    q16 = cuda(q).to(torch.bfloat16)
    with pytest.raises(
        RuntimeError,
        match=r"an FP8 KV cache \(float8_e4m3fn k and v\) is read on the split-KV kernel, "
        "which does not serve seqused_q",
    ):
        flash_attn_varlen_func(q16, cuda(k), cuda(v), cuda(cu_q), cuda(cu_k), 7, 7, seqused_q=used)


def test_opcheck_and_compile_on_cuda():
    """The fake kernel agrees with the CUDA op (bfloat16 out, fp32 lse), and
    torch.compile(fullgraph=True) traces the call."""
    from test_fp8_ops import OPCHECK_UTILS, fwd_args

    q, k, v, scales, _ = fixed_case(2, 17, 40, 4, 2, 64)
    kwargs = dict(zip(("q_descale", "k_descale", "v_descale"), (cuda(s) for s in scales)))
    args = fwd_args(cuda(q), cuda(k), cuda(v), causal=True)
    torch.library.opcheck(torch.ops.flash_attn.fwd.default, args, kwargs, test_utils=OPCHECK_UTILS)

    def attend(q, k, v, q_descale, k_descale, v_descale):
        return flash_attn_func(
            q, k, v, causal=True, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale
        )

    eager = attend(cuda(q), cuda(k), cuda(v), **kwargs)
    compiled = torch.compile(attend, fullgraph=True)(cuda(q), cuda(k), cuda(v), **kwargs)
    assert compiled.dtype == torch.bfloat16 and torch.equal(compiled, eager)
