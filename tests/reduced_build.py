"""Refusals of a reduced build (FLASH_ATTN_CUDA_HDIMS / _DTYPES), told apart from errors.

A call of a head dim or dtype such a build left out raises a RuntimeError that says so.
The tests report it as a skip (conftest.py) and scripts/sanitize_*.py count it and go on,
so that a build of one head dim runs what it serves. On a build of every kernel the same
error stays an error: nothing may be missing there.
"""

# setup.py ends build_info with the first on a reduced build; the C++
# launchers' refusal of a left-out head dim or dtype contains the second.
REDUCED_KERNEL_SET_MARK = "reduced kernel set"
LEFT_OUT_MESSAGE = "which this build left out"


def left_out_reason(error, build_info):
    """The build's refusal, when `error` or an error behind it refuses a kernel
    that a reduced build (`build_info` from flash_attn_cuda) left out; None for
    any other error. Behind it: its cause (torch.library.opcheck raises its own
    error from the op's) or the error it was raised while handling
    (`pytest.raises(RuntimeError, match=...)` fails with an AssertionError when
    the call is refused before the check the test expects)."""
    if REDUCED_KERNEL_SET_MARK not in (build_info or ""):
        return None
    while error is not None:
        if isinstance(error, RuntimeError):
            reason = next(
                (line.strip() for line in str(error).splitlines() if LEFT_OUT_MESSAGE in line), None
            )
            if reason is not None:
                return reason
        error = error.__cause__ or error.__context__
    return None
