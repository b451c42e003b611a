"""CUDA tests of the forward ops at head dims 257-512.

These head dims run the SM80 forward kernel's d512 tiles (fwd_tile_config.h:
128 x 64 with 8 warps on sm90, 64 x 64 with 4 on sm80) in two passes over
256-column slabs of V, each recomputing S over all 512 columns; calls whose query rows fit one split-KV block run the split-KV
kernel's d512 instance (plan_fwd_split; its warps split the value dim in
halves, splitkv_tile_config.h). S_dmask is refused by name above 256 (the
backward is tests/test_cuda_bwd_d512.py's). Results are held to the
correctness criterion against float64 attention (tests/reference.py).

Every test here needs a GPU and is skipped with a reason without one.
"""

import pytest
import torch

from flash_attn_cuda import flash_attn_func, flash_attn_varlen_func
from reference import attention_ref, check_close, dropout_keep_mask_batch, varlen_attention_ref

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


def test_fwd_kernels_by_rows():
    """Many query rows run the SM80 kernel's slab passes, decode-like rows the
    split-KV kernel (the profiler names the kernel that ran)."""

    def kernel_names(seqlen_q):
        q, k, v = randn(1, seqlen_q, 8, 512), randn(1, 300, 2, 512), randn(1, 300, 2, 512)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            flash_attn_func(q, k, v, causal=True)
            torch.cuda.synchronize()
        return {event.name for event in prof.events()}

    assert any("flash_fwd_kernel<flash::FwdKernelTraits<512, " in n for n in kernel_names(200))
    assert any("splitkv" in n for n in kernel_names(1))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa4"])
def test_fwd_dropout_matches_reference_mask(causal, heads):
    """Dropout on the SM80 kernel's score-extras variant: the same Philox mask
    as every other head dim and the CPU path (tests/reference.py)."""
    (nheads, nheads_k), p, seed, offset = heads, 0.3, 17, 5
    q = randn(2, 130, nheads, 512)
    k, v = randn(2, 200, nheads_k, 512), randn(2, 200, nheads_k, 512)
    out, lse, _, _ = torch.ops.flash_attn.fwd(
        q, k, v, None, p, 512**-0.5, causal, -1, -1, 0.0, False, seed, offset, None
    )
    keep = dropout_keep_mask_batch(seed, offset, 2, nheads, 130, 200, p).to(DEVICE)
    exact, _ = attention_ref(q, k, v, causal=causal, dropout_p=p, keep_mask=keep)
    same, _ = attention_ref(q, k, v, causal=causal, dropout_p=p, keep_mask=keep, compute_dtype=BF16)
    check_close(out, exact, same, "out")


def test_varlen_fwd_seqused_q():
    """seqused_q: the used rows are attention over the shortened sequences;
    the rest get out 0 and lse +inf (docs/serving.md)."""
    lens_q, lens_k, used_q = [40, 70], [90, 50], [25, 0]
    cu_q = torch.tensor([0] + lens_q, device=DEVICE).cumsum(0).int()
    cu_k = torch.tensor([0] + lens_k, device=DEVICE).cumsum(0).int()
    q, k, v = randn(sum(lens_q), 4, 512), randn(sum(lens_k), 2, 512), randn(sum(lens_k), 2, 512)
    used = torch.tensor(used_q, device=DEVICE, dtype=torch.int32)
    out, lse, _ = flash_attn_varlen_func(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max(lens_q),
        max(lens_k),
        causal=True,
        seqused_q=used,
        return_attn_probs=True,
    )
    for b in range(2):
        rows = slice(int(cu_q[b]), int(cu_q[b]) + used_q[b])
        keys = slice(int(cu_k[b]), int(cu_k[b + 1]))
        if used_q[b]:
            exact, _ = attention_ref(q[None, rows], k[None, keys], v[None, keys], causal=True)
            same, _ = attention_ref(
                q[None, rows], k[None, keys], v[None, keys], causal=True, compute_dtype=BF16
            )
            check_close(out[None, rows], exact, same, "out")
        rest = slice(int(cu_q[b]) + used_q[b], int(cu_q[b + 1]))
        assert torch.equal(out[rest], torch.zeros_like(out[rest]))
        assert torch.isinf(lse[:, rest]).all()


def test_s_dmask_refused():
    """S_dmask (return_attn_probs with dropout) is served up to head dim 256
    on CUDA: refused by name above it; at p = 0 return_attn_probs returns the
    same out and the LSE."""
    q = randn(1, 8, 2, 512)
    k, v = randn(1, 8, 2, 512), randn(1, 8, 2, 512)
    out = flash_attn_func(q, k, v)
    with pytest.raises(RuntimeError, match=r"S_dmask\) is served up to head dim 256"):
        flash_attn_func(q, k, v, dropout_p=0.1, return_attn_probs=True)
    out2, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
    assert torch.equal(out2, out)
    assert lse.shape == (1, 2, 8) and torch.isfinite(lse).all()
