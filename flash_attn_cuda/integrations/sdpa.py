"""The "FLASH_ATTN_CUDA" provider for PyTorch's flash-attention registry.

PyTorch (2.10 and later) lets a package replace the kernels behind its FLASH
attention backend: the package registers a ``register_fn`` under a name with
``torch.nn.attention.register_flash_attention_impl``, and the user opts in with
``torch.nn.attention.activate_flash_attention_impl(name)``. Activation calls the
``register_fn``, which here installs the functions of this module as the CUDA
kernels of the aten ops below; ``restore_flash_attention_impl()`` removes them,
so the built-in kernels serve the ops again.

===============================================  ==================================
aten op                                          what calls it
===============================================  ==================================
``_scaled_dot_product_flash_attention``          ``F.scaled_dot_product_attention``
                                                 (FLASH backend), context parallel
``_scaled_dot_product_flash_attention_backward``  its autograd formula
``_flash_attention_forward``                     ``varlen_attn``, dense or varlen
``_flash_attention_backward``                    its autograd formula
``_flash_attention_forward_no_dropout_inplace``  ``varlen_attn_out`` (where torch
                                                 has it)
===============================================  ==================================

Each override turns its arguments into one call of a ``torch.ops.flash_attn``
op: SDPA's ``(batch, nheads, seqlen, head_dim)`` tensors become
``(batch, seqlen, nheads, head_dim)`` views with ``transpose(1, 2)`` (no copy),
GQA key/value heads go to the op as they are, the logsumexp comes back as
``(batch, nheads, seqlen_q)`` (varlen: ``(nheads, total_q)``) in fp32, and the
dropout state travels as torch does it: a uint64 ``rng_state = [seed, offset]``
that the forward returns and the backward receives, from which our backward op
regenerates the forward's mask. The overrides are plain functions of tensors,
so they can also be called directly, with CPU tensors (the CPU path of the ops),
which is how the tests without a GPU check them.

The keyword arguments of these aten ops grew over torch releases
(``window_size_left/right``, ``seqused_k``, ``alibi_slopes``, ``block_table``,
``num_splits``). The overrides accept each of them where the installed torch
passes it; a keyword argument that a later torch adds and this module does not
know is accepted only while it is ``None`` and otherwise raises, naming it.
A call the ops cannot serve raises ``UnsupportedAttentionCall`` with the
argument's name; it never falls back silently to another kernel.
"""

from __future__ import annotations

import operator
import os
import re
import warnings
from typing import Callable, Dict, List, Optional, Sequence

import torch

from ..interface import _draw_rng_state, _prepare, _unpad_head_dim

__all__ = [
    "PROVIDER_NAME",
    "UnsupportedAttentionCall",
    "flash_attention_backward",
    "flash_attention_forward",
    "flash_attention_forward_no_dropout_inplace",
    "register_provider",
    "registry_available",
    "scaled_dot_product_flash_attention",
    "scaled_dot_product_flash_attention_backward",
]

PROVIDER_NAME = "FLASH_ATTN_CUDA"

_MAX_HEAD_DIM = 256


class UnsupportedAttentionCall(RuntimeError):
    """A call of an overridden aten op that the flash_attn ops cannot serve."""


def _unsupported(op: str, message: str) -> UnsupportedAttentionCall:
    return UnsupportedAttentionCall(f"{PROVIDER_NAME} provider, aten::{op}: {message}")


def _reject_unknown(op: str, extra: Dict[str, object]) -> None:
    # A keyword argument a newer torch added: harmless while it keeps its
    # default (None); anything else might change the result, so refuse it.
    for name, value in extra.items():
        if value is not None:
            raise _unsupported(
                op, f"argument {name}={value!r} is not supported (unknown to this provider)"
            )


def _window(value: Optional[int], name: str) -> int:
    if value is None:
        return -1
    try:
        return operator.index(value)
    except TypeError:
        # A fraction of a key has no meaning; truncating it would hide the caller's mistake.
        raise TypeError(
            f"{PROVIDER_NAME} provider: {name} must be an int (-1 for no bound), got {value!r}"
        ) from None


