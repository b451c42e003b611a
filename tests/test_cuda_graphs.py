"""CUDA graph capture of the generation paths, and no host synchronisation in them.

A serving engine captures its decode step in a CUDA graph and replays it with
new inputs copied into the captured buffers: the calls must take no host-side
look at device data (a synchronisation, which capture refuses), keep their
launch configuration to the shapes, and leave every step's result equal to an
eager call's. Each test runs the same steps eagerly and as replays of one
captured step (capture_error_mode "global": a synchronising call in capture
fails it) and compares results and caches exactly: the same kernels run on the
same inputs.

Also checked: with torch's sync debug mode set to "error", the eager calls of
each generation entry point issue no synchronising torch call.

Every test here needs a GPU and is skipped with a reason without one.
"""

import contextlib
import functools

import pytest
import torch
import torch.nn.functional as F

import flash_attn_cuda
from flash_attn_cuda.integrations import sdpa

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
DTYPE = torch.bfloat16
BATCH, HEADS, KV_HEADS, HEAD_DIM = 3, 8, 2, 128
CAPACITY, PAGE = 256, 16
STEPS = 4


def capture(step):
    """A CUDA graph of step() after warm-up calls on a side stream (torch's recipe:
    the first calls set up what capture must not, e.g. the index-check record)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def rand(*shape):
    return torch.randn(*shape, device=DEVICE, dtype=DTYPE)


def decode_inputs(paged, rotary):
    """Caches (contiguous or shuffled pages), per-sequence lengths and STEPS steps of
    new q / k / v; optionally rotary tables."""
    k_cache, v_cache = (
        rand(BATCH, CAPACITY, KV_HEADS, HEAD_DIM),
        rand(BATCH, CAPACITY, KV_HEADS, HEAD_DIM),
    )
    block_table = None
    if paged:
        pages = CAPACITY // PAGE
        order = torch.randperm(BATCH * pages + 2, device=DEVICE)[: BATCH * pages]
        k_paged = rand(BATCH * pages + 2, PAGE, KV_HEADS, HEAD_DIM)
        v_paged = rand(BATCH * pages + 2, PAGE, KV_HEADS, HEAD_DIM)
        k_paged[order] = k_cache.reshape(-1, PAGE, KV_HEADS, HEAD_DIM)
        v_paged[order] = v_cache.reshape(-1, PAGE, KV_HEADS, HEAD_DIM)
        k_cache, v_cache = k_paged, v_paged
        block_table = order.view(BATCH, pages).to(torch.int32)
    seqlens = torch.tensor([5, 77, 190], dtype=torch.int32, device=DEVICE)
    steps = [
        (
            rand(BATCH, 1, HEADS, HEAD_DIM),
            rand(BATCH, 1, KV_HEADS, HEAD_DIM),
            rand(BATCH, 1, KV_HEADS, HEAD_DIM),
        )
        for _ in range(STEPS)
    ]
    rotary_args = {}
    if rotary:
        angle = torch.rand(CAPACITY, HEAD_DIM // 4, device=DEVICE) * 6.28
        rotary_args = dict(rotary_cos=angle.cos().to(DTYPE), rotary_sin=angle.sin().to(DTYPE))
    return k_cache, v_cache, block_table, seqlens, steps, rotary_args


@pytest.mark.parametrize("num_splits", [0, 1])
@pytest.mark.parametrize("rotary", [False, True], ids=["plain", "rotary"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_kvcache_decode_step_replays_like_eager(paged, rotary, num_splits):
    k_cache, v_cache, block_table, seqlens, steps, rotary_args = decode_inputs(paged, rotary)
    kwargs = dict(
        block_table=block_table, causal=True, num_splits=num_splits, return_softmax_lse=True
    )
    kwargs.update(rotary_args)

    # Eager: append + attend, then advance the lengths on the device.
    k_eager, v_eager, lens_eager = k_cache.clone(), v_cache.clone(), seqlens.clone()
    eager = []
    for q, k, v in steps:
        out, lse = flash_attn_cuda.flash_attn_with_kvcache(
            q, k_eager, v_eager, k, v, cache_seqlens=lens_eager, **kwargs
        )
        lens_eager += 1
        eager.append((out.clone(), lse.clone()))

    # Graph: one captured step (attention and the length update) on static buffers.
    k_graph, v_graph, lens_graph = k_cache.clone(), v_cache.clone(), seqlens.clone()
    q_in, k_in, v_in = (t.clone() for t in steps[0])
    result = {}

    def step():
        result["out"], result["lse"] = flash_attn_cuda.flash_attn_with_kvcache(
            q_in, k_graph, v_graph, k_in, v_in, cache_seqlens=lens_graph, **kwargs
        )
        lens_graph.add_(1)

    graph = capture(step)
    # The warm-up and the capture ran the step; start again from the same state.
    k_graph.copy_(k_cache)
    v_graph.copy_(v_cache)
    lens_graph.copy_(seqlens)
    for (q, k, v), (out, lse) in zip(steps, eager):
        q_in.copy_(q)
        k_in.copy_(k)
        v_in.copy_(v)
        graph.replay()
        assert torch.equal(result["out"], out)
        assert torch.equal(result["lse"], lse)
    torch.cuda.synchronize()
    assert torch.equal(lens_graph, lens_eager)
    assert torch.equal(k_graph, k_eager)
    assert torch.equal(v_graph, v_eager)


def test_kvcache_decode_step_with_out_replays_like_eager():
    # A serving engine also keeps the output buffer static (out=).
    k_cache, v_cache, _, seqlens, steps, _ = decode_inputs(paged=False, rotary=False)
    k_eager, v_eager, lens_eager = k_cache.clone(), v_cache.clone(), seqlens.clone()
    eager = []
    for q, k, v in steps:
        out = flash_attn_cuda.flash_attn_with_kvcache(
            q, k_eager, v_eager, k, v, cache_seqlens=lens_eager, causal=True
        )
        lens_eager += 1
        eager.append(out)
    k_graph, v_graph, lens_graph = k_cache.clone(), v_cache.clone(), seqlens.clone()
    q_in, k_in, v_in = (t.clone() for t in steps[0])
    out_buffer = torch.empty_like(q_in)

    def step():
        flash_attn_cuda.flash_attn_with_kvcache(
            q_in,
            k_graph,
            v_graph,
            k_in,
            v_in,
            cache_seqlens=lens_graph,
            causal=True,
            out=out_buffer,
        )
        lens_graph.add_(1)

    graph = capture(step)
    k_graph.copy_(k_cache)
    v_graph.copy_(v_cache)
    lens_graph.copy_(seqlens)
    for (q, k, v), out in zip(steps, eager):
        q_in.copy_(q)
        k_in.copy_(k)
        v_in.copy_(v)
        graph.replay()
        assert torch.equal(out_buffer, out)


@functools.cache
def one_row_per_sequence():
    return torch.arange(BATCH + 1, dtype=torch.int32, device=DEVICE)


def paged_varlen_decode(q, k_cache, v_cache, block_table, used):
    """One decode step in vLLM's form: flash_attn_varlen_func over pages, one
    query row per sequence, seqused_k on the device and cu_seqlens_k None;
    max_seqlen_k is the static bound. cu_seqlens_q is made once, outside any
    capture or synchronisation check, as an engine keeps it."""
    return flash_attn_cuda.flash_attn_varlen_func(
        q.view(BATCH, HEADS, HEAD_DIM),
        k_cache,
        v_cache,
        one_row_per_sequence(),
        None,
        1,
        CAPACITY,
        causal=True,
        block_table=block_table,
        seqused_k=used,
    )


def test_paged_varlen_decode_step_replays_like_eager():
    # vLLM's form: flash_attn_varlen_func over pages, seqused_k on the device and
    # cu_seqlens_k None; max_seqlen_k is the static bound.
    k_cache, v_cache, block_table, seqlens, steps, _ = decode_inputs(paged=True, rotary=False)

    def attend(q, used):
        return paged_varlen_decode(q, k_cache, v_cache, block_table, used)

    lens_eager = seqlens.clone()
    eager = []
    for q, _, _ in steps:
        eager.append(attend(q, lens_eager).clone())
        lens_eager += 1
    q_in, lens_graph = steps[0][0].clone(), seqlens.clone()
    result = {}

    def step():
        result["out"] = attend(q_in, lens_graph)
        lens_graph.add_(1)

    graph = capture(step)
    lens_graph.copy_(seqlens)
    for (q, _, _), out in zip(steps, eager):
        q_in.copy_(q)
        graph.replay()
        assert torch.equal(result["out"], out)


@pytest.mark.parametrize("eager_first", [True, False], ids=["eager_first", "capture_first"])
def test_paged_varlen_capture_reads_the_eager_zero_offsets(eager_first, monkeypatch):
    """vLLM's form captured after an eager call reads the zero key offsets that
    call made (interface._zero_offsets): no fill of them in the graph. A
    capture that finds none makes its own in the graph and leaves the cache
    empty (an eager read of a captured fill would see memory never written).
    Either way a replay equals the eager call."""
    import flash_attn_cuda.interface as interface

    monkeypatch.setattr(interface, "_ZERO_OFFSETS", {})
    k_cache, v_cache, block_table, seqlens, steps, _ = decode_inputs(paged=True, rotary=False)
    q = steps[0][0]
    # The eager call also sets up what capture must not (see capture()).
    expected = paged_varlen_decode(q, k_cache, v_cache, block_table, seqlens).clone()
    if not eager_first:
        interface._ZERO_OFFSETS.clear()
    result, made = {}, []
    real_zeros_like = torch.zeros_like

    def zeros_like(t, *args, **kwargs):
        made.append(t.dtype)
        return real_zeros_like(t, *args, **kwargs)

    monkeypatch.setattr(torch, "zeros_like", zeros_like)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result["out"] = paged_varlen_decode(q, k_cache, v_cache, block_table, seqlens)
    monkeypatch.setattr(torch, "zeros_like", real_zeros_like)
    assert (torch.int32 in made) != eager_first, made
    assert bool(interface._ZERO_OFFSETS) == eager_first
    graph.replay()
    assert torch.equal(result["out"], expected)


@pytest.mark.parametrize("seqlen_q", [1, 64])
def test_flash_attn_func_replays_like_eager(seqlen_q):
    q, k, v = (
        rand(BATCH, seqlen_q, HEADS, HEAD_DIM),
        rand(BATCH, 200, KV_HEADS, HEAD_DIM),
        rand(BATCH, 200, KV_HEADS, HEAD_DIM),
    )
    q_in, k_in, v_in = q.clone(), k.clone(), v.clone()
    result = {}

    def step():
        result["out"] = flash_attn_cuda.flash_attn_func(q_in, k_in, v_in, causal=True)

    graph = capture(step)
    for _ in range(2):
        q_new, k_new, v_new = rand(*q.shape), rand(*k.shape), rand(*v.shape)
        q_in.copy_(q_new)
        k_in.copy_(k_new)
        v_in.copy_(v_new)
        graph.replay()
        expected = flash_attn_cuda.flash_attn_func(q_new, k_new, v_new, causal=True)
        assert torch.equal(result["out"], expected)


@contextlib.contextmanager
def provider_active():
    if not sdpa.registry_available():
        pytest.skip(f"torch {torch.__version__} has no flash-attention registry")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.nn.attention.activate_flash_attention_impl(sdpa.PROVIDER_NAME)
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            yield
    finally:
        torch.nn.attention.restore_flash_attention_impl()


@pytest.mark.parametrize("seqlen_q", [1, 64])
def test_sdpa_provider_replays_like_eager(seqlen_q):
    # transformers' SDPA decode: (batch, heads, seqlen, head_dim) views of
    # (batch, seqlen, heads, head_dim) projections.
    # One query row decodes over a cache; a prompt attends causally to itself
    # (torch refuses is_causal with seqlen_q != seqlen_k before any provider).
    seqlen_k = 200 if seqlen_q == 1 else seqlen_q
    q = rand(BATCH, seqlen_q, HEADS, HEAD_DIM).transpose(1, 2)
    k, v = rand(BATCH, HEADS, seqlen_k, HEAD_DIM), rand(BATCH, HEADS, seqlen_k, HEAD_DIM)
    q_in, k_in, v_in = q.clone(), k.clone(), v.clone()  # clone keeps q's strides
    result = {}
    causal = seqlen_q > 1

    def step():
        result["out"] = F.scaled_dot_product_attention(q_in, k_in, v_in, is_causal=causal)

    with provider_active():
        graph = capture(step)
        q_new = rand(*q.shape)
        q_in.copy_(q_new)
        graph.replay()
        replayed = result["out"].clone()
        expected = F.scaled_dot_product_attention(q_in, k_in, v_in, is_causal=causal)
    assert torch.equal(replayed, expected)


def test_generation_calls_do_not_synchronise():
    k_cache, v_cache, block_table, seqlens, steps, _ = decode_inputs(paged=True, rotary=False)
    q, k, v = steps[0]
    k_flat, v_flat = rand(BATCH, 100, KV_HEADS, HEAD_DIM), rand(BATCH, 100, KV_HEADS, HEAD_DIM)
    calls = {
        "with_kvcache_paged": lambda: flash_attn_cuda.flash_attn_with_kvcache(
            q, k_cache, v_cache, k, v, cache_seqlens=seqlens, block_table=block_table, causal=True
        ),
        "with_kvcache": lambda: flash_attn_cuda.flash_attn_with_kvcache(
            q, k_flat, v_flat, k, v, cache_seqlens=seqlens % 90, causal=True
        ),
        "func": lambda: flash_attn_cuda.flash_attn_func(q, k_flat, v_flat, causal=True),
        "varlen_paged": lambda: paged_varlen_decode(q, k_cache, v_cache, block_table, seqlens),
    }
    for call in calls.values():
        call()  # first calls set up per-device state
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for name, call in calls.items():
            try:
                call()
            except RuntimeError as exc:
                raise AssertionError(f"{name} synchronised with the device: {exc}") from exc
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()


def test_sdpa_provider_does_not_synchronise():
    q = rand(BATCH, 1, HEADS, HEAD_DIM).transpose(1, 2)
    k, v = rand(BATCH, HEADS, 200, HEAD_DIM), rand(BATCH, HEADS, 200, HEAD_DIM)
    with provider_active():
        F.scaled_dot_product_attention(q, k, v)  # the first call sets up per-device state
        torch.cuda.synchronize()
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            F.scaled_dot_product_attention(q, k, v)
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()
