"""The test suite's rule for builds with a reduced kernel set (conftest.py):
only the build's own refusal of a left-out kernel, on a build marked reduced,
turns a CUDA test into a skip."""

from conftest import LEFT_OUT_MESSAGE, REDUCED_KERNEL_SET_MARK, left_out_reason

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
