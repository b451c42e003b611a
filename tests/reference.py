"""Independent reference attention for the tests, in pure torch.

Nothing here calls the extension: the window rule, softcap, ALiBi, GQA,
dropout and the Philox4x32-10 keep mask are restated from the op contract
(docs/architecture.md, "The op contract") so that the kernels are checked against a
second, plain implementation.

Layouts follow the ops: q (batch, seqlen_q, nheads, head_dim), k / v
(batch, seqlen_k, nheads_k, head_dim); lse (batch, nheads, seqlen_q).
"""

import math

import torch

# ---------------------------------------------------------------------------
# Window rule
# ---------------------------------------------------------------------------


def normalize_window(causal, window_left, window_right, seqlen_k):
    """The (left, right) window the ops use: causal forces right = 0; a side
    that is negative or reaches seqlen_k or beyond becomes unbounded (-1)."""

    def side(w):
        return -1 if (w < 0 or w >= seqlen_k) else int(w)

    left, right = side(window_left), side(window_right)
    if causal:
        right = 0
    return left, right


def visible_mask(seqlen_q, seqlen_k, window_left=-1, window_right=-1, device="cpu"):
    """Bool (seqlen_q, seqlen_k): query i sees key j iff
    i + sk - sq - left <= j <= i + sk - sq + right (a negative side unbounded)."""
    rows = torch.arange(seqlen_q, device=device).unsqueeze(1)
    cols = torch.arange(seqlen_k, device=device).unsqueeze(0)
    diagonal = rows + seqlen_k - seqlen_q
    mask = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if window_left >= 0:
        mask &= cols >= diagonal - window_left
    if window_right >= 0:
        mask &= cols <= diagonal + window_right
    return mask


def alibi_bias(slopes, seqlen_q, seqlen_k, dtype=torch.float64):
    """slopes (..., nheads) -> bias (..., nheads, seqlen_q, seqlen_k):
    -slope * |i + sk - sq - j|."""
    rows = torch.arange(seqlen_q, device=slopes.device).unsqueeze(1)
    cols = torch.arange(seqlen_k, device=slopes.device).unsqueeze(0)
    distance = (rows + seqlen_k - seqlen_q - cols).abs().to(dtype)
    return -slopes.to(dtype)[..., None, None] * distance


# ---------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------


def attention_ref(
    q,
    k,
    v,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    dropout_p=0.0,
    keep_mask=None,
    compute_dtype=torch.float64,
    normalize=True,
    learnable_sink=None,
):
    """Attention of fixed-length q, k, v in compute_dtype.

    alibi_slopes: None, (nheads) or (batch, nheads). keep_mask: None or bool
    (batch, nheads, seqlen_q, seqlen_k), True where dropout keeps P; kept
    values are scaled by 1 / (1 - dropout_p). normalize=False takes the window
    as given instead of normalising it like the ops do. learnable_sink: None
    or (nheads): attention sinks, one more logit per row in the softmax's
    denominator, in the units of the final scores, with no value row.

    Returns (out (batch, seqlen_q, nheads, head_dim), lse (batch, nheads,
    seqlen_q)), both in compute_dtype and differentiable (learnable_sink
    too). The lse includes the sink. Rows that see no key: out 0, lse +inf,
    or the sink with learnable_sink.
    """
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    assert nheads % nheads_k == 0
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    left, right = window_size
    if normalize:
        left, right = normalize_window(causal, left, right, seqlen_k)
    elif causal:
        right = 0

    qc, kc, vc = (t.to(compute_dtype) for t in (q, k, v))
    group = nheads // nheads_k
    kc = kc.repeat_interleave(group, dim=2)
    vc = vc.repeat_interleave(group, dim=2)

    scores = torch.einsum("bqhd,bkhd->bhqk", qc, kc) * softmax_scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        slopes = alibi_slopes if alibi_slopes.dim() == 2 else alibi_slopes.expand(batch, nheads)
        scores = scores + alibi_bias(slopes, seqlen_q, seqlen_k, compute_dtype)
    visible = visible_mask(seqlen_q, seqlen_k, left, right, q.device)
    scores = scores.masked_fill(~visible, float("-inf"))

    if learnable_sink is not None:
        # The sink is one more finite logit in every row, so even a row with
        # no visible key has a finite lse (the sink) and P = 0.
        sink = learnable_sink.to(device=scores.device, dtype=compute_dtype)
        sink = sink.view(1, nheads, 1, 1).expand(batch, nheads, seqlen_q, 1)
        lse = torch.logsumexp(torch.cat([scores, sink], dim=-1), dim=-1)
        probs = torch.exp(scores - lse.unsqueeze(-1))
    else:
        row_sees_key = visible.any(dim=-1)  # (seqlen_q,)
        # logsumexp of a row with no visible key would be -inf and poison the
        # gradient; give it finite scores, then report +inf and P = 0.
        safe_scores = scores.masked_fill(~row_sees_key[:, None], 0.0)
        lse = torch.logsumexp(safe_scores, dim=-1)
        probs = torch.exp(scores - lse.unsqueeze(-1))
        lse = lse.masked_fill(~row_sees_key, float("inf"))

    if dropout_p > 0 or keep_mask is not None:
        assert keep_mask is not None, "dropout needs the keep mask"
        probs = probs * keep_mask.to(device=probs.device, dtype=compute_dtype) / (1.0 - dropout_p)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, vc)
    return out, lse


