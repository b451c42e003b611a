"""Attention sinks (learnable_sink) against the float64 reference.

Row i of head h normalises with one more logit, the head's sink, in its
softmax denominator (docs/architecture.md, "The op contract"); the sink has no value
row, the returned lse includes it, a row that sees no key gets output 0 and
lse = sink, and d sink_h = -sum_i exp(sink_h - lse_i) * rowsum(dO_i * O_i).
Every case runs on the CPU path and, with a GPU, on the CUDA kernels (the
tests marked cuda are skipped with a reason without one). Comparisons follow
the correctness criterion: fp32 inputs (CPU only) against float64 with fixed
tolerances, fp16 / bf16 within 2x (output) or 3x (gradients) the error of the
same math in the input dtype.
"""

import math

import pytest
import torch
from torch.library import opcheck

import reference
import s_dmask
from reference import (
    FP32_GRAD_TOL,
    FP32_TOL,
    assert_compiled_matches_eager,
    assert_within_criterion,
    attention_ref,
    check_close,
    varlen_attention_ref,
)

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

ops = torch.ops.flash_attn

CUDA = pytest.mark.cuda
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
# (device, dtype, head_dim) of the main fixed-length / varlen cases.
DEVICE_DTYPES = [
    ("cpu", torch.float32, 32),
    ("cpu", torch.bfloat16, 40),
    pytest.param("cuda", torch.float16, 64, marks=CUDA),
    pytest.param("cuda", torch.bfloat16, 128, marks=CUDA),
]


def random_sink(nheads, device, requires_grad=False):
    """Sinks spread over the scores' range and beyond: some heads barely
    notice theirs, one is dominated by it, one sink sits far below."""
    sink = torch.randn(nheads, dtype=torch.float32) * 2.0
    sink[0] = 6.0
    if nheads > 1:
        sink[-1] = -30.0
    return sink.to(device).requires_grad_(requires_grad)


def rand(*shape, device, dtype, requires_grad=False):
    return torch.randn(*shape, device=device, dtype=dtype).requires_grad_(requires_grad)


def check_lse(lse, lse_exact, lse_same, name="lse"):
    assert lse.dtype == torch.float32
    assert torch.isfinite(lse).all(), f"{name}: a sink leaves every row finite"
    if lse_same.dtype == torch.float32:
        torch.testing.assert_close(lse.double(), lse_exact, atol=2e-5, rtol=2e-5, msg=name)
    else:
        assert_within_criterion(lse, lse_exact, lse_same.double(), atol=1e-4, name=name)


# --------------------------------------------------------------- fixed length


FIXED_CASES = {
    "plain": dict(seqlens=(17, 17)),
    "causal_sq_gt_sk": dict(seqlens=(40, 23), causal=True),  # rows that see no key
    "causal_sq_lt_sk": dict(seqlens=(23, 70), causal=True),
    "local": dict(seqlens=(65, 65), window=(5, 3)),
    "local_empty_rows": dict(seqlens=(50, 20), window=(0, 0)),
    "softcap_alibi": dict(seqlens=(33, 47), softcap=5.0, alibi=True),
    "gqa_causal_alibi": dict(seqlens=(129, 129), causal=True, alibi=True, heads=(8, 2)),
    "mqa_softcap_local": dict(seqlens=(1, 77), softcap=3.0, window=(9, -1), heads=(4, 1)),
}


def fixed_length_run(device, dtype, head_dim, case, *, deterministic=False):
    seqlen_q, seqlen_k = case["seqlens"]
    nheads, nheads_k = case.get("heads", (4, 2))
    batch = 2
    causal = case.get("causal", False)
    window = case.get("window", (-1, -1))
    softcap = case.get("softcap", 0.0)
    q = rand(batch, seqlen_q, nheads, head_dim, device=device, dtype=dtype, requires_grad=True)
    k = rand(batch, seqlen_k, nheads_k, head_dim, device=device, dtype=dtype, requires_grad=True)
    v = rand(batch, seqlen_k, nheads_k, head_dim, device=device, dtype=dtype, requires_grad=True)
    alibi = torch.rand(batch, nheads, device=device) if case.get("alibi") else None
    sink = random_sink(nheads, device, requires_grad=True)
    dout = torch.randn(batch, seqlen_q, nheads, head_dim, device=device, dtype=dtype)
    kwargs = dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=alibi)
    return q, k, v, sink, dout, kwargs, deterministic


