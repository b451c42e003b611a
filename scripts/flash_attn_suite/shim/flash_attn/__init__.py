"""flash-attn 2.x's import names, answered by flash_attn_cuda.

This folder exists only to run flash-attn's own test file against
flash_attn_cuda (see scripts/flash_attn_suite/README.md): run.sh puts it first
on PYTHONPATH for that run. It is not a distribution and has no metadata, so
pip and importlib.metadata never see a "flash-attn" installed; do not install
it or put it on a path that other programs use.
"""

from flash_attn_cuda import (  # noqa: F401
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]
