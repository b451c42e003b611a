"""flash_attn_cuda and flash-attn 2.8 in one process, imported in either order.

Both put ops in the ``flash_attn`` namespace: ours are defined by the
extension's ``TORCH_LIBRARY(flash_attn, m)`` (fwd, bwd, varlen_fwd, varlen_bwd,
fwd_kvcache, check_index_errors, set_sync_index_checks); flash-attn 2.8 defines
``_flash_attn_forward``, ``_flash_attn_backward``, ``_flash_attn_varlen_forward``
and ``_flash_attn_varlen_backward`` with ``torch.library.custom_op`` (a
FRAGMENT library, which may join a namespace another library defined). The
names differ, so both sets work. A stand-in module registers ops the way
flash-attn does; each order runs in a fresh interpreter (op registrations
cannot be undone within one).
"""

import os
import subprocess
import sys
import textwrap

import pytest

from conftest import PACKAGE_PARENT

# Registers ops the way flash-attn 2.8's flash_attn_interface.py does: custom_op
# in the flash_attn namespace plus a fake kernel. The bodies only return
# tensors of the right shapes; the point is the registration.
STAND_IN = textwrap.dedent(
    """
    import torch

    @torch.library.custom_op("flash_attn::_flash_attn_forward", mutates_args=(), device_types="cpu")
    def _flash_attn_forward(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
        softmax_scale: float, causal: bool, window_size_left: int, window_size_right: int,
        softcap: float, alibi_slopes: torch.Tensor | None, return_softmax: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        b, s, h, _ = q.shape
        return (q.clone(), q.new_zeros((b, h, s), dtype=torch.float32), q.new_empty(0),
                torch.zeros(2, dtype=torch.int64))

    @torch.library.register_fake("flash_attn::_flash_attn_forward")
    def _(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
          softcap, alibi_slopes, return_softmax):
        b, s, h, _ = q.shape
        return (torch.empty_like(q), q.new_empty((b, h, s), dtype=torch.float32),
                q.new_empty(0), q.new_empty(2, dtype=torch.int64))

    @torch.library.custom_op(
        "flash_attn::_flash_attn_backward", mutates_args=("dq", "dk", "dv"), device_types="cpu"
    )
    def _flash_attn_backward(
        dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        out: torch.Tensor, softmax_lse: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor,
        dv: torch.Tensor, dropout_p: float, softmax_scale: float, causal: bool,
    ) -> torch.Tensor:
        dq.zero_(); dk.zero_(); dv.zero_()
        return softmax_lse.clone()

    @torch.library.custom_op(
        "flash_attn::_flash_attn_varlen_forward", mutates_args=(), device_types="cpu"
    )
    def _flash_attn_varlen_forward(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
    ) -> torch.Tensor:
        return q.clone()

    @torch.library.custom_op(
        "flash_attn::_flash_attn_varlen_backward", mutates_args=(), device_types="cpu"
    )
    def _flash_attn_varlen_backward(dout: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return dout.clone()
    """
)

RUN = textwrap.dedent(
    """
    import importlib, sys
    import torch
    for name in sys.argv[1].split(","):
        importlib.import_module(name)
    import flash_attn_cuda

    # Our documented ops work ...
    q = torch.randn(1, 17, 2, 32)
    out, lse, _, rng = torch.ops.flash_attn.fwd(
        q, q, q, None, 0.0, 32 ** -0.5, True, -1, -1, 0.0, False, 0, 0, None)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2), is_causal=True).transpose(1, 2)
    assert (out - expected).abs().max().item() < 1e-5
    out.requires_grad_()
    got = flash_attn_cuda.flash_attn_func(q.requires_grad_(), q, q, causal=True)
    got.sum().backward()
    assert q.grad is not None
    # ... and so do the stand-in's.
    o, l, _, _ = torch.ops.flash_attn._flash_attn_forward(
        q.detach(), q.detach(), q.detach(), 0.0, 1.0, False, -1, -1, 0.0, None, False)
    assert torch.equal(o, q.detach()) and l.shape == (1, 2, 17)
    cu = torch.tensor([0, 17], dtype=torch.int32)
    assert torch.equal(torch.ops.flash_attn._flash_attn_varlen_forward(q[0], q[0], q[0], cu, cu, 17, 17), q[0])
    names = {"fwd", "bwd", "varlen_fwd", "varlen_bwd", "fwd_kvcache",
             "_flash_attn_forward", "_flash_attn_backward",
             "_flash_attn_varlen_forward", "_flash_attn_varlen_backward"}
    for n in names:
        assert hasattr(torch.ops.flash_attn, n), n
    # Under torch.compile both sets trace (fake kernels of both libraries).
    f = torch.compile(lambda x: torch.ops.flash_attn.fwd(
        x, x, x, None, 0.0, 0.2, False, -1, -1, 0.0, False, 0, 0, None)[0]
        + torch.ops.flash_attn._flash_attn_forward(
            x, x, x, 0.0, 1.0, False, -1, -1, 0.0, None, False)[0], fullgraph=True, backend="eager")
    x = torch.randn(1, 9, 2, 32)
    torch.testing.assert_close(f(x), torch.ops.flash_attn.fwd(
        x, x, x, None, 0.0, 0.2, False, -1, -1, 0.0, False, 0, 0, None)[0] + x)
    print("OK")
    """
)


@pytest.fixture
def stand_in_dir(tmp_path):
    (tmp_path / "flash_attn_stand_in.py").write_text(STAND_IN)
    (tmp_path / "run_check.py").write_text(RUN)
    return tmp_path


@pytest.mark.parametrize(
    "order",
    ["flash_attn_stand_in,flash_attn_cuda", "flash_attn_cuda,flash_attn_stand_in"],
    ids=["stand_in_first", "ours_first"],
)
def test_both_import_orders(stand_in_dir, order):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(stand_in_dir), PACKAGE_PARENT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    result = subprocess.run(
        [sys.executable, str(stand_in_dir / "run_check.py"), order],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith("OK")