def reference_fixed(q, k, v, sink, dout, kwargs, compute_dtype):
    inputs = [t.detach().to(compute_dtype).requires_grad_() for t in (q, k, v)]
    s = sink.detach().to(compute_dtype).requires_grad_()
    out, lse = attention_ref(*inputs, compute_dtype=compute_dtype, learnable_sink=s, **kwargs)
    grads = torch.autograd.grad(out, inputs + [s], dout.to(compute_dtype))
    return out, lse, grads


@pytest.mark.parametrize("device,dtype,head_dim", DEVICE_DTYPES)
@pytest.mark.parametrize("case", sorted(FIXED_CASES))
def test_fixed_length_matches_reference(device, dtype, head_dim, case):
    q, k, v, sink, dout, kwargs, _ = fixed_length_run(device, dtype, head_dim, FIXED_CASES[case])
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, learnable_sink=sink, **kwargs)
    grads = torch.autograd.grad(out, (q, k, v, sink), dout)
    out_ref, lse_ref, grads_ref = reference_fixed(q, k, v, sink, dout, kwargs, torch.float64)
    out_same, lse_same, grads_same = reference_fixed(q, k, v, sink, dout, kwargs, dtype)
    check_close(out, out_ref, out_same, "out")
    check_lse(lse, lse_ref, lse_same)
    for name, ours, exact, same in zip(("dq", "dk", "dv"), grads, grads_ref, grads_same):
        check_close(ours, exact, same, name, grad=True)
    d_sink, d_sink_ref, d_sink_same = grads[3], grads_ref[3], grads_same[3]
    assert d_sink.dtype == torch.float32 and d_sink.shape == sink.shape
    if dtype == torch.float32:
        torch.testing.assert_close(d_sink.double(), d_sink_ref, **FP32_GRAD_TOL)
    else:
        assert_within_criterion(
            d_sink, d_sink_ref, d_sink_same, factor=3.0, atol=1e-4, name="d_sink"
        )


@pytest.mark.parametrize(
    "device,dtype",
    [
        ("cpu", torch.float32),
        pytest.param("cuda", torch.bfloat16, marks=CUDA),
    ],
)
def test_rows_that_see_no_key(device, dtype):
    """Output 0 and lse = the head's sink, exactly; those rows add nothing to d_sink."""
    batch, seqlen_q, seqlen_k, nheads = 2, 9, 5, 3
    q, k, v = (
        rand(batch, s, nheads, 64, device=device, dtype=dtype, requires_grad=True)
        for s in (seqlen_q, seqlen_k, seqlen_k)
    )
    sink = random_sink(nheads, device, requires_grad=True)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True, learnable_sink=sink)
    empty = seqlen_q - seqlen_k  # rows 0 .. 3 see no key under bottom-right causal
    assert (out[:, :empty] == 0).all()
    expected = sink.detach().view(1, nheads, 1).expand(batch, nheads, empty)
    assert torch.equal(lse[:, :, :empty], expected)
    dout = torch.randn_like(out)
    (d_sink,) = torch.autograd.grad(out, sink, dout)
    (d_sink_kept,) = torch.autograd.grad(
        flash_attn_func(q[:, empty:], k, v, causal=True, learnable_sink=sink), sink, dout[:, empty:]
    )
    # On CUDA the two calls may tile the kept rows differently (bf16 outputs).
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(d_sink, d_sink_kept, **tol)


