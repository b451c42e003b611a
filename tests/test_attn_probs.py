"""S_dmask (return_softmax / return_attn_probs) in flash-attn 2.x's convention.

Entries are softmax numerators relative to the running row max over the key
blocks processed so far (blocks of _get_block_size_n keys from key 0, visited
from the last to the first), negated where dropout dropped them, 0 where
masked. Every check reads S_dmask the way flash-attn's own tests do
(tests/s_dmask.py restates that reading): the probabilities recovered from it
must be the float64 reference softmax, and the dropout pattern read from the
sign must be the one the kernel applied (the output computed with it must be
the kernel's output). CPU cases run everywhere; the same checks run on CUDA
(marked `cuda`, skipped without a GPU).
"""

import inspect
import math

import pytest
import torch

import reference as ref
import s_dmask

import flash_attn_cuda
from flash_attn_cuda import _get_block_size_n, flash_attn_func, flash_attn_varlen_func

ops = torch.ops.flash_attn

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def device_dtype_params():
    return [
        pytest.param("cpu", torch.float32, id="cpu-fp32"),
        pytest.param("cpu", torch.bfloat16, id="cpu-bf16"),
        pytest.param("cpu", torch.float16, id="cpu-fp16"),
        pytest.param("cuda", torch.float16, id="cuda-fp16", marks=pytest.mark.cuda),
        pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=pytest.mark.cuda),
    ]


def block_n(device, head_dim, dropout_p, causal):
    return _get_block_size_n(torch.device(device), head_dim, dropout_p > 0, causal)


def make_alibi(kind, batch, nheads, device):
    if kind is None:
        return None
    shape = (nheads,) if kind == "head" else (batch, nheads)
    return (torch.rand(*shape, dtype=torch.float32) * 0.5 + 0.05).to(device)


def check_output_with_pattern(out, q, k, v, keep, dropout_p, **ref_kwargs):
    """The kernel's output is attention with the dropout pattern read from
    S_dmask: the pattern in S_dmask is the one the kernel applied."""
    mask = keep if dropout_p > 0 else None
    exact, _ = ref.attention_ref(q, k, v, dropout_p=dropout_p, keep_mask=mask, **ref_kwargs)
    if out.dtype == torch.float32:
        torch.testing.assert_close(out.double(), exact, atol=2e-5, rtol=2e-5)
    else:
        same, _ = ref.attention_ref(
            q, k, v, dropout_p=dropout_p, keep_mask=mask, compute_dtype=out.dtype, **ref_kwargs
        )
        ref.assert_within_criterion(out, exact, same, factor=2.0)


# (batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, options)
FIXED_CASES = [
    (2, 17, 113, 4, 4, 32, {}),
    (2, 113, 17, 4, 2, 64, dict(causal=True)),  # seqlen_q > seqlen_k: rows see no key
    (1, 129, 129, 4, 1, 40, dict(causal=True)),  # MQA
    (2, 113, 129, 6, 2, 64, dict(window=(40, 7))),
    (1, 129, 113, 2, 2, 32, dict(window=(-1, 20))),
    (1, 113, 129, 2, 2, 32, dict(causal=True, window=(50, -1))),
    (2, 65, 200, 4, 4, 32, dict(softcap=5.0, scale=0.3)),
    (2, 97, 131, 4, 2, 32, dict(alibi="head", causal=True)),
    (1, 60, 190, 4, 1, 64, dict(alibi="batch_head", softcap=4.0, window=(70, 30))),
    (1, 1, 257, 2, 2, 64, {}),
    (1, 33, 150, 2, 2, 32, dict(scale=-0.2, causal=True)),
]


def _case_id(case):
    batch, sq, sk, h, hk, d, opts = case
    extra = "-".join(f"{key}{value}" for key, value in opts.items())
    return f"b{batch}-q{sq}-k{sk}-h{h}x{hk}-d{d}" + (f"-{extra}" if extra else "")


