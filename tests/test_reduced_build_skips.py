"""The test suite's rule for builds with a reduced kernel set (conftest.py):
only the build's own refusal of a left-out kernel, on a build marked reduced,
turns a CUDA test into a skip."""

import pytest
from reduced_build import LEFT_OUT_MESSAGE, REDUCED_KERNEL_SET_MARK, left_out_reason

REFUSAL = (
    f"flash_attn_cuda: head_dim 64 in bf16 needs the compiled head dim 64, {LEFT_OUT_MESSAGE}; "
    "rebuild with FLASH_ATTN_CUDA_HDIMS and FLASH_ATTN_CUDA_DTYPES including it"
)
REDUCED = f"cuda 13.0; archs sm_90; hdims 128; dtypes bf16; torch 2.x; {REDUCED_KERNEL_SET_MARK}"
FULL = "cuda 13.0; archs sm_90; hdims 32,64,96,128,160,192,224,256; dtypes fp16,bf16; torch 2.x"


def test_refusal_on_a_reduced_build_is_a_skip_with_the_refusal_as_reason():
    error = RuntimeError(REFUSAL + "\nException raised from launcher_for at flash_api_cuda.cpp:60")
    assert left_out_reason(error, REDUCED) == REFUSAL


def test_refusal_on_a_full_build_stays_a_failure():
    assert left_out_reason(RuntimeError(REFUSAL), FULL) is None


def test_other_errors_stay_failures():
    assert (
        left_out_reason(RuntimeError("flash_attn_cuda: q must be on a CUDA device"), REDUCED)
        is None
    )
    assert left_out_reason(ValueError(REFUSAL), REDUCED) is None
    assert left_out_reason(AssertionError(REFUSAL), REDUCED) is None


def test_unknown_build_is_not_reduced():
    assert left_out_reason(RuntimeError(REFUSAL), None) is None


def test_refusal_wrapped_by_opcheck_is_a_skip():
    # torch.library.opcheck raises its own error with the op's as __cause__.
    wrapped = Exception("opcheck(op, ...): test_schema failed")
    wrapped.__cause__ = RuntimeError(REFUSAL)
    assert left_out_reason(wrapped, REDUCED) == REFUSAL
    assert left_out_reason(wrapped, FULL) is None
    other = Exception("opcheck(op, ...): test_faketensor failed")
    other.__cause__ = RuntimeError("flash_attn_cuda: q must be on a CUDA device")
    assert left_out_reason(other, REDUCED) is None


def _sanitize_calls(monkeypatch, build_info):
    """scripts/sanitize_calls.py, fresh, on a build described by build_info."""
    import importlib.util
    import os

    import flash_attn_cuda

    monkeypatch.setattr(flash_attn_cuda, "build_info", build_info)
    path = os.path.join(os.path.dirname(__file__), "..", "scripts", "sanitize_calls.py")
    spec = importlib.util.spec_from_file_location("sanitize_calls_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sanitizer_call_sets_count_what_a_reduced_build_left_out(monkeypatch):
    calls = _sanitize_calls(monkeypatch, REDUCED)

    @calls.skips_left_out
    def left_out():
        raise RuntimeError(REFUSAL)

    @calls.skips_left_out
    def served(x):
        return x + 1

    assert calls.summary("sanitize_x") == "sanitize_x: all calls completed"
    assert served(1) == 2
    assert left_out() is None
    assert calls.summary("sanitize_x") == (
        f"sanitize_x: all calls completed but 1 of kernels this reduced build left out "
        f"(the first: {REFUSAL})"
    )


def test_sanitizer_call_sets_fail_on_other_errors_and_on_full_builds(monkeypatch):
    calls = _sanitize_calls(monkeypatch, FULL)

    @calls.skips_left_out
    def left_out():
        raise RuntimeError(REFUSAL)

    with pytest.raises(RuntimeError, match="which this build left out"):
        left_out()
    calls = _sanitize_calls(monkeypatch, REDUCED)

    @calls.skips_left_out
    def bad_input():
        raise RuntimeError("flash_attn_cuda: q must be on a CUDA device")

    with pytest.raises(RuntimeError, match="CUDA device"):
        bad_input()
    assert calls.summary("sanitize_x") == "sanitize_x: all calls completed"


def test_refusal_before_the_expected_error_is_a_skip():
    """A bad-value test expects the op's own error; a reduced build refuses the
    call first, and pytest.raises fails on the message with an AssertionError
    raised while handling the refusal."""
    with pytest.raises(AssertionError) as mismatch:
        with pytest.raises(RuntimeError, match=r"cu_seqlens_q must be non-decreasing"):
            raise RuntimeError(REFUSAL)
    assert left_out_reason(mismatch.value, REDUCED) == REFUSAL
    assert left_out_reason(mismatch.value, FULL) is None
    with pytest.raises(AssertionError) as other:
        with pytest.raises(RuntimeError, match=r"cu_seqlens_q must be non-decreasing"):
            raise RuntimeError("flash_attn_cuda: cu_seqlens_q[1] = 3 > cu_seqlens_q[2] = 0")
    assert left_out_reason(other.value, REDUCED) is None
