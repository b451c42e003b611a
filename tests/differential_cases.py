"""Seeded random cases for the CUDA-against-CPU differential test
(test_cuda_differential.py).

A case is a plain dict that draw_case(seed) draws from random.Random(seed)
alone, so a seed names its case and reproduces it by itself. The tensors of a
case come from a torch.Generator seeded with the same seed, on the CPU, and are
copied to each device, so both paths see identical inputs (and identical
strided views of them). The pieces:

* draw_case(seed): the configuration (shapes, features, which op).
* build_inputs(case): the CPU tensors ("bases": the views are rebuilt on each
  device from them), NaN planted where nothing may be read.
* run_ops(case, inputs, device): the torch.ops.flash_attn calls of the case on
  one device; results on the CPU.
* references(case, inputs, device): plain-torch attention (reference.py) in
  float64, float32 and the input dtype, the gradients, and the expected caches
  after a kvcache append; it gives the tolerances.
* compare(case, inputs, got, other, refs): the mismatches between two results
  (CUDA against CPU, or the CPU op against the float64 reference) as strings.

Tolerances (the correctness criterion of docs/architecture.md, adapted to two
implementations that both accumulate in fp32 from the same low-precision inputs):

* out / S_dmask: max|a - b| <= 2 * max|same_dtype - ref64| + ulp(max|ref64|):
  each side is within the criterion of the exact result, and the two final
  roundings to fp16 / bf16 may land one ulp apart.
* dq / dk / dv: the same with factor 3 (docs/architecture.md) and 1e-4 of absolute
  slack for gradients that are exactly zero in exact arithmetic.
* dq / dk / dv also get twice the part of the gradient that comes from
  FlashAttention-2's backward taking D = rowsum(dO * O) from the output
  rounded to fp16 / bf16 (computed exactly, see _grads).
* lse (fp32 on both paths): max|a - b| <= 4 * max|lse32 - lse64| +
  1e-5 * (1 + max|lse64|), i.e. a few times the fp32 rounding noise of the
  same math, plus softcap * 2^-10 with softcap (the CUDA build's tanh is
  tanh.approx.f32, see softcap_score_error); rows that see no key must be
  +inf on both.
* caches after an append: bitwise, except keys rotated in fp32 and rounded
  once, which may differ by one ulp; rows outside the appended ones bitwise
  unchanged (NaN included).

A value head dim below the query / key one (d_v < d_qk, head_dim_v) cuts v,
v_cache and v_new as the first d_v columns of wider tensors whose other
columns are NaN: a kernel that read V past d_v would put NaN into dP (and so
dq / dk), and one that wrote past it would change the bases (checked).
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import random
import time

import torch

from reference import (
    attention_ref,
    dropout_threshold,
    normalize_window,
    philox4x32_10,
    varlen_attention_ref,
)
from test_cpu_kvcache import apply_rotary

ops = torch.ops.flash_attn

# ---------------------------------------------------------------------------
# Knobs
# ---------------------------------------------------------------------------

DEFAULT_CASES = 2000
CHUNK = 50
# Base seed of case 0; FLASH_ATTN_TEST_SEED = n shifts it by n * SEED_STRIDE,
# so every shift draws a disjoint set of cases.
BASE_SEED = 7_000_000
SEED_STRIDE = 1_000_000

HEAD_DIMS = (32, 64, 96, 128, 256)
# Share of the cases with d_v < d_qk, and the d_v drawn for them (those below d_qk).
SMALLER_HEAD_DIM_V = 0.15
HEAD_DIMS_V = (16, 32, 64, 128)
HEAD_DIM_WEIGHTS = (1.0, 3.0, 1.0, 3.0, 1.2)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
MANTISSA_BITS = {torch.float16: 10, torch.bfloat16: 7, torch.float32: 23}
MAX_SEQLEN = 300
EDGE_LENGTHS = (
    1,
    2,
    3,
    7,
    15,
    16,
    17,
    31,
    32,
    33,
    63,
    64,
    65,
    127,
    128,
    129,
    191,
    255,
    256,
    257,
    300,
)
KV_PAGE_SIZES = (1, 5, 16, 32, 48, 64, 256)  # any size on every path
VARLEN_PAGE_SIZES = (1, 7, 16, 48, 64, 256)  # varlen_fwd gathers pages: any size
# b * nheads * seqlen_q * seqlen_k * head_dim above which the batch shrinks, to
# keep the CPU reference quick.
WORK_CAP = 60_000_000


def base_seed():
    return BASE_SEED + SEED_STRIDE * int(os.environ.get("FLASH_ATTN_TEST_SEED", "0"))


def case_count():
    return int(os.environ.get("FLASH_ATTN_DIFF_CASES", str(DEFAULT_CASES)))


# ---------------------------------------------------------------------------
# Drawing a configuration
# ---------------------------------------------------------------------------


def _draw_len(rng, hi=MAX_SEQLEN, lo=1):
    r = rng.random()
    if r < 0.06:
        return max(lo, rng.choice([1, 1, 2]))
    if r < 0.25:
        choices = [n for n in EDGE_LENGTHS if lo <= n <= hi]
        if choices:
            return rng.choice(choices)
    if r < 0.65:
        return rng.randint(lo, max(lo, min(64, hi)))
    return rng.randint(lo, max(lo, hi))


def _draw_heads(rng):
    """(nheads, nheads_k): GQA ratio 1, 2, 4, 8, or MQA (one kv head)."""
    ratio = rng.choices([1, 2, 4, 8, "mqa"], weights=[3, 2, 2, 1, 2])[0]
    if ratio == "mqa":
        return rng.choice([2, 3, 5, 6, 7, 8]), 1
    nheads_k = rng.randint(1, 8 // ratio)
    return nheads_k * ratio, nheads_k


def _draw_side(rng, seqlen_k):
    r = rng.random()
    if r < 0.22:
        return -1
    if r < 0.27:
        return -rng.randint(2, 50)  # any negative side is unbounded
    if r < 0.37:
        return 0
    if r < 0.67:
        return rng.randint(1, 16)
    return rng.randint(0, max(seqlen_k, 1) + 16)


def _draw_mask(rng, seqlen_k):
    """(causal, window_left, window_right) as passed to the op."""
    r = rng.random()
    if r < 0.3:
        return False, -1, -1
    if r < 0.55:
        # The op forces right = 0 under causal, whatever is passed.
        return True, -1, rng.choice([-1, -1, 0, rng.randint(1, 9)])
    if r < 0.9:
        return False, _draw_side(rng, seqlen_k), _draw_side(rng, seqlen_k)
    return True, rng.randint(0, max(seqlen_k, 1) + 8), -1


def _draw_scores(rng, c, head_dim):
    """Score modifiers shared by every kind."""
    r = rng.random()
    if r < 0.76:
        c["scale_kind"], c["softmax_scale"] = "default", head_dim**-0.5
    elif r < 0.9:
        c["scale_kind"], c["softmax_scale"] = "positive", rng.uniform(0.3, 2.0) * head_dim**-0.5
    else:
        c["scale_kind"], c["softmax_scale"] = "negative", -rng.uniform(0.3, 1.5) * head_dim**-0.5
    c["softcap"] = 0.0
    if rng.random() < 0.17:
        c["softcap"] = rng.choice([rng.uniform(0.5, 3.0), rng.uniform(5.0, 50.0)])
    c["alibi"] = None
    if rng.random() < 0.17:
        c["alibi"] = rng.choice(["head", "batch_head"])
        c["alibi_max"] = rng.choice([0.05, 0.3, 1.0])
    c["spread"] = 1.0 if rng.random() < 0.8 else rng.uniform(2.0, 4.0)
    c["fwd_kernel"] = rng.choices(["auto", "sm80", "sm90"], weights=[2, 1, 1])[0]
    c["bwd_kernel"] = rng.choices(["auto", "sm80", "sm90"], weights=[2, 1, 1])[0]


def _draw_dropout(rng, c):
    c["dropout_p"] = rng.choices([0.0, 0.1, 0.17], weights=[0.64, 0.18, 0.18])[0]
    c["philox_seed"] = rng.getrandbits(rng.choice([20, 40, 63]))
    c["philox_offset"] = rng.getrandbits(rng.choice([8, 32, 62]))
    # How the seed reaches the op: the int arguments, or an rng_state tensor
    # [seed, offset] (on the CPU or on the op's device).
    c["rng_via"] = rng.choice(["ints", "ints", "tensor_cpu", "tensor_device"])
    c["return_softmax"] = c["dropout_p"] > 0 and rng.random() < 0.3


def _draw_backward(rng, c):
    c["bwd"] = rng.random() < 0.55
    c["deterministic"] = c["bwd"] and rng.random() < 0.35


def draw_case(seed):
    """The configuration of case `seed`, from random.Random(seed) only."""
    rng = random.Random(seed)
    kind = rng.choices(["fixed", "varlen", "kvcache"], weights=[0.4, 0.3, 0.3])[0]
    c = {"seed": seed, "kind": kind, "dtype": rng.choice(["fp16", "bf16"])}
    c["head_dim"] = rng.choices(HEAD_DIMS, weights=HEAD_DIM_WEIGHTS)[0]
    c["head_dim_v"] = _draw_head_dim_v(seed, c["head_dim"])
    c["nheads"], c["nheads_k"] = _draw_heads(rng)
    _draw_scores(rng, c, c["head_dim"])
    {"fixed": _draw_fixed, "varlen": _draw_varlen, "kvcache": _draw_kvcache}[kind](rng, c)
    return c


def _draw_head_dim_v(seed, head_dim):
    """d_v, from a generator of its own: the rest of a seed's case is what it
    was before cases had a d_v."""
    rng = random.Random(seed ^ 0x5F3759DF)
    smaller = [d for d in HEAD_DIMS_V if d < head_dim]
    return rng.choice(smaller) if rng.random() < SMALLER_HEAD_DIM_V else head_dim


def head_dim_v(c):
    return c.get("head_dim_v", c["head_dim"])


def _draw_fixed(rng, c):
    c["batch"] = rng.randint(1, 4)
    # Self-attention on one packed qkv tensor needs one length and one head count.
    qkvpacked = rng.random() < 0.12
    if qkvpacked:
        c["nheads_k"] = c["nheads"]
    r = rng.random()
    if qkvpacked:
        c["seqlen_q"] = c["seqlen_k"] = _draw_len(rng)
    elif r < 0.03:
        c["seqlen_q"], c["seqlen_k"] = rng.choice([(0, _draw_len(rng)), (_draw_len(rng), 0)])
    elif r < 0.33:
        c["seqlen_q"] = c["seqlen_k"] = _draw_len(rng)
    else:
        c["seqlen_q"], c["seqlen_k"] = _draw_len(rng), _draw_len(rng)
    c["causal"], c["window_left"], c["window_right"] = _draw_mask(rng, c["seqlen_k"])
    _draw_dropout(rng, c)
    _draw_backward(rng, c)
    c["layout"] = (
        "qkvpacked"
        if qkvpacked
        else rng.choice(["contiguous", "contiguous", "kvpacked", "bhsd", "head_slice", "dim_pad"])
    )
    work = lambda: c["batch"] * c["nheads"] * c["seqlen_q"] * c["seqlen_k"] * c["head_dim"]
    while c["batch"] > 1 and work() > WORK_CAP:
        c["batch"] -= 1


def _draw_varlen(rng, c):
    batch = rng.randint(1, 5)
    qkvpacked = rng.random() < 0.12
    if qkvpacked:
        c["nheads_k"] = c["nheads"]
    mode = (
        "self"
        if qkvpacked
        else rng.choice(["self", "independent", "independent", "q_shorter", "q_longer"])
    )
    seqlens_q, seqlens_k = [], []
    for _ in range(batch):
        sq = 0 if rng.random() < 0.1 else _draw_len(rng, hi=200)
        sk = 0 if rng.random() < 0.1 else _draw_len(rng, hi=MAX_SEQLEN)
        if mode == "self":
            sk = sq
        elif mode == "q_shorter" and sq > sk:
            sq, sk = sk, sq
        elif mode == "q_longer" and sq < sk:
            sq, sk = sk, sq
        seqlens_q.append(sq)
        seqlens_k.append(sk)
    c["seqlens_q"], c["seqlens_k"] = seqlens_q, seqlens_k
    c["batch"] = batch
    # Rows outside every sequence: before the first one and after the last.
    padded = rng.random() < 0.3
    c["q_offset"] = rng.randint(1, 5) if padded and rng.random() < 0.5 else 0
    c["q_tail"] = rng.randint(1, 9) if padded and rng.random() < 0.5 else 0
    c["k_offset"] = rng.randint(1, 7) if padded else 0
    c["k_tail"] = rng.randint(1, 40) if padded else 0
    if qkvpacked:  # one packed tensor: the same rows for queries and keys
        c["k_offset"], c["k_tail"] = c["q_offset"], c["q_tail"]
    c["poison"] = padded  # NaN in the key / value rows outside every sequence
    c["max_seqlen_q"] = max(seqlens_q) + (rng.randint(1, 20) if rng.random() < 0.12 else 0)
    c["max_seqlen_k"] = max(seqlens_k) + (rng.randint(1, 20) if rng.random() < 0.12 else 0)
    c["causal"], c["window_left"], c["window_right"] = _draw_mask(rng, c["max_seqlen_k"])
    _draw_dropout(rng, c)
    c["page_size"] = None
    if not qkvpacked and rng.random() < 0.12:
        # Paged keys / values in the varlen forward (no backward).
        c["page_size"] = rng.choice(VARLEN_PAGE_SIZES)
        c["table_fill"] = rng.choice(["pages", "minus_one"])
        c["bwd"], c["deterministic"] = False, False
    else:
        _draw_backward(rng, c)
    layouts = ["contiguous", "contiguous", "head_slice"]
    if c["page_size"] is None:
        layouts.append("kvpacked")
    c["layout"] = "qkvpacked" if qkvpacked else rng.choice(layouts)
    # Drawn last so that the draws above (and the cases of earlier seeds) stay
    # as they were. Not with qkvpacked: its query rows are its key rows, so the
    # NaN planted past seqused_q would land in keys the call reads.
    c["seqused_q"] = None
    if not qkvpacked and rng.random() < 0.2:
        c["seqused_q"] = [
            rng.choice([0, n]) if rng.random() < 0.25 else rng.randint(0, n) for n in c["seqlens_q"]
        ]


def _draw_kvcache(rng, c):
    c["batch"] = batch = rng.randint(1, 4)
    r = rng.random()
    c["seqlen_q"] = (
        1 if r < 0.45 else rng.randint(2, 8) if r < 0.75 else rng.randint(9, 64) if r < 0.96 else 0
    )
    r = rng.random()
    if r < 0.35:
        c["seqlen_new"] = None  # no k / v given
    elif r < 0.4:
        c["seqlen_new"] = 0  # k / v of zero rows
    elif r < 0.6:
        c["seqlen_new"] = 1
    elif r < 0.85:
        c["seqlen_new"] = rng.randint(2, 8)
    else:
        c["seqlen_new"] = rng.randint(9, 32)
    if c["seqlen_q"] == 0 and c["seqlen_new"] is None:
        c["seqlen_new"] = rng.randint(1, 4)  # a call with neither queries nor appends tests nothing
    new = c["seqlen_new"] or 0
    min_capacity = max(new, c["seqlen_q"] if c["seqlen_new"] is not None else 0, 1)
    c["page_size"] = rng.choice(KV_PAGE_SIZES) if rng.random() < 0.4 else None
    if c["page_size"] is not None:
        ps = c["page_size"]
        wanted = rng.randint(min_capacity, max(min_capacity, 400 if ps < 256 else 512))
        c["pages_per_seq"] = max(1, -(-wanted // ps))
        c["capacity"] = c["pages_per_seq"] * ps
        c["spare_pages"] = rng.randint(0, 3)
        c["table_fill"] = rng.choice(["pages", "minus_one"])
    else:
        c["capacity"] = rng.randint(min_capacity, max(min_capacity, 400))
    cap = c["capacity"]
    c["causal"], c["window_left"], c["window_right"] = _draw_mask(rng, cap)
    if c["seqlen_new"] is None and rng.random() < 0.1:
        c["cache_seqlens"] = None  # the whole cache is valid
    else:
        top = cap - new
        c["cache_seqlens"] = [
            rng.choice([0, top]) if rng.random() < 0.15 else rng.randint(0, top)
            for _ in range(batch)
        ]
    # Rotary embedding of the new keys and of q (needs k / v).
    c["rotary"] = None
    if c["seqlen_new"] is not None and rng.random() < 0.45:
        c["rotary"] = rng.choice(["interleaved", "neox"])
        d = c["head_dim"]
        options = [d, d // 2] + [m for m in range(16, d + 1, 16)]
        c["rotary_dim"] = rng.choices(
            [rng.choice(options), rng.randrange(8, d + 1, 8), rng.randrange(2, d + 1, 2)],
            weights=[0.7, 0.2, 0.1],
        )[0]
        c["seqlen_rotary"] = cap + max(c["seqlen_q"], 1) + rng.randint(0, 5)
    c["cache_batch_idx"] = None
    c["cache_leftpad"] = None
    c["batch_cache"] = batch
    c["packed_cache"] = False
    if c["page_size"] is None:
        if rng.random() < 0.25:
            c["batch_cache"] = batch + rng.randint(0, 3)
            if c["seqlen_new"] is None and rng.random() < 0.3:
                # Without an append two sequences may share a cache row.
                c["cache_batch_idx"] = [rng.randrange(c["batch_cache"]) for _ in range(batch)]
            else:
                c["cache_batch_idx"] = rng.sample(range(c["batch_cache"]), batch)
        if rng.random() < 0.2 and c["cache_seqlens"] is not None:
            c["cache_leftpad"] = [
                rng.choice([0, e]) if rng.random() < 0.2 else rng.randint(0, e)
                for e in c["cache_seqlens"]
            ]
        c["packed_cache"] = rng.random() < 0.15
    c["q_layout"] = "head_slice" if rng.random() < 0.15 else "contiguous"
    r = rng.random()
    c["num_splits"] = 0 if r < 0.4 else 1 if r < 0.65 else rng.choice([2, 3, 4, 5, 8, 16, 64])
    c["dropout_p"], c["bwd"], c["deterministic"] = 0.0, False, False
    # Drawn last, for the same reason as seqused_q in _draw_varlen.
    if c["page_size"] is not None:
        # FA3's call shapes on a paged cache (docs/serving.md): a table with more
        # rows than the batch, of which cache_batch_idx picks some (distinct: an
        # append into a shared row of pages would race), and left padding over
        # the logical rows of the pages.
        if rng.random() < 0.25:
            c["batch_cache"] = batch + rng.randint(0, 3)
            c["cache_batch_idx"] = rng.sample(range(c["batch_cache"]), batch)
        if rng.random() < 0.25 and c["cache_seqlens"] is not None:
            c["cache_leftpad"] = [
                rng.choice([0, e]) if rng.random() < 0.2 else rng.randint(0, e)
                for e in c["cache_seqlens"]
            ]
    c["rotary_seqlens"] = None
    if c["rotary"] and rng.random() < 0.3:
        # Rotary positions apart from the cache positions: new key i at
        # rotary_seqlens[b] + i, and q row i there too under a window; the last
        # one must stay inside the tables.
        top = c["seqlen_rotary"] - max(new, c["seqlen_q"], 1)
        c["rotary_seqlens"] = [
            rng.choice([0, top]) if rng.random() < 0.2 else rng.randint(0, top)
            for _ in range(batch)
        ]


# ---------------------------------------------------------------------------
# Describing, validating and counting cases
# ---------------------------------------------------------------------------


def describe(c):
    """One line with everything needed to read a failure."""
    parts = [
        f"seed={c['seed']}",
        c["kind"],
        c["dtype"],
        f"d={c['head_dim']}" + (f"/{head_dim_v(c)}" if head_dim_v(c) != c["head_dim"] else ""),
        f"h={c['nheads']}/{c['nheads_k']}",
    ]
    if c["kind"] == "fixed":
        parts.append(f"b={c['batch']} sq={c['seqlen_q']} sk={c['seqlen_k']} layout={c['layout']}")
    elif c["kind"] == "varlen":
        parts.append(
            f"sq={c['seqlens_q']} sk={c['seqlens_k']} max=({c['max_seqlen_q']},"
            f"{c['max_seqlen_k']}) pad=q{c['q_offset']}+{c['q_tail']}/k{c['k_offset']}"
            f"+{c['k_tail']} layout={c['layout']}"
        )
        if c["page_size"] is not None:
            parts.append(f"paged={c['page_size']}/{c['table_fill']}")
        if c.get("seqused_q") is not None:
            parts.append(f"seqused_q={c['seqused_q']}")
    else:
        parts.append(
            f"b={c['batch']} sq={c['seqlen_q']} new={c['seqlen_new']} cap={c['capacity']} "
            f"seqlens={c['cache_seqlens']}"
        )
        if c["page_size"] is not None:
            parts.append(
                f"paged={c['page_size']}x{c['pages_per_seq']}+{c['spare_pages']}/{c['table_fill']}"
            )
        if c["cache_batch_idx"] is not None:
            parts.append(f"batch_idx={c['cache_batch_idx']}/{c['batch_cache']}")
        if c["cache_leftpad"] is not None:
            parts.append(f"leftpad={c['cache_leftpad']}")
        if c["rotary"]:
            parts.append(f"rotary={c['rotary']}:{c['rotary_dim']}")
            if c.get("rotary_seqlens") is not None:
                parts.append(f"rotary_seqlens={c['rotary_seqlens']}")
        if c["packed_cache"]:
            parts.append("packed_cache")
        parts.append(f"q={c['q_layout']} splits={c['num_splits']}")
    parts.append(f"causal={int(c['causal'])} win=({c['window_left']},{c['window_right']})")
    parts.append(f"scale={c['softmax_scale']:.4g}")
    if c["softcap"]:
        parts.append(f"softcap={c['softcap']:.3g}")
    if c["alibi"]:
        parts.append(f"alibi={c['alibi']}:{c['alibi_max']}")
    if c["spread"] != 1.0:
        parts.append(f"spread={c['spread']:.2f}")
    if c["dropout_p"]:
        parts.append(
            f"dropout={c['dropout_p']} philox=({c['philox_seed']},{c['philox_offset']})"
            f" via={c['rng_via']}" + (" return_softmax" if c["return_softmax"] else "")
        )
    if c["bwd"]:
        parts.append("bwd" + (" deterministic" if c["deterministic"] else ""))
    parts.append(f"kernels={c['fwd_kernel']}/{c['bwd_kernel']}")
    return " ".join(parts)


def validate(c):
    """Structural rules the CUDA path relies on; returns the broken ones."""
    bad = []
    d, h, hk = c["head_dim"], c["nheads"], c["nheads_k"]
    if d not in HEAD_DIMS:
        bad.append(f"head_dim {d}")
    dv = head_dim_v(c)
    if dv % 8 or not 8 <= dv <= d:
        bad.append(f"head_dim_v {dv}")
    if h % hk or h > 8:
        bad.append(f"heads {h}/{hk}")
    if c["dropout_p"] not in (0.0, 0.1, 0.17):
        bad.append("dropout_p")
    if c["kind"] == "fixed":
        if not (
            1 <= c["batch"] <= 4
            and 0 <= c["seqlen_q"] <= MAX_SEQLEN
            and 0 <= c["seqlen_k"] <= MAX_SEQLEN
        ):
            bad.append("fixed shape")
        if c["layout"] == "qkvpacked" and (c["seqlen_q"] != c["seqlen_k"] or h != hk):
            bad.append("qkvpacked needs one seqlen and one head count")
    elif c["kind"] == "varlen":
        if c["max_seqlen_q"] < max(c["seqlens_q"]) or c["max_seqlen_k"] < max(c["seqlens_k"]):
            bad.append("max_seqlen below a sequence length")
        if c["page_size"] is not None and c["bwd"]:
            bad.append("paged varlen has no backward")
        used = c.get("seqused_q")
        if used is not None and (
            c["layout"] == "qkvpacked"
            or len(used) != c["batch"]
            or any(not 0 <= u <= n for u, n in zip(used, c["seqlens_q"]))
        ):
            bad.append("seqused_q out of range (or with qkvpacked)")
        if c["layout"] == "qkvpacked" and (
            c["seqlens_q"] != c["seqlens_k"]
            or h != hk
            or c["page_size"] is not None
            or (c["q_offset"], c["q_tail"]) != (c["k_offset"], c["k_tail"])
        ):
            bad.append("qkvpacked needs the same rows for queries and keys")
    else:
        cap, new = c["capacity"], c["seqlen_new"] or 0
        if c["page_size"] is not None:
            if cap != c["page_size"] * c["pages_per_seq"]:
                bad.append("capacity")
        if c["seqlen_new"] is not None and c["seqlen_q"] > cap:
            bad.append("seqlen_q above the capacity with an append")
        seqlens = c["cache_seqlens"]
        if seqlens is None:
            if c["seqlen_new"] is not None:
                bad.append("an append needs cache_seqlens")
        else:
            if any(not 0 <= e <= cap - new for e in seqlens):
                bad.append("cache_seqlens out of range")
            if c["cache_leftpad"] is not None and any(
                not 0 <= p <= e for p, e in zip(c["cache_leftpad"], seqlens)
            ):
                bad.append("cache_leftpad out of range")
        idx = c["cache_batch_idx"]
        if idx is not None:
            if any(not 0 <= i < c["batch_cache"] for i in idx):
                bad.append("cache_batch_idx out of range")
            if c["seqlen_new"] and len(set(idx)) != len(idx):
                bad.append("two appends into one cache row")
            if c["page_size"] is not None and len(set(idx)) != len(idx):
                bad.append("two sequences on one row of pages")
        if c["rotary"]:
            if c["seqlen_new"] is None:
                bad.append("rotary needs k / v")
            rd = c["rotary_dim"]
            if rd % 2 or not 2 <= rd <= c["head_dim"]:
                bad.append("rotary_dim")
            if c["seqlen_rotary"] < cap + max(c["seqlen_q"], 1):
                bad.append("seqlen_rotary")
            rs = c.get("rotary_seqlens")
            if rs is not None and any(
                not 0 <= p <= c["seqlen_rotary"] - max(new, c["seqlen_q"], 1) for p in rs
            ):
                bad.append("rotary_seqlens reach past the rotary tables")
        if c["num_splits"] < 0:
            bad.append("num_splits")
    return bad


def features(c):
    """The coverage tags of a case (what the generator claims to cover)."""
    f = {
        f"kind:{c['kind']}",
        f"dtype:{c['dtype']}",
        f"head_dim:{c['head_dim']}",
        f"fwd_kernel:{c['fwd_kernel']}",
        f"scale:{c['scale_kind']}",
    }
    if head_dim_v(c) < c["head_dim"]:
        f.add(f"head_dim_v<head_dim:{c['kind']}")
        if c["bwd"]:
            f.add("head_dim_v<head_dim:bwd")
    h, hk = c["nheads"], c["nheads_k"]
    f.add(f"gqa_ratio:{h // hk}")
    if hk == 1 and h > 1:
        f.add("mqa")
    if c["causal"]:
        f.add("causal")
        if c["window_left"] >= 0:
            f.add("causal+local_left")
    left, right = c["window_left"], c["window_right"]
    if not c["causal"] and (left >= 0 or right >= 0):
        f.add("local")
        f.add("local:" + ("both" if left >= 0 and right >= 0 else "left" if left >= 0 else "right"))
        if 0 in (left, right):
            f.add("local:zero_side")
    if not c["causal"] and min(left, right) < -1:
        f.add("window:negative_below_-1")
    if c["softcap"]:
        f.add("softcap")
    if c["alibi"]:
        f.add(f"alibi:{c['alibi']}")
    if c["spread"] != 1.0:
        f.add("spread_scores")
    if c["dropout_p"]:
        f.add(f"dropout:{c['dropout_p']}")
        f.add(f"rng_via:{c['rng_via']}")
        if c["return_softmax"]:
            f.add("return_softmax")
    if c["bwd"]:
        f.add(f"bwd:{c['kind']}")
        f.add(f"bwd_kernel:{c['bwd_kernel']}")
        if c["deterministic"]:
            f.add("deterministic")
        if c["dropout_p"]:
            f.add("bwd+dropout")
    if c["kind"] == "fixed":
        sq, sk = c["seqlen_q"], c["seqlen_k"]
        f.add(f"layout:{c['layout']}")
        f.add("sq==sk" if sq == sk else "sq>sk" if sq > sk else "sq<sk")
        if 0 in (sq, sk):
            f.add("fixed:empty")
        if 1 in (sq, sk):
            f.add("fixed:seqlen_1")
        if sq % 2 or sk % 2:
            f.add("fixed:odd_seqlen")
        if c["batch"] > 1:
            f.add("fixed:batch>1")
    elif c["kind"] == "varlen":
        f.add(f"varlen_layout:{c['layout']}")
        pairs = list(zip(c["seqlens_q"], c["seqlens_k"]))
        if any(0 in p for p in pairs):
            f.add("varlen:empty_seq")
        if any(sq == 0 and sk > 0 for sq, sk in pairs):
            f.add("varlen:empty_q")
        if any(sk == 0 and sq > 0 for sq, sk in pairs):
            f.add("varlen:empty_k")
        if any(1 in p for p in pairs):
            f.add("varlen:seqlen_1")
        if any(sq % 2 or sk % 2 for sq, sk in pairs):
            f.add("varlen:odd_seqlen")
        if any(sq > sk for sq, sk in pairs):
            f.add("varlen:sq>sk")
        if any(sq < sk for sq, sk in pairs):
            f.add("varlen:sq<sk")
        if c["poison"]:
            f.add("varlen:rows_outside_poisoned")
        if c["max_seqlen_k"] > max(c["seqlens_k"]) or c["max_seqlen_q"] > max(c["seqlens_q"]):
            f.add("varlen:max_seqlen_above_longest")
        if c["page_size"] is not None:
            f.add("varlen:paged")
            f.add(f"varlen_page_size:{c['page_size']}")
        if c.get("seqused_q") is not None:
            f.add("varlen:seqused_q")
            if c["bwd"]:
                f.add("bwd:seqused_q")
            if c["page_size"] is not None:
                f.add("varlen:seqused_q+paged")
    else:
        f.add("kv:paged" if c["page_size"] is not None else "kv:contiguous")
        if c["page_size"] is not None:
            f.add(f"kv_page_size:{c['page_size']}")
            f.add(f"kv_table:{c['table_fill']}")
        new = c["seqlen_new"]
        f.add(
            "kv:no_append"
            if new is None
            else "kv:append_0_rows"
            if new == 0
            else "kv:append_1"
            if new == 1
            else "kv:append_several"
        )
        f.add(f"kv:seqlen_q_{'0' if c['seqlen_q'] == 0 else '1' if c['seqlen_q'] == 1 else 'many'}")
        seqlens = c["cache_seqlens"]
        if seqlens is None:
            f.add("kv:cache_seqlens_none")
        else:
            if 0 in seqlens:
                f.add("kv:cache_seqlens_0")
            if any(e == c["capacity"] - (new or 0) for e in seqlens):
                f.add("kv:cache_full_after_append")
        if c["cache_batch_idx"] is not None:
            f.add("kv:cache_batch_idx")
        if c["cache_leftpad"] is not None:
            f.add("kv:cache_leftpad")
        if c["page_size"] is not None and c["cache_batch_idx"] is not None:
            f.add("kv:paged+cache_batch_idx")
        if c["page_size"] is not None and c["cache_leftpad"] is not None:
            f.add("kv:paged+cache_leftpad")
        if c.get("rotary_seqlens") is not None:
            f.add("kv:rotary_seqlens")
        if c["rotary"]:
            f.add(f"kv:rotary_{c['rotary']}")
            if c["rotary_dim"] < c["head_dim"]:
                f.add("kv:rotary_partial")
            if c["rotary_dim"] % 16:
                f.add("kv:rotary_dim_not_16")
        if c["packed_cache"]:
            f.add("kv:packed_cache_view")
        if c["q_layout"] != "contiguous":
            f.add("kv:strided_q")
        ns = c["num_splits"]
        f.add(f"kv:num_splits_{'0' if ns == 0 else '1' if ns == 1 else 'several'}")
    if c["kind"] != "kvcache" and c["layout"] != "contiguous":
        f.add("strided_views")
    return f


def coverage(cases):
    counts = collections.Counter()
    for c in cases:
        counts.update(features(c))
    return counts


# Every tag here must be drawn at least MIN_COVERAGE times in 2,000 cases.
MIN_COVERAGE = 20
REQUIRED_FEATURES = (
    ["kind:fixed", "kind:varlen", "kind:kvcache", "dtype:fp16", "dtype:bf16"]
    + [f"head_dim:{d}" for d in HEAD_DIMS]
    + [f"head_dim_v<head_dim:{k}" for k in ("fixed", "varlen", "kvcache", "bwd")]
    + [f"gqa_ratio:{r}" for r in (1, 2, 4, 8)]
    + ["mqa"]
    + [
        "causal",
        "causal+local_left",
        "local",
        "local:both",
        "local:left",
        "local:right",
        "local:zero_side",
        "window:negative_below_-1",
        "softcap",
        "alibi:head",
        "alibi:batch_head",
        "spread_scores",
        "scale:default",
        "scale:positive",
        "scale:negative",
        "dropout:0.1",
        "dropout:0.17",
        "rng_via:ints",
        "rng_via:tensor_cpu",
        "rng_via:tensor_device",
        "return_softmax",
        "bwd:fixed",
        "bwd:varlen",
        "deterministic",
        "bwd+dropout",
        "fwd_kernel:auto",
        "fwd_kernel:sm80",
        "fwd_kernel:sm90",
        "bwd_kernel:sm80",
        "bwd_kernel:sm90",
        "strided_views",
    ]
    + [
        f"layout:{x}"
        for x in ("contiguous", "qkvpacked", "kvpacked", "bhsd", "head_slice", "dim_pad")
    ]
    + [
        "sq==sk",
        "sq>sk",
        "sq<sk",
        "fixed:empty",
        "fixed:seqlen_1",
        "fixed:odd_seqlen",
        "fixed:batch>1",
    ]
    + [f"varlen_layout:{x}" for x in ("contiguous", "qkvpacked", "kvpacked", "head_slice")]
    + [
        "varlen:empty_seq",
        "varlen:empty_q",
        "varlen:empty_k",
        "varlen:seqlen_1",
        "varlen:odd_seqlen",
        "varlen:sq>sk",
        "varlen:sq<sk",
        "varlen:rows_outside_poisoned",
        "varlen:max_seqlen_above_longest",
        "varlen:paged",
        "varlen:seqused_q",
        "bwd:seqused_q",
    ]
    + ["kv:paged", "kv:contiguous"]
    + [f"kv_page_size:{p}" for p in KV_PAGE_SIZES]
    + [
        "kv_table:pages",
        "kv_table:minus_one",
        "kv:no_append",
        "kv:append_0_rows",
        "kv:append_1",
        "kv:append_several",
        "kv:seqlen_q_0",
        "kv:seqlen_q_1",
        "kv:seqlen_q_many",
        "kv:cache_seqlens_none",
        "kv:cache_seqlens_0",
        "kv:cache_full_after_append",
        "kv:cache_batch_idx",
        "kv:cache_leftpad",
        "kv:paged+cache_batch_idx",
        "kv:paged+cache_leftpad",
        "kv:rotary_seqlens",
        "kv:rotary_interleaved",
        "kv:rotary_neox",
        "kv:rotary_partial",
        "kv:rotary_dim_not_16",
        "kv:packed_cache_view",
        "kv:strided_q",
        "kv:num_splits_0",
        "kv:num_splits_1",
        "kv:num_splits_several",
    ]
)
# Rarer by design (a few percent of one kind): fewer draws suffice.
MIN_COVERAGE_RARE = 8
RARE_FEATURES = (
    "fixed:empty",
    "kv:seqlen_q_0",
    "kv:cache_seqlens_none",
    "kv:append_0_rows",
    "window:negative_below_-1",
)


def work_units(c):
    """b * nheads * seqlen_q * seqlen_k * head_dim, times 3.5 with a backward:
    what the CPU reference op's time is proportional to."""
    if c["kind"] == "fixed":
        w = c["batch"] * c["seqlen_q"] * c["seqlen_k"]
    elif c["kind"] == "varlen":
        w = sum(q * k for q, k in zip(c["seqlens_q"], c["seqlens_k"]))
    else:
        w = c["batch"] * c["seqlen_q"] * c["capacity"]
    w *= c["nheads"] * c["head_dim"]
    return w * (3.5 if c["bwd"] else 1.0)


