"""A value head dim d_v smaller than the query/key head dim d_qk, against the
float64 reference.

q and k have d_qk, v and out have d_v <= d_qk, dv has d_v, and the default
softmax scale is 1/sqrt(d_qk) (docs/architecture.md, "The op contract"). The CPU path runs
the d_qk problem on a zero-padded v (api/head_dims.h), the CUDA kernels read and write
at d_v columns (test_cuda_head_dims_dv.py); every path takes it: fixed-length, varlen
and KV cache, forward and backward. Every case runs on
the CPU path and, with a GPU, on the CUDA kernels (the tests marked cuda are
skipped with a reason without one, and a head dim a reduced build left out is
a skip). Comparisons follow the correctness criterion: fp32 inputs (CPU only)
against float64 with fixed tolerances, fp16 / bf16 within 2x (output) or 3x
(gradients) the error of the same math in the input dtype.
"""

import pytest
import torch
from torch.library import opcheck

from reference import (
    assert_compiled_matches_eager,
    assert_within_criterion,
    attention_ref,
    check_close,
    varlen_attention_ref,
)

from flash_attn_cuda import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

ops = torch.ops.flash_attn

CUDA = pytest.mark.cuda
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
# (device, dtype, d_qk, d_v). (36, 20): head dims the Python layer pads to a
# multiple of 8 first.
DEVICE_DIMS = [
    ("cpu", torch.float32, 40, 24),
    ("cpu", torch.float32, 32, 16),
    ("cpu", torch.float32, 36, 20),
    ("cpu", torch.bfloat16, 40, 24),
    # Head dims past the CUDA kernels' 256 (issue 56), served by the CPU path:
    # Gemma's 512, a d_v below it, and absorbed MLA's 576 / 512.
    ("cpu", torch.float32, 512, 512),
    ("cpu", torch.bfloat16, 512, 256),
    ("cpu", torch.float32, 576, 512),
    pytest.param("cuda", torch.float16, 64, 32, marks=CUDA),
    pytest.param("cuda", torch.bfloat16, 128, 64, marks=CUDA),
    pytest.param("cuda", torch.bfloat16, 192, 128, marks=CUDA),
    pytest.param("cuda", torch.float16, 192, 128, marks=CUDA),
]


def rand(*shape, device, dtype, requires_grad=False):
    return torch.randn(*shape, device=device, dtype=dtype).requires_grad_(requires_grad)


def check(ours, exact, same, name, *, grad=False):
    assert ours.shape == exact.shape, f"{name}: shape {tuple(ours.shape)} != {tuple(exact.shape)}"
    check_close(ours, exact, same, name, grad=grad)


def check_lse(lse, lse_exact, lse_same):
    finite = torch.isfinite(lse_exact)
    assert torch.equal(torch.isfinite(lse), finite)
    if lse_same.dtype == torch.float32:
        torch.testing.assert_close(lse[finite].double(), lse_exact[finite], atol=2e-5, rtol=2e-5)
    else:
        assert_within_criterion(
            lse[finite], lse_exact[finite], lse_same[finite].double(), atol=1e-4, name="lse"
        )


# --------------------------------------------------------------- fixed length


FIXED_CASES = {
    "plain": dict(seqlens=(17, 17)),
    "causal": dict(seqlens=(40, 23), causal=True),  # rows that see no key
    "gqa_causal": dict(seqlens=(129, 129), causal=True, heads=(8, 2)),
    "softcap_alibi_local": dict(seqlens=(33, 47), softcap=5.0, alibi=True, window=(9, 3)),
    "mqa_sink": dict(seqlens=(21, 77), heads=(4, 1), sink=True),
}


def fixed_inputs(device, dtype, d_qk, d_v, case):
    seqlen_q, seqlen_k = case["seqlens"]
    nheads, nheads_k = case.get("heads", (4, 2))
    batch = 2
    q = rand(batch, seqlen_q, nheads, d_qk, device=device, dtype=dtype, requires_grad=True)
    k = rand(batch, seqlen_k, nheads_k, d_qk, device=device, dtype=dtype, requires_grad=True)
    v = rand(batch, seqlen_k, nheads_k, d_v, device=device, dtype=dtype, requires_grad=True)
    dout = torch.randn(batch, seqlen_q, nheads, d_v, device=device, dtype=dtype)
    kwargs = dict(
        causal=case.get("causal", False),
        window_size=case.get("window", (-1, -1)),
        softcap=case.get("softcap", 0.0),
        alibi_slopes=torch.rand(batch, nheads, device=device) if case.get("alibi") else None,
    )
    sink = None
    if case.get("sink"):
        sink = (torch.randn(nheads) * 2).to(device)
    return q, k, v, dout, kwargs, sink


