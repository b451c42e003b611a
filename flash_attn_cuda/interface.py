"""The flash-attn 2.x Python API on top of the ``torch.ops.flash_attn`` ops.

Every public function here takes the same parameters, in the same order and
with the same defaults, as its namesake in flash-attn 2.8, and returns the same
values. Each differentiable family has one ``torch.autograd.Function`` whose
forward calls one forward op and whose backward calls the matching backward op;
no gradient is computed in Python. The packed variants split their packed input
into strided views, so autograd stacks the three (or two) gradients back into
the packed tensor's gradient.
"""

from __future__ import annotations

import operator
from typing import Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from .ops import _out_dtype

__all__ = [
    "_get_block_size_n",
    "flash_attn_combine",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]

# The kernels need the head dim to be a multiple of this; other head dims are
# zero-padded here and the padding is sliced off the results. Zero columns add
# nothing to q.k and produce zero output columns, so the math is unchanged.
_HEAD_DIM_ALIGNMENT = 8

# The largest head dim per device, csrc/common/head_dim_bounds.h's: on CUDA
# the ops serve up to 512 (above 256 on the SM80 kernels' d512 rows, the
# forward's decode-like calls on the split-KV kernel), flash_attn_with_kvcache also
# absorbed MLA's 576 with d_v <= 512 (the op checks d_v); the CPU path serves
# up to 1024, the function the CUDA kernels of issue 56 will serve.
_MAX_HEAD_DIM = {"cuda": 512, "cpu": 1024}
# S_dmask (return_attn_probs): the forward kernels' 256 on CUDA.
_MAX_S_DMASK_HEAD_DIM = {"cuda": 256, "cpu": 1024}
_MAX_KVCACHE_HEAD_DIM = {"cuda": 576, "cpu": 1024}


def _max_head_dim(device, bounds=_MAX_HEAD_DIM) -> int:
    return bounds["cpu" if torch.device(device).type == "cpu" else "cuda"]


# Seeds are drawn below 2**62 so that torch.randint's exclusive upper bound fits
# int64 on every backend.
_SEED_BOUND = 2**62


# Key-block width of S_dmask (see return_attn_probs). The CPU and CUDA kernels
# write numerators against the running max over blocks of this many keys
# (kProbsBlockN in csrc/cpu/attention_cpu.h, kReturnProbsBlockN in
# csrc/cuda/fwd/return_probs.h), whatever the device, head dim, dropout or mask.
_S_DMASK_BLOCK_N = 64


def _get_block_size_n(device, head_dim, is_dropout, is_causal):
    """The key-block width of S_dmask, with flash-attn 2.x's signature.

    flash-attn's tests pass it to their ``normalize_flash_attn_S`` helper to
    turn the numerators of S_dmask (returned with ``return_attn_probs=True``)
    back into probabilities. Here one width serves every device, head dim,
    dropout and causal setting; the arguments are accepted for compatibility
    (head_dim is checked against the supported range).
    """
    del is_dropout, is_causal  # the width depends on none of them
    bound = _max_head_dim(device if device is not None else "cuda", _MAX_S_DMASK_HEAD_DIM)
    if not 0 < head_dim <= bound:
        raise ValueError(f"head_dim must be in [1, {bound}], got {head_dim}")
    return _S_DMASK_BLOCK_N


