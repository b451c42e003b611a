"""flash_attn.bert_padding for the test shim: packing padded batches for the varlen API.

Plain torch (index_select / index_copy), so gradients flow through both
directions, which the tests rely on.
"""

import torch
import torch.nn.functional as F


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """Keeps the tokens that the mask marks, packed one sequence after another.

    Args:
        hidden_states: (batch, seqlen, ...).
        attention_mask: bool or 0/1 (batch, seqlen): the tokens that count.
        unused_mask: optional bool (batch, seqlen): tokens that are kept in the
            packed tensor but not counted in seqused (allocated, not used).

    Returns:
        (packed (total, ...), indices (total,) of the kept tokens in the
        flattened (batch * seqlen) order, cu_seqlens int32 (batch + 1,),
        max_seqlen (int), seqused int32 (batch,): the counted tokens of each
        sequence).
    """
    kept = attention_mask.bool()
    if unused_mask is not None:
        kept = kept | unused_mask.bool()
    seqlens = kept.sum(dim=-1, dtype=torch.int32)
    seqused = attention_mask.bool().sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(kept.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    max_seqlen = int(seqlens.max().item()) if seqlens.numel() else 0
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat.index_select(0, indices), indices, cu_seqlens, max_seqlen, seqused


def pad_input(hidden_states, indices, batch, seqlen):
    """The inverse of unpad_input: (total, ...) -> (batch, seqlen, ...), zeros elsewhere."""
    rest = hidden_states.shape[1:]
    out = hidden_states.new_zeros((batch * seqlen, *rest))
    out = out.index_copy(0, indices, hidden_states)
    return out.reshape(batch, seqlen, *rest)