def reference_grads(fn, inputs, dout, compute_dtype):
    cast = [t.detach().to(compute_dtype).requires_grad_() for t in inputs]
    out, lse = fn(*cast)
    grads = torch.autograd.grad(out, cast, dout.to(compute_dtype))
    return out, lse, grads


def check_against_reference(ref, inputs, dout, dtype, out, lse, grads):
    """out, lse and (dq, dk, dv) against ref(q, k, v, compute_dtype) in float64
    and in the inputs' dtype."""
    exact = reference_grads(lambda *t: ref(*t, torch.float64), inputs, dout, torch.float64)
    same = reference_grads(lambda *t: ref(*t, dtype), inputs, dout, dtype)
    check(out, exact[0], same[0], "out")
    check_lse(lse, exact[1], same[1])
    for name, ours, e, s in zip(("dq", "dk", "dv"), grads, exact[2], same[2]):
        check(ours, e, s, name, grad=True)


@pytest.mark.parametrize("device,dtype,d_qk,d_v", DEVICE_DIMS)
@pytest.mark.parametrize("case", sorted(FIXED_CASES))
def test_fixed_length_matches_reference(device, dtype, d_qk, d_v, case):
    q, k, v, dout, kwargs, sink = fixed_inputs(device, dtype, d_qk, d_v, FIXED_CASES[case])
    out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True, learnable_sink=sink, **kwargs)
    assert out.shape == q.shape[:-1] + (d_v,)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert dv.shape == v.shape

    def ref(q, k, v, compute_dtype):
        return attention_ref(q, k, v, compute_dtype=compute_dtype, learnable_sink=sink, **kwargs)

    check_against_reference(ref, (q, k, v), dout, dtype, out, lse, (dq, dk, dv))