# ---------------------------------------------------------------------------
# Layout and dropout-state conversions
# ---------------------------------------------------------------------------


def _bshd(t: torch.Tensor) -> torch.Tensor:
    # (batch, nheads, seqlen, head_dim) <-> (batch, seqlen, nheads, head_dim): a view.
    return t.transpose(1, 2)


# The strides of empty_like(t) by (t.shape, t.stride()), of which they are a
# function: a meta empty_like per output per call cost more host time than the
# rest of _in_layout_of. Bounded: cleared when full.
_EMPTY_LIKE_STRIDES: Dict[tuple, tuple] = {}
_EMPTY_LIKE_STRIDES_MAX = 512


def _empty_like_strides(like: torch.Tensor) -> tuple:
    key = (like.shape, like.stride())
    try:
        return _EMPTY_LIKE_STRIDES[key]
    except KeyError:
        pass
    except TypeError:  # symbolic sizes are not hashable: no cache
        return torch.empty_like(like, device="meta").stride()
    strides = torch.empty_like(like, device="meta").stride()
    if len(_EMPTY_LIKE_STRIDES) >= _EMPTY_LIKE_STRIDES_MAX:
        _EMPTY_LIKE_STRIDES.clear()
    _EMPTY_LIKE_STRIDES[key] = strides
    return strides


def _in_layout_of(result: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`result` with the strides torch's kernels (and meta functions) give: those
    of ``empty_like(like)``. torch.compile checks the strides of an op's outputs
    against its meta function, so a result in another layout is copied once."""
    if result.shape != like.shape:
        raise AssertionError(f"shape {tuple(result.shape)} != {tuple(like.shape)}")
    expected = _empty_like_strides(like)
    if result.stride() == expected:
        return result
    if all(n == 1 or a == b for n, a, b in zip(result.shape, result.stride(), expected)):
        # Only dims of size 1 differ: the same memory under the expected strides.
        return result.as_strided(result.shape, expected)
    target = torch.empty_like(like)
    target.copy_(result)
    return target


def _to_torch_rng_state(rng_state: torch.Tensor):
    """Our int64 [seed, offset] as torch's pair: (uint64 (2,), uint64 ()).

    rng_state is what the forward ops return: int64 (2,) on q's device (zeros
    without dropout). The second tensor is never read (the backward overrides
    take the pair from the first; torch's own kernels return it uninitialized
    too), so it is allocated without a fill kernel."""
    seed_offset = rng_state.view(torch.uint64)
    unused = torch.empty((), dtype=torch.uint64, device=rng_state.device)
    return seed_offset, unused


def _from_torch_rng_state(
    op: str,
    dropout_p: float,
    philox_seed: Optional[torch.Tensor],
    philox_offset: Optional[torch.Tensor],
) -> Optional[torch.Tensor]:
    """torch's dropout state as our int64 [seed, offset]; None without dropout."""
    if dropout_p == 0.0:
        return None
    if philox_seed is None:
        raise _unsupported(op, "dropout_p > 0 needs the rng_state the forward returned")
    if philox_seed.numel() == 2 and philox_seed.dtype in (torch.uint64, torch.int64):
        return philox_seed.reshape(2).view(torch.int64)
    if (
        philox_seed.numel() == 1 and philox_offset is not None and philox_offset.numel() == 1
    ):  # a separate seed and offset (torch's older convention)
        return torch.stack([philox_seed.reshape(()), philox_offset.reshape(())]).to(torch.int64)
    raise _unsupported(
        op,
        "rng_state must be the uint64 [seed, offset] pair the forward returned, got dtype "
        f"{philox_seed.dtype} and shape {tuple(philox_seed.shape)}",
    )


# ---------------------------------------------------------------------------
# Argument checks shared by the overrides
# ---------------------------------------------------------------------------