# ---------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------


def dtype_of(c):
    return DTYPES[c["dtype"]]


def _randn(g, shape, dtype, scale=1.0):
    t = torch.randn(shape, generator=g, dtype=torch.float32)
    return (t * scale).to(dtype) if scale != 1.0 else t.to(dtype)


def _alibi(c, g, batch):
    if not c["alibi"]:
        return None
    shape = (c["nheads"],) if c["alibi"] == "head" else (batch, c["nheads"])
    return torch.rand(shape, generator=g, dtype=torch.float32) * c["alibi_max"]


def _qkv_bases(c, g, lead_q, lead_k):
    """Base tensors of q / k / v for the case's layout; lead_q / lead_k are the
    leading dims ((batch, seqlen) or (total,)). views() cuts q, k, v out of them."""
    dt, d, h, hk, spread = dtype_of(c), c["head_dim"], c["nheads"], c["nheads_k"], c["spread"]
    layout = c["layout"]
    if layout == "qkvpacked":
        qkv = _randn(g, lead_q + (3, h, d), dt)
        qkv[..., 0, :, :] *= spread
        return {"qkv": qkv}
    if layout == "kvpacked":
        return {
            "q": _randn(g, lead_q + (h, d), dt, spread),
            "kv": _randn(g, lead_k + (2, hk, d), dt),
        }
    if layout == "bhsd":  # (b, h, s, d) memory, viewed as (b, s, h, d)
        return {
            "q": _randn(g, (lead_q[0], h, lead_q[1], d), dt, spread),
            "k": _randn(g, (lead_k[0], hk, lead_k[1], d), dt),
            "v": _randn(g, (lead_k[0], hk, lead_k[1], d), dt),
        }
    if layout == "head_slice":  # every other head of a tensor with twice the heads
        return {
            "q": _randn(g, lead_q + (2 * h, d), dt, spread),
            "k": _randn(g, lead_k + (2 * hk, d), dt),
            "v": _randn(g, lead_k + (2 * hk, d), dt),
        }
    if layout == "dim_pad":  # rows of d + 8 elements, the first d used
        return {
            "q": _randn(g, lead_q + (h, d + 8), dt, spread),
            "k": _randn(g, lead_k + (hk, d + 8), dt),
            "v": _randn(g, lead_k + (hk, d + 8), dt),
        }
    return {
        "q": _randn(g, lead_q + (h, d), dt, spread),
        "k": _randn(g, lead_k + (hk, d), dt),
        "v": _randn(g, lead_k + (hk, d), dt),
    }


