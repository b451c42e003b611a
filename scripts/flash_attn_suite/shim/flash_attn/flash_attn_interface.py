"""flash_attn.flash_attn_interface for the test shim.

The public functions are flash_attn_cuda's. The private forward functions that
flash-attn's tests call keep flash-attn 2.x's signatures and return
(out, softmax_lse, S_dmask, rng_state), calling torch.ops.flash_attn.* the way
flash_attn_cuda's own autograd functions do. What flash_attn_cuda cannot do
raises instead of being ignored.
"""

import torch

from flash_attn_cuda import (  # noqa: F401
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)
from flash_attn_cuda.interface import _attention_window, _draw_rng_state

# flash_attn_cuda is the CUDA build; there is no Triton / ROCm path to test.
USE_TRITON_ROCM = False

try:
    from flash_attn_cuda import _get_block_size_n
except ImportError:

    def _get_block_size_n(device, head_dim, is_dropout, is_causal):
        """Stand-in for a flash_attn_cuda without _get_block_size_n.

        The tests use the width to turn S_dmask back into probabilities, which
        is only exact when the package writes S_dmask in flash-attn's blocked
        convention with this width (64 keys in flash_attn_cuda); older builds
        returned normalised probabilities, for which the attn checks of the
        dropout tests fail whatever width is given.
        """
        return 64


def _contiguous_last_dim(t):
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def _flash_attn_forward(
    q,
    k,
    v,
    dropout_p,
    softmax_scale,
    causal,
    window_size_left=-1,
    window_size_right=-1,
    softcap=0.0,
    alibi_slopes=None,
    return_softmax=False,
):
    """Fixed-length forward: (out, softmax_lse, S_dmask, rng_state)."""
    q, k, v = (_contiguous_last_dim(t) for t in (q, k, v))
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    left, right = _attention_window(causal, (window_size_left, window_size_right))
    return torch.ops.flash_attn.fwd(
        q,
        k,
        v,
        alibi_slopes,
        dropout_p,
        softmax_scale,
        causal,
        left,
        right,
        softcap,
        return_softmax and dropout_p > 0.0,
        0,
        0,
        _draw_rng_state(dropout_p, q.device),
    )


def _flash_attn_varlen_forward(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p,
    softmax_scale,
    causal,
    window_size_left=-1,
    window_size_right=-1,
    softcap=0.0,
    alibi_slopes=None,
    return_softmax=False,
    block_table=None,
    leftpad_k=None,
    seqused_k=None,
    zero_tensors=False,
    num_splits=0,
):
    """Varlen forward: (out, softmax_lse, S_dmask, rng_state).

    seqused_k is supported with a paged cache (block_table), where it only
    gives each sequence's key count: it replaces the lengths of cu_seqlens_k.
    zero_tensors only zero-filled outputs before the kernel in flash-attn;
    it changes no result. num_splits 0 and 1 are accepted (the varlen
    forward chooses no split-KV); leftpad_k is not supported.
    """
    if leftpad_k is not None:
        raise NotImplementedError("flash_attn_cuda's varlen forward has no leftpad_k")
    if num_splits > 1:
        raise RuntimeError(
            f"num_splits > 1 is not supported by flash_attn_cuda's varlen forward "
            f"(got {num_splits})"
        )
    if seqused_k is not None:
        if block_table is None:
            raise NotImplementedError(
                "flash_attn_cuda's varlen forward supports seqused_k only "
                "with block_table (a paged cache)"
            )
        cu_seqlens_k = torch.nn.functional.pad(seqused_k.cumsum(0, dtype=torch.int32), (1, 0))
    q, k, v = (_contiguous_last_dim(t) for t in (q, k, v))
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    left, right = _attention_window(causal, (window_size_left, window_size_right))
    return torch.ops.flash_attn.varlen_fwd(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        block_table,
        alibi_slopes,
        int(max_seqlen_q),
        int(max_seqlen_k),
        dropout_p,
        softmax_scale,
        causal,
        left,
        right,
        softcap,
        return_softmax and dropout_p > 0.0,
        0,
        0,
        _draw_rng_state(dropout_p, q.device),
    )
