"""flash_attn_combine: the merge of partial attention results by their lse.

The reference (`combine_ref`) restates the rule of csrc/common/lse_combine_rule.h
in float64: an lse of -inf or +inf (this package's empty row) is a split with no
key and weighs nothing, a row with no non-empty split gets out 0 and lse +inf, a
NaN lse makes the row NaN. The end-to-end tests split the keys of an attention
problem, run the package's forward on each part and check that the merge of the
parts is the attention over all keys, computed in float64. The CUDA cases
compare the kernel with the same reference and skip without a GPU.
"""

import math

import pytest
import torch

import flash_attn_cuda
from flash_attn_cuda import flash_attn_combine, flash_attn_func, flash_attn_varlen_func

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ops = torch.ops.flash_attn


def combine_ref(out_partial, lse_partial):
    """(out, lse) in float64 on the CPU; the rule of the op, restated."""
    o = out_partial.double().cpu()
    lse = lse_partial.double().cpu()
    lse = torch.where(lse == math.inf, -math.inf, lse)  # +inf: the package's empty row
    nan_row = lse.isnan().any(0)
    empty = lse == -math.inf
    m = torch.where(empty, -math.inf, lse).amax(0)
    all_empty = m == -math.inf
    m_safe = torch.where(all_empty, 0.0, m)
    w = torch.where(empty, 0.0, torch.exp(lse - m_safe))
    total = w.sum(0)
    row_lse = torch.where(all_empty, math.inf, m_safe + torch.log(total))
    weight = torch.where(empty, 0.0, torch.exp(lse - row_lse))
    weight = torch.where(all_empty, 0.0, weight)
    # An empty split's out row may hold anything: it is never multiplied.
    out = torch.where(weight[..., None] == 0, 0.0, weight[..., None] * o).sum(0)
    out = torch.where(nan_row[..., None], math.nan, out)
    row_lse = torch.where(nan_row, math.nan, row_lse)
    return out, row_lse


def assert_close_to_ref(out, lse, ref_out, ref_lse, out_dtype):
    # fp32 math: the lse to a few ulp; out to its dtype's rounding.
    assert lse.dtype == torch.float32
    torch.testing.assert_close(lse.double().cpu(), ref_lse, rtol=1e-5, atol=1e-5, equal_nan=True)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[out_dtype]
    assert out.dtype == out_dtype
    torch.testing.assert_close(out.double().cpu(), ref_out, rtol=tol, atol=tol, equal_nan=True)


def random_partials(num_splits, lead, nheads, head_dim, device, dtype=torch.float32):
    """out_partial (num_splits, *lead, nheads, head_dim), lse_partial (num_splits, *lead, nheads),
    with lse spread over a wide range so that the weights differ by orders of magnitude."""
    out = torch.randn(num_splits, *lead, nheads, head_dim, device=device).to(dtype)
    lse = torch.randn(num_splits, *lead, nheads, device=device) * 4 + 10
    return out, lse


# ---------------------------------------------------------------------------
# End to end: partial attentions over parts of the keys
# ---------------------------------------------------------------------------


def attention_ref(q, k, v, visible):
    """float64 attention with a boolean visibility (seqlen_q, seqlen_k); rows that see no key
    get out 0 and lse +inf (the op contract). q, k, v: (batch, seqlen, nheads, d)."""
    q, k, v = q.double(), k.double(), v.double()
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(scores, -1)  # (b, h, sq)
    p = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", p, v)
    lse = torch.where(lse == -math.inf, math.inf, lse)
    return out, lse.transpose(1, 2)  # lse as (b, sq, h)


def causal_visible(seqlen_q, seqlen_k):
    i = torch.arange(seqlen_q)[:, None]
    j = torch.arange(seqlen_k)[None, :]
    return j <= i + seqlen_k - seqlen_q


