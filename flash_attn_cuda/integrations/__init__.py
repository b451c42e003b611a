"""Ways for code that does not call flash_attn_cuda directly to reach its kernels.

- ``sdpa``: the "FLASH_ATTN_CUDA" provider of PyTorch's flash-attention registry
  (torch 2.10 and later). Importing flash_attn_cuda registers it; the user
  activates it with ``torch.nn.attention.activate_flash_attention_impl("FLASH_ATTN_CUDA")``
  and ``F.scaled_dot_product_attention`` (FLASH backend), ``varlen_attn`` and
  context parallelism then run on the ``torch.ops.flash_attn`` ops.
  See docs/integrations.md.
- ``transformers``: ``attn_implementation="flash_attn_cuda"`` for transformers v5;
  imported on demand (``import flash_attn_cuda.integrations.transformers``), not here.
"""

from . import sdpa
from .sdpa import PROVIDER_NAME, UnsupportedAttentionCall, register_provider

__all__ = ["PROVIDER_NAME", "UnsupportedAttentionCall", "register_provider", "sdpa"]
