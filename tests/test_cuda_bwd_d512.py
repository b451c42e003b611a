"""CUDA tests of the backward at head dims 257-512.

These head dims run the SM80 backward kernel's d512 row (bwd_tile_config.h):
32 x 32 blocks in two passes over head-dim slabs of 256 columns, each pass
recomputing S and dP at the full width (docs/head_dims_dv_and_512.md section
3, "SM80"). The forward they follow runs on the split-KV kernel. Gradients
are held to the correctness criterion against float32 / same-dtype attention
(tests/reference.py), and against the CPU op where dropout draws its mask.

Every test here needs a GPU and is skipped with a reason without one.
"""

import pytest
import torch

import reference
from cuda_inputs import DEVICE, DTYPES, random_qkv
from test_cuda_bwd import (
    GRAD_ATOL,
    check_deterministic_bwd,
    check_grads,
    check_varlen_bwd,
    reference_grads,
    run_fwd_bwd,
)

from flash_attn_cuda import flash_attn_func

pytestmark = pytest.mark.cuda

BF16 = torch.bfloat16


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (3, 1)], ids=["mha", "gqa4", "mqa3"])
@pytest.mark.parametrize("seqlens", [(1, 70), (77, 77), (130, 257), (300, 129)])
def test_bwd_matches_reference(dtype, causal, heads, seqlens):
    """Key blocks of 32 and query blocks of 32, whole and partial; GQA adds
    the query heads' dK / dV slab by slab into the kv heads' sums."""
    (seqlen_q, seqlen_k), (nheads, nheads_k) = seqlens, heads
    q, k, v = random_qkv(2, seqlen_q, seqlen_k, nheads, nheads_k, 512, dtype)
    dout = torch.randn_like(q)
    grads, _ = run_fwd_bwd(q, k, v, dout, causal=causal)
    check_grads(q, k, v, dout, grads, causal=causal)


