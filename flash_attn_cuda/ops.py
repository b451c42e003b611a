"""Fake (meta) kernels for every op of the ``flash_attn`` library.

The real kernels live in C++ (CPU) and CUDA; these functions only describe the
outputs -- shapes, dtypes, devices, strides -- so that FakeTensor tracing,
``torch.compile`` and ``torch.library.opcheck`` can reason about the ops without
running them. Every output allocated here is contiguous, as the real kernels
allocate theirs. The schemas themselves are defined in csrc/flash_api.cpp.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = []  # nothing public: importing this module registers the kernels


def _contiguous_like(t: torch.Tensor) -> torch.Tensor:
    # new_empty always returns a contiguous tensor, whatever the strides of t.
    return t.new_empty(t.shape)


def _out_dtype(q: torch.Tensor) -> torch.dtype:
    # FP8 attention (q, k, v float8_e4m3fn) writes bfloat16 (docs/fp8.md);
    # every other forward writes q's dtype.
    return torch.bfloat16 if q.dtype == torch.float8_e4m3fn else q.dtype


def _out_like(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # out has q's shape with the head dim of v (d_v <= d_qk).
    return q.new_empty(q.shape[:-1] + v.shape[-1:], dtype=_out_dtype(q))


def _rng_state_like(q: torch.Tensor) -> torch.Tensor:
    return torch.empty((2,), dtype=torch.int64, device=q.device)


@torch.library.register_fake("flash_attn::fwd")
def _fwd_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    alibi_slopes: Optional[torch.Tensor],
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    return_softmax: bool,
    philox_seed: int,
    philox_offset: int,
    rng_state: Optional[torch.Tensor],
    *,
    learnable_sink: Optional[torch.Tensor] = None,
    q_descale: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
):
    return (_out_like(q, v),) + _fwd_results(q, k, return_softmax)


def _fwd_results(q, k, return_softmax):
    # (softmax_lse, S_dmask, rng_state) of fwd and fwd_out.
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k = k.shape[1]
    softmax_lse = q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)
    if return_softmax:
        s_dmask = q.new_empty((batch, nheads, seqlen_q, seqlen_k))
    else:
        s_dmask = q.new_empty((0,))
    return softmax_lse, s_dmask, _rng_state_like(q)


@torch.library.register_fake("flash_attn::fwd_out")
def _fwd_out_fake(*args, out: torch.Tensor, **kwargs):
    # fwd's arguments plus out, which the real kernel writes in place (schema
    # (a!)): fwd's results without the output.
    return _fwd_fake(*args, **kwargs)[1:]


@torch.library.register_fake("flash_attn::bwd")
def _bwd_fake(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    alibi_slopes: Optional[torch.Tensor],
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    deterministic: bool,
    rng_state: Optional[torch.Tensor],
    *,
    softmax_d: Optional[torch.Tensor] = None,
):
    # softmax_d, when given, is written in place (schema (a!)).
    return _contiguous_like(q), _contiguous_like(k), _contiguous_like(v)


@torch.library.register_fake("flash_attn::varlen_fwd")
def _varlen_fwd_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    block_table: Optional[torch.Tensor],
    alibi_slopes: Optional[torch.Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    return_softmax: bool,
    philox_seed: int,
    philox_offset: int,
    rng_state: Optional[torch.Tensor],
    *,
    seqused_k: Optional[torch.Tensor] = None,
    learnable_sink: Optional[torch.Tensor] = None,
    seqused_q: Optional[torch.Tensor] = None,
    num_splits: int = 0,
    q_descale: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
):
    lse, s_dmask, rng = _varlen_fwd_results(
        q, cu_seqlens_q, max_seqlen_q, max_seqlen_k, return_softmax
    )
    return _out_like(q, v), lse, s_dmask, rng


def _varlen_fwd_results(q, cu_seqlens_q, max_seqlen_q, max_seqlen_k, return_softmax):
    # (softmax_lse, S_dmask, rng_state) of varlen_fwd and varlen_fwd_out.
    total_q, nheads, _ = q.shape
    batch = cu_seqlens_q.shape[0] - 1
    softmax_lse = q.new_empty((nheads, total_q), dtype=torch.float32)
    if return_softmax:
        s_dmask = q.new_empty((batch, nheads, max_seqlen_q, max_seqlen_k))
    else:
        s_dmask = q.new_empty((0,))
    return softmax_lse, s_dmask, _rng_state_like(q)


@torch.library.register_fake("flash_attn::varlen_fwd_out")
def _varlen_fwd_out_fake(*args, out: torch.Tensor, **kwargs):
    # varlen_fwd's arguments plus out, written in place (schema (a!)).
    return _varlen_fwd_fake(*args, **kwargs)[1:]


@torch.library.register_fake("flash_attn::varlen_bwd")
def _varlen_bwd_fake(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    alibi_slopes: Optional[torch.Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    deterministic: bool,
    rng_state: Optional[torch.Tensor],
    *,
    seqused_k: Optional[torch.Tensor] = None,
    softmax_d: Optional[torch.Tensor] = None,
    seqused_q: Optional[torch.Tensor] = None,
):
    return _contiguous_like(q), _contiguous_like(k), _contiguous_like(v)


@torch.library.register_fake("flash_attn::fwd_kvcache")
def _fwd_kvcache_fake(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: Optional[torch.Tensor],
    v: Optional[torch.Tensor],
    cache_seqlens: Optional[torch.Tensor],
    rotary_cos: Optional[torch.Tensor],
    rotary_sin: Optional[torch.Tensor],
    cache_batch_idx: Optional[torch.Tensor],
    cache_leftpad: Optional[torch.Tensor],
    block_table: Optional[torch.Tensor],
    alibi_slopes: Optional[torch.Tensor],
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    rotary_interleaved: bool,
    num_splits: int,
    *,
    learnable_sink: Optional[torch.Tensor] = None,
    rotary_seqlens: Optional[torch.Tensor] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k_new: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    q_descale: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
):
    # An FP8 cache (k_cache / v_cache float8_e4m3fn) is read with a 16-bit q:
    # out keeps q's dtype.
    # k_cache / v_cache are written in place by the real kernel (schema (a!) /
    # (b!)); a fake kernel has no data to write, so only the outputs appear here.
    out = _out_like(q, v_cache)
    if cu_seqlens_q is not None:
        # Varlen q (total_q, nheads, head_dim): lse (nheads, total_q).
        total_q, nheads, _ = q.shape
        return out, q.new_empty((nheads, total_q), dtype=torch.float32)
    batch, seqlen_q, nheads, _ = q.shape
    softmax_lse = q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)
    return out, softmax_lse


@torch.library.register_fake("flash_attn::fwd_kvcache_out")
def _fwd_kvcache_out_fake(*args, out: torch.Tensor, **kwargs):
    # fwd_kvcache's arguments plus out; the caches and out are written in place
    # ((a!), (b!), (c!)): the softmax_lse alone.
    return _fwd_kvcache_fake(*args, **kwargs)[1]


@torch.library.register_fake("flash_attn::sink_grad")
def _sink_grad_fake(
    softmax_lse: torch.Tensor,
    softmax_d: torch.Tensor,
    learnable_sink: torch.Tensor,
    cu_seqlens_q: Optional[torch.Tensor] = None,
):
    # d learnable_sink: fp32 (nheads,), on the device of the lse.
    return softmax_lse.new_empty(learnable_sink.shape, dtype=torch.float32)


@torch.library.register_fake("flash_attn::combine")
def _combine_fake(
    out_partial: torch.Tensor,
    lse_partial: torch.Tensor,
    out_dtype: Optional[torch.dtype] = None,
):
    # out: out_partial's shape without num_splits, in out_dtype (default
    # out_partial's); softmax_lse: fp32, lse_partial's shape without num_splits.
    dtype = out_partial.dtype if out_dtype is None else out_dtype
    out = out_partial.new_empty(out_partial.shape[1:], dtype=dtype)
    return out, lse_partial.new_empty(lse_partial.shape[1:], dtype=torch.float32)


@torch.library.register_fake("flash_attn::combine_out")
def _combine_out_fake(out_partial: torch.Tensor, lse_partial: torch.Tensor, *, out: torch.Tensor):
    # out is written in place (schema (a!)): the softmax_lse alone.
    return lse_partial.new_empty(lse_partial.shape[1:], dtype=torch.float32)
