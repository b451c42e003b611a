"""CUDA tests of torch.ops.flash_attn.fwd_kvcache (flash_attn_with_kvcache semantics).

Inputs are drawn on the CPU with the helpers of test_cpu_kvcache.py, then the
CUDA op runs on device copies and the CPU op on host copies of the same
tensors (each on its own clone of the caches, which both ops write in place).
Outputs are held to the correctness criterion (docs/architecture.md) against the
float64 reference and compared with the CPU op; the caches after the append are compared with the
expected contents and with the CPU op's.

Every test here needs a GPU and is skipped with a reason without one.
"""

import math

import pytest
import torch

import flash_attn_cuda
from test_cpu_kvcache import (
    check_against_reference,
    check_caches,
    make_inputs,
    op_args,
    page_cache,
    unpage,
)

pytestmark = pytest.mark.cuda

DEVICE = "cuda"
fwd_kvcache = torch.ops.flash_attn.fwd_kvcache

DTYPES = [torch.bfloat16, torch.float16]
DTYPE_IDS = ["bf16", "fp16"]
MODES = {  # seqlen_new, rotary
    "no_new": (0, None),
    "new": (3, None),
    "new_rotary_interleaved": (3, "interleaved"),
    "new_rotary_neox": (3, "neox"),
}


def to_device(args, device=DEVICE):
    return {
        name: value.to(device) if isinstance(value, torch.Tensor) else value
        for name, value in args.items()
    }