def views(c, bases):
    """q, k, v as the op receives them, cut from the base tensors (any device):
    v is the first d_v columns of the v the layout gives."""
    q, k, v = _full_views(c, bases)
    return q, k, v[..., : head_dim_v(c)]


def _full_views(c, bases):
    layout, d = c["layout"], c["head_dim"]
    if layout == "qkvpacked":
        qkv = bases["qkv"]
        return qkv.select(-3, 0), qkv.select(-3, 1), qkv.select(-3, 2)
    if layout == "kvpacked":
        return bases["q"], bases["kv"].select(-3, 0), bases["kv"].select(-3, 1)
    if layout == "bhsd":
        return tuple(bases[n].transpose(1, 2) for n in "qkv")
    if layout == "head_slice":
        return bases["q"][..., 1::2, :], bases["k"][..., ::2, :], bases["v"][..., 1::2, :]
    if layout == "dim_pad":
        return tuple(bases[n][..., :d] for n in "qkv")
    return bases["q"], bases["k"], bases["v"]


def build_inputs(c):
    """CPU tensors of the case (deterministic in the seed)."""
    g = torch.Generator().manual_seed(c["seed"])
    inputs = {"fixed": _fixed_inputs, "varlen": _varlen_inputs, "kvcache": _kvcache_inputs}[
        c["kind"]
    ](c, g)
    if c["kind"] != "kvcache":
        # v's columns past d_v (views() cuts them off) are never read.
        _full_views(c, inputs["bases"])[2][..., head_dim_v(c) :] = float("nan")
    return inputs


