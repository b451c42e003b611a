"""A value head dim below the query / key one (d_v < d_qk) on the CUDA kernels,
read and written at d_v columns (docs/head_dims_dv_and_512.md, section 1,
level 1).

The kernel of d_qk runs the call; V (and dO, O) are read with their columns
past d_v zero-filled, O (and dV) written at d_v columns, with no padded copy
(the SM80 backward alone runs on padded copies, BwdPlan::pad_v).
A zero column of V, dO or O adds exact zeros everywhere, so each result equals
the one of the same kernel on v (dout, out) zero-padded to d_qk, cropped:
bitwise wherever the kernel's arithmetic has a fixed order (the forward, the
split-KV decode, the deterministic backward), and within the correctness
criterion against the float64 reference everywhere. The CPU path and its
semantics are test_head_dims_qk_v.py's.

Every test is marked cuda (skipped without a GPU); each runs on the SM80
design and, on an sm90 GPU, the Hopper one (FLASH_ATTN_FWD_KERNEL /
FLASH_ATTN_BWD_KERNEL). The pairs cover MLA's 192 / 128 and a d_v of one or
more whole 64-column swizzle atoms below d_qk.

Level 2: on sm90, a forward with d_qk in (160, 192] and d_v <= 128 runs the
(192, 128) pair's own Hopper kernel (plan_fwd; fwd_tile_config.h), whose key
tiles (112) differ from d_192's (96): its sums run in another order, so it
matches the padded call within rounding rather than bitwise, and the
reference within the criterion. FWD_PAIRS adds the pairs around it.
The backward of those calls runs the pair's own Hopper backward (plan_bwd;
bwd_tile_config.h BwdTileConfig<192, 128>): d192's 64 x 64 tile with dO, V
and dV at 128 columns. Its tiles and summation order are d192's, and the
columns it drops only ever added exact zeros, so its gradients are still
bitwise the padded call's where the order is fixed (deterministic).
"""

import re

import pytest
import torch
import torch.nn.functional as F

from reference import attention_ref, check_close, varlen_attention_ref

from flash_attn_cuda import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from flash_attn_cuda.interface import _draw_rng_state

pytestmark = pytest.mark.cuda

ops = torch.ops.flash_attn

# (d_qk, d_v)
PAIRS = [(192, 128), (128, 64), (96, 64), (256, 128)]
PAIR_IDS = [f"{a}-{b}" for a, b in PAIRS]
# The forward's: also the other calls the (192, 128) kernel takes (d_v of one
# atom, of one and a half, a d_qk below 192) on sm90.
FWD_PAIRS = PAIRS + [(192, 64), (192, 96), (176, 128)]
FWD_PAIR_IDS = [f"{a}-{b}" for a, b in FWD_PAIRS]


@pytest.fixture(params=["sm80", "sm90"])
def kernel(request, monkeypatch):
    if request.param == "sm90" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernels run on sm90 GPUs only")
    monkeypatch.setenv("FLASH_ATTN_FWD_KERNEL", request.param)
    monkeypatch.setenv("FLASH_ATTN_BWD_KERNEL", request.param)
    return request.param