@pytest.mark.parametrize(
    "seqlen_q,parts",
    [
        (3, [(20, False), (17, True)]),  # cascade: shared prefix, then a causal suffix
        (5, [(7, False), (2, True), (1, True), (9, False)]),  # rows with no key in a part
        (1, [(1, False)] * 5),
        (17, [(13, False), (64, False), (33, False)]),
    ],
)
def test_split_keys_merge_to_full_attention(seqlen_q, parts):
    batch, nheads, d = 2, 3, 40
    q = torch.randn(batch, seqlen_q, nheads, d)
    keys = sum(n for n, _ in parts)
    k = torch.randn(batch, keys, nheads, d)
    v = torch.randn(batch, keys, nheads, d)
    outs, lses, visible, start = [], [], [], 0
    for n, causal in parts:
        kp, vp = k[:, start : start + n], v[:, start : start + n]
        out, lse, _ = flash_attn_func(q, kp, vp, causal=causal, return_attn_probs=True)
        outs.append(out)
        lses.append(lse.transpose(1, 2))  # (b, h, sq) -> (b, sq, h), a strided view
        visible.append(
            causal_visible(seqlen_q, n) if causal else torch.ones(seqlen_q, n, dtype=bool)
        )
        start += n
    out_partial, lse_partial = torch.stack(outs), torch.stack(lses)
    ref_out, ref_lse = attention_ref(q, k, v, torch.cat(visible, 1))
    out, lse = flash_attn_combine(out_partial, lse_partial)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
    if all(not c for _, c in parts):
        full_out, full_lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
        torch.testing.assert_close(out, full_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse, full_lse.transpose(1, 2), rtol=1e-5, atol=1e-5)


def test_row_with_no_key_in_any_part_is_an_empty_row():
    # seqlen_q > seqlen_k with causal in every part: the first rows see no key anywhere
    # and keep the package's empty row (out 0, lse +inf) through the merge.
    q = torch.randn(1, 6, 2, 16)
    k, v = torch.randn(1, 4, 2, 16), torch.randn(1, 4, 2, 16)
    parts = [flash_attn_func(q, k[:, :2], v[:, :2], causal=True, return_attn_probs=True)]
    parts.append(flash_attn_func(q, k[:, 2:], v[:, 2:], causal=True, return_attn_probs=True))
    out, lse = flash_attn_combine(
        torch.stack([p[0] for p in parts]), torch.stack([p[1].transpose(1, 2) for p in parts])
    )
    assert torch.isinf(parts[0][1][:, :, :4]).all()  # the forward's convention, read here
    assert (lse[:, :4] == math.inf).all() and (out[:, :4] == 0).all()
    assert torch.isfinite(lse[:, 4:]).all()


