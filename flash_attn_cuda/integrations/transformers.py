"""transformers (v5) on flash_attn_cuda: ``attn_implementation="flash_attn_cuda"``.

Usage::

    import flash_attn_cuda.integrations.transformers as fa_transformers
    fa_transformers.register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="flash_attn_cuda")

``register()`` adds an attention function to transformers' ``AttentionInterface``
and a mask function to its ``AttentionMaskInterface``, both under the name
"flash_attn_cuda" (and the alias "paged|flash_attn_cuda"). Nothing here poses as
the ``flash-attn`` distribution, and nothing changes until ``register()`` runs.

What the attention function serves, in transformers' calling convention
(query / key / value as ``(batch, heads, seqlen, head_dim)``):

- no padding: ``flash_attn_func`` on ``(batch, seqlen, heads, head_dim)`` views;
- a padding mask (the 2-D mask this module's mask function hands through): the
  valid tokens are gathered into packed rows and run through
  ``flash_attn_varlen_func``, and the output is scattered back (zeros at the
  dropped query rows);
- padding-free packed batches: from the ``cu_seq_lens_q/k`` and
  ``max_length_q/k`` keyword arguments (data collators, continuous batching), or
  detected from ``position_ids`` that restart inside a row;
- a paged KV cache (``block_table`` with ``k_cache`` / ``v_cache``, as
  transformers' continuous batching passes for decode batches):
  ``flash_attn_with_kvcache``, which appends the step's keys and values to the
  pages and attends in one call;
- GQA / MQA without repeating K/V, ``sliding_window``, ``softcap``, dropout
  (``module.training``), the model's ``scaling``, a value head dim smaller
  than the query's (zero-padded, then cropped), and attention sinks (``s_aux``,
  gpt-oss: one logit per query head, passed on as ``learnable_sink`` in fp32;
  its gradient flows back to the model's parameter in its own dtype). gpt-oss
  admits only the flash implementations it lists under a name that contains
  "flash": register this one under another name for it, e.g.
  ``register("fa_cuda")``.

``output_attentions`` is not served: it returns no weights (as transformers'
flash path does).

transformers treats an implementation whose name contains "flash" as a flash
kernel: at model init it asks its lazy flash import for the kernel's functions
(``flash_attn_func``, ``flash_attn_varlen_func``, ``flash_attn_with_kvcache``).
``register()`` therefore also teaches that lookup our names, so it returns this
package's functions for them and behaves as before for every other name.
"""

from __future__ import annotations

import os
import warnings
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ..interface import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

__all__ = [
    "IMPLEMENTATION",
    "PAGED_IMPLEMENTATION",
    "attention_forward",
    "attention_mask",
    "is_registered",
    "register",
]

# The names under which register() makes the implementation available.
IMPLEMENTATION = "flash_attn_cuda"
PAGED_IMPLEMENTATION = "paged|" + IMPLEMENTATION

_registered_names: set = set()


# --------------------------------------------------------------------------- #
# Masks
# --------------------------------------------------------------------------- #


def attention_mask(
    batch_size: Optional[int] = None,
    q_length: Optional[int] = None,
    kv_length: Optional[int] = None,
    q_offset=0,
    kv_offset=0,
    mask_function=None,
    attention_mask: Optional[torch.Tensor] = None,
    **kwargs,
) -> Optional[torch.Tensor]:
    """The mask transformers builds for this implementation: a 2-D key padding mask or None.

    The kernels apply causal / sliding-window masking themselves and keep packed
    sequences apart through cu_seqlens, so the only thing a mask has to carry is
    which key positions hold real tokens. The user's 2-D mask covers every
    position seen so far; a layer that keeps fewer keys (a sliding-window cache)
    sees the last ``kv_length`` of them. None when every key is valid, which lets
    the attention function take the fixed-length path.
    """
    # The other arguments (which differ between transformers 5.x releases: q_length or
    # cache_position, offsets, the mask pattern) are not needed.
    del batch_size, q_length, q_offset, kv_offset, mask_function, kwargs
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        # A prepared 4-D mask never reaches here (transformers returns it as is);
        # anything else is not a padding mask.
        raise ValueError(
            f"{IMPLEMENTATION}: expected a 2-D (batch, kv_length) padding mask, got shape "
            f"{tuple(attention_mask.shape)}"
        )
    if kv_length is None:  # every transformers 5.x passes it; keep the whole mask otherwise
        kv_length = attention_mask.shape[1]
    mask = attention_mask[:, -kv_length:]
    if mask.dtype != torch.bool:
        mask = mask.bool()
    # A mask shorter than kv_length (a static cache larger than what was filled)
    # must survive: it tells the attention function how many cache rows are real.
    if mask.shape[1] == kv_length and bool(mask.all()):
        return None
    return mask