@pytest.mark.parametrize("device", DEVICES)
def test_sink_only_rescales(device):
    """With a sink, out = out_without * (1 - p_sink) row by row, and the lse is
    logaddexp(lse_without, sink)."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v = (rand(2, 31, 4, 64, device=device, dtype=dtype) for _ in range(3))
    sink = random_sink(4, device)
    out0, lse0, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    out1, lse1, _ = flash_attn_func(
        q, k, v, causal=True, return_attn_probs=True, learnable_sink=sink
    )
    lse_expected = torch.logaddexp(lse0.double(), sink.double().view(1, -1, 1))
    torch.testing.assert_close(lse1.double(), lse_expected, atol=2e-5, rtol=2e-5)
    keep = torch.exp(lse0.double() - lse_expected).transpose(1, 2).unsqueeze(-1)
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out1.double(), out0.double() * keep, **tol)


@pytest.mark.parametrize("device", DEVICES)
def test_deterministic_d_sink_is_bitwise_reproducible(device):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v, sink, dout, kwargs, _ = fixed_length_run(
        device, dtype, 64, dict(seqlens=(300, 300), causal=True, heads=(8, 2))
    )
    results = []
    for _ in range(3):
        out = flash_attn_func(q, k, v, deterministic=True, learnable_sink=sink, **kwargs)
        results.append(torch.autograd.grad(out, (q, k, v, sink), dout))
    for again in results[1:]:
        for a, b in zip(results[0], again):
            assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_packed_variants(device):
    dtype = torch.float32 if device == "cpu" else torch.float16
    batch, seqlen, nheads, d = 2, 19, 4, 32
    qkv = rand(batch, seqlen, 3, nheads, d, device=device, dtype=dtype, requires_grad=True)
    sink = random_sink(nheads, device, requires_grad=True)
    q, k, v = qkv.unbind(2)
    # deterministic: the gradients of two calls are compared bitwise.
    expected = flash_attn_func(q, k, v, causal=True, deterministic=True, learnable_sink=sink)
    got = flash_attn_qkvpacked_func(qkv, causal=True, deterministic=True, learnable_sink=sink)
    assert torch.equal(got, expected)
    got_kv = flash_attn_kvpacked_func(q, qkv[:, :, 1:], causal=True, learnable_sink=sink)
    assert torch.equal(got_kv, expected)
    dout = torch.randn_like(got)
    g1 = torch.autograd.grad(got, (qkv, sink), dout)
    g2 = torch.autograd.grad(expected, (qkv, sink), dout)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)

    cu = torch.tensor([0, 7, 7, 19, 38], dtype=torch.int32, device=device)
    packed = rand(38, 3, nheads, d, device=device, dtype=dtype, requires_grad=True)
    expected = flash_attn_varlen_func(*packed.unbind(1), cu, cu, 19, 19, learnable_sink=sink)
    got = flash_attn_varlen_qkvpacked_func(packed, cu, 19, learnable_sink=sink)
    assert torch.equal(got, expected)
    got_kv = flash_attn_varlen_kvpacked_func(
        packed[:, 0], packed[:, 1:], cu, cu, 19, 19, learnable_sink=sink
    )
    assert torch.equal(got_kv, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_sink_without_grad_and_no_grad_mode(device):
    """A sink that needs no gradient leaves d_sink out; under no_grad the
    direct op path gives the same result as the autograd.Function."""
    dtype = torch.float32 if device == "cpu" else torch.float16
    q, k, v = (rand(1, 21, 2, 32, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    sink = random_sink(2, device)
    out = flash_attn_func(q, k, v, learnable_sink=sink)
    with torch.no_grad():
        assert torch.equal(flash_attn_func(q, k, v, learnable_sink=sink), out.detach())
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(g is not None for g in grads)
    # Only the sink requires grad: the graph is recorded, dq / dk / dv are not asked for.
    qd, kd, vd = (t.detach() for t in (q, k, v))
    sink_g = sink.clone().requires_grad_()
    out = flash_attn_func(qd, kd, vd, learnable_sink=sink_g)
    assert out.requires_grad
    (d_sink,) = torch.autograd.grad(out.sum(), sink_g)
    assert d_sink.shape == (2,) and torch.isfinite(d_sink).all()


def test_dropout_cpu():
    """Dropout drops real keys only: the same keep mask as without a sink, the
    same S_dmask numerators, and the probabilities they give normalised by
    the lse that includes the sink; forward and backward match the reference
    with that keep mask."""
    batch, seqlen_q, seqlen_k, nheads, d, p = 2, 37, 45, 4, 32, 0.17
    q, k, v = (
        rand(batch, s, nheads, d, device="cpu", dtype=torch.float32, requires_grad=True)
        for s in (seqlen_q, seqlen_k, seqlen_k)
    )
    sink = random_sink(nheads, "cpu", requires_grad=True)
    scale = d**-0.5
    args = (
        q.detach(),
        k.detach(),
        v.detach(),
        None,
        p,
        scale,
        True,
        -1,
        -1,
        0.0,
        True,
        1234,
        5,
        None,
    )
    out_plain, lse_plain, probs_plain, _ = ops.fwd(*args)
    out, lse, probs, _ = ops.fwd(*args, learnable_sink=sink.detach())
    assert torch.equal(probs, probs_plain)
    keep = reference.dropout_keep_mask_batch(1234, 5, batch, nheads, seqlen_q, seqlen_k, p)
    scores = s_dmask.final_scores(
        q.detach(),
        k.detach(),
        softmax_scale=scale,
        window=reference.normalize_window(True, -1, -1, seqlen_k),
    )
    block_n = flash_attn_cuda._get_block_size_n("cpu", d, True, True)
    visible = torch.isfinite(scores)
    assert torch.equal(~torch.signbit(probs)[visible], keep[visible])
    out_ref, lse_ref = attention_ref(
        q.detach(),
        k.detach(),
        v.detach(),
        causal=True,
        dropout_p=p,
        keep_mask=keep,
        learnable_sink=sink.detach(),
    )
    torch.testing.assert_close(out.double(), out_ref, **FP32_TOL)
    torch.testing.assert_close(lse.double(), lse_ref, **FP32_TOL)
    factor = torch.exp(s_dmask.block_running_max(scores, block_n) - lse.double()[..., None])
    recovered = (probs.abs().double() * factor).masked_fill(~visible, 0.0)
    expected = torch.exp(scores - lse_ref[..., None]).masked_fill(~visible, 0.0)
    torch.testing.assert_close(recovered, expected, atol=1e-6, rtol=1e-5)

    # The public function, whose seed is drawn inside: the keep mask is read
    # back from S_dmask's signs.
    out, lse, probs = flash_attn_func(
        q, k, v, dropout_p=p, causal=True, return_attn_probs=True, learnable_sink=sink
    )
    keep = ~torch.signbit(probs)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, sink), dout)
    inputs = [t.detach().double().requires_grad_() for t in (q, k, v, sink)]
    out_ref, _ = attention_ref(
        *inputs[:3], causal=True, dropout_p=p, keep_mask=keep, learnable_sink=inputs[3]
    )
    grads_ref = torch.autograd.grad(out_ref, inputs, dout.double())
    torch.testing.assert_close(out.double(), out_ref, **FP32_TOL)
    for name, ours, exact in zip(("dq", "dk", "dv", "d_sink"), grads, grads_ref):
        torch.testing.assert_close(ours.double(), exact, msg=name, **FP32_GRAD_TOL)


# --------------------------------------------------------------------- varlen


VARLEN_CASES = {
    "plain": dict(lens_q=[5, 17, 1], lens_k=[9, 17, 30]),
    "causal_empty_sequence": dict(lens_q=[12, 0, 33], lens_k=[7, 4, 33], causal=True),
    "local_softcap_gqa": dict(
        lens_q=[40, 3], lens_k=[40, 64], window=(6, 2), softcap=4.0, heads=(6, 2)
    ),
    "alibi_causal": dict(lens_q=[20, 130], lens_k=[25, 128], causal=True, alibi=True),
}


def cu_of(lengths, device, start=0):
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return (cu + start).to(device)


@pytest.mark.parametrize("device,dtype,head_dim", DEVICE_DTYPES)
@pytest.mark.parametrize("case", sorted(VARLEN_CASES))
def test_varlen_matches_reference(device, dtype, head_dim, case):
    c = VARLEN_CASES[case]
    nheads, nheads_k = c.get("heads", (4, 2))
    cu_q, cu_k = cu_of(c["lens_q"], device), cu_of(c["lens_k"], device)
    total_q, total_k = sum(c["lens_q"]), sum(c["lens_k"])
    q = rand(total_q, nheads, head_dim, device=device, dtype=dtype, requires_grad=True)
    k = rand(total_k, nheads_k, head_dim, device=device, dtype=dtype, requires_grad=True)
    v = rand(total_k, nheads_k, head_dim, device=device, dtype=dtype, requires_grad=True)
    alibi = torch.rand(len(c["lens_q"]), nheads, device=device) if c.get("alibi") else None
    sink = random_sink(nheads, device, requires_grad=True)
    kwargs = dict(
        causal=c.get("causal", False),
        window_size=c.get("window", (-1, -1)),
        softcap=c.get("softcap", 0.0),
        alibi_slopes=alibi,
    )
    max_q, max_k = max(c["lens_q"]), max(c["lens_k"])
    out, lse, _ = flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max_q, max_k, return_attn_probs=True, learnable_sink=sink, **kwargs
    )
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, sink), dout)

    def ref(compute_dtype):
        inputs = [t.detach().to(compute_dtype).requires_grad_() for t in (q, k, v, sink)]
        o, lse_ = varlen_attention_ref(
            *inputs[:3],
            cu_q.cpu(),
            cu_k.cpu(),
            max_k,
            compute_dtype=compute_dtype,
            learnable_sink=inputs[3],
            **kwargs,
        )
        return o, lse_, torch.autograd.grad(o, inputs, dout.to(compute_dtype))

    out_ref, lse_ref, grads_ref = ref(torch.float64)
    out_same, lse_same, grads_same = ref(dtype)
    check_close(out, out_ref, out_same, "out")
    check_lse(lse, lse_ref, lse_same)
    for name, ours, exact, same in zip(("dq", "dk", "dv", "d_sink"), grads, grads_ref, grads_same):
        check_close(ours, exact, same, name, grad=True)


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_rows_outside_every_sequence(device):
    """cu_seqlens_q need not cover q: the rows outside every sequence add
    nothing to d_sink, whatever their lse and output hold."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    nheads = 3
    cu_q = torch.tensor([2, 9, 9, 20], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 11, 16, 30], dtype=torch.int32, device=device)
    q = rand(24, nheads, 64, device=device, dtype=dtype)
    k, v = (rand(30, nheads, 64, device=device, dtype=dtype) for _ in range(2))
    sink = random_sink(nheads, device)
    out, lse, _ = flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, 11, 14, causal=True, return_attn_probs=True, learnable_sink=sink
    )
    dout = torch.randn_like(out)
    d = (dout.float() * out.float()).sum(-1).t()
    # Unused rows with any content: garbage (NaN) must not reach d_sink.
    lse_garbage, d_garbage = lse.clone(), d.clone()
    for rows in (slice(0, 2), slice(20, 24)):
        lse_garbage[:, rows] = float("nan")
        d_garbage[:, rows] = float("nan")
    got = ops.sink_grad(lse_garbage, d_garbage, sink, cu_q)
    used = slice(2, 20)
    expected = -(
        torch.exp(sink.double()[:, None] - lse[:, used].double()) * d[:, used].double()
    ).sum(1)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ KV cache


