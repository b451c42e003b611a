// The Hopper forward's tiles, counted alike by the plan, the launcher and the
// kernel: the (query block, head, batch) tiles of a call, by which plan_fwd
// (launch/plan.cpp) sizes the grid and picks its kind, and the divisors that
// the launcher (fwd_launch.h) hands the kernel to find a tile's block
// (fwd_block_order.h). Which grid runs a call is decided in plan_fwd alone.
#pragma once

#include <cstdint>

#include "cuda/core/int_divisor.h"
#include "cuda/core/params.h"

namespace flash {

// The Hopper kernel's query block on the grid that takes its tiles from a
// counter: two MMA warpgroups of 64 rows each. (Other grids run the tile
// table's kBlockMSm90.)
constexpr int kFwdSm90BlockM = 128;

// The most blocks a one-dimensional grid can have (grid x).
constexpr int64_t kFwdSm90MaxGridTiles = 2147483647;

// Tiles of the (query block, head, batch) grid; varlen: of the longest
// sequence's query blocks, in every batch entry.
inline int64_t fwd_sm90_num_tiles(const FwdParams& params, int block_m = kFwdSm90BlockM) {
  const int num_m_blocks = (params.seqlen_q + block_m - 1) / block_m;
  return int64_t(num_m_blocks) * params.nheads * params.batch;
}

// What the Hopper kernel divides a tile's index by to find its block
// (fwd_tile_coord in fwd_block_order.h), as multiply-highs: a persistent
// block finds its next tile between two query blocks, with every MMA warp
// waiting, and as 64-bit divisions that step took long enough to slow down
// forwards of short key counts (PERF_LOG 2026-11-24 e4d08b2).
struct FwdTileDivisors {
  IntDivisor m_blocks;  // query blocks per (head, batch)
  IntDivisor heads;
  IntDivisor heads_per_kv_head;

  FwdTileDivisors() = default;
  FwdTileDivisors(int num_m_blocks, int nheads, int nheads_k)
      : m_blocks(num_m_blocks), heads(nheads), heads_per_kv_head(nheads / nheads_k) {}
};

inline FwdTileDivisors fwd_sm90_tile_divisors(const FwdParams& params, int block_m) {
  return FwdTileDivisors((params.seqlen_q + block_m - 1) / block_m, params.nheads, params.nheads_k);
}

}  // namespace flash