@pytest.mark.parametrize("device", DEVICES)
def test_out_argument_and_no_grad_path(device):
    """out= and the no-graph path give the autograd path's output."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v, _, kwargs, _ = fixed_inputs(device, dtype, 64, 32, FIXED_CASES["causal"])
    expected = flash_attn_func(q, k, v, **kwargs)
    with torch.no_grad():
        plain = flash_attn_func(q, k, v, **kwargs)
        out = torch.full_like(expected, float("nan"))
        written = flash_attn_func(q, k, v, out=out, **kwargs)
    assert written is out
    assert torch.equal(plain, expected.detach())
    assert torch.equal(out, expected.detach())

    q1 = q.detach()[:, :1]
    k_cache, v_cache = k.detach().clone(), v.detach().clone()
    seqlens = torch.tensor([3, 20], dtype=torch.int32, device=device)
    expected = flash_attn_with_kvcache(q1, k_cache, v_cache, cache_seqlens=seqlens)
    out = torch.full_like(expected, float("nan"))
    written = flash_attn_with_kvcache(q1, k_cache, v_cache, cache_seqlens=seqlens, out=out)
    assert written is out and out.shape == (2, 1, q.shape[2], 32)
    assert torch.equal(out, expected)


# --------------------------------------------------------------------- varlen


VARLEN_CASES = {
    "plain": dict(seqlens_q=(5, 0, 17), seqlens_k=(9, 4, 23)),
    "causal_gqa": dict(seqlens_q=(30, 7, 1), seqlens_k=(30, 19, 40), causal=True, heads=(6, 2)),
    "softcap_local": dict(seqlens_q=(12, 33), seqlens_k=(20, 33), softcap=4.0, window=(6, 2)),
}


def cu_seqlens(lengths, device):
    return torch.tensor(
        [0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device
    )


@pytest.mark.parametrize("device,dtype,d_qk,d_v", DEVICE_DIMS)
@pytest.mark.parametrize("case", sorted(VARLEN_CASES))
def test_varlen_matches_reference(device, dtype, d_qk, d_v, case):
    spec = VARLEN_CASES[case]
    nheads, nheads_k = spec.get("heads", (4, 2))
    cu_q, cu_k = cu_seqlens(spec["seqlens_q"], device), cu_seqlens(spec["seqlens_k"], device)
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
    max_q, max_k = max(spec["seqlens_q"]), max(spec["seqlens_k"])
    q = rand(total_q, nheads, d_qk, device=device, dtype=dtype, requires_grad=True)
    k = rand(total_k, nheads_k, d_qk, device=device, dtype=dtype, requires_grad=True)
    v = rand(total_k, nheads_k, d_v, device=device, dtype=dtype, requires_grad=True)
    dout = torch.randn(total_q, nheads, d_v, device=device, dtype=dtype)
    kwargs = dict(
        causal=spec.get("causal", False),
        window_size=spec.get("window", (-1, -1)),
        softcap=spec.get("softcap", 0.0),
    )
    out, lse, _ = flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max_q, max_k, return_attn_probs=True, **kwargs
    )
    assert out.shape == (total_q, nheads, d_v)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)

    def ref(q, k, v, compute_dtype):
        return varlen_attention_ref(
            q,
            k,
            v,
            cu_q.cpu(),
            cu_k.cpu(),
            max_seqlen_k=max_k,
            compute_dtype=compute_dtype,
            **kwargs,
        )

    check_against_reference(ref, (q, k, v), dout, dtype, out, lse, (dq, dk, dv))


# ------------------------------------------------------------------- KV cache


KVCACHE_CASES = {
    "decode": dict(seqlen_q=1),
    "decode_gqa_append": dict(seqlen_q=1, append=1, heads=(8, 1)),
    "prefill_causal_append": dict(seqlen_q=6, append=6, causal=True),
    "softcap_batch_idx_append": dict(seqlen_q=2, append=3, softcap=6.0, batch_idx=True),
}


@pytest.mark.parametrize("device,dtype,d_qk,d_v", DEVICE_DIMS)
@pytest.mark.parametrize("case", sorted(KVCACHE_CASES))
@pytest.mark.parametrize("page_size", [None, 16])
def test_kvcache_matches_reference(device, dtype, d_qk, d_v, case, page_size):
    spec = KVCACHE_CASES[case]
    if page_size is not None and spec.get("batch_idx"):
        pytest.skip("cache_batch_idx does not go with block_table")
    nheads, nheads_k = spec.get("heads", (4, 2))
    batch, capacity, seqlen_q, append = 3, 96, spec["seqlen_q"], spec.get("append", 0)
    q = rand(batch, seqlen_q, nheads, d_qk, device=device, dtype=dtype)
    # One more cache row than the batch uses: cache_batch_idx picks rows
    # (2, 0, 3) and row 1 must stay as it was.
    rows = batch + 1
    k_cache = rand(rows, capacity, nheads_k, d_qk, device=device, dtype=dtype)
    v_cache = rand(rows, capacity, nheads_k, d_v, device=device, dtype=dtype)
    seqlens = torch.tensor([5, 37, capacity - append], dtype=torch.int32)
    batch_idx = (
        torch.tensor([2, 0, 3], dtype=torch.int32, device=device) if spec.get("batch_idx") else None
    )
    k_new = v_new = None
    if append:
        k_new = rand(batch, append, nheads_k, d_qk, device=device, dtype=dtype)
        v_new = rand(batch, append, nheads_k, d_v, device=device, dtype=dtype)
    kwargs = dict(causal=spec.get("causal", False), softcap=spec.get("softcap", 0.0))

    # The expected caches after the call.
    cache_rows = batch_idx.long().cpu() if batch_idx is not None else torch.arange(batch)
    k_after, v_after = k_cache.clone(), v_cache.clone()
    for b in range(batch):
        n = int(seqlens[b])
        if append:
            k_after[cache_rows[b], n : n + append] = k_new[b]
            v_after[cache_rows[b], n : n + append] = v_new[b]

    table = None
    k_call, v_call = k_cache.clone(), v_cache.clone()
    if page_size is not None:
        pages = capacity // page_size
        order = torch.randperm(rows * pages + 2, device=device)[: rows * pages]
        k_call = rand(rows * pages + 2, page_size, nheads_k, d_qk, device=device, dtype=dtype)
        v_call = rand(rows * pages + 2, page_size, nheads_k, d_v, device=device, dtype=dtype)
        k_call[order] = k_cache.reshape(-1, page_size, nheads_k, d_qk)
        v_call[order] = v_cache.reshape(-1, page_size, nheads_k, d_v)
        table = order.view(rows, pages)[:batch].to(torch.int32)
        untouched = (v_call.clone(), order.view(rows, pages)[batch:])
    out, lse = flash_attn_with_kvcache(
        q,
        k_call,
        v_call,
        k_new,
        v_new,
        cache_seqlens=seqlens.to(device),
        block_table=table,
        cache_batch_idx=batch_idx,
        return_softmax_lse=True,
        **kwargs,
    )
    assert out.shape == (batch, seqlen_q, nheads, d_v)
    if table is not None:
        # The pages of the unused cache row and the two spare pages keep their values.
        spare = torch.ones(v_call.shape[0], dtype=torch.bool, device=device)
        spare[table.long().flatten()] = False
        assert torch.equal(v_call[spare], untouched[0][spare])
        k_call = k_call[order.view(rows, pages)].reshape(rows, capacity, nheads_k, d_qk)
        v_call = v_call[order.view(rows, pages)].reshape(rows, capacity, nheads_k, d_v)
    assert v_call.shape[-1] == d_v
    assert torch.equal(k_call, k_after)
    assert torch.equal(v_call, v_after)

    used = seqlens + append

    def ref(compute_dtype):
        outs, lses = [], []
        for b in range(batch):
            r, n = int(cache_rows[b]), int(used[b])
            o, lse_b = attention_ref(
                q[b : b + 1],
                k_after[r : r + 1, :n],
                v_after[r : r + 1, :n],
                compute_dtype=compute_dtype,
                **kwargs,
            )
            outs.append(o)
            lses.append(lse_b)
        return torch.cat(outs), torch.cat(lses)

    out_exact, lse_exact = ref(torch.float64)
    out_same, lse_same = ref(dtype)
    check(out, out_exact, out_same, "out")
    check_lse(lse, lse_exact, lse_same)


# ------------------------------------------------------------------- opcheck


def _dtype_dims(device):
    return (torch.float32, 40, 24) if device == "cpu" else (torch.bfloat16, 64, 32)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_fixed_length(device):
    dtype, d_qk, d_v = _dtype_dims(device)
    q = rand(2, 17, 4, d_qk, device=device, dtype=dtype)
    k = rand(2, 23, 2, d_qk, device=device, dtype=dtype)
    v = rand(2, 23, 2, d_v, device=device, dtype=dtype)
    args = (0.0, d_qk**-0.5, True, -1, 0, 0.0)
    fwd_args = (q, k, v, None, *args, False, 0, 0, None)
    opcheck(ops.fwd.default, fwd_args)
    opcheck(ops.fwd_out.default, fwd_args, {"out": q.new_empty(2, 17, 4, d_v)})
    out, lse, _, rng = ops.fwd(*fwd_args)
    assert out.shape == (2, 17, 4, d_v) and out.is_contiguous()
    dout = torch.randn_like(out)
    bwd_args = (dout, q, k, v, out, lse, None, *args, False, rng)
    opcheck(ops.bwd.default, bwd_args)
    opcheck(ops.bwd.default, bwd_args, {"softmax_d": torch.empty_like(lse)})
    dq, dk, dv = ops.bwd(*bwd_args)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_varlen(device):
    dtype, d_qk, d_v = _dtype_dims(device)
    cu_q = torch.tensor([0, 5, 17], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 9, 23], dtype=torch.int32, device=device)
    q = rand(17, 4, d_qk, device=device, dtype=dtype)
    k = rand(23, 2, d_qk, device=device, dtype=dtype)
    v = rand(23, 2, d_v, device=device, dtype=dtype)
    args = (0.0, d_qk**-0.5, True, -1, 0, 0.0)
    fwd_args = (q, k, v, cu_q, cu_k, None, None, 12, 14, *args, False, 0, 0, None)
    opcheck(ops.varlen_fwd.default, fwd_args)
    opcheck(ops.varlen_fwd_out.default, fwd_args, {"out": q.new_empty(17, 4, d_v)})
    out, lse, _, rng = ops.varlen_fwd(*fwd_args)
    assert out.shape == (17, 4, d_v)
    bwd_args = (
        torch.randn_like(out),
        q,
        k,
        v,
        out,
        lse,
        cu_q,
        cu_k,
        None,
        12,
        14,
        *args,
        False,
        rng,
    )
    opcheck(ops.varlen_bwd.default, bwd_args)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_kvcache(device):
    dtype, d_qk, d_v = _dtype_dims(device)
    q = rand(2, 1, 4, d_qk, device=device, dtype=dtype)
    k_cache = rand(2, 40, 2, d_qk, device=device, dtype=dtype)
    v_cache = rand(2, 40, 2, d_v, device=device, dtype=dtype)
    k_new = rand(2, 1, 2, d_qk, device=device, dtype=dtype)
    v_new = rand(2, 1, 2, d_v, device=device, dtype=dtype)
    seqlens = torch.tensor([3, 39], dtype=torch.int32, device=device)
    kv_args = (
        q,
        k_cache,
        v_cache,
        k_new,
        v_new,
        seqlens,
        None,
        None,
        None,
        None,
        None,
        None,
        d_qk**-0.5,
        True,
        -1,
        -1,
        0.0,
        True,
        0,
    )
    opcheck(ops.fwd_kvcache.default, kv_args)
    opcheck(ops.fwd_kvcache_out.default, kv_args, {"out": q.new_empty(2, 1, 4, d_v)})


# ------------------------------------------------------------- torch.compile


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_with_backward(device):
    torch._dynamo.reset()
    dtype, d_qk, d_v = _dtype_dims(device)

    def attention(q, k, v):
        return flash_attn_func(q, k, v, causal=True, deterministic=True)

    def inputs():
        torch.manual_seed(0)
        q = rand(2, 19, 4, d_qk, device=device, dtype=dtype, requires_grad=True)
        k = rand(2, 19, 2, d_qk, device=device, dtype=dtype, requires_grad=True)
        v = rand(2, 19, 2, d_v, device=device, dtype=dtype, requires_grad=True)
        return q, k, v

    out = assert_compiled_matches_eager(attention, inputs)
    assert out.shape == (2, 19, 4, d_v)


# -------------------------------------------------------------- bad arguments


@pytest.mark.parametrize("device", DEVICES)
def test_d_v_larger_than_d_qk_is_refused(device):
    dtype = torch.float16
    q = rand(2, 5, 4, 32, device=device, dtype=dtype)
    k = rand(2, 7, 2, 32, device=device, dtype=dtype)
    v = rand(2, 7, 2, 48, device=device, dtype=dtype)
    op_message = r"d_v = 48\) must not exceed the head dim of q and k \(d_qk = 32\)"
    with pytest.raises(RuntimeError, match=op_message):
        ops.fwd(q, k, v, None, 0.0, 1.0, False, -1, -1, 0.0, False, 0, 0, None)
    cu = torch.tensor([0, 5, 10], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 7, 14], dtype=torch.int32, device=device)
    with pytest.raises(RuntimeError, match=op_message):
        ops.varlen_fwd(
            q.flatten(0, 1),
            k.flatten(0, 1),
            v.flatten(0, 1),
            cu,
            cu_k,
            None,
            None,
            5,
            7,
            0.0,
            1.0,
            False,
            -1,
            -1,
            0.0,
            False,
            0,
            0,
            None,
        )
    with pytest.raises(RuntimeError, match=r"d_v = 48\) must not exceed .*\(d_qk = 32\)"):
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
            False,
            0,
        )
    py_message = r"d_v = 48\) must not exceed the head dim of q and k \(d_qk = 32\)"
    with pytest.raises(ValueError, match=py_message):
        flash_attn_func(q, k, v)
    with pytest.raises(ValueError, match=py_message):
        flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu_k, 5, 7)
    with pytest.raises(ValueError, match=py_message):
        flash_attn_with_kvcache(q, k, v)
    # Padding both to a multiple of 8 would hide a d_v of 22 over a d_qk of 20.
    with pytest.raises(ValueError, match=r"d_v = 22\) must not exceed .*\(d_qk = 20\)"):
        flash_attn_func(q[..., :20], k[..., :20], v[..., :22])


@pytest.mark.parametrize("device", DEVICES)
def test_bad_d_v_shapes(device):
    dtype = torch.float16
    q = rand(2, 5, 4, 32, device=device, dtype=dtype)
    k = rand(2, 7, 2, 32, device=device, dtype=dtype)
    with pytest.raises(RuntimeError, match=r"d_v = 12\) must be a multiple of 8"):
        ops.fwd(
            q,
            k,
            rand(2, 7, 2, 12, device=device, dtype=dtype),
            None,
            0.0,
            1.0,
            False,
            -1,
            -1,
            0.0,
            False,
            0,
            0,
            None,
        )
    with pytest.raises(RuntimeError, match="v must have the shape of k"):
        ops.fwd(
            q,
            k,
            rand(2, 6, 2, 16, device=device, dtype=dtype),
            None,
            0.0,
            1.0,
            False,
            -1,
            -1,
            0.0,
            False,
            0,
            0,
            None,
        )
    v = rand(2, 7, 2, 16, device=device, dtype=dtype)
    out, lse, _, rng = ops.fwd(q, k, v, None, 0.0, 1.0, False, -1, -1, 0.0, False, 0, 0, None)
    with pytest.raises(RuntimeError, match="dout must have the shape of q with the head dim of v"):
        ops.bwd(
            torch.randn_like(q), q, k, v, out, lse, None, 0.0, 1.0, False, -1, -1, 0.0, False, rng
        )
    with pytest.raises(RuntimeError, match=r"out must have shape"):
        ops.fwd_out(
            q, k, v, None, 0.0, 1.0, False, -1, -1, 0.0, False, 0, 0, None, out=torch.empty_like(q)
        )
    with pytest.raises(RuntimeError, match="v must have the head dim of v_cache"):
        ops.fwd_kvcache(
            q,
            k,
            v,
            k[:, :1],
            rand(2, 1, 2, 24, device=device, dtype=dtype),
            torch.tensor([1, 1], dtype=torch.int32, device=device),
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
            False,
            0,
        )


# ------------------------------------------------------ head dims past 256


def latent_cache(latent, page_size):
    """An absorbed-MLA cache of the latent rows (batch, capacity, 1, d_qk):
    the tensor itself, or its rows in pages of page_size through a shuffled
    block table. Returns (k_cache, block_table or None)."""
    if page_size is None:
        return latent, None
    batch, capacity, _, d_qk = latent.shape
    pages = capacity // page_size
    order = torch.randperm(batch * pages, device=latent.device)
    k_cache = torch.empty(
        batch * pages, page_size, 1, d_qk, dtype=latent.dtype, device=latent.device
    )
    k_cache[order] = latent.reshape(-1, page_size, 1, d_qk)
    return k_cache, order.view(batch, pages).to(torch.int32)


def check_against_latent_reference(out, lse, q, latent, seqlens, d_v, causal=False):
    """out and lse of an absorbed-MLA call against float64 attention over each
    entry's first seqlens[b] latent rows, V their first d_v columns (the
    criterion's baseline: the same attention in bfloat16)."""

    def ref(compute_dtype):
        outs, lses = [], []
        for b in range(q.shape[0]):
            n = int(seqlens[b])
            o, lse_b = attention_ref(
                q[b : b + 1],
                latent[b : b + 1, :n],
                latent[b : b + 1, :n, :, :d_v],
                causal=causal,
                compute_dtype=compute_dtype,
            )
            outs.append(o)
            lses.append(lse_b)
        return torch.cat(outs), torch.cat(lses)

    out_exact, lse_exact = ref(torch.float64)
    out_same, lse_same = ref(torch.bfloat16)
    check(out, out_exact, out_same, "out")
    check_lse(lse, lse_exact, lse_same)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seqlen_q", [1, 2])
