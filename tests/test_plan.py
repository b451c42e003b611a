"""The kernel plans (csrc/cuda/launch/plan.h), through the debug ops
torch.ops.flash_attn._plan_fwd / _plan_bwd / _plan_decode.

The plans are plain C++ compiled into every build, so these run on the CPU:
each op describes, for a call of the given shape on a described device, which
kernel the CUDA path runs, its tile, grid and split count, and why. The tile
table thresholds are read from fwd_tile_config.h, so the boundary tests follow
the table. The last tests (marked cuda) compare the plan for the current GPU
with the kernels a call actually launched, as the profiler records them.
"""

import math
import re
from pathlib import Path

import pytest
import torch

from cuda_inputs import launched_kernels

import flash_attn_cuda  # noqa: F401  (registers the ops)

ops = torch.ops.flash_attn
ROOT = Path(__file__).resolve().parents[1]

# Device descriptions: (cc, SMs, shared memory per block opt-in / per SM).
H100 = dict(
    cc_major=9,
    cc_minor=0,
    num_sms=132,
    smem_per_block_optin=232448,
    smem_per_sm=233472,
    reserved_smem_per_block=1024,
)
A100 = dict(
    cc_major=8,
    cc_minor=0,
    num_sms=108,
    smem_per_block_optin=166912,
    smem_per_sm=167936,
    reserved_smem_per_block=1024,
)
L40 = dict(
    cc_major=8,
    cc_minor=9,
    num_sms=142,
    smem_per_block_optin=101376,
    smem_per_sm=102400,
    reserved_smem_per_block=1024,
)


def parse(line):
    """'k=v k=v ... reason: text' -> dict (values as int where they are)."""
    fields, _, reason = line.partition(" reason: ")
    plan = {"reason": reason}
    for item in fields.split():
        key, _, value = item.partition("=")
        plan[key] = int(value) if re.fullmatch(r"-?\d+", value) else value
    return plan


def fwd(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, device=H100, **kw):
    return parse(
        ops._plan_fwd(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, **device, **kw)
    )


def bwd(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, device=H100, **kw):
    return parse(
        ops._plan_bwd(batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, **device, **kw)
    )


def decode(batch, seqlen_q, cache, nheads, nheads_k, head_dim, device=H100, **kw):
    return parse(
        ops._plan_decode(batch, seqlen_q, cache, nheads, nheads_k, head_dim, **device, **kw)
    )


def fwd_tile_table():
    """FwdTileConfig rows of fwd_tile_config.h: head dim -> {kBlockM: ..., ...}."""
    text = (ROOT / "csrc/cuda/fwd/fwd_tile_config.h").read_text()
    table = {}
    for dim, body in re.findall(r"struct FwdTileConfig<(\d+)>\s*{([^}]*)}", text):
        table[int(dim)] = {k: int(v) for k, v in re.findall(r"(k\w+)\s*=\s*(\d+)", body)}
    assert set(table) == {32, 64, 96, 128, 160, 192, 224, 256, 512}, table.keys()
    return table


FWD_TABLE = fwd_tile_table()


def bwd_tile_table():
    """BwdTileConfig rows of bwd_tile_config.h: head dim -> {kBlockM: ..., ...}."""
    text = (ROOT / "csrc/cuda/bwd/bwd_tile_config.h").read_text()
    table = {}
    for dim, body in re.findall(r"struct BwdTileConfig<(\d+)>\s*{([^}]*)}", text):
        table[int(dim)] = {k: int(v) for k, v in re.findall(r"(k\w+)\s*=\s*(\d+)", body)}
    assert set(table) == {32, 64, 96, 128, 160, 192, 224, 256, 512}, table.keys()
    return table


BWD_TABLE = bwd_tile_table()
# The head dims with a Hopper backward tile (d512 has the SM80 kernel only).
HOPPER_BWD_DIMS = [d for d in sorted(BWD_TABLE) if BWD_TABLE[d]["kBlockMSm90"]]


def fwd_pair_tile_table():
    """The specialised (d_qk, d_v) rows of fwd_tile_config.h: (d_qk, d_v) -> {...}."""
    text = (ROOT / "csrc/cuda/fwd/fwd_tile_config.h").read_text()
    table = {}
    for dim, dim_v, body in re.findall(r"struct FwdTileConfig<(\d+), (\d+)>\s*{([^}]*)}", text):
        table[int(dim), int(dim_v)] = {
            k: int(v) for k, v in re.findall(r"(k\w+)\s*=\s*(\d+)", body)
        }
    assert set(table) == {(192, 128)}, table.keys()
    return table


FWD_PAIR_TABLE = fwd_pair_tile_table()


# ---------------------------------------------------------------- forward