def _fixed_inputs(c, g):
    b, sq, sk = c["batch"], c["seqlen_q"], c["seqlen_k"]
    inputs = {"bases": _qkv_bases(c, g, (b, sq), (b, sk))}
    inputs["alibi"] = _alibi(c, g, b)
    inputs["dout"] = _randn(g, (b, sq, c["nheads"], head_dim_v(c)), dtype_of(c))
    return inputs


def _cu(lengths, offset):
    cu = [offset]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32)


def _varlen_inputs(c, g):
    cu_q, cu_k = _cu(c["seqlens_q"], c["q_offset"]), _cu(c["seqlens_k"], c["k_offset"])
    total_q, total_k = int(cu_q[-1]) + c["q_tail"], int(cu_k[-1]) + c["k_tail"]
    bases = _qkv_bases(c, g, (total_q,), (total_k,))
    inputs = {"bases": bases, "cu_q": cu_q, "cu_k": cu_k}
    inputs["alibi"] = _alibi(c, g, c["batch"])
    inputs["dout"] = _randn(g, (total_q, c["nheads"], head_dim_v(c)), dtype_of(c))
    if c["poison"]:
        # Key / value rows outside every sequence are NaN: no result may read
        # them (docs/serving.md: keys past the used length).
        outside_k = torch.ones(total_k, dtype=torch.bool)
        outside_k[int(cu_k[0]) : int(cu_k[-1])] = False
        _, k, v = views(c, bases)
        k[outside_k] = float("nan")
        v[outside_k] = float("nan")
    if c.get("seqused_q") is not None:
        # The query rows (and their dout) past seqused_q[b] are no query rows
        # (docs/serving.md): NaN there must reach no result.
        inputs["seqused_q"] = torch.tensor(c["seqused_q"], dtype=torch.int32)
        q, _, _ = views(c, bases)
        unused = _unused_q_rows(c, cu_q)
        q[unused] = float("nan")
        inputs["dout"][unused] = float("nan")
    if c["page_size"] is not None:
        inputs.update(_scatter_pages(c, g, inputs))
    return inputs


