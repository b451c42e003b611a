"""seqused_q on flash_attn_varlen_func and the varlen ops (FA3's argument).

Sequence b uses only its first seqused_q[b] query rows. Held to the float64
reference (reference.varlen_attention_ref with seqused_q / seqused_k), forward
and backward:
* the used rows equal attention over the truncated sequences, with causal and
  local windows aligned bottom-right to the used lengths (seqused_q[b], and
  seqused_k[b] or the keys cu_seqlens_k gives), as FA3 does;
* the rows past seqused_q[b] get out 0, lse +inf and dq 0, add nothing to dk /
  dv or to a sink's gradient, and are never read (NaN planted there changes
  nothing); with out= they keep the caller's values;
* a bad value raises, naming seqused_q, the value and the bound.

Every test runs on the CPU and, where a GPU is present, on CUDA with each
forward / backward design forced (FLASH_ATTN_FWD_KERNEL / _BWD_KERNEL).
"""

import re

import pytest
import torch

import reference as ref

from flash_attn_cuda import flash_attn_varlen_func

ops = torch.ops.flash_attn

# (device, kernel design): the CPU path, and on CUDA each design forced.
TARGETS = [
    pytest.param(("cpu", None), id="cpu"),
    pytest.param(("cuda", "sm80"), id="cuda-sm80", marks=pytest.mark.cuda),
    pytest.param(("cuda", "sm90"), id="cuda-sm90", marks=pytest.mark.cuda),
]

# lengths_q, seqused_q, lengths_k, seqused_k (None: every key): zero used,
# full, partial, one row, a sequence with no keys, longer than a tile.
LENS_Q = [5, 17, 0, 33, 40, 130]
USED_Q = [0, 17, 0, 20, 1, 77]
LENS_K = [9, 14, 3, 33, 7, 150]
USED_K = [4, 14, 3, 20, 0, 101]
HEADS = {"mha": (4, 4), "gqa": (8, 2)}
MASKS = {"full": (False, (-1, -1)), "causal": (True, (-1, -1)), "local": (False, (9, 3))}


@pytest.fixture
def target(request, monkeypatch):
    device, kernel = request.param
    if device == "cuda" and kernel is not None:
        if kernel == "sm90" and torch.cuda.get_device_capability() != (9, 0):
            pytest.skip("the Hopper kernels run on sm90 GPUs only")
        monkeypatch.setenv("FLASH_ATTN_FWD_KERNEL", kernel)
        monkeypatch.setenv("FLASH_ATTN_BWD_KERNEL", kernel)
    return device


def dtype_on(device):
    return torch.float32 if device == "cpu" else torch.bfloat16


