"""num_splits on the varlen forward (FA3's flash_attn_varlen_func(...,
num_splits=)): 1 runs the forward kernels, > 1 splits each sequence's keys
that many ways (the split-KV kernel and an lse merge on CUDA), 0 lets the
plan choose. Speed only: every count meets the correctness criterion against
the float64 reference, on both devices; the CPU path computes the same
result whatever the count.
"""

import math

import pytest
import torch

from cuda_inputs import launched_kernels
from reference import check_close, varlen_attention_ref

import flash_attn_cuda
from flash_attn_cuda import flash_attn_varlen_func

CUDA = pytest.param("cuda", marks=pytest.mark.cuda)


def offsets(lengths, device):
    return torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)


def inputs(device, dtype, lengths_q, lengths_k, heads=(8, 2), head_dim=64, head_dim_v=None):
    g = torch.Generator().manual_seed(sum(lengths_q) * 31 + sum(lengths_k))
    h, hk = heads

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    q = rand(sum(lengths_q), h, head_dim)
    k = rand(sum(lengths_k), hk, head_dim)
    v = rand(sum(lengths_k), hk, head_dim_v or head_dim)
    return q, k, v, offsets(lengths_q, device), offsets(lengths_k, device)


def check_against_reference(out, lse, q, k, v, cu_q, cu_k, max_k, rows=None, **kwargs):
    exact, exact_lse = varlen_attention_ref(q, k, v, cu_q, cu_k, max_seqlen_k=max_k, **kwargs)
    same, _ = varlen_attention_ref(
        q, k, v, cu_q, cu_k, max_seqlen_k=max_k, compute_dtype=q.dtype, **kwargs
    )
    rows = slice(None) if rows is None else rows
    check_close(out[rows].cpu(), exact[rows].cpu(), same[rows].cpu(), "out")
    lse, exact_lse = lse[:, rows].cpu(), exact_lse[:, rows].cpu()
    assert torch.equal(torch.isinf(lse), torch.isinf(exact_lse)), "rows without keys: lse +inf"
    finite = ~torch.isinf(exact_lse)
    if finite.any():
        torch.testing.assert_close(lse[finite].double(), exact_lse[finite], atol=2e-3, rtol=1e-3)


# Decode-like and chunk-like sequences: an empty one, one query row, more
# query rows than keys (causal rows that see no key), long keys (on CUDA,
# long enough to split many ways; shorter on the CPU, whose result does not
# depend on the split, to keep the float64 reference quick).
LENGTHS_Q = [1, 0, 3, 7, 1, 2]
LENGTHS_K_CUDA = [700, 5, 2, 300, 0, 1200]
LENGTHS_K_CPU = [70, 5, 2, 30, 0, 120]