@pytest.mark.parametrize("dropout_p", [0.0, 0.17])
@pytest.mark.parametrize("device,dtype", device_dtype_params())
@pytest.mark.parametrize("case", FIXED_CASES, ids=_case_id)
def test_fwd_s_dmask(case, device, dtype, dropout_p):
    batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, opts = case
    opts = dict(opts)
    causal = opts.pop("causal", False)
    window = opts.pop("window", (-1, -1))
    softcap = opts.pop("softcap", 0.0)
    scale = opts.pop("scale", 1.0 / math.sqrt(head_dim))
    alibi = make_alibi(opts.pop("alibi", None), batch, nheads, device)
    assert not opts
    q = torch.randn(batch, seqlen_q, nheads, head_dim, dtype=dtype, device=device)
    k = torch.randn(batch, seqlen_k, nheads_k, head_dim, dtype=dtype, device=device)
    v = torch.randn(batch, seqlen_k, nheads_k, head_dim, dtype=dtype, device=device)
    seed, offset = 20261126, 12
    out, lse, probs, _ = ops.fwd(
        q,
        k,
        v,
        alibi,
        dropout_p,
        scale,
        causal,
        window[0],
        window[1],
        softcap,
        True,
        seed,
        offset,
        None,
    )
    assert probs.shape == (batch, nheads, seqlen_q, seqlen_k) and probs.dtype == dtype

    left, right = ref.normalize_window(causal, window[0], window[1], seqlen_k)
    scores = s_dmask.final_scores(
        q.cpu(),
        k.cpu(),
        softmax_scale=scale,
        window=(left, right),
        softcap=softcap,
        alibi_slopes=None if alibi is None else alibi.cpu(),
    )
    keep = None
    if dropout_p > 0:
        keep = ref.dropout_keep_mask_batch(
            seed, offset, batch, nheads, seqlen_q, seqlen_k, dropout_p
        )
    width = block_n(device, head_dim, dropout_p, causal)
    probs_cpu = s_dmask.crop(probs.cpu(), seqlen_q, seqlen_k)
    kept = s_dmask.check_entry(probs_cpu, scores, width, keep)
    torch.testing.assert_close(lse.cpu().double(), s_dmask.row_lse(scores), atol=1e-4, rtol=1e-4)
    check_output_with_pattern(
        out,
        q,
        k,
        v,
        kept.to(device),
        dropout_p,
        softmax_scale=scale,
        causal=causal,
        window_size=window,
        softcap=softcap,
        alibi_slopes=alibi,
    )


# (lengths_q, lengths_k, nheads, nheads_k, head_dim, options)
VARLEN_CASES = [
    ([17, 0, 113, 129], [113, 5, 17, 129], 4, 2, 32, dict(causal=True)),
    ([1, 40, 129], [257, 64, 65], 2, 1, 64, dict(window=(30, 10))),
    ([50, 7], [130, 70], 4, 4, 32, dict(alibi="batch_head", softcap=3.0)),
]