def int32(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


def cu_seqlens(lengths, device):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return int32(cu, device)


def unused_rows(lengths, used):
    cu = cu_seqlens(lengths, "cpu").tolist()
    return [r for b, n in enumerate(used) for r in range(cu[b] + n, cu[b + 1])]


def inputs(device, nheads=4, nheads_k=4, head_dim=64, head_dim_v=None):
    dtype = dtype_on(device)
    q = torch.randn(sum(LENS_Q), nheads, head_dim, device=device, dtype=dtype)
    k = torch.randn(sum(LENS_K), nheads_k, head_dim, device=device, dtype=dtype)
    v = torch.randn(sum(LENS_K), nheads_k, head_dim_v or head_dim, device=device, dtype=dtype)
    return q, k, v, cu_seqlens(LENS_Q, device), cu_seqlens(LENS_K, device)


def call(q, k, v, cu_q, cu_k, mask, used_q, used_k=None, **kwargs):
    causal, window = MASKS[mask]
    return flash_attn_varlen_func(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max(LENS_Q),
        max(LENS_K),
        causal=causal,
        window_size=window,
        seqused_q=used_q,
        seqused_k=used_k,
        **kwargs,
    )


def reference(q, k, v, cu_q, cu_k, mask, used_q, used_k, dout, compute_dtype, sink=None):
    """(out, lse, [dq, dk, dv] (+ [d_sink])) of the reference in compute_dtype."""
    causal, window = MASKS[mask]
    leaves = [t.detach().to(compute_dtype).requires_grad_() for t in (q, k, v)]
    if sink is not None:
        leaves.append(sink.detach().clone().requires_grad_())
    out, lse = ref.varlen_attention_ref(
        *leaves[:3],
        cu_q,
        cu_k,
        max_seqlen_k=max(LENS_K),
        causal=causal,
        window_size=window,
        compute_dtype=compute_dtype,
        learnable_sink=leaves[3] if sink is not None else None,
        seqused_q=used_q,
        seqused_k=used_k,
    )
    out.backward(dout.to(compute_dtype))
    return out.detach(), lse.detach(), [t.grad for t in leaves]


def check_output(out, exact, same, name, factor=2.0, atol=1e-5):
    assert torch.isfinite(out).all(), f"{name} is not finite"
    ref.assert_within_criterion(out, exact, same, factor=factor, atol=atol, name=name)


@pytest.mark.parametrize("target", TARGETS, indirect=True)
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("with_seqused_k", [False, True], ids=["keys_all", "seqused_k"])
def test_forward_backward_match_reference(target, mask, heads, with_seqused_k):
    device = target
    q, k, v, cu_q, cu_k = inputs(device, *HEADS[heads])
    used_q = int32(USED_Q, device)
    used_k = int32(USED_K, device) if with_seqused_k else None
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse, _ = call(*leaves, cu_q, cu_k, mask, used_q, used_k, return_attn_probs=True)
    dout = torch.randn_like(out)
    out.backward(dout)

    exact, lse_exact, grads_exact = reference(
        q, k, v, cu_q, cu_k, mask, USED_Q, used_k, dout, torch.float64
    )
    same, _, grads_same = reference(q, k, v, cu_q, cu_k, mask, USED_Q, used_k, dout, q.dtype)
    check_output(out.detach(), exact, same, "out")
    inf = torch.isinf(lse_exact)
    assert torch.equal(torch.isinf(lse), inf)
    torch.testing.assert_close(lse[~inf].double(), lse_exact[~inf], atol=2e-2, rtol=0)
    for name, leaf, exact_g, same_g in zip(("dq", "dk", "dv"), leaves, grads_exact, grads_same):
        check_output(leaf.grad, exact_g, same_g, name, factor=3.0, atol=5e-5)

    rows = unused_rows(LENS_Q, USED_Q)
    assert (out[rows] == 0).all()
    assert torch.isinf(lse[:, rows]).all() and (lse[:, rows] > 0).all()
    assert (leaves[0].grad[rows] == 0).all()


@pytest.mark.parametrize("target", TARGETS, indirect=True)
@pytest.mark.parametrize("mask", ["full", "causal"])
def test_full_seqused_q_equals_no_seqused_q(target, mask):
    device = target
    q, k, v, cu_q, cu_k = inputs(device)
    full = int32(LENS_Q, device)
    a = call(q, k, v, cu_q, cu_k, mask, None)
    b = call(q, k, v, cu_q, cu_k, mask, full)
    torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("target", TARGETS, indirect=True)
@pytest.mark.parametrize("mask", ["full", "causal"])
def test_never_reads_rows_past_seqused_q(target, mask):
    """NaN / Inf in q and dout past seqused_q change nothing."""
    device = target
    q, k, v, cu_q, cu_k = inputs(device, 8, 2)
    used_q = int32(USED_Q, device)
    rows = torch.tensor(unused_rows(LENS_Q, USED_Q), device=device)
    dout = torch.randn(q.shape, device=device, dtype=q.dtype)
    results = []
    for planted in (False, True):
        qq, dd = q.clone(), dout.clone()
        if planted:
            qq[rows] = float("nan")
            dd[rows[::2]] = float("inf")
        leaves = [t.clone().requires_grad_() for t in (qq, k, v)]
        out = call(*leaves, cu_q, cu_k, mask, used_q, deterministic=True)
        out.backward(dd)
        grads = [t.grad for t in leaves]
        grads[0] = grads[0].index_fill(0, rows, 0)  # the planted rows' dq is 0 anyway
        results.append([out.detach()] + grads)
    for name, clean, planted in zip(("out", "dq", "dk", "dv"), *results):
        assert torch.isfinite(planted).all(), f"{name}: a planted NaN / Inf reached the result"
        assert torch.equal(planted, clean), name


@pytest.mark.parametrize("target", TARGETS, indirect=True)
@pytest.mark.parametrize(
    "dims", [(64, 64), (40, 40), (64, 32)], ids=["d64", "d40_padded", "dv32_padded_v"]
)
def test_out_keeps_rows_past_seqused_q(target, dims):
    """out=: the used rows equal the allocating call; the rest keep the caller's
    values (FA3's behaviour: no write past seqused_q), also through the
    scratch buffers of a padded head dim."""
    device = target
    q, k, v, cu_q, cu_k = inputs(device, head_dim=dims[0], head_dim_v=dims[1])
    used_q = int32(USED_Q, device)
    expected, lse_expected, _ = call(q, k, v, cu_q, cu_k, "causal", used_q, return_attn_probs=True)
    out = torch.full(expected.shape, 7.0, device=device, dtype=q.dtype)
    returned, lse, _ = call(q, k, v, cu_q, cu_k, "causal", used_q, out=out, return_attn_probs=True)
    assert returned.data_ptr() == out.data_ptr()
    rows = unused_rows(LENS_Q, USED_Q)
    used_rows = sorted(set(range(q.shape[0])) - set(rows))
    assert (out[rows] == 7.0).all()
    torch.testing.assert_close(out[used_rows], expected[used_rows], atol=0, rtol=0)
    torch.testing.assert_close(lse, lse_expected, atol=0, rtol=0)


@pytest.mark.parametrize("target", TARGETS, indirect=True)
def test_ops_out_keeps_rows_and_bwd_softmax_d(target):
    """The ops directly: varlen_fwd_out leaves the rows past seqused_q of out
    alone; varlen_bwd writes D = 0 there into softmax_d."""
    device = target
    q, k, v, cu_q, cu_k = inputs(device)
    used_q = int32(USED_Q, device)
    args = (None, None, max(LENS_Q), max(LENS_K), 0.0, 0.125, True, -1, 0, 0.0, False, 0, 0, None)
    out = torch.full(q.shape, 3.0, device=device, dtype=q.dtype)
    lse, _, _ = ops.varlen_fwd_out(q, k, v, cu_q, cu_k, *args, out=out, seqused_q=used_q)
    rows = unused_rows(LENS_Q, USED_Q)
    assert (out[rows] == 3.0).all()
    softmax_d = torch.full_like(lse, float("nan"))
    dq, _, _ = ops.varlen_bwd(
        torch.randn_like(out),
        q,
        k,
        v,
        out,
        lse,
        cu_q,
        cu_k,
        None,
        max(LENS_Q),
        max(LENS_K),
        0.0,
        0.125,
        True,
        -1,
        0,
        0.0,
        False,
        None,
        softmax_d=softmax_d,
        seqused_q=used_q,
    )
    assert (softmax_d[:, rows] == 0).all() and torch.isfinite(softmax_d).all()
    assert (dq[rows] == 0).all()


@pytest.mark.parametrize("target", TARGETS, indirect=True)
def test_learnable_sink_gradient(target):
    """Rows past seqused_q add nothing to the sink's gradient (their lse is
    +inf, their D 0)."""
    device = target
    q, k, v, cu_q, cu_k = inputs(device)
    used_q = int32(USED_Q, device)
    sink = torch.randn(q.shape[1], device=device, dtype=torch.float32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)] + [sink.clone().requires_grad_()]
    out = call(*leaves[:3], cu_q, cu_k, "causal", used_q, learnable_sink=leaves[3])
    dout = torch.randn_like(out)
    out.backward(dout)
    exact, _, grads_exact = reference(
        q, k, v, cu_q, cu_k, "causal", USED_Q, None, dout, torch.float64, sink=sink
    )
    same, _, grads_same = reference(
        q, k, v, cu_q, cu_k, "causal", USED_Q, None, dout, q.dtype, sink=sink
    )
    check_output(out.detach(), exact, same, "out")
    for name, leaf, exact_g, same_g in zip(
        ("dq", "dk", "dv", "d_sink"), leaves, grads_exact, grads_same
    ):
        check_output(leaf.grad, exact_g, same_g, name, factor=3.0, atol=5e-4)