def poison_allocator(nbytes=1 << 26):
    """Leaves NaN in soon-to-be-reused cached memory, so an output element the
    kernels forget to write shows up."""
    blob = torch.full((nbytes // 4,), float("nan"), device=DEVICE)
    del blob


def run_cuda(args, **overrides):
    """Runs the CUDA op on device copies; returns host (out, lse, k_cache, v_cache)."""
    call = to_device(dict(args, **overrides))
    poison_allocator()
    out, lse = fwd_kvcache(**call)
    torch.cuda.synchronize()
    return out.cpu(), lse.cpu(), call["k_cache"].cpu(), call["v_cache"].cpu()


def run_cpu(args, **overrides):
    call = dict(args, **overrides)
    call["k_cache"] = call["k_cache"].clone()
    call["v_cache"] = call["v_cache"].clone()
    out, lse = fwd_kvcache(**call)
    return out, lse, call["k_cache"], call["v_cache"]


def check_matches_cpu_op(args, got, rotary):
    """CUDA and CPU results of the same call: outputs within rounding of each
    other, appended cache rows identical (rotary included: both rotate in fp32
    without fused multiply-add and round once)."""
    out, lse, k_after, v_after = got
    out_cpu, lse_cpu, k_cpu, v_cpu = run_cpu(args)
    tol = 2e-2 if out.dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(out, out_cpu, atol=tol, rtol=tol)
    finite = torch.isfinite(lse_cpu)
    assert torch.equal(finite, torch.isfinite(lse))
    torch.testing.assert_close(lse[finite], lse_cpu[finite], atol=1e-3, rtol=1e-3)
    assert torch.equal(v_after, v_cpu)
    if rotary:
        # One rounding of the same fp32 value: at most one ulp apart.
        torch.testing.assert_close(k_after, k_cpu, atol=0, rtol=1e-2)
    else:
        assert torch.equal(k_after, k_cpu)


def check_all(args, got, seqlen_new, rotary):
    out, lse, k_after, v_after = got
    assert not torch.isnan(out).any(), "an output element was left unwritten"
    check_against_reference(args, out, lse)
    if seqlen_new:
        check_caches(args, k_after, v_after)
    else:
        assert torch.equal(k_after, args["k_cache"]) and torch.equal(v_after, args["v_cache"])
    check_matches_cpu_op(args, got, rotary)


# ----------------------------------------------------------------------------
# decode against the reference and the CPU op


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("heads", [(8, 8), (32, 8), (6, 1)], ids=["mha", "gqa4", "mqa6"])
@pytest.mark.parametrize("seqlen_q", [1, 3, 16])
def test_matches_reference(dtype, causal, mode, heads, seqlen_q):
    seqlen_new, rotary = MODES[mode]
    args = make_inputs(
        batch=3,
        seqlen_q=seqlen_q,
        capacity=301,
        nheads=heads[0],
        nheads_k=heads[1],
        head_dim=128,
        dtype=dtype,
        seqlen_new=seqlen_new,
        rotary=rotary,
        causal=causal,
    )
    check_all(args, run_cuda(args), seqlen_new, rotary)


@pytest.mark.parametrize("head_dim", [32, 40, 64, 72, 96, 128, 160, 192, 224, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_head_dims(head_dim, dtype):
    args = make_inputs(
        batch=2,
        seqlen_q=2,
        capacity=203,
        nheads=8,
        nheads_k=2,
        head_dim=head_dim,
        dtype=dtype,
        seqlen_new=2,
        rotary="neox",
        rotary_dim=head_dim // 2 if head_dim % 4 == 0 else head_dim,
        causal=True,
    )
    check_all(args, run_cuda(args), 2, "neox")


@pytest.mark.parametrize("head_dim", [64, 96, 256])
@pytest.mark.parametrize("seqlen_q", [2, 3, 4, 5])
@pytest.mark.parametrize("num_splits", [0, 3])
def test_kernel_variant_boundary(head_dim, seqlen_q, num_splits):
    # seqlen_q x 8 query heads per kv head = 16, 24, 32, 40 packed rows: the
    # split-KV kernel's decode variant (warps along the keys) takes up to 16
    # rows at head dims 64 and 128, 32 at 96 and 256; more rows go to the
    # 64-row variant. Both sides of each boundary, with and without splits.
    args = make_inputs(
        batch=2,
        seqlen_q=seqlen_q,
        capacity=333,
        nheads=16,
        nheads_k=2,
        head_dim=head_dim,
        dtype=torch.bfloat16,
        seqlen_new=seqlen_q,
        rotary="neox",
        causal=True,
    )
    check_all(args, run_cuda(args, num_splits=num_splits), seqlen_q, "neox")


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_long_runs_one_block_per_sm(head_dim, num_splits):
    # A contiguous cache whose splits each hold at least 128 key tiles: the
    # op launches the decode variant with shared memory for one block per SM
    # (splitkv_launch_smem_bytes), whose extra bytes the kernel never touches.
    tile = {64: 128, 128: 64, 256: 32}[head_dim]
    capacity = 128 * tile * num_splits + 37
    args = make_inputs(
        batch=2,
        seqlen_q=1,
        capacity=capacity,
        nheads=8,
        nheads_k=2,
        head_dim=head_dim,
        dtype=torch.bfloat16,
        seqlen_new=1,
        rotary="neox",
    )
    args["cache_seqlens"] = torch.tensor([capacity - 1, capacity // 3], dtype=torch.int32)
    check_all(args, run_cuda(args, num_splits=num_splits), 1, "neox")


@pytest.mark.parametrize("num_splits", [0, 1])
@pytest.mark.parametrize(
    "capacity,waves",
    [(300, 2), (1100, 2), (4200, 2), (4200, 5)],
    ids=["few_tiles", "17_tiles", "66_tiles", "66_tiles_5_waves"],
)
def test_grid_beyond_two_blocks_per_sm(num_splits, capacity, waves):
    # More (batch, kv head) items over a contiguous cache than two blocks per
    # SM hold at once: items of fewer than 16 key tiles run two blocks per SM
    # (splitkv_launch_smem_bytes), items of 16-63 tiles the persistent grid,
    # one block per SM (splitkv_grid_blocks), longer items a block each, one
    # per SM, in several waves. The append and rotary: in the attention
    # kernel, but for the persistent grid and grids of more than 4 waves
    # (append_in_attention_fits).
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    batch = (waves * sm_count) // 8 + 1  # 8 kv heads: (waves x SMs) items and a few more
    args = make_inputs(
        batch=batch,
        seqlen_q=1,
        capacity=capacity,
        nheads=32,
        nheads_k=8,
        head_dim=128,
        dtype=torch.bfloat16,
        seqlen_new=1,
        rotary="neox",
    )
    args["cache_seqlens"] = torch.randint(1, capacity, (batch,), dtype=torch.int32)
    check_all(args, run_cuda(args, num_splits=num_splits), 1, "neox")


PERSISTENT_CASES = {  # head_dim, options
    "d64": (64, {}),
    "d96": (96, {}),
    "d128": (128, {}),
    "d256": (256, dict(capacity=1600)),
    "append_rotary_causal": (128, dict(seqlen_new=2, rotary="interleaved", causal=True)),
    "local_seqlen_q4": (128, dict(seqlen_q=4, window=(40, 0))),
    # softcap / ALiBi keep a block per item: the same big grid on that path.
    "softcap_alibi_block_per_item": (128, dict(softcap=4.0, alibi=True)),
    "leftpad_batch_idx": (128, dict(leftpad=True, batch_idx=True)),
}


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("case", list(PERSISTENT_CASES))
def test_persistent_grid(case, num_splits):
    # More work items (batch x kv head x split) over a contiguous cache than
    # two blocks per SM hold, each of 16-63 key tiles of the capacity: one
    # block per SM runs every SM-count-th item (splitkv_grid_blocks), the
    # copies of an item's first tiles in flight while the previous item is
    # finished (splitkv_kernel.h). The lengths mix items without keys, items
    # of one tile (fewer than the stages in flight, so the copy stream runs
    # several items ahead) and items of many tiles; with a window or several
    # splits, items without keys also sit between items with keys.
    head_dim, options = PERSISTENT_CASES[case]
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    # Key tiles per item at d96/d128 (64 keys): 50, or 16 with 3 splits; d64
    # (128 keys) runs persistent with one split; d256 (32 keys, 1600-key
    # cache) 50 or 16. Every case stays under the persistent grid's cap of
    # key tiles per SM (splitkv_grid_blocks).
    nheads_k, capacity = 4, options.get("capacity", 3200)
    batch = 2 * sm_count // nheads_k + 5
    seqlen_new = options.get("seqlen_new", 0)
    rotary = options.get("rotary")
    batch_cache = batch + 3 if options.get("batch_idx") else None
    cache_batch_idx = (
        torch.randperm(batch_cache)[:batch].to(torch.int32) if options.get("batch_idx") else None
    )
    args = make_inputs(
        batch=batch,
        seqlen_q=options.get("seqlen_q", 1),
        capacity=capacity,
        nheads=4 * nheads_k,
        nheads_k=nheads_k,
        head_dim=head_dim,
        dtype=torch.bfloat16,
        seqlen_new=seqlen_new,
        rotary=rotary,
        batch_cache=batch_cache,
        cache_batch_idx=cache_batch_idx,
        causal=options.get("causal", False),
        window=options.get("window", (-1, -1)),
    )
    room = max(seqlen_new, args["q"].shape[1] if rotary else 0)
    lengths = torch.randint(0, capacity - room + 1, (batch,), dtype=torch.int32)
    lengths[:6] = torch.tensor([0, 1, 2, 0, capacity - room, 63], dtype=torch.int32)
    lengths[7::5] = torch.randint(0, 3, lengths[7::5].shape, dtype=torch.int32)
    args["cache_seqlens"] = lengths
    if options.get("leftpad"):
        args["cache_leftpad"] = (lengths * torch.rand(batch)).to(torch.int32)
    if options.get("softcap"):
        args["softcap"] = options["softcap"]
    if options.get("alibi"):
        args["alibi_slopes"] = torch.rand(batch, 4 * nheads_k) * 0.5
    args["num_splits"] = num_splits
    check_all(args, run_cuda(args), seqlen_new, rotary)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize(
    "batch, nheads_k",
    [(3, 2), (2, 8), (3, 1), (5, 3)],
    ids=["clusters_6", "clusters_16", "odd_3", "odd_15"],
)
def test_cluster_launch(batch, nheads_k, num_splits):
    # On sm90 the decode variant over a contiguous cache is launched in
    # clusters of 2 blocks along (batch, kv head) when batch * nheads_k is
    # even, and without clusters when it is odd (splitkv_cluster_x); both
    # must give the same results. Before sm90 there are no clusters.
    capacity = 700
    args = make_inputs(
        batch=batch,
        seqlen_q=1,
        capacity=capacity,
        nheads=4 * nheads_k,
        nheads_k=nheads_k,
        head_dim=128,
        dtype=torch.bfloat16,
        seqlen_new=1,
    )
    args["cache_seqlens"] = torch.randint(1, capacity - 1, (batch,), dtype=torch.int32)
    check_all(args, run_cuda(args, num_splits=num_splits), 1, None)


@pytest.mark.parametrize("profile", ["rising", "falling", "late_spike"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_row_max_moves_at_chosen_tiles(profile, num_splits):
    # The online softmax's rescaling of the output, driven where it happens.
    # Key tiles run from the last key to the first, so scores rising with the
    # key position put each row's max in the first tile (no rescale after it),
    # falling scores move it in every tile, and one large score at key 5 moves
    # it only in the last tile (or last split).
    capacity, head_dim = 1500, 128
    args = make_inputs(
        batch=2,
        seqlen_q=1,
        capacity=capacity,
        nheads=8,
        nheads_k=2,
        head_dim=head_dim,
        dtype=torch.bfloat16,
    )
    direction = torch.randint(0, 2, (head_dim,)).float() * 2 - 1
    position = torch.arange(capacity, dtype=torch.float32) / capacity
    strength = {
        "rising": 4 * position,
        "falling": 4 * (1 - position),
        "late_spike": torch.zeros(capacity).index_fill_(0, torch.tensor([5]), 8.0),
    }[profile]
    keys = strength[None, :, None, None] * direction + 0.1 * torch.randn(2, capacity, 2, head_dim)
    args["q"] = (0.1 * direction).expand(2, 1, 8, head_dim).to(torch.bfloat16).contiguous()
    args["k_cache"] = keys.to(torch.bfloat16)
    args["cache_seqlens"] = torch.tensor([capacity, capacity - 77], dtype=torch.int32)
    check_all(args, run_cuda(args, num_splits=num_splits), 0, None)


@pytest.mark.parametrize("rotary", [None, "interleaved", "neox"])
@pytest.mark.parametrize("rotary_dim", [16, 48, 64])
@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "paged16"])
def test_cache_contents_after_append(rotary, rotary_dim, page_size):
    args = make_inputs(
        batch=3,
        seqlen_q=2,
        capacity=131,
        nheads=4,
        nheads_k=2,
        head_dim=64,
        dtype=torch.bfloat16,
        seqlen_new=6,
        rotary=rotary,
        rotary_dim=rotary_dim,
        page_size=page_size,
    )
    check_all(args, run_cuda(args), 6, rotary)


@pytest.mark.parametrize("seqlen_new", [1, 16, 17, 40])
@pytest.mark.parametrize("rotary", [None, "interleaved", "neox"])
@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "paged16"])
@pytest.mark.parametrize("num_splits", [1, 7])
def test_append_in_attention_and_before(seqlen_new, rotary, page_size, num_splits):
    # Appends of up to 16 rows (kAppendInAttentionMaxRows) in a grid of one
    # wave are done by the attention kernel itself: each block copies its q
    # and its new rows from k / v with its first tile, rotates them, and the
    # first query block of each split writes the new rows into the cache.
    # Longer ones go through the kernel before it (as does the persistent
    # grid: test_grid_beyond_two_blocks_per_sm, test_persistent_grid). The
    # lengths put the new rows across a key-block boundary (64 keys at d128)
    # and, with 7 splits, across a split boundary, so that two items each
    # write a part; one entry's new rows (or its q positions) reach the
    # cache's end.
    capacity = 600
    args = make_inputs(
        batch=4,
        seqlen_q=2,
        capacity=capacity,
        nheads=8,
        nheads_k=2,
        head_dim=128,
        dtype=torch.bfloat16,
        seqlen_new=seqlen_new,
        rotary=rotary,
        page_size=page_size,
        causal=True,
    )
    capacity = args["block_table"].shape[1] * page_size if page_size else capacity
    args["cache_seqlens"] = torch.tensor(
        [128 - seqlen_new // 2, 0, 317, capacity - max(seqlen_new, 2)], dtype=torch.int32
    )
    check_all(args, run_cuda(args, num_splits=num_splits), seqlen_new, rotary)


def unaligned_copy(table):
    """The table on the device at an address 8 bytes past a 16-byte boundary."""
    flat = torch.empty(table.numel() + 4, dtype=table.dtype, device=DEVICE)
    flat[4:] = table.flatten().to(DEVICE)
    return flat[4:].view(table.shape)


@pytest.mark.parametrize("rotary", ["interleaved", "neox"])
@pytest.mark.parametrize(
    "case", ["dim32", "dim40", "dim8", "tables_unaligned", "window_sees_new", "window_hides_new"]
)
def test_append_in_attention_rules(rotary, case):
    # The attention kernel rotates 16-element units it copied 16 bytes at a
    # time, and loads only the new keys of the tiles it attends to: rotary
    # dims that are not a multiple of 16, tables off a 16-byte boundary and
    # local windows that hide a new key from every query (6 new keys, one
    # query, 2 keys to its left) go through the kernel before it
    # (append_in_attention_fits). Both sides of each rule, with rotary dims
    # that leave part of each head unrotated.
    rotary_dim = {"dim32": 32, "dim40": 40, "dim8": 8}.get(case, 64)
    window = {"window_sees_new": (5, 0), "window_hides_new": (2, 0)}.get(case, (-1, -1))
    args = make_inputs(
        batch=3,
        seqlen_q=1,
        capacity=300,
        nheads=8,
        nheads_k=2,
        head_dim=128,
        dtype=torch.bfloat16,
        seqlen_new=6,
        rotary=rotary,
        rotary_dim=rotary_dim,
        window=window,
    )
    args["cache_seqlens"] = torch.tensor([0, 61, 294], dtype=torch.int32)
    overrides = {}
    if case == "tables_unaligned":
        overrides = {name: unaligned_copy(args[name]) for name in ("rotary_cos", "rotary_sin")}
    check_all(args, run_cuda(args, **overrides), 6, rotary)


# ----------------------------------------------------------------------------
# paged caches


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("page_size", [16, 48, 64, 80, 256])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_matches_contiguous(dtype, page_size, num_splits):
    capacity = 2 * 256 if page_size == 256 else page_size * math.ceil(300 / page_size)
    args = make_inputs(
        batch=3,
        seqlen_q=2,
        capacity=capacity,
        nheads=16,
        nheads_k=4,
        head_dim=128,
        dtype=dtype,
        seqlen_new=2,
        rotary="neox",
        causal=True,
    )
    # Lengths crossing page and tile boundaries, one reaching the last page.
    args["cache_seqlens"] = torch.tensor([255, 17, capacity - 2], dtype=torch.int32)
    check_paged_matches_contiguous(args, page_size, num_splits, 2, "neox")


def check_paged_matches_contiguous(args, page_size, num_splits, seqlen_new, rotary):
    """The call on args' contiguous caches and on the same caches cut into
    pages of page_size rows: the same key tiles in the same order, so the same
    bits (the page layout changes addresses only); then check_all."""
    paged = dict(args)
    page_cache(paged, page_size)
    contiguous = run_cuda(args, num_splits=num_splits)
    got = run_cuda(paged, num_splits=num_splits)
    out, lse, k_after, v_after = got
    assert torch.equal(out, contiguous[0]) and torch.equal(lse, contiguous[1])
    assert torch.equal(unpage(k_after, paged["block_table"]), contiguous[2])
    assert torch.equal(unpage(v_after, paged["block_table"]), contiguous[3])
    check_all(paged, got, seqlen_new, rotary)


@pytest.mark.parametrize("page_size", [16, 256])
def test_decode_batch_default_splits(page_size):
    """Decode as served (one query, GQA 32:8, num_splits chosen by the op) over
    caches of many key tiles: every split runs several tiles through the copy
    pipeline and the block-table look-ahead. The op may pick another split
    count for a paged cache than for a contiguous one (it targets two blocks
    per SM over pages, one over a contiguous cache), so the two agree within
    the rounding of the split merge, not bit for bit (test_paged_matches_contiguous
    compares bits at equal split counts)."""
    capacity = 2048
    args = make_inputs(
        batch=8,
        seqlen_q=1,
        capacity=capacity,
        nheads=32,
        nheads_k=8,
        head_dim=128,
        dtype=torch.bfloat16,
        seqlen_new=1,
        rotary="neox",
    )
    args["cache_seqlens"] = torch.tensor(
        [capacity - 1, 0, 700, 1500, 64, 1023, 1919, 333], dtype=torch.int32
    )
    paged = dict(args)
    page_cache(paged, page_size)
    contiguous = run_cuda(args)
    got = run_cuda(paged)
    torch.testing.assert_close(got[0].float(), contiguous[0].float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got[1], contiguous[1], rtol=1e-5, atol=1e-5)
    check_all(paged, got, 1, "neox")


@pytest.mark.parametrize("page_size", [1, 3, 5, 8, 17])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_any_page_size(page_size, num_splits):
    """Pages of any row count (SGLang's 1, odd ones): rows are located one by
    one, so a page boundary may fall anywhere in a thread's rows of a tile.
    Append and rotary write through the same table."""
    capacity = page_size * math.ceil(300 / page_size)
    args = make_inputs(
        batch=3,
        seqlen_q=2,
        capacity=capacity,
        nheads=16,
        nheads_k=4,
        head_dim=128,
        dtype=torch.bfloat16,
        seqlen_new=2,
        rotary="neox",
        causal=True,
    )
    args["cache_seqlens"] = torch.tensor([255, 17, capacity - 2], dtype=torch.int32)
    paged = dict(args)
    page_cache(paged, page_size)
    contiguous = run_cuda(args, num_splits=num_splits)
    got = run_cuda(paged, num_splits=num_splits)
    assert torch.equal(got[0], contiguous[0]) and torch.equal(got[1], contiguous[1])
    assert torch.equal(unpage(got[2], paged["block_table"]), contiguous[2])
    check_all(paged, got, 2, "neox")


# ----------------------------------------------------------------------------
# split-KV


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("capacity", [63, 1000, 2049])
def test_num_splits_agree(dtype, causal, capacity):
    args = make_inputs(
        batch=2,
        seqlen_q=4,
        capacity=capacity,
        nheads=32,
        nheads_k=8,
        head_dim=128,
        dtype=dtype,
        seqlen_new=4,
        rotary="interleaved",
        causal=causal,
    )
    results = {n: run_cuda(args, num_splits=n) for n in (0, 1, 2, 3, 8, 128)}
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    first = results[1]
    for n, got in results.items():
        torch.testing.assert_close(got[0], first[0], atol=tol, rtol=tol, msg=f"num_splits={n}")
        torch.testing.assert_close(got[1], first[1], atol=1e-3, rtol=1e-3, msg=f"num_splits={n}")
        assert torch.equal(got[2], first[2]) and torch.equal(got[3], first[3])
        check_against_reference(dict(args, num_splits=n), got[0], got[1])
    check_matches_cpu_op(args, results[0], "interleaved")


@pytest.mark.parametrize("head_dim", [64, 96, 160, 256])
def test_many_splits_every_head_dim(head_dim):
    # The combine kernel spreads a row's splits over groups of threads whose
    # count depends on the head dim (96: 5 groups, 160: 3, 256: 2); 60+ splits
    # also take its path for more splits than one round of loads covers.
    args = make_inputs(
        batch=1,
        seqlen_q=1,
        capacity=2000,
        nheads=8,
        nheads_k=2,
        head_dim=head_dim,
        dtype=torch.bfloat16,
        seqlen_new=0,
        rotary=None,
        causal=False,
    )
    args["cache_seqlens"] = torch.tensor([1999], dtype=torch.int32)
    single = run_cuda(args, num_splits=1)
    many = run_cuda(args, num_splits=128)
    torch.testing.assert_close(many[0], single[0], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(many[1], single[1], atol=1e-3, rtol=1e-3)
    check_against_reference(dict(args, num_splits=128), many[0], many[1])


@pytest.mark.parametrize("seqlen_new", [0, 2])
def test_per_batch_lengths_with_empty_sequence(seqlen_new):
    args = make_inputs(
        batch=4,
        seqlen_q=3,
        capacity=333,
        nheads=8,
        nheads_k=2,
        head_dim=64,
        dtype=torch.bfloat16,
        seqlen_new=seqlen_new,
        causal=True,
    )
    args["cache_seqlens"] = torch.tensor([0, 1, 129, 331 - seqlen_new], dtype=torch.int32)
    for num_splits in (1, 4):
        got = run_cuda(args, num_splits=num_splits)
        check_all(args, got, seqlen_new, None)
        if seqlen_new == 0:
            assert torch.equal(got[0][0], torch.zeros_like(got[0][0]))
            assert torch.isinf(got[1][0]).all() and (got[1][0] > 0).all()


def test_cache_seqlens_none_attends_whole_cache():
    args = make_inputs(
        batch=2, seqlen_q=3, capacity=190, head_dim=64, dtype=torch.bfloat16, causal=True
    )
    args["cache_seqlens"] = None
    got = run_cuda(args)
    check_all(args, got, 0, None)


# ----------------------------------------------------------------------------
# cache_batch_idx, leftpad


@pytest.mark.parametrize("seqlen_new", [0, 4])
def test_cache_batch_idx(seqlen_new):
    cache_batch_idx = torch.tensor([4, 0, 2], dtype=torch.int32)
    args = make_inputs(
        batch=3,
        seqlen_q=4,
        capacity=223,
        batch_cache=5,
        nheads=8,
        nheads_k=4,
        head_dim=128,
        cache_batch_idx=cache_batch_idx,
        dtype=torch.bfloat16,
        seqlen_new=seqlen_new,
        rotary="interleaved" if seqlen_new else None,
        causal=True,
    )
    got = run_cuda(args)
    check_all(args, got, seqlen_new, "interleaved" if seqlen_new else None)
    for unused in (1, 3):
        assert torch.equal(got[2][unused], args["k_cache"][unused])
        assert torch.equal(got[3][unused], args["v_cache"][unused])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("num_splits", [1, 0])
def test_cache_leftpad(causal, mode, num_splits):
    seqlen_new, rotary = MODES[mode]
    args = make_inputs(
        batch=4,
        seqlen_q=3,
        capacity=270,
        nheads=8,
        nheads_k=2,
        head_dim=64,
        dtype=torch.bfloat16,
        seqlen_new=seqlen_new,
        rotary=rotary,
        leftpad=True,
        causal=causal,
    )
    args["cache_leftpad"][1] = args["cache_seqlens"][1]
    args["num_splits"] = num_splits
    check_all(args, run_cuda(args), seqlen_new, rotary)


# ----------------------------------------------------------------------------
# masks and score modifiers

WINDOWS = {
    "causal": (True, (-1, -1)),
    "local_40_0": (False, (40, 0)),
    "local_2_3": (False, (2, 3)),
    "right_only_1": (False, (-1, 1)),
    "left_only_70": (False, (70, -1)),
    "causal_left_100": (True, (100, -1)),
    "wider_than_cache": (False, (1000, 1000)),
}


@pytest.mark.parametrize("seqlen_q", [1, 2, 7, 16])
@pytest.mark.parametrize("window", list(WINDOWS))
def test_causal_and_local(seqlen_q, window):
    causal, (left, right) = WINDOWS[window]
    args = make_inputs(
        batch=3,
        seqlen_q=seqlen_q,
        capacity=400,
        nheads=8,
        nheads_k=2,
        head_dim=64,
        dtype=torch.bfloat16,
        seqlen_new=seqlen_q,
        rotary="interleaved",
        causal=causal,
        window=(left, right),
    )
    for num_splits in (1, 3):
        check_all(
            dict(args, num_splits=num_splits),
            run_cuda(args, num_splits=num_splits),
            seqlen_q,
            "interleaved",
        )


@pytest.mark.parametrize("softcap", [0.0, 4.0])
@pytest.mark.parametrize("alibi", [None, "per_head", "per_batch_head"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_softcap_and_alibi(softcap, alibi, causal):
    args = make_inputs(
        batch=3,
        seqlen_q=4,
        capacity=300,
        nheads=8,
        nheads_k=2,
        head_dim=128,
        dtype=torch.bfloat16,
        seqlen_new=2,
        causal=causal,
    )
    args["softcap"] = softcap
    if alibi == "per_head":
        args["alibi_slopes"] = torch.rand(8) * 0.5
    elif alibi == "per_batch_head":
        args["alibi_slopes"] = torch.rand(3, 8) * 0.5
    for num_splits in (1, 4):
        check_all(dict(args, num_splits=num_splits), run_cuda(args, num_splits=num_splits), 2, None)


@pytest.mark.parametrize("softcap", [0.0, 4.0])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_negative_softmax_scale(softcap, causal):
    """A negative scale (legal, if odd) flips which score is a row's max; the
    kernels that fold the scale into exp2 would track the wrong one, so such a
    call takes the variant that scales each score first."""
    args = make_inputs(
        batch=2,
        seqlen_q=3,
        capacity=300,
        nheads=8,
        nheads_k=2,
        head_dim=128,
        dtype=torch.bfloat16,
        seqlen_new=2,
        causal=causal,
    )
    args["softcap"] = softcap
    args["softmax_scale"] = -0.3
    for num_splits in (1, 4):
        check_all(dict(args, num_splits=num_splits), run_cuda(args, num_splits=num_splits), 2, None)


def test_strided_views_append_into_shared_storage():
    batch, capacity, nheads, nheads_k, head_dim, seqlen_new = 2, 224, 8, 2, 64, 3
    qkv = torch.randn(
        batch, seqlen_new, nheads + 2 * nheads_k, head_dim, dtype=torch.bfloat16, device=DEVICE
    )
    q, k, v = qkv.split([nheads, nheads_k, nheads_k], dim=2)
    kv_cache = torch.randn(
        batch, capacity, 2, nheads_k, head_dim, dtype=torch.bfloat16, device=DEVICE
    )
    args = op_args(
        q,
        kv_cache[:, :, 0],
        kv_cache[:, :, 1],
        causal=True,
        k=k,
        v=v,
        cache_seqlens=torch.tensor([5, 130], dtype=torch.int32, device=DEVICE),
        rotary_interleaved=False,
    )
    before = {name: args[name].clone() for name in ("k_cache", "v_cache")}
    reference_args = to_device(dict(args, **before), "cpu")
    out, lse = fwd_kvcache(**args)
    check_against_reference(reference_args, out.cpu(), lse.cpu())
    check_caches(reference_args, kv_cache[:, :, 0].cpu(), kv_cache[:, :, 1].cpu())


@pytest.mark.parametrize("last_writer", ["q", "k", "cache_seqlens", "k_cache"])
def test_inputs_written_by_the_kernel_just_before(last_writer):
    """On sm90 each kernel of the call is launched as a programmatic dependent
    of the kernel before it in the stream, so it may start while that kernel
    still runs and must wait for it before touching memory. Each decode step
    here takes an input written by the kernel right before the call (filled
    with NaN first, so that an early read shows), the next step's q is this
    step's output, and nothing synchronises between the steps."""
    batch, capacity, nheads, nheads_k, head_dim, steps = 3, 300, 16, 4, 128, 4
    args = make_inputs(
        batch=batch,
        seqlen_q=1,
        capacity=capacity,
        nheads=nheads,
        nheads_k=nheads_k,
        head_dim=head_dim,
        dtype=torch.bfloat16,
        seqlen_new=1,
        rotary="neox",
        causal=True,
    )
    args["cache_seqlens"] = torch.tensor([0, 37, 250], dtype=torch.int32)
    call = to_device(args)
    snapshots, outputs = [], []
    out = None
    for step in range(steps):
        # The next inputs: q from the last output, a fresh new token, lengths
        # one further. Snapshots are taken before the last writer runs.
        next_inputs = {
            "q": (out * 0.5 if out is not None else call["q"]).clone(),
            "k": call["k"] * 1.5 - 0.25,
            "cache_seqlens": call["cache_seqlens"] + (1 if step else 0),
        }
        snapshots.append(
            dict(
                {
                    name: value.clone() if isinstance(value, torch.Tensor) else value
                    for name, value in call.items()
                },
                **{name: value.clone() for name, value in next_inputs.items()},
            )
        )
        for name, value in next_inputs.items():
            if name == last_writer:
                continue
            call[name] = value
        if last_writer == "k_cache":
            # An in-place write of the rows the step attends to: one kernel
            # right before the call, same values as the snapshot.
            fresh = call["k_cache"].clone()
            call["k_cache"].fill_(float("nan"))
            call["k_cache"].copy_(fresh)
        else:
            target = (
                torch.full_like(next_inputs[last_writer], float("nan"))
                if last_writer != "cache_seqlens"
                else torch.full_like(next_inputs[last_writer], -7)
            )
            target.copy_(next_inputs[last_writer])
            call[last_writer] = target
        out, lse = fwd_kvcache(**call)
        outputs.append((out, lse))
    torch.cuda.synchronize()
    for step, (out, lse) in enumerate(outputs):
        assert not torch.isnan(out).any(), f"step {step}: NaN in the output"
        check_against_reference(to_device(snapshots[step], "cpu"), out.cpu(), lse.cpu())
    check_caches(to_device(snapshots[-1], "cpu"), call["k_cache"].cpu(), call["v_cache"].cpu())


# ----------------------------------------------------------------------------
# CUDA graphs and the Python API


def test_cuda_graph_replay_with_changing_lengths():
    batch, capacity, nheads, nheads_k, head_dim = 4, 512, 16, 4, 128
    args = make_inputs(
        batch=batch,
        seqlen_q=1,
        capacity=capacity,
        nheads=nheads,
        nheads_k=nheads_k,
        head_dim=head_dim,
        dtype=torch.bfloat16,
        seqlen_new=1,
        rotary="neox",
        causal=True,
        page_size=16,
    )
    static = to_device(args)
    static["cache_seqlens"] = torch.tensor([3, 100, 250, 17], dtype=torch.int32, device=DEVICE)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up outside the graph
            fwd_kvcache(
                **dict(static, k_cache=static["k_cache"].clone(), v_cache=static["v_cache"].clone())
            )
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out, static_lse = fwd_kvcache(**static)
    for step in range(3):
        # New step: fresh q / new token, lengths advanced in place.
        static["q"].copy_(torch.randn_like(static["q"]))
        static["k"].copy_(torch.randn_like(static["k"]))
        static["v"].copy_(torch.randn_like(static["v"]))
        static["cache_seqlens"].add_(
            torch.tensor([1, 7, 30, 2 * step + 1], dtype=torch.int32, device=DEVICE)
        )
        host_before = to_device(static, "cpu")
        graph.replay()
        torch.cuda.synchronize()
        check_against_reference(host_before, static_out.cpu(), static_lse.cpu())
        check_caches(host_before, static["k_cache"].cpu(), static["v_cache"].cpu())


@pytest.mark.parametrize("head_dim", [64, 36])
def test_flash_attn_with_kvcache_api(head_dim):
    args = make_inputs(
        batch=2,
        seqlen_q=2,
        capacity=257,
        nheads=8,
        nheads_k=2,
        head_dim=head_dim,
        dtype=torch.bfloat16,
        seqlen_new=2,
        rotary="neox",
        rotary_dim=32,
        causal=True,
    )
    dev = to_device(args)
    k_cache, v_cache = dev["k_cache"].clone(), dev["v_cache"].clone()
    out, lse = flash_attn_cuda.flash_attn_with_kvcache(
        dev["q"],
        k_cache,
        v_cache,
        k=dev["k"],
        v=dev["v"],
        rotary_cos=dev["rotary_cos"],
        rotary_sin=dev["rotary_sin"],
        cache_seqlens=dev["cache_seqlens"],
        causal=True,
        rotary_interleaved=False,
        num_splits=3,
        return_softmax_lse=True,
    )
    check_against_reference(args, out.cpu(), lse.cpu())
    check_caches(args, k_cache.cpu(), v_cache.cpu())