# --------------------------------------------------------------------------- #
# Attention
# --------------------------------------------------------------------------- #


def _window(sliding_window: Optional[int], causal: bool) -> Tuple[int, int]:
    # transformers' masks (masking_utils): a causal sliding window of size w lets
    # query i see keys i - w + 1 .. i; the bidirectional one keys with |i - j| <= w.
    if sliding_window is None or sliding_window <= 0:
        return (-1, -1)
    if causal:
        return (sliding_window - 1, 0)
    return (sliding_window, sliding_window)


def _cu_seqlens(lengths: torch.Tensor) -> torch.Tensor:
    return F.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))


def _as_int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 else t.to(torch.int32)


def _packed_from_position_ids(position_ids: Optional[torch.Tensor], batch: int, seqlen: int):
    """cu_seqlens and max length when position_ids restart inside a row, else None.

    A new sequence starts at every row start and wherever the position does not
    step by exactly one (the rule transformers' eager masks use for packing).
    """
    if position_ids is None or seqlen <= 1 or position_ids.dim() != 2:
        return None
    if position_ids.shape[-1] != seqlen or position_ids.shape[0] not in (1, batch):
        return None
    pos = position_ids.expand(batch, seqlen)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = (pos[:, 1:] - pos[:, :-1]) != 1
    if not bool(starts[:, 1:].any()):
        return None
    first = torch.nonzero(starts.flatten(), as_tuple=False).flatten().to(torch.int32)
    total = torch.full((1,), batch * seqlen, dtype=torch.int32, device=first.device)
    cu = torch.cat([first, total])
    return cu, int(cu.diff().max())


def _compute_dtype(query: torch.Tensor, module) -> Optional[torch.dtype]:
    """The half dtype to run fp32 activations in on CUDA (the kernels take fp16 / bf16 there)."""
    if query.dtype != torch.float32 or query.device.type != "cuda":
        return None
    if torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    for sub in module.modules():
        if isinstance(sub, torch.nn.Linear) and sub.weight.dtype in (torch.float16, torch.bfloat16):
            return sub.weight.dtype
    return None  # the kernel's own check will name the dtype it needs


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    is_causal: Optional[bool] = None,
    s_aux: Optional[torch.Tensor] = None,
    **kwargs,
):
    """transformers' attention-function contract, served by flash_attn_cuda's kernels.

    Args:
        module: the attention module (read: ``is_causal``, for fp32 inputs on
            CUDA its Linear layers' dtype).
        query: (batch, nheads, seqlen_q, head_dim).
        key, value: (batch, nheads_k, seqlen_k, head_dim[_v]); nheads a multiple
            of nheads_k; head_dim_v <= head_dim.
        attention_mask: None or the 2-D (batch, kv_len) bool padding mask from
            :func:`attention_mask`.
        dropout: attention dropout probability (models pass 0 in eval mode).
        scaling: softmax scale; None means 1 / sqrt(head_dim).
        sliding_window: window size in transformers' sense (the query and the
            sliding_window - 1 keys before it, when causal).
        softcap: logit soft-capping (Gemma 2).
        is_causal: overrides ``module.is_causal``.
        s_aux: attention sinks, (nheads,): each query head's sink logit, in the
            units of the scaled scores (as gpt-oss's eager path concatenates
            them to ``query @ key^T * scaling``).
        kwargs: ``position_ids``; ``cu_seq_lens_q``, ``cu_seq_lens_k``,
            ``max_length_q``, ``max_length_k`` for packed batches;
            ``block_table``, ``k_cache``, ``v_cache`` for a paged cache;
            ``deterministic``. Others are ignored.

    Returns:
        (out, None) with out (batch, seqlen_q, nheads, head_dim_v).
    """
    if kwargs.get("output_attentions", False):
        warnings.warn(
            f"{IMPLEMENTATION} does not return attention weights (output_attentions=True); "
            "use attn_implementation='eager' for them",
            stacklevel=2,
        )
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            f"{IMPLEMENTATION}: only a 2-D (batch, kv_length) padding mask can be served, got a "
            f"mask of shape {tuple(attention_mask.shape)}; use attn_implementation='sdpa' or "
            "'eager' for custom 4-D masks"
        )
    if query.numel() == 0:
        raise ValueError(f"{IMPLEMENTATION}: query has a zero-sized dim: {tuple(query.shape)}")

    causal = is_causal if is_causal is not None else bool(getattr(module, "is_causal", True))
    window = _window(sliding_window, causal)
    softcap = 0.0 if softcap is None else float(softcap)
    deterministic = kwargs.get("deterministic")
    if deterministic is None:
        # Only a backward reads it, and none follows a forward run without grad
        # (generation): the environment is not read on those calls.
        deterministic = torch.is_grad_enabled() and (
            os.environ.get("FLASH_ATTENTION_DETERMINISTIC", "0") == "1"
        )
    common = dict(
        softmax_scale=scaling,
        causal=causal,
        window_size=window,
        softcap=softcap,
    )
    if s_aux is not None:
        if s_aux.dim() != 1 or s_aux.shape[0] != query.shape[1]:
            raise ValueError(
                f"{IMPLEMENTATION}: s_aux (attention sinks) must have shape (nheads,) = "
                f"({query.shape[1]},), got {tuple(s_aux.shape)}"
            )
        # The models keep the sinks in their own dtype; the kernels take fp32
        # (a differentiable cast: the gradient reaches the parameter).
        common["learnable_sink"] = s_aux.to(device=query.device, dtype=torch.float32)

    batch, _, seqlen_q, head_dim = query.shape
    # (batch, seqlen, heads, head_dim) views; the ops take any strides but the last.
    q = query.transpose(1, 2)
    k = key.transpose(1, 2)
    v = value.transpose(1, 2)
    # A smaller value head dim (head_dim_v <= head_dim) goes to the kernels as
    # it is: the ops take it.
    half = _compute_dtype(q, module)
    if half is not None:
        q, k, v = q.to(half), k.to(half), v.to(half)

    out = _dispatch(
        q, k, v, attention_mask, batch, seqlen_q, dropout, deterministic, common, kwargs
    )
    return out, None


