"""Context parallelism (torch.distributed.tensor.experimental.context_parallel)
on the FLASH_ATTN_CUDA provider, with a device mesh of size 1.

Under context_parallel, DTensor's handlers turn aten::_scaled_dot_product_flash_attention
and its backward into ring attention over the mesh, calling the same aten ops on
each rank's local shards; with the provider active those calls reach our kernels.

CPU (gloo): F.scaled_dot_product_attention on CPU picks torch's CPU flash op,
which context parallelism does not intercept, so the CPU test calls
aten::_scaled_dot_product_flash_attention directly on sequence-sharded DTensors,
with the overrides registered for the CPU key. CUDA (nccl, skipped without a
GPU): the real path, F.scaled_dot_product_attention under the FLASH backend.
The run on several GPUs is scripts/context_parallel_check.py.
"""

import os
import socket

import pytest
import torch
import torch.nn.functional as F

from provider_spy import spy

from flash_attn_cuda.integrations import sdpa

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available in this build", allow_module_level=True)
try:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental import context_parallel
except ImportError as exc:  # pragma: no cover - depends on the torch build
    pytest.skip(f"context parallelism is missing in this torch ({exc})", allow_module_level=True)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def process_group(request):
    backend = request.param
    if backend == "gloo" and not dist.is_gloo_available():
        pytest.skip("gloo is not available")
    if backend == "nccl" and not dist.is_nccl_available():
        pytest.skip("nccl is not available")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(_free_port())
    dist.init_process_group(backend, rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu" if backend == "gloo" else "cuda", (1,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("process_group", ["gloo"], indirect=True)
def test_cpu_ring_attention_runs_our_ops(process_group, monkeypatch):
    # Causal: context parallelism's default load balancing requires it.
    causal = True
    mesh = process_group
    calls = spy(monkeypatch)
    handle = sdpa._install(("CPU",))
    try:
        q, k, v = (torch.randn(2, 4, 48, 32, dtype=torch.float32) for _ in range(3))
        originals = [t.clone() for t in (q, k, v)]
        dout = torch.randn(2, 4, 48, 32)
        with context_parallel(mesh, buffers=[q, k, v, dout], buffer_seq_dims=[2, 2, 2, 2]):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            dq, dk, dv = (DTensor.from_local(t, mesh, [Shard(2)], run_check=False) for t in leaves)
            out = torch.ops.aten._scaled_dot_product_flash_attention(dq, dk, dv, 0.0, causal)[0]
            assert isinstance(out, DTensor) and out.placements == (Shard(2),)
            out.to_local().backward(dout.clone())
            out_local = out.to_local().detach()
    finally:
        handle.remove()
    assert calls.get("_scaled_dot_product_flash_attention", 0) >= 1
    assert calls.get("_scaled_dot_product_flash_attention_backward", 0) >= 1
    # One rank: the shards are the whole (possibly reordered) sequence; compare
    # with attention on the same order, which is the identity for one rank.
    exp_leaves = [t.clone().requires_grad_() for t in originals]
    expected = F.scaled_dot_product_attention(*exp_leaves, is_causal=causal)
    expected.backward(dout)
    torch.testing.assert_close(out_local, expected.detach(), rtol=1e-5, atol=1e-5)
    for leaf, exp in zip(leaves, exp_leaves):
        torch.testing.assert_close(leaf.grad, exp.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not sdpa.registry_available(), reason="needs torch >= 2.10 (the registry)")
@pytest.mark.parametrize("process_group", ["nccl"], indirect=True)
@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_cuda_context_parallel_sdpa_uses_provider(process_group, monkeypatch, dtype):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh = process_group
    q, k, v = (torch.randn(2, 4, 256, 64, device="cuda", dtype=dtype) for _ in range(3))
    dout = torch.randn_like(q)

    def builtin():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(*leaves, is_causal=True)
        out.backward(dout)
        return out.detach(), [t.grad for t in leaves]

    expected, expected_grads = builtin()
    calls = spy(monkeypatch)
    torch.nn.attention.activate_flash_attention_impl(sdpa.PROVIDER_NAME)
    try:
        qs, ks, vs, dos = (t.clone() for t in (q, k, v, dout))
        with context_parallel(mesh, buffers=[qs, ks, vs, dos], buffer_seq_dims=[2, 2, 2, 2]):
            leaves = [t.clone().requires_grad_() for t in (qs, ks, vs)]
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                out = F.scaled_dot_product_attention(*leaves, is_causal=True)
            out = out.to_local() if isinstance(out, DTensor) else out
            out.backward(dos)
            out = out.detach()
            grads = [t.grad for t in leaves]
    finally:
        torch.nn.attention.restore_flash_attention_impl()
    assert calls.get("_scaled_dot_product_flash_attention", 0) >= 1
    assert calls.get("_scaled_dot_product_flash_attention_backward", 0) >= 1
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g, e, rtol=5e-2, atol=5e-2)