def _unused_q_rows(c, cu_q):
    """The rows of the packed queries past seqused_q[b] of their sequence."""
    rows = [
        torch.arange(int(cu_q[bi]) + u, int(cu_q[bi + 1])) for bi, u in enumerate(c["seqused_q"])
    ]
    return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)


def _scatter_pages(c, g, inputs):
    """Paged copies of the packed varlen keys / values: pages in random order,
    unused rows NaN, table columns past a sequence's pages -1 or unused pages."""
    _, k, v = views(c, inputs["bases"])
    ps, hk, d = c["page_size"], c["nheads_k"], c["head_dim"]
    cu_k = inputs["cu_k"]
    lengths = c["seqlens_k"]
    pages = [-(-n // ps) for n in lengths]
    width = max(max(pages) + 1, 1)
    spare = 2
    num_blocks = sum(pages) + spare
    order = torch.randperm(num_blocks, generator=g).tolist()
    k_pages = torch.full((num_blocks, ps, hk, d), float("nan"), dtype=k.dtype)
    v_pages = torch.full((num_blocks, ps, hk, head_dim_v(c)), float("nan"), dtype=k.dtype)
    table = torch.full((c["batch"], width), -1, dtype=torch.int32)
    for bi, n in enumerate(lengths):
        for i in range(pages[bi]):
            block = order.pop()
            table[bi, i] = block
            start, count = int(cu_k[bi]) + i * ps, min(ps, n - i * ps)
            k_pages[block, :count] = k[start : start + count]
            v_pages[block, :count] = v[start : start + count]
    if c["table_fill"] == "pages":
        for bi in range(c["batch"]):
            for i in range(pages[bi], width):
                table[bi, i] = order[(bi + i) % len(order)]  # a spare (NaN) page
    return {"k_pages": k_pages, "v_pages": v_pages, "block_table": table}


def _kvcache_inputs(c, g):
    dt, d, h, hk, b = dtype_of(c), c["head_dim"], c["nheads"], c["nheads_k"], c["batch"]
    sq, new, cap = c["seqlen_q"], c["seqlen_new"], c["capacity"]
    inputs = {}
    if c["q_layout"] == "head_slice":
        inputs["q_base"] = _randn(g, (b, sq, 2 * h, d), dt, c["spread"])
    else:
        inputs["q_base"] = _randn(g, (b, sq, h, d), dt, c["spread"])
    paged = c["page_size"] is not None
    if paged:
        ps = c["page_size"]
        num_blocks = b * c["pages_per_seq"] + c["spare_pages"]
        inputs["cache_base"] = _randn(g, (2, num_blocks, ps, hk, d), dt)
    elif c["packed_cache"]:
        inputs["cache_base"] = _randn(g, (c["batch_cache"], cap, 2, hk, d), dt)
    else:
        inputs["cache_base"] = _randn(g, (2, c["batch_cache"], cap, hk, d), dt)
    if new is not None:
        inputs["k_new"] = _randn(g, (b, new, hk, d), dt)
        # The first d_v columns of a wider tensor (drawn whole: the same
        # generator stream for any d_v).
        inputs["v_new"] = _randn(g, (b, new, hk, d), dt)[..., : head_dim_v(c)]
    if c["rotary"]:
        angle = torch.rand(
            (c["seqlen_rotary"], c["rotary_dim"] // 2), generator=g, dtype=torch.float64
        ) * (2 * math.pi)
        inputs["cos"], inputs["sin"] = torch.cos(angle).to(dt), torch.sin(angle).to(dt)
    if c["cache_seqlens"] is not None:
        inputs["cache_seqlens"] = torch.tensor(c["cache_seqlens"], dtype=torch.int32)
    if c["cache_batch_idx"] is not None:
        inputs["cache_batch_idx"] = torch.tensor(c["cache_batch_idx"], dtype=torch.int32)
    if c["cache_leftpad"] is not None:
        inputs["cache_leftpad"] = torch.tensor(c["cache_leftpad"], dtype=torch.int32)
    if c.get("rotary_seqlens") is not None:
        inputs["rotary_seqlens"] = torch.tensor(c["rotary_seqlens"], dtype=torch.int32)
    if paged:
        pps = c["pages_per_seq"]
        order = torch.randperm(num_blocks, generator=g)
        table = order[: b * pps].view(b, pps).to(torch.int32).clone()
        if c["table_fill"] == "minus_one":
            for bi in range(b):
                table[bi, _used_pages(c, bi) :] = -1  # row bi of the picked rows
        # Entries the call may not read hold no valid page (int32 has no NaN): a
        # read shows as an index error. Those are the rows cache_batch_idx does
        # not pick and the pages wholly before the left padding.
        bad_page = num_blocks + 1000
        if c["cache_batch_idx"] is not None:
            picked = table
            table = torch.full((c["batch_cache"], pps), bad_page, dtype=torch.int32)
            table[torch.tensor(c["cache_batch_idx"], dtype=torch.long)] = picked
        if c["cache_leftpad"] is not None:
            for bi, pad in enumerate(c["cache_leftpad"]):
                table[_table_row(c, bi), : pad // c["page_size"]] = bad_page
        inputs["block_table"] = table
    inputs["alibi"] = _alibi(c, g, b)
    _poison_cache(c, inputs)
    return inputs


def _end(c, bi):
    return c["capacity"] if c["cache_seqlens"] is None else c["cache_seqlens"][bi]


def _used_pages(c, bi):
    return -(-(_end(c, bi) + (c["seqlen_new"] or 0)) // c["page_size"])


def cache_views(c, base):
    """(k_cache, v_cache) views of the cache base tensor (any device); v_cache
    is the first d_v columns of its half of the base."""
    k_cache, v_full = _full_cache_views(c, base)
    return k_cache, v_full[..., : head_dim_v(c)]


def _full_cache_views(c, base):
    if c["packed_cache"]:
        return base.select(2, 0), base.select(2, 1)
    return base[0], base[1]


def _poison_cache(c, inputs):
    """NaN in every cache row the call must not read before its append: past
    the used length, before the left padding (in pages too), cache rows no
    batch entry uses, unused pages, the unused rows of the last page, and the
    rows the append is about to write (a read of those before the append shows
    as NaN)."""
    k_cache, v_cache = cache_views(c, inputs["cache_base"])
    read = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    for bi in range(c["batch"]):
        pad = 0 if c["cache_leftpad"] is None else c["cache_leftpad"][bi]
        for pos in range(pad, _end(c, bi)):
            read[_cache_slot(c, inputs, bi, pos)] = True
    k_cache[~read] = float("nan")
    v_cache[~read] = float("nan")
    _full_cache_views(c, inputs["cache_base"])[1][..., head_dim_v(c) :] = float("nan")


def written_mask(c, inputs):
    """Bool over (cache rows or pages, positions) of k_cache: the rows the
    append writes."""
    k_cache, _ = cache_views(c, inputs["cache_base"])
    mask = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    for bi in range(c["batch"]):
        for pos in range(_end(c, bi), _end(c, bi) + (c["seqlen_new"] or 0)):
            mask[_cache_slot(c, inputs, bi, pos)] = True
    return mask


def _table_row(c, bi):
    """Batch entry bi's cache row, or its row of the block table."""
    return bi if c["cache_batch_idx"] is None else c["cache_batch_idx"][bi]


def _cache_slot(c, inputs, bi, pos):
    row = _table_row(c, bi)
    if c["page_size"] is not None:
        return int(inputs["block_table"][row, pos // c["page_size"]]), pos % c["page_size"]
    return row, pos


# ---------------------------------------------------------------------------
# Running the ops
# ---------------------------------------------------------------------------


class LeftOut(Exception):
    """The CUDA build refused a kernel it left out (reduced build)."""


@contextlib.contextmanager
def kernel_env(c):
    """FLASH_ATTN_FWD_KERNEL / _BWD_KERNEL for the case (read per call; sm90
    GPUs only, ignored elsewhere; a forced sm90 falls back where it cannot run)."""
    saved = {n: os.environ.get(n) for n in ("FLASH_ATTN_FWD_KERNEL", "FLASH_ATTN_BWD_KERNEL")}
    try:
        for name, choice in (
            ("FLASH_ATTN_FWD_KERNEL", c["fwd_kernel"]),
            ("FLASH_ATTN_BWD_KERNEL", c["bwd_kernel"]),
        ):
            if choice == "auto":
                os.environ.pop(name, None)
            else:
                os.environ[name] = choice
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _on(t, device):
    return None if t is None else t.to(device)


def _poison_allocator(device):
    # Leaves NaN in memory the caching allocator hands out next, so that an
    # output element a kernel forgets to write shows.
    if torch.device(device).type == "cuda":
        torch.full((1 << 24,), float("nan"), device=device)  # freed at once, NaN left behind


def _rng_args(c, device):
    """(philox_seed, philox_offset, rng_state) for the forward op."""
    seed, offset = c["philox_seed"], c["philox_offset"]
    if c["dropout_p"] == 0 or c["rng_via"] == "ints":
        return seed, offset, None
    where = "cpu" if c["rng_via"] == "tensor_cpu" else device
    # The op ignores the ints when a tensor is given: pass others to prove it.
    return 0, 0, torch.tensor([seed, offset], dtype=torch.int64, device=where)


def _host(t):
    return None if t is None else t.detach().cpu()


def run_ops(c, inputs, device, repeat=False):
    """The case's op calls on `device`; every result moved to the CPU. With
    repeat, the forward (and backward) run twice and the second results are
    returned too, under the key "repeat"."""
    run = {"fixed": _run_fixed, "varlen": _run_varlen, "kvcache": _run_kvcache}[c["kind"]]
    result = run(c, inputs, device)
    if repeat:
        result["repeat"] = run(c, inputs, device)
    if torch.device(device).type == "cuda":
        # A bad index value the kernels recorded (none may be, the inputs are
        # valid) is raised here, inside its own case, not by the next call.
        import flash_attn_cuda

        check = getattr(flash_attn_cuda, "check_index_errors", None)
        if check is not None:
            check(device)
        torch.cuda.synchronize(device)
    return result


def _run_fixed(c, inputs, device):
    bases = {n: t.to(device) for n, t in inputs["bases"].items()}
    q, k, v = views(c, bases)
    alibi = _on(inputs["alibi"], device)
    seed, offset, rng_state = _rng_args(c, device)
    args = (
        alibi,
        c["dropout_p"],
        c["softmax_scale"],
        c["causal"],
        c["window_left"],
        c["window_right"],
        c["softcap"],
    )
    _poison_allocator(device)
    out, lse, s_dmask, rng_used = ops.fwd(
        q, k, v, *args, c["return_softmax"], seed, offset, rng_state
    )
    result = {"out": _host(out), "lse": _host(lse), "rng_state": _host(rng_used)}
    if c["return_softmax"]:
        result["s_dmask"] = _host(s_dmask)
    if c["bwd"]:
        _poison_allocator(device)
        dq, dk, dv = ops.bwd(
            inputs["dout"].to(device), q, k, v, out, lse, *args, c["deterministic"], rng_used
        )
        result.update(dq=_host(dq), dk=_host(dk), dv=_host(dv))
    return result


def _run_varlen(c, inputs, device):
    bases = {n: t.to(device) for n, t in inputs["bases"].items()}
    q, k, v = views(c, bases)
    table = None
    if c["page_size"] is not None:
        k, v = inputs["k_pages"].to(device), inputs["v_pages"].to(device)
        table = inputs["block_table"].to(device)
    cu_q, cu_k = inputs["cu_q"].to(device), inputs["cu_k"].to(device)
    seqused_q = _on(inputs.get("seqused_q"), device)
    alibi = _on(inputs["alibi"], device)
    seed, offset, rng_state = _rng_args(c, device)
    score_args = (
        c["dropout_p"],
        c["softmax_scale"],
        c["causal"],
        c["window_left"],
        c["window_right"],
        c["softcap"],
    )
    _poison_allocator(device)
    out, lse, s_dmask, rng_used = ops.varlen_fwd(
        q,
        k,
        v,
        cu_q,
        cu_k,
        table,
        alibi,
        c["max_seqlen_q"],
        c["max_seqlen_k"],
        *score_args,
        c["return_softmax"],
        seed,
        offset,
        rng_state,
        seqused_q=seqused_q,
    )
    result = {"out": _host(out), "lse": _host(lse), "rng_state": _host(rng_used)}
    if c["return_softmax"]:
        result["s_dmask"] = _host(s_dmask)
    if c["bwd"]:
        out_read = out
        if seqused_q is not None:
            # The backward may not read out past seqused_q either.
            out_read = out.clone()
            out_read[_unused_q_rows(c, inputs["cu_q"]).to(device)] = float("nan")
        _poison_allocator(device)
        dq, dk, dv = ops.varlen_bwd(
            inputs["dout"].to(device),
            q,
            k,
            v,
            out_read,
            lse,
            cu_q,
            cu_k,
            alibi,
            c["max_seqlen_q"],
            c["max_seqlen_k"],
            *score_args,
            c["deterministic"],
            rng_used,
            seqused_q=seqused_q,
        )
        result.update(dq=_host(dq), dk=_host(dk), dv=_host(dv))
    return result


def _kv_q(c, q_base):
    return q_base[:, :, 1::2] if c["q_layout"] == "head_slice" else q_base


def _run_kvcache(c, inputs, device):
    # The op appends in place: every run works on its own copy of the cache.
    cache_base = inputs["cache_base"].to(device, copy=True)
    k_cache, v_cache = cache_views(c, cache_base)
    q = _kv_q(c, inputs["q_base"].to(device))
    get = lambda name: _on(inputs.get(name), device)
    _poison_allocator(device)
    out, lse = ops.fwd_kvcache(
        q,
        k_cache,
        v_cache,
        get("k_new"),
        get("v_new"),
        get("cache_seqlens"),
        get("cos"),
        get("sin"),
        get("cache_batch_idx"),
        get("cache_leftpad"),
        get("block_table"),
        get("alibi"),
        c["softmax_scale"],
        c["causal"],
        c["window_left"],
        c["window_right"],
        c["softcap"],
        c["rotary"] == "interleaved",
        c["num_splits"],
        rotary_seqlens=get("rotary_seqlens"),
    )
    return {"out": _host(out), "lse": _host(lse), "cache_base": _host(cache_base)}


# ---------------------------------------------------------------------------
# References (plain torch, reference.py)
# ---------------------------------------------------------------------------


def keep_mask(seed, offset, batch_index, nheads, seqlen_q, seqlen_k, dropout_p, device):
    """reference.dropout_keep_mask computed on `device`: bool (nheads,
    seqlen_q, seqlen_k), True where dropout keeps the probability."""
    mask32 = 0xFFFFFFFF
    seed &= (1 << 64) - 1
    groups = (seqlen_k + 3) // 4
    heads = torch.arange(nheads, dtype=torch.int64, device=device).view(-1, 1, 1)
    rows = torch.arange(seqlen_q, dtype=torch.int64, device=device).view(1, -1, 1)
    cols = torch.arange(groups, dtype=torch.int64, device=device).view(1, 1, -1)
    shape = (nheads, seqlen_q, groups)
    words = philox4x32_10(
        cols.expand(shape),
        rows.expand(shape),
        ((batch_index * nheads + heads) & mask32).expand(shape),
        torch.full(shape, offset & mask32, dtype=torch.int64, device=device),
        seed & mask32,
        (seed >> 32) & mask32,
    )
    bits = torch.stack(words, dim=-1).reshape(nheads, seqlen_q, groups * 4)[..., :seqlen_k]
    return bits >= dropout_threshold(dropout_p)


COMPUTE = ("exact", "fp32", "same")


def _compute_dtype(c, which):
    return {"exact": torch.float64, "fp32": torch.float32, "same": dtype_of(c)}[which]


def _grads(fn, leaves_src, dout, compute_dtype, rounded_out_dtype=None):
    """dq, dk, dv of fn by autograd; with rounded_out_dtype also the part of
    the gradients that FlashAttention-2's backward adds by computing
    D_i = rowsum(dO_i * O_i) from the output rounded to that dtype: D enters
    dS_ij = P_ij * (dP_ij - D_i) like the gradient of -sum_i D_i * lse_i
    (d lse_i / d s_ij = P_ij), so the change of D by the rounding, pushed
    through lse, is exactly that part (zero for dv)."""
    leaves = [t.detach().to(compute_dtype).requires_grad_() for t in leaves_src]
    out, lse = fn(*leaves, compute_dtype)
    zeros = [torch.zeros_like(t) for t in leaves]
    if out.numel() == 0 or not out.requires_grad:
        return zeros, zeros
    dout = dout.to(compute_dtype)
    want_rounding = rounded_out_dtype is not None and lse.requires_grad
    grads = torch.autograd.grad(out, leaves, dout, allow_unused=True, retain_graph=want_rounding)
    grads = [z if gr is None else gr for gr, z in zip(grads, zeros)]
    if not want_rounding:
        return grads, zeros
    exact = out.detach()
    change_of_d = ((exact.to(rounded_out_dtype).to(compute_dtype) - exact) * dout).sum(-1)
    weight = (-change_of_d.transpose(-1, -2)).masked_fill(~torch.isfinite(lse.detach()), 0.0)
    parts = torch.autograd.grad(lse, leaves, weight, allow_unused=True)
    return grads, [z if part is None else part for part, z in zip(parts, zeros)]


def _grad_refs(c, fn, leaves, dout):
    refs = {}
    grads, rounding = _grads(fn, leaves, dout, torch.float64, rounded_out_dtype=dtype_of(c))
    same, _ = _grads(fn, leaves, dout, dtype_of(c))
    for i, name in enumerate(("dq", "dk", "dv")):
        refs[f"{name}_exact"] = _host(grads[i])
        refs[f"{name}_same"] = _host(same[i])
        refs[f"{name}_rounded_d"] = _host(rounding[i])
    return refs


def references(c, inputs, device):
    """Plain-torch results on `device` in float64 ("exact"), float32 and the
    input dtype ("same"); moved to the CPU. Keys: out_<which>, lse_<which>,
    and with a backward dq/dk/dv_<exact|same>; for kvcache also the expected
    cache base tensor after the append."""
    return {"fixed": _fixed_refs, "varlen": _varlen_refs, "kvcache": _kvcache_refs}[c["kind"]](
        c, inputs, device
    )


def _score_kwargs(c, alibi):
    return dict(
        softmax_scale=c["softmax_scale"],
        softcap=c["softcap"],
        alibi_slopes=alibi,
        dropout_p=c["dropout_p"],
    )


def _fixed_refs(c, inputs, device):
    bases = {n: t.to(device) for n, t in inputs["bases"].items()}
    q, k, v = views(c, bases)
    alibi = _on(inputs["alibi"], device)
    keep = None
    if c["dropout_p"] > 0:
        keep = (
            torch.stack(
                [
                    keep_mask(
                        c["philox_seed"],
                        c["philox_offset"],
                        bi,
                        c["nheads"],
                        c["seqlen_q"],
                        c["seqlen_k"],
                        c["dropout_p"],
                        device,
                    )
                    for bi in range(c["batch"])
                ]
            )
            if c["batch"]
            else None
        )

    def fn(qq, kk, vv, compute_dtype):
        return attention_ref(
            qq,
            kk,
            vv,
            causal=c["causal"],
            window_size=(c["window_left"], c["window_right"]),
            keep_mask=keep,
            compute_dtype=compute_dtype,
            **_score_kwargs(c, alibi),
        )

    return _attention_refs(c, fn, (q, k, v), inputs, device)


def _attention_refs(c, fn, qkv, inputs, device):
    """out / lse at every compute precision, and the gradient references when
    the case runs the backward, from one reference function `fn`."""
    refs = {}
    for which in COMPUTE:
        out, lse = fn(*qkv, _compute_dtype(c, which))
        refs[f"out_{which}"], refs[f"lse_{which}"] = _host(out), _host(lse)
    if c["bwd"]:
        refs.update(_grad_refs(c, fn, qkv, inputs["dout"].to(device)))
    return refs


def _varlen_refs(c, inputs, device):
    bases = {n: t.to(device) for n, t in inputs["bases"].items()}
    q, k, v = views(c, bases)
    alibi = _on(inputs["alibi"], device)
    cu_q, cu_k = inputs["cu_q"], inputs["cu_k"]
    used_q = _used_lengths_q(c)
    keep = None
    if c["dropout_p"] > 0:
        keep = [
            keep_mask(
                c["philox_seed"],
                c["philox_offset"],
                bi,
                c["nheads"],
                sq,
                sk,
                c["dropout_p"],
                device,
            )
            for bi, (sq, sk) in enumerate(zip(used_q, c["seqlens_k"]))
        ]

    def fn(qq, kk, vv, compute_dtype):
        return varlen_attention_ref(
            qq,
            kk,
            vv,
            cu_q,
            cu_k,
            max_seqlen_k=c["max_seqlen_k"],
            causal=c["causal"],
            window_size=(c["window_left"], c["window_right"]),
            keep_masks=keep,
            compute_dtype=compute_dtype,
            seqused_q=c.get("seqused_q"),
            **_score_kwargs(c, alibi),
        )

    return _attention_refs(c, fn, (q, k, v), inputs, device)


def _used_lengths_q(c):
    """The query rows each varlen sequence uses (seqused_q, else all)."""
    used = c.get("seqused_q")
    return c["seqlens_q"] if used is None else used


def _kvcache_refs(c, inputs, device):
    dt = dtype_of(c)
    cache_base = inputs["cache_base"].to(device, copy=True)
    k_cache, v_cache = cache_views(c, cache_base)
    q = _kv_q(c, inputs["q_base"].to(device))
    new = c["seqlen_new"] or 0
    cap = c["capacity"]
    left, right = normalize_window(c["causal"], c["window_left"], c["window_right"], cap)
    per_row = left >= 0 or right >= 0  # rotary q rows get their own positions
    alibi = _on(inputs["alibi"], device)
    cos = sin = None
    if c["rotary"]:
        cos, sin = inputs["cos"].to(device).float(), inputs["sin"].to(device).float()
    interleaved = c["rotary"] == "interleaved"
    # The append: new keys rotated in fp32 at their positions, rounded once.
    for bi in range(c["batch"]):
        end = _end(c, bi)
        if not new:
            continue
        k_new = inputs["k_new"][bi : bi + 1].to(device)
        if cos is not None:
            positions = (_rotary_start(c, bi) + torch.arange(new, device=device)).unsqueeze(0)
            k_new = apply_rotary(k_new, cos, sin, positions, interleaved).to(dt)
        for i in range(new):
            slot = _cache_slot(c, inputs, bi, end + i)
            k_cache[slot] = k_new[0, i]
            v_cache[slot] = inputs["v_new"][bi, i].to(device)
    refs = {"cache_base": _host(cache_base)}
    outs = {w: [] for w in COMPUTE}
    lses = {w: [] for w in COMPUTE}
    sq = c["seqlen_q"]
    for bi in range(c["batch"]):
        end = _end(c, bi)
        pad = 0 if c["cache_leftpad"] is None else c["cache_leftpad"][bi]
        slots = [_cache_slot(c, inputs, bi, pos) for pos in range(pad, end + new)]
        rows = torch.tensor([s[0] for s in slots], dtype=torch.long, device=device)
        cols = torch.tensor([s[1] for s in slots], dtype=torch.long, device=device)
        keys, values = k_cache[rows, cols].unsqueeze(0), v_cache[rows, cols].unsqueeze(0)
        q_b = q[bi : bi + 1]
        if cos is not None and sq:
            offsets = (
                torch.arange(sq, device=device)
                if per_row
                else torch.zeros(sq, dtype=torch.long, device=device)
            )
            start = _rotary_start(c, bi)
            q_b = apply_rotary(q_b, cos, sin, (start + offsets).unsqueeze(0), interleaved).to(dt)
        slopes = None
        if alibi is not None:
            slopes = alibi if alibi.dim() == 1 else alibi[bi]
        for which in COMPUTE:
            out, lse = attention_ref(
                q_b,
                keys,
                values,
                causal=False,
                window_size=(left, right),
                normalize=False,
                compute_dtype=_compute_dtype(c, which),
                softmax_scale=c["softmax_scale"],
                softcap=c["softcap"],
                alibi_slopes=slopes,
            )
            outs[which].append(out)
            lses[which].append(lse)
    for which in COMPUTE:
        refs[f"out_{which}"] = _host(torch.cat(outs[which]))
        refs[f"lse_{which}"] = _host(torch.cat(lses[which]))
    return refs


def _rotary_start(c, bi):
    """The rotary position of batch entry bi's first new key (and of q):
    rotary_seqlens[bi] when given, else its cache position."""
    rs = c.get("rotary_seqlens")
    return _end(c, bi) if rs is None else rs[bi]


def reference_as_result(c, refs):
    """The float64 reference shaped like a run_ops result (for checking the
    CPU op itself against it)."""
    result = {"out": refs["out_exact"], "lse": refs["lse_exact"]}
    for name in ("dq", "dk", "dv"):
        if f"{name}_exact" in refs:
            result[name] = refs[f"{name}_exact"]
    if "cache_base" in refs:
        result["cache_base"] = refs["cache_base"]
    return result


# ---------------------------------------------------------------------------
# Comparison
# ---------------------------------------------------------------------------


def softcap_score_error(c):
    """How far the CUDA kernels' softcapped scores may be from exact ones in
    fp32: nvcc's --use_fast_math (setup.py) compiles tanhf to tanh.approx.f32,
    whose error is about 2^-11, so a score softcap * tanh(x) may move by
    softcap * 2^-11 (the CPU path's tanh is exact to fp32). An lse moves by at
    most as much as the scores; the bound is doubled. Zero without softcap."""
    return c["softcap"] * 2.0**-10 if c["softcap"] > 0 else 0.0


def ulp(x, dtype):
    """One unit in the last place of |x| in dtype (0 for x = 0)."""
    if not math.isfinite(x) or x <= 0:
        return 0.0
    return 2.0 ** (math.floor(math.log2(x)) - MANTISSA_BITS[dtype])


def _max_abs(t):
    if t.numel() == 0:
        return 0.0
    return t.double().abs().max().item()


def _check_close(name, a, b, exact, same, factor, atol, dtype, extra=0.0):
    """max|a - b| <= factor * max|same - exact| + ulp(max|exact|) + atol + extra."""
    if a.shape != b.shape:
        return f"{name}: shape {tuple(a.shape)} against {tuple(b.shape)}"
    if a.numel() == 0:
        return None
    nans = int(torch.isnan(a).sum()) + int(torch.isnan(b).sum())
    if nans:
        return (
            f"{name}: {int(torch.isnan(a).sum())} / {int(torch.isnan(b).sum())} NaN elements "
            "(poisoned rows read, or an element left unwritten)"
        )
    diff = (a.double() - b.double()).abs()
    err = diff.max().item()
    base = _max_abs(same.double() - exact.double())
    tol = factor * base + ulp(_max_abs(exact), dtype) + atol + extra
    if not err <= tol:
        where = tuple(int(i) for i in torch.nonzero(diff == diff.max())[0])
        return (
            f"{name}: max|diff| {err:.3e} at {where} > tolerance {tol:.3e} "
            f"({factor} x same-dtype error {base:.3e} + ulp + {atol:g}"
            + (f" + rounded-O term {extra:.3e})" if extra else ")")
        )
    return None


def _check_lse(name, a, b, lse32, lse64, extra=0.0):
    if a.shape != b.shape:
        return f"{name}: shape {tuple(a.shape)} against {tuple(b.shape)}"
    if a.numel() == 0:
        return None
    no_key = torch.isinf(lse64)
    for label, t in (("first", a), ("second", b)):
        if torch.isnan(t).any():
            return f"{name}: NaN in the {label} result"
        if not torch.equal(torch.isinf(t), no_key) or (t[no_key] < 0).any():
            bad = torch.nonzero(torch.isinf(t) != no_key)
            return (
                f"{name}: rows that see no key must be +inf and only those ({label} result; "
                f"first differing row {tuple(int(i) for i in bad[0]) if len(bad) else '-'})"
            )
    finite = ~no_key
    if not finite.any():
        return None
    err = (a[finite].double() - b[finite].double()).abs().max().item()
    noise = (lse32[finite].double() - lse64[finite]).abs().max().item()
    tol = 4 * noise + 1e-5 * (1 + lse64[finite].abs().max().item()) + extra
    if not err <= tol:
        return f"{name}: max|diff| {err:.3e} > tolerance {tol:.3e} (4 x fp32 noise {noise:.3e}" + (
            f" + softcap term {extra:.3e})" if extra else ")"
        )
    return None


def _bits(t):
    """The tensor's bit patterns, so that torch.equal compares NaN too."""
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.view(as_int[t.element_size()])


def _inside_rows(cu, lengths):
    rows = [torch.arange(int(cu[i]), int(cu[i]) + n) for i, n in enumerate(lengths)]
    return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)


def compare(c, inputs, got, other, refs):
    """Mismatches between two results of the case (lists of strings)."""
    dt = dtype_of(c)
    problems = []

    def add(p):
        if p:
            problems.append(p)

    if c["kind"] == "varlen":
        q_rows = _inside_rows(inputs["cu_q"], c["seqlens_q"])
        k_rows = _inside_rows(inputs["cu_k"], c["seqlens_k"])
        pick_q = lambda t: t[q_rows]
        pick_k = lambda t: t[k_rows]
        pick_lse = lambda t: t[:, q_rows]
    else:
        pick_q = pick_k = pick_lse = lambda t: t

    if c["kind"] != "kvcache" or c["seqlen_q"] > 0:
        add(
            _check_close(
                "out",
                pick_q(got["out"]),
                pick_q(other["out"]),
                pick_q(refs["out_exact"]),
                pick_q(refs["out_same"]),
                2.0,
                1e-5,
                dt,
            )
        )
        add(
            _check_lse(
                "lse",
                pick_lse(got["lse"]),
                pick_lse(other["lse"]),
                pick_lse(refs["lse_fp32"]),
                pick_lse(refs["lse_exact"]),
                extra=softcap_score_error(c),
            )
        )
    if c["bwd"]:
        for name, pick in (("dq", pick_q), ("dk", pick_k), ("dv", pick_k)):
            add(
                _check_close(
                    name,
                    pick(got[name]),
                    pick(other[name]),
                    pick(refs[f"{name}_exact"]),
                    pick(refs[f"{name}_same"]),
                    3.0,
                    1e-4,
                    dt,
                    extra=2 * _max_abs(pick(refs[f"{name}_rounded_d"])),
                )
            )
    if "s_dmask" in got and "s_dmask" in other:
        add(_check_s_dmask(c, got["s_dmask"], other["s_dmask"], dt, 2 * softcap_score_error(c)))
    if "cache_base" in got:
        problems.extend(_check_caches(c, inputs, got["cache_base"], other["cache_base"]))
    if "rng_state" in got and c["dropout_p"] > 0:
        expected = [c["philox_seed"], c["philox_offset"]]
        if got["rng_state"].tolist() != expected:
            problems.append(f"rng_state: returned {got['rng_state'].tolist()}, expected {expected}")
    rep = got.get("repeat")
    if rep is not None:
        for name in ("out", "lse", "dq", "dk", "dv", "cache_base"):
            if name in got and not torch.equal(_bits(got[name]), _bits(rep[name])):
                problems.append(
                    f"{name}: not bitwise reproducible"
                    + (" (deterministic backward)" if name[0] == "d" else "")
                )
    return problems


def _check_s_dmask(c, a, b, dt, extra=0.0):
    """S_dmask of return_softmax (flash-attn's form: exp(score - running row
    max) per key block, dropped entries negated, masked ones +0; every value in
    [-1, 1]): the same values within rounding, the same dropped pattern where
    the value is clearly non-zero."""
    if a.shape != b.shape:
        return f"s_dmask: shape {tuple(a.shape)} against {tuple(b.shape)}"
    if c["kind"] == "varlen":
        lengths = zip(_used_lengths_q(c), c["seqlens_k"])
        blocks = [(bi, sq, sk) for bi, (sq, sk) in enumerate(lengths)]
        pairs = [(a[bi, :, :sq, :sk], b[bi, :, :sq, :sk]) for bi, sq, sk in blocks]
    else:
        pairs = [(a, b)]
    tol = 2 * ulp(1.0, dt) + 1e-4 + extra
    for x, y in pairs:
        if x.numel() == 0:
            continue
        x, y = x.float(), y.float()
        if torch.isnan(x).any() or torch.isnan(y).any():
            return "s_dmask: NaN"
        err = (x.abs() - y.abs()).abs().max().item()
        if err > tol:
            return f"s_dmask: max||a| - |b|| {err:.3e} > {tol:.3e}"
        clear = (y.abs() > 4 * tol) & (x.abs() > 4 * tol)
        if not torch.equal(x[clear] < 0, y[clear] < 0):
            return "s_dmask: different dropout pattern (sign of the probabilities)"
    return None


def _check_caches(c, inputs, got_base, other_base):
    """The cache after the call: bitwise unchanged outside the appended rows;
    the appended rows bitwise equal to the other result, rotated keys within
    one ulp."""
    problems = []
    original = inputs["cache_base"]
    written = written_mask(c, inputs)
    beyond = (
        t[..., head_dim_v(c) :]
        for t in (_full_cache_views(c, got_base)[1], _full_cache_views(c, original)[1])
    )
    if not torch.equal(*(_bits(t) for t in beyond)):
        problems.append("v_cache: columns past d_v of its buffer changed")
    got_k, got_v = cache_views(c, got_base)
    oth_k, oth_v = cache_views(c, other_base)
    org_k, org_v = cache_views(c, original)
    for name, got, oth, org in (("k_cache", got_k, oth_k, org_k), ("v_cache", got_v, oth_v, org_v)):
        if not torch.equal(_bits(got[~written]), _bits(org[~written])):
            bad = torch.nonzero((_bits(got) != _bits(org)).flatten(2).any(-1) & ~written)
            problems.append(
                f"{name}: rows outside the append changed (first at "
                f"{tuple(int(i) for i in bad[0]) if len(bad) else '?'})"
            )
        a, b = got[written], oth[written].to(got.dtype)
        if a.numel() == 0:
            continue
        if torch.isnan(a).any():
            problems.append(f"{name}: NaN in the appended rows")
        elif name == "k_cache" and c["rotary"]:
            rel = 2.0 ** -MANTISSA_BITS[a.dtype]
            diff = (a.double() - b.double()).abs()
            allowed = rel * torch.maximum(a.double().abs(), b.double().abs()) + 2.0**-24
            if (diff > allowed).any():
                problems.append(
                    f"{name}: rotated appended keys differ by more than one ulp "
                    f"(max {diff.max().item():.3e})"
                )
        elif not torch.equal(_bits(a), _bits(b)):
            problems.append(
                f"{name}: appended rows differ (max "
                f"{(a.double() - b.double()).abs().max().item():.3e})"
            )
    return problems


# ---------------------------------------------------------------------------
# Timing the CPU side: python3 tests/differential_cases.py [sample] [threads]
# ---------------------------------------------------------------------------


def estimate_cpu_seconds(sample=200, threads=None):
    """Times the CPU op (the reference path of the CUDA test) on every
    len/sample-th of the case_count() cases, fits seconds = a * work_units + b
    per case, and returns (fitted total seconds for all cases, measured
    seconds, sample size). The GPU run adds the CUDA ops and the plain-torch
    references on the GPU (milliseconds per case)."""
    import flash_attn_cuda  # noqa: F401  (registers the ops)

    if threads:
        torch.set_num_threads(threads)
    cases = [draw_case(base_seed() + i) for i in range(case_count())]
    step = max(1, len(cases) // sample)
    picked = cases[::step]
    xs, ys = [], []
    for c in picked:
        inputs = build_inputs(c)
        t0 = time.perf_counter()
        run_ops(c, inputs, "cpu")
        ys.append(time.perf_counter() - t0)
        xs.append(work_units(c))
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    var = sum((x - mean_x) ** 2 for x in xs) or 1.0
    a = max(sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / var, 0.0)
    b = max(mean_y - a * mean_x, 0.0)
    total = sum(a * work_units(c) + b for c in cases)
    return total, sum(ys), n


if __name__ == "__main__":
    import sys

    args = [int(x) for x in sys.argv[1:]]
    total, measured, n = estimate_cpu_seconds(*args)
    print(
        f"CPU op on {n} sampled cases: {measured:.1f} s with {torch.get_num_threads()} threads; "
        f"all {case_count()} cases: about {total:.0f} s of CPU op time on this machine"
    )
