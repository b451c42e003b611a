"""Reading S_dmask (return_attn_probs / return_softmax) as flash-attn 2.x's tests do.

flash-attn's test suite never compares S_dmask with probabilities directly. It
crops S_dmask to (seqlen_q, seqlen_k) (flash-attn pads both to multiples of
128), zeroes every position a query cannot see (outside the causal / local
window, past a sequence's length), reads the dropout pattern from the sign
(>= 0 is kept), and turns the magnitudes back into probabilities with its own
fp32 scores: the keys are split into blocks of ``_get_block_size_n(...)``
columns from key 0, and block j's numerators are relative to the running max
over blocks j, j+1, ... (the kernel visits key blocks from the last to the
first), so

    P_ij = |S_ij| * exp(max(s_i over blocks >= block(j)) - lse_i).

This module restates that reading from the convention alone, in float64, so
that the tests check this package's S_dmask the way a flash-attn test would.
Scores follow the op contract (docs/architecture.md): scale, softcap, ALiBi, then the
window mask; tests/reference.py holds the window and ALiBi rules.
"""

import math

import torch

import reference


def final_scores(q, k, *, softmax_scale=None, window=(-1, -1), softcap=0.0, alibi_slopes=None):
    """Scores (batch, nheads, seqlen_q, seqlen_k) in float64, -inf where masked.

    q (batch, seqlen_q, nheads, d), k (batch, seqlen_k, nheads_k, d); window
    already normalised (reference.normalize_window); alibi_slopes None,
    (nheads) or (batch, nheads).
    """
    batch, seqlen_q, nheads, head_dim = q.shape
    seqlen_k = k.shape[1]
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
    k = k.double().repeat_interleave(nheads // k.shape[2], dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        slopes = alibi_slopes if alibi_slopes.dim() == 2 else alibi_slopes.expand(batch, nheads)
        scores = scores + reference.alibi_bias(slopes.to(scores.device), seqlen_q, seqlen_k)
    visible = reference.visible_mask(seqlen_q, seqlen_k, window[0], window[1], scores.device)
    return scores.masked_fill(~visible, float("-inf"))


def block_running_max(scores, block_n):
    """Per column, the row's max over the column's key block and every block
    after it: (..., seqlen_k), -inf where those blocks hold no visible key."""
    seqlen_k = scores.shape[-1]
    if seqlen_k == 0:
        return scores.clone()
    nblocks = -(-seqlen_k // block_n)
    padded = torch.nn.functional.pad(scores, (0, nblocks * block_n - seqlen_k), value=float("-inf"))
    block_max = padded.unflatten(-1, (nblocks, block_n)).amax(dim=-1)
    suffix_max = block_max.flip(-1).cummax(dim=-1).values.flip(-1)
    return suffix_max.repeat_interleave(block_n, dim=-1)[..., :seqlen_k]


def row_lse(scores):
    """logsumexp over keys; +inf for a row with no visible key (so P = 0)."""
    lse = torch.logsumexp(scores, dim=-1)
    return lse.masked_fill(lse == float("-inf"), float("inf"))


def expected_numerators(scores, block_n):
    """What S_dmask holds, undropped: exp(s - running block max), 0 where masked."""
    return torch.exp(scores - block_running_max(scores, block_n)).nan_to_num(0.0)


def probs_from_numerators(numerators, scores, block_n):
    """flash-attn's normalisation: |S| * exp(running block max - lse)."""
    factor = torch.exp(block_running_max(scores, block_n) - row_lse(scores)[..., None])
    return numerators.abs().double() * factor


def reference_probs(scores):
    """softmax over keys; 0 for rows with no visible key."""
    return torch.exp(scores - row_lse(scores)[..., None])


def crop(s_dmask, seqlen_q, seqlen_k):
    """The (seqlen_q, seqlen_k) corner of an S_dmask of one batch entry or
    more, zero-padded where S_dmask is smaller (as flash-attn's helper does)."""
    rows, cols = s_dmask.shape[-2:]
    s = s_dmask[..., :seqlen_q, :seqlen_k]
    return torch.nn.functional.pad(s, (0, max(0, seqlen_k - cols), 0, max(0, seqlen_q - rows)))


def tolerance(dtype):
    """Numerators are rounded to dtype: relative error within half an ulp."""
    return {
        torch.float32: dict(atol=1e-7, rtol=1e-4),
        torch.float16: dict(atol=1e-6, rtol=1e-3),
        torch.bfloat16: dict(atol=1e-6, rtol=5e-3),
    }[dtype]


def check_entry(s_dmask, scores, block_n, keep=None, name="S_dmask"):
    """Checks one cropped S_dmask (nheads, seqlen_q, seqlen_k) against the
    float64 scores of the same shape (-inf where masked).

    * masked positions hold +0;
    * |S| is the numerator exp(s - running block max), and the probabilities
      recovered from it are the reference softmax;
    * keep (bool, same shape) given: the sign bit is set exactly where dropout
      dropped the entry, so flash-attn's reading (S >= 0 is kept) gives the
      applied pattern on every entry whose numerator is not 0.
    Returns the keep pattern read from the sign bit.
    """
    tol = tolerance(s_dmask.dtype)
    visible = scores > float("-inf")
    masked = s_dmask[~visible]
    assert torch.all(masked == 0) and not torch.any(torch.signbit(masked)), (
        f"{name}: masked positions must hold +0"
    )

    def message(what):
        return lambda m: f"{name}, {what}: {m}"

    numerators = expected_numerators(scores, block_n)
    torch.testing.assert_close(s_dmask.abs().double(), numerators, **tol, msg=message("numerators"))
    probs = probs_from_numerators(s_dmask, scores, block_n)
    torch.testing.assert_close(probs, reference_probs(scores), **tol, msg=message("recovered P"))

    kept_by_sign = ~torch.signbit(s_dmask)
    if keep is not None:
        assert torch.equal(kept_by_sign[visible], keep[visible]), f"{name}: dropout pattern"
        nonzero = visible & (s_dmask != 0)
        assert torch.equal((s_dmask >= 0)[nonzero], keep[nonzero]), (
            f"{name}: dropout pattern read as S >= 0"
        )
    return kept_by_sign & visible