def lengths_k(device):
    return LENGTHS_K_CUDA if device == "cuda" else LENGTHS_K_CPU


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("num_splits", [1, 0, 3, 16])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_matches_reference(device, num_splits, causal):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    keys = lengths_k(device)
    q, k, v, cu_q, cu_k = inputs(device, dtype, LENGTHS_Q, keys)
    out, lse, _ = flash_attn_varlen_func(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max(LENGTHS_Q),
        max(keys),
        causal=causal,
        return_attn_probs=True,
        num_splits=num_splits,
    )
    check_against_reference(out, lse, q, k, v, cu_q, cu_k, max(lengths_k(device)), causal=causal)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_cpu_result_does_not_depend_on_num_splits(device):
    if device == "cuda":
        pytest.skip("the CUDA split changes the summation order (checked against the reference)")
    q, k, v, cu_q, cu_k = inputs(device, torch.bfloat16, LENGTHS_Q, lengths_k(device))
    results = [
        flash_attn_varlen_func(
            q,
            k,
            v,
            cu_q,
            cu_k,
            7,
            max(lengths_k(device)),
            causal=True,
            return_softmax_lse=True,
            num_splits=n,
        )
        for n in (1, 0, 5)
    ]
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("num_splits", [0, 4])
def test_composes_with_score_features(device, num_splits):
    """GQA 4, (batch, nheads) ALiBi, softcap, a local window, sinks, d_v < d_qk."""
    dtype = torch.float32 if device == "cpu" else torch.float16
    q, k, v, cu_q, cu_k = inputs(
        device, dtype, LENGTHS_Q, lengths_k(device), heads=(8, 2), head_dim=128, head_dim_v=64
    )
    batch = len(LENGTHS_Q)
    slopes = (torch.rand(batch, 8) * 0.2).to(device)
    sink = torch.randn(8).to(device)
    kwargs = dict(causal=True, window_size=(100, 0), softcap=5.0)
    out, lse = flash_attn_varlen_func(
        q,
        k,
        v,
        cu_q,
        cu_k,
        7,
        max(lengths_k(device)),
        alibi_slopes=slopes,
        learnable_sink=sink,
        return_softmax_lse=True,
        num_splits=num_splits,
        **kwargs,
    )
    check_against_reference(
        out,
        lse,
        q,
        k,
        v,
        cu_q,
        cu_k,
        max(lengths_k(device)),
        alibi_slopes=slopes,
        learnable_sink=sink,
        **kwargs,
    )


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("page_size", [1, 16])
def test_paged_and_seqused_k(device, page_size):
    """Paged keys (vLLM's call: cu_seqlens_k None, seqused_k), split 3 ways."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v, cu_q, cu_k = inputs(device, dtype, LENGTHS_Q, lengths_k(device))
    used = [min(n, max(lengths_k(device)) - 10) for n in lengths_k(device)]
    pages_per_seq = math.ceil(max(lengths_k(device)) / page_size)
    num_pages = len(lengths_k(device)) * pages_per_seq + 2
    g = torch.Generator().manual_seed(1)
    table = torch.randperm(num_pages, generator=g)[: len(lengths_k(device)) * pages_per_seq]
    table = table.view(len(lengths_k(device)), pages_per_seq).to(torch.int32)
    k_pages = torch.full((num_pages, page_size, *k.shape[1:]), math.nan, dtype=dtype)
    v_pages = torch.full((num_pages, page_size, *v.shape[1:]), math.nan, dtype=dtype)
    for b, n in enumerate(used):
        lo = int(cu_k[b])
        for j in range(n):
            page, row = int(table[b, j // page_size]), j % page_size
            k_pages[page, row] = k[lo + j].cpu()
            v_pages[page, row] = v[lo + j].cpu()
    seqused_k = torch.tensor(used, dtype=torch.int32, device=device)
    out, lse = flash_attn_varlen_func(
        q,
        k_pages.to(device),
        v_pages.to(device),
        cu_q,
        None,
        7,
        max(lengths_k(device)),
        causal=True,
        block_table=table.to(device),
        seqused_k=seqused_k,
        return_softmax_lse=True,
        num_splits=3,
    )
    check_against_reference(
        out, lse, q, k, v, cu_q, cu_k, max(lengths_k(device)), causal=True, seqused_k=used
    )


@pytest.mark.cuda
@pytest.mark.parametrize("batch", [1, 64])
def test_decode_splits_by_default(batch, monkeypatch):
    """vLLM's and flash-attn 2.x's decode call (one query row per sequence,
    paged keys, seqused_k, no cu_seqlens_k) with the default num_splits runs the
    split-KV kernel, as flash-attn 2.x's varlen forward splits it (one query
    row of a 128-row tile per head on the forward kernels took 3.2-10.8x the
    time: PERF_LOG 2026-12-01 "varlen decode"); num_splits=1 keeps the forward
    kernels. Both meet the reference."""
    monkeypatch.delenv("FLASH_ATTN_FWD_KERNEL", raising=False)
    page_size, seqlen_k, heads, head_dim = 16, 1040, (8, 2), 128
    g = torch.Generator().manual_seed(batch)
    q = torch.randn(batch, heads[0], head_dim, generator=g).cuda().bfloat16()
    k = torch.randn(batch * seqlen_k, heads[1], head_dim, generator=g).cuda().bfloat16()
    v = torch.randn_like(k)
    pages_per_seq = seqlen_k // page_size
    perm = torch.randperm(batch * pages_per_seq, generator=g).to(torch.int32)
    table = perm.view(batch, pages_per_seq).cuda()
    k_pages = torch.empty(batch * pages_per_seq, page_size, *k.shape[1:], device="cuda").bfloat16()
    v_pages = torch.empty_like(k_pages)
    # Key j of sequence b: row j % page_size of page table[b, j // page_size].
    k_pages[table.view(-1).long()] = k.view(-1, page_size, *k.shape[1:])
    v_pages[table.view(-1).long()] = v.view(-1, page_size, *v.shape[1:])
    cu_q = offsets([1] * batch, "cuda")
    cu_k = offsets([seqlen_k] * batch, "cuda")
    used = torch.full((batch,), seqlen_k, dtype=torch.int32, device="cuda")

    def call(**kw):
        return flash_attn_varlen_func(
            q,
            k_pages,
            v_pages,
            cu_q,
            None,
            1,
            seqlen_k,
            causal=True,
            block_table=table,
            seqused_k=used,
            return_softmax_lse=True,
            **kw,
        )

    for kw, splits in (({}, True), (dict(num_splits=1), False)):
        names = launched_kernels(lambda kw=kw: call(**kw))
        assert any("splitkv" in n for n in names) == splits, (kw, names)
        assert any("flash_fwd" in n for n in names), (kw, names)
        out, lse = call(**kw)
        check_against_reference(out, lse, q, k, v, cu_q, cu_k, seqlen_k, causal=True)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_out_and_backward(device):
    """out= with a split forward, and the backward from a split forward's lse."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v, cu_q, cu_k = inputs(device, dtype, [2, 5, 1], [300, 40, 900])
    out_buf = torch.full(q.shape, math.nan, dtype=dtype, device=device)
    got = flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, 5, 900, causal=True, out=out_buf, num_splits=4
    )
    assert got is out_buf
    check_against_reference(
        out_buf,
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 900, causal=True, return_softmax_lse=True)[
            1
        ],
        q,
        k,
        v,
        cu_q,
        cu_k,
        900,
        causal=True,
    )
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    grads = []
    for n in (1, 4):
        for t in leaves:
            t.grad = None
        flash_attn_varlen_func(
            *leaves, cu_q, cu_k, 5, 900, causal=True, num_splits=n
        ).sum().backward()
        grads.append([t.grad.clone() for t in leaves])
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("num_splits", [0, 3])
def test_rows_outside_every_sequence(device, num_splits, monkeypatch):
    """q rows before cu_seqlens_q[0] and from cu_seqlens_q[batch] on: a split
    run gives them out 0 and lse +inf, as the CPU does, with a sink too (the
    combine fills them; no partial of theirs is written or read), and the
    rows of the sequences match the reference. One query row per sequence
    and 0 splits: the decode-like call that splits by default (a forced
    forward kernel would not split, and leaves those rows undefined, as the
    op contract allows)."""
    monkeypatch.delenv("FLASH_ATTN_FWD_KERNEL", raising=False)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    lengths_k = [700, 0, 1200] if device == "cuda" else [70, 0, 120]
    g = torch.Generator().manual_seed(7)
    q = torch.randn(9, 8, 64, generator=g).to(device=device, dtype=dtype)
    k, v = (
        torch.randn(sum(lengths_k), 2, 64, generator=g).to(device=device, dtype=dtype)
        for _ in range(2)
    )
    cu_q = torch.tensor([2, 3, 4, 5], dtype=torch.int32, device=device)
    cu_k = offsets(lengths_k, device)
    sink = torch.randn(8, generator=g).to(device)
    out_buf = torch.full(q.shape, math.nan, dtype=dtype, device=device)
    _, lse, _ = flash_attn_varlen_func(
        q,
        k,
        v,
        cu_q,
        cu_k,
        1,
        max(lengths_k),
        out=out_buf,
        learnable_sink=sink,
        return_attn_probs=True,
        num_splits=num_splits,
    )
    outside = [0, 1, 5, 6, 7, 8]
    assert torch.equal(out_buf[outside].float().cpu(), torch.zeros(6, 8, 64)), "out 0 outside"
    assert torch.isposinf(lse[:, outside]).all(), "lse +inf outside"
    check_against_reference(
        out_buf, lse, q, k, v, cu_q, cu_k, max(lengths_k), rows=slice(2, 5), learnable_sink=sink
    )


