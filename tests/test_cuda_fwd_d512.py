"""CUDA tests of the forward ops at head dims 257-512.

These head dims have no forward kernel of their own: the forward runs on the
split-KV kernel's d512 instance (plan_fwd_split; its warps split the value
dim in halves, splitkv_tile_config.h). Its dropout, S_dmask and seqused_q are
refused by name (the backward is tests/test_cuda_bwd_d512.py's). Results are
held to the correctness criterion against float64 attention
(tests/reference.py).

Every test here needs a GPU and is skipped with a reason without one.
"""

import pytest
import torch

from flash_attn_cuda import flash_attn_func, flash_attn_varlen_func
from reference import attention_ref, check_close, varlen_attention_ref

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
BF16 = torch.bfloat16


def randn(*shape, dtype=BF16):
    return torch.randn(*shape, device=DEVICE, dtype=dtype)


def check_against_reference(out, q, k, v, **kwargs):
    exact, _ = attention_ref(q, k, v, **kwargs)
    same, _ = attention_ref(q, k, v, compute_dtype=q.dtype, **kwargs)
    check_close(out, exact, same, "out")


@pytest.mark.parametrize("dtype", [BF16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(8, 8), (16, 4), (6, 1)], ids=["mha", "gqa4", "mqa6"])
@pytest.mark.parametrize("seqlens", [(1, 700), (77, 77), (300, 129), (1000, 1000)])
def test_fwd_matches_reference(dtype, causal, heads, seqlens):
    """Query rows of a kv head: seqlen_q x group, 1 to 6,000, in 16-row blocks."""
    (seqlen_q, seqlen_k), (nheads, nheads_k) = seqlens, heads
    q = randn(2, seqlen_q, nheads, 512, dtype=dtype)
    k = randn(2, seqlen_k, nheads_k, 512, dtype=dtype)
    v = randn(2, seqlen_k, nheads_k, 512, dtype=dtype)
    out = flash_attn_func(q, k, v, causal=causal)
    assert out.shape == (2, seqlen_q, nheads, 512)
    check_against_reference(out, q, k, v, causal=causal)


@pytest.mark.parametrize("d_qk,d_v", [(264, 264), (320, 128), (512, 256), (512, 384), (504, 504)])
def test_fwd_head_dims_and_value_dims(d_qk, d_v):
    q, k, v = randn(2, 90, 8, d_qk), randn(2, 200, 2, d_qk), randn(2, 200, 2, d_v)
    out = flash_attn_func(q, k, v, causal=True)
    assert out.shape == (2, 90, 8, d_v)
    check_against_reference(out, q, k, v, causal=True)


@pytest.mark.parametrize("feature", ["window", "softcap", "alibi", "sink"])
def test_fwd_score_features(feature):
    q, k, v = randn(2, 150, 8, 512), randn(2, 400, 2, 512), randn(2, 400, 2, 512)
    kwargs, ref_kwargs = {}, {}
    if feature == "window":
        kwargs = ref_kwargs = dict(window_size=(64, 8))
    elif feature == "softcap":
        kwargs = ref_kwargs = dict(softcap=20.0)
    elif feature == "alibi":
        slopes = torch.rand(8, device=DEVICE, dtype=torch.float32)
        kwargs = ref_kwargs = dict(alibi_slopes=slopes)
    else:
        sink = torch.randn(8, device=DEVICE, dtype=torch.float32)
        kwargs = ref_kwargs = dict(learnable_sink=sink)
    out = flash_attn_func(q, k, v, causal=True, **kwargs)
    check_against_reference(out, q, k, v, causal=True, **ref_kwargs)


@pytest.mark.parametrize("num_splits", [0, 1, 3])
@pytest.mark.parametrize("page_size", [None, 16, 64])
@pytest.mark.parametrize(
    "lens_q, lens_k",
    [([5, 0, 130, 40], [64, 30, 200, 40]), ([5, 0, 7, 2], [16, 9, 1, 0])],
    ids=["long", "keys_within_one_block"],
)
def test_varlen_fwd_matches_reference(num_splits, page_size, lens_q, lens_k):
    """Varlen (an empty sequence among them), paged or not, any split count (a
    varlen run takes two splits at least: the combine writes every row, even
    where every sequence's keys fit one key block and the second split has
    none)."""
    cu_q = torch.tensor([0] + lens_q, device=DEVICE).cumsum(0).int()
    cu_k = torch.tensor([0] + lens_k, device=DEVICE).cumsum(0).int()
    q, k, v = randn(sum(lens_q), 8, 512), randn(sum(lens_k), 2, 512), randn(sum(lens_k), 2, 512)
    kwargs = dict(max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k), causal=True)
    table = None
    k_in, v_in = k, v
    if page_size is not None:
        # Each sequence's keys in its own pages, at random places in the pool.
        pages = [-(-n // page_size) for n in lens_k]
        num_pages = sum(pages)
        order = torch.randperm(num_pages, device=DEVICE)
        k_in = torch.zeros(num_pages, page_size, 2, 512, device=DEVICE, dtype=BF16)
        v_in = torch.zeros_like(k_in)
        table = torch.zeros(len(lens_k), max(pages), device=DEVICE, dtype=torch.int32)
        used = 0
        for b, n in enumerate(lens_k):
            for p in range(pages[b]):
                page = order[used + p]
                rows = slice(
                    int(cu_k[b]) + p * page_size,
                    min(int(cu_k[b]) + n, int(cu_k[b]) + (p + 1) * page_size),
                )
                count = rows.stop - rows.start
                k_in[page, :count] = k[rows]
                v_in[page, :count] = v[rows]
                table[b, p] = page
            used += pages[b]
    out = flash_attn_varlen_func(
        q, k_in, v_in, cu_q, cu_k, block_table=table, num_splits=num_splits, **kwargs
    )
    exact, _ = varlen_attention_ref(q, k, v, cu_q, cu_k, causal=True)
    same, _ = varlen_attention_ref(q, k, v, cu_q, cu_k, causal=True, compute_dtype=BF16)
    check_close(out, exact, same, "out")


def test_unserved_features_refused():
    """Dropout (and with it S_dmask) and seqused_q are not served by the
    forward above head dim 256 on CUDA: each is refused by name."""
    q = randn(1, 8, 2, 512)
    k, v = randn(1, 8, 2, 512), randn(1, 8, 2, 512)
    out = flash_attn_func(q, k, v)
    with pytest.raises(RuntimeError, match=r"does not serve dropout_p > 0"):
        flash_attn_func(q.detach(), k, v, dropout_p=0.1)
    # flash-attn draws S_dmask only with dropout (refused above), so
    # return_attn_probs at p = 0 is served: the same out, and the LSE.
    out2, lse, _ = flash_attn_func(q.detach(), k, v, return_attn_probs=True)
    assert torch.equal(out2, out)
    assert lse.shape == (1, 2, 8) and torch.isfinite(lse).all()
    cu = torch.tensor([0, 8], device=DEVICE, dtype=torch.int32)
    used = torch.tensor([4], device=DEVICE, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"does not serve seqused_q"):
        flash_attn_varlen_func(q.detach()[0], k[0], v[0], cu, cu, 8, 8, seqused_q=used)