def _dispatch(q, k, v, mask, batch, seqlen_q, dropout, deterministic, common, kwargs):
    nheads, head_dim = q.shape[2], q.shape[3]
    train = dict(dropout_p=dropout, deterministic=deterministic)

    # 1. Paged cache (decode batches of continuous batching): append + attend.
    block_table = kwargs.get("block_table")
    k_cache, v_cache = kwargs.get("k_cache"), kwargs.get("v_cache")
    cu_k = kwargs.get("cu_seq_lens_k")
    if block_table is not None and k_cache is not None and v_cache is not None and cu_k is not None:
        # One query token per sequence: (num_seqs, 1, heads, head_dim).
        qs, ks, vs = (t.reshape(-1, 1, *t.shape[-2:]) for t in (q, k, v))
        n = ks.shape[0]
        cu_k = _as_int32(cu_k)
        # cu_seq_lens_k counts the new token; the cache holds one fewer before the append.
        cache_seqlens = cu_k[1 : n + 1] - cu_k[:n] - 1
        out = flash_attn_with_kvcache(
            qs,
            k_cache,
            v_cache,
            ks,
            vs,
            cache_seqlens=cache_seqlens,
            block_table=_as_int32(block_table),
            **common,
        )
        return out.reshape(batch, -1, nheads, out.shape[-1])

    # 2. Padding: gather the valid tokens into packed rows, attend, scatter back.
    if mask is not None:
        return _padded(q, k, v, mask, batch, seqlen_q, common, train)

    # 3. Packed (padding-free) batches with precomputed boundaries.
    cu_q = kwargs.get("cu_seq_lens_q")
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    if cu_q is not None and cu_k is not None and max_q is not None and max_k is not None:
        out = flash_attn_varlen_func(
            q.reshape(-1, nheads, head_dim),
            k.reshape(-1, *k.shape[-2:]),
            v.reshape(-1, *v.shape[-2:]),
            _as_int32(cu_q),
            _as_int32(cu_k),
            max_q,
            max_k,
            **train,
            **common,
        )
        return out.reshape(batch, -1, nheads, out.shape[-1])

    # 4. Packed batches told apart by position_ids only.
    if k.shape[1] == seqlen_q:
        packed = _packed_from_position_ids(kwargs.get("position_ids"), batch, seqlen_q)
        if packed is not None:
            cu, max_len = packed
            out = flash_attn_varlen_func(
                q.reshape(-1, nheads, head_dim),
                k.reshape(-1, *k.shape[-2:]),
                v.reshape(-1, *v.shape[-2:]),
                cu,
                cu,
                max_len,
                max_len,
                **train,
                **common,
            )
            return out.reshape(batch, seqlen_q, nheads, out.shape[-1])

    # 5. Fixed length.
    return flash_attn_func(q, k, v, **train, **common)