def test_varlen_partials():
    # varlen forward on two halves of each sequence's keys, merged in the varlen layout.
    lengths_q, lengths_k = [3, 1, 6], [5, 8, 2]
    nheads, d = 2, 24
    cu_q = torch.tensor([0, 3, 4, 10], dtype=torch.int32)
    tq = torch.randn(10, nheads, d)
    halves = []
    for part in range(2):
        ks = [torch.randn(n // 2 + part * (n % 2), nheads, d) for n in lengths_k]
        halves.append(ks)
    outs, lses = [], []
    for ks in halves:
        vs = [torch.randn_like(x) for x in ks]
        cu_k = torch.tensor([0] + [x.shape[0] for x in ks], dtype=torch.int32).cumsum(0).int()
        out, lse, _ = flash_attn_varlen_func(
            tq, torch.cat(ks), torch.cat(vs), cu_q, cu_k, max(lengths_q),
            max(x.shape[0] for x in ks), return_attn_probs=True,
        )  # fmt: skip
        outs.append(out)
        lses.append(lse.t())  # (nheads, total) -> (total, nheads)
        ks[:] = [torch.cat([x, y], -1) for x, y in zip(ks, vs)]  # keep k and v for the check
    out, lse = flash_attn_combine(torch.stack(outs), torch.stack(lses))
    assert out.shape == (10, nheads, d) and lse.shape == (10, nheads)
    for b in range(3):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        kv = torch.cat([halves[0][b], halves[1][b]])
        kb, vb = kv[..., :d], kv[..., d:]
        ref_out, ref_lse = attention_ref(
            tq[rows][None],
            kb[None],
            vb[None],
            torch.ones(rows.stop - rows.start, kb.shape[0], dtype=bool),
        )
        torch.testing.assert_close(out[rows].double(), ref_out[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[rows].double(), ref_lse[0], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# The rule, edge cases, layouts, dtypes (both devices)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("partial_dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", [None] + DTYPES)
def test_dtypes(device, partial_dtype, out_dtype):
    out_partial, lse_partial = random_partials(5, (2, 7), 3, 64, device, partial_dtype)
    out, lse = flash_attn_combine(out_partial, lse_partial, out_dtype=out_dtype)
    ref_out, ref_lse = combine_ref(out_partial, lse_partial)
    assert out.device == out_partial.device and lse.device == out_partial.device
    assert_close_to_ref(out, lse, ref_out, ref_lse, out_dtype or partial_dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_splits", [1, 2, 3, 5, 33, 256])
@pytest.mark.parametrize("head_dim", [1, 3, 6, 8, 40, 64, 130, 256])
def test_split_counts_and_head_dims(device, num_splits, head_dim):
    out_partial, lse_partial = random_partials(num_splits, (2, 3), 4, head_dim, device)
    out, lse = flash_attn_combine(out_partial, lse_partial)
    assert_close_to_ref(out, lse, *combine_ref(out_partial, lse_partial), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_splits_weigh_nothing(device):
    out_partial, lse_partial = random_partials(6, (2, 9), 4, 32, device)
    lse_partial[1] = -math.inf
    lse_partial[3, :, ::2] = math.inf  # the package's empty row
    lse_partial[4, 1] = -math.inf
    # Whatever an empty split's rows hold never reaches the result.
    out_partial[1] = math.nan
    out_partial[3, :, ::2] = math.inf
    out_partial[4, 1] = math.nan
    out, lse = flash_attn_combine(out_partial, lse_partial)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert_close_to_ref(out, lse, *combine_ref(out_partial, lse_partial), torch.float32)
    # The same as the merge of the non-empty splits alone: at batch 1's odd rows, 0, 2, 3, 5.
    keep = [0, 2, 3, 5]
    sub_out, sub_lse = flash_attn_combine(out_partial[keep, 1, 1::2], lse_partial[keep, 1, 1::2])
    torch.testing.assert_close(out[1, 1::2], sub_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse[1, 1::2], sub_lse, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("empty_value", [-math.inf, math.inf])
def test_row_with_every_split_empty(device, empty_value):
    out_partial, lse_partial = random_partials(4, (1, 3), 2, 16, device)
    lse_partial[:, 0, 1, 0] = empty_value
    lse_partial[:2, 0, 2, 1] = -math.inf
    lse_partial[2:, 0, 2, 1] = math.inf
    out_partial[:, 0, 1, 0] = math.nan
    out, lse = flash_attn_combine(out_partial, lse_partial, out_dtype=torch.bfloat16)
    assert lse[0, 1, 0] == math.inf and lse[0, 2, 1] == math.inf
    assert (out[0, 1, 0] == 0).all() and (out[0, 2, 1] == 0).all()
    assert_close_to_ref(out, lse, *combine_ref(out_partial, lse_partial), torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
def test_nan_lse_makes_the_row_nan(device):
    out_partial, lse_partial = random_partials(3, (2, 4), 2, 8, device)
    lse_partial[1, 0, 2, 1] = math.nan
    lse_partial[:, 1, 3, 0] = -math.inf
    lse_partial[2, 1, 3, 0] = math.nan  # NaN beside empty splits: still NaN
    out, lse = flash_attn_combine(out_partial, lse_partial)
    assert lse[0, 2, 1].isnan() and out[0, 2, 1].isnan().all()
    assert lse[1, 3, 0].isnan() and out[1, 3, 0].isnan().all()
    nan_rows = torch.zeros(2, 4, 2, dtype=bool)
    nan_rows[0, 2, 1] = nan_rows[1, 3, 0] = True
    assert torch.isfinite(lse[~nan_rows.to(device)]).all()
    assert_close_to_ref(out, lse, *combine_ref(out_partial, lse_partial), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_extreme_lse_values(device):
    # Weights are taken against the row's max: lse far from 0 neither overflows nor
    # underflows the result; a split 200 below the max underflows to weight 0.
    out_partial, lse_partial = random_partials(4, (1, 5), 2, 16, device)
    lse_partial[:, 0, 0] += 3e4
    lse_partial[:, 0, 1] -= 3e4
    lse_partial[0, 0, 2] = -200.0
    out, lse = flash_attn_combine(out_partial, lse_partial)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    ref_out, ref_lse = combine_ref(out_partial, lse_partial)
    torch.testing.assert_close(lse.double().cpu(), ref_lse, rtol=1e-6, atol=0)
    torch.testing.assert_close(out.double().cpu(), ref_out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_result_is_a_partial_of_a_further_merge(device):
    # Merging groups of splits, then the groups, equals merging all at once (also with a
    # group whose rows are all empty: its +inf lse weighs nothing in the second merge).
    out_partial, lse_partial = random_partials(7, (2, 5), 3, 24, device)
    lse_partial[4:, 0, 1] = -math.inf
    groups = [slice(0, 4), slice(4, 7)]
    parts = [flash_attn_combine(out_partial[g], lse_partial[g]) for g in groups]
    assert (parts[1][1][0, 1] == math.inf).all()
    out, lse = flash_attn_combine(
        torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
    )
    flat_out, flat_lse = flash_attn_combine(out_partial, lse_partial)
    torch.testing.assert_close(out, flat_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, flat_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_varlen_layout(device):
    out_partial, lse_partial = random_partials(3, (11,), 4, 72, device, torch.bfloat16)
    lse_partial[0, 3] = -math.inf
    out, lse = flash_attn_combine(out_partial, lse_partial)
    assert out.shape == (11, 4, 72) and lse.shape == (11, 4) and lse.is_contiguous()
    assert_close_to_ref(out, lse, *combine_ref(out_partial, lse_partial), torch.bfloat16)
    buffer = torch.full((11, 4, 72), math.nan, device=device)
    result, lse2 = flash_attn_combine(out_partial, lse_partial, out=buffer)
    assert result is buffer
    torch.testing.assert_close(buffer, out.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse2, lse)


@pytest.mark.parametrize("device", DEVICES)
def test_any_strides(device):
    # out_partial: a strided last dim, permuted heads / rows; lse_partial: a transposed
    # view (the forwards' (b, h, s) lse, read as (b, s, h)); out: strided too.
    base = torch.randn(2, 5, 3, 4, 2 * 20, device=device)  # (b, s, splits, h, 2d)
    out_partial = base[..., ::2].permute(2, 0, 1, 3, 4)  # (splits, b, s, h, d), last stride 2
    lse_partial = (torch.randn(3, 2, 4, 5, device=device) * 3).transpose(2, 3)
    assert not out_partial.is_contiguous() and out_partial.stride(-1) == 2
    ref_out, ref_lse = combine_ref(out_partial, lse_partial)
    out, lse = flash_attn_combine(out_partial, lse_partial)
    assert_close_to_ref(out, lse, ref_out, ref_lse, torch.float32)
    for target in (
        torch.full((2, 5, 4, 40), math.nan, device=device)[..., ::2],  # strided last dim
        torch.full((5, 2, 4, 20), math.nan, device=device, dtype=torch.half).transpose(0, 1),
        torch.full((2, 5, 4, 21), math.nan, device=device)[..., 1:],  # misaligned rows
    ):
        result, lse2 = flash_attn_combine(out_partial, lse_partial, out=target)
        assert result is target
        assert_close_to_ref(result, lse2, ref_out, ref_lse, target.dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_out_and_out_dtype(device):
    out_partial, lse_partial = random_partials(2, (1, 3), 2, 16, device)
    out = torch.empty(1, 3, 2, 16, device=device, dtype=torch.bfloat16)
    result, lse = flash_attn_combine(out_partial, lse_partial, out=out, out_dtype=torch.bfloat16)
    assert result is out
    assert_close_to_ref(out, lse, *combine_ref(out_partial, lse_partial), torch.bfloat16)
    with pytest.raises(
        ValueError, match="out has dtype torch.bfloat16 but out_dtype is torch.float16"
    ):
        flash_attn_combine(out_partial, lse_partial, out=out, out_dtype=torch.float16)


@pytest.mark.parametrize("device", DEVICES)
def test_no_rows(device):
    out_partial, lse_partial = random_partials(3, (0, 4), 2, 8, device)
    out, lse = flash_attn_combine(out_partial, lse_partial)
    assert out.shape == (0, 4, 2, 8) and lse.shape == (0, 4, 2)


# ---------------------------------------------------------------------------
# Bad input: the message names the argument, the value and the bound
# ---------------------------------------------------------------------------


def _bad_cases():
    good_o = torch.randn(2, 1, 3, 2, 8)
    good_l = torch.randn(2, 1, 3, 2)
    return [
        ((good_o.double(), good_l), {}, "out_partial must have dtype float32, float16 or bfloat16, got Double"),
        ((good_o, good_l.half()), {}, "lse_partial must have dtype float32, got Half"),
        ((good_o, good_l[0, 0]), {}, r"lse_partial must be 4-D \(num_splits, batch, seqlen, nheads\) or, varlen, 3-D"),
        ((good_o[..., 0], good_l), {}, r"out_partial must be 5-D \(num_splits, batch, seqlen, nheads, head_dim\)"),
        ((good_o, good_l[..., :1]), {}, r"out_partial \[2, 1, 3, 2, 8\] must have the shape of lse_partial \[2, 1, 3, 1\]"),
        ((good_o[:0], good_l[:0]), {}, r"num_splits \(dim 0 of out_partial and lse_partial\) must be in \[1, 256\], got 0"),
        ((torch.randn(257, 1, 1, 1, 8), torch.randn(257, 1, 1, 1)), {}, r"must be in \[1, 256\], got 257"),
        ((good_o[..., :0], good_l), {}, r"head_dim \(last dim of out_partial\) must be at least 1, got 0"),
        ((good_o, good_l), {"out_dtype": torch.int32}, "out_dtype must be torch.float32, torch.float16 or torch.bfloat16, got torch.int32"),
        ((good_o, good_l), {"out": torch.empty(1, 3, 2, 9)}, r"out must have shape \(batch, seqlen, nheads, head_dim\) = \[1, 3, 2, 8\].*got \[1, 3, 2, 9\]"),
        ((good_o, good_l), {"out": torch.empty(1, 3, 2, 8, dtype=torch.float64)}, "out must have dtype float32, float16 or bfloat16, got Double"),
        ((good_o, good_l), {"out": torch.empty(8).expand(1, 3, 2, 8)}, "out must not have elements that share memory"),
        ((good_o, good_l), {"out": good_o[0]}, "out must not share memory with out_partial or lse_partial"),
        ((good_o, good_l), {"out": [1.0]}, "out must be a torch.Tensor, got list"),
    ]  # fmt: skip


@pytest.mark.parametrize("args,kwargs,message", _bad_cases())
def test_bad_input(args, kwargs, message):
    with pytest.raises((RuntimeError, ValueError, TypeError), match=message):
        flash_attn_combine(*args, **kwargs)


@pytest.mark.cuda
def test_bad_devices():
    out_partial, lse_partial = random_partials(2, (1, 3), 2, 8, "cuda")
    with pytest.raises(RuntimeError, match=r"lse_partial must be on the device of out_partial"):
        flash_attn_combine(out_partial, lse_partial.cpu())
    with pytest.raises(RuntimeError, match=r"out must be on the device of out_partial"):
        flash_attn_combine(out_partial, lse_partial, out=torch.empty(1, 3, 2, 8))


def test_out_with_grad_is_refused():
    out_partial, lse_partial = random_partials(2, (1, 3), 2, 8, "cpu")
    out_partial.requires_grad_()
    with pytest.raises(RuntimeError, match="out= does not support autograd"):
        flash_attn_combine(out_partial, lse_partial, out=torch.empty(1, 3, 2, 8))


def test_exported():
    assert flash_attn_cuda.flash_attn_combine is flash_attn_combine
    assert "flash_attn_combine" in flash_attn_cuda.__all__


# ---------------------------------------------------------------------------
# opcheck and torch.compile
# ---------------------------------------------------------------------------

OPCHECK_UTILS = (
    "test_schema",
    "test_autograd_registration",
    "test_faketensor",
    "test_aot_dispatch_dynamic",
)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("varlen", [False, True])
def test_opcheck(device, varlen):
    lead = (7,) if varlen else (2, 5)
    out_partial, lse_partial = random_partials(3, lead, 4, 24, device, torch.bfloat16)
    lse_partial = lse_partial.transpose(-1, -2).contiguous().transpose(-1, -2)  # strided
    torch.library.opcheck(ops.combine.default, (out_partial, lse_partial), test_utils=OPCHECK_UTILS)
    torch.library.opcheck(
        ops.combine.default, (out_partial, lse_partial, torch.float32), test_utils=OPCHECK_UTILS
    )
    out = torch.empty(out_partial.shape[1:], device=device, dtype=torch.float16)
    torch.library.opcheck(
        ops.combine_out.default, (out_partial, lse_partial), {"out": out}, test_utils=OPCHECK_UTILS
    )


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph(device):
    torch._dynamo.reset()

    def merge(out_partial, lse_partial, buffer):
        out, lse = flash_attn_combine(out_partial, lse_partial, out_dtype=torch.bfloat16)
        written, lse2 = flash_attn_combine(out_partial * 2, lse_partial, out=buffer)
        return out.float() + 1, lse + lse2, written

    out_partial, lse_partial = random_partials(4, (2, 6), 3, 32, device)
    compiled = torch.compile(merge, fullgraph=True, backend="aot_eager")
    buffer = torch.empty(2, 6, 3, 32, device=device)
    out, lse, written = compiled(out_partial, lse_partial, buffer)
    ref_out, ref_lse = combine_ref(out_partial, lse_partial)
    torch.testing.assert_close(out.double().cpu(), ref_out + 1, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse.double().cpu(), 2 * ref_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(buffer.double().cpu(), 2 * ref_out, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


# ---------------------------------------------------------------------------
# CUDA against the reference and the CPU path (skipped without a GPU)
# ---------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("partial_dtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [1, 3, 6, 36, 128, 130, 512])
@pytest.mark.parametrize("num_splits", [1, 7, 64, 256])
def test_cuda_matches_cpu(partial_dtype, out_dtype, head_dim, num_splits):
    from cuda_inputs import poison_allocator

    out_partial, lse_partial = random_partials(
        num_splits, (2, 9), 5, head_dim, "cuda", partial_dtype
    )
    lse_partial[num_splits // 2, :, ::3] = -math.inf
    lse_partial[-1, 1] = math.inf
    out_partial[num_splits // 2, :, ::3] = math.nan
    poison_allocator()
    out, lse = flash_attn_combine(out_partial, lse_partial, out_dtype=out_dtype)
    torch.cuda.synchronize()
    assert_close_to_ref(out, lse, *combine_ref(out_partial, lse_partial), out_dtype)
    cpu_out, cpu_lse = flash_attn_combine(out_partial.cpu(), lse_partial.cpu(), out_dtype=out_dtype)
    torch.testing.assert_close(lse.cpu(), cpu_lse, rtol=1e-5, atol=1e-5)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[out_dtype]
    torch.testing.assert_close(out.cpu(), cpu_out, rtol=tol, atol=tol)


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", [8, 64, 100])
def test_cuda_non_contiguous_and_misaligned(head_dim):
    # Views whose rows are not 4-element aligned take the scalar kernel; each must be right.
    base = torch.randn(9, 2, 11, 3, head_dim + 3, device="cuda", dtype=torch.bfloat16)
    for out_partial in (
        base[..., 1 : head_dim + 1],
        base[..., :head_dim],
        base[..., 3:].transpose(2, 3),
    ):
        lse_partial = torch.randn(out_partial.shape[:-1], device="cuda").mul(5)
        ref_out, ref_lse = combine_ref(out_partial, lse_partial)
        out, lse = flash_attn_combine(out_partial, lse_partial)
        assert_close_to_ref(out, lse, ref_out, ref_lse, torch.bfloat16)
        target = torch.full(out_partial.shape[1:-1] + (head_dim + 1,), math.nan, device="cuda")
        result, lse2 = flash_attn_combine(out_partial, lse_partial, out=target[..., 1:])
        assert_close_to_ref(result, lse2, ref_out, ref_lse, torch.float32)


@pytest.mark.cuda
def test_cuda_many_rows():
    # Context-parallel sizes: many rows, a few splits; and the varlen layout.
    out_partial, lse_partial = random_partials(4, (4, 1024), 16, 128, "cuda", torch.bfloat16)
    out, lse = flash_attn_combine(out_partial, lse_partial)
    assert_close_to_ref(out, lse, *combine_ref(out_partial, lse_partial), torch.bfloat16)
    flat_out, flat_lse = flash_attn_combine(out_partial.flatten(1, 2), lse_partial.flatten(1, 2))
    torch.testing.assert_close(flat_out, out.flatten(0, 1), rtol=0, atol=0)
    torch.testing.assert_close(flat_lse, lse.flatten(0, 1), rtol=0, atol=0)


@pytest.mark.cuda
def test_cuda_split_keys_merge_to_full_attention():
    batch, seqlen_q, nheads, d = 2, 33, 4, 128
    q = torch.randn(batch, seqlen_q, nheads, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, 300, nheads, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    bounds = [0, 64, 65, 200, 300]
    parts = [
        flash_attn_func(q, k[:, a:b], v[:, a:b], return_attn_probs=True)
        for a, b in zip(bounds, bounds[1:])
    ]
    # The forward's bf16 outputs as partials, as a caller without an fp32 output has them.
    out, lse = flash_attn_combine(
        torch.stack([p[0] for p in parts]), torch.stack([p[1].transpose(1, 2) for p in parts])
    )
    full_out, full_lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
    torch.testing.assert_close(lse, full_lse.transpose(1, 2), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.float(), full_out.float(), rtol=2e-2, atol=2e-2)
