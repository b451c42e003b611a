"""flash_attn.layers.rotary for the test shim: the rotary embedding as a reference.

Computed in fp32 and returned in the input's dtype; the tests use it to build
the expected result of flash_attn_with_kvcache's rotary path.
"""

import torch


def _positions(x, seqlen_offsets, cu_seqlens):
    """Position of every token: (batch, seqlen) or, with cu_seqlens, (total,)."""
    device = x.device
    if cu_seqlens is None:
        batch, seqlen = x.shape[:2]
        pos = torch.arange(seqlen, device=device).expand(batch, seqlen)
        if isinstance(seqlen_offsets, torch.Tensor):
            return pos + seqlen_offsets.to(device=device, dtype=torch.long).reshape(batch, 1)
        return pos + int(seqlen_offsets)
    total = x.shape[0]
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    token = torch.arange(total, device=device)
    seq = torch.searchsorted(cu[1:], token, right=True)  # which sequence each token is in
    pos = token - cu[seq]
    if isinstance(seqlen_offsets, torch.Tensor):
        return pos + seqlen_offsets.to(device=device, dtype=torch.long)[seq]
    return pos + int(seqlen_offsets)


def apply_rotary_emb(
    x,
    cos,
    sin,
    interleaved=False,
    inplace=False,
    seqlen_offsets=0,
    cu_seqlens=None,
    max_seqlen=None,
):
    """Rotates the first rotary_dim = 2 * cos.shape[-1] features of every head.

    Args:
        x: (batch, seqlen, nheads, headdim), or (total, nheads, headdim) with
            cu_seqlens.
        cos, sin: (seqlen_rotary, rotary_dim / 2): row p is position p. A
            position past the table is left unrotated.
        interleaved: True rotates pairs (0, 1), (2, 3), ... (GPT-J); False
            rotates (i, i + rotary_dim / 2) (GPT-NeoX).
        inplace: write the result into x and return x.
        seqlen_offsets: int, or (batch,) int tensor: the position of each
            sequence's first token.
        cu_seqlens: optional (batch + 1,) int32 for a packed x.
        max_seqlen: accepted for compatibility; not needed.
    """
    del max_seqlen
    half = cos.shape[-1]
    rotary_dim = 2 * half
    if rotary_dim > x.shape[-1]:
        raise ValueError(f"rotary_dim {rotary_dim} is larger than the head dim {x.shape[-1]}")
    table_len = cos.shape[0]
    pos = _positions(x, seqlen_offsets, cu_seqlens)
    inside = pos < table_len
    pos = pos.clamp(max=table_len - 1)
    cos_p = torch.where(inside[..., None], cos.float()[pos], 1.0)  # (..., half)
    sin_p = torch.where(inside[..., None], sin.float()[pos], 0.0)
    cos_p, sin_p = cos_p.unsqueeze(-2), sin_p.unsqueeze(-2)  # broadcast over heads

    rot = x[..., :rotary_dim].float()
    if interleaved:
        first, second = rot[..., 0::2], rot[..., 1::2]
    else:
        first, second = rot[..., :half], rot[..., half:]
    out_first = first * cos_p - second * sin_p
    out_second = first * sin_p + second * cos_p
    if interleaved:
        rotated = torch.stack((out_first, out_second), dim=-1).flatten(-2)
    else:
        rotated = torch.cat((out_first, out_second), dim=-1)

    out = x if inplace else x.clone()
    out[..., :rotary_dim] = rotated.to(x.dtype)
    return out
