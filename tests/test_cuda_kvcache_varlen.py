"""CUDA tests of fwd_kvcache's varlen form (FA3's cu_seqlens_q / max_seqlen_q
and cu_seqlens_k_new; semantics in test_cpu_kvcache_varlen.py and
docs/serving.md).

Each case runs the CUDA op on device copies over memory poisoned with NaN,
and is held to the float64 reference (sequence by sequence), to the appended
cache rows the reference expects, and to the CPU op, with one split and with
the split count the plan chooses (the combine kernel then merges the varlen
rows).

Every test here needs a GPU and is skipped with a reason without one.
"""

import math

import pytest
import torch

import flash_attn_cuda
from test_cpu_kvcache_varlen import (
    MODES,
    SCHEMA_POSITIONAL,
    Q_LENS,
    check_against_reference,
    check_caches,
    mode_inputs,
    varlen_inputs,
)
from test_cuda_kvcache import run_cpu, run_cuda, to_device

pytestmark = pytest.mark.cuda

fwd_kvcache = torch.ops.flash_attn.fwd_kvcache

WINDOWS = {"full": (False, (-1, -1)), "causal": (True, (-1, -1)), "local_40_0": (False, (40, 0))}


def inside_sequences(args):
    """Bool (total_q,): rows of q some sequence owns (the others are not
    defined on CUDA)."""
    cu = args["cu_seqlens_q"]
    rows = torch.zeros(args["q"].shape[0], dtype=torch.bool)
    rows[int(cu[0]) : int(cu[-1])] = True
    return rows


def check_all(args, got):
    out, lse, k_after, v_after = got
    assert not torch.isnan(out).any(), "an output element was left unwritten"
    check_against_reference(args, out, lse)
    if args["k"] is not None:
        check_caches(args, k_after, v_after)
    else:
        assert torch.equal(k_after, args["k_cache"]) and torch.equal(v_after, args["v_cache"])
    out_cpu, lse_cpu, k_cpu, v_cpu = run_cpu(args)
    tol = 2e-2 if out.dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(out, out_cpu, atol=tol, rtol=tol)
    finite = torch.isfinite(lse_cpu)
    assert torch.equal(finite, torch.isfinite(lse))
    torch.testing.assert_close(lse[finite], lse_cpu[finite], atol=1e-3, rtol=1e-3)
    # Both paths rotate in fp32 without fused multiply-add and round once.
    assert torch.equal(k_after, k_cpu) and torch.equal(v_after, v_cpu)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("window", list(WINDOWS))
@pytest.mark.parametrize("page_size", [None, 1, 16, 64], ids=["contiguous", "p1", "p16", "p64"])
@pytest.mark.parametrize("num_splits", [1, 0, 3])
def test_matches_reference(mode, window, page_size, num_splits):
    new, rotary = MODES[mode]
    causal, win = WINDOWS[window]
    new_lens = None if new is None else ([3] if new == "fixed" else [2, 0, 0, 70, 4])
    args = varlen_inputs(
        [3, 0, 1, 150, 5],
        new_lens,
        capacity=400,
        heads=(8, 2),
        head_dim=128,
        dtype=torch.bfloat16,
        rotary=rotary,
        page_size=page_size,
        causal=causal,
        window=win,
        varlen_new=new != "fixed",
    )
    args["num_splits"] = num_splits
    check_all(args, run_cuda(args))


@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("heads", [(8, 8), (32, 8), (6, 1)], ids=["mha", "gqa4", "mqa6"])
def test_speculative_decoding_shapes(head_dim, heads):
    """Few query rows per sequence (draft tokens) appended over long caches."""
    q_lens = [4, 1, 5, 0, 3, 4]
    args = varlen_inputs(
        q_lens,
        q_lens,
        capacity=3000,
        heads=heads,
        head_dim=head_dim,
        dtype=torch.float16,
        page_size=16,
        causal=True,
    )
    check_all(args, run_cuda(args))


@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "p16"])
@pytest.mark.parametrize("num_splits", [1, 0])
def test_composes_with_every_feature(page_size, num_splits):
    """cache_batch_idx, cache_leftpad, rotary_seqlens, softcap, (batch, nheads)
    ALiBi, sinks, GQA and out= in one varlen call."""
    args = mode_inputs(
        "varlen_new_rotary_neox",
        "causal",
        page_size=page_size,
        dtype=torch.bfloat16,
        leftpad=True,
        batch_idx=True,
        heads=(8, 2),
        head_dim=64,
        capacity=200,
    )
    batch = len(Q_LENS)
    args["softcap"] = 3.0
    args["alibi_slopes"] = torch.rand(batch, 8) * 0.3
    args["rotary_seqlens"] = torch.randint(0, 10, (batch,), dtype=torch.int32)
    args["num_splits"] = num_splits
    sink = torch.randn(8)
    call = to_device(args)
    out = torch.full(call["q"].shape, math.nan, dtype=torch.bfloat16, device="cuda")
    lse = torch.ops.flash_attn.fwd_kvcache_out(
        *[call[n] for n in SCHEMA_POSITIONAL],
        out=out,
        learnable_sink=sink.cuda(),
        rotary_seqlens=call["rotary_seqlens"],
        cu_seqlens_q=call["cu_seqlens_q"],
        cu_seqlens_k_new=call["cu_seqlens_k_new"],
        max_seqlen_q=call["max_seqlen_q"],
    )
    check_against_reference(dict(args, learnable_sink=sink), out.cpu(), lse.cpu())
    check_caches(args, call["k_cache"].cpu(), call["v_cache"].cpu())


