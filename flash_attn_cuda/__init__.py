"""flash_attn_cuda: FlashAttention-2 forward and backward for PyTorch.

A drop-in replacement for the flash-attn 2.x Python API (same functions,
arguments, layouts and results), backed by the ``torch.ops.flash_attn`` ops:
CUDA kernels when the package was built with CUDA, and a CPU implementation
everywhere.
"""

__version__ = "0.1.0"

import torch  # noqa: F401  (the extension links against torch's libraries)

try:
    # Registers the ops (torch.ops.flash_attn.*) and their CPU / CUDA kernels.
    from . import _C
except ImportError as exc:  # pragma: no cover - depends on the build
    raise ImportError(
        "flash_attn_cuda: the compiled extension flash_attn_cuda._C could not be loaded "
        f"({exc}). Build it from the repository root with `pip install --no-build-isolation "
        "-e .` (set FLASH_ATTN_SKIP_CUDA_BUILD=1 for a CPU-only build), using the same torch "
        "version that is installed now."
    ) from exc

from . import integrations  # noqa: E402
from . import ops as _ops  # noqa: E402,F401  (registers the fake kernels)
from .index_checks import check_index_errors, set_sync_index_checks  # noqa: E402
from .interface import (  # noqa: E402
    _get_block_size_n,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

# Makes "FLASH_ATTN_CUDA" known to torch.nn.attention's flash-attention registry
# (torch >= 2.10); it stays inactive until the user calls
# torch.nn.attention.activate_flash_attention_impl("FLASH_ATTN_CUDA").
integrations.register_provider()

# True when the CUDA kernels were compiled into this build.
cuda_built = bool(getattr(_C, "cuda_built", False))
# What this build contains (archs, head dims, dtypes), as reported by the extension.
build_info = getattr(_C, "build_info", None)

__all__ = [
    "__version__",
    "_get_block_size_n",
    "build_info",
    "check_index_errors",
    "cuda_built",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "integrations",
    "set_sync_index_checks",
]