@pytest.mark.parametrize("page_size", [None, 1, 64])
@pytest.mark.parametrize("num_splits", [0, 1, 4])
def test_absorbed_mla_decode_reads_v_from_the_key_cache(device, seqlen_q, page_size, num_splits):
    """Absorbed MLA decode (issue 56 item 2): 128 query heads of 576 columns
    over one latent head, and v_cache the view k_cache[..., :512] of the same
    rows, paged in FlashMLA's 64-row pages or 1-row pages. On CUDA the
    split-KV kernel of compiled head dim 576 (value dim 512) serves it."""
    if device == "cpu" and num_splits:
        pytest.skip("the CPU path does not split the keys")
    batch, capacity, nheads, d_qk, d_v = 2, 128, 128, 576, 512
    q = rand(batch, seqlen_q, nheads, d_qk, device=device, dtype=torch.bfloat16)
    latent = rand(batch, capacity, 1, d_qk, device=device, dtype=torch.bfloat16)
    seqlens = torch.tensor([77, capacity], dtype=torch.int32, device=device)
    k_cache, table = latent_cache(latent, page_size)
    v_cache = k_cache[..., :d_v]
    assert v_cache.data_ptr() == k_cache.data_ptr() and not v_cache.is_contiguous()
    out, lse = flash_attn_with_kvcache(
        q,
        k_cache,
        v_cache,
        cache_seqlens=seqlens,
        block_table=table,
        num_splits=num_splits,
        return_softmax_lse=True,
    )
    assert out.shape == (batch, seqlen_q, nheads, d_v)
    check_against_latent_reference(out, lse, q, latent, seqlens, d_v)


