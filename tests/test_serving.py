"""What serving engines rely on: seqused_k, out=, unused cache rows, batch invariance.

* seqused_k on the varlen ops: sequence b uses only its first seqused_k[b] keys.
  Forward and backward are held to the float64 reference of the truncated
  sequences; paged varlen takes seqused_k as each sequence's keys.
* out= on flash_attn_func, flash_attn_varlen_func and flash_attn_with_kvcache:
  the caller's tensor is written and returned, equal to the allocating call.
* Keys past a sequence's used length are never read into a result: NaN and Inf
  planted past seqused_k, past each varlen sequence's end, past cache_seqlens in
  the last page and in unused pages must not change the output (FA3's issue 1745).
* Batch invariance: with num_splits=1 (flash_attn_with_kvcache) and for
  flash_attn_varlen_func, a sequence's rows are bitwise the same alone and
  inside batches of other sequences. On CUDA the varlen forward is invariant
  for a fixed kernel choice (FLASH_ATTN_FWD_KERNEL); the automatic choice
  picks the kernel by the batch's shape (docs/serving.md).

Every test runs on the CPU and, where a GPU is present, on CUDA.
"""

import math

import pytest
import torch

import reference as ref

from flash_attn_cuda import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
ops = torch.ops.flash_attn

# Pages of any row count: 16 (vLLM's multiples), 5 (a page boundary inside a
# thread's rows of a tile) and 1 (SGLang's default).
PAGE_SIZE = 16
PAGE_SIZES = [1, 5, 16]


def dtype_on(device):
    return torch.float32 if device == "cpu" else torch.bfloat16


def cu_seqlens(lengths, device):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def int32(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


def plant_non_finite(t, rows):
    """NaN in half of `rows` of t (dim 0) and +-Inf in the rest, in place."""
    rows = torch.as_tensor(rows, dtype=torch.long)
    if rows.numel() == 0:
        return t
    values = torch.tensor([float("nan"), float("inf"), float("-inf")], dtype=t.dtype)
    fill = values[torch.arange(rows.numel()) % 3].to(t.device)
    t[rows.to(t.device)] = fill.view(-1, *([1] * (t.dim() - 1))).expand(-1, *t.shape[1:])
    return t


def fill_non_finite(t):
    """NaN / Inf in every row of t (dims 0 and 1 taken together), in place."""
    if t.numel():
        flat = t.view(-1, *t.shape[2:])
        plant_non_finite(flat, list(range(flat.shape[0])))
    return t


def fill_random(t):
    return t.normal_()


def check_output(out, exact, same, name="out", factor=2.0, atol=1e-5):
    assert torch.isfinite(out).all(), f"{name} is not finite"
    ref.assert_within_criterion(out, exact, same, factor=factor, atol=atol, name=name)


# ----------------------------------------------------------------------------- seqused_k

# (lengths_q, lengths_k, seqused_k): empty, full, partial, zero used, one key.
SEQUSED_CASE = ([5, 1, 17, 0, 33, 40], [9, 14, 40, 3, 33, 7], [4, 0, 40, 3, 20, 1])
HEADS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (4, 1)}


def truncated(k, v, cu_k, used):
    """k / v rows and offsets of the used keys only (what the reference sees)."""
    index = torch.cat(
        [torch.arange(int(cu_k[b]), int(cu_k[b]) + int(n)) for b, n in enumerate(used.tolist())]
        + [torch.zeros(0, dtype=torch.long)]
    )
    index = index.to(k.device)
    return k.index_select(0, index), v.index_select(0, index), cu_seqlens(used.tolist(), k.device)


def unused_rows(cu_k, used):
    return [
        r for b, n in enumerate(used.tolist()) for r in range(int(cu_k[b]) + n, int(cu_k[b + 1]))
    ]


def seqused_inputs(device, nheads, nheads_k, head_dim=64):
    lens_q, lens_k, used = SEQUSED_CASE
    dtype = dtype_on(device)
    cu_q, cu_k = cu_seqlens(lens_q, device), cu_seqlens(lens_k, device)
    q = torch.randn(sum(lens_q), nheads, head_dim, device=device, dtype=dtype)
    k = torch.randn(sum(lens_k), nheads_k, head_dim, device=device, dtype=dtype)
    v = torch.randn(sum(lens_k), nheads_k, head_dim, device=device, dtype=dtype)
    return q, k, v, cu_q, cu_k, int32(used, device), max(lens_q), max(lens_k)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", list(HEADS))
