"""CUDA tests of FA3's call shapes of fwd_kvcache: block_table with cache_leftpad,
block_table with cache_batch_idx, and rotary_seqlens (semantics in
test_cpu_kvcache_fa3_shapes.py and docs/serving.md).

Each case runs the CUDA op on device copies and is held to the float64
reference and to the CPU op (test_cuda_kvcache.py's check_all), with one split
and with the split count the plan chooses, so that both the append / rotary
pre-kernel and the split-KV kernel's own append are exercised.

Every test here needs a GPU and is skipped with a reason without one.
"""

import pytest
import torch

import flash_attn_cuda
from test_cpu_kvcache import MODES, make_inputs, page_cache
from test_cuda_kvcache import check_all, run_cuda, to_device

pytestmark = pytest.mark.cuda

WINDOWS = {  # causal, (left, right)
    "full": (False, (-1, -1)),
    "causal": (True, (-1, -1)),
    "local_40_0": (False, (40, 0)),
}


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("window", list(WINDOWS))
@pytest.mark.parametrize("num_splits", [1, 0])
def test_paged_leftpad(page_size, mode, window, num_splits):
    seqlen_new, rotary = MODES[mode]
    causal, (left, right) = WINDOWS[window]
    args = make_inputs(
        batch=4,
        seqlen_q=3,
        capacity=300,
        nheads=8,
        nheads_k=2,
        head_dim=64,
        dtype=torch.bfloat16,
        seqlen_new=seqlen_new,
        rotary=rotary,
        leftpad=True,
        page_size=page_size,
        causal=causal,
        window=(left, right),
    )
    args["cache_leftpad"][0] = 0
    args["cache_leftpad"][1] = args["cache_seqlens"][1]
    args["num_splits"] = num_splits
    check_all(args, run_cuda(args), seqlen_new, rotary)


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("mode", ["no_new", "new", "new_rotary_interleaved", "new_rotary_neox"])
@pytest.mark.parametrize("leftpad", [False, True], ids=["no_pad", "leftpad"])
@pytest.mark.parametrize("num_splits", [1, 0])
def test_paged_cache_batch_idx(page_size, mode, leftpad, num_splits):
    seqlen_new, rotary = MODES[mode]
    args = make_inputs(
        batch=3,
        seqlen_q=2,
        capacity=256,
        nheads=8,
        nheads_k=2,
        head_dim=128,
        dtype=torch.bfloat16,
        batch_cache=5,
        cache_batch_idx=torch.tensor([4, 0, 2], dtype=torch.int32),
        seqlen_new=seqlen_new,
        rotary=rotary,
        leftpad=leftpad,
        causal=True,
    )
    page_cache(args, page_size)
    args["num_splits"] = num_splits
    got = run_cuda(args)
    check_all(args, got, seqlen_new, rotary)


@pytest.mark.parametrize("rotary", ["interleaved", "neox"])
@pytest.mark.parametrize("window", list(WINDOWS))
@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "paged16"])
@pytest.mark.parametrize("seqlen_q", [1, 4])
@pytest.mark.parametrize("num_splits", [1, 0])
def test_rotary_seqlens(rotary, window, page_size, seqlen_q, num_splits):
    causal, (left, right) = WINDOWS[window]
    args = make_inputs(
        batch=3,
        seqlen_q=seqlen_q,
        capacity=192,
        nheads=8,
        nheads_k=2,
        head_dim=128,
        dtype=torch.bfloat16,
        seqlen_new=2,
        rotary=rotary,
        leftpad=True,
        page_size=page_size,
        causal=causal,
        window=(left, right),
    )
    room = max(2, seqlen_q)
    args["rotary_seqlens"] = torch.tensor([0, 192 - room, 37], dtype=torch.int32)
    args["num_splits"] = num_splits
    check_all(args, run_cuda(args), 2, rotary)


BAD_VALUES = {
    # name: (changes, message)
    "rotary_seqlens_negative": (
        {"rotary_seqlens": [0, -3]},
        r"rotary_seqlens\[1\] = -3 must be >= 0",
    ),
    "rotary_seqlens_past_table": (
        {"rotary_seqlens": [64, 0]},
        r"batch 0 needs position 64 \(its positions start at rotary_seqlens\[0\] = 64\)",
    ),
    "paged_leftpad_past_end": (
        {"cache_leftpad": [0, 9], "cache_seqlens": [3, 5]},
        r"cache_leftpad\[1\] = 9 must be in \[0, cache_seqlens\[1\] = 5\]",
    ),
    "paged_batch_idx_past_table": (
        {"cache_batch_idx": [0, 2]},
        r"cache_batch_idx\[1\] = 2 must be in \[0, 2\) \(the rows of block_table",
    ),
}


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_bad_values_raise_like_the_cpu_path(case):
    changes, message = BAD_VALUES[case]
    args = make_inputs(
        batch=2,
        seqlen_q=1,
        capacity=64,
        nheads=4,
        nheads_k=2,
        head_dim=64,
        dtype=torch.bfloat16,
        seqlen_new=1,
        rotary="neox",
        page_size=16,
    )
    for name, values in changes.items():
        args[name] = torch.tensor(values, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.flash_attn.fwd_kvcache(**args)
    previous = flash_attn_cuda.set_sync_index_checks(True)
    try:
        call = to_device(args)
        with pytest.raises(RuntimeError, match=message):
            torch.ops.flash_attn.fwd_kvcache(**call)
    finally:
        flash_attn_cuda.set_sync_index_checks(previous)