@CUDA
@pytest.mark.parametrize("seqlen_q,causal", [(1, False), (2, True)])
@pytest.mark.parametrize("page_size", [None, 1, 64])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("d_v", [512, 256])
def test_shared_latent_cache_matches_a_separate_v(seqlen_q, causal, page_size, num_splits, d_v):
    """With v_cache a view of k_cache the 576 kernel reads V in the K tile
    and loads none (splitkv_reads_v_in_k), its two value halves splitting the
    score product between them (splitkv_splits_scores); given V as a tensor of
    its own with the same values it loads it and each half computes all of S.
    The scores are summed in another order, so the two calls agree to the
    criterion against float64, not bit for bit; both keep lse's meaning."""
    batch, capacity, nheads, d_qk = 3, 192, 128, 576
    q = rand(batch, seqlen_q, nheads, d_qk, device="cuda", dtype=torch.bfloat16)
    latent = rand(batch, capacity, 1, d_qk, device="cuda", dtype=torch.bfloat16)
    seqlens = torch.tensor([1, 131, capacity], dtype=torch.int32, device="cuda")
    k_cache, table = latent_cache(latent, page_size)
    for v_cache in (k_cache[..., :d_v], k_cache[..., :d_v].contiguous()):
        out, lse = flash_attn_with_kvcache(
            q,
            k_cache,
            v_cache,
            cache_seqlens=seqlens,
            block_table=table,
            causal=causal,
            num_splits=num_splits,
            return_softmax_lse=True,
        )
        assert out.shape == (batch, seqlen_q, nheads, d_v)
        check_against_latent_reference(out, lse, q, latent, seqlens, d_v, causal)