def test_seqused_k_forward_backward_match_truncated_reference(device, causal, heads):
    nheads, nheads_k = HEADS[heads]
    q, k, v, cu_q, cu_k, used, max_q, max_k = seqused_inputs(device, nheads, nheads_k)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flash_attn_varlen_func(*leaves, cu_q, cu_k, max_q, max_k, causal=causal, seqused_k=used)
    dout = torch.randn_like(out)
    out.backward(dout)

    def reference(compute_dtype):
        ref_leaves = [t.detach().to(compute_dtype).requires_grad_() for t in (q, k, v)]
        k_used, v_used, cu_used = truncated(ref_leaves[1], ref_leaves[2], cu_k, used)
        # The window normalises against the max_seqlen_k the call passed.
        out_ref, lse_ref = ref.varlen_attention_ref(
            ref_leaves[0],
            k_used,
            v_used,
            cu_q,
            cu_used,
            max_seqlen_k=max_k,
            causal=causal,
            compute_dtype=compute_dtype,
        )
        out_ref.backward(dout.to(compute_dtype))
        return out_ref.detach(), lse_ref, [t.grad for t in ref_leaves]

    exact, lse_exact, grads_exact = reference(torch.float64)
    same, _, grads_same = reference(q.dtype)
    check_output(out, exact, same)
    _, lse, _ = flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, seqused_k=used, return_attn_probs=True
    )
    inf = torch.isinf(lse_exact)
    assert torch.equal(torch.isinf(lse), inf)
    torch.testing.assert_close(lse[~inf].double(), lse_exact[~inf], atol=2e-2, rtol=0)
    for name, leaf, exact_g, same_g in zip(("dq", "dk", "dv"), leaves, grads_exact, grads_same):
        check_output(leaf.grad, exact_g, same_g, name=name, factor=3.0, atol=5e-5)
    # Keys past seqused_k get no gradient at all.
    rows = unused_rows(cu_k, used)
    assert (leaves[1].grad[rows] == 0).all() and (leaves[2].grad[rows] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_seqused_k_never_reads_unused_rows(device, causal):
    q, k, v, cu_q, cu_k, used, max_q, max_k = seqused_inputs(device, 8, 2)
    rows = unused_rows(cu_k, used)
    k_bad, v_bad = plant_non_finite(k.clone(), rows), plant_non_finite(v.clone(), rows)
    dout = torch.randn_like(q)
    results = []
    for kk, vv in ((k, v), (k_bad, v_bad)):
        leaves = [t.clone().requires_grad_() for t in (q, kk, vv)]
        # deterministic: the two backward passes must agree bitwise on CUDA too.
        out = flash_attn_varlen_func(
            *leaves, cu_q, cu_k, max_q, max_k, causal=causal, deterministic=True, seqused_k=used
        )
        out.backward(dout)
        results.append([out.detach()] + [t.grad for t in leaves])
    for name, clean, planted in zip(("out", "dq", "dk", "dv"), *results):
        assert torch.isfinite(planted).all(), f"{name}: a planted NaN / Inf reached the result"
        assert torch.equal(planted, clean), name


def paged_from_packed(k, v, cu_k, lengths, page_size, fill_unused):
    """A paged cache holding sequence b's first lengths[b] rows of k / v in shuffled
    pages, with spare pages and spare block_table columns; every row that is not a
    used key (the last page's tail, the spare pages) is filled by fill_unused."""
    batch = len(lengths)
    pages = [max(1, math.ceil(n / page_size)) for n in lengths]
    max_blocks = max(pages) + 1
    num_blocks = sum(pages) + 3
    shape = (num_blocks, page_size) + tuple(k.shape[1:])
    k_cache = fill_unused(torch.empty(shape, dtype=k.dtype, device=k.device))
    v_cache = fill_unused(torch.empty(shape, dtype=v.dtype, device=v.device))
    order = torch.randperm(num_blocks).tolist()
    spare = order[sum(pages) :]
    table = torch.empty(batch, max_blocks, dtype=torch.int32)
    for b, n in enumerate(lengths):
        for i in range(max_blocks):
            table[b, i] = order.pop(0) if i < pages[b] else spare[(b + i) % len(spare)]
        for i in range(pages[b]):
            count = min(page_size, n - i * page_size)
            if count <= 0:
                continue
            src = slice(int(cu_k[b]) + i * page_size, int(cu_k[b]) + i * page_size + count)
            k_cache[int(table[b, i]), :count] = k[src]
            v_cache[int(table[b, i]), :count] = v[src]
    return k_cache, v_cache, table.to(k.device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("cu_k_given", [True, False], ids=["with_cu_seqlens_k", "vllm_form"])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_paged_varlen_seqused_k(device, causal, cu_k_given, page_size):
    q, k, v, cu_q, cu_k, used, max_q, max_k = seqused_inputs(device, 8, 2, head_dim=128)
    # NaN / Inf in every cache row that is not a used key: the last used page's
    # tail, the table's spare columns and the pool's spare pages.
    k_cache, v_cache, table = paged_from_packed(
        k, v, cu_k, used.tolist(), page_size, fill_non_finite
    )
    with torch.no_grad():
        out = flash_attn_varlen_func(
            q,
            k_cache,
            v_cache,
            cu_q,
            cu_k if cu_k_given else None,
            max_q,
            max_k,
            causal=causal,
            block_table=table,
            seqused_k=used,
        )
        contiguous = flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, seqused_k=used
        )
    k_used, v_used, cu_used = truncated(k, v, cu_k, used)
    exact, _ = ref.varlen_attention_ref(
        q, k_used, v_used, cu_q, cu_used, max_seqlen_k=max_k, causal=causal
    )
    same, _ = ref.varlen_attention_ref(
        q, k_used, v_used, cu_q, cu_used, max_seqlen_k=max_k, causal=causal, compute_dtype=q.dtype
    )
    check_output(out, exact, same)
    torch.testing.assert_close(out, contiguous, atol=3e-2 if device == "cuda" else 1e-6, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_vllm_form_makes_no_offsets_per_call(device, monkeypatch):
    """cu_seqlens_k None (vLLM's paged call): the zero key offsets the op takes are
    made once per (device, dtype, length), not allocated and filled on every eager
    call; a call traced by torch.compile makes its own, and both give the same out."""
    import flash_attn_cuda.interface as interface

    monkeypatch.setattr(interface, "_ZERO_OFFSETS", {})
    q, k, v, cu_q, cu_k, used, max_q, max_k = seqused_inputs(device, 8, 2, head_dim=64)
    k_cache, v_cache, table = paged_from_packed(k, v, cu_k, used.tolist(), 16, fill_random)

    def call(q):
        return flash_attn_varlen_func(
            q, k_cache, v_cache, cu_q, None, max_q, max_k, block_table=table, seqused_k=used
        )

    made = []
    real_zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, **kw: made.append(a) or real_zeros(*a, **kw))
    with torch.no_grad():
        first, second = call(q), call(q)
    monkeypatch.setattr(torch, "zeros", real_zeros)
    assert len(made) == 1
    assert list(interface._ZERO_OFFSETS) == [(cu_q.device, torch.int32, tuple(cu_q.shape))]
    assert torch.equal(first, second)
    zeros = interface._zero_offsets(cu_q)
    assert zeros is interface._zero_offsets(cu_q) and not zeros.any()
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(call, fullgraph=True)(q)
    assert torch.equal(compiled, first)


@pytest.mark.parametrize("device", DEVICES)
def test_plain_varlen_never_reads_past_a_sequence(device):
    """Each sequence's result is bitwise the same when every other sequence's
    keys and values, and the rows after the last sequence, hold NaN / Inf."""
    lens_q, lens_k = [7, 1, 33, 16], [9, 40, 33, 1]
    dtype = dtype_on(device)
    cu_q, cu_k = cu_seqlens(lens_q, device), cu_seqlens(lens_k, device)
    tail = 5  # rows of k / v after the last sequence
    q = torch.randn(sum(lens_q), 4, 64, device=device, dtype=dtype)
    k = torch.randn(sum(lens_k) + tail, 2, 64, device=device, dtype=dtype)
    v = torch.randn_like(k)
    total = sum(lens_k)
    with torch.no_grad():
        clean = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True)
        for b in range(len(lens_q)):
            others = [r for r in range(total + tail) if not int(cu_k[b]) <= r < int(cu_k[b + 1])]
            kb, vb = plant_non_finite(k.clone(), others), plant_non_finite(v.clone(), others)
            out = flash_attn_varlen_func(
                q, kb, vb, cu_q, cu_k, max(lens_q), max(lens_k), causal=True
            )
            rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
            assert torch.isfinite(out[rows]).all(), f"sequence {b} read another's keys"
            assert torch.equal(out[rows], clean[rows]), f"sequence {b}"