def _last_dim_contiguous(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    # The ops accept any strides except on the last dim; copy only when needed.
    if t is not None and t.stride(-1) != 1:
        return t.contiguous()
    return t


def _pad_head_dim(t: torch.Tensor) -> torch.Tensor:
    missing = -t.shape[-1] % _HEAD_DIM_ALIGNMENT
    return F.pad(t, (0, missing)) if missing else t


def _unpad_head_dim(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    return t if t.shape[-1] == head_dim else t[..., :head_dim]


def _prepare(t: torch.Tensor) -> torch.Tensor:
    # _pad_head_dim(_last_dim_contiguous(t)), inlined: it runs for every
    # input of every call.
    if t.stride(-1) != 1:
        t = t.contiguous()
    missing = -t.shape[-1] % _HEAD_DIM_ALIGNMENT
    return F.pad(t, (0, missing)) if missing else t


# The zero key offsets of vLLM's paged call (cu_seqlens_k None), one tensor per
# (device, dtype, length), so that an eager decode step makes no allocation and no
# fill for them. The ops only read it. Under torch.compile a fresh one is made (a
# cached tensor would be a captured constant). A CUDA graph capture reads the one an
# eager call cached; without one it makes its own, since a fill it captured would
# run only at replay.
_ZERO_OFFSETS: dict = {}


def _zero_offsets(like: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return torch.zeros_like(like)
    key = (like.device, like.dtype, tuple(like.shape))
    zeros = _ZERO_OFFSETS.get(key)
    if zeros is not None:
        # A CUDA graph reads the eager call's tensor too: no fill in each replay.
        return zeros
    if like.is_cuda and torch.cuda.is_current_stream_capturing():
        # A fill captured here would run only at replay: the graph makes its own.
        return torch.zeros_like(like)
    return _ZERO_OFFSETS.setdefault(
        key, torch.zeros(like.shape, dtype=like.dtype, device=like.device)
    )


def _check_ndim(t: torch.Tensor, name: str, ndim: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {layout}, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(t.shape)}")


def _check_packed(t: torch.Tensor, name: str, dim: int, count: int, layout: str) -> None:
    _check_ndim(t, name, dim + 3, layout)
    if t.shape[dim] != count:
        raise ValueError(
            f"{name} must have size {count} at dim {dim} {layout}, got shape {tuple(t.shape)}"
        )


def _check_head_dim(
    q: torch.Tensor, v: Optional[torch.Tensor] = None, bounds=_MAX_HEAD_DIM
) -> None:
    # Checked before padding, so that the messages name the caller's head dims.
    bound = _max_head_dim(q.device, bounds)
    if q.shape[-1] > bound:
        where = (
            "on the CPU"
            if q.device.type == "cpu"
            else f"on {q.device.type} (larger head dims run on the CPU path only)"
        )
        raise ValueError(
            f"head dimension (last dim of q) must be at most {bound} {where}, got {q.shape[-1]}"
        )
    # Zero would also reach the default softmax scale, 1 / sqrt(head dim).
    if q.shape[-1] < 1:
        raise ValueError(f"head dimension (last dim of q) must be at least 1, got {q.shape[-1]}")
    if v is not None and isinstance(v, torch.Tensor) and v.shape[-1] < 1:
        raise ValueError(f"head dimension of v (last dim) must be at least 1, got {v.shape[-1]}")
    # v may have a smaller head dim d_v than q and k (d_qk); padding both to a
    # multiple of 8 could hide a larger one from the op.
    if v is not None and isinstance(v, torch.Tensor) and v.shape[-1] > q.shape[-1]:
        raise ValueError(
            f"the head dim of v (d_v = {v.shape[-1]}) must not exceed the head dim of q and k "
            f"(d_qk = {q.shape[-1]})"
        )


def _check_same_device(q: torch.Tensor, **others: Optional[torch.Tensor]) -> None:
    device = q.device
    for name, t in others.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
        if t.device != device:
            raise ValueError(f"{name} must be on the same device as q ({device}), got {t.device}")


def _check_dropout_p(dropout_p: float) -> None:
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")


def _attention_window(causal: bool, window_size: Sequence[int]) -> Tuple[int, int]:
    if isinstance(window_size, (str, bytes)) or not hasattr(window_size, "__len__"):
        raise TypeError(
            "window_size must be a pair (left, right) of ints, -1 for an unbounded side, "
            f"got {window_size!r} ({type(window_size).__name__})"
        )
    if len(window_size) != 2:
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}")
    try:
        # operator.index takes ints (and integer numpy or 0-dim tensor values) but no
        # floats: a window of 0.5 keys would otherwise be truncated without a word.
        left, right = operator.index(window_size[0]), operator.index(window_size[1])
    except TypeError:
        raise TypeError(f"window_size must hold ints (left, right), got {window_size!r}") from None
    # Causal is the window's right side closed at the diagonal; the ops apply
    # the same rule, normalising here keeps the two flags from disagreeing.
    if causal:
        right = 0
    return left, right


def _default_softmax_scale(softmax_scale: Optional[float], head_dim: int) -> float:
    # Uses the caller's head dim, before any padding.
    return head_dim ** (-0.5) if softmax_scale is None else softmax_scale


def _draw_rng_state(dropout_p: float, device: torch.device) -> Optional[torch.Tensor]:
    # A fresh [seed, offset] per call, drawn from torch's default generator on
    # the device the kernel reads it from: torch.manual_seed makes runs
    # reproducible, CUDA graphs can capture it, and torch.compile traces it as
    # an ordinary random op (no graph break). The forward returns the pair it
    # used and the backward regenerates the same dropout mask from it.
    if dropout_p <= 0.0:
        return None
    return torch.randint(0, _SEED_BOUND, (2,), dtype=torch.int64, device=device)


def _distinct(*tensors):
    # torch.compile cannot trace an autograd.Function that receives one tensor
    # object in two argument slots (flash_attn_func(x, x, x), or one cu_seqlens
    # for queries and keys). A view of the repeat is a distinct object over the
    # same memory, and autograd still routes its gradient to the original.
    seen = []
    result = []
    for t in tensors:
        if t is not None and any(t is s for s in seen):
            t = t.view_as(t)
        elif t is not None:
            seen.append(t)
        result.append(t)
    return result


def _grad_needed(q, k, v, alibi_slopes, learnable_sink=None) -> bool:
    # When autograd.Function.apply would record a graph: grad mode on and an
    # input that requires grad (alibi_slopes too: apply counts every tensor
    # argument, although its gradient is None; learnable_sink has a gradient
    # of its own, sink_grad). Otherwise the forward op is
    # called directly: the same op with the same arguments, without apply's
    # host cost (ctx, saved tensors) or _distinct's views, which only tracing
    # an autograd.Function needs.
    return torch.is_grad_enabled() and (
        q.requires_grad
        or k.requires_grad
        or v.requires_grad
        or (alibi_slopes is not None and alibi_slopes.requires_grad)
        or (learnable_sink is not None and learnable_sink.requires_grad)
    )


def _sink_grad(learnable_sink, softmax_lse, dout, out, cu_seqlens_q=None, softmax_d=None):
    # d sink_h = -sum_i exp(sink_h - lse_i) * D_i with D_i = rowsum(dO_i * O_i)
    # (torch.ops.flash_attn.sink_grad), D in fp32 and in the lse's layout:
    # (batch, nheads, seqlen_q), or (nheads, total_q) for varlen. A backward
    # op that ran leaves D in its softmax_d; without one (only the sink needs
    # a gradient) it is computed here, from fp32 copies of dout and out. The
    # padded head-dim columns of dout and out are zeros and add nothing.
    if softmax_d is None:
        softmax_d = (dout.float() * out.float()).sum(-1)
        softmax_d = softmax_d.transpose(1, 2) if softmax_d.dim() == 3 else softmax_d.t()
    d_sink = torch.ops.flash_attn.sink_grad(softmax_lse, softmax_d, learnable_sink, cu_seqlens_q)
    return d_sink.to(learnable_sink.dtype)


def _as_int(value, name: str) -> int:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be an int, got a tensor of shape {tuple(value.shape)}")
        return int(value.item())
    return int(value)


def _descale_kwargs(q_descale, k_descale, v_descale) -> dict:
    # The FP8 descales the caller gave (docs/fp8.md), as the ops' keyword
    # arguments: only those given, so that a call without them makes the same
    # op call (and graph) as before they existed.
    named = dict(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    return {name: t for name, t in named.items() if t is not None}


def _any_fp8(*tensors: torch.Tensor) -> bool:
    # FP8 attention (q, k, v float8_e4m3fn) or an FP8 KV cache (k, v
    # float8_e4m3fn under a 16-bit q): either is forward only.
    return any(t.dtype == torch.float8_e4m3fn for t in tensors)


def _fp8_backward_error(fn: str) -> RuntimeError:
    return RuntimeError(
        f"{fn}: the backward pass does not take float8_e4m3fn inputs: FP8 attention is "
        "forward only (docs/fp8.md); call it under torch.no_grad(), or train in float16 / "
        "bfloat16"
    )


def _check_out(out, fn: str, q: torch.Tensor, shape, layout: str) -> None:
    # Checked here in the caller's head dim: with a head dim that is not a
    # multiple of 8 the op writes a padded buffer, copied into out afterwards.
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{fn}: out must be a torch.Tensor, got {type(out).__name__}")
    if out.device != q.device:
        raise ValueError(f"{fn}: out must be on the device of q ({q.device}), got {out.device}")
    expected = _out_dtype(q)
    if out.dtype != expected:
        what = "the dtype of q" if expected == q.dtype else f"the output dtype of a {q.dtype} q"
        raise ValueError(f"{fn}: out must have {what} ({expected}), got {out.dtype}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(
            f"{fn}: out must have shape {layout} = {tuple(shape)}, got {tuple(out.shape)}"
        )
    if out.numel() > 0 and out.stride(-1) != 1:
        raise ValueError(
            f"{fn}: out must have a contiguous last dimension (stride 1), got strides "
            f"{tuple(out.stride())}"
        )


def _check_no_grad_for_out(fn: str, *tensors: Optional[torch.Tensor]) -> None:
    # As torch's own out= functions: writing into a caller's buffer has no
    # place in the autograd graph.
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise RuntimeError(
            f"{fn}: out= does not support autograd, but an input requires grad; call it under "
            "torch.no_grad() or without out="
        )


def _padded_target(out: torch.Tensor, padded_head_dim: int, keep: bool = False) -> torch.Tensor:
    # The buffer the op writes: out itself, or for a padded head dim a
    # scratch copy of its shape with the padded last dim, holding out's values
    # when `keep` (rows the op leaves alone must come back unchanged).
    if out.shape[-1] == padded_head_dim:
        return out
    target = out.new_empty(tuple(out.shape[:-1]) + (padded_head_dim,))
    if keep:
        target[..., : out.shape[-1]].copy_(out)
    return target


def _copy_back(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if target is not out:
        out.copy_(target[..., : out.shape[-1]])
    return out


class _FlashAttnFunc(torch.autograd.Function):
    """Fixed-length attention: forward is flash_attn.fwd, backward flash_attn.bwd."""

    @staticmethod
    def forward(
        ctx,
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window,
        softcap,
        alibi_slopes,
        deterministic,
        return_softmax,
        rng_state,
        learnable_sink,
        q_descale,
        k_descale,
        v_descale,
    ):
        head_dim, head_dim_v = q.shape[-1], v.shape[-1]
        ctx.fp8 = _any_fp8(q, k, v)
        q_padded, k_padded, v_padded = _prepare(q), _prepare(k), _prepare(v)
        out_padded, softmax_lse, s_dmask, rng_used = torch.ops.flash_attn.fwd(
            q_padded,
            k_padded,
            v_padded,
            alibi_slopes,
            dropout_p,
            softmax_scale,
            causal,
            window[0],
            window[1],
            softcap,
            return_softmax,
            0,
            0,
            rng_state,
            learnable_sink=learnable_sink,
            **_descale_kwargs(q_descale, k_descale, v_descale),
        )
        ctx.save_for_backward(
            q_padded,
            k_padded,
            v_padded,
            out_padded,
            softmax_lse,
            rng_used,
            alibi_slopes,
            learnable_sink,
        )
        ctx.head_dim = head_dim
        ctx.head_dim_v = head_dim_v
        ctx.dropout_p = dropout_p
        ctx.softmax_scale = softmax_scale
        ctx.causal = causal
        ctx.window = window
        ctx.softcap = softcap
        ctx.deterministic = deterministic
        ctx.mark_non_differentiable(softmax_lse, s_dmask)
        return _unpad_head_dim(out_padded, head_dim_v), softmax_lse, s_dmask

    @staticmethod
    def backward(ctx, dout, _dsoftmax_lse, _ds_dmask):
        if ctx.fp8:
            raise _fp8_backward_error("flash_attn_func")
        q, k, v, out, softmax_lse, rng_state, alibi_slopes, learnable_sink = ctx.saved_tensors
        dout = _prepare(dout)
        sink_needs_grad = ctx.needs_input_grad[12]
        if not any(ctx.needs_input_grad[:3]):
            d_sink = _sink_grad(learnable_sink, softmax_lse, dout, out) if sink_needs_grad else None
            return (None,) * 12 + (d_sink, None, None, None)
        # D = rowsum(dO * O), which the backward computes anyway, for sink_grad.
        softmax_d = torch.empty_like(softmax_lse) if sink_needs_grad else None
        dq, dk, dv = torch.ops.flash_attn.bwd(
            dout,
            q,
            k,
            v,
            out,
            softmax_lse,
            alibi_slopes,
            ctx.dropout_p,
            ctx.softmax_scale,
            ctx.causal,
            ctx.window[0],
            ctx.window[1],
            ctx.softcap,
            ctx.deterministic,
            rng_state,
            softmax_d=softmax_d,
        )
        d_sink = None
        if sink_needs_grad:
            d_sink = _sink_grad(learnable_sink, softmax_lse, dout, out, softmax_d=softmax_d)
        grads = (
            _unpad_head_dim(dq, ctx.head_dim),
            _unpad_head_dim(dk, ctx.head_dim),
            _unpad_head_dim(dv, ctx.head_dim_v),
        )
        return grads + (None,) * 9 + (d_sink, None, None, None)


class _FlashAttnVarlenFunc(torch.autograd.Function):
    """Varlen attention: forward is flash_attn.varlen_fwd, backward flash_attn.varlen_bwd."""

    @staticmethod
    def forward(
        ctx,
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
        window,
        softcap,
        alibi_slopes,
        deterministic,
        return_softmax,
        block_table,
        rng_state,
        seqused_k,
        learnable_sink,
        seqused_q,
        num_splits,
        q_descale,
        k_descale,
        v_descale,
    ):
        head_dim, head_dim_v = q.shape[-1], v.shape[-1]
        ctx.fp8 = _any_fp8(q, k, v)
        q_padded, k_padded, v_padded = _prepare(q), _prepare(k), _prepare(v)
        out_padded, softmax_lse, s_dmask, rng_used = torch.ops.flash_attn.varlen_fwd(
            q_padded,
            k_padded,
            v_padded,
            cu_seqlens_q,
            cu_seqlens_k,
            block_table,
            alibi_slopes,
            max_seqlen_q,
            max_seqlen_k,
            dropout_p,
            softmax_scale,
            causal,
            window[0],
            window[1],
            softcap,
            return_softmax,
            0,
            0,
            rng_state,
            seqused_k=seqused_k,
            learnable_sink=learnable_sink,
            seqused_q=seqused_q,
            num_splits=num_splits,
            **_descale_kwargs(q_descale, k_descale, v_descale),
        )
        ctx.save_for_backward(
            q_padded,
            k_padded,
            v_padded,
            out_padded,
            softmax_lse,
            cu_seqlens_q,
            cu_seqlens_k,
            rng_used,
            alibi_slopes,
            seqused_k,
            learnable_sink,
            seqused_q,
        )
        ctx.paged = block_table is not None
        ctx.head_dim = head_dim
        ctx.head_dim_v = head_dim_v
        ctx.max_seqlen_q = max_seqlen_q
        ctx.max_seqlen_k = max_seqlen_k
        ctx.dropout_p = dropout_p
        ctx.softmax_scale = softmax_scale
        ctx.causal = causal
        ctx.window = window
        ctx.softcap = softcap
        ctx.deterministic = deterministic
        ctx.mark_non_differentiable(softmax_lse, s_dmask)
        return _unpad_head_dim(out_padded, head_dim_v), softmax_lse, s_dmask

    @staticmethod
    def backward(ctx, dout, _dsoftmax_lse, _ds_dmask):
        if ctx.fp8:
            raise _fp8_backward_error("flash_attn_varlen_func")
        if ctx.paged:
            # As in flash-attn 2.x: paged K/V (block_table) is a forward-only feature.
            raise RuntimeError(
                "flash_attn_varlen_func: the backward pass does not support block_table "
                "(paged K/V); call it under torch.no_grad() or without block_table"
            )
        (
            q,
            k,
            v,
            out,
            softmax_lse,
            cu_seqlens_q,
            cu_seqlens_k,
            rng_state,
            alibi_slopes,
            seqused_k,
            learnable_sink,
            seqused_q,
        ) = ctx.saved_tensors
        dout = _prepare(dout)
        sink_needs_grad = ctx.needs_input_grad[18]
        if not any(ctx.needs_input_grad[:3]):
            d_sink = None
            if sink_needs_grad:
                # Rows past seqused_q have out 0 and lse +inf: they add 0.
                d_sink = _sink_grad(learnable_sink, softmax_lse, dout, out, cu_seqlens_q)
            return (None,) * 18 + (d_sink, None, None, None, None, None)
        softmax_d = torch.empty_like(softmax_lse) if sink_needs_grad else None
        dq, dk, dv = torch.ops.flash_attn.varlen_bwd(
            dout,
            q,
            k,
            v,
            out,
            softmax_lse,
            cu_seqlens_q,
            cu_seqlens_k,
            alibi_slopes,
            ctx.max_seqlen_q,
            ctx.max_seqlen_k,
            ctx.dropout_p,
            ctx.softmax_scale,
            ctx.causal,
            ctx.window[0],
            ctx.window[1],
            ctx.softcap,
            ctx.deterministic,
            rng_state,
            seqused_k=seqused_k,
            softmax_d=softmax_d,
            seqused_q=seqused_q,
        )
        d_sink = None
        if sink_needs_grad:
            d_sink = _sink_grad(
                learnable_sink, softmax_lse, dout, out, cu_seqlens_q, softmax_d=softmax_d
            )
        grads = (
            _unpad_head_dim(dq, ctx.head_dim),
            _unpad_head_dim(dk, ctx.head_dim),
            _unpad_head_dim(dv, ctx.head_dim_v),
        )
        return grads + (None,) * 15 + (d_sink, None, None, None, None, None)


def _results(out, softmax_lse, s_dmask, return_attn_probs: bool, return_softmax_lse: bool):
    """What the public functions return: flash-attn 2.x's (out, softmax_lse, S_dmask)
    with return_attn_probs, FA3 / vLLM's (out, softmax_lse) with return_softmax_lse."""
    if return_attn_probs:
        return out, softmax_lse, s_dmask
    if return_softmax_lse:
        return out, softmax_lse
    return out


def _check_return_flags(return_attn_probs: bool, return_softmax_lse: bool) -> None:
    if return_attn_probs and return_softmax_lse:
        raise ValueError(
            "return_attn_probs=True and return_softmax_lse=True ask for two different results "
            "((out, softmax_lse, S_dmask) and (out, softmax_lse)): pass one of them"
        )


def _attention(
    q,
    k,
    v,
    dropout_p,
    softmax_scale,
    causal,
    window_size,
    softcap,
    alibi_slopes,
    deterministic,
    return_attn_probs,
    out=None,
    learnable_sink=None,
    return_softmax_lse=False,
    q_descale=None,
    k_descale=None,
    v_descale=None,
):
    _check_head_dim(q, v)
    _check_same_device(
        q,
        k=k,
        v=v,
        alibi_slopes=alibi_slopes,
        learnable_sink=learnable_sink,
        q_descale=q_descale,
        k_descale=k_descale,
        v_descale=v_descale,
    )
    descales = _descale_kwargs(q_descale, k_descale, v_descale)
    _check_dropout_p(dropout_p)
    window = _attention_window(causal, window_size)
    if out is not None:
        fn = "flash_attn_func"
        _check_out(
            out, fn, q, q.shape[:-1] + v.shape[-1:], "(batch_size, seqlen_q, nheads, headdim)"
        )
        _check_no_grad_for_out(fn, q, k, v, learnable_sink)
        q_padded, k_padded, v_padded = _prepare(q), _prepare(k), _prepare(v)
        target = _padded_target(out, v_padded.shape[-1])
        softmax_lse, s_dmask, _ = torch.ops.flash_attn.fwd_out(
            q_padded,
            k_padded,
            v_padded,
            alibi_slopes,
            dropout_p,
            _default_softmax_scale(softmax_scale, q.shape[-1]),
            causal,
            window[0],
            window[1],
            softcap,
            return_attn_probs and dropout_p > 0.0,
            0,
            0,
            _draw_rng_state(dropout_p, q.device),
            out=target,
            learnable_sink=learnable_sink,
            **descales,
        )
        out = _copy_back(out, target)
        return _results(out, softmax_lse, s_dmask, return_attn_probs, return_softmax_lse)
    softmax_scale = _default_softmax_scale(softmax_scale, q.shape[-1])
    # As in flash-attn: the probabilities are only materialised when there is a
    # dropout pattern to report; otherwise S_dmask is empty.
    return_softmax = return_attn_probs and dropout_p > 0.0
    if not _grad_needed(q, k, v, alibi_slopes, learnable_sink):
        out, softmax_lse, s_dmask, _ = torch.ops.flash_attn.fwd(
            _prepare(q),
            _prepare(k),
            _prepare(v),
            alibi_slopes,
            dropout_p,
            softmax_scale,
            causal,
            window[0],
            window[1],
            softcap,
            return_softmax,
            0,
            0,
            _draw_rng_state(dropout_p, q.device),
            learnable_sink=learnable_sink,
            **descales,
        )
        out = _unpad_head_dim(out, v.shape[-1])
        return _results(out, softmax_lse, s_dmask, return_attn_probs, return_softmax_lse)
    q, k, v, alibi_slopes, learnable_sink, q_descale, k_descale, v_descale = _distinct(
        q, k, v, alibi_slopes, learnable_sink, q_descale, k_descale, v_descale
    )
    out, softmax_lse, s_dmask = _FlashAttnFunc.apply(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window,
        softcap,
        alibi_slopes,
        deterministic,
        return_softmax,
        _draw_rng_state(dropout_p, q.device),
        learnable_sink,
        q_descale,
        k_descale,
        v_descale,
    )
    return _results(out, softmax_lse, s_dmask, return_attn_probs, return_softmax_lse)


def _varlen_attention(
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
    window_size,
    softcap,
    alibi_slopes,
    deterministic,
    return_attn_probs,
    block_table,
    seqused_k=None,
    out=None,
    learnable_sink=None,
    seqused_q=None,
    return_softmax_lse=False,
    num_splits=0,
    q_descale=None,
    k_descale=None,
    v_descale=None,
):
    fn = "flash_attn_varlen_func"
    _check_head_dim(q, v)
    if cu_seqlens_k is None:
        # vLLM's form of a paged call: the keys of each sequence come from
        # seqused_k alone. The op still takes offsets; zeros are valid ones.
        if block_table is None or seqused_k is None:
            raise ValueError(
                f"{fn}: cu_seqlens_k may be None only with block_table and seqused_k (then "
                "seqused_k gives each sequence's keys)"
            )
        cu_seqlens_k = _zero_offsets(cu_seqlens_q)
    _check_same_device(
        q,
        k=k,
        v=v,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        alibi_slopes=alibi_slopes,
        block_table=block_table,
        seqused_k=seqused_k,
        learnable_sink=learnable_sink,
        seqused_q=seqused_q,
        q_descale=q_descale,
        k_descale=k_descale,
        v_descale=v_descale,
    )
    descales = _descale_kwargs(q_descale, k_descale, v_descale)
    _check_dropout_p(dropout_p)
    window = _attention_window(causal, window_size)
    max_seqlen_q = _as_int(max_seqlen_q, "max_seqlen_q")
    max_seqlen_k = _as_int(max_seqlen_k, "max_seqlen_k")
    softmax_scale = _default_softmax_scale(softmax_scale, q.shape[-1])
    if out is not None:
        _check_out(out, fn, q, q.shape[:-1] + v.shape[-1:], "(total_q, nheads, headdim)")
        _check_no_grad_for_out(fn, q, k, v, learnable_sink)
        q_padded, k_padded, v_padded = _prepare(q), _prepare(k), _prepare(v)
        # With seqused_q the rows past it keep the caller's values (as FA3):
        # a padded scratch target starts from them, since it is copied back.
        target = _padded_target(out, v_padded.shape[-1], keep=seqused_q is not None)
        softmax_lse, s_dmask, _ = torch.ops.flash_attn.varlen_fwd_out(
            q_padded,
            k_padded,
            v_padded,
            cu_seqlens_q,
            cu_seqlens_k,
            block_table,
            alibi_slopes,
            max_seqlen_q,
            max_seqlen_k,
            dropout_p,
            softmax_scale,
            causal,
            window[0],
            window[1],
            softcap,
            return_attn_probs and dropout_p > 0.0,
            0,
            0,
            _draw_rng_state(dropout_p, q.device),
            seqused_k=seqused_k,
            out=target,
            learnable_sink=learnable_sink,
            seqused_q=seqused_q,
            num_splits=num_splits,
            **descales,
        )
        out = _copy_back(out, target)
        return _results(out, softmax_lse, s_dmask, return_attn_probs, return_softmax_lse)
    if not _grad_needed(q, k, v, alibi_slopes, learnable_sink):
        head_dim_v = v.shape[-1]
        out, softmax_lse, s_dmask, _ = torch.ops.flash_attn.varlen_fwd(
            _prepare(q),
            _prepare(k),
            _prepare(v),
            cu_seqlens_q,
            cu_seqlens_k,
            block_table,
            alibi_slopes,
            max_seqlen_q,
            max_seqlen_k,
            dropout_p,
            softmax_scale,
            causal,
            window[0],
            window[1],
            softcap,
            return_attn_probs and dropout_p > 0.0,
            0,
            0,
            _draw_rng_state(dropout_p, q.device),
            seqused_k=seqused_k,
            learnable_sink=learnable_sink,
            seqused_q=seqused_q,
            num_splits=num_splits,
            **descales,
        )
        out = _unpad_head_dim(out, head_dim_v)
        return _results(out, softmax_lse, s_dmask, return_attn_probs, return_softmax_lse)
    (
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        alibi_slopes,
        block_table,
        seqused_k,
        learnable_sink,
        seqused_q,
        q_descale,
        k_descale,
        v_descale,
    ) = _distinct(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        alibi_slopes,
        block_table,
        seqused_k,
        learnable_sink,
        seqused_q,
        q_descale,
        k_descale,
        v_descale,
    )
    out, softmax_lse, s_dmask = _FlashAttnVarlenFunc.apply(
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
        window,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs and dropout_p > 0.0,
        block_table,
        _draw_rng_state(dropout_p, q.device),
        seqused_k,
        learnable_sink,
        seqused_q,
        num_splits,
        q_descale,
        k_descale,
        v_descale,
    )
    return _results(out, softmax_lse, s_dmask, return_attn_probs, return_softmax_lse)


_RETURNS_DOC = """
    Returns:
        out; with return_attn_probs the tuple (out, softmax_lse, S_dmask)
        (flash-attn 2.x); with return_softmax_lse the pair (out, softmax_lse)
        (FA3 and vLLM's flash_attn_varlen_func):
        out: {out_layout}, same dtype as q.
        softmax_lse: fp32 {lse_layout}, the natural-log log-sum-exp of each row
            of scaled (and softcapped, ALiBi-biased, masked) scores, the sink
            included with learnable_sink; +inf for a query row that sees no
            key (with learnable_sink: the head's sink).
        S_dmask: meant for tests only, in flash-attn 2.x's convention. When
            dropout_p > 0, {probs_layout} in q's dtype holding softmax
            numerators before dropout, not probabilities: each row's keys
            are cut into blocks of _get_block_size_n(...) keys from key 0,
            visited from the last block to the first, and entry (i, j) holds
            exp(s_ij - m) for the final score s_ij (scaled, softcapped,
            ALiBi-biased, as for softmax_lse) and m the max of row i's
            scores over j's block and every block after it (the running max
            over the blocks processed so far). Entries that dropout dropped
            are negated (sign bit set: -0.0 where the numerator rounds to 0).
            Masked entries hold 0: outside the causal / local window, rows
            that see no key and, for varlen, positions past a sequence's
            lengths. P_ij = |S_ij| * exp(m - softmax_lse_i) recovers the
            probabilities (with learnable_sink too: the lse holds the sink),
            as flash-attn's test helper normalize_flash_attn_S computes them.
            When dropout_p == 0 it is an empty tensor, as in flash-attn.
"""

_COMMON_ARGS_DOC = """
        dropout_p: probability of dropping an attention weight. Dropout is
            applied whenever dropout_p > 0, so pass 0.0 at evaluation time.
            Kept weights are scaled by 1 / (1 - dropout_p).
        softmax_scale: factor applied to q.k before the softmax; None means
            1 / sqrt(headdim).
        causal: mask out keys after the query's position. With
            seqlen_q != seqlen_k the diagonal is aligned to the bottom-right
            corner: query i sees key j iff j <= i + seqlen_k - seqlen_q. A
            query row that sees no key produces zeros.
        window_size: (left, right) sliding-window (local) attention: query i
            sees keys i + seqlen_k - seqlen_q - left through
            i + seqlen_k - seqlen_q + right, inclusive. -1 leaves that side
            unbounded; causal sets right to 0.
        softcap: when > 0, scores become softcap * tanh(score / softcap).
        alibi_slopes: optional fp32 tensor of shape (nheads,) or
            (batch_size, nheads); adds -slope * |i + seqlen_k - seqlen_q - j|
            to the score of query i and key j.
        deterministic: make the backward pass bitwise reproducible (the
            forward pass always is).
        return_attn_probs: also return softmax_lse and S_dmask (see below).
        return_softmax_lse: keyword-only; also return softmax_lse, without
            S_dmask (see below). At most one of the two may be True.
"""

_SINK_ARG_DOC = """        learnable_sink: optional keyword-only fp32 tensor of shape (nheads,)
            (one per query head): attention sinks, as in gpt-oss. Row i of
            head h normalises with an extra exp(sink_h - m_i) in its softmax
            denominator, in the units of the final scores (after scale,
            softcap, ALiBi and mask); the sink has no value, so a row's
            weights sum to less than 1 and a row that sees no key outputs 0.
            softmax_lse includes it. Differentiable: its gradient is
            -sum_i exp(sink_h - lse_i) * rowsum(dout_i * out_i) over the
            rows of head h.
"""


_FP8_ARG_DOC = """        q_descale, k_descale, v_descale: optional keyword-only fp32 tensors
            of shape (batch_size, nheads_k) (varlen: batch_size = number of
            sequences), any strides (an expanded scalar is fine), FA3's FP8
            API (docs/fp8.md): with q, k and v of dtype torch.float8_e4m3fn,
            element x of batch entry b and kv head g stands for
            x * descale[b, g] (a query head reads its kv head's q_descale); a
            descale not given is 1. The output is then bfloat16 and
            softmax_lse that of the scores of the dequantised q and k.
            An FP8 KV cache: k and v of dtype torch.float8_e4m3fn under a
            float16 / bfloat16 q (packed or paged, e.g. vLLM's cache in
            chunked prefill), with k_descale / v_descale and no q_descale;
            the output then has q's dtype. Forward only; no dropout, ALiBi
            or S_dmask. Refused with inputs that are not float8_e4m3fn.
"""


_OUT_ARG_DOC = """        out: optional keyword-only tensor of shape {layout}, q's dtype and
            device, last dim contiguous: the output is written into it (no
            new output tensor) and it is what the call returns. Forward only:
            raises when grad is enabled and an input requires grad. With a
            headdim that is not a multiple of 8 the result goes through a
            padded scratch buffer first.
"""


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    out=None,
    learnable_sink=None,
    return_softmax_lse=False,
    q_descale=None,
    k_descale=None,
    v_descale=None,
):
    _check_return_flags(return_attn_probs, return_softmax_lse)
    _check_ndim(q, "q", 4, "(batch_size, seqlen_q, nheads, headdim)")
    _check_ndim(k, "k", 4, "(batch_size, seqlen_k, nheads_k, headdim)")
    _check_ndim(v, "v", 4, "(batch_size, seqlen_k, nheads_k, headdim)")
    return _attention(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        out,
        learnable_sink,
        return_softmax_lse=return_softmax_lse,
        q_descale=q_descale,
        k_descale=k_descale,
        v_descale=v_descale,
    )


flash_attn_func.__doc__ = (
    """Scaled dot-product attention over fixed-length batches.

    Grouped-query and multi-query attention: k and v may have fewer heads
    than q (nheads must be a multiple of nheads_k); query head h reads key /
    value head h // (nheads // nheads_k), without copying K or V.

    Args:
        q: (batch_size, seqlen_q, nheads, headdim), fp16 or bf16 on CUDA
            (fp32 is also accepted on CPU; float8_e4m3fn too, with the
            descales below, on CPU and on CUDA of sm89 or newer). Any
            headdim up to 512 works, forward and backward (above 256 no
            S_dmask); up to 1024 on CPU; one that is not a multiple of 8 is
            zero-padded internally.
        k: (batch_size, seqlen_k, nheads_k, headdim), same dtype and device
            (or float8_e4m3fn under a 16-bit q: an FP8 KV cache).
        v: (batch_size, seqlen_k, nheads_k, headdim), same dtype and device.
"""
    + _COMMON_ARGS_DOC
    + _SINK_ARG_DOC
    + _FP8_ARG_DOC
    + _OUT_ARG_DOC.format(layout="(batch_size, seqlen_q, nheads, headdim)")
    + _RETURNS_DOC.format(
        out_layout="(batch_size, seqlen_q, nheads, headdim)",
        lse_layout="(batch_size, nheads, seqlen_q)",
        probs_layout="(batch_size, nheads, seqlen_q, seqlen_k)",
    )
)


def flash_attn_kvpacked_func(
    q,
    kv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    learnable_sink=None,
    return_softmax_lse=False,
):
    _check_return_flags(return_attn_probs, return_softmax_lse)
    _check_ndim(q, "q", 4, "(batch_size, seqlen_q, nheads, headdim)")
    _check_packed(kv, "kv", 2, 2, "(batch_size, seqlen_k, 2, nheads_k, headdim)")
    k, v = kv.unbind(dim=2)
    return _attention(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        learnable_sink=learnable_sink,
        return_softmax_lse=return_softmax_lse,
    )


flash_attn_kvpacked_func.__doc__ = (
    """Attention with keys and values stacked in one tensor.

    Same as flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], ...); the gradient of
    kv arrives as one packed tensor. GQA / MQA work as in flash_attn_func.

    Args:
        q: (batch_size, seqlen_q, nheads, headdim).
        kv: (batch_size, seqlen_k, 2, nheads_k, headdim), keys at index 0 of
            dim 2 and values at index 1.
"""
    + _COMMON_ARGS_DOC
    + _SINK_ARG_DOC
    + _RETURNS_DOC.format(
        out_layout="(batch_size, seqlen_q, nheads, headdim)",
        lse_layout="(batch_size, nheads, seqlen_q)",
        probs_layout="(batch_size, nheads, seqlen_q, seqlen_k)",
    )
)


def flash_attn_qkvpacked_func(
    qkv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    learnable_sink=None,
    return_softmax_lse=False,
):
    _check_return_flags(return_attn_probs, return_softmax_lse)
    _check_packed(qkv, "qkv", 2, 3, "(batch_size, seqlen, 3, nheads, headdim)")
    q, k, v = qkv.unbind(dim=2)
    return _attention(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        learnable_sink=learnable_sink,
        return_softmax_lse=return_softmax_lse,
    )


flash_attn_qkvpacked_func.__doc__ = (
    """Self-attention with queries, keys and values stacked in one tensor.

    Same as flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], ...);
    the gradient of qkv arrives as one packed tensor. q, k and v share the
    head count here; use flash_attn_kvpacked_func or flash_attn_func for
    GQA / MQA.

    Args:
        qkv: (batch_size, seqlen, 3, nheads, headdim).
"""
    + _COMMON_ARGS_DOC
    + _SINK_ARG_DOC
    + _RETURNS_DOC.format(
        out_layout="(batch_size, seqlen, nheads, headdim)",
        lse_layout="(batch_size, nheads, seqlen)",
        probs_layout="(batch_size, nheads, seqlen, seqlen)",
    )
)


_VARLEN_ARGS_DOC = """
        cu_seqlens_q: int32 (batch_size + 1,), prefix sums of the query
            lengths: sequence b owns rows cu_seqlens_q[b]:cu_seqlens_q[b + 1].
        cu_seqlens_k: int32 (batch_size + 1,), the same for keys and values.
        max_seqlen_q: int, the longest query sequence of the batch.
        max_seqlen_k: int, the longest key sequence of the batch.
"""


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
    *,
    seqused_k=None,
    out=None,
    learnable_sink=None,
    seqused_q=None,
    return_softmax_lse=False,
    num_splits=0,
    q_descale=None,
    k_descale=None,
    v_descale=None,
):
    _check_return_flags(return_attn_probs, return_softmax_lse)
    _check_ndim(q, "q", 3, "(total_q, nheads, headdim)")
    kv_layout = (
        "(total_k, nheads_k, headdim)"
        if block_table is None
        else "(num_blocks, page_block_size, nheads_k, headdim) with block_table"
    )
    kv_ndim = 3 if block_table is None else 4
    _check_ndim(k, "k", kv_ndim, kv_layout)
    _check_ndim(v, "v", kv_ndim, kv_layout)
    return _varlen_attention(
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
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        block_table,
        seqused_k,
        out,
        learnable_sink,
        seqused_q,
        return_softmax_lse=return_softmax_lse,
        num_splits=num_splits,
        q_descale=q_descale,
        k_descale=k_descale,
        v_descale=v_descale,
    )


flash_attn_varlen_func.__doc__ = (
    """Attention over a batch of variable-length sequences packed end to end.

    Queries of all sequences are concatenated along the first dim, and so are
    keys and values; cu_seqlens_q / cu_seqlens_k say where each sequence
    starts. Causal and local windows are aligned per sequence, to the
    bottom-right corner of that sequence's (seqlen_q, seqlen_k) score matrix.
    GQA / MQA work as in flash_attn_func.

    Args:
        q: (total_q, nheads, headdim).
        k: (total_k, nheads_k, headdim), or, with block_table, a paged cache
            (num_blocks, page_block_size, nheads_k, headdim).
        v: same layout as k.
"""
    + _VARLEN_ARGS_DOC
    + _COMMON_ARGS_DOC
    + _SINK_ARG_DOC
    + """        block_table: optional int32 (batch_size, max_num_blocks_per_seq).
            Key position p of sequence b lives in page block_table[b, p //
            page_block_size], row p % page_block_size. Forward only: the
            backward pass does not support it. On CUDA the pages a call
            reaches are first gathered into packed keys and values (one
            extra copy of them per call); flash_attn_with_kvcache reads
            pages in place.
        seqused_k: optional keyword-only int32 (batch_size,): sequence b
            uses only its first seqused_k[b] keys (rows cu_seqlens_k[b] ..
            cu_seqlens_k[b] + seqused_k[b]); the rest of its K / V rows are
            never read into a result, and their gradients are zero. Causal
            and local windows align to seqused_k[b]. Each value must lie in
            [0, cu_seqlens_k[b + 1] - cu_seqlens_k[b]]. With block_table it
            gives each sequence's keys (positions 0 .. seqused_k[b] - 1 of
            its pages), at most max_seqlen_k and the rows its block_table
            row addresses; cu_seqlens_k is then not used for the keys and
            may be None.
        seqused_q: optional keyword-only int32 (batch_size,), as in FA3:
            sequence b uses only its first seqused_q[b] query rows (rows
            cu_seqlens_q[b] .. cu_seqlens_q[b] + seqused_q[b]); the rest of
            its rows of q are never read. Causal and local windows align to
            the used lengths (seqused_q[b], and seqused_k[b] or the keys
            cu_seqlens_k gives). Each value must lie in [0, cu_seqlens_q[b +
            1] - cu_seqlens_q[b]]. The rows past it get out 0, lse +inf and
            dq 0, and add nothing to dk / dv; with out= they keep the
            caller's values (no write, as FA3), so read only the used rows.
        num_splits: keyword-only, FA3's split of each sequence's keys in the
            forward: 0 (default) lets the kernel choose (a decode-like call,
            each sequence's query rows of a kv head within one split-KV
            query block, splits as flash-attn 2.x splits it), 1 does not
            split (a row's result then does not depend on the batch, for a
            fixed FLASH_ATTN_FWD_KERNEL), > 1 splits that many ways (at most
            128) and merges by the lse. Affects speed only; calls with
            dropout, return_attn_probs or seqused_q do not split.
"""
    + _FP8_ARG_DOC
    + _OUT_ARG_DOC.format(layout="(total_q, nheads, headdim)")
    + _RETURNS_DOC.format(
        out_layout="(total_q, nheads, headdim)",
        lse_layout="(nheads, total_q)",
        probs_layout="(batch_size, nheads, max_seqlen_q, max_seqlen_k)",
    )
)


def flash_attn_varlen_kvpacked_func(
    q,
    kv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    learnable_sink=None,
    return_softmax_lse=False,
):
    _check_return_flags(return_attn_probs, return_softmax_lse)
    _check_ndim(q, "q", 3, "(total_q, nheads, headdim)")
    _check_packed(kv, "kv", 1, 2, "(total_k, 2, nheads_k, headdim)")
    k, v = kv.unbind(dim=1)
    return _varlen_attention(
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
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        None,
        learnable_sink=learnable_sink,
        return_softmax_lse=return_softmax_lse,
    )


flash_attn_varlen_kvpacked_func.__doc__ = (
    """Variable-length attention with keys and values stacked in one tensor.

    Same as flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], ...); the gradient
    of kv arrives as one packed tensor.

    Args:
        q: (total_q, nheads, headdim).
        kv: (total_k, 2, nheads_k, headdim).
"""
    + _VARLEN_ARGS_DOC
    + _COMMON_ARGS_DOC
    + _SINK_ARG_DOC
    + _RETURNS_DOC.format(
        out_layout="(total_q, nheads, headdim)",
        lse_layout="(nheads, total_q)",
        probs_layout="(batch_size, nheads, max_seqlen_q, max_seqlen_k)",
    )
)


def flash_attn_varlen_qkvpacked_func(
    qkv,
    cu_seqlens,
    max_seqlen,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    learnable_sink=None,
    return_softmax_lse=False,
):
    _check_return_flags(return_attn_probs, return_softmax_lse)
    _check_packed(qkv, "qkv", 1, 3, "(total, 3, nheads, headdim)")
    q, k, v = qkv.unbind(dim=1)
    return _varlen_attention(
        q,
        k,
        v,
        cu_seqlens,
        cu_seqlens,
        max_seqlen,
        max_seqlen,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        None,
        learnable_sink=learnable_sink,
        return_softmax_lse=return_softmax_lse,
    )


flash_attn_varlen_qkvpacked_func.__doc__ = (
    """Variable-length self-attention with q, k and v stacked in one tensor.

    Same as flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2],
    cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, ...); the gradient of qkv
    arrives as one packed tensor.

    Args:
        qkv: (total, 3, nheads, headdim).
        cu_seqlens: int32 (batch_size + 1,), prefix sums of the sequence
            lengths.
        max_seqlen: int, the longest sequence of the batch.
"""
    + _COMMON_ARGS_DOC
    + _SINK_ARG_DOC
    + _RETURNS_DOC.format(
        out_layout="(total, nheads, headdim)",
        lse_layout="(nheads, total)",
        probs_layout="(batch_size, nheads, max_seqlen, max_seqlen)",
    )
)


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens: Optional[Union[int, torch.Tensor]] = None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
    *,
    out=None,
    learnable_sink=None,
    rotary_seqlens: Optional[torch.Tensor] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k_new: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    q_descale: Optional[torch.Tensor] = None,
    k_descale: Optional[torch.Tensor] = None,
    v_descale: Optional[torch.Tensor] = None,
):
    """Attention of new queries against a key/value cache, for decoding.

    When k and v are given, they are first written into k_cache / v_cache
    *in place*, at positions cache_seqlens[b], cache_seqlens[b] + 1, ... of
    each sequence b, and attention then runs over the updated cache: one call
    both appends the step's keys/values and attends. The caller keeps the cache
    large enough and advances cache_seqlens itself. There is no backward pass.

    With rotary_cos / rotary_sin, rotary embeddings are applied to the new
    keys at their cache positions and to q: with causal or local attention
    query row i is rotated as position cache_seqlens[b] + i, otherwise every
    query row is rotated as position cache_seqlens[b]. With rotary_seqlens,
    rotary_seqlens[b] takes the place of cache_seqlens[b] in these positions
    (new key i at rotary_seqlens[b] + i), as in FA3; the cache rows written
    stay at cache_seqlens[b] + i.

    Masking, GQA / MQA, softcap and ALiBi follow flash_attn_func, with
    seqlen_k the number of valid cache rows of each sequence (after the
    append).

    Args:
        q: (batch_size, seqlen_q, nheads, headdim), headdim at most 512 on CUDA
            (head dims above 256 on sm80 and sm90 GPUs), or 576 with a headdim_v
            of at most 512 (absorbed MLA's latent cache), and 1024 on CPU. A
            headdim that is not a multiple of 8 works on zero-padded copies of
            the caches, which costs a copy of both caches per call.
        k_cache: (batch_size_cache, seqlen_cache, nheads_k, headdim), or with
            block_table a paged cache (num_blocks, page_block_size, nheads_k,
            headdim). Its last dim must be contiguous (it is written in place).
        v_cache: same layout as k_cache.
        k: optional (batch_size, seqlen_new, nheads_k, headdim), keys to append.
        v: optional (batch_size, seqlen_new, nheads_k, headdim), values to
            append; given together with k.
        rotary_cos: optional (seqlen_rotary, rotary_dim / 2) cosines.
        rotary_sin: optional (seqlen_rotary, rotary_dim / 2) sines.
        cache_seqlens: int, or int32 (batch_size,): the number of valid rows in
            each sequence's cache before the append. None means the whole cache
            is valid.
        cache_batch_idx: optional int32 (batch_size,): the cache entry each
            batch element uses; default 0, 1, ..., batch_size - 1. With
            block_table it selects the row of block_table (as in FA3).
        cache_leftpad: optional int32 (batch_size,): the first valid cache row
            of each sequence (its logical row with block_table); default 0.
        block_table: optional int32 (batch_size, max_num_blocks_per_seq) for a
            paged cache: position p of sequence b lives in page
            block_table[b, p // page_block_size]. With cache_batch_idx it may
            have any number of rows, and row cache_batch_idx[b] serves b.
        softmax_scale: factor applied to q.k; None means 1 / sqrt(headdim).
        causal: causal mask aligned to the bottom-right corner.
        window_size: (left, right) local attention; -1 leaves a side unbounded.
        softcap: when > 0, scores become softcap * tanh(score / softcap).
        rotary_interleaved: True rotates dimension pairs (0, 1), (2, 3), ...;
            False rotates (i, i + rotary_dim / 2) (GPT-NeoX style).
        alibi_slopes: optional fp32 (nheads,) or (batch_size, nheads).
        num_splits: how many chunks to split the keys into; 0 lets the kernel
            choose, 1 disables splitting. Affects speed only. With
            num_splits=1 a row's result is bitwise the same whatever other
            sequences share the batch (on CUDA without rotary; 0 picks a
            split count by the batch): see docs/serving.md.
        return_softmax_lse: also return the fp32 log-sum-exp.
        out: optional keyword-only (batch_size, seqlen_q, nheads, headdim)
            tensor, q's dtype and device, last dim contiguous: the output is
            written into it (no new output tensor) and it is what the call
            returns. With a headdim that is not a multiple of 8 the result
            goes through a padded scratch buffer first.
        learnable_sink: optional keyword-only fp32 (nheads,): attention
            sinks, as in flash_attn_func (forward only here). softmax_lse
            includes them.
        rotary_seqlens: optional keyword-only int32 (batch_size,): the
            rotary position of the first new key and of query row 0 of each
            sequence, instead of cache_seqlens; needs rotary_cos / rotary_sin.
        cu_seqlens_q: optional keyword-only int32 (batch_size + 1,), FA3's
            varlen query (chunked prefill, speculative decoding): q is then
            (total_q, nheads, headdim) and sequence b's query rows are
            cu_seqlens_q[b] .. cu_seqlens_q[b + 1]; needs max_seqlen_q. out
            is (total_q, nheads, headdim) and softmax_lse (nheads, total_q).
            Causal and local windows align to each sequence's own row count.
        cu_seqlens_k_new: optional keyword-only int32 (batch_size + 1,): k
            and v are then (total_k_new, nheads_k, headdim), and sequence b
            appends rows cu_seqlens_k_new[b] .. cu_seqlens_k_new[b + 1] of
            them after cache_seqlens[b] (zero rows allowed).
        max_seqlen_q: keyword-only int, the most query rows of any sequence
            (with cu_seqlens_q).
        k_descale, v_descale: optional keyword-only fp32 (batch_size,
            nheads_k), any strides: an FP8 KV cache (docs/fp8.md). With
            k_cache and v_cache of dtype torch.float8_e4m3fn and a float16 /
            bfloat16 q, cache element x read for batch entry b (not
            cache_batch_idx[b]) and kv head g stands for x * descale[b, g]
            (1 when not given), and an appended k / v element (after rotary,
            rounded to q's dtype) is stored as the e4m3 value nearest to
            value / descale[b, g] saturated to [-448, 448]. out has q's dtype.
        q_descale: not taken (an error when given): q is not quantised; an
            fp8 q is refused here.

    Returns:
        out: (batch_size, seqlen_q, nheads, headdim), or (out, softmax_lse)
        with softmax_lse fp32 (batch_size, nheads, seqlen_q) when
        return_softmax_lse is True.
    """
    varlen_q = cu_seqlens_q is not None
    if varlen_q:
        _check_ndim(q, "q", 3, "(total_q, nheads, headdim)")
        if max_seqlen_q is None:
            raise ValueError(
                "flash_attn_with_kvcache: max_seqlen_q must be given with cu_seqlens_q"
            )
        max_seqlen_q = _as_int(max_seqlen_q, "max_seqlen_q")
    else:
        _check_ndim(q, "q", 4, "(batch_size, seqlen_q, nheads, headdim)")
    if cu_seqlens_k_new is not None and k is None:
        raise ValueError(
            "flash_attn_with_kvcache: cu_seqlens_k_new needs k / v (it gives each sequence's "
            "rows of them), got k=None"
        )
    _check_ndim(k_cache, "k_cache", 4, "(batch_size_cache, seqlen_cache, nheads_k, headdim)")
    _check_ndim(v_cache, "v_cache", 4, "(batch_size_cache, seqlen_cache, nheads_k, headdim_v)")
    _check_head_dim(q, v_cache, _MAX_KVCACHE_HEAD_DIM)
    # The caches are written in place, so a copy to fix their layout would
    # silently drop the update.
    if k_cache.stride(-1) != 1:
        raise ValueError("k_cache must have a contiguous last dimension (stride 1)")
    if v_cache.stride(-1) != 1:
        raise ValueError("v_cache must have a contiguous last dimension (stride 1)")
    _check_same_device(
        q,
        k_cache=k_cache,
        v_cache=v_cache,
        k=k,
        v=v,
        rotary_cos=rotary_cos,
        rotary_sin=rotary_sin,
        cache_batch_idx=cache_batch_idx,
        cache_leftpad=cache_leftpad,
        block_table=block_table,
        alibi_slopes=alibi_slopes,
        learnable_sink=learnable_sink,
        rotary_seqlens=rotary_seqlens,
        cache_seqlens=cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k_new=cu_seqlens_k_new,
        q_descale=q_descale,
        k_descale=k_descale,
        v_descale=v_descale,
    )
    if out is not None:
        _check_out(
            out,
            "flash_attn_with_kvcache",
            q,
            q.shape[:-1] + v_cache.shape[-1:],
            "(total_q, nheads, headdim)" if varlen_q else "(batch_size, seqlen_q, nheads, headdim)",
        )
    window = _attention_window(causal, window_size)
    head_dim, head_dim_v = q.shape[-1], v_cache.shape[-1]
    softmax_scale = _default_softmax_scale(softmax_scale, head_dim)
    if cache_seqlens is not None and not isinstance(cache_seqlens, torch.Tensor):
        batch = cu_seqlens_q.shape[0] - 1 if varlen_q else q.shape[0]
        cache_seqlens = torch.full(
            (batch,), cache_seqlens, dtype=torch.int32, device=k_cache.device
        )
    q = _prepare(q)
    if k is not None:
        k = _prepare(k)
    if v is not None:
        v = _prepare(v)
    rotary_cos, rotary_sin = _last_dim_contiguous(rotary_cos), _last_dim_contiguous(rotary_sin)
    # An unaligned head dim runs on zero-padded copies of the caches (as
    # flash-attn does); the appended rows are copied back afterwards.
    k_cache_used, v_cache_used = _pad_head_dim(k_cache), _pad_head_dim(v_cache)
    args = (
        q,
        k_cache_used,
        v_cache_used,
        k,
        v,
        cache_seqlens,
        rotary_cos,
        rotary_sin,
        cache_batch_idx,
        cache_leftpad,
        block_table,
        alibi_slopes,
        softmax_scale,
        causal,
        window[0],
        window[1],
        softcap,
        rotary_interleaved,
        num_splits,
    )
    kwargs = dict(learnable_sink=learnable_sink, rotary_seqlens=rotary_seqlens)
    if varlen_q or cu_seqlens_k_new is not None:
        # Only the varlen form passes these, so that the fixed-length call
        # keeps its exact op call (and graph) of before.
        kwargs.update(
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_k_new=cu_seqlens_k_new, max_seqlen_q=max_seqlen_q
        )
    kwargs.update(_descale_kwargs(q_descale, k_descale, v_descale))
    if out is None:
        out, softmax_lse = torch.ops.flash_attn.fwd_kvcache(*args, **kwargs)
    else:
        target = _padded_target(out, v_cache_used.shape[-1])
        softmax_lse = torch.ops.flash_attn.fwd_kvcache_out(*args, out=target, **kwargs)
        out = _copy_back(out, target)
    out = _unpad_head_dim(out, head_dim_v)
    if k is not None:
        if k_cache_used is not k_cache:
            k_cache.copy_(k_cache_used[..., :head_dim])
        if v_cache_used is not v_cache:
            v_cache.copy_(v_cache_used[..., :head_dim_v])
    return (out, softmax_lse) if return_softmax_lse else out


_COMBINE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def flash_attn_combine(out_partial, lse_partial, out=None, out_dtype=None):
    """Merges partial attention results over disjoint key sets by their log-sum-exp.

    FlashAttention-3's ``flash_attn_combine``: for cascade attention, context
    parallelism, or a split of the keys done by the caller. Each split i holds,
    per query row, the attention output ``out_i`` over its own keys and the
    natural-log ``lse_i`` of that softmax's denominator (what the forwards
    return with ``return_softmax_lse`` / ``return_attn_probs``, with the lse
    transposed to this layout). Per row::

        m = max_i lse_i;  lse = m + log(sum_i exp(lse_i - m))
        out = sum_i exp(lse_i - lse) * out_i

    computed in fp32 whatever the dtypes. Edge cases: a split whose lse is
    -inf or +inf (this package's value for a row that sees no key) saw no key
    and contributes nothing, whatever its out row holds; a row whose splits
    all saw no key gets out = 0 and lse = +inf, so the result can be a partial
    of a further merge; a NaN lse in any split makes the row's out and lse
    NaN. There is no backward pass.

    Args:
        out_partial: (num_splits, batch, seqlen, nheads, head_dim), or varlen
            (num_splits, total, nheads, head_dim); float32, float16 or
            bfloat16; any strides. 1 <= num_splits <= 256, head_dim >= 1.
        lse_partial: float32 (num_splits, batch, seqlen, nheads), or varlen
            (num_splits, total, nheads); any strides.
        out: optional (batch, seqlen, nheads, head_dim) (varlen: (total,
            nheads, head_dim)) tensor on out_partial's device, float32,
            float16 or bfloat16, any strides: the result is written into it and
            it is what the call returns.
        out_dtype: dtype of the result when out is None: float32, float16 or
            bfloat16; default out_partial's dtype (with out, its dtype, which
            out_dtype must then match if given).

    Returns:
        (out, softmax_lse): out as described; softmax_lse float32 (batch,
        seqlen, nheads) (varlen: (total, nheads)), contiguous.
    """
    for name, t in (("out_partial", out_partial), ("lse_partial", lse_partial)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"flash_attn_combine: {name} must be a torch.Tensor, got {type(t)}")
    if out_dtype is not None and out_dtype not in _COMBINE_DTYPES:
        raise ValueError(
            "flash_attn_combine: out_dtype must be torch.float32, torch.float16 or "
            f"torch.bfloat16, got {out_dtype}"
        )
    if out is None:
        return torch.ops.flash_attn.combine(out_partial, lse_partial, out_dtype)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"flash_attn_combine: out must be a torch.Tensor, got {type(out).__name__}")
    if out_dtype is not None and out.dtype != out_dtype:
        raise ValueError(
            f"flash_attn_combine: out has dtype {out.dtype} but out_dtype is {out_dtype}; "
            "give one of them, or the same dtype"
        )
    _check_no_grad_for_out("flash_attn_combine", out_partial, lse_partial)
    softmax_lse = torch.ops.flash_attn.combine_out(out_partial, lse_partial, out=out)
    return out, softmax_lse