def randn(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", dtype=dtype)


def pad(t, d):
    """t zero-padded to d columns: the call as the ops ran it before level 1."""
    return F.pad(t, (0, d - t.shape[-1]))


def runs_pair_kernel(kernel, d_qk, d_v):
    """Whether the forward runs the (192, 128) pair's Hopper kernel (plan_fwd)."""
    return kernel == "sm90" and 160 < d_qk <= 192 and d_v <= 128


def assert_as_padded(ours, padded, bitwise):
    """The padded call's result: bitwise where the same kernel ran both, else
    within the rounding of another summation order (fp32 sums, one 16-bit
    rounding at the end)."""
    if bitwise:
        assert torch.equal(ours, padded)
    else:
        torch.testing.assert_close(ours, padded, atol=1e-2, rtol=1e-2)


def check_grads(ours, exact, same):
    for name, o, e, s in zip(("dq", "dk", "dv"), ours, exact, same):
        assert o.shape == e.shape, name
        check_close(o, e, s, name, grad=True)


def reference_grads(ref, inputs, dout, dtype):
    cast = [t.detach().to(dtype).requires_grad_() for t in inputs]
    out, lse = ref(*cast, dtype)
    return out, lse, torch.autograd.grad(out, cast, dout.to(dtype))


# ------------------------------------------------------------------- forward


@pytest.mark.parametrize("d_qk,d_v", FWD_PAIRS, ids=FWD_PAIR_IDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
def test_fwd_equals_padded_and_reference(kernel, d_qk, d_v, causal, heads):
    nheads, nheads_k = heads
    q = randn(2, 200, nheads, d_qk)
    k = randn(2, 333, nheads_k, d_qk)
    v = randn(2, 333, nheads_k, d_v)
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert out.shape == (2, 200, nheads, d_v)
    padded, lse_padded, _ = flash_attn_func(
        q, k, pad(v, d_qk), causal=causal, return_attn_probs=True
    )
    bitwise = not runs_pair_kernel(kernel, d_qk, d_v)
    assert_as_padded(out, padded[..., :d_v], bitwise)
    assert_as_padded(lse, lse_padded, bitwise)
    exact, _ = attention_ref(q, k, v, causal=causal)
    same, _ = attention_ref(q, k, v, causal=causal, compute_dtype=q.dtype)
    check_close(out, exact, same, "out")

    # out= (a strided view of a wider buffer too) gets the same bits, and the
    # buffer's other columns keep their values.
    buffer = torch.full((2, 200, nheads, d_v + 8), float("nan"), device="cuda", dtype=q.dtype)
    written = flash_attn_func(q, k, v, causal=causal, out=buffer[..., :d_v])
    assert torch.equal(written, out)
    assert torch.equal(buffer[..., :d_v], out)
    assert buffer[..., d_v:].isnan().all()


@pytest.mark.parametrize("d_qk,d_v", FWD_PAIRS, ids=FWD_PAIR_IDS)
def test_fwd_score_features_and_probs(kernel, d_qk, d_v):
    """Softcap, ALiBi, a local window, a sink, dropout and the returned
    probabilities: only V's and O's width differs from d_qk."""
    q, k, v = randn(1, 129, 4, d_qk), randn(1, 131, 2, d_qk), randn(1, 131, 2, d_v)
    kwargs = dict(
        softcap=5.0,
        alibi_slopes=torch.rand(4, device="cuda") * 0.3,
        window_size=(40, 7),
        learnable_sink=torch.randn(4, device="cuda"),
    )
    bitwise = not runs_pair_kernel(kernel, d_qk, d_v)
    out = flash_attn_func(q, k, v, **kwargs)
    assert_as_padded(out, flash_attn_func(q, k, pad(v, d_qk), **kwargs)[..., :d_v], bitwise)
    torch.manual_seed(5)
    out, lse, probs = flash_attn_func(q, k, v, dropout_p=0.2, return_attn_probs=True)
    torch.manual_seed(5)
    padded, lse_padded, probs_padded = flash_attn_func(
        q, k, pad(v, d_qk), dropout_p=0.2, return_attn_probs=True
    )
    assert_as_padded(out, padded[..., :d_v], bitwise)
    assert_as_padded(lse, lse_padded, bitwise)
    assert_as_padded(probs, probs_padded, bitwise)


@pytest.mark.parametrize("d_qk,d_v", FWD_PAIRS, ids=FWD_PAIR_IDS)
# 16-row pages go to the Hopper producer's TMA boxes, 3-row pages to its row
# gather, which zero-fills v's columns past d_v itself; the (192, 128) pair's
# kernel reads V's 128 columns both ways (d_v 64 / 96: columns past d_v).
@pytest.mark.parametrize("page_size", [None, 16, 3], ids=["contiguous", "paged", "paged3"])
def test_varlen_fwd_equals_padded(kernel, d_qk, d_v, page_size):
    lengths_q, lengths_k = [50, 0, 7, 130], [100, 5, 0, 260]
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32)
    q = randn(int(cu_q[-1]), 8, d_qk)
    k = randn(int(cu_k[-1]), 2, d_qk)
    v = randn(int(cu_k[-1]), 2, d_v)
    args = (cu_q.cuda(), cu_k.cuda(), max(lengths_q), max(lengths_k))
    table = None
    k_in, v_in, v_wide = k, v, pad(v, d_qk)
    if page_size is not None:
        pages = [-(-n // page_size) for n in lengths_k]
        num_pages = sum(pages) + 2
        order = torch.randperm(num_pages).tolist()
        table = torch.zeros(len(lengths_k), max(pages), dtype=torch.int32)
        k_in = randn(num_pages, page_size, 2, d_qk)
        v_in = randn(num_pages, page_size, 2, d_v)
        for b, n in enumerate(lengths_k):
            for i in range(pages[b]):
                page = order.pop()
                table[b, i] = page
                start, count = int(cu_k[b]) + i * page_size, min(page_size, n - i * page_size)
                k_in[page, :count] = k[start : start + count]
                v_in[page, :count] = v[start : start + count]
        table = table.cuda()
        v_wide = pad(v_in, d_qk)
    out = flash_attn_varlen_func(q, k_in, v_in, *args, causal=True, block_table=table)
    assert out.shape == (q.shape[0], 8, d_v)
    padded = flash_attn_varlen_func(q, k_in, v_wide, *args, causal=True, block_table=table)
    assert_as_padded(out, padded[..., :d_v], not runs_pair_kernel(kernel, d_qk, d_v))
    if table is not None:
        # The same kernel on the keys unpaged: bitwise (the boxes and the
        # gather fill V's stages as its tiles' TMA copy does).
        assert torch.equal(out, flash_attn_varlen_func(q, k, v, *args, causal=True))
    exact, _ = varlen_attention_ref(q, k, v, cu_q, cu_k, max_seqlen_k=max(lengths_k), causal=True)
    same, _ = varlen_attention_ref(
        q, k, v, cu_q, cu_k, max_seqlen_k=max(lengths_k), causal=True, compute_dtype=q.dtype
    )
    check_close(out, exact, same, "out")


def forward_with_kernel_names(*args, func=flash_attn_func, **kwargs):
    """func's output and the names of the kernels it ran."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = func(*args, **kwargs)
        torch.cuda.synchronize()
    return out, {event.name for event in prof.events()}


def sm90_forward_tiles(names):
    """(d_qk, block N, d_v, tiles from a counter) of each Hopper forward that
    ran: FwdSm90KernelTraits<d_qk, block M, block N, element, d_v, K / V
    stages>, then the kernel's grid argument."""
    found = set()
    for name in names:
        match = re.search(
            r"flash_fwd_sm90_kernel<.*?FwdSm90KernelTraits<(\d+), \d+, (\d+), [\w:]+, (\d+), \d+>, "
            r"(true|false)",
            name,
        )
        if match:
            found.add((int(match[1]), int(match[2]), int(match[3]), match[4] == "true"))
    return found


@pytest.mark.parametrize(
    "d_qk,d_v,tiles",
    [
        (192, 128, (192, 112, 128)),
        (192, 64, (192, 112, 128)),
        (176, 128, (192, 112, 128)),
        (192, 192, (192, 96, 192)),
        (192, 160, (192, 96, 192)),
        (160, 128, (160, 96, 160)),
        (128, 64, (128, 128, 128)),
    ],
)
def test_fwd_pair_kernel_choice_on_sm90(d_qk, d_v, tiles, monkeypatch):
    """By default on sm90, d_qk in (160, 192] with d_v <= 128 runs the (192,
    128) kernel (112-key tiles, P V 128 wide) and every other pair the kernel
    of its compiled d_qk; on each of the pair kernel's grids (one block per
    tile, fixed shares of the persistent grid, tiles from a counter), within
    the criterion of the reference."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernels run on sm90 GPUs only")
    monkeypatch.delenv("FLASH_ATTN_FWD_KERNEL", raising=False)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    pair = tiles[2] != tiles[0]
    shapes = [(2, 300, 4, False)]  # few tiles: one block per tile
    if pair:
        # More tiles than SMs, of equal work (fixed shares) and short causal
        # ones (from a counter).
        batch = sms // 8 + 1
        shapes += [(batch, 1000, 8, False), (batch, 1000, 8, True)]
    for batch, seqlen, nheads, causal in shapes:
        q = randn(batch, seqlen, nheads, d_qk)
        k = randn(batch, seqlen + 17, 2, d_qk)
        v = randn(batch, seqlen + 17, 2, d_v)
        out, names = forward_with_kernel_names(q, k, v, causal=causal)
        # Only the causal calls of many tiles take them from a counter.
        counter = causal and batch > 2
        assert sm90_forward_tiles(names) == {(*tiles, counter)}, names
        exact, _ = attention_ref(q, k, v, causal=causal)
        same, _ = attention_ref(q, k, v, causal=causal, compute_dtype=q.dtype)
        check_close(out, exact, same, "out")


@pytest.mark.parametrize("page_size", [16, 3], ids=["boxes", "gather"])
@pytest.mark.parametrize("d_v", [128, 64])
def test_paged_fwd_pair_kernel_on_sm90(page_size, d_v, monkeypatch):
    """Paged varlen keys of d_qk 192, d_v <= 128 run the (192, 128) kernel's
    paged instantiation (FwdSm90Keys, the last template argument) on sm90, by
    boxes or the row gather; its output is test_varlen_fwd_equals_padded's
    business."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernels run on sm90 GPUs only")
    monkeypatch.delenv("FLASH_ATTN_FWD_KERNEL", raising=False)
    batch, seqlen = 2, 1000
    pages = -(-seqlen // page_size)
    q = randn(batch * seqlen, 8, 192)
    k_cache = randn(batch * pages, page_size, 2, 192)
    v_cache = randn(batch * pages, page_size, 2, d_v)
    table = torch.randperm(batch * pages, device="cuda", dtype=torch.int32).view(batch, pages)
    cu = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * seqlen
    _, names = forward_with_kernel_names(
        q,
        k_cache,
        v_cache,
        cu,
        cu,
        seqlen,
        seqlen,
        block_table=table,
        func=flash_attn_varlen_func,
    )
    paged_pair = [
        n
        for n in names
        if re.search(
            r"flash_fwd_sm90_kernel<.*?FwdSm90KernelTraits<192, \d+, 112, [\w:]+, 128, \d+>, "
            r"(true|false), (true|false), [^,>]*FwdSm90Keys(?:\)[1-3]|::kPaged\w+)>",
            n,
        )
    ]
    assert paged_pair, names


# ------------------------------------------------------------------ backward


@pytest.mark.parametrize("d_qk,d_v", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_bwd_equals_padded_and_reference(kernel, d_qk, d_v, heads, deterministic):
    nheads, nheads_k = heads
    q = randn(2, 130, nheads, d_qk).requires_grad_()
    k = randn(2, 201, nheads_k, d_qk).requires_grad_()
    v = randn(2, 201, nheads_k, d_v).requires_grad_()
    dout = randn(2, 130, nheads, d_v)
    out = flash_attn_func(q, k, v, causal=True, deterministic=deterministic)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert grads[2].shape == v.shape

    # The op on zero-padded v, out and dout, cropped (the pre-level-1 call).
    scale = d_qk**-0.5
    q0, k0, v0 = q.detach(), k.detach(), v.detach()
    out_op, lse, _, rng = ops.fwd(q0, k0, v0, None, 0.0, scale, True, -1, 0, 0.0, False, 0, 0, None)
    dq, dk, dv = ops.bwd(
        pad(dout, d_qk),
        q0,
        k0,
        pad(v0, d_qk),
        pad(out_op, d_qk),
        lse,
        None,
        0.0,
        scale,
        True,
        -1,
        0,
        0.0,
        deterministic,
        rng,
    )
    padded = (dq, dk, dv[..., :d_v])
    if deterministic:
        for name, ours, theirs in zip(("dq", "dk", "dv"), grads, padded):
            assert torch.equal(ours, theirs), name
        # And twice the same bits.
        again = torch.autograd.grad(
            flash_attn_func(q, k, v, causal=True, deterministic=True), (q, k, v), dout
        )
        assert all(torch.equal(a, b) for a, b in zip(grads, again))

    def ref(q, k, v, dtype):
        return attention_ref(q, k, v, causal=True, compute_dtype=dtype)

    exact = reference_grads(ref, (q, k, v), dout, torch.float64)
    same = reference_grads(ref, (q, k, v), dout, q.dtype)
    check_grads(grads, exact[2], same[2])


@pytest.mark.parametrize("d_qk,d_v", PAIRS, ids=PAIR_IDS)
def test_bwd_score_features_equal_padded(kernel, d_qk, d_v):
    """Softcap, ALiBi, a window, dropout (the Hopper kernel's score-mods
    variant, or the SM80 kernel's score-extras one, on padded inputs there:
    BwdPlan::pad_v) and GQA, deterministic: given the same forward results,
    the backward's gradients are bitwise those of the call on zero-padded v,
    out and dout. The forward's own results are the padded call's only within
    rounding where the pair's kernel runs (runs_pair_kernel), so both backward
    calls take one forward's out, LSE and RNG state; autograd's gradients are
    bitwise the op's."""
    q = randn(1, 97, 8, d_qk).requires_grad_()
    k = randn(1, 131, 2, d_qk).requires_grad_()
    v = randn(1, 131, 2, d_v).requires_grad_()
    dout = randn(1, 97, 8, d_v)
    alibi = torch.rand(8, device="cuda") * 0.3
    torch.manual_seed(11)
    out_autograd = flash_attn_func(
        q, k, v, dropout_p=0.1, window_size=(50, 9), softcap=5.0, alibi_slopes=alibi,
        deterministic=True,
    )  # fmt: skip
    grads = torch.autograd.grad(out_autograd, (q, k, v), dout)

    # The same forward through the op, with the RNG state autograd's drew.
    torch.manual_seed(11)
    rng = _draw_rng_state(0.1, q.device)
    # alibi, dropout_p, softmax_scale, causal, window_left, window_right, softcap
    score = (alibi, 0.1, d_qk**-0.5, False, 50, 9, 5.0)
    out, lse, _, rng = ops.fwd(q, k, v, *score, False, 0, 0, rng)
    assert torch.equal(out, out_autograd)
    ours = ops.bwd(dout, q, k, v, out, lse, *score, True, rng)
    wide = ops.bwd(pad(dout, d_qk), q, k, pad(v, d_qk), pad(out, d_qk), lse, *score, True, rng)
    for name, g, o, w in zip(("dq", "dk", "dv"), grads, ours, wide):
        assert torch.equal(g, o), name
        assert torch.equal(o, w[..., : o.shape[-1]]), name


@pytest.mark.parametrize("d_qk,d_v", PAIRS, ids=PAIR_IDS)
def test_varlen_bwd_matches_reference(kernel, d_qk, d_v):
    lengths = [30, 0, 77, 129]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    total = int(cu[-1])
    q = randn(total, 8, d_qk).requires_grad_()
    k = randn(total, 2, d_qk).requires_grad_()
    v = randn(total, 2, d_v).requires_grad_()
    dout = randn(total, 8, d_v)
    out = flash_attn_varlen_func(q, k, v, cu.cuda(), cu.cuda(), max(lengths), max(lengths))
    grads = torch.autograd.grad(out, (q, k, v), dout)

    def ref(q, k, v, dtype):
        return varlen_attention_ref(q, k, v, cu, cu, max_seqlen_k=max(lengths), compute_dtype=dtype)

    exact = reference_grads(ref, (q, k, v), dout, torch.float64)
    same = reference_grads(ref, (q, k, v), dout, q.dtype)
    check_close(out, exact[0], same[0], "out")
    check_grads(grads, exact[2], same[2])


def backward_with_kernel_names(q, k, v, dout, **kwargs):
    """The gradients of flash_attn_func and the names of the kernels its
    backward ran."""
    out = flash_attn_func(q, k, v, **kwargs)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        grads = torch.autograd.grad(out, (q, k, v), dout)
        torch.cuda.synchronize()
    return out, grads, {event.name for event in prof.events()}


def sm90_backward_kernels(names):
    """(d_qk, block M, block N, d_v, score mods, ordered dQ) of each Hopper
    backward that ran: flash_bwd_sm90_kernel<BwdSm90KernelTraits<d_qk, block M,
    block N, element, stages, stage dQ, d_v>, score mods, ordered dQ>."""
    found = set()
    for name in names:
        match = re.search(
            r"flash_bwd_sm90_kernel<.*?BwdSm90KernelTraits<(\d+), (\d+), (\d+), [\w:]+, \d+, "
            r"(?:true|false), (\d+)>, (true|false), (true|false)>",
            name,
        )
        if match:
            found.add(
                (
                    *(int(match[i]) for i in range(1, 5)),
                    match[5] == "true",
                    match[6] == "true",
                )
            )
    return found


@pytest.mark.parametrize(
    "d_qk,d_v,kernel_dims",
    [
        (192, 128, (192, 64, 64, 128)),
        (192, 64, (192, 64, 64, 128)),
        (176, 128, (192, 64, 64, 128)),
        (192, 192, (192, 64, 64, 192)),
        (192, 160, (192, 64, 64, 192)),
        (160, 128, (160, 64, 64, 160)),
        (128, 64, (128, 64, 128, 128)),
    ],
)
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)], ids=["mha", "gqa"])
def test_bwd_pair_kernel_choice_on_sm90(d_qk, d_v, kernel_dims, heads, monkeypatch):
    """By default on sm90, the backward of d_qk in (160, 192] with d_v <= 128
    runs the (192, 128) Hopper backward (dO, V, dV at 128 columns) and every
    other pair the kernel of its compiled d_qk: plain, causal, under GQA, with
    score mods (softcap, ALiBi, dropout: the score-mods variant) and
    deterministic (ordered dQ, bitwise the same twice), its gradients within
    the criterion of the float64 reference."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernels run on sm90 GPUs only")
    monkeypatch.delenv("FLASH_ATTN_FWD_KERNEL", raising=False)
    monkeypatch.delenv("FLASH_ATTN_BWD_KERNEL", raising=False)
    nheads, nheads_k = heads
    q = randn(2, 300, nheads, d_qk).requires_grad_()
    k = randn(2, 317, nheads_k, d_qk).requires_grad_()
    v = randn(2, 317, nheads_k, d_v).requires_grad_()
    dout = randn(2, 300, nheads, d_v)
    for causal in (False, True):
        out, grads, names = backward_with_kernel_names(q, k, v, dout, causal=causal)
        assert sm90_backward_kernels(names) == {(*kernel_dims, False, False)}, names
        assert grads[2].shape == v.shape

        def ref(q, k, v, dtype, causal=causal):
            return attention_ref(q, k, v, causal=causal, compute_dtype=dtype)

        exact = reference_grads(ref, (q, k, v), dout, torch.float64)
        same = reference_grads(ref, (q, k, v), dout, q.dtype)
        check_grads(grads, exact[2], same[2])

    # Deterministic: ordered dQ, bitwise the same twice, within the criterion.
    _, det, names = backward_with_kernel_names(q, k, v, dout, causal=True, deterministic=True)
    assert sm90_backward_kernels(names) == {(*kernel_dims, False, True)}, names
    _, again, _ = backward_with_kernel_names(q, k, v, dout, causal=True, deterministic=True)
    for name, a, b in zip(("dq", "dk", "dv"), det, again):
        assert torch.equal(a, b), name

    def causal_ref(q, k, v, dtype):
        return attention_ref(q, k, v, causal=True, compute_dtype=dtype)

    exact = reference_grads(causal_ref, (q, k, v), dout, torch.float64)
    same = reference_grads(causal_ref, (q, k, v), dout, q.dtype)
    check_grads(det, exact[2], same[2])

    # Softcap and ALiBi against the reference; with dropout too, bitwise
    # repeatable from one forward (same seed), on the score-mods variant.
    alibi = torch.rand(nheads, device="cuda") * 0.3
    _, mods, names = backward_with_kernel_names(
        q, k, v, dout, causal=True, softcap=5.0, alibi_slopes=alibi
    )
    assert sm90_backward_kernels(names) == {(*kernel_dims, True, False)}, names

    def mods_ref(q, k, v, dtype):
        return attention_ref(
            q, k, v, causal=True, softcap=5.0, alibi_slopes=alibi, compute_dtype=dtype
        )

    exact = reference_grads(mods_ref, (q, k, v), dout, torch.float64)
    same = reference_grads(mods_ref, (q, k, v), dout, q.dtype)
    check_grads(mods, exact[2], same[2])
    runs = []
    for _ in range(2):
        torch.manual_seed(5)
        _, dropped, names = backward_with_kernel_names(
            q, k, v, dout, dropout_p=0.1, softcap=5.0, deterministic=True
        )
        assert sm90_backward_kernels(names) == {(*kernel_dims, True, False)}, names
        runs.append(dropped)
    for name, a, b in zip(("dq", "dk", "dv"), *runs):
        assert torch.equal(a, b), name


# ------------------------------------------------------------------ KV cache


@pytest.mark.parametrize("d_qk,d_v", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "paged"])
@pytest.mark.parametrize("num_splits", [1, 0, 7])
@pytest.mark.parametrize("append", [0, 1, 3])
def test_kvcache_in_place_equals_padded(d_qk, d_v, page_size, num_splits, append):
    """v_cache is read in place at d_v columns and the append writes v's d_v
    columns into it; v_cache here is the first d_v columns of a d_qk-wide
    buffer, whose other columns no call may touch."""
    batch, capacity, nheads, nheads_k = 3, 256, 8, 2
    q = randn(batch, 2, nheads, d_qk)
    rows = batch if page_size is None else batch * capacity // page_size
    width = capacity if page_size is None else page_size
    k_cache = randn(rows, width, nheads_k, d_qk)
    v_buffer = randn(rows, width, nheads_k, d_qk)
    v_cache = v_buffer[..., :d_v]
    beyond = v_buffer[..., d_v:].clone()
    table = None
    if page_size is not None:
        table = torch.randperm(rows, device="cuda", dtype=torch.int32).view(batch, -1)
    seqlens = torch.tensor([5, 100, capacity - append], dtype=torch.int32, device="cuda")
    k_new = randn(batch, append, nheads_k, d_qk) if append else None
    v_new = randn(batch, append, nheads_k, d_v) if append else None
    k_before, v_before = k_cache.clone(), v_cache.clone()
    kwargs = dict(cache_seqlens=seqlens, block_table=table, causal=True, num_splits=num_splits)

    out, lse = flash_attn_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, return_softmax_lse=True, **kwargs
    )
    assert out.shape == (batch, 2, nheads, d_v)
    assert v_cache.data_ptr() == v_buffer.data_ptr()
    assert torch.equal(v_buffer[..., d_v:], beyond)

    # The same call on padded copies of the caches from before the call.
    k_padded, v_padded = k_before.clone(), pad(v_before, d_qk)
    out_padded, lse_padded = flash_attn_with_kvcache(
        q,
        k_padded,
        v_padded,
        k_new,
        None if v_new is None else pad(v_new, d_qk),
        return_softmax_lse=True,
        **kwargs,
    )
    assert torch.equal(out, out_padded[..., :d_v])
    assert torch.equal(lse, lse_padded)
    assert torch.equal(k_cache, k_padded)
    assert torch.equal(v_cache, v_padded[..., :d_v])

    # out= gets the same bits.
    out_arg = torch.full_like(out, float("nan"))
    k_cache.copy_(k_before)
    v_cache.copy_(v_before)
    flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, out=out_arg, **kwargs)
    assert torch.equal(out_arg, out)


@pytest.mark.parametrize("num_splits", [1, 0, 5])
@pytest.mark.parametrize("page_size", [None, 64], ids=["contiguous", "paged"])
def test_kvcache_v_as_column_slice_of_k(num_splits, page_size):
    """MLA's absorbed decode: v_cache = k_cache[..., :d_v], many query heads
    over one kv head, read in place (no copy of either)."""
    d_qk, d_v, batch, capacity, nheads = 192, 128, 4, 512, 16
    rows = batch if page_size is None else batch * capacity // page_size
    k_cache = randn(rows, capacity if page_size is None else page_size, 1, d_qk)
    v_cache = k_cache[..., :d_v]
    table = None
    if page_size is not None:
        table = torch.randperm(rows, device="cuda", dtype=torch.int32).view(batch, -1)
    q = randn(batch, 1, nheads, d_qk)
    seqlens = torch.tensor([1, 77, 300, capacity], dtype=torch.int32, device="cuda")
    before = k_cache.clone()
    kwargs = dict(cache_seqlens=seqlens, block_table=table, num_splits=num_splits)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs)
    assert torch.equal(k_cache, before)
    padded = flash_attn_with_kvcache(q, k_cache, pad(v_cache, d_qk), **kwargs)
    assert torch.equal(out, padded[..., :d_v])
    if page_size is not None:
        k_cache = k_cache[table.long()].reshape(batch, capacity, 1, d_qk)
    for b in range(batch):
        n = int(seqlens[b])
        keys = k_cache[b : b + 1, :n]
        exact, _ = attention_ref(q[b : b + 1], keys, keys[..., :d_v])
        same, _ = attention_ref(q[b : b + 1], keys, keys[..., :d_v], compute_dtype=q.dtype)
        check_close(out[b : b + 1], exact, same, "out")