def _check_qkv(op: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    head_dim = query.shape[-1]
    if key.shape[-1] != head_dim or value.shape[-1] != head_dim:
        raise _unsupported(
            op,
            "query, key and value must share one head dim, got "
            f"{head_dim}, {key.shape[-1]} and {value.shape[-1]}",
        )
    if head_dim > _MAX_HEAD_DIM:
        raise _unsupported(op, f"head dim must be at most {_MAX_HEAD_DIM}, got {head_dim}")
    if head_dim < 1:
        raise _unsupported(op, f"head dim must be at least 1, got {head_dim}")


def _check_dropout(op: str, dropout_p: float) -> None:
    if not 0.0 <= dropout_p < 1.0:
        raise _unsupported(op, f"dropout_p must be in [0, 1), got {dropout_p}")


def _check_no_debug_mask(op: str, return_debug_mask: bool) -> None:
    if return_debug_mask:
        raise _unsupported(
            op,
            "return_debug_mask=True is not supported (torch's debug mask has a layout of "
            "its own kernels; use flash_attn_cuda.flash_attn_func(..., return_attn_probs=True))",
        )


def _check_alibi_no_grad(op: str, alibi_slopes, tensors: Sequence[torch.Tensor]) -> None:
    # The backward ops' schemas have no alibi_slopes: a gradient of an ALiBi
    # forward taken through them would silently drop the bias. Refuse it here.
    if alibi_slopes is None:
        return
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise _unsupported(
            op,
            "alibi_slopes with inputs that require grad: aten::_flash_attention_backward takes "
            "no alibi_slopes, so its gradient would be wrong; use "
            "flash_attn_cuda.flash_attn_func(..., alibi_slopes=...) for training with ALiBi",
        )


def _softmax_scale(scale: Optional[float], head_dim: int) -> float:
    return head_dim ** (-0.5) if scale is None else float(scale)


# ---------------------------------------------------------------------------
# The two shapes of call: fixed length (BSHD) and varlen ((total, H, D))
# ---------------------------------------------------------------------------


def _forward_dense(q, k, v, dropout_p, causal, scale, left, right, alibi_slopes):
    """(out, lse, rng_state, empty debug mask): with return_softmax=False the
    op's S_dmask is an empty (0,) tensor of q's dtype and device, which is what
    torch's kernels return as debug_attn_mask, so it serves as one."""
    head_dim = q.shape[-1]
    out, lse, s_dmask, rng_state = torch.ops.flash_attn.fwd(
        _prepare(q),
        _prepare(k),
        _prepare(v),
        alibi_slopes,
        float(dropout_p),
        _softmax_scale(scale, head_dim),
        bool(causal),
        left,
        right,
        0.0,
        False,
        0,
        0,
        _draw_rng_state(dropout_p, q.device),
    )
    return _unpad_head_dim(out, head_dim), lse, rng_state, s_dmask


def _backward_dense(dout, q, k, v, out, lse, dropout_p, causal, scale, left, right, rng_state):
    head_dim = q.shape[-1]
    dq, dk, dv = torch.ops.flash_attn.bwd(
        _prepare(dout),
        _prepare(q),
        _prepare(k),
        _prepare(v),
        _prepare(out),
        lse.contiguous(),
        None,
        float(dropout_p),
        _softmax_scale(scale, head_dim),
        bool(causal),
        left,
        right,
        0.0,
        torch.are_deterministic_algorithms_enabled(),
        rng_state,
    )
    return tuple(_unpad_head_dim(g, head_dim) for g in (dq, dk, dv))


def _keys_in_use(op, k, v, cu_seq_k, seqused_k):
    """Packed K/V holding only the first seqused_k[b] keys of each sequence, and
    their cu_seqlens. A gather, although varlen_fwd / varlen_bwd take seqused_k:
    torch's aten::_flash_attention_backward passes no seqused_k, so the forward
    and the backward both run on the gathered keys."""
    if cu_seq_k is None:
        raise _unsupported(op, "seqused_k needs cum_seq_k (the start of each sequence's keys)")
    if seqused_k.dim() != 1 or seqused_k.numel() != cu_seq_k.numel() - 1:
        raise _unsupported(
            op,
            f"seqused_k must have shape (batch,) = ({cu_seq_k.numel() - 1},), got "
            f"{tuple(seqused_k.shape)}",
        )
    starts = cu_seq_k[:-1].long()
    lengths = seqused_k.to(device=cu_seq_k.device).long()
    capacity = cu_seq_k[1:].long() - starts
    if bool(((lengths < 0) | (lengths > capacity)).any()):
        raise _unsupported(
            op, "seqused_k must lie in [0, cum_seq_k[b + 1] - cum_seq_k[b]] for every b"
        )
    total = int(lengths.sum())
    new_cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=cu_seq_k.device)
    torch.cumsum(lengths, 0, out=new_cu[1:])
    shift = torch.repeat_interleave(starts - new_cu[:-1].long(), lengths, output_size=total)
    index = torch.arange(total, device=cu_seq_k.device) + shift
    return k.index_select(0, index), v.index_select(0, index), new_cu