def test_bad_num_splits_names_the_argument():
    q, k, v, cu_q, cu_k = inputs("cpu", torch.float32, [1, 2], [3, 4])
    for bad in (-1, 129):
        with pytest.raises(RuntimeError, match=rf"num_splits must be in \[0, 128\] .*got {bad}"):
            flash_attn_varlen_func(q, k, v, cu_q, cu_k, 2, 4, num_splits=bad)


def test_compiles(device="cpu"):
    # The CUDA kernels take half precision only.
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v, cu_q, cu_k = inputs(device, dtype, LENGTHS_Q, lengths_k(device))

    def step(q, k, v, cu_q, cu_k):
        return flash_attn_varlen_func(
            q,
            k,
            v,
            cu_q,
            cu_k,
            7,
            max(lengths_k(device)),
            causal=True,
            num_splits=0,
            return_softmax_lse=True,
        )

    eager = step(q, k, v, cu_q, cu_k)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)(q, k, v, cu_q, cu_k)
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1])


@pytest.mark.cuda
def test_cuda_compiles():
    test_compiles("cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("num_splits", [1, 3])
def test_bad_index_values_raise_the_same_message(num_splits):
    """The split run reads the sequences as the forward kernels do: a bad
    cu_seqlens_k value gives the same message, and no access outside k."""
    q, k, v, cu_q, cu_k = inputs("cuda", torch.bfloat16, [1, 2], [300, 40])
    bad = cu_k.clone()
    bad[2] = 10_000
    previous = flash_attn_cuda.set_sync_index_checks(True)
    try:
        with pytest.raises(
            RuntimeError, match=r"cu_seqlens_k\[2\] = 10000 exceeds the number of rows"
        ):
            flash_attn_varlen_func(q, k, v, cu_q, bad, 2, 10_000, num_splits=num_splits)
        bad_q = cu_q.clone()
        bad_q[1] = 2
        bad_q[2] = 1
        with pytest.raises(RuntimeError, match=r"cu_seqlens_q must be non-decreasing"):
            flash_attn_varlen_func(q, k, v, bad_q, cu_k, 2, 300, num_splits=num_splits)
    finally:
        flash_attn_cuda.set_sync_index_checks(previous)


@pytest.mark.cuda
def test_paged_bad_index_values_raise_the_same_message():
    """vLLM's decode call (paged keys, seqused_k, no cu_seqlens_k): the split
    run (num_splits 0 splits such a call) reports a bad table entry or a
    seqused_k past the table's rows with the forward kernels' message
    (num_splits 1), whichever kernel met the value first, and reads nothing
    outside the pool."""
    batch, page_size, pages = 2, 16, 8
    q = torch.randn(batch, 8, 128, device="cuda", dtype=torch.bfloat16)
    k_cache = torch.randn(batch * pages + 1, page_size, 2, 128, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(batch * pages, device="cuda", dtype=torch.int32).view(batch, pages)
    used = torch.tensor([100, 37], dtype=torch.int32, device="cuda")
    cu_q = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    bad_table = table.clone()
    bad_table[1, 2] = 10_000
    bad_used = used.clone()
    bad_used[0] = pages * page_size + 5

    def message(table, used, num_splits):
        with pytest.raises(RuntimeError) as error:
            flash_attn_varlen_func(
                q,
                k_cache,
                v_cache,
                cu_q,
                None,
                1,
                pages * page_size,
                causal=True,
                seqused_k=used,
                block_table=table,
                num_splits=num_splits,
            )
        return str(error.value)

    previous = flash_attn_cuda.set_sync_index_checks(True)
    try:
        for args in ((bad_table, used), (table, bad_used)):
            assert message(*args, 0) == message(*args, 1)
        assert "10000" in message(bad_table, used, 0)
        assert "seqused_k" in message(table, bad_used, 0)
    finally:
        flash_attn_cuda.set_sync_index_checks(previous)