# ----------------------------------------------------------------------------- out=


def _inputs_fixed(device, head_dim):
    dtype = dtype_on(device)
    return [torch.randn(2, 37, n, head_dim, device=device, dtype=dtype) for n in (4, 2, 2)]


def _calls(device, head_dim):
    """name -> (call(out=None), expected shape) of each function taking out=."""
    dtype = dtype_on(device)
    q, k, v = _inputs_fixed(device, head_dim)
    vq, vk, vv, cu_q, cu_k, used, max_q, max_k = seqused_inputs(device, 4, 2, head_dim)
    kc, vc, table = paged_from_packed(vk, vv, cu_k, used.tolist(), PAGE_SIZE, fill_non_finite)
    dq = torch.randn(3, 2, 4, head_dim, device=device, dtype=dtype)
    k_cache = torch.randn(3, 64, 2, head_dim, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    new = torch.randn(3, 1, 2, head_dim, device=device, dtype=dtype)
    seqlens = int32([5, 0, 40], device)
    return {
        "func": (lambda out=None: flash_attn_func(q, k, v, causal=True, out=out), q.shape),
        "varlen_seqused": (
            lambda out=None: flash_attn_varlen_func(
                vq, vk, vv, cu_q, cu_k, max_q, max_k, causal=True, seqused_k=used, out=out
            ),
            vq.shape,
        ),
        "varlen_paged": (
            lambda out=None: flash_attn_varlen_func(
                vq, kc, vc, cu_q, None, max_q, max_k, block_table=table, seqused_k=used, out=out
            ),
            vq.shape,
        ),
        # The append is idempotent: every call writes the same rows.
        "kvcache": (
            lambda out=None: flash_attn_with_kvcache(
                dq,
                k_cache,
                v_cache,
                new,
                new.clone(),
                cache_seqlens=seqlens,
                causal=True,
                num_splits=1,
                out=out,
            ),
            dq.shape,
        ),
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [64, 36], ids=["d64", "d36_padded"])
@pytest.mark.parametrize("name", ["func", "varlen_seqused", "varlen_paged", "kvcache"])
def test_out_is_written_and_returned(device, head_dim, name):
    call, shape = _calls(device, head_dim)[name]
    with torch.no_grad():
        expected = call()
        out = torch.full(shape, float("nan"), device=device, dtype=dtype_on(device))
        pointer = out.data_ptr()
        result = call(out=out)
    assert result is out and out.data_ptr() == pointer
    assert torch.equal(out, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["func", "varlen_seqused", "kvcache"])
def test_out_may_be_a_strided_view(device, name):
    # A view into a wider buffer (heads of a larger tensor): the rows around it stay.
    call, shape = _calls(device, 64)[name]
    with torch.no_grad():
        expected = call()
        buffer = torch.full(
            shape[:-2] + (shape[-2] + 3, shape[-1]), 7.0, device=device, dtype=dtype_on(device)
        )
        out = buffer[..., 1:-2, :]
        assert not out.is_contiguous()
        assert call(out=out) is out
    assert torch.equal(out, expected)
    assert (buffer[..., 0, :] == 7).all() and (buffer[..., -2:, :] == 7).all()


@pytest.mark.parametrize("device", DEVICES)
def test_out_returns_lse_like_the_allocating_call(device):
    q, k, v = _inputs_fixed(device, 64)
    with torch.no_grad():
        out, lse, _ = flash_attn_func(q, k, v, return_attn_probs=True)
        buf = torch.empty_like(q)
        result, lse_out, _ = flash_attn_func(q, k, v, return_attn_probs=True, out=buf)
    assert result is buf and torch.equal(buf, out) and torch.equal(lse_out, lse)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["func", "varlen_seqused", "kvcache"])