def _forward_varlen(
    op,
    q,
    k,
    v,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    dropout_p,
    causal,
    scale,
    left,
    right,
    alibi_slopes,
    seqused_k,
    block_table,
    num_splits,
):
    if block_table is not None:
        if seqused_k is not None:  # paged keys: only the lengths matter
            lengths = seqused_k.to(torch.int32)
            cu_seq_k = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=q.device)
            torch.cumsum(lengths, 0, out=cu_seq_k[1:])
    elif seqused_k is not None:
        k, v, cu_seq_k = _keys_in_use(op, k, v, cu_seq_k, seqused_k)
    if cu_seq_k is None:
        raise _unsupported(
            op, "cum_seq_k is required with cum_seq_q (or block_table with seqused_k)"
        )
    head_dim = q.shape[-1]
    out, lse, s_dmask, rng_state = torch.ops.flash_attn.varlen_fwd(
        _prepare(q),
        _prepare(k),
        _prepare(v),
        cu_seq_q,
        cu_seq_k,
        block_table,
        alibi_slopes,
        int(max_q),
        int(max_k),
        float(dropout_p),
        _softmax_scale(scale, head_dim),
        bool(causal),
        left,
        right,
        0.0,
        False,
        0,
        0,
        _draw_rng_state(dropout_p, q.device),
        # None: the op's choice (decode-like calls split); 1 keeps one split.
        num_splits=0 if num_splits is None else int(num_splits),
    )
    return _unpad_head_dim(out, head_dim), lse, rng_state, s_dmask


def _backward_varlen(
    dout,
    q,
    k,
    v,
    out,
    lse,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    dropout_p,
    causal,
    scale,
    left,
    right,
    rng_state,
):
    head_dim = q.shape[-1]
    dq, dk, dv = torch.ops.flash_attn.varlen_bwd(
        _prepare(dout),
        _prepare(q),
        _prepare(k),
        _prepare(v),
        _prepare(out),
        lse.contiguous(),
        cu_seq_q,
        cu_seq_k,
        None,
        int(max_q),
        int(max_k),
        float(dropout_p),
        _softmax_scale(scale, head_dim),
        bool(causal),
        left,
        right,
        0.0,
        torch.are_deterministic_algorithms_enabled(),
        rng_state,
    )
    return tuple(_unpad_head_dim(g, head_dim) for g in (dq, dk, dv))


# ---------------------------------------------------------------------------
# The overrides, one per aten op
# ---------------------------------------------------------------------------


