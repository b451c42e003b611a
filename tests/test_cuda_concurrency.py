"""Concurrent calls give the results of serial calls, bit for bit.

Each test builds two independent workloads ("lanes", with inputs of their
own), computes every lane's results serially on the current stream, then
issues the same calls again many times

* interleaved on two torch.cuda.Streams from one thread (iteration t of both
  lanes before iteration t + 1 of either), and
* from two Python threads, each looping over its lane on a stream of its own,

and compares every result with the serial one bitwise. The forward pass is
deterministic, and the backward pass is with deterministic=True, so any
difference means that concurrent calls share state they should not (a
workspace, a counter, a cached buffer) or that a kernel reads memory another
stream is writing. Covered: flash_attn_func and flash_attn_varlen_func
(forward and backward), and flash_attn_with_kvcache appending into each lane's
own caches, contiguous and paged, with the split-KV kernel chosen by the
launcher or forced.

Stream hygiene as torch documents it: side streams wait for the stream that
wrote their inputs, the current stream waits for the side streams before it
reads their results, and record_stream marks every cross-stream use so that
the caching allocator does not hand memory back early.

Head dims 64 and 128 in bf16 only, which every build (also a reduced one) has.
Every test here needs a GPU and is skipped with a reason without one.
"""

import threading

import pytest
import torch

import flash_attn_cuda
from cuda_inputs import DEVICE, random_cu_seqlens, random_qkv

pytestmark = pytest.mark.cuda

DTYPE = torch.bfloat16
HEAD_DIMS = [64, 128]
ITERATIONS = 24
MODES = ["streams", "threads"]


class Lane:
    """One workload: `run()` issues its calls on the current stream and
    returns its result tensors, named by `names`; `inputs` are the tensors it
    reads that were made on the stream that built the lane."""

    def __init__(self, run, inputs, names):
        self.run = run
        self.inputs = [t for t in inputs if isinstance(t, torch.Tensor)]
        self.names = names


def _record_use(tensors, stream):
    for t in tensors:
        t.record_stream(stream)


def _finish(streams, lanes, results):
    """The current stream waits for the side streams, and every tensor that
    crossed between streams records its use on the other one."""
    current = torch.cuda.current_stream()
    for stream in streams:
        current.wait_stream(stream)
    for stream, lane, lane_results in zip(streams, lanes, results):
        _record_use(lane.inputs, stream)
        for tensors in lane_results:
            _record_use(tensors, current)


def run_interleaved_on_streams(lanes, iterations):
    current = torch.cuda.current_stream()
    streams = [torch.cuda.Stream() for _ in lanes]
    for stream in streams:
        stream.wait_stream(current)  # the lanes' inputs were written on `current`
    results = [[] for _ in lanes]
    for _ in range(iterations):
        for lane, stream, lane_results in zip(lanes, streams, results):
            with torch.cuda.stream(stream):
                lane_results.append(lane.run())
    _finish(streams, lanes, results)
    return results


def run_in_threads(lanes, iterations):
    current = torch.cuda.current_stream()
    streams = [torch.cuda.Stream() for _ in lanes]
    for stream in streams:
        stream.wait_stream(current)
    results = [[] for _ in lanes]
    errors = []
    start = threading.Barrier(len(lanes))

    def work(index):
        try:
            torch.cuda.set_device(current.device)  # a new thread starts on device 0
            with torch.cuda.stream(streams[index]):
                start.wait()
                for _ in range(iterations):
                    results[index].append(lanes[index].run())
        except BaseException as error:  # re-raised in the test's thread
            errors.append(error)
            start.abort()

    threads = [threading.Thread(target=work, args=(i,), name=f"lane{i}") for i in range(len(lanes))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(thread.is_alive() for thread in threads), "a lane's thread did not finish"
    if errors:
        raise errors[0]
    _finish(streams, lanes, results)
    return results


RUNNERS = {"streams": run_interleaved_on_streams, "threads": run_in_threads}


def _bits(t):
    t = t.detach().contiguous()
    return t.view(torch.uint8) if t.numel() else t


def assert_bitwise_equal(got, want, what):
    assert got.shape == want.shape and got.dtype == want.dtype, (
        f"{what}: {tuple(got.shape)} {got.dtype} vs serial {tuple(want.shape)} {want.dtype}"
    )
    if not torch.equal(_bits(got), _bits(want)):
        diff = (got.float() - want.float()).abs()
        diff = diff[~diff.isnan()]
        raise AssertionError(
            f"{what} differs from the serial call: {int((_bits(got) != _bits(want)).sum())} "
            f"bytes differ, max |diff| {diff.max().item() if diff.numel() else 'nan'}"
        )


def check_concurrent_matches_serial(lanes, mode, iterations=ITERATIONS):
    serial = [lane.run() for lane in lanes]
    torch.cuda.synchronize()
    results = RUNNERS[mode](lanes, iterations)
    torch.cuda.synchronize()
    for lane_index, (lane, want, lane_results) in enumerate(zip(lanes, serial, results)):
        assert len(lane_results) == iterations
        for iteration, got in enumerate(lane_results):
            assert len(got) == len(want) == len(lane.names)
            for name, g, w in zip(lane.names, got, want):
                assert_bitwise_equal(
                    g, w, f"{mode}: lane {lane_index}, iteration {iteration}, {name}"
                )


# ---------------------------------------------------------------------------
# flash_attn_func, forward and backward
# ---------------------------------------------------------------------------


def fixed_length_lane(head_dim, causal, seqlen_q, seqlen_k, nheads=4, nheads_k=2, batch=2):
    q, k, v = random_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, DTYPE)
    for t in (q, k, v):
        t.requires_grad_()
    dout = torch.randn_like(q)

    def run():
        out, lse, _ = flash_attn_cuda.flash_attn_func(
            q, k, v, causal=causal, deterministic=True, return_attn_probs=True
        )
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
        return out.detach(), lse, dq, dk, dv

    return Lane(run, [q, k, v, dout], ["out", "lse", "dq", "dk", "dv"])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_flash_attn_func_concurrent(head_dim, causal, mode):
    # Lanes of different shapes, so that a result written to the wrong place
    # shows: one that fills the GPU and one of a few blocks, whose blocks run
    # beside the first one's.
    lanes = [
        fixed_length_lane(head_dim, causal, 1000, 1023, nheads=8, nheads_k=2, batch=4),
        fixed_length_lane(head_dim, causal, 173, 301),
    ]
    check_concurrent_matches_serial(lanes, mode)