def kvcache_reference(
    q, k_cache, v_cache, cache_seqlens, sink, *, causal, window, softcap, alibi, compute_dtype
):
    """Attention over each sequence's cache rows [0, cache_seqlens[b]) (the
    caches after the call's append), the window normalised against the
    capacity as fwd_kvcache does."""
    capacity = k_cache.shape[1]
    left, right = reference.normalize_window(causal, window[0], window[1], capacity)
    outs, lses = [], []
    for b in range(q.shape[0]):
        n = int(cache_seqlens[b])
        o, lse = attention_ref(
            q[b : b + 1],
            k_cache[b : b + 1, :n],
            v_cache[b : b + 1, :n],
            causal=False,
            window_size=(left, right),
            softcap=softcap,
            alibi_slopes=None if alibi is None else alibi[b : b + 1],
            compute_dtype=compute_dtype,
            normalize=False,
            learnable_sink=sink,
        )
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


KVCACHE_CASES = {
    "decode": dict(seqlen_q=1),
    "decode_gqa_append": dict(seqlen_q=1, append=1, heads=(8, 1)),
    "prefill_causal_append": dict(seqlen_q=6, append=6, causal=True),
    "local_softcap_alibi": dict(seqlen_q=3, window=(10, 0), softcap=6.0, alibi=True),
}