def scaled_dot_product_flash_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    return_debug_mask: bool = False,
    *,
    scale: Optional[float] = None,
    **extra,
):
    """aten::_scaled_dot_product_flash_attention on the flash_attn ops.

    query (batch, nheads, seqlen_q, head_dim), key / value (batch, nheads_k,
    seqlen_k, head_dim) with nheads a multiple of nheads_k. Returns torch's
    9-tuple: output (layout of query), logsumexp fp32 (batch, nheads,
    seqlen_q), cum_seq_q / cum_seq_k (None), max_q, max_k, rng_state (uint64
    [seed, offset]), unused (uint64 scalar), debug_attn_mask (empty).
    """
    op = "_scaled_dot_product_flash_attention"
    _reject_unknown(op, extra)
    _check_no_debug_mask(op, return_debug_mask)
    _check_dropout(op, dropout_p)
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 4:
            raise _unsupported(
                op,
                f"{name} must be 4-D (batch, nheads, seqlen, head_dim), got shape {tuple(t.shape)}",
            )
    _check_qkv(op, query, key, value)
    out, lse, rng_state, debug_mask = _forward_dense(
        _bshd(query), _bshd(key), _bshd(value), dropout_p, is_causal, scale, -1, -1, None
    )
    seed_offset, unused = _to_torch_rng_state(rng_state)
    return (
        _in_layout_of(_bshd(out), query),
        lse,
        None,
        None,
        query.shape[2],
        key.shape[2],
        seed_offset,
        unused,
        debug_mask,
    )


def scaled_dot_product_flash_attention_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    cum_seq_q: Optional[torch.Tensor],
    cum_seq_k: Optional[torch.Tensor],
    max_q: int,
    max_k: int,
    dropout_p: float,
    is_causal: bool,
    philox_seed: Optional[torch.Tensor],
    philox_offset: Optional[torch.Tensor],
    *,
    scale: Optional[float] = None,
    **extra,
):
    """aten::_scaled_dot_product_flash_attention_backward on flash_attn.bwd.

    Takes what the forward override returned (philox_seed is its rng_state) and
    returns (grad_query, grad_key, grad_value) in the layouts of query, key and
    value (GQA: grad_key / grad_value have nheads_k heads).
    """
    op = "_scaled_dot_product_flash_attention_backward"
    _reject_unknown(op, extra)
    del cum_seq_q, cum_seq_k, max_q, max_k  # fixed-length call: read from the shapes
    _check_dropout(op, dropout_p)
    _check_qkv(op, query, key, value)
    rng_state = _from_torch_rng_state(op, dropout_p, philox_seed, philox_offset)
    dq, dk, dv = _backward_dense(
        _bshd(grad_out),
        _bshd(query),
        _bshd(key),
        _bshd(value),
        _bshd(out),
        logsumexp,
        dropout_p,
        is_causal,
        scale,
        -1,
        -1,
        rng_state,
    )
    return (
        _in_layout_of(_bshd(dq), query),
        _in_layout_of(_bshd(dk), key),
        _in_layout_of(_bshd(dv), value),
    )