@pytest.mark.parametrize("device", DEVICES)
def test_append_into_a_shared_latent_cache(device):
    """v_cache = k_cache[..., :d_v] (absorbed MLA's cache): an append writes k
    and v into the same bytes, so v must be k[..., :d_v]; then the call equals
    the one on separate caches. Another v, or a rotary append (which would
    rotate k's columns but not v's copy of them), is refused by name."""
    batch, capacity, nheads, d_qk, d_v = 2, 40, 4, 64, 32
    q = rand(batch, 1, nheads, d_qk, device=device, dtype=torch.bfloat16)
    k_cache = rand(batch, capacity, 1, d_qk, device=device, dtype=torch.bfloat16)
    k_new = rand(batch, 2, 1, d_qk, device=device, dtype=torch.bfloat16)
    seqlens = torch.tensor([5, 30], dtype=torch.int32, device=device)
    k_sep, v_sep = k_cache.clone(), k_cache[..., :d_v].clone()
    out = flash_attn_with_kvcache(
        q, k_cache, k_cache[..., :d_v], k_new, k_new[..., :d_v], cache_seqlens=seqlens
    )
    out_sep = flash_attn_with_kvcache(
        q, k_sep, v_sep, k_new, k_new[..., :d_v].clone(), cache_seqlens=seqlens
    )
    assert torch.equal(out, out_sep)
    assert torch.equal(k_cache, k_sep) and torch.equal(k_cache[..., :d_v], v_sep)
    with pytest.raises(RuntimeError, match=r"v must be k\[\.\.\., :32\] \(the same memory\)"):
        flash_attn_with_kvcache(
            q, k_cache, k_cache[..., :d_v], k_new, k_new[..., :d_v].clone(), cache_seqlens=seqlens
        )
    angle = torch.rand(capacity, 8, device=device)
    cos, sin = angle.cos().to(torch.bfloat16), angle.sin().to(torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"rotate k before the call"):
        flash_attn_with_kvcache(
            q,
            k_cache,
            k_cache[..., :d_v],
            k_new,
            k_new[..., :d_v],
            rotary_cos=cos,
            rotary_sin=sin,
            cache_seqlens=seqlens,
        )


