"""The index-check controls on every build (docs/memory_safety.md): they exist
as ops and functions, round-trip their setting, and do nothing harmful
without a GPU. The CUDA behaviour is in test_cuda_index_safety.py."""

import pytest
import torch

import flash_attn_cuda
from flash_attn_cuda import check_index_errors, set_sync_index_checks


def test_ops_are_registered():
    assert hasattr(torch.ops.flash_attn, "check_index_errors")
    assert hasattr(torch.ops.flash_attn, "set_sync_index_checks")


def test_sync_setting_round_trips():
    previous = set_sync_index_checks(True)
    try:
        assert isinstance(previous, bool)
        # A CPU-only build has no CUDA checks to switch: it reports False.
        assert set_sync_index_checks(False) is flash_attn_cuda.cuda_built
        assert set_sync_index_checks(False) is False
    finally:
        set_sync_index_checks(previous)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_check_without_gpu_is_a_no_op():
    assert check_index_errors() is None
    assert check_index_errors(0) is None


def test_check_rejects_a_cpu_device():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU to reach the device argument's check")
    with pytest.raises(ValueError, match="must be a CUDA device"):
        check_index_errors("cpu")


def test_cpu_path_raises_at_the_call():
    """The CPU path needs no report: the bad value raises at once, with the
    message the CUDA path reports."""
    q = torch.randn(8, 2, 32)
    cu = torch.tensor([0, 6, 3], dtype=torch.int32)
    with pytest.raises(
        RuntimeError,
        match=r"cu_seqlens_q must be non-decreasing, got "
        r"cu_seqlens_q\[1\] = 6 > cu_seqlens_q\[2\] = 3",
    ):
        flash_attn_cuda.flash_attn_varlen_func(q, q, q, cu, cu, 8, 8)