def flash_attention_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cum_seq_q: Optional[torch.Tensor],
    cum_seq_k: Optional[torch.Tensor],
    max_q: int,
    max_k: int,
    dropout_p: float,
    is_causal: bool,
    return_debug_mask: bool,
    *,
    scale: Optional[float] = None,
    window_size_left: Optional[int] = None,
    window_size_right: Optional[int] = None,
    seqused_k: Optional[torch.Tensor] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    num_splits: Optional[int] = None,
    **extra,
):
    """aten::_flash_attention_forward on flash_attn.fwd / flash_attn.varlen_fwd.

    Fixed length (cum_seq_q None): (batch, seqlen, nheads, head_dim), logsumexp
    (batch, nheads, seqlen_q). Varlen: (total, nheads, head_dim) with int32
    cum_seq_q / cum_seq_k, logsumexp (nheads, total_q); block_table (paged K/V)
    and seqused_k (only the first seqused_k[b] keys of sequence b) are varlen
    only. num_splits (varlen only; None lets the op choose) is varlen_fwd's:
    how many ways each sequence's keys are split, which changes the speed and
    the summation order, not the result beyond rounding (1: no split, the
    batch-invariant choice). The fixed-length path chooses its own. Returns
    (output, logsumexp, rng_state, unused, debug_attn_mask).
    """
    op = "_flash_attention_forward"
    _reject_unknown(op, extra)
    _check_no_debug_mask(op, return_debug_mask)
    _check_dropout(op, dropout_p)
    _check_alibi_no_grad(op, alibi_slopes, (query, key, value))
    if block_table is None:
        _check_qkv(op, query, key, value)
    left = _window(window_size_left, "window_size_left")
    right = _window(window_size_right, "window_size_right")
    if cum_seq_q is None:
        if query.dim() != 4:
            raise _unsupported(
                op,
                "query must be 4-D (batch, seqlen, nheads, head_dim) without cum_seq_q, "
                f"got shape {tuple(query.shape)}",
            )
        if block_table is not None or seqused_k is not None:
            name = "block_table" if block_table is not None else "seqused_k"
            raise _unsupported(op, f"{name} is supported only with cum_seq_q (varlen)")
        out, lse, rng_state, debug_mask = _forward_dense(
            query, key, value, dropout_p, is_causal, scale, left, right, alibi_slopes
        )
    else:
        out, lse, rng_state, debug_mask = _forward_varlen(
            op,
            query,
            key,
            value,
            cum_seq_q,
            cum_seq_k,
            max_q,
            max_k,
            dropout_p,
            is_causal,
            scale,
            left,
            right,
            alibi_slopes,
            seqused_k,
            block_table,
            num_splits,
        )
    seed_offset, unused = _to_torch_rng_state(rng_state)
    return _in_layout_of(out, query), lse, seed_offset, unused, debug_mask


def flash_attention_forward_no_dropout_inplace(
    out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cum_seq_q: Optional[torch.Tensor],
    cum_seq_k: Optional[torch.Tensor],
    max_q: int,
    max_k: int,
    dropout_p: float,
    is_causal: bool,
    return_debug_mask: bool,
    **kwargs,
):
    """aten::_flash_attention_forward_no_dropout_inplace: the forward written into
    `out`; returns the logsumexp."""
    op = "_flash_attention_forward_no_dropout_inplace"
    if dropout_p != 0.0:
        raise _unsupported(op, f"dropout_p must be 0, got {dropout_p}")
    result, lse, _, _, _ = flash_attention_forward(
        query,
        key,
        value,
        cum_seq_q,
        cum_seq_k,
        max_q,
        max_k,
        0.0,
        is_causal,
        return_debug_mask,
        **kwargs,
    )
    out.copy_(result)
    return lse


def flash_attention_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    cum_seq_q: Optional[torch.Tensor],
    cum_seq_k: Optional[torch.Tensor],
    max_q: int,
    max_k: int,
    dropout_p: float,
    is_causal: bool,
    rng_state: Optional[torch.Tensor],
    unused: Optional[torch.Tensor],
    *,
    scale: Optional[float] = None,
    window_size_left: Optional[int] = None,
    window_size_right: Optional[int] = None,
    **extra,
):
    """aten::_flash_attention_backward on flash_attn.bwd / flash_attn.varlen_bwd.

    Layouts as in flash_attention_forward; returns (grad_query, grad_key,
    grad_value) in the layouts of query, key and value.
    """
    op = "_flash_attention_backward"
    _reject_unknown(op, extra)
    _check_dropout(op, dropout_p)
    _check_qkv(op, query, key, value)
    state = _from_torch_rng_state(op, dropout_p, rng_state, unused)
    left = _window(window_size_left, "window_size_left")
    right = _window(window_size_right, "window_size_right")
    if cum_seq_q is None:
        grads = _backward_dense(
            grad_out,
            query,
            key,
            value,
            out,
            logsumexp,
            dropout_p,
            is_causal,
            scale,
            left,
            right,
            state,
        )
    else:
        if cum_seq_k is None:
            raise _unsupported(op, "cum_seq_k is required with cum_seq_q")
        grads = _backward_varlen(
            grad_out,
            query,
            key,
            value,
            out,
            logsumexp,
            cum_seq_q,
            cum_seq_k,
            max_q,
            max_k,
            dropout_p,
            is_causal,
            scale,
            left,
            right,
            state,
        )
    return tuple(_in_layout_of(g, t) for g, t in zip(grads, (query, key, value)))