def test_flash_attn_with_kvcache_chunked_prefill():
    """The public function: a chunk of prefill beside decode rows, paged."""
    args = varlen_inputs(
        [200, 1, 1, 7],
        [200, 1, 1, 7],
        capacity=1024,
        heads=(16, 4),
        head_dim=128,
        dtype=torch.bfloat16,
        rotary="neox",
        page_size=64,
        causal=True,
    )
    call = to_device(args)
    out, lse = flash_attn_cuda.flash_attn_with_kvcache(
        call["q"],
        call["k_cache"],
        call["v_cache"],
        k=call["k"],
        v=call["v"],
        rotary_cos=call["rotary_cos"],
        rotary_sin=call["rotary_sin"],
        cache_seqlens=call["cache_seqlens"],
        block_table=call["block_table"],
        causal=True,
        rotary_interleaved=False,
        return_softmax_lse=True,
        cu_seqlens_q=call["cu_seqlens_q"],
        cu_seqlens_k_new=call["cu_seqlens_k_new"],
        max_seqlen_q=call["max_seqlen_q"],
    )
    check_against_reference(args, out.cpu(), lse.cpu())
    check_caches(args, call["k_cache"].cpu(), call["v_cache"].cpu())


def test_head_dim_v_smaller():
    args = mode_inputs("varlen_new", "causal", page_size=16, batch_idx=True, dtype=torch.bfloat16)
    args["v_cache"] = args["v_cache"][..., :16].contiguous()
    args["v"] = args["v"][..., :16].contiguous()
    out, lse, k_after, v_after = run_cuda(args)
    out_cpu, lse_cpu, k_cpu, v_cpu = run_cpu(args)
    torch.testing.assert_close(out, out_cpu, atol=2e-2, rtol=2e-2)
    assert torch.equal(k_after, k_cpu) and torch.equal(v_after, v_cpu)


def test_cuda_graph_capture():
    """A varlen step replays from a CUDA graph (no host read of the offsets)."""
    args = to_device(mode_inputs("varlen_new", "causal", page_size=16, dtype=torch.bfloat16))
    static = dict(args)
    fwd_kvcache(
        **dict(static, k_cache=static["k_cache"].clone(), v_cache=static["v_cache"].clone())
    )
    k_cache, v_cache = static["k_cache"].clone(), static["v_cache"].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = fwd_kvcache(**dict(static, k_cache=k_cache, v_cache=v_cache))
    k_cache.copy_(args["k_cache"])
    v_cache.copy_(args["v_cache"])
    graph.replay()
    torch.cuda.synchronize()
    ref_out, ref_lse = fwd_kvcache(
        **dict(args, k_cache=args["k_cache"].clone(), v_cache=args["v_cache"].clone())
    )
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


BAD_VALUES = {  # changes, message (the CPU path's)
    "cu_q_decreasing": (
        {"cu_seqlens_q": [0, 3, 0, 4, 11, 16]},
        r"^fwd_kvcache: cu_seqlens_q must be non-decreasing, got cu_seqlens_q\[1\] = 3 > "
        r"cu_seqlens_q\[2\] = 0",
    ),
    "cu_q_past_rows": (
        {"cu_seqlens_q": [0, 3, 3, 4, 11, 17]},
        r"cu_seqlens_q\[5\] = 17 exceeds the number of rows of its tensor \(16\)",
    ),
    "cu_q_longer_than_max": (
        {"max_seqlen_q": 6},
        r"sequence 3 has length 7 according to cu_seqlens_q, more than the max_seqlen given",
    ),
    "cu_new_negative": (
        {"cu_seqlens_k_new": [-1, 2, 2, 2, 9, 13]},
        r"cu_seqlens_k_new\[0\] must be >= 0, got -1",
    ),
    "cu_new_past_rows": (
        {"cu_seqlens_k_new": [0, 2, 2, 2, 9, 14]},
        r"cu_seqlens_k_new\[5\] = 14 exceeds the number of rows of its tensor \(13\)",
    ),
    "append_past_cache": (
        {"cache_seqlens": [0, 0, 0, 60, 0]},
        r"cache_seqlens\[3\] \+ seqlen_new = 60 \+ 7 must fit in the cache",
    ),
}


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_bad_values_raise_like_the_cpu_path(case):
    changes, message = BAD_VALUES[case]
    # No rotary and empty caches: the one bad value is the only error, on
    # the device too (where the first recorded one is raised).
    args = mode_inputs("varlen_new", "causal", page_size=16, capacity=64, dtype=torch.bfloat16)
    args["cache_seqlens"] = torch.zeros(len(Q_LENS), dtype=torch.int32)
    for name, values in changes.items():
        args[name] = values if isinstance(values, int) else torch.tensor(values, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=message):
        run_cpu(args)
    previous = flash_attn_cuda.set_sync_index_checks(True)
    try:
        with pytest.raises(RuntimeError, match=message):
            fwd_kvcache(**to_device(args))
    finally:
        flash_attn_cuda.set_sync_index_checks(previous)