def test_hopper_forward_for_long_causal_d128_on_sm90():
    plan = fwd(2, 8192, 8192, 16, 16, 128, causal=True)
    assert plan["kernel"] == "sm90" and plan["variant"] == "plain"
    assert (plan["block_m"], plan["block_n"]) == (128, FWD_TABLE[128]["kBlockNSm90"])
    # Causal tiles differ in work; 8k keys per tile is past the counter's reach.
    assert plan["grid_kind"] == "one_per_tile"
    assert plan["grid"] == "%dx1x1" % (8192 // 128 * 16 * 2)


def test_sm80_forward_on_sm80():
    plan = fwd(2, 8192, 8192, 16, 16, 128, device=A100, causal=True)
    row = FWD_TABLE[128]
    assert plan["kernel"] == "sm80" and plan["choice"] == "sm80"
    assert (plan["block_m"], plan["block_n"], plan["warps"]) == (
        row["kBlockM"],
        row["kBlockN"],
        row["kNWarps"],
    )
    assert plan["grid_kind"] == "heads_batch"
    assert plan["grid"] == "%dx16x2" % (8192 // row["kBlockM"])
    assert "not an sm90 device" in plan["reason"]


def test_sm80_forward_without_sm90a_code():
    plan = fwd(2, 8192, 8192, 16, 16, 128, sm90a_built=False)
    assert plan["kernel"] == "sm80" and "sm_90a" in plan["reason"]


@pytest.mark.parametrize("head_dim", sorted(FWD_TABLE))
def test_min_seqlen_k_threshold(head_dim):
    """One small call (one query block): the Hopper kernel from kMinSeqlenKSm90 keys on."""
    row = FWD_TABLE[head_dim]
    if row["kBlockNSm90"] == 0:
        assert fwd(1, 128, 8192, 1, 1, head_dim)["kernel"] == "sm80"
        return
    threshold = row["kMinSeqlenKSm90"]
    assert fwd(1, 128, max(threshold, 1), 1, 1, head_dim)["kernel"] == "sm90"
    if threshold > 1:
        below = fwd(1, 128, threshold - 1, 1, 1, head_dim)
        assert below["kernel"] == "sm80" and "fwd_sm90_by_shape" in below["reason"]


@pytest.mark.parametrize(
    "head_dim", [d for d in sorted(FWD_TABLE) if FWD_TABLE[d]["kMinBlocksPerSmSm90"] > 0]
)
def test_min_blocks_per_sm_threshold(head_dim):
    """Below the key threshold: from kMinBlocksPerSmSm90 128-row query blocks per SM on."""
    row = FWD_TABLE[head_dim]
    short_keys = row["kMinSeqlenKSm90"] - 1
    needed = row["kMinBlocksPerSmSm90"] * H100["num_sms"]
    # batch entries of one query block of one head each: tiles == batch.
    assert fwd(needed, 128, short_keys, 1, 1, head_dim)["kernel"] == "sm90"
    assert fwd(needed - 1, 128, short_keys, 1, 1, head_dim)["kernel"] == "sm80"


def test_kernel_override():
    short = (1, 128, 128, 1, 1, 128)  # below both thresholds: SM80 by default
    assert fwd(*short)["kernel"] == "sm80"
    forced = fwd(*short, kernel_override="sm90")
    assert forced["kernel"] == "sm90" and forced["choice"] == "sm90"
    long = (2, 8192, 8192, 16, 16, 128)
    forced = fwd(*long, kernel_override="sm80")
    assert forced["kernel"] == "sm80" and "FLASH_ATTN_FWD_KERNEL=sm80" in forced["reason"]
    # Only an sm90 device honours it.
    assert fwd(*short, device=A100, kernel_override="sm90")["kernel"] == "sm80"
    with pytest.raises(RuntimeError, match="kernel_override"):
        fwd(*short, kernel_override="sm100")


def test_forward_variants():
    long = (2, 4096, 4096, 16, 16, 128)
    # Dropout runs the Hopper kernel's score-mods variant (docs/dropout_sm90.md).
    dropout = fwd(*long, dropout_p=0.1)
    assert dropout["kernel"] == "sm90" and dropout["variant"] == "score_mods"
    assert dropout["block_n"] == FWD_TABLE[128]["kBlockNSm90"]
    softcap = fwd(*long, softcap=30.0)
    assert softcap["kernel"] == "sm90" and softcap["variant"] == "score_mods"
    alibi = fwd(*long, alibi=True, device=A100)
    assert alibi["kernel"] == "sm80" and alibi["variant"] == "score_extras"
    # A negative scale: the score-mods variant, which keeps such scores negated
    # (score_mods.h); a zero (or subnormal, infinite, NaN) one stays SM80.
    negative_scale = fwd(*long, softmax_scale=-0.1)
    assert negative_scale["kernel"] == "sm90" and negative_scale["variant"] == "score_mods"
    zero_scale = fwd(*long, softmax_scale=0.0)
    assert zero_scale["kernel"] == "sm80" and zero_scale["variant"] == "score_extras"
    assert "softmax scale" in zero_scale["reason"]
    unaligned = fwd(*long, tma_aligned=False)
    assert unaligned["kernel"] == "sm80" and "TMA" in unaligned["reason"]
    probs = fwd(*long, return_softmax=True)
    assert probs["return_probs"] == 1


def tile_draws_dropout(head_dim, block_m, block_n):
    """plan.h fwd_sm90_draws_dropout: 64 registers to spare beside S, O and P
    in flight (FwdSm90KernelTraits::kDrawsDropout) on a block_m x block_n tile."""
    registers = 240 if block_m // 64 == 2 else 160
    return registers - (block_n // 2 + head_dim // 2 + block_n // 4) >= 64


def hopper_dropout_tile(head_dim):
    """plan.h fwd_sm90_dropout_tile: the Hopper forward's tile for dropout (the
    table's, else 128 rows of its keys, else 128 x 64), or None."""
    row = FWD_TABLE[head_dim]
    table = (row["kBlockMSm90"], row["kBlockNSm90"])
    for tile in (table, (128, table[1]), (128, 64)):
        if tile[1] <= table[1] and tile_draws_dropout(head_dim, *tile):
            return tile
    return None


def test_hopper_dropout_head_dims():
    """Which head dims the Hopper forward draws dropout at, and on which tile
    (PERF_LOG 2026-11-29, issue 57 step 1: d64's 192-row tile and d256's
    128 x 80 spilled in the loop; they draw on 128 x 128 and 128 x 64)."""
    hopper = [d for d in sorted(FWD_TABLE) if FWD_TABLE[d]["kBlockNSm90"]]
    table_draws = [
        d
        for d in hopper
        if tile_draws_dropout(d, FWD_TABLE[d]["kBlockMSm90"], FWD_TABLE[d]["kBlockNSm90"])
    ]
    assert table_draws == [96, 128, 160, 192, 224]
    assert {d: hopper_dropout_tile(d) for d in hopper} == {
        64: (128, 128),
        96: (128, 128),
        128: (128, 128),
        160: (128, 96),
        192: (128, 96),
        224: (128, 80),
        256: (128, 64),
    }


@pytest.mark.parametrize("head_dim", [d for d in sorted(FWD_TABLE) if FWD_TABLE[d]["kBlockNSm90"]])
def test_forward_dropout_on_hopper(head_dim):
    """Dropout's forward runs the Hopper kernel wherever the plain rule would,
    in its score-mods variant (one instantiation fewer than a variant of its
    own), on the grids that variant runs; its backward stays on the SM80
    kernel, which replays the same mask (csrc/common/philox.h)."""
    row = FWD_TABLE[head_dim]
    long = (2, 8192, 8192, 16, 16, head_dim)
    plain = fwd(*long, causal=True)
    dropout = fwd(*long, causal=True, dropout_p=0.1)
    tile = hopper_dropout_tile(head_dim)
    assert tile is not None
    assert dropout["kernel"] == "sm90" and dropout["variant"] == "score_mods"
    # d64 and d256 draw on a tile of their own (128 x 128, 128 x 64), not the
    # table's, which their plain and softcap calls run.
    assert (dropout["block_m"], dropout["block_n"]) == tile
    table = (row["kBlockMSm90"], row["kBlockNSm90"])
    assert (plain["block_m"], plain["block_n"]) == table
    softcap = fwd(*long, causal=True, softcap=30.0)
    assert (softcap["block_m"], softcap["block_n"]) == table
    if tile == table:
        assert dropout["grid_kind"] == plain["grid_kind"]
    assert "dropout" not in dropout["reason"]
    # Any p in (0, 1), with softcap and ALiBi too.
    for p in (1e-6, 0.5, 0.999):
        assert fwd(*long, dropout_p=p)["kernel"] == "sm90"
    mods = fwd(*long, dropout_p=0.1, softcap=30.0, alibi=True)
    assert mods["kernel"] == "sm90" and mods["variant"] == "score_mods"
    # The same shape rule as the plain call below the key threshold.
    if row["kMinSeqlenKSm90"] > 1:
        short = (1, 128, row["kMinSeqlenKSm90"] - 1, 1, 1, head_dim)
        assert fwd(*short, dropout_p=0.1)["kernel"] == fwd(*short)["kernel"] == "sm80"
        forced = fwd(*short, dropout_p=0.1, kernel_override="sm90")
        assert forced["kernel"] == "sm90" and forced["variant"] == "score_mods"
    # The probabilities come from their own kernel after either forward.
    probs = fwd(*long, dropout_p=0.1, return_softmax=True)
    assert probs["kernel"] == "sm90" and probs["return_probs"] == 1
    # Still the SM80 kernel: a forced SM80, another device, a scale that is
    # not normal (a negative one draws on Hopper too). The backward draws the
    # same mask on Hopper (test_backward_dropout_on_hopper).
    forced = fwd(*long, dropout_p=0.1, kernel_override="sm80")
    assert forced["kernel"] == "sm80" and forced["variant"] == "score_extras"
    assert fwd(*long, dropout_p=0.1, device=A100)["kernel"] == "sm80"
    zero = fwd(*long, dropout_p=0.1, softmax_scale=0.0)
    assert zero["kernel"] == "sm80" and "softmax scale" in zero["reason"]
    negative = fwd(*long, dropout_p=0.1, softmax_scale=-0.1)
    assert negative["kernel"] == "sm90" and negative["variant"] == "score_mods"
    backward = bwd(*long, causal=True, dropout_p=0.1)
    assert backward["kernel"] == "sm90" and backward["variant"] == "score_mods"


def test_forward_dropout_not_on_the_counter_grid():
    """The counter grid runs the plain rule only: a short causal call with
    dropout takes the score-mods variant's grid instead."""
    short_causal = (16, 1024, 1024, 16, 16, 128)
    assert fwd(*short_causal, causal=True)["grid_kind"] == "tile_counter"
    plan = fwd(*short_causal, causal=True, dropout_p=0.1)
    assert plan["kernel"] == "sm90" and plan["variant"] == "score_mods"
    assert plan["grid_kind"] != "tile_counter"


def expected_paged_keys(page_size, block_n):
    """Boxes where the largest power of two dividing the page and the key
    tile (up to 256 rows) is at least 64 rows; else the row gather."""
    rows = 1
    while rows < 256 and page_size % (2 * rows) == 0 and block_n % (2 * rows) == 0:
        rows *= 2
    return "paged_boxes" if rows >= 64 else "paged_gather"


def test_expected_paged_keys_examples():
    assert expected_paged_keys(64, 128) == expected_paged_keys(256, 128) == "paged_boxes"
    assert expected_paged_keys(192, 128) == "paged_boxes"  # 64-row boxes
    for page_size in (1, 3, 8, 16, 32, 48):
        assert expected_paged_keys(page_size, 128) == "paged_gather"
    assert expected_paged_keys(256, 112) == "paged_gather"  # 16-row boxes at most


@pytest.mark.parametrize("page_size", [1, 2, 3, 5, 8, 16, 17, 24, 32, 48, 64, 192, 256])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_forward_paged_keys(page_size, head_dim):
    """Paged varlen keys are read in place by the Hopper kernel whatever the
    page size: by TMA boxes where a box of at least 64 rows fits both a page
    and the key tile, else gathered row by row by the producer warpgroup
    (plan.h FwdKeys, paged_box_rows.h kPagedBoxesMinRows)."""
    long = (2, 4096, 4096, 16, 16, head_dim)
    plan = fwd(*long, varlen=True, page_size=page_size)
    assert plan["kernel"] == "sm90", plan
    assert plan["keys"] == expected_paged_keys(page_size, plan["block_n"]), plan
    forced = fwd(*long, varlen=True, page_size=page_size, kernel_override="sm90")
    assert forced["kernel"] == "sm90" and forced["keys"] == plan["keys"]
    # Every grid and score rule: the counter grid (short causal), softcap.
    short = fwd(16, 1024, 1024, 16, 16, head_dim, varlen=True, causal=True, page_size=page_size)
    assert short["keys"] == plan["keys"], short
    softcap = fwd(*long, varlen=True, page_size=page_size, softcap=30.0)
    assert softcap["variant"] == "score_mods" and softcap["keys"] == plan["keys"], softcap
    # The SM80 kernel reads paged keys row by row; the plan names no Hopper
    # key load there.
    sm80 = fwd(*long, varlen=True, page_size=page_size, kernel_override="sm80")
    assert sm80["kernel"] == "sm80" and sm80["keys"] == "contiguous"
    with pytest.raises(RuntimeError, match="page_size"):
        fwd(*long, varlen=False, page_size=16)


def test_forward_row_gather_takes_a_third_stage():
    """d128's row gather (pages whose boxes would be below 64 rows) runs on
    three K / V stages with O staged over Q (plan.h fwd_sm90_kv_stages): one
    block per tile, also for short causal tiles, which over boxes or
    contiguous keys take the persistent counter grid. d64 keeps O's own tile
    and so its grids; d256 keeps two stages."""
    long = (4, 4096, 4096, 16, 16, 128)
    short = (16, 1024, 1024, 16, 16)
    for page_size in (1, 16, 48):
        plan = fwd(*long, varlen=True, page_size=page_size)
        assert plan["keys"] == "paged_gather" and plan["grid_kind"] == "one_per_tile", plan
        assert "three K / V stages" in plan["reason"], plan
        gather = fwd(*short, 128, varlen=True, causal=True, page_size=page_size)
        assert gather["keys"] == "paged_gather" and gather["grid_kind"] == "one_per_tile", gather
        d64 = fwd(*short, 64, varlen=True, causal=True, page_size=page_size)
        assert d64["keys"] == "paged_gather" and d64["grid_kind"] == "tile_counter", d64
    boxes = fwd(*short, 128, varlen=True, causal=True, page_size=256)
    assert boxes["keys"] == "paged_boxes" and boxes["grid_kind"] == "tile_counter", boxes
    d256 = fwd(4, 4096, 4096, 8, 8, 256, varlen=True, page_size=16)
    assert d256["keys"] == "paged_gather" and "three K / V stages" not in d256["reason"]


def test_forward_contiguous_keys():
    assert fwd(2, 4096, 4096, 16, 16, 128)["keys"] == "contiguous"
    assert fwd(2, 4096, 4096, 16, 16, 128, varlen=True)["keys"] == "contiguous"


def test_forward_grids():
    # Equal work, more tiles than SMs: fixed shares of a persistent grid.
    plan = fwd(4, 4096, 4096, 16, 16, 128)
    assert plan["grid_kind"] == "fixed_shares" and plan["grid"] == "132x1x1"
    # Few tiles: one block each.
    plan = fwd(1, 256, 4096, 2, 2, 128)
    assert plan["grid_kind"] == "one_per_tile" and plan["grid"] == "4x1x1"
    # Short causal tiles, more than SMs: the counter grid, 128-row tiles.
    plan = fwd(16, 1024, 1024, 16, 16, 64, causal=True)
    assert plan["grid_kind"] == "tile_counter" and plan["block_m"] == 128
    assert plan["grid"] == "132x1x1"
    # ... but not with softcap (the counter grid keeps the plain rule).
    plan = fwd(16, 1024, 1024, 16, 16, 64, causal=True, softcap=20.0)
    assert plan["grid_kind"] != "tile_counter"
    # Varlen batches count as tiles of differing work.
    plan = fwd(16, 1024, 1024, 16, 16, 128, varlen=True)
    assert plan["grid_kind"] == "tile_counter"
    # d256 has no room for a separate O tile: no persistent grid.
    plan = fwd(4, 4096, 4096, 8, 8, 256)
    assert plan["kernel"] == "sm90" and plan["grid_kind"] == "one_per_tile"


def fwd_sm90_smem_bytes(d_qk, d_v, block_m, block_n):
    """Q, O, two stages of K and V and the mbarriers (plan.h fwd_sm90_persistent)."""
    return block_m * (d_qk + d_v) * 2 + 2 * block_n * (d_qk + d_v) * 2 + 104


@pytest.mark.parametrize("d_qk,d_v", [(192, 128), (192, 64), (192, 96), (176, 128), (161, 8)])
def test_forward_pair_kernel(d_qk, d_v):
    """d_qk in (160, 192] with d_v <= 128 runs the (192, 128) kernel on sm90:
    112-key tiles with O staged apart (persistent: 220 KiB; 128 keys would
    need 240), on every grid and score rule of the Hopper kernel; where the
    Hopper kernel does not run, the SM80 one of d_qk (level 1)."""
    row = FWD_PAIR_TABLE[192, 128]
    block_m, block_n = row["kBlockMSm90"], row["kBlockNSm90"]
    assert (block_m, block_n) == (128, 112)
    assert fwd_sm90_smem_bytes(192, 128, block_m, block_n) <= 227 * 1024
    assert fwd_sm90_smem_bytes(192, 128, block_m, 128) > 227 * 1024
    long = (2, 8192, 8192, 16, 16, d_qk)
    plan = fwd(*long, causal=True, head_dim_v=d_v)
    assert plan["kernel"] == "sm90" and plan["variant"] == "plain"
    assert (plan["hdim"], plan["hdim_v"]) == (192, 128)
    assert (plan["block_m"], plan["block_n"]) == (block_m, block_n)
    assert plan["grid_kind"] == "one_per_tile" and "(192, 128) kernel" in plan["reason"]
    # Persistent: fixed shares for tiles of equal work, the counter for short
    # causal ones.
    shares = fwd(4, 4096, 4096, 16, 16, d_qk, head_dim_v=d_v)
    assert shares["grid_kind"] == "fixed_shares" and shares["hdim_v"] == 128
    counter = fwd(16, 1024, 1024, 16, 16, d_qk, causal=True, head_dim_v=d_v)
    assert counter["grid_kind"] == "tile_counter" and counter["hdim_v"] == 128
    # Softcap, ALiBi, dropout: the pair kernel's score-mods variant (its
    # draws fit: 240 - (56 + 64 + 28) registers to spare).
    mods = fwd(*long, head_dim_v=d_v, dropout_p=0.1, softcap=30.0, alibi=True)
    assert mods["kernel"] == "sm90" and mods["variant"] == "score_mods"
    assert (mods["hdim"], mods["hdim_v"], mods["block_n"]) == (192, 128, block_n)
    # Paged keys and varlen batches run it too, by the row gather at every
    # page size (a box fits at most 16 rows of its 112-key tiles, below
    # kPagedBoxesMinRows), V at its 128 columns.
    for page_size in (16, 24, 256, 3, 1):
        paged = fwd(*long, varlen=True, page_size=page_size, head_dim_v=d_v)
        assert paged["kernel"] == "sm90" and paged["keys"] == "paged_gather", paged
        assert (paged["hdim"], paged["hdim_v"], paged["block_n"]) == (192, 128, block_n)
    short_paged = fwd(
        16, 1024, 1024, 16, 16, d_qk, varlen=True, causal=True, page_size=3, head_dim_v=d_v
    )
    assert short_paged["grid_kind"] == "tile_counter" and short_paged["hdim_v"] == 128
    assert short_paged["keys"] == "paged_gather"
    # The SM80 kernel of d_qk, at its own width: another device, a forced
    # SM80, TMA refused, no sm_90a code.
    for sm80 in (
        fwd(*long, head_dim_v=d_v, device=A100),
        fwd(*long, head_dim_v=d_v, kernel_override="sm80"),
        fwd(*long, head_dim_v=d_v, tma_aligned=False),
        fwd(*long, head_dim_v=d_v, sm90a_built=False),
    ):
        assert sm80["kernel"] == "sm80" and (sm80["hdim"], sm80["hdim_v"]) == (192, 192), sm80
        assert sm80["block_n"] == FWD_TABLE[192]["kBlockN"]
    assert fwd(*long, head_dim_v=d_v, kernel_override="sm90")["hdim_v"] == 128


@pytest.mark.parametrize(
    "d_qk,d_v", [(192, 192), (192, 129), (192, 160), (160, 128), (128, 64), (224, 128), (256, 128)]
)
def test_forward_other_pairs_keep_level_1(d_qk, d_v):
    """Every other (d_qk, d_v) runs the kernel of its compiled d_qk, V's
    columns past d_v zero (level 1)."""
    compiled = next(d for d in sorted(FWD_TABLE) if d >= d_qk)
    plan = fwd(2, 8192, 8192, 16, 16, d_qk, causal=True, head_dim_v=d_v)
    assert plan["kernel"] == "sm90"
    assert (plan["hdim"], plan["hdim_v"]) == (compiled, compiled)
    assert plan["block_n"] == FWD_TABLE[compiled]["kBlockNSm90"]
    assert "(192, 128)" not in plan["reason"]
    with pytest.raises(RuntimeError, match="head_dim_v"):
        fwd(2, 128, 128, 4, 4, d_qk, head_dim_v=d_qk + 1)


def test_empty_forward():
    assert fwd(0, 128, 128, 4, 4, 128)["kernel"] == "none"
    assert fwd(2, 0, 128, 4, 4, 128)["kernel"] == "none"


@pytest.mark.parametrize("device", [H100, A100])
def test_forward_decode_shape_on_the_splitkv_kernel(device):
    """A fixed-length call whose query rows of a kv head fit one split-KV
    query block (a decode step through flash_attn_func or SDPA) runs the
    split-KV kernel with the split count a KV-cache call of its shape gets."""
    for batch, seqlen_q, seqlen_k, nheads, nheads_k in [
        (1, 1, 8192, 32, 8),
        (8, 1, 640, 16, 16),
        (64, 1, 4096, 32, 8),
        (2, 4, 2048, 32, 8),
    ]:
        plan = fwd(batch, seqlen_q, seqlen_k, nheads, nheads_k, 128, device=device, causal=True)
        split = decode(batch, seqlen_q, seqlen_k, nheads, nheads_k, 128, device=device)
        assert plan["kernel"] == "splitkv", plan
        assert plan["splits"] == split["splits"] >= 1, (plan, split)
        assert plan["warps_n"] == split["warps_n"] and plan["block_m"] == split["block_m"]
    # Batch 1 over 8k keys: split to fill the SMs.
    assert fwd(1, 1, 8192, 32, 8, 128, device=device)["splits"] > 1
    # Score extras ride along (the kernel's extras variant).
    for kw in (
        dict(softcap=30.0),
        dict(alibi=True),
        dict(softmax_scale=-0.1),
        dict(window_size_left=64),
    ):
        assert fwd(1, 1, 8192, 32, 8, 128, device=device, **kw)["kernel"] == "splitkv", kw


def test_forward_splitkv_only_where_it_serves():
    decode_shape = (1, 1, 8192, 32, 8, 128)
    assert fwd(*decode_shape)["kernel"] == "splitkv"
    # More query rows of a kv head than one split-KV query block.
    assert fwd(1, 256, 8192, 32, 8, 128)["kernel"] in ("sm80", "sm90")
    assert fwd(2, 8192, 8192, 16, 16, 128)["kernel"] == "sm90"
    # What only the forward kernels have, and a kernel named by override.
    for kw in (
        dict(dropout_p=0.1),
        dict(return_softmax=True),
        dict(head_dim_v=64),
        dict(kernel_override="sm90"),
        dict(kernel_override="sm80"),
    ):
        plan = fwd(*decode_shape, **kw)
        assert plan["kernel"] in ("sm80", "sm90"), (kw, plan)
    # Varlen calls (plan_varlen_split, varlen_fwd's num_splits): 1 keeps the
    # forward kernels, and so does a kernel override under the default 0.
    assert fwd(*decode_shape, varlen=True, num_splits=1)["kernel"] in ("sm80", "sm90")
    assert fwd(*decode_shape, varlen=True, kernel_override="sm90")["kernel"] == "sm90"
    assert fwd(*decode_shape, varlen=True, num_splits=1, page_size=16)["kernel"] == "sm90"


def test_varlen_decode_splits_by_default():
    """varlen_fwd's default num_splits=0: a decode-like varlen call (vLLM's and
    flash-attn 2.x's decode through flash_attn_varlen_func: one query row per
    sequence, paged keys) runs on the split-KV kernel, as flash-attn 2.x's
    varlen forward splits it, with at least two splits (the combine writes the
    rows outside every sequence): on the forward kernels each query head's
    row took a 128-row tile (PERF_LOG 2026-12-01 "varlen decode")."""
    b1 = fwd(1, 1, 32768, 32, 8, 128, varlen=True, page_size=16)
    assert b1["kernel"] == "splitkv" and b1["splits"] > 2
    assert b1["splits"] == decode(1, 1, 32768, 32, 8, 128, paged=True)["splits"]
    # A batch that fills the SMs with one split gets the floor of two.
    b64 = fwd(64, 1, 4096, 32, 8, 128, varlen=True, page_size=16)
    assert b64["kernel"] == "splitkv" and b64["splits"] == 2, b64
    assert "min_splits" in b64["reason"]
    # Speculative rows (4 a sequence x 4 query heads a kv head) fit one block.
    assert fwd(8, 4, 8192, 32, 8, 128, varlen=True)["kernel"] == "splitkv"
    # More query rows than one split-KV block, dropout or probabilities: the
    # forward kernels.
    assert fwd(8, 256, 8192, 32, 8, 128, varlen=True)["kernel"] == "sm90"
    assert fwd(8, 1, 8192, 32, 8, 128, varlen=True, dropout_p=0.1)["kernel"] != "splitkv"
    assert fwd(8, 1, 8192, 32, 8, 128, varlen=True, return_softmax=True)["kernel"] != "splitkv"
    # An explicit count is honoured.
    assert fwd(8, 1, 8192, 32, 8, 128, varlen=True, num_splits=5)["splits"] == 5


# --------------------------------------------------------------- backward


def test_backward_kernels():
    long = (2, 4096, 4096, 16, 16, 128)
    plan = bwd(*long)
    assert plan["kernel"] == "sm90" and plan["splits"] == 1
    assert plan["grid"] == "%dx16x2" % (4096 // plan["block_n"])
    assert bwd(*long, device=A100)["kernel"] == "sm80"
    dropout = bwd(*long, dropout_p=0.1)
    assert dropout["kernel"] == "sm90" and dropout["variant"] == "score_mods"
    assert bwd(*long, alibi=True)["variant"] == "score_mods"
    assert bwd(*long, kernel_override="sm80")["kernel"] == "sm80"
    assert bwd(*long, tma_aligned=False)["kernel"] == "sm80"
    assert bwd(0, 128, 128, 4, 4, 128)["kernel"] == "none"


def bwd_tile_draws_dropout(head_dim, block_m):
    """plan.h bwd_sm90_draws_dropout: 64-row query blocks and 48 registers to
    spare beside S^T, dP^T, dK and dV (BwdSm90KernelTraits::kDrawsDropout)."""
    block_n = BWD_TABLE[head_dim]["kBlockN"]
    accumulators = block_n * (block_m + head_dim) // 128
    return block_m == 64 and 240 - accumulators >= 48


def hopper_bwd_dropout_block_m(head_dim):
    """plan.h bwd_sm90_dropout_block_m: the table's query block where it draws
    dropout, else 64 rows where they do, else None."""
    table = BWD_TABLE[head_dim]["kBlockMSm90"]
    for block_m in (table, 64):
        if block_m <= table and bwd_tile_draws_dropout(head_dim, block_m):
            return block_m
    return None


def test_hopper_backward_dropout_head_dims():
    """Which head dims the Hopper backward draws dropout at
    (docs/dropout_sm90.md section 6): every one, d64 on 64-row query blocks
    instead of its table's 128."""
    hopper = [d for d in sorted(BWD_TABLE) if BWD_TABLE[d]["kBlockMSm90"]]
    table_draws = [d for d in hopper if bwd_tile_draws_dropout(d, BWD_TABLE[d]["kBlockMSm90"])]
    assert table_draws == [32, 96, 128, 160, 192, 224, 256]
    assert {d: hopper_bwd_dropout_block_m(d) for d in hopper} == {d: 64 for d in hopper}


@pytest.mark.parametrize("head_dim", HOPPER_BWD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_backward_dropout_on_hopper(head_dim, causal):
    """The backward of a call with dropout runs the Hopper kernel's score-mods
    variant, as softcap and ALiBi do, on a tile that draws the mask: the
    table's, or at d64 64-row query blocks instead of 128."""
    long = (2, 8192, 8192, 16, 16, head_dim)
    plain = bwd(*long, causal=causal)
    assert plain["kernel"] == "sm90"
    dropout = bwd(*long, causal=causal, dropout_p=0.1)
    assert dropout["kernel"] == "sm90" and dropout["variant"] == "score_mods"
    block_m = hopper_bwd_dropout_block_m(head_dim)
    assert (dropout["block_m"], dropout["block_n"]) == (block_m, plain["block_n"])
    assert bwd(*long, causal=causal, softcap=30.0)["block_m"] == plain["block_m"]
    assert dropout["grid"] == plain["grid"] and dropout["splits"] == 1
    assert "dropout" not in dropout["reason"]
    for p in (1e-6, 0.5, 0.9, 0.999):
        assert bwd(*long, dropout_p=p)["kernel"] == "sm90"
    mods = bwd(*long, dropout_p=0.1, softcap=30.0, alibi=True)
    assert mods["kernel"] == "sm90" and mods["variant"] == "score_mods"
    assert bwd(*long, varlen=True, dropout_p=0.1)["kernel"] == "sm90"
    assert bwd(2, 8192, 8192, 16, 2, head_dim, dropout_p=0.1)["kernel"] == "sm90"
    # Deterministic: the ordered kernel is a variant of the plain one, so
    # dropout takes dQ splits, as softcap does.
    det = bwd(*long, causal=causal, dropout_p=0.1, deterministic=True)
    assert det["kernel"] == "sm90" and det["variant"] == "score_mods"
    assert det["ordered_dq"] == 0 and det["splits"] > 1
    # Still the SM80 kernel: a forced SM80, another device, a scale that is
    # not normal (a negative one draws on Hopper too).
    forced = bwd(*long, dropout_p=0.1, kernel_override="sm80")
    assert forced["kernel"] == "sm80" and forced["variant"] == "score_extras"
    assert bwd(*long, dropout_p=0.1, device=A100)["kernel"] == "sm80"
    zero = bwd(*long, dropout_p=0.1, softmax_scale=0.0)
    assert zero["kernel"] == "sm80" and "softmax scale" in zero["reason"]
    negative = bwd(*long, dropout_p=0.1, softmax_scale=-0.1)
    assert negative["kernel"] == "sm90" and negative["variant"] == "score_mods"


def test_backward_d64_hopper_tile():
    # d64 runs the Hopper kernel with 128-row query blocks, FA4's 128 x 128
    # (kBlockMSm90): every variant, the ordered one's dQ staging buffer too,
    # fits an sm90 block.
    long = (2, 8192, 8192, 32, 32, 64)
    for kw in ({}, {"alibi": True}, {"causal": True, "deterministic": True}):
        plan = bwd(*long, **kw)
        assert plan["kernel"] == "sm90" and plan["block_m"] == 128, (kw, plan)
        assert plan["block_n"] == 128 and plan["grid"] == "64x32x2", (kw, plan)
    assert bwd(*long, causal=True, deterministic=True)["ordered_dq"] == 1


def test_backward_large_smem_tile():
    long = (1, 4096, 4096, 8, 8, 256)
    # sm80 blocks cannot hold the double-buffered d256 tile; sm90 ones can.
    assert bwd(*long, device=A100)["kernel"] == "sm80"
    assert bwd(*long, kernel_override="sm80")["kernel"] == "sm80_large_smem"
    # The score-extras variant keeps the table's tile.
    assert bwd(*long, kernel_override="sm80", softcap=10.0)["kernel"] == "sm80"


def bwd_sm90_smem_bytes(d_qk, d_v, block_m, block_n, stages=2):
    """plan.h bwd_sm90_smem_bytes: Q and K at d_qk, dO and V at d_v, dS (and
    the split design's P^T), the row statistics, the dQ staging buffer of the
    keys-per-warpgroup design, the mbarriers."""
    ds = 2 * block_m * block_n * 2
    p = 0 if block_n == 128 else ds
    dq = block_m * d_qk * 4 if block_n == 128 else 0
    return (
        stages * block_m * (d_qk + d_v) * 2
        + block_n * (d_qk + d_v) * 2
        + ds
        + p
        + stages * 2 * block_m * 4
        + dq
        + 48
    )


@pytest.mark.parametrize("d_qk,d_v", [(192, 128), (192, 64), (192, 96), (176, 128), (161, 8)])
def test_backward_pair_kernel(d_qk, d_v):
    """d_qk in (160, 192] with d_v <= 128 runs the (192, 128) Hopper backward
    (dO, V and dV at 128 columns) on d192's 64 x 64 tile, with every score rule,
    deterministic mode and GQA the d192 kernel takes; where the Hopper kernel
    does not run, the SM80 one of d_qk with dO and V padded (level 1)."""
    row = BWD_TABLE[192]
    block_m, block_n = row["kBlockMSm90"], row["kBlockN"]
    assert (block_m, block_n) == (64, 64)
    # 153 KiB against d192's 177 (bwd_tile_config.h, BwdTileConfig<192, 128>).
    assert bwd_sm90_smem_bytes(192, 128, block_m, block_n) == 156720
    assert bwd_sm90_smem_bytes(192, 192, block_m, block_n) == 181296
    long = (2, 8192, 8192, 16, 16, d_qk)
    for causal in (False, True):
        plan = bwd(*long, causal=causal, head_dim_v=d_v)
        assert plan["kernel"] == "sm90" and plan["variant"] == "plain", plan
        assert (plan["hdim"], plan["hdim_v"]) == (192, 128)
        assert (plan["block_m"], plan["block_n"]) == (block_m, block_n)
        assert plan["grid"] == "%dx16x2" % (8192 // block_n) and plan["splits"] == 1
        assert "(192, 128) kernel" in plan["reason"]
    # Softcap, ALiBi, dropout: the pair kernel's score-mods variant (its draws
    # fit: 240 - 64 (2 x 64 + 192 + 128) / 256 = 128 registers to spare).
    for kw in ({"dropout_p": 0.1}, {"softcap": 30.0}, {"alibi": True}):
        mods = bwd(*long, head_dim_v=d_v, **kw)
        assert mods["kernel"] == "sm90" and mods["variant"] == "score_mods", (kw, mods)
        assert (mods["hdim"], mods["hdim_v"]) == (192, 128)
    mods = bwd(*long, head_dim_v=d_v, dropout_p=0.1, softcap=30.0, alibi=True)
    assert mods["variant"] == "score_mods" and mods["hdim_v"] == 128
    # Deterministic: ordered dQ on the plain variant, dQ splits with score
    # mods or a left window bound, as at d192.
    det = bwd(*long, causal=True, deterministic=True, head_dim_v=d_v)
    assert det["ordered_dq"] == 1 and det["splits"] == 1 and det["hdim_v"] == 128
    det = bwd(*long, deterministic=True, softcap=30.0, head_dim_v=d_v)
    assert det["ordered_dq"] == 0 and det["splits"] > 1 and det["hdim_v"] == 128
    det = bwd(*long, deterministic=True, window_size_left=512, window_size_right=0, head_dim_v=d_v)
    assert det["ordered_dq"] == 0 and det["splits"] > 1 and det["hdim_v"] == 128
    # GQA / MQA and varlen.
    for nheads_k in (2, 1):
        gqa = bwd(2, 8192, 8192, 16, nheads_k, d_qk, head_dim_v=d_v)
        assert gqa["kernel"] == "sm90" and gqa["hdim_v"] == 128
        gqa = bwd(2, 8192, 8192, 16, nheads_k, d_qk, deterministic=True, head_dim_v=d_v)
        assert gqa["kernel"] == "sm90" and gqa["hdim_v"] == 128
    assert bwd(*long, varlen=True, head_dim_v=d_v)["hdim_v"] == 128
    # The SM80 kernel of d_qk, dO and V padded to it: another device, a
    # forced SM80, TMA refused, no sm_90a code, a scale that is not normal.
    for sm80 in (
        bwd(*long, head_dim_v=d_v, device=A100),
        bwd(*long, head_dim_v=d_v, kernel_override="sm80"),
        bwd(*long, head_dim_v=d_v, tma_aligned=False),
        bwd(*long, head_dim_v=d_v, sm90a_built=False),
        bwd(*long, head_dim_v=d_v, softmax_scale=0.0),
    ):
        assert sm80["kernel"].startswith("sm80"), sm80
        assert (sm80["hdim"], sm80["hdim_v"]) == (192, 192), sm80
    assert bwd(*long, head_dim_v=d_v, kernel_override="sm90")["hdim_v"] == 128
    negative = bwd(*long, head_dim_v=d_v, softmax_scale=-0.1)
    assert negative["kernel"] == "sm90" and negative["variant"] == "score_mods"
    assert negative["hdim_v"] == 128


@pytest.mark.parametrize(
    "d_qk,d_v", [(192, 192), (192, 129), (192, 160), (160, 128), (128, 64), (224, 128), (256, 128)]
)
def test_backward_other_pairs_keep_level_1(d_qk, d_v):
    """Every other (d_qk, d_v) runs the backward of its compiled d_qk, dO's and
    V's columns past d_v zero (level 1)."""
    compiled = next(d for d in sorted(BWD_TABLE) if d >= d_qk)
    plan = bwd(2, 8192, 8192, 16, 16, d_qk, causal=True, head_dim_v=d_v)
    assert plan["kernel"] == "sm90"
    assert (plan["hdim"], plan["hdim_v"]) == (compiled, compiled)
    assert plan["block_n"] == BWD_TABLE[compiled]["kBlockN"]
    assert "(192, 128)" not in plan["reason"]
    # d_v = d_qk is the default.
    assert bwd(2, 8192, 8192, 16, 16, d_qk)["hdim_v"] == compiled
    with pytest.raises(RuntimeError, match="head_dim_v"):
        bwd(2, 128, 128, 4, 4, d_qk, head_dim_v=d_qk + 1)


def test_deterministic_dq_splits():
    # The SM80 kernel: about two blocks per SM over (batch, heads), at most
    # one per key block.
    sm80 = {"kernel_override": "sm80", "deterministic": True}
    plan = bwd(1, 8192, 8192, 16, 16, 128, **sm80)
    assert plan["splits"] == math.ceil(2 * 132 / 16) and plan["ordered_dq"] == 0
    assert plan["grid"] == "%dx16x1" % plan["splits"]
    assert bwd(1, 8192, 256, 16, 16, 128, **sm80)["splits"] == 256 // 128
    assert bwd(64, 1024, 1024, 32, 32, 128, **sm80)["splits"] == 1


def test_deterministic_ordered_dq_on_hopper():
    # The Hopper kernel keeps one block per key block and orders the dQ
    # additions by key block, with or without a causal mask.
    for causal in (False, True):
        plan = bwd(1, 8192, 8192, 16, 16, 128, causal=causal, deterministic=True)
        assert plan["kernel"] == "sm90" and plan["ordered_dq"] == 1
        assert plan["splits"] == 1 and plan["grid"] == "64x16x1"
    # A left window bound: a query block's first contributor is not key block
    # 0, so the Hopper kernel takes dQ splits.
    plan = bwd(
        1, 8192, 8192, 16, 16, 128, window_size_left=512, window_size_right=0, deterministic=True
    )
    assert plan["kernel"] == "sm90" and plan["ordered_dq"] == 0
    assert plan["splits"] == math.ceil(2 * 132 / 16)
    # Softcap / ALiBi: the ordered kernel is a variant of the plain one only.
    plan = bwd(1, 8192, 8192, 16, 16, 128, softcap=30.0, deterministic=True)
    assert plan["variant"] == "score_mods" and plan["ordered_dq"] == 0
    # Not deterministic: neither.
    plan = bwd(1, 8192, 8192, 16, 16, 128)
    assert plan["ordered_dq"] == 0 and plan["splits"] == 1


# ----------------------------------------------------------------- decode


def wave_rule_splits(base, slots, cap):
    """The split count rule of choose_kv_splits, in Python."""

    def fill(splits):
        waves = base * splits / slots
        return waves / math.ceil(waves)

    if fill(1) >= 0.95:
        return 1
    best = max(fill(s) for s in range(1, cap + 1))
    return next(s for s in range(1, cap + 1) if fill(s) >= 0.95 * best)


@pytest.mark.parametrize("batch", [1, 2, 4, 8, 16, 32, 64, 128])
@pytest.mark.parametrize("paged", [False, True])
def test_decode_split_counts(batch, paged):
    """GQA 32:8 d128, one query: the decode variant (16 rows); a contiguous
    cache runs one block per SM, a paged one two."""
    cache = 16384
    plan = decode(batch, 1, cache, 32, 8, 128, paged=paged)
    assert plan["warps_n"] == 4 and plan["block_m"] == 16 and plan["m_blocks"] == 1
    slots = H100["num_sms"] * (2 if paged else 1)
    expected = wave_rule_splits(batch * 8, slots, min(128, cache // 64))
    assert plan["splits"] == expected
    assert plan["items"] == batch * 8 * expected


def test_decode_split_examples():
    assert decode(1, 1, 16384, 32, 8, 128)["splits"] == 16
    assert decode(8, 1, 16384, 32, 8, 128)["splits"] == 2
    assert decode(16, 1, 16384, 32, 8, 128)["splits"] == 1
    assert decode(1, 1, 16384, 32, 8, 128, paged=True)["splits"] == 32
    # An explicit count, capped at the cache's key blocks.
    assert decode(1, 1, 16384, 32, 8, 128, num_splits=7)["splits"] == 7
    assert decode(1, 1, 256, 32, 8, 128, num_splits=100)["splits"] == 256 // 64


@pytest.mark.parametrize("cache", [8192, 65536])
def test_decode_batch_one_long_context_fills_one_wave(cache):
    """Issue 55 item 2's shape (GQA 32:8 d128, one query, contiguous cache, 132
    SMs): the 4 query heads of a kv head share one block's 16 rows, and 16
    splits make 128 blocks, one per SM with 4 SMs idle. The count in
    docs/serving.md (PERF_LOG 2026-11-29, batch-1 decode counted) keeps it so:
    the idle SMs cost the memory-bound stream nothing."""
    plan = decode(1, 1, cache, 32, 8, 128)
    assert (plan["warps_n"], plan["block_m"], plan["m_blocks"]) == (4, 16, 1)
    assert plan["splits"] == 16 and plan["items"] == 128 and plan["grid"] == 128
    assert plan["persistent"] == 0 and plan["cluster"] == 2
    # A block streams 8 key tiles at 8k, 64 at 64k: both ask for the tiles'
    # shared memory alone (three stages of 64-key K and V tiles and one 16-row
    # Q tile, 2 bytes each); the grid is one block per SM either way.
    assert plan["smem"] == 2 * 128 * (2 * 3 * 64 + 16)


@pytest.mark.parametrize("cache", [8192, 65536])
def test_decode_batch_sixteen_no_split(cache):
    """Batch 16: 128 (batch, kv head) items already fill one wave: no split."""
    plan = decode(16, 1, cache, 32, 8, 128)
    assert plan["splits"] == 1 and plan["items"] == 128 and plan["grid"] == 128
    assert plan["persistent"] == 0 and plan["cluster"] == 2


def test_decode_variants_and_grid():
    # Many rows per kv head: the 64-row variant, which keeps one block per item.
    plan = decode(4, 64, 4096, 32, 8, 128)
    assert plan["warps_n"] == 1 and plan["block_m"] == 64 and plan["m_blocks"] == 4
    assert plan["cluster"] == 1
    # An sm89 block cannot hold the decode variant's three stages at d256.
    assert decode(1, 1, 4096, 32, 8, 256, device=L40)["warps_n"] == 1
    # Contiguous cache, one block per SM: clusters of 2 on sm90, none on sm80.
    assert decode(16, 1, 32768, 32, 8, 128)["cluster"] == 2
    assert decode(16, 1, 32768, 32, 8, 128, device=A100)["cluster"] == 1
    assert decode(16, 1, 32768, 32, 8, 128, device=A100)["programmatic"] == 0
    # 1k-4k keys per item, more items than two blocks per SM: persistent.
    plan = decode(64, 1, 1024, 32, 8, 128)
    assert plan["persistent"] == 1 and plan["grid"] == 132 and plan["cluster"] == 1
    # Softcap keeps one block per item.
    assert decode(64, 1, 1024, 32, 8, 128, softcap=30.0)["persistent"] == 0


def test_decode_head_dim_512():
    """d512 (head dims 257-512): the decode variant of 2 key slabs x 2 value
    halves, 16 rows a block whatever the row count, two 64 KB stages and the
    4 KB score exchange (151,552 B: one block per SM on sm90 and sm80), never
    persistent; an sm89 block cannot hold it."""
    for head_dim in (264, 512):
        plan = decode(1, 1, 4096, 32, 8, head_dim)
        assert plan["head_dim"] == 512 and plan["warps_n"] == 2 and plan["block_m"] == 16
        assert plan["m_blocks"] == 1 and plan["smem"] == 147456 + 4096
    # Many rows: several 16-row query blocks, no 64-row variant.
    plan = decode(4, 64, 4096, 32, 8, 512)
    assert plan["warps_n"] == 2 and plan["block_m"] == 16 and plan["m_blocks"] == 16
    # Short items of a large batch would take the persistent grid at d128.
    assert decode(64, 1, 1024, 32, 8, 128)["persistent"] == 1
    assert decode(64, 1, 1024, 32, 8, 512)["persistent"] == 0
    assert decode(16, 1, 8192, 32, 8, 512, device=A100)["warps_n"] == 2
    plan = decode(16, 1, 8192, 32, 8, 512, device=L40)
    assert plan["warps_n"] == 0 and plan["splits"] == 0
    # The in-kernel append's table rows still fit beside the tiles (160 KiB).
    assert (
        decode(16, 1, 16384, 32, 8, 512, seqlen_new=1, rotary_dim=512)["append_in_attention"] == 1
    )
    # Absorbed MLA's 576 (d_v 512): the same split, 165,888 B, an sm80 block too.
    plan = decode(64, 1, 4096, 128, 1, 576)
    assert plan["head_dim"] == 576 and plan["warps_n"] == 2 and plan["block_m"] == 16
    assert plan["m_blocks"] == 8 and plan["smem"] == 165888
    assert decode(64, 1, 4096, 128, 1, 576, device=A100)["warps_n"] == 2
    assert plan["v_in_k"] == 0
    with pytest.raises(RuntimeError, match=r"head_dim must be in \[1, 576\], got 584"):
        decode(1, 1, 64, 8, 8, 584)


def test_mla_shared_cache_reads_v_in_the_k_tile():
    """Absorbed MLA's shared cache (v_cache = k_cache[..., :512]) at 576: the
    kernel reads V in the K tile, so a block holds Q, two K stages and the
    score exchange (96,256 B) and two blocks share an SM; the splits fill two
    blocks per SM. Score
    extras, an append and other head dims keep the kernel that loads V."""
    for paged in (False, True):
        plan = decode(64, 1, 4096, 128, 1, 576, v_in_k=True, paged=paged)
        assert plan["v_in_k"] == 1 and plan["smem"] == 96256 and plan["persistent"] == 0
        assert plan["m_blocks"] == 8 and plan["splits"] == 1  # 512 blocks: two waves of 264
        # 128 blocks would fill half of the 264 slots: two splits fill them.
        assert decode(16, 1, 4096, 128, 1, 576, v_in_k=True, paged=paged)["splits"] == 2
    assert decode(16, 1, 4096, 128, 1, 576)["splits"] == 1  # one block an SM: 128 of 132
    on_a100 = decode(16, 1, 4096, 128, 1, 576, v_in_k=True, device=A100)
    assert on_a100["v_in_k"] == 1 and on_a100["smem"] == 96256
    for kw in (dict(softcap=30.0), dict(alibi=True), dict(seqlen_new=1)):
        plan = decode(16, 1, 4096, 128, 1, 576, v_in_k=True, **kw)
        assert plan["v_in_k"] == 0 and plan["smem"] == 165888, kw
    assert decode(16, 1, 4096, 32, 8, 512, v_in_k=True)["v_in_k"] == 0
    assert decode(16, 1, 4096, 32, 8, 128, v_in_k=True)["v_in_k"] == 0


def test_forward_above_256():
    """Head dims 257-512 run the SM80 kernel's d512 row (no Hopper tile), in
    two passes over slabs of V's columns, whatever the override; calls whose
    query rows fit one split-KV block run that kernel, as at every head dim.
    Dropout takes the SM80 kernel's score-extras variant; a device of 99 KiB
    blocks holds neither kernel (the op refuses it by name); S_dmask is the
    op's to refuse above 256."""
    for head_dim in (264, 512):
        plan = fwd(2, 4096, 4096, 16, 16, head_dim)
        assert plan["kernel"] == "sm80" and plan["hdim"] == 512
        # sm90 blocks hold the large-shared-memory tile, 128 rows with 8 warps.
        assert (plan["block_m"], plan["block_n"], plan["warps"], plan["large_smem"]) == (
            128,
            64,
            8,
            1,
        )
        assert "no Hopper tile" in plan["reason"]
    assert fwd(2, 4096, 4096, 16, 16, 512, kernel_override="sm90")["kernel"] == "sm80"
    assert fwd(2, 4096, 4096, 16, 16, 512, head_dim_v=256)["kernel"] == "sm80"
    dropout = fwd(2, 1024, 1024, 16, 16, 512, dropout_p=0.1)
    assert dropout["kernel"] == "sm80" and dropout["variant"] == "score_extras"
    assert (dropout["block_m"], dropout["block_n"], dropout["warps"]) == (128, 32, 8)
    # Decode-like rows (seqlen_q x group within one split-KV block).
    assert fwd(2, 1, 4096, 16, 16, 512)["kernel"] == "splitkv"
    assert fwd(2, 1024, 1024, 16, 16, 512, device=L40)["kernel"] == "none"
    # An sm80 block holds the table's 64 x 64 with 4 warps (64 x 32 with the extras).
    a100 = fwd(2, 1024, 1024, 16, 16, 512, device=A100)
    assert (a100["kernel"], a100["block_m"], a100["block_n"], a100["warps"]) == ("sm80", 64, 64, 4)
    assert a100["large_smem"] == 0
    assert fwd(2, 1024, 1024, 16, 16, 512, device=A100, softcap=5.0)["block_n"] == 32
    # No other head dim has a large-shared-memory forward tile.
    assert fwd(2, 4096, 4096, 16, 16, 256, kernel_override="sm80")["large_smem"] == 0
    # Below 256 nothing changes: many rows take the forward kernels.
    assert fwd(2, 4096, 4096, 16, 16, 256)["kernel"] in ("sm80", "sm90")
    # The backward of these head dims is the SM80 kernel's d512 row.
    assert bwd(2, 1024, 1024, 16, 16, 512)["kernel"] == "sm80_large_smem"
    with pytest.raises(RuntimeError, match=r"head_dim must be in \[1, 512\], got 576"):
        bwd(2, 1024, 1024, 16, 16, 576)


def test_decode_append_in_attention():
    base = (16, 1, 16384, 32, 8, 128)
    assert decode(*base, seqlen_new=1)["append_in_attention"] == 1
    assert decode(*base, seqlen_new=1, rotary_dim=128)["append_in_attention"] == 1
    assert decode(*base)["append_in_attention"] == 0
    # Longer appends, unaligned or odd rotary tables, softcap: the pre-kernel.
    assert decode(*base, seqlen_new=17)["append_in_attention"] == 0
    assert (
        decode(*base, seqlen_new=1, rotary_dim=128, rotary_aligned=False)["append_in_attention"]
        == 0
    )
    assert decode(*base, seqlen_new=1, rotary_dim=24)["append_in_attention"] == 0
    assert decode(*base, seqlen_new=1, softcap=30.0)["append_in_attention"] == 0


# ------------------------------------------------ the plan against a real GPU


def current_device():
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return dict(
        cc_major=props.major,
        cc_minor=props.minor,
        num_sms=props.multi_processor_count,
        smem_per_block_optin=props.shared_memory_per_block_optin,
        smem_per_sm=props.shared_memory_per_multiprocessor,
        reserved_smem_per_block=1024,
    )


@pytest.mark.cuda
@pytest.mark.parametrize("seqlen", [128, 4096])
def test_plan_matches_launched_forward(seqlen, monkeypatch):
    monkeypatch.delenv("FLASH_ATTN_FWD_KERNEL", raising=False)
    sm90a = "sm_90a" in flash_attn_cuda.build_info
    q, k, v = (
        torch.randn(2, seqlen, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3)
    )
    plan = fwd(
        2, seqlen, seqlen, 8, 8, 128, device=current_device(), causal=True, sm90a_built=sm90a
    )
    names = launched_kernels(
        lambda: ops.fwd(q, k, v, None, 0.0, 128**-0.5, True, -1, 0, 0.0, False, 0, 0, None)
    )
    fwd_names = [n for n in names if "flash_fwd" in n]
    assert fwd_names, names
    assert any("sm90" in n for n in fwd_names) == (plan["kernel"] == "sm90"), (plan, fwd_names)


@pytest.mark.cuda
@pytest.mark.parametrize("page_size", [1, 3, 16, 64])
def test_plan_matches_launched_paged_forward(page_size, monkeypatch):
    """Paged varlen keys of any page size run the kernel the plan names: on
    an sm90 build and GPU the Hopper one (boxes or the row gather)."""
    monkeypatch.delenv("FLASH_ATTN_FWD_KERNEL", raising=False)
    sm90a = "sm_90a" in flash_attn_cuda.build_info
    batch, seqlen, heads = 2, 4096, 8
    pages_per_seq = (seqlen + page_size - 1) // page_size
    q = torch.randn(batch * seqlen, heads, 128, device="cuda", dtype=torch.bfloat16)
    k_cache = torch.randn(
        batch * pages_per_seq, page_size, heads, 128, device="cuda", dtype=torch.bfloat16
    )
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(batch * pages_per_seq, device="cuda", dtype=torch.int32)
    table = table.view(batch, pages_per_seq)
    cu = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * seqlen
    plan = fwd(
        batch,
        seqlen,
        seqlen,
        heads,
        heads,
        128,
        device=current_device(),
        causal=True,
        varlen=True,
        page_size=page_size,
        sm90a_built=sm90a,
    )
    names = launched_kernels(
        lambda: ops.varlen_fwd(
            q,
            k_cache,
            v_cache,
            cu,
            cu,
            table,
            None,
            seqlen,
            seqlen,
            0.0,
            128**-0.5,
            True,
            -1,
            0,
            0.0,
            False,
            0,
            0,
            None,
        )
    )
    fwd_names = [n for n in names if "flash_fwd" in n]
    assert fwd_names, names
    assert any("sm90" in n for n in fwd_names) == (plan["kernel"] == "sm90"), (plan, fwd_names)
    if plan["kernel"] == "sm90":
        assert plan["keys"] == expected_paged_keys(page_size, plan["block_n"])
        # d128's two MMA warpgroups: boxes and the row gather are kernels of
        # their own (fwd_launch.h fwd_sm90_kernel_for), the kernel's last
        # template argument (FwdSm90Keys, demangled as a cast or a name).
        keys = {"paged_boxes": ("1", "kPagedBoxes"), "paged_gather": ("2", "kPagedGather")}
        sm90_keys = {
            m[1] or m[2]
            for n in fwd_names
            for m in re.finditer(r"FwdSm90Keys(?:\)(\d)|::(\w+))>", n)
        }
        assert sm90_keys and sm90_keys <= set(keys[plan["keys"]]), (plan, fwd_names)


@pytest.mark.cuda
def test_plan_matches_launched_decode_shaped_forward(monkeypatch):
    """seqlen_q 1 through the fwd op: the split-KV kernel (and its combine
    where the plan splits), as the plan says."""
    monkeypatch.delenv("FLASH_ATTN_FWD_KERNEL", raising=False)
    sm90a = "sm_90a" in flash_attn_cuda.build_info
    q = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 8192, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    plan = fwd(1, 1, 8192, 32, 8, 128, device=current_device(), causal=True, sm90a_built=sm90a)
    assert plan["kernel"] == "splitkv"
    names = launched_kernels(
        lambda: ops.fwd(q, k, v, None, 0.0, 128**-0.5, True, -1, 0, 0.0, False, 0, 0, None)
    )
    assert any("splitkv" in n for n in names), names
    assert not any("flash_fwd_sm90_kernel" in n or "flash_fwd_kernel" in n for n in names), names
    assert any("combine" in n for n in names) == (plan["splits"] > 1), (plan, names)


@pytest.mark.cuda
def test_plan_matches_launched_decode():
    q = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k_cache = torch.randn(1, 16384, 8, 128, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    seqlens = torch.full((1,), 16384, device="cuda", dtype=torch.int32)
    plan = decode(1, 1, 16384, 32, 8, 128, device=current_device())
    names = launched_kernels(
        lambda: ops.fwd_kvcache(
            q,
            k_cache,
            v_cache,
            None,
            None,
            seqlens,
            None,
            None,
            None,
            None,
            None,
            None,
            128**-0.5,
            True,
            -1,
            0,
            0.0,
            False,
            0,
        )
    )
    combined = any("combine" in n for n in names)
    assert combined == (plan["splits"] > 1), (plan, names)


def test_fp8_cache_plans_the_staged_kernel():
    """An e4m3 cache (docs/fp8.md): the decode variant keeps three 8-bit
    staging stages and Q, its warps reading their fragments from the staged
    bytes (d128: 3 x 16 KB + Q 4 KB = 53,248 B, against the 16-bit kernel's
    102,400), where the others convert into a 16-bit tile set beside them; a
    block per item (no persistent grid) and no in-kernel append."""
    paged = decode(16, 1, 8192, 32, 8, 128, paged=True, fp8_cache=True)
    assert paged["smem"] == 53248 and paged["warps_n"] == 4
    # d96: rows not whole 64-byte atoms: 3 x 12 KB staged, a 24 KB tile set, Q of 32 rows.
    assert decode(16, 1, 8192, 32, 8, 96, fp8_cache=True)["smem"] == 3 * 12288 + 24576 + 6144
    assert decode(16, 1, 8192, 32, 8, 128, paged=True)["smem"] == 102400
    # Short items of a large batch take the persistent grid on a 16-bit cache only.
    assert decode(64, 1, 1024, 32, 8, 128)["persistent"] == 1
    assert decode(64, 1, 1024, 32, 8, 128, fp8_cache=True)["persistent"] == 0
    appending = decode(16, 1, 8192, 32, 8, 128, seqlen_new=1, fp8_cache=True)
    assert appending["append_in_attention"] == 0
    # Absorbed MLA over an e4m3 latent cache reads V in the K tile too: one
    # staging and one 16-bit K tile a stage's worth, as the bf16 K stages.
    mla = decode(16, 1, 4096, 128, 1, 576, v_in_k=True, fp8_cache=True)
    assert mla["v_in_k"] == 1
    assert mla["smem"] == decode(16, 1, 4096, 128, 1, 576, v_in_k=True)["smem"]
    # The 64-row variant (many rows a kv head) stages as well: its two 16 KB
    # staging stages and one tile set take what its two 16-bit stages took.
    rows = decode(2, 16, 4096, 32, 8, 128, fp8_cache=True)
    assert rows["warps_n"] == 1 and rows["smem"] == 81920
    assert decode(2, 16, 4096, 32, 8, 128)["smem"] == 81920


def test_fp8_attention_plans_the_split_kv_kernel():
    """FP8 attention (docs/fp8.md) has the split-KV kernel's e4m3 instances only:
    every fixed-length call plans it, whatever its rows or a kernel override, the
    many-row calls on the 64-row variant; a call with dropout gets no kernel (the
    op refuses it by name first)."""
    prefill = fwd(1, 8192, 8192, 16, 4, 128, causal=True, fp8=True)
    assert prefill["kernel"] == "splitkv" and "e4m3 keys and values" in prefill["reason"]
    assert prefill["warps_n"] == 1 and prefill["block_m"] == 64
    assert fwd(1, 8192, 8192, 16, 4, 128, causal=True)["kernel"] != "splitkv"
    forced = fwd(1, 8192, 8192, 16, 4, 128, fp8=True, kernel_override="sm80")
    assert forced["kernel"] == "splitkv"
    decode_shaped = fwd(16, 1, 32768, 32, 8, 128, fp8=True)
    assert decode_shaped["kernel"] == "splitkv" and decode_shaped["warps_n"] == 4
    assert fwd(2, 300, 300, 8, 2, 512, fp8=True)["kernel"] == "splitkv"
    assert fwd(1, 64, 64, 4, 4, 128, dropout_p=0.1, fp8=True)["kernel"] == "none"


def test_decode_min_splits():
    """A varlen forward on the split-KV kernel alone (FP8 attention, head dims
    above 256) takes two splits even where every key fits one key block:
    plan_fwd_split sets DecodeShape::min_splits, and the second split is empty
    (the CUDA cases: test_cuda_fp8_attention.py, test_cuda_fwd_d512.py)."""
    assert decode(3, 64, 40, 4, 2, 128, fp8_cache=True)["splits"] == 1
    raised = decode(3, 64, 40, 4, 2, 128, fp8_cache=True, min_splits=2)
    assert raised["splits"] == 2 and "min_splits" in raised["reason"]
    assert raised["items"] == 2 * decode(3, 64, 40, 4, 2, 128, fp8_cache=True)["items"]
    # A count the plan chose above the floor stays.
    chosen = decode(1, 1, 32768, 32, 8, 128)["splits"]
    assert chosen > 2 and decode(1, 1, 32768, 32, 8, 128, min_splits=2)["splits"] == chosen
    with pytest.raises(RuntimeError, match="min_splits must be >= 1, got 0"):
        decode(1, 1, 64, 4, 4, 128, min_splits=0)


def test_fp8_cache_splits_keep_four_key_tiles():
    """Batch 1 over an e4m3 cache: the three slots an SM would cut 4k-8k keys
    into 48 splits of two or three 64-key tiles; no split gets fewer than
    four tiles (choose_kv_splits), while long caches keep filling the waves.
    An explicit num_splits is honoured, and a 16-bit cache is unchanged."""
    assert decode(1, 1, 4096, 32, 8, 128, fp8_cache=True)["splits"] == 16
    assert 24 <= decode(1, 1, 8192, 32, 8, 128, fp8_cache=True)["splits"] <= 32
    assert decode(1, 1, 8192, 32, 8, 128, paged=True, fp8_cache=True)["splits"] <= 32
    assert decode(1, 1, 32768, 32, 8, 128, fp8_cache=True)["splits"] > 32
    assert decode(1, 1, 8192, 32, 8, 128, fp8_cache=True, num_splits=48)["splits"] == 48
    assert decode(1, 1, 1024, 32, 8, 128, fp8_cache=True)["splits"] == 4
    assert decode(1, 1, 4096, 32, 8, 128)["splits"] == 16


def test_fp8_cache_runs_three_blocks_an_sm():
    """A contiguous 16-bit cache with long runs of keys streams one block an
    SM (the launch asks for more than two blocks an SM leave each); an e4m3 cache
    launches with its stages' 53,248 B, and its decode variant's plain kernels,
    held to 168 registers, run three blocks an SM (splitkv_max_blocks_per_sm):
    batch 16 x 8 kv heads (128 items) splits in three to fill the 3 x 132
    slots. With score extras (softcap) the kernel keeps up to 255 registers,
    two blocks an SM, two splits."""
    bf16 = decode(16, 1, 32768, 32, 8, 128)
    fp8 = decode(16, 1, 32768, 32, 8, 128, fp8_cache=True)
    reserved = H100["reserved_smem_per_block"]
    assert 2 * (bf16["smem"] + reserved) > H100["smem_per_sm"] and bf16["splits"] == 1
    assert fp8["smem"] == 53248 and 3 * (fp8["smem"] + reserved) <= H100["smem_per_sm"]
    assert fp8["splits"] == 3 and fp8["grid"] == 384
    capped = decode(16, 1, 32768, 32, 8, 128, fp8_cache=True, softcap=30.0)
    assert capped["splits"] == 2 and capped["grid"] == 256
    # The 64-row variant and head dims without fragments from the stage keep two.
    assert decode(16, 1, 32768, 32, 8, 256, fp8_cache=True)["splits"] == 2


@pytest.mark.parametrize("head_dim", [264, 384, 512])
def test_backward_d512_runs_the_sm80_kernel_in_slabs(head_dim):
    """Head dims 257-512 run the SM80 kernel's d512 row (no Hopper tile) in
    passes over head-dim slabs of 256 columns: where the device's blocks hold
    200.25 KiB (sm90) its large-shared-memory tile, 32 x 64 with 8 warps, for
    every variant; on an sm80 the table's 32 x 32 with 4 warps (132.25 KiB);
    an sm86 / sm89 block holds neither, and the plan says so (the op raises
    it with both sizes)."""
    row = BWD_TABLE[512]
    assert row["kBlockMSm90"] == 0
    long = (2, 4096, 4096, 8, 2, head_dim)
    plan = bwd(*long, causal=True)
    assert plan["kernel"] == "sm80_large_smem" and plan["hdim"] == 512
    assert (plan["block_m"], plan["block_n"]) == (32, 64)
    assert plan["grid"] == f"{4096 // 64}x8x2"
    assert plan["sm80_smem"] == 205056 and plan["smem_fits"] == 1
    assert "no Hopper tile" in plan["reason"]
    a100 = bwd(*long, causal=True, device=A100)
    assert a100["kernel"] == "sm80" and a100["hdim"] == 512
    assert (a100["block_m"], a100["block_n"]) == (row["kBlockM"], row["kBlockN"]) == (32, 32)
    assert a100["grid"] == f"{4096 // 32}x8x2"
    assert a100["sm80_smem"] == 135424 and a100["smem_fits"] == 1
    for device, kernel in ((H100, "sm80_large_smem"), (A100, "sm80")):
        extras = bwd(*long, softcap=20.0, alibi=True, dropout_p=0.1, device=device)
        assert extras["kernel"] == kernel and extras["variant"] == "score_extras"
        det = bwd(*long, deterministic=True, device=device)
        assert det["kernel"] == kernel and det["splits"] > 1
    small = bwd(*long, device=L40)
    assert small["sm80_smem"] == 135424 and small["smem_fits"] == 0
    # d256 keeps its large tile for the plain variant only, on the table's grid.
    d256 = bwd(*long[:5], 256, kernel_override="sm80")
    assert d256["kernel"] == "sm80_large_smem" and d256["block_n"] == BWD_TABLE[256]["kBlockN"]
    assert bwd(*long[:5], 256, kernel_override="sm80", softcap=5.0)["kernel"] == "sm80"
    # Every row of the table fits an sm80 block.
    for d in sorted(BWD_TABLE):
        assert bwd(2, 512, 512, 4, 4, d, device=A100, kernel_override="sm80")["smem_fits"] == 1