# ---------------------------------------------------------------------------
# Registration with the dispatcher and with torch's registry
# ---------------------------------------------------------------------------

_OVERRIDES: Dict[str, Callable] = {
    "_scaled_dot_product_flash_attention": scaled_dot_product_flash_attention,
    "_scaled_dot_product_flash_attention_backward": scaled_dot_product_flash_attention_backward,
    "_flash_attention_forward": flash_attention_forward,
    "_flash_attention_backward": flash_attention_backward,
    "_flash_attention_forward_no_dropout_inplace": flash_attention_forward_no_dropout_inplace,
}


def overridden_ops() -> List[str]:
    """The aten ops (default overloads) the provider overrides in this torch."""
    return [name for name in _OVERRIDES if hasattr(torch.ops.aten, name)]


# aten::_scaled_dot_product_flash_attention, the op of every SDPA call, is served
# by a C++ kernel (csrc/ops/sdpa_flash_override.cpp) where this torch takes it: a
# Python kernel costs each call a trip from the dispatcher into Python and back
# (PERF_LOG 2026-11-29, per-call host cost). The C++ kernel hands every call it
# does not serve itself (dropout, a debug mask, padded head dims, anything to
# refuse) to flash_attn::_sdpa_flash_fallback, which runs the Python override
# above, so results and errors are the same. FLASH_ATTN_CUDA_SDPA_PYTHON=1 keeps
# the Python override registered instead (for an A/B of the two).
_CPP_KERNEL_OP = "_scaled_dot_product_flash_attention"


def _cpp_kernel_wanted() -> bool:
    return os.environ.get("FLASH_ATTN_CUDA_SDPA_PYTHON", "0") != "1" and hasattr(
        torch.ops.flash_attn, "_sdpa_flash_override"
    )


def _fallback(*args, **kwargs):
    # Looked up per call: the override in _OVERRIDES is the one installed.
    return _OVERRIDES[_CPP_KERNEL_OP](*args, **kwargs)


def _register_fallback() -> None:
    if not hasattr(torch.ops.flash_attn, "_sdpa_flash_fallback"):
        return
    global _FALLBACK_LIBRARY
    _FALLBACK_LIBRARY = torch.library.Library("flash_attn", "IMPL")
    _FALLBACK_LIBRARY.impl("_sdpa_flash_fallback", _fallback, "CompositeExplicitAutograd")


_FALLBACK_LIBRARY: Optional[torch.library.Library] = None
_register_fallback()


class _ProviderHandle:
    """What the registry keeps while the provider is active; remove() takes our
    kernels out of the dispatcher, which brings back torch's own."""

    def __init__(self, libraries: List[torch.library.Library], cpp_keys: Sequence[str] = ()):
        self.libraries = libraries
        self.cpp_keys = list(cpp_keys)

    def remove(self) -> None:
        for key in self.cpp_keys:
            torch.ops.flash_attn._sdpa_flash_override(key, False)
        self.cpp_keys = []
        for lib in self.libraries:
            destroy = getattr(lib, "_destroy", None)
            if destroy is not None:
                destroy()
        self.libraries = []