def varlen_attention_ref(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_k=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    dropout_p=0.0,
    keep_masks=None,
    compute_dtype=torch.float64,
    learnable_sink=None,
    seqused_q=None,
    seqused_k=None,
):
    """Varlen attention by a loop over the sequences: q (total_q, nheads, d),
    k (total_k, nheads_k, d), v (total_k, nheads_k, d_v). The window is normalised against
    max_seqlen_k (default: the longest key sequence), as the ops do.
    keep_masks: None or a list of bool (nheads, seqlen_q_b, seqlen_k_b).
    learnable_sink: None or (nheads), as in attention_ref.
    seqused_q / seqused_k: None or (batch) ints: sequence b is only its first
    seqused_q[b] query rows / seqused_k[b] keys (FA3's semantics; the used
    lengths are the sequence's lengths, for the causal / local alignment too).

    Returns (out (total_q, nheads, d), lse (nheads, total_q)). Rows outside
    every sequence, and rows past seqused_q[b], are 0 in out and +inf in lse.
    """
    cu_q = [int(x) for x in cu_seqlens_q]
    cu_k = [int(x) for x in cu_seqlens_k]
    batch = len(cu_q) - 1
    head_dim = q.shape[-1]
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    if max_seqlen_k is None:
        max_seqlen_k = max([cu_k[b + 1] - cu_k[b] for b in range(batch)] + [0])
    left, right = normalize_window(causal, window_size[0], window_size[1], max_seqlen_k)
    nheads = q.shape[1]
    out = q.new_zeros(q.shape[:-1] + v.shape[-1:], dtype=compute_dtype)  # v may have d_v < d
    lse = torch.full((nheads, q.shape[0]), float("inf"), dtype=compute_dtype, device=q.device)
    pieces_out, pieces_lse = [], []
    end_q = [
        cu_q[b + 1] if seqused_q is None else cu_q[b] + int(seqused_q[b]) for b in range(batch)
    ]
    end_k = [
        cu_k[b + 1] if seqused_k is None else cu_k[b] + int(seqused_k[b]) for b in range(batch)
    ]
    for b in range(batch):
        qb = q[cu_q[b] : end_q[b]].unsqueeze(0)
        kb = k[cu_k[b] : end_k[b]].unsqueeze(0)
        vb = v[cu_k[b] : end_k[b]].unsqueeze(0)
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes[b] if alibi_slopes.dim() == 2 else alibi_slopes
        mask = None if keep_masks is None else keep_masks[b].unsqueeze(0)
        ob, lb = attention_ref(
            qb,
            kb,
            vb,
            softmax_scale=softmax_scale,
            causal=False,
            window_size=(left, right),
            softcap=softcap,
            alibi_slopes=slopes,
            dropout_p=dropout_p,
            keep_mask=mask,
            compute_dtype=compute_dtype,
            normalize=False,
            learnable_sink=learnable_sink,
        )
        pieces_out.append((cu_q[b], end_q[b], ob[0]))
        pieces_lse.append((cu_q[b], end_q[b], lb[0]))
    # Assemble without in-place writes so that autograd flows through.
    out_rows, lse_cols, cursor = [], [], 0
    for (start, end, ob), (_, _, lb) in zip(pieces_out, pieces_lse):
        if start > cursor:
            out_rows.append(out[cursor:start])
            lse_cols.append(lse[:, cursor:start])
        out_rows.append(ob)
        lse_cols.append(lb)
        cursor = end
    if cursor < q.shape[0]:
        out_rows.append(out[cursor:])
        lse_cols.append(lse[:, cursor:])
    out = torch.cat(out_rows, dim=0) if out_rows else out
    lse = torch.cat(lse_cols, dim=1) if lse_cols else lse
    return out, lse