def kvcache_case(device, dtype, head_dim, case, page_size=None, num_splits=0):
    nheads, nheads_k = case.get("heads", (4, 2))
    batch, capacity = 3, 96
    seqlen_q, append = case["seqlen_q"], case.get("append", 0)
    q = rand(batch, seqlen_q, nheads, head_dim, device=device, dtype=dtype)
    k_cache = rand(batch, capacity, nheads_k, head_dim, device=device, dtype=dtype)
    v_cache = rand(batch, capacity, nheads_k, head_dim, device=device, dtype=dtype)
    seqlens = torch.tensor([0, 37, capacity - append], dtype=torch.int32)
    if not case.get("causal") and case.get("window", (-1, -1)) == (-1, -1):
        seqlens[0] = 5  # (a row that sees no key is covered below)
    k_new = v_new = None
    if append:
        k_new = rand(batch, append, nheads_k, head_dim, device=device, dtype=dtype)
        v_new = rand(batch, append, nheads_k, head_dim, device=device, dtype=dtype)
    alibi = torch.rand(batch, nheads, device=device) if case.get("alibi") else None
    sink = random_sink(nheads, device)
    kwargs = dict(
        causal=case.get("causal", False),
        window_size=case.get("window", (-1, -1)),
        softcap=case.get("softcap", 0.0),
        alibi_slopes=alibi,
        num_splits=num_splits,
    )
    k_call, v_call, table = k_cache.clone(), v_cache.clone(), None
    if page_size is not None:
        pages = capacity // page_size
        order = torch.randperm(batch * pages + 2, device=device)[: batch * pages]
        k_paged = rand(batch * pages + 2, page_size, nheads_k, head_dim, device=device, dtype=dtype)
        v_paged = torch.randn_like(k_paged)
        k_paged[order] = k_cache.reshape(-1, page_size, nheads_k, head_dim)
        v_paged[order] = v_cache.reshape(-1, page_size, nheads_k, head_dim)
        k_call, v_call = k_paged, v_paged
        table = order.view(batch, pages).to(torch.int32)
    out, lse = flash_attn_with_kvcache(
        q,
        k_call,
        v_call,
        k_new,
        v_new,
        cache_seqlens=seqlens.to(device),
        block_table=table,
        return_softmax_lse=True,
        learnable_sink=sink,
        **kwargs,
    )
    if table is not None:
        k_call = k_call[table.long()].reshape(batch, capacity, nheads_k, head_dim)
        v_call = v_call[table.long()].reshape(batch, capacity, nheads_k, head_dim)
    used = seqlens + append
    ref_kwargs = dict(
        causal=kwargs["causal"],
        window=kwargs["window_size"],
        softcap=kwargs["softcap"],
        alibi=alibi,
    )
    out_ref, lse_ref = kvcache_reference(
        q, k_call, v_call, used, sink, **ref_kwargs, compute_dtype=torch.float64
    )
    out_same, lse_same = kvcache_reference(
        q, k_call, v_call, used, sink, **ref_kwargs, compute_dtype=dtype
    )
    check_close(out, out_ref, out_same, "out")
    check_lse(lse, lse_ref, lse_same)