def _install(dispatch_keys: Sequence[str] = ("CUDA",)) -> _ProviderHandle:
    """Registers the overrides as the kernels of `dispatch_keys`.

    The provider uses ("CUDA",). The tests also pass "CPU" (where these aten
    ops have no kernel of their own) to run SDPA's autograd formulas, varlen_attn
    and context parallelism on the CPU path of the ops.
    """
    libraries, cpp_keys = [], []
    for key in dispatch_keys:
        lib = torch.library.Library("aten", "IMPL", key)
        with warnings.catch_warnings():
            # Replacing torch's kernel is the point; its "Overriding a previously
            # registered kernel" warning says nothing the user did not ask for.
            warnings.filterwarnings("ignore", message=".*[Oo]verrid.*")
            if (
                _cpp_kernel_wanted()
                and hasattr(torch.ops.aten, _CPP_KERNEL_OP)
                and torch.ops.flash_attn._sdpa_flash_override(key, True)
            ):
                cpp_keys.append(key)
            for name in overridden_ops():
                if not (name == _CPP_KERNEL_OP and key in cpp_keys):
                    lib.impl(name, _OVERRIDES[name], key)
        libraries.append(lib)
    return _ProviderHandle(libraries, cpp_keys)


def _arch_serves(arch: str, major: int, minor: int) -> bool:
    # Machine code for sm_XY runs on GPUs of major X and minor >= Y; an arch-specific
    # target (sm_90a) only on its own GPU. The build compiles no PTX (setup.py).
    match = re.fullmatch(r"sm_(\d+)(\d)([af]?)", arch)
    if match is None:
        return False
    arch_major, arch_minor, suffix = int(match.group(1)), int(match.group(2)), match.group(3)
    if suffix:
        return (arch_major, arch_minor) == (major, minor)
    return arch_major == major and arch_minor <= minor


def _cannot_serve() -> Optional[str]:
    """Why activating the provider here would not bring our kernels to any SDPA call, or
    None when it serves every visible GPU."""
    import flash_attn_cuda

    if not torch.cuda.is_available():
        return (
            "no CUDA GPU is visible (torch.cuda.is_available() is False); the provider "
            "replaces the CUDA kernels of SDPA's flash backend, so calls on CPU tensors keep "
            "torch's own kernels"
        )
    if not flash_attn_cuda.cuda_built:
        return (
            f"this build of flash_attn_cuda has no CUDA kernels ({flash_attn_cuda.build_info}), "
            "so SDPA flash-attention calls on CUDA tensors will raise; rebuild with a CUDA "
            "toolkit (README.md, 'Install')"
        )
    archs = re.search(r"archs ([\w,]+)", flash_attn_cuda.build_info or "")
    built = archs.group(1).split(",") if archs else []
    problems = []
    for index in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(index)
        name = f"cuda:{index} ({torch.cuda.get_device_name(index)}, sm_{major}{minor})"
        if major < 8:
            problems.append(f"{name} is older than sm80, which the kernels need")
        elif built and not any(_arch_serves(arch, major, minor) for arch in built):
            problems.append(
                f"{name} has no kernels in this build (archs {','.join(built)}); rebuild with "
                f"FLASH_ATTN_CUDA_ARCHS including it"
            )
    if problems:
        return "; ".join(problems) + ": SDPA flash-attention calls there will raise"
    return None


def _register_fn() -> _ProviderHandle:
    # What torch.nn.attention.activate_flash_attention_impl calls. Where the kernels
    # cannot serve, activation still installs them (a script that activates the provider
    # may run on CPU machines too) but says so, instead of leaving the user to find out
    # that nothing changed or that every call raises.
    reason = _cannot_serve()
    if reason is not None:
        warnings.warn(f"{PROVIDER_NAME} provider activated, but {reason}.", stacklevel=3)
    return _install(("CUDA",))


def registry_available() -> bool:
    """True when the installed torch has the flash-attention registry (2.10+)."""
    attention = getattr(torch.nn, "attention", None)
    return attention is not None and hasattr(attention, "register_flash_attention_impl")


def register_provider() -> bool:
    """Registers "FLASH_ATTN_CUDA" with torch's registry (never activates it).

    Called when flash_attn_cuda is imported; returns False, doing nothing, on a
    torch without the registry.
    """
    if not registry_available():
        return False
    torch.nn.attention.register_flash_attention_impl(PROVIDER_NAME, register_fn=_register_fn)
    return True