def _padded(q, k, v, mask, batch, seqlen_q, common, train):
    """Attention of a padded batch through the varlen kernel."""
    mask = mask.to(device=q.device, dtype=torch.bool)
    kv_len = mask.shape[1]
    if k.shape[1] < kv_len:
        raise ValueError(
            f"{IMPLEMENTATION}: the padding mask covers {kv_len} keys but only {k.shape[1]} "
            "were given"
        )
    # A static cache can be longer than what the mask covers: the rest is unused.
    k, v = k[:, :kv_len], v[:, :kv_len]
    nheads, head_dim = q.shape[2], q.shape[3]

    lens_k = mask.sum(dim=1, dtype=torch.int32)
    idx_k = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    cu_k = _cu_seqlens(lens_k)
    max_k = int(lens_k.max())
    k_packed = k.reshape(batch * kv_len, *k.shape[2:]).index_select(0, idx_k)
    v_packed = v.reshape(batch * kv_len, *v.shape[2:]).index_select(0, idx_k)

    if not common["causal"]:
        # Every query row is computed (encoders, cross-attention): each attends
        # to its own sequence's valid keys.
        idx_q = None
        cu_q = torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, dtype=torch.int32, device=q.device)
        max_q = seqlen_q
        q_packed = q.reshape(batch * seqlen_q, nheads, head_dim)
    elif seqlen_q == 1:
        # Decoding: one (real) query token per sequence.
        idx_q = None
        cu_q = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
        max_q = 1
        q_packed = q.reshape(batch, nheads, head_dim)
    else:
        # Causal: the queries are the last seqlen_q positions of the keys; their
        # padded rows are dropped (the output there is zero).
        mask_q = mask if seqlen_q == kv_len else mask[:, -seqlen_q:]
        lens_q = mask_q.sum(dim=1, dtype=torch.int32)
        idx_q = (
            idx_k
            if seqlen_q == kv_len
            else (torch.nonzero(mask_q.flatten(), as_tuple=False).flatten())
        )
        cu_q = cu_k if seqlen_q == kv_len else _cu_seqlens(lens_q)
        max_q = max_k if seqlen_q == kv_len else int(lens_q.max())
        q_packed = q.reshape(batch * seqlen_q, nheads, head_dim).index_select(0, idx_q)

    out = flash_attn_varlen_func(
        q_packed, k_packed, v_packed, cu_q, cu_k, max_q, max_k, **train, **common
    )
    if idx_q is not None:
        full = out.new_zeros(batch * seqlen_q, nheads, out.shape[-1])
        out = full.index_copy(0, idx_q, out)
    return out.reshape(batch, seqlen_q, nheads, out.shape[-1])


# --------------------------------------------------------------------------- #
# Registration
# --------------------------------------------------------------------------- #


def _teach_flash_lookup(names) -> None:
    """Make transformers' lazy flash-kernel lookup return our functions for our names.

    transformers calls it at model init for any implementation whose name
    contains "flash" (and its own flash wrapper calls it on every forward). For
    names it does not know it would look for a hub kernel and fail. The lookup
    is wrapped once; every other name goes to the original.
    """
    try:
        from transformers import modeling_flash_attention_utils as fa_utils
    except ImportError:  # pragma: no cover - depends on the transformers version
        return
    current = getattr(fa_utils, "_lazy_imports", None)
    if current is None:  # pragma: no cover - a transformers without this hook
        return
    served = getattr(current, "_flash_attn_cuda_names", None)
    if served is not None:
        served.update(names)
        return
    original = current
    pad = getattr(fa_utils, "_pad_input", None)
    unpad = getattr(fa_utils, "_unpad_input", None)

    # Releases up to about 5.2 return (func, varlen_func, pad, unpad); later ones add
    # the kvcache function after varlen_func (and keep it in _flash_with_kvcache_fn).
    with_kvcache = hasattr(fa_utils, "_flash_with_kvcache_fn")

    def lazy_imports(implementation, *args, **kwargs):
        if implementation in lazy_imports._flash_attn_cuda_names:
            if with_kvcache:
                return flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, pad, unpad
            return flash_attn_func, flash_attn_varlen_func, pad, unpad
        return original(implementation, *args, **kwargs)

    lazy_imports._flash_attn_cuda_names = set(names)
    lazy_imports.__wrapped__ = original
    fa_utils._lazy_imports = lazy_imports


def register(name: str = IMPLEMENTATION) -> str:
    """Register flash_attn_cuda with transformers; returns the name to pass as attn_implementation.

    Registers ``name`` and ``"paged|" + name`` in ``AttentionInterface`` and
    ``AttentionMaskInterface`` (global mappings: every model in the process
    sees them). Idempotent. Raises ImportError when transformers is missing.
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as exc:
        raise ImportError(
            "flash_attn_cuda.integrations.transformers.register() needs transformers >= 5 "
            f"(`pip install transformers`): {exc}"
        ) from exc
    names = (name, "paged|" + name)
    for n in names:
        AttentionInterface.register(n, attention_forward)
        AttentionMaskInterface.register(n, attention_mask)
    _teach_flash_lookup(names)
    _registered_names.update(names)
    return name


def is_registered(name: str = IMPLEMENTATION) -> bool:
    """Whether register(name) has run in this process."""
    return name in _registered_names