@pytest.mark.parametrize("case", sorted(KVCACHE_CASES))
@pytest.mark.parametrize("page_size", [None, 16])
def test_kvcache_cpu(case, page_size):
    kvcache_case("cpu", torch.float32, 32, KVCACHE_CASES[case], page_size)


@CUDA
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("case", sorted(KVCACHE_CASES))
@pytest.mark.parametrize("page_size", [None, 16])
def test_kvcache_cuda(dtype, head_dim, num_splits, case, page_size):
    kvcache_case("cuda", dtype, head_dim, KVCACHE_CASES[case], page_size, num_splits)


@pytest.mark.parametrize("device", DEVICES)
def test_kvcache_row_without_keys(device):
    dtype = torch.float32 if device == "cpu" else torch.float16
    q = rand(2, 1, 4, 64, device=device, dtype=dtype)
    k_cache, v_cache = (rand(2, 32, 2, 64, device=device, dtype=dtype) for _ in range(2))
    sink = random_sink(4, device)
    seqlens = torch.tensor([0, 9], dtype=torch.int32, device=device)
    out, lse = flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=seqlens, return_softmax_lse=True, learnable_sink=sink
    )
    assert (out[0] == 0).all()
    assert torch.equal(lse[0, :, 0], sink)


# ------------------------------------------------------ CUDA: more head dims


@CUDA
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("case", ["causal_sq_gt_sk", "gqa_causal_alibi", "softcap_alibi"])
def test_cuda_head_dims(dtype, head_dim, case):
    test_fixed_length_matches_reference("cuda", dtype, head_dim, case)


@CUDA
@pytest.mark.parametrize("kernel", ["sm80", "sm90"])
def test_cuda_both_forward_kernels(kernel, monkeypatch):
    if kernel == "sm90" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper forward kernel runs on sm90 GPUs only")
    monkeypatch.setenv("FLASH_ATTN_FWD_KERNEL", kernel)
    for case in ("plain", "causal_sq_gt_sk", "local"):
        test_fixed_length_matches_reference("cuda", torch.bfloat16, 128, case)


# ------------------------------------------------------------------- sink_grad