@pytest.mark.parametrize("d_qk,d_v", [(264, 264), (320, 128), (384, 384), (512, 256), (504, 504)])
def test_bwd_head_dims_and_value_dims(d_qk, d_v):
    """Head dims below 512 leave the second slab partly (264: 8 columns) or
    wholly past d_v; d_v < d_qk runs on V, out and dout padded to d_qk."""
    q, k, v = random_qkv(2, 90, 200, 8, 2, d_qk, BF16)
    v = torch.randn(2, 200, 2, d_v, device=DEVICE, dtype=BF16)
    for t in (q, k, v):
        t.requires_grad_()
    dout = torch.randn(2, 90, 8, d_v, device=DEVICE, dtype=BF16)
    out = flash_attn_func(q, k, v, causal=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    check_grads(q.detach(), k.detach(), v.detach(), dout, grads, causal=True)


@pytest.mark.parametrize("feature", ["window", "softcap", "alibi", "softcap_alibi_window"])
def test_bwd_score_features(feature):
    q, k, v = random_qkv(2, 150, 400, 8, 2, 512, BF16)
    dout = torch.randn_like(q)
    slopes = torch.rand(8, device=DEVICE) * 0.3
    kwargs, ref_kwargs = {}, {}
    if feature in ("window", "softcap_alibi_window"):
        kwargs["window"] = ref_kwargs["window_size"] = (64, 8)
    if feature in ("softcap", "softcap_alibi_window"):
        kwargs["softcap"] = ref_kwargs["softcap"] = 20.0
    if feature in ("alibi", "softcap_alibi_window"):
        kwargs["alibi_slopes"] = ref_kwargs["alibi_slopes"] = slopes
    grads, _ = run_fwd_bwd(q, k, v, dout, causal=True, **kwargs)
    check_grads(q, k, v, dout, grads, causal=True, **ref_kwargs)


def test_bwd_learnable_sink():
    """dq, dk, dv and the sink's gradient, as tests/test_sinks.py holds them."""
    q, k, v = (t.requires_grad_() for t in random_qkv(2, 120, 250, 8, 2, 512, BF16))
    sink = torch.randn(8, device=DEVICE, dtype=torch.float32, requires_grad=True)
    dout = torch.randn_like(q)
    out = flash_attn_func(q, k, v, causal=True, learnable_sink=sink)
    grads = torch.autograd.grad(out, (q, k, v, sink), dout)

    def reference_run(compute_dtype):
        leaves = [t.detach().to(compute_dtype).requires_grad_() for t in (q, k, v, sink)]
        ref_out, _ = reference.attention_ref(
            *leaves[:3], causal=True, learnable_sink=leaves[3], compute_dtype=compute_dtype
        )
        return torch.autograd.grad(ref_out, leaves, dout.to(compute_dtype))

    exact, same = reference_run(torch.float64), reference_run(BF16)
    for name, ours, ref_exact, ref_same in zip(("dq", "dk", "dv", "d_sink"), grads, exact, same):
        reference.assert_within_criterion(
            ours, ref_exact, ref_same, factor=3.0, atol=1e-4, name=name
        )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_bwd(dtype, causal):
    check_varlen_bwd(dtype, 512, causal, "plain")


@pytest.mark.parametrize("nheads,nheads_k", [(4, 4), (8, 2)])
@pytest.mark.parametrize("causal", [False, True])
def test_bwd_deterministic_is_bitwise_reproducible(nheads, nheads_k, causal):
    """Deterministic: dQ in splits walked in order, and under GQA the query
    heads' dK / dV added in head order, one turn per (key block, slab)."""
    check_deterministic_bwd(300, 400, nheads, nheads_k, 512, causal)


@pytest.mark.parametrize("forward_device", ["cpu", DEVICE])
@pytest.mark.parametrize("nheads_k", [4, 2])
def test_bwd_dropout_matches_cpu(nheads_k, forward_device):
    """Dropout with softcap and ALiBi (the keep mask replayed from the rng
    state), after the CPU or the CUDA forward (the SM80 kernel's slab passes)
    with the same seed: against the CPU backward on the same out / lse and
    against attention with the reference mask."""
    q, k, v = random_qkv(2, 100, 130, 4, nheads_k, 512, BF16)
    dout = torch.randn_like(q)
    slopes = torch.rand(4, device=DEVICE) * 0.2
    scale, p = 512**-0.5, 0.3
    out, lse, _, rng_state = torch.ops.flash_attn.fwd(
        *(t.to(forward_device) for t in (q, k, v, slopes)),
        p,
        scale,
        True,
        -1,
        -1,
        20.0,
        False,
        31,
        8,
        None,
    )
    rng_state = rng_state.cpu()
    args = (slopes, p, scale, True, -1, -1, 20.0, False)
    on = lambda device: [t.to(device) for t in (dout, q, k, v, out, lse)]
    cuda_grads = torch.ops.flash_attn.bwd(*on(DEVICE), *args, rng_state.to(DEVICE))
    cpu_grads = torch.ops.flash_attn.bwd(*on("cpu"), slopes.cpu(), *args[1:], rng_state)
    keep = reference.dropout_keep_mask_batch(31, 8, 2, 4, 100, 130, p).to(DEVICE)
    ref_kwargs = dict(causal=True, softcap=20.0, alibi_slopes=slopes, dropout_p=p, keep_mask=keep)
    exact = reference_grads(q, k, v, dout, torch.float32, **ref_kwargs)
    same = reference_grads(q, k, v, dout, BF16, **ref_kwargs)
    for name, ours, cpu, ref_exact, ref_same in zip(
        ("dq", "dk", "dv"), cuda_grads, cpu_grads, exact, same
    ):
        baseline = reference.max_abs_err(ref_same, ref_exact)
        diff = reference.max_abs_err(ours.cpu(), cpu)
        assert diff <= 2 * baseline + GRAD_ATOL, f"{name}: CUDA vs CPU differ by {diff:.3e}"
        assert reference.max_abs_err(ours, ref_exact) <= 3 * baseline + GRAD_ATOL, name


def test_bwd_rows_that_see_no_key_get_zero_gradient():
    q, k, v = random_qkv(1, 200, 64, 2, 2, 512, BF16)
    dout = torch.randn_like(q)
    (dq, dk, dv), (_, lse, _) = run_fwd_bwd(q, k, v, dout, window=(0, 0))
    empty_rows = torch.isinf(lse[0, 0])
    assert empty_rows.any()
    assert torch.equal(dq[0, empty_rows], torch.zeros_like(dq[0, empty_rows]))
    check_grads(q, k, v, dout, (dq, dk, dv), window_size=(0, 0))


def test_bwd_kernel_is_the_sm80_slab_kernel():
    """On an sm90 the large-shared-memory tile, 32 x 64 with 8 warps (an sm80
    runs the table's 32 x 32 with 4: tests/test_plan.py)."""
    if torch.cuda.get_device_properties(0).shared_memory_per_block_optin < 205056:
        pytest.skip("the device's blocks cannot hold the d512 large-shared-memory tile")
    q, k, v = random_qkv(1, 64, 64, 2, 2, 512, BF16)
    dout = torch.randn_like(q)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run_fwd_bwd(q, k, v, dout)
        torch.cuda.synchronize()
    names = [event.name for event in prof.events()]
    main = [n for n in names if "flash_bwd_dq_dk_dv_kernel" in n]
    assert main and all("BwdKernelTraits<512, 32, 64, 8" in n for n in main), main


def test_bwd_torch_compile_training_matches_eager():
    torch._dynamo.reset()

    def loss_fn(q, k, v):
        return flash_attn_func(q, k, v, causal=True).float().square().mean()

    q, k, v = (t.requires_grad_() for t in random_qkv(1, 96, 96, 4, 2, 512, BF16))
    eager = torch.autograd.grad(loss_fn(q, k, v), (q, k, v))
    compiled = torch.autograd.grad(torch.compile(loss_fn, fullgraph=True)(q, k, v), (q, k, v))
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a.float(), b.float(), atol=1e-3, rtol=1e-3)
    torch._dynamo.reset()
