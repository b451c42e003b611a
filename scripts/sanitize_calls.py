"""What the scripts/sanitize_*.py call sets share (not a pytest module).

On a build with a reduced kernel set (FLASH_ATTN_CUDA_HDIMS / _DTYPES) a call of a head dim
or dtype the build left out is skipped and counted (tests/reduced_build.py tells that
refusal apart from any other error), so that a build of one head dim runs, under the
sanitizers, every call it serves; `summary` says how many were left out. On a build of
every kernel the refusal stays an error.
"""

import functools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from reduced_build import left_out_reason  # noqa: E402

import flash_attn_cuda  # noqa: E402

_left_out: list[str] = []


def skips_left_out(call):
    """`call`, returning None instead of raising where the build left its kernel out."""

    @functools.wraps(call)
    def wrapper(*args, **kwargs):
        try:
            return call(*args, **kwargs)
        except RuntimeError as error:
            reason = left_out_reason(error, flash_attn_cuda.build_info)
            if reason is None:
                raise
            _left_out.append(reason)
            return None

    return wrapper


def summary(script):
    """The script's last line: all calls completed, or how many the build left out."""
    if not _left_out:
        return f"{script}: all calls completed"
    return (
        f"{script}: all calls completed but {len(_left_out)} of kernels this reduced build "
        f"left out (the first: {_left_out[0]})"
    )