def test_compile_fullgraph_absorbed_mla_decode_with_append_on_cpu():
    """torch.compile(fullgraph=True) through absorbed MLA's decode step: the
    shared latent cache (v_cache = k_cache[..., :512]) appended in place, the
    same bits and cache as eager."""
    torch._dynamo.reset()

    def step(q, cache, new, seqlens):
        return flash_attn_with_kvcache(
            q, cache, cache[..., :512], new, new[..., :512], cache_seqlens=seqlens
        )

    torch.manual_seed(0)
    q = torch.randn(2, 1, 8, 576, dtype=torch.bfloat16)
    cache = torch.randn(2, 64, 1, 576, dtype=torch.bfloat16)
    new = torch.randn(2, 1, 1, 576, dtype=torch.bfloat16)
    seqlens = torch.tensor([10, 60], dtype=torch.int32)
    eager_cache, compiled_cache = cache.clone(), cache.clone()
    eager = step(q, eager_cache, new, seqlens)
    compiled = torch.compile(step, fullgraph=True)(q, compiled_cache, new, seqlens)
    assert torch.equal(compiled, eager) and torch.equal(compiled_cache, eager_cache)
    assert not torch.equal(eager_cache, cache)


def test_compile_fullgraph_head_dim_512_on_cpu():
    torch._dynamo.reset()

    def attention(q, k, v):
        return flash_attn_func(q, k, v, causal=True)

    def inputs():
        torch.manual_seed(0)
        q = rand(1, 9, 2, 512, device="cpu", dtype=torch.float32, requires_grad=True)
        k = rand(1, 13, 1, 512, device="cpu", dtype=torch.float32, requires_grad=True)
        v = rand(1, 13, 1, 384, device="cpu", dtype=torch.float32, requires_grad=True)
        return q, k, v

    out = assert_compiled_matches_eager(attention, inputs)
    assert out.shape == (1, 9, 2, 384)


