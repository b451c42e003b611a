"""flash_attn_cuda: FlashAttention-2 forward and backward for PyTorch.

A drop-in replacement for the flash-attn 2.x Python API (same functions,
arguments, layouts and results), backed by the ``torch.ops.flash_attn`` ops:
CUDA kernels when the package was built with CUDA, and a CPU implementation
everywhere.
"""

__version__ = "0.1.0"

import torch  # noqa: F401  (the extension links against torch's libraries)


def _no_extension_message() -> str | None:
    """Why the import fails when this folder holds no built extension at all, or None
    when one is there (and failed to load for another reason).

    The usual case: `pip install .` from a checkout, then Python started in the checkout.
    Python looks in the current directory first, so it finds the sources in
    flash_attn_cuda/, not the installed copy, and `from . import _C` then fails with a
    misleading "circular import".
    """
    import importlib.machinery
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    if any(
        os.path.exists(os.path.join(here, "_C" + suffix))
        for suffix in importlib.machinery.EXTENSION_SUFFIXES
    ):
        return None
    parent = os.path.dirname(here)
    installed = [
        os.path.join(entry, __name__)
        for entry in sys.path
        if os.path.realpath(entry or os.curdir) != os.path.realpath(parent)
        and os.path.isfile(os.path.join(entry or os.curdir, __name__, "__init__.py"))
    ]
    if os.path.isfile(os.path.join(parent, "setup.py")) and installed:
        return (
            f"flash_attn_cuda: imported from the source tree {here}, which has no built "
            f"extension (_C), instead of the installed package at {installed[0]}: Python "
            "searches the current directory (or the script's) first, so the sources shadow "
            "the install. Run Python from another directory to use the installed package, or "
            "build the extension in place with `pip install --no-build-isolation -e .` in "
            f"{parent} (FLASH_ATTN_SKIP_CUDA_BUILD=1 for a CPU-only build)."
        )
    return (
        f"flash_attn_cuda: {here} has no built extension (_C): the package has not been "
        "built. Build it from the repository root with `pip install --no-build-isolation -e .` "
        "(FLASH_ATTN_SKIP_CUDA_BUILD=1 for a CPU-only build), or install it with "
        "`pip install --no-build-isolation .` and import it from another directory."
    )


try:
    # Registers the ops (torch.ops.flash_attn.*) and their CPU / CUDA kernels.
    from . import _C
except ImportError as exc:  # pragma: no cover - depends on the build
    message = _no_extension_message()
    if message is not None:
        # The original error ("cannot import name '_C' ... circular import") adds nothing.
        raise ImportError(message) from None
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
    flash_attn_combine,
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
    "flash_attn_combine",
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