# seqused_q[b] must lie in [0, cu_seqlens_q[b + 1] - cu_seqlens_q[b]].
BAD_VALUES = {
    "past_sequence": (
        [0, 18, 0, 33, 40, 130],
        "flash_attn: seqused_q[1] = 18 must be in [0, 17] "
        "(the query rows cu_seqlens_q gives sequence 1)",
    ),
    "negative": ([-2, 1, 0, 1, 1, 1], "flash_attn: seqused_q[0] = -2 must be in [0, 5]"),
}


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_bad_values_raise_on_cpu(case):
    values, message = BAD_VALUES[case]
    q, k, v, cu_q, cu_k = inputs("cpu")
    with pytest.raises(RuntimeError, match=re.escape(message)):
        call(q, k, v, cu_q, cu_k, "causal", int32(values, "cpu"))
    out = torch.zeros_like(q)
    lse = torch.zeros(q.shape[1], q.shape[0])
    with pytest.raises(RuntimeError, match="seqused_q"):
        ops.varlen_bwd(
            out, q, k, v, out, lse, cu_q, cu_k, None, max(LENS_Q), max(LENS_K), 0.0, 0.125,
            False, -1, -1, 0.0, False, None, seqused_q=int32(values, "cpu"),
        )  # fmt: skip


def test_bad_shape_and_dtype_raise():
    q, k, v, cu_q, cu_k = inputs("cpu")
    with pytest.raises(RuntimeError, match=r"seqused_q must have dtype int32"):
        call(q, k, v, cu_q, cu_k, "full", torch.tensor(USED_Q))
    with pytest.raises(RuntimeError, match=r"seqused_q must have shape \(batch,\) = \(6,\)"):
        call(q, k, v, cu_q, cu_k, "full", int32(USED_Q[:3], "cpu"))