@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
@pytest.mark.parametrize("device,dtype", device_dtype_params())
@pytest.mark.parametrize("case", VARLEN_CASES)
def test_varlen_fwd_s_dmask(case, device, dtype, dropout_p):
    lengths_q, lengths_k, nheads, nheads_k, head_dim, opts = case
    opts = dict(opts)
    causal = opts.pop("causal", False)
    window = opts.pop("window", (-1, -1))
    softcap = opts.pop("softcap", 0.0)
    batch = len(lengths_q)
    alibi = make_alibi(opts.pop("alibi", None), batch, nheads, device)
    cu_q = torch.tensor([0] + lengths_q, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_k = torch.tensor([0] + lengths_k, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    max_q, max_k = max(lengths_q), max(lengths_k)
    q = torch.randn(sum(lengths_q), nheads, head_dim, dtype=dtype, device=device)
    k = torch.randn(sum(lengths_k), nheads_k, head_dim, dtype=dtype, device=device)
    v = torch.randn_like(k)
    scale = 1.0 / math.sqrt(head_dim)
    seed, offset = 77, 1 << 33
    out, _, probs, _ = ops.varlen_fwd(
        q,
        k,
        v,
        cu_q.to(device),
        cu_k.to(device),
        None,
        alibi,
        max_q,
        max_k,
        dropout_p,
        scale,
        causal,
        window[0],
        window[1],
        softcap,
        True,
        seed,
        offset,
        None,
    )
    assert probs.shape == (batch, nheads, max_q, max_k) and probs.dtype == dtype
    probs = probs.cpu()

    left, right = ref.normalize_window(causal, window[0], window[1], max_k)
    keeps = (
        ref.dropout_keep_masks_varlen(seed, offset, cu_q, cu_k, nheads, dropout_p)
        if dropout_p > 0
        else None
    )
    width = block_n(device, head_dim, dropout_p, causal)
    kept_masks = []
    for b in range(batch):
        qb = q[cu_q[b] : cu_q[b + 1]].cpu()[None]
        kb = k[cu_k[b] : cu_k[b + 1]].cpu()[None]
        slopes = None
        if alibi is not None:
            slopes = alibi[b].cpu()
        scores = s_dmask.final_scores(
            qb, kb, softmax_scale=scale, window=(left, right), softcap=softcap, alibi_slopes=slopes
        )[0]
        lq, lk = lengths_q[b], lengths_k[b]
        # Past the sequence's own lengths, S_dmask is padding: +0.
        padding = torch.cat([probs[b, :, lq:].flatten(), probs[b, :, :, lk:].flatten()])
        assert torch.all(padding == 0) and not torch.any(torch.signbit(padding))
        kept = s_dmask.check_entry(
            probs[b, :, :lq, :lk],
            scores,
            width,
            None if keeps is None else keeps[b],
            name=f"sequence {b}",
        )
        kept_masks.append(kept.to(device))

    exact, _ = ref.varlen_attention_ref(
        q,
        k,
        v,
        cu_q,
        cu_k,
        causal=causal,
        window_size=window,
        softcap=softcap,
        alibi_slopes=alibi,
        dropout_p=dropout_p,
        keep_masks=kept_masks if dropout_p > 0 else None,
    )
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), exact, atol=2e-5, rtol=2e-5)
    else:
        same, _ = ref.varlen_attention_ref(
            q,
            k,
            v,
            cu_q,
            cu_k,
            causal=causal,
            window_size=window,
            softcap=softcap,
            alibi_slopes=alibi,
            dropout_p=dropout_p,
            keep_masks=kept_masks if dropout_p > 0 else None,
            compute_dtype=dtype,
        )
        ref.assert_within_criterion(out, exact, same, factor=2.0)


@pytest.mark.parametrize("device,dtype", device_dtype_params())
def test_block_width_is_the_one_the_kernels_use(device, dtype):
    """Scores that fall along the keys: each key block's own max is the
    running max there, so every block starts with a numerator of exactly 1.
    Any other block width than _get_block_size_n's would fail this."""
    head_dim, seqlen_k = 32, 300
    width = block_n(device, head_dim, 0.1, False)
    q = torch.zeros(1, 3, 2, head_dim, dtype=dtype)
    q[..., 0] = 1.0
    k = torch.randn(1, seqlen_k, 2, head_dim, dtype=dtype)
    k[:, :, :, 0] = -0.05 * torch.arange(seqlen_k, dtype=torch.float32)[None, :, None]
    v = torch.randn_like(k)
    _, _, probs, _ = ops.fwd(
        q.to(device),
        k.to(device),
        v.to(device),
        None,
        0.1,
        1.0,
        False,
        -1,
        -1,
        0.0,
        True,
        3,
        4,
        None,
    )
    probs = probs.cpu()
    starts = probs[..., ::width].abs()
    assert torch.all(starts == 1), starts
    scores = s_dmask.final_scores(q, k, softmax_scale=1.0)
    s_dmask.check_entry(
        probs[0], scores[0], width, ref.dropout_keep_mask_batch(3, 4, 1, 2, 3, seqlen_k, 0.1)[0]
    )
    # A single block (exp(s - row max)) would differ from the second block on.
    row_max = torch.exp(scores - scores.amax(dim=-1, keepdim=True))[0]
    assert not torch.allclose(probs.abs().double()[0, ..., width:], row_max[..., width:])


