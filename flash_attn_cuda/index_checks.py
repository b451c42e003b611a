"""When the CUDA path reports a bad value inside an index tensor.

The values inside ``cu_seqlens_q`` / ``cu_seqlens_k``, ``cache_seqlens``,
``cache_leftpad``, ``cache_batch_idx`` and ``block_table`` live on the GPU. The
CUDA kernels never follow a bad one outside the tensors they were given: they
clamp it, and record the first one they meet on the device. Reading that record
at the call would cost a device-to-host synchronisation per call, so by default
it is raised by the next ``flash_attn_cuda`` call on the same device (a
``RuntimeError`` with the CPU path's message, naming the argument, the index,
the value and the bound). Two ways to have it raised at the call instead:

* ``check_index_errors()`` waits for the device and raises what was recorded;
* ``set_sync_index_checks(True)`` (or ``FLASH_ATTN_CUDA_SYNC_INDEX_CHECKS=1`` in
  the environment) makes every call that reads index tensors wait for its
  stream and raise its own error, at the cost of that synchronisation.

Inside CUDA graph capture nothing is waited for or raised: the kernels clamp
and record, and the first call outside capture raises. The CPU path checks the
values on the host and raises at the call. docs/memory_safety.md has the rules.
"""

from __future__ import annotations

import torch

__all__ = ["check_index_errors", "set_sync_index_checks"]


def check_index_errors(device: torch.device | str | int | None = None) -> None:
    """Waits for ``device`` (default: the current CUDA device) and raises a
    ``RuntimeError`` for the first bad index value a kernel recorded there since
    the last report; returns ``None`` when there is none, or no GPU."""
    if not torch.cuda.is_available():
        return
    if device is None:
        index = torch.cuda.current_device()
    else:
        index = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if index.type != "cuda":
            raise ValueError(f"check_index_errors: device must be a CUDA device, got {index}")
        index = index.index if index.index is not None else torch.cuda.current_device()
    torch.ops.flash_attn.check_index_errors(index)


def set_sync_index_checks(enabled: bool) -> bool:
    """Makes every CUDA call that reads index tensors wait for its stream and
    raise its own bad index value (``True``), or leaves the report to the next
    call (``False``, the default). Returns the previous setting."""
    return bool(torch.ops.flash_attn.set_sync_index_checks(bool(enabled)))