@CUDA
@pytest.mark.parametrize("d_qk,d_v", [(512, 512), (576, 512), (264, 128)])
def test_head_dims_past_512_are_refused_on_cuda(d_qk, d_v):
    """On CUDA the ops serve head dims up to 512 (above 256 the forward on the
    split-KV kernel, the backward on the SM80 kernel in head-dim slabs) and the
    KV-cache op absorbed MLA's 576 / 512 (common/head_dim_bounds.h); what is
    past a bound gets a clear error that names the head dim and the bound,
    from the Python layer and from the op."""
    q = rand(1, 4, 2, d_qk, device="cuda", dtype=torch.bfloat16)
    k = rand(1, 4, 2, d_qk, device="cuda", dtype=torch.bfloat16)
    v = rand(1, 4, 2, d_v, device="cuda", dtype=torch.bfloat16)
    if d_qk <= 512:  # tests/test_cuda_{fwd,bwd}_d512.py check the results
        out = flash_attn_func(q.requires_grad_(), k, v)
        assert out.shape == (1, 4, 2, d_v)
        out.sum().backward()
        assert q.grad.shape == q.shape and torch.isfinite(q.grad).all()
        q = q.detach()
    else:
        match = rf"at most 512 on cuda \(larger head dims run on the CPU path only\), got {d_qk}"
        with pytest.raises(ValueError, match=match):
            flash_attn_func(q, k, v)
        with pytest.raises(RuntimeError, match=rf"\[8, 512\] on CUDA .*got {d_qk}"):
            ops.fwd(q, k, v, None, 0.0, d_qk**-0.5, False, -1, -1, 0.0, False, 0, 0, None)
    # tests/test_cuda_kvcache_d512.py and the absorbed-MLA test here check the results.
    assert flash_attn_with_kvcache(q[:, :1], k, v).shape == (1, 1, 2, d_v)