# ---------------------------------------------------------------------------
# Philox4x32-10 dropout mask (same definition as csrc/common/philox.h)
# ---------------------------------------------------------------------------

_MASK32 = 0xFFFFFFFF
_PHILOX_MUL = (0xD2511F53, 0xCD9E8D57)
_PHILOX_WEYL = (0x9E3779B9, 0xBB67AE85)


def _mulhilo32(constant, x):
    """(hi, lo) 32-bit halves of constant * x for int64 tensors holding
    uint32 values, without overflowing int64 (16-bit split of the constant)."""
    c_hi, c_lo = constant >> 16, constant & 0xFFFF
    upper = x * c_hi  # < 2^48
    lower = x * c_lo  # < 2^48
    low_sum = ((upper & 0xFFFF) << 16) + lower  # < 2^49
    hi = (upper >> 16) + (low_sum >> 32)
    return hi & _MASK32, low_sum & _MASK32


def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 on int64 tensors (uint32 values); keys are Python ints."""
    for _ in range(10):
        hi0, lo0 = _mulhilo32(_PHILOX_MUL[0], c0)
        hi1, lo1 = _mulhilo32(_PHILOX_MUL[1], c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + _PHILOX_WEYL[0]) & _MASK32
        k1 = (k1 + _PHILOX_WEYL[1]) & _MASK32
    return c0, c1, c2, c3


def dropout_threshold(dropout_p):
    """Draws below this uint32 are dropped. The ops hold dropout_p as float32."""
    scaled = float(torch.tensor(dropout_p, dtype=torch.float32).item()) * 4294967296.0
    return _MASK32 if scaled >= 4294967295.0 else int(scaled)


def dropout_keep_mask(seed, offset, batch_index, nheads, seqlen_q, seqlen_k, dropout_p, heads=None):
    """Bool (len(heads), seqlen_q, seqlen_k) keep mask of one batch entry.

    One Philox call per (row, group of 4 columns): key = (seed lo, seed hi),
    counter = (col // 4, row, batch_index * nheads + head, offset lo); column
    col reads output word col % 4 and is kept iff it is >= the threshold.
    """
    seed &= (1 << 64) - 1
    offset &= (1 << 64) - 1
    heads = list(range(nheads)) if heads is None else list(heads)
    groups = (seqlen_k + 3) // 4
    head_t = torch.tensor(heads, dtype=torch.int64).view(-1, 1, 1)
    rows = torch.arange(seqlen_q, dtype=torch.int64).view(1, -1, 1)
    cols = torch.arange(groups, dtype=torch.int64).view(1, 1, -1)
    shape = (len(heads), seqlen_q, groups)
    c0 = cols.expand(shape)
    c1 = rows.expand(shape)
    c2 = ((batch_index * nheads + head_t) & _MASK32).expand(shape)
    c3 = torch.full(shape, offset & _MASK32, dtype=torch.int64)
    words = philox4x32_10(c0, c1, c2, c3, seed & _MASK32, (seed >> 32) & _MASK32)
    bits = torch.stack(words, dim=-1).reshape(len(heads), seqlen_q, groups * 4)[..., :seqlen_k]
    return bits >= dropout_threshold(dropout_p)


def dropout_keep_mask_batch(seed, offset, batch, nheads, seqlen_q, seqlen_k, dropout_p):
    """Bool (batch, nheads, seqlen_q, seqlen_k) keep mask of a fixed-length problem."""
    return (
        torch.stack(
            [
                dropout_keep_mask(seed, offset, b, nheads, seqlen_q, seqlen_k, dropout_p)
                for b in range(batch)
            ]
        )
        if batch > 0
        else torch.zeros(0, nheads, seqlen_q, seqlen_k, dtype=torch.bool)
    )


def dropout_keep_masks_varlen(seed, offset, cu_seqlens_q, cu_seqlens_k, nheads, dropout_p):
    """List of bool (nheads, seqlen_q_b, seqlen_k_b), one per sequence."""
    cu_q = [int(x) for x in cu_seqlens_q]
    cu_k = [int(x) for x in cu_seqlens_k]
    return [
        dropout_keep_mask(
            seed, offset, b, nheads, cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b], dropout_p
        )
        for b in range(len(cu_q) - 1)
    ]


# ---------------------------------------------------------------------------
# Comparison criterion (docs/architecture.md, "The correctness criterion")
# ---------------------------------------------------------------------------


def max_abs_err(a, b):
    if a.numel() == 0:
        return 0.0
    return (a.double() - b.double()).abs().max().item()


def assert_within_criterion(ours, ref_exact, ref_same_dtype, factor=2.0, atol=1e-5, name="out"):
    """max|ours - ref_exact| <= factor * max|ref_same_dtype - ref_exact| + atol."""
    err = max_abs_err(ours, ref_exact)
    baseline = max_abs_err(ref_same_dtype, ref_exact)
    assert err <= factor * baseline + atol, (
        f"{name}: max error {err:.3e} exceeds {factor} x the same-dtype torch error "
        f"{baseline:.3e} + {atol:.0e}"
    )


# fp32 results (CPU only) against float64: fixed tolerances, outputs and gradients.
FP32_TOL = dict(atol=2e-5, rtol=2e-5)
FP32_GRAD_TOL = dict(atol=1e-4, rtol=1e-4)


def check_close(ours, exact, same, name, *, grad=False):
    """The correctness criterion for one result: fp32 against float64 with fixed
    tolerances; fp16 / bf16 within factor x the same-dtype torch error (3x for
    gradients, 2x for outputs)."""
    if same.dtype == torch.float32:
        tol = FP32_GRAD_TOL if grad else FP32_TOL
        torch.testing.assert_close(ours.double(), exact.double(), msg=name, **tol)
    else:
        assert_within_criterion(
            ours, exact, same, factor=3.0 if grad else 2.0, atol=1e-4 if grad else 1e-5, name=name
        )


def assert_compiled_matches_eager(attention, inputs):
    """attention(*inputs()) under torch.compile(fullgraph=True) gives eager's
    output and input gradients bitwise (inputs() draws the same tensors each
    call); returns the compiled output."""
    eager_in, compiled_in = inputs(), inputs()
    eager_out = attention(*eager_in)
    eager_out.float().square().sum().backward()
    compiled = torch.compile(attention, backend="aot_eager", fullgraph=True)
    out = compiled(*compiled_in)
    out.float().square().sum().backward()
    assert torch.equal(out, eager_out)
    for a, b in zip(compiled_in, eager_in):
        torch.testing.assert_close(a.grad, b.grad, atol=0, rtol=0)
    torch._dynamo.reset()
    return out


# ---------------------------------------------------------------------------
# FP8 (docs/fp8.md; the same rule as csrc/common/fp8_rule.h)
# ---------------------------------------------------------------------------

E4M3_MAX = 448.0
# Relative rounding of e4m3 (3 stored mantissa bits, round to nearest) on
# normal values: half a unit in the last place, 2**-(3 + 1).
E4M3_UNIT_ROUNDOFF = 2.0**-4
# bfloat16's (7 stored bits): the rounding of the output.
BF16_UNIT_ROUNDOFF = 2.0**-8


def fp8_dequantize(x, descale, dtype=torch.float64):
    """x (batch, seqlen, heads, d) in float8_e4m3fn, descale (batch, nheads_k):
    x * descale[b, h // (heads // nheads_k)] in dtype (the descale of a query
    head is its kv head's). descale None: x in dtype."""
    values = x.to(dtype)
    if descale is None:
        return values
    group = x.shape[2] // descale.shape[1]
    per_head = descale.to(dtype).repeat_interleave(group, dim=1)  # (batch, heads)
    return values * per_head[:, None, :, None]


def fp8_dequantize_varlen(x, descale, cu_seqlens, dtype=torch.float64):
    """x (total, heads, d): row r of sequence b (cu_seqlens[b] <= r <
    cu_seqlens[b + 1]) takes descale[b, ...]; rows outside every sequence are
    left at descale 1 (nothing reads them)."""
    values = x.to(dtype)
    if descale is None:
        return values
    cu = [int(c) for c in cu_seqlens]
    group = x.shape[1] // descale.shape[1]
    per_head = descale.to(dtype).repeat_interleave(group, dim=1)
    scale = torch.ones(x.shape[0], x.shape[1], dtype=dtype)
    for b in range(len(cu) - 1):
        scale[cu[b] : cu[b + 1]] = per_head[b]
    return values * scale[:, :, None]


def quantize_e4m3(value, descale):
    """What an fp8 cache stores for a 16-bit value: value / descale in fp32,
    saturated to [-448, 448], rounded to the nearest e4m3 (ties to even).
    descale broadcasts against value."""
    scaled = value.float() / descale.float()
    return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def fp8_kernel_tolerance(q, k, v, softmax_scale, ref_out, ref_abs_out, ref_lse):
    """The tolerance docs/fp8.md derives for an FP8 kernel that, as FA3 does,
    rounds P to e4m3 before P·V and may accumulate q·k in reduced precision,
    against the float64 reference of the dequantised inputs. q, k: dequantised
    v: dequantised float64 (batch, seqlen, heads, d) (k, v may have fewer
    heads); ref_out /
    ref_lse: the float64 reference; ref_abs_out: the same attention with |v|
    for v, i.e. sum_j P_ij |v_j|. Returns elementwise bounds (out_bound,
    lse_bound) of |out - ref_out| and |lse - ref_lse|:

    out: (2**-4 + 2 * ds) * sum_j P_ij |v_j| + seqlen_k * 2**-18 * max_j |v_j|
    + 2**-8 * |ref_out| + 1e-5, where 2**-4 is e4m3's relative rounding of
    each weight (scaled by 2**8 first, so that weights down to 2**-14 are
    normal e4m3 values), seqlen_k * 2**-18 what the smaller ones can lose in
    all (2**-18: half e4m3's subnormal step, 2**-9, over the 2**8), ds a
    bound of the score
    error (a score off by ds moves its weight and the row's normaliser by
    about ds, relative) and 2**-8 the bf16 rounding of the output.
    lse: ds + 2**-20 * (1 + |lse|). ds = 2**-13 * scale * max over keys of
    sum_d |q_d k_d|: an accumulation that keeps 13 bits.
    """
    group = q.shape[2] // k.shape[2]
    k_heads = k.repeat_interleave(group, dim=2).abs()
    dot = torch.einsum("bqhd,bkhd->bhqk", q.abs(), k_heads).amax(dim=-1)  # (b, h, sq)
    ds = 2.0**-13 * abs(softmax_scale) * dot
    ds_rows = ds.transpose(1, 2)[..., None]  # (b, sq, h, 1)
    v_max = v.abs().repeat_interleave(group, dim=2).amax(dim=(1, 3))[:, None, :, None]
    out_bound = (E4M3_UNIT_ROUNDOFF + 2 * ds_rows) * ref_abs_out + k.shape[1] * 2.0**-18 * v_max
    out_bound = out_bound + BF16_UNIT_ROUNDOFF * ref_out.abs() + 1e-5
    finite = torch.isfinite(ref_lse)
    lse_bound = ds + 2.0**-20 * (1 + ref_lse.abs().where(finite, torch.zeros_like(ref_lse)))
    return out_bound, lse_bound


def emulate_fp8_p_kernel(q, k, v, softmax_scale, causal=False, window_size=(-1, -1)):
    """A float64 model of the FP8 kernel docs/fp8.md bounds: P = exp(s - m)
    scaled by 2**8 (so that weights down to 2**-14 stay normal in e4m3),
    rounded to e4m3, then P·V / rowsum(P before rounding). Inputs dequantised
    float64 (batch, seqlen, heads, d). Returns out (float64; rows that see no
    key 0)."""
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k = k.shape[1]
    group = nheads // k.shape[2]
    kh, vh = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kh) * softmax_scale
    left, right = normalize_window(causal, window_size[0], window_size[1], seqlen_k)
    visible = visible_mask(seqlen_q, seqlen_k, left, right)
    scores = scores.masked_fill(~visible, float("-inf"))
    m = scores.amax(dim=-1, keepdim=True).clamp_min(-1e300)
    p = torch.exp(scores - m)
    total = p.sum(dim=-1, keepdim=True)
    p_rounded = (p * 256.0).to(torch.float8_e4m3fn).double() / 256.0
    out = torch.einsum("bhqk,bkhd->bqhd", p_rounded / total.where(total > 0, 1.0), vh)
    return out