@pytest.mark.parametrize("device", DEVICES)
def test_sink_grad_op(device):
    lse = torch.randn(2, 3, 11, device=device) + 2.0
    lse[0, 1, 4] = float("inf")  # a row without keys and without a sink
    d = torch.randn(2, 3, 11, device=device)
    sink = torch.randn(3, device=device)
    got = ops.sink_grad(lse, d, sink)
    expected = -(torch.exp(sink.double().view(1, 3, 1) - lse.double()) * d.double()).sum((0, 2))
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    assert got.dtype == torch.float32 and got.shape == (3,)
    # Varlen layout (nheads, total_q), every row used.
    cu = torch.tensor([0, 4, 11], dtype=torch.int32, device=device)
    got = ops.sink_grad(lse[0], d[0], sink, cu)
    expected = -(torch.exp(sink.double()[:, None] - lse[0].double()) * d[0].double()).sum(1)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------- opcheck


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_forwards(device):
    dtype = torch.bfloat16
    sink = random_sink(4, device)
    q = rand(2, 17, 4, 32, device=device, dtype=dtype)
    k, v = (rand(2, 23, 2, 32, device=device, dtype=dtype) for _ in range(2))
    fwd_args = (q, k, v, None, 0.0, 32**-0.5, True, -1, -1, 0.0, False, 0, 0, None)
    opcheck(ops.fwd.default, fwd_args, {"learnable_sink": sink})
    opcheck(ops.fwd_out.default, fwd_args, {"out": torch.empty_like(q), "learnable_sink": sink})

    cu_q = torch.tensor([0, 5, 17], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 9, 23], dtype=torch.int32, device=device)
    vq = rand(17, 4, 32, device=device, dtype=dtype)
    vk, vv = (rand(23, 2, 32, device=device, dtype=dtype) for _ in range(2))
    varlen_args = (
        vq,
        vk,
        vv,
        cu_q,
        cu_k,
        None,
        None,
        12,
        14,
        0.0,
        32**-0.5,
        True,
        -1,
        -1,
        0.0,
        False,
        0,
        0,
        None,
    )
    opcheck(ops.varlen_fwd.default, varlen_args, {"learnable_sink": sink})
    opcheck(
        ops.varlen_fwd_out.default,
        varlen_args,
        {"out": torch.empty_like(vq), "learnable_sink": sink},
    )

    kq = rand(2, 1, 4, 32, device=device, dtype=dtype)
    k_cache, v_cache = (rand(2, 40, 2, 32, device=device, dtype=dtype) for _ in range(2))
    seqlens = torch.tensor([3, 40], dtype=torch.int32, device=device)
    kv_args = (
        kq,
        k_cache,
        v_cache,
        None,
        None,
        seqlens,
        None,
        None,
        None,
        None,
        None,
        None,
        32**-0.5,
        True,
        -1,
        -1,
        0.0,
        True,
        0,
    )
    opcheck(ops.fwd_kvcache.default, kv_args, {"learnable_sink": sink})
    opcheck(
        ops.fwd_kvcache_out.default, kv_args, {"out": torch.empty_like(kq), "learnable_sink": sink}
    )


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_sink_grad(device):
    lse = torch.randn(2, 4, 9, device=device)
    d = torch.randn(2, 4, 9, device=device)
    sink = torch.randn(4, device=device)
    opcheck(ops.sink_grad.default, (lse, d, sink), {})
    cu = torch.tensor([1, 5, 8], dtype=torch.int32, device=device)
    opcheck(ops.sink_grad.default, (lse[0], d[0], sink, cu), {})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("varlen", [False, True])