# ---------------------------------------------------------------------------
# flash_attn_varlen_func, forward and backward
# ---------------------------------------------------------------------------


def varlen_lane(head_dim, causal, batch, max_len, nheads=4, nheads_k=2):
    cu_q, max_q = random_cu_seqlens(batch, max_len)
    cu_k, max_k = random_cu_seqlens(batch, max_len + 37)
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
    q = torch.randn(total_q, nheads, head_dim, device=DEVICE, dtype=DTYPE, requires_grad=True)
    k = torch.randn(total_k, nheads_k, head_dim, device=DEVICE, dtype=DTYPE, requires_grad=True)
    v = torch.randn(total_k, nheads_k, head_dim, device=DEVICE, dtype=DTYPE, requires_grad=True)
    dout = torch.randn_like(q)
    cu_q, cu_k = cu_q.to(DEVICE), cu_k.to(DEVICE)

    def run():
        out, lse, _ = flash_attn_cuda.flash_attn_varlen_func(
            q,
            k,
            v,
            cu_q,
            cu_k,
            max_q,
            max_k,
            causal=causal,
            deterministic=True,
            return_attn_probs=True,
        )
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
        return out.detach(), lse, dq, dk, dv

    return Lane(run, [q, k, v, dout, cu_q, cu_k], ["out", "lse", "dq", "dk", "dv"])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_flash_attn_varlen_func_concurrent(head_dim, causal, mode):
    lanes = [
        varlen_lane(head_dim, causal, batch=6, max_len=900, nheads=8),
        varlen_lane(head_dim, causal, batch=3, max_len=257, nheads=2, nheads_k=1),
    ]
    check_concurrent_matches_serial(lanes, mode)


# ---------------------------------------------------------------------------
# flash_attn_with_kvcache, appending into each lane's own caches
# ---------------------------------------------------------------------------


def kvcache_lane(
    head_dim,
    paged,
    num_splits,
    batch,
    seqlen_cache,
    nheads=8,
    nheads_k=2,
    seqlen_q=1,
    seqlen_new=1,
    page_size=64,
):
    q = torch.randn(batch, seqlen_q, nheads, head_dim, device=DEVICE, dtype=DTYPE)
    k_new = torch.randn(batch, seqlen_new, nheads_k, head_dim, device=DEVICE, dtype=DTYPE)
    v_new = torch.randn_like(k_new)
    # Room for the append: each sequence's valid rows end before the cache does.
    cache_seqlens = torch.randint(
        1, seqlen_cache - seqlen_new + 1, (batch,), dtype=torch.int32, device=DEVICE
    )
    if paged:
        pages_per_seq = seqlen_cache // page_size
        num_pages = batch * pages_per_seq + 3  # some pages belong to no sequence
        k_cache = torch.randn(num_pages, page_size, nheads_k, head_dim, device=DEVICE, dtype=DTYPE)
        block_table = torch.randperm(num_pages, device=DEVICE)[: batch * pages_per_seq]
        block_table = block_table.to(torch.int32).reshape(batch, pages_per_seq)
    else:
        k_cache = torch.randn(batch, seqlen_cache, nheads_k, head_dim, device=DEVICE, dtype=DTYPE)
        block_table = None
    v_cache = torch.randn_like(k_cache)

    def run():
        # Each call appends into caches of its own; the clones are made on the
        # calling stream, like the call.
        k_cache_call, v_cache_call = k_cache.clone(), v_cache.clone()
        out, lse = flash_attn_cuda.flash_attn_with_kvcache(
            q,
            k_cache_call,
            v_cache_call,
            k=k_new,
            v=v_new,
            cache_seqlens=cache_seqlens,
            block_table=block_table,
            causal=True,
            num_splits=num_splits,
            return_softmax_lse=True,
        )
        return out, lse, k_cache_call, v_cache_call

    return Lane(
        run,
        [q, k_new, v_new, cache_seqlens, k_cache, v_cache, block_table],
        ["out", "lse", "k_cache", "v_cache"],
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("num_splits", [0, 4], ids=["auto_splits", "4_splits"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_flash_attn_with_kvcache_concurrent(head_dim, paged, num_splits, mode):
    lanes = [
        kvcache_lane(head_dim, paged, num_splits, batch=8, seqlen_cache=4096),
        kvcache_lane(
            head_dim,
            paged,
            num_splits,
            batch=3,
            seqlen_cache=512,
            nheads=4,
            nheads_k=4,
            seqlen_q=3,
            seqlen_new=3,
        ),
    ]
    check_concurrent_matches_serial(lanes, mode)


@pytest.mark.parametrize("mode", MODES)
def test_mixed_calls_concurrent(mode):
    """A forward + backward lane next to a decoding lane: different kernels,
    and their workspaces, at the same time."""
    lanes = [
        fixed_length_lane(128, True, 300, 300),
        kvcache_lane(128, True, 0, batch=4, seqlen_cache=2048),
    ]
    check_concurrent_matches_serial(lanes, mode)