def test_get_block_size_n_signature_and_exports():
    import flash_attn_cuda.interface as interface

    assert flash_attn_cuda._get_block_size_n is interface._get_block_size_n
    assert "_get_block_size_n" in flash_attn_cuda.__all__
    params = list(inspect.signature(_get_block_size_n).parameters)
    assert params == ["device", "head_dim", "is_dropout", "is_causal"]
    widths = {
        _get_block_size_n(device, head_dim, is_dropout, is_causal)
        for device in ("cpu", torch.device("cpu"), torch.device("cuda", 0))
        for head_dim in (8, 32, 40, 64, 96, 128, 192, 256)
        for is_dropout in (False, True)
        for is_causal in (False, True)
    }
    # One width everywhere: CPU and CUDA kernels write the same convention.
    assert len(widths) == 1 and isinstance(widths.pop(), int)
    # The head dims each device serves (common/head_dim_bounds.h).
    assert _get_block_size_n("cpu", 1024, False, False) == _get_block_size_n("cuda", 256, 0, 0)
    with pytest.raises(ValueError, match=r"head_dim must be in \[1, 256\], got 257"):
        _get_block_size_n(torch.device("cuda", 0), 257, False, False)
    with pytest.raises(ValueError, match=r"head_dim must be in \[1, 1024\], got 1025"):
        _get_block_size_n("cpu", 1025, False, False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_func_probs_like_flash_attn_tests(device, causal):
    """The flow of flash-attn's own tests through the public API: read the
    pattern from the sign, recover P with _get_block_size_n, compare the
    output computed with that pattern."""
    dtype = torch.bfloat16
    dropout_p, batch, seqlen_q, seqlen_k, nheads, head_dim = 0.2, 2, 113, 203, 4, 36
    q = torch.randn(batch, seqlen_q, nheads, head_dim, dtype=dtype, device=device)
    k = torch.randn(batch, seqlen_k, nheads, head_dim, dtype=dtype, device=device)
    v = torch.randn_like(k)
    window = (50, 10)
    out, lse, probs = flash_attn_func(
        q, k, v, dropout_p, causal=causal, window_size=window, return_attn_probs=True
    )
    left, right = ref.normalize_window(causal, window[0], window[1], seqlen_k)
    scores = s_dmask.final_scores(q.cpu(), k.cpu(), window=(left, right))
    converted = s_dmask.crop(probs.cpu(), seqlen_q, seqlen_k).masked_fill(scores == -math.inf, 0)
    keep = converted >= 0
    width = _get_block_size_n(q.device, head_dim, True, causal)
    recovered = s_dmask.probs_from_numerators(converted, scores, width)
    torch.testing.assert_close(
        recovered, s_dmask.reference_probs(scores), **s_dmask.tolerance(dtype)
    )
    visible = scores > -math.inf
    dropped = (~keep & visible).sum().item() / visible.sum().item()
    assert abs(dropped - dropout_p) < 0.02
    check_output_with_pattern(
        out, q, k, v, keep.to(device), dropout_p, causal=causal, window_size=window
    )


@pytest.mark.parametrize("device", DEVICES)
def test_flash_attn_varlen_func_probs(device):
    dtype, dropout_p, nheads, head_dim = torch.float16, 0.3, 2, 64
    lengths = [70, 3, 129]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32).to(device)
    q = torch.randn(sum(lengths), nheads, head_dim, dtype=dtype, device=device)
    k, v = torch.randn_like(q), torch.randn_like(q)
    out, _, probs = flash_attn_varlen_func(
        q, k, v, cu, cu, 129, 129, dropout_p, causal=True, return_attn_probs=True
    )
    assert probs.shape == (3, nheads, 129, 129)
    width = _get_block_size_n(q.device, head_dim, True, True)
    kept_masks = []
    for b, n in enumerate(lengths):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        scores = s_dmask.final_scores(q[rows].cpu()[None], k[rows].cpu()[None], window=(-1, 0))[0]
        kept = s_dmask.check_entry(probs[b, :, :n, :n].cpu(), scores, width)
        kept_masks.append(kept.to(device))
    exact, _ = ref.varlen_attention_ref(
        q, k, v, cu, cu, causal=True, dropout_p=dropout_p, keep_masks=kept_masks
    )
    same, _ = ref.varlen_attention_ref(
        q,
        k,
        v,
        cu,
        cu,
        causal=True,
        dropout_p=dropout_p,
        keep_masks=kept_masks,
        compute_dtype=dtype,
    )
    ref.assert_within_criterion(out, exact, same, factor=2.0)