def test_backward_ops_hand_out_d(device, varlen):
    """softmax_d= of bwd / varlen_bwd receives D = rowsum(dO * O) in the lse's
    layout (what sink_grad reads), and the gradients do not change."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    batch, seqlen, nheads, head_dim = 2, 37, 4, 64
    q, k, v, dout = (
        torch.randn(batch, seqlen, nheads, head_dim, device=device, dtype=dtype) for _ in range(4)
    )
    args = (0.0, head_dim**-0.5, True, -1, 0, 0.0)
    if varlen:
        q, k, v, dout = (t.reshape(batch * seqlen, nheads, head_dim) for t in (q, k, v, dout))
        cu = torch.tensor([0, 30, batch * seqlen], dtype=torch.int32, device=device)
        out, lse, _, rng = ops.varlen_fwd(
            q, k, v, cu, cu, None, None, 44, 44, *args[:6], False, 0, 0, None
        )
        bwd_args = (dout, q, k, v, out, lse, cu, cu, None, 44, 44, *args, False, rng)
        bwd = ops.varlen_bwd
        expected = (dout.float() * out.float()).sum(-1).t()
    else:
        out, lse, _, rng = ops.fwd(q, k, v, None, *args, False, 0, 0, None)
        bwd_args = (dout, q, k, v, out, lse, None, *args, False, rng)
        bwd = ops.bwd
        expected = (dout.float() * out.float()).sum(-1).transpose(1, 2)
    plain = bwd(*bwd_args)
    softmax_d = torch.full_like(lse, float("nan"))
    with_d = bwd(*bwd_args, softmax_d=softmax_d)
    for a, b in zip(plain, with_d):
        assert torch.equal(a, b)
    torch.testing.assert_close(softmax_d, expected, atol=1e-3, rtol=1e-3)
    opcheck(bwd.default, bwd_args, dict(softmax_d=torch.empty_like(lse)))
    with pytest.raises(RuntimeError, match="softmax_d must have the shape of softmax_lse"):
        bwd(*bwd_args, softmax_d=torch.empty(3, device=device))


# ------------------------------------------------------------- torch.compile


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_with_backward(device):
    torch._dynamo.reset()
    dtype = torch.bfloat16

    def attention(q, k, v, sink):
        return flash_attn_func(q, k, v, causal=True, deterministic=True, learnable_sink=sink)

    def inputs():
        torch.manual_seed(0)
        q = rand(2, 19, 4, 32, device=device, dtype=dtype, requires_grad=True)
        k, v = (
            rand(2, 19, 2, 32, device=device, dtype=dtype, requires_grad=True) for _ in range(2)
        )
        return q, k, v, random_sink(4, device, requires_grad=True)

    assert_compiled_matches_eager(attention, inputs)


# -------------------------------------------------------------- bad arguments


BAD_SINKS = {
    "dtype": (
        lambda n, dev: torch.zeros(n, dtype=torch.bfloat16, device=dev),
        "learnable_sink must have dtype float32",
    ),
    "kv_heads": (
        lambda n, dev: torch.zeros(2, device=dev),
        r"learnable_sink must have shape \(nheads,\) = \(4,\)",
    ),
    "2d": (
        lambda n, dev: torch.zeros(1, n, device=dev),
        r"learnable_sink must have shape \(nheads,\) = \(4,\)",
    ),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", sorted(BAD_SINKS))
def test_bad_learnable_sink(device, bad):
    make, message = BAD_SINKS[bad]
    sink = make(4, device)
    dtype = torch.float16
    q = rand(2, 17, 4, 32, device=device, dtype=dtype)
    k, v = (rand(2, 23, 2, 32, device=device, dtype=dtype) for _ in range(2))
    with pytest.raises(RuntimeError, match="flash_attn: " + message):
        flash_attn_func(q, k, v, learnable_sink=sink)
    with pytest.raises(RuntimeError, match="flash_attn: " + message):
        ops.fwd(q, k, v, None, 0.0, 1.0, False, -1, -1, 0.0, False, 0, 0, None, learnable_sink=sink)
    cu = torch.tensor([0, 17, 34], dtype=torch.int32, device=device)
    with pytest.raises(RuntimeError, match="flash_attn: " + message):
        flash_attn_varlen_func(
            q.flatten(0, 1),
            k.flatten(0, 1)[:34],
            v.flatten(0, 1)[:34],
            cu,
            cu,
            17,
            17,
            learnable_sink=sink,
        )
    with pytest.raises(RuntimeError, match="fwd_kvcache: " + message):
        flash_attn_with_kvcache(q, k, v, learnable_sink=sink)


@CUDA
def test_learnable_sink_on_another_device():
    q, k, v = (rand(1, 9, 4, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    sink = torch.zeros(4)
    with pytest.raises(ValueError, match="learnable_sink must be on the same device as q"):
        flash_attn_func(q, k, v, learnable_sink=sink)
    with pytest.raises(RuntimeError, match="learnable_sink must be on the same device as q"):
        ops.fwd(q, k, v, None, 0.0, 1.0, False, -1, -1, 0.0, False, 0, 0, None, learnable_sink=sink)
    with pytest.raises(RuntimeError, match="learnable_sink must be on the same device as q"):
        ops.fwd_kvcache(
            q,
            k,
            v,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            1.0,
            False,
            -1,
            -1,
            0.0,
            True,
            0,
            learnable_sink=sink,
        )


def test_out_with_sink_requiring_grad_is_refused():
    q, k, v = (rand(1, 9, 2, 32, device="cpu", dtype=torch.float32) for _ in range(3))
    sink = torch.zeros(2, requires_grad=True)
    with pytest.raises(RuntimeError, match="out= does not support autograd"):
        flash_attn_func(q, k, v, learnable_sink=sink, out=torch.empty_like(q))
    with torch.no_grad():
        out = flash_attn_func(q, k, v, learnable_sink=sink, out=torch.empty_like(q))
    assert torch.equal(out, flash_attn_func(q, k, v, learnable_sink=sink.detach()))


def test_math_constants():
    # The sink formula at one row, by hand: one key with score s, value 1.
    s, sink = 0.7, -0.2
    q = torch.full((1, 1, 1, 8), 1.0)
    k = torch.zeros(1, 1, 1, 8)
    k[..., 0] = s * math.sqrt(8)
    v = torch.ones(1, 1, 1, 8)
    out, lse, _ = flash_attn_func(
        q, k, v, return_attn_probs=True, learnable_sink=torch.tensor([sink])
    )
    p = math.exp(s) / (math.exp(s) + math.exp(sink))
    torch.testing.assert_close(out, torch.full_like(out, p))
    torch.testing.assert_close(lse, torch.full_like(lse, math.log(math.exp(s) + math.exp(sink))))