def test_out_allocates_no_output(name):
    """The out= call asks the allocator for one block fewer than the allocating
    call: the output (every other allocation is the same in both)."""
    call, shape = _calls("cuda", 64)[name]
    out = torch.empty(shape, device="cuda", dtype=torch.bfloat16)

    def allocations(fn):
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        with torch.no_grad():
            fn()
        torch.cuda.synchronize()
        return torch.cuda.memory_stats()["allocation.all.allocated"] - before

    call(), call(out=out)  # warm-up: lazy initialisation allocates once
    assert allocations(lambda: call(out=out)) == allocations(call) - 1


# ----------------------------------------------------------------------------- KV cache


def kvcache_inputs(
    device, batch, lengths, capacity, seqlen_q=2, nheads=8, nheads_k=2, head_dim=128
):
    dtype = dtype_on(device)
    q = torch.randn(batch, seqlen_q, nheads, head_dim, device=device, dtype=dtype)
    k_cache = torch.randn(batch, capacity, nheads_k, head_dim, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    return q, k_cache, v_cache, int32(lengths, device)


def page_order(batch, capacity, page_size, device):
    """Which pool page holds each (sequence, page): shuffled, with two spare
    pages per sequence left over. Returns (block_table, pages in the pool)."""
    per_seq = capacity // page_size
    order = torch.randperm(batch * per_seq + 2 * batch, device=device)
    return order[: batch * per_seq].view(batch, per_seq).to(torch.int32), order.numel()


def to_pages(cache, table, num_blocks, fill):
    """(batch, capacity, ...) -> a pool of num_blocks pages laid out by table;
    the pages no sequence owns are filled by `fill`."""
    page_size = cache.shape[1] // table.shape[1]
    pool = fill(
        torch.empty(
            (num_blocks, page_size) + tuple(cache.shape[2:]), dtype=cache.dtype, device=cache.device
        )
    )
    pool[table.long().flatten()] = cache.reshape(-1, page_size, *cache.shape[2:])
    return pool


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("seqlen_new", [0, 2])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_kvcache_never_reads_past_cache_seqlens(device, paged, num_splits, seqlen_new, page_size):
    if not paged and page_size != PAGE_SIZE:
        pytest.skip("the page size applies to a paged cache only")
    capacity = page_size * -(-128 // page_size)
    # Lengths end mid-page, on a page boundary, at 0 and at the full cache.
    lengths = [37, 2 * page_size, 0, capacity - seqlen_new, 1]
    batch = len(lengths)
    q, k_cache, v_cache, seqlens = kvcache_inputs(device, batch, lengths, capacity)
    new = (
        [
            torch.randn(batch, seqlen_new, 2, q.shape[-1], device=device, dtype=q.dtype)
            for _ in range(2)
        ]
        if seqlen_new
        else [None, None]
    )
    # Past each length (the appended rows are written over): NaN / Inf. Paged,
    # that is the last used page's tail and every page of the table's columns
    # past it; the pool's spare pages hold NaN / Inf too.
    bad_k, bad_v = k_cache.clone(), v_cache.clone()
    for b, n in enumerate(lengths):
        plant_non_finite(bad_k[b], list(range(n, capacity)))
        plant_non_finite(bad_v[b], list(range(n, capacity)))
    table, num_blocks = page_order(batch, capacity, page_size, device)
    results = []
    for kc, vc, fill in ((k_cache, v_cache, fill_random), (bad_k, bad_v, fill_non_finite)):
        if paged:
            kc, vc = (to_pages(c, table, num_blocks, fill) for c in (kc, vc))
        out = flash_attn_with_kvcache(
            q,
            kc.clone(),
            vc.clone(),
            new[0],
            new[1],
            cache_seqlens=seqlens,
            block_table=table if paged else None,
            causal=True,
            num_splits=num_splits,
        )
        results.append(out)
    clean, planted = results
    assert torch.isfinite(planted).all(), "a planted NaN / Inf reached the output"
    assert torch.equal(planted, clean)


@pytest.mark.parametrize("device", DEVICES)
def test_kvcache_never_reads_before_cache_leftpad(device):
    capacity = 64
    lengths, leftpad = [40, 9, 64], [7, 0, 33]
    q, k_cache, v_cache, seqlens = kvcache_inputs(device, 3, lengths, capacity)
    pad = int32(leftpad, device)
    bad_k, bad_v = k_cache.clone(), v_cache.clone()
    for b, (n, p) in enumerate(zip(lengths, leftpad)):
        rows = list(range(0, p)) + list(range(n, capacity))
        plant_non_finite(bad_k[b], rows)
        plant_non_finite(bad_v[b], rows)
    clean = flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=seqlens, cache_leftpad=pad, num_splits=1
    )
    planted = flash_attn_with_kvcache(
        q, bad_k, bad_v, cache_seqlens=seqlens, cache_leftpad=pad, num_splits=1
    )
    assert torch.isfinite(planted).all() and torch.equal(planted, clean)


# ----------------------------------------------------------------------------- batch invariance


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("seqlen_q", [1, 4])
def test_kvcache_batch_invariance(device, paged, seqlen_q):
    """With num_splits=1, sequence 0's output and lse are bitwise the same alone
    and at any place in batches of 3 and 9 sequences of other lengths."""
    capacity, length = 8 * PAGE_SIZE, 77
    q0, k0, v0, _ = kvcache_inputs(device, 1, [length], capacity, seqlen_q=seqlen_q)

    def run(q, kc, vc, lengths):
        table = None
        if paged:
            table, num_blocks = page_order(q.shape[0], capacity, PAGE_SIZE, device)
            kc, vc = (to_pages(c, table, num_blocks, fill_random) for c in (kc, vc))
        return flash_attn_with_kvcache(
            q,
            kc,
            vc,
            cache_seqlens=int32(lengths, device),
            block_table=table,
            causal=True,
            num_splits=1,
            return_softmax_lse=True,
        )

    alone_out, alone_lse = run(q0, k0, v0, [length])
    for batch, place in ((3, 1), (9, 8), (9, 0)):
        qo, ko, vo, _ = kvcache_inputs(
            device, batch - 1, [0] * (batch - 1), capacity, seqlen_q=seqlen_q
        )
        lengths = torch.randint(0, capacity + 1, (batch - 1,)).tolist()
        q, kc, vc = (
            torch.cat([o[:place], t, o[place:]]) for o, t in ((qo, q0), (ko, k0), (vo, v0))
        )
        out, lse = run(q, kc, vc, lengths[:place] + [length] + lengths[place:])
        assert torch.equal(out[place], alone_out[0]), f"batch {batch}, place {place}"
        assert torch.equal(lse[place], alone_lse[0]), f"batch {batch}, place {place}"


@pytest.fixture(
    params=[
        None,
        pytest.param("sm80", marks=pytest.mark.cuda),
        pytest.param("sm90", marks=pytest.mark.cuda),
    ],
    ids=["default", "sm80", "sm90"],
)
def fwd_kernel(request, monkeypatch):
    """The CUDA forward kernel, fixed: the automatic choice goes by the batch's
    shape, so only a fixed choice is batch invariant on CUDA."""
    if request.param is not None:
        monkeypatch.setenv("FLASH_ATTN_FWD_KERNEL", request.param)
    return request.param


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("paged", [False, True], ids=["packed", "paged"])
def test_varlen_batch_invariance(device, paged, fwd_kernel):
    if device == "cuda" and fwd_kernel is None:
        pytest.skip("the automatic CUDA kernel choice depends on the batch (docs/serving.md)")
    if device == "cpu" and fwd_kernel is not None:
        pytest.skip("the CPU has one kernel")
    dtype = dtype_on(device)
    head_dim, nheads, nheads_k = 128, 8, 2
    q0 = torch.randn(45, nheads, head_dim, device=device, dtype=dtype)
    k0 = torch.randn(300, nheads_k, head_dim, device=device, dtype=dtype)
    v0 = torch.randn_like(k0)

    def run(lens_q, lens_k, qs, ks, vs):
        q, k, v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
        cu_q, cu_k = cu_seqlens(lens_q, device), cu_seqlens(lens_k, device)
        with torch.no_grad():
            if not paged:
                return flash_attn_varlen_func(
                    q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True
                ), cu_q
            kc, vc, table = paged_from_packed(k, v, cu_k, lens_k, PAGE_SIZE, fill_random)
            return flash_attn_varlen_func(
                q,
                kc,
                vc,
                cu_q,
                None,
                max(lens_q),
                max(lens_k),
                causal=True,
                block_table=table,
                seqused_k=int32(lens_k, device),
            ), cu_q

    alone, _ = run([45], [300], [q0], [k0], [v0])
    for count, place in ((2, 1), (6, 3), (6, 0)):
        lens_q = torch.randint(1, 200, (count,)).tolist()
        lens_k = [n + int(torch.randint(0, 400, ())) for n in lens_q]
        qs = [torch.randn(n, nheads, head_dim, device=device, dtype=dtype) for n in lens_q]
        ks = [torch.randn(n, nheads_k, head_dim, device=device, dtype=dtype) for n in lens_k]
        vs = [torch.randn_like(t) for t in ks]
        out, cu_q = run(
            lens_q[:place] + [45] + lens_q[place:],
            lens_k[:place] + [300] + lens_k[place:],
            qs[:place] + [q0] + qs[place:],
            ks[:place] + [k0] + ks[place:],
            vs[:place] + [v0] + vs[place:],
        )
        rows = slice(int(cu_q[place]), int(cu_q[place + 1]))
        assert torch.equal(out[rows], alone), f"{count + 1} sequences, place {place}"


# ----------------------------------------------------------------------------- fake kernels


def test_fake_kernels_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(25, 4, 32, dtype=torch.bfloat16)
        k = torch.empty(40, 2, 32, dtype=torch.bfloat16)
        cu = torch.empty(4, dtype=torch.int32)
        used = torch.empty(3, dtype=torch.int32)
        args = (q, k, k, cu, cu, None, None, 19, 19, 0.0, 0.2, True, -1, -1, 0.0, False, 0, 0, None)
        out, lse, s_dmask, rng = ops.varlen_fwd(*args, seqused_k=used)
        assert out.shape == q.shape and lse.shape == (4, 25) and lse.dtype == torch.float32
        assert s_dmask.shape == (0,) and rng.shape == (2,)
        results = ops.varlen_fwd_out(*args, seqused_k=used, out=torch.empty_like(q))
        assert [t.shape for t in results] == [(4, 25), (0,), (2,)]
        dq, dk, dv = ops.varlen_bwd(
            q,
            q,
            k,
            k,
            q,
            lse,
            cu,
            cu,
            None,
            19,
            19,
            0.0,
            0.2,
            True,
            -1,
            -1,
            0.0,
            False,
            None,
            seqused_k=used,
        )
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape
        qf = torch.empty(2, 7, 4, 32, dtype=torch.bfloat16)
        kf = torch.empty(2, 9, 2, 32, dtype=torch.bfloat16)
        lse, s_dmask, rng = ops.fwd_out(
            qf,
            kf,
            kf,
            None,
            0.0,
            0.2,
            False,
            -1,
            -1,
            0.0,
            False,
            0,
            0,
            None,
            out=torch.empty_like(qf),
        )
        assert lse.shape == (2, 4, 7) and s_dmask.shape == (0,)
        lse = ops.fwd_kvcache_out(
            qf,
            kf,
            kf,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            0.2,
            True,
            -1,
            -1,
            0.0,
            True,
            1,
            out=torch.empty_like(qf),
        )
        assert lse.shape == (2, 4, 7) and lse.dtype == torch.float32
