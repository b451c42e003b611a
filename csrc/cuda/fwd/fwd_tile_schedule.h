// How the Hopper forward's grid walks its tiles, as the host sees it: shared
// by the launcher, which sizes the grid (fwd_launch.h), and the op,
// which provides a tile counter only for calls whose grid may take tiles from
// one (the launcher zeroes it if its grid does).
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

// Whether a call the Hopper kernel can take runs it rather than the SM80
// kernel: from the tile table's key count on (kMinSeqlenKSm90), and below it
// when there are many query blocks to spread, at least the table's
// kMinBlocksPerSmSm90 of 128 rows per SM (the reasons beside the table).
// Short calls of many query blocks ran faster on the Hopper kernel, short
// calls of few slower (PERF_LOG 2026-11-25 76288cf).
inline bool fwd_sm90_by_shape(const FwdParams& params, int min_seqlen_k, int min_blocks_per_sm) {
  return params.seqlen_k >= min_seqlen_k ||
         (params.num_sms > 0 &&
          fwd_sm90_num_tiles(params) >= int64_t(min_blocks_per_sm) * params.num_sms);
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

// Whether the tiles do different work (a causal or local bound, or the
// sequences of a varlen batch, whose lengths differ and whose longest sets
// the grid), so that a persistent grid hands them out from a counter instead
// of in fixed shares. On varlen batches fixed shares were slower than the
// counter (up to 2048 keys) or one block per query block (PERF_LOG
// 2026-11-24 9f57c38).
inline bool fwd_tiles_differ_in_work(const FwdParams& params) {
  return params.window_left >= 0 || params.window_right >= 0 || params.cu_seqlens_q != nullptr;
}

// The most keys one query block sees: with both window sides bounded, the
// window plus the block's own rows; else up to every key.
inline int64_t fwd_sm90_most_keys_per_tile(const FwdParams& params) {
  if (params.window_left >= 0 && params.window_right >= 0) {
    const int64_t window = int64_t(params.window_left) + params.window_right + kFwdSm90BlockM;
    return window < params.seqlen_k ? window : params.seqlen_k;
  }
  return params.seqlen_k;
}

// Whether a forward that the Hopper kernel may run takes its tiles past the
// first wave from params.tile_counter (fwd_kernel_sm90.h): more tiles
// than SMs, of different work, each short enough that a tile's prologue and
// epilogue are a large share of it, on the plain score rule (softcap and
// ALiBi run the Hopper kernel's other grids, dropout the SM80 kernel; one
// kernel instantiation fewer per head dim). Against one block per tile the
// counter wins at short key counts and fades by 4096 keys, hence the cap of
// 2048 keys per tile (PERF_LOG 2026-11-24 30a90ef); past it, on varlen
// batches too, one block per query block is faster (PERF_LOG 2026-11-24
// 9f57c38).
constexpr int64_t kFwdSm90MostKeysPerTileFromCounter = 2048;
inline bool fwd_sm90_takes_tiles_from_counter(const FwdParams& params) {
  const bool plain_rule =
      params.softcap <= 0.f && params.alibi_slopes == nullptr && params.dropout_p <= 0.f;
  return params.fwd_kernel != KernelChoice::kSm80 && plain_rule &&
         fwd_tiles_differ_in_work(params) && params.num_sms > 0 &&
         fwd_sm90_num_tiles(params) > params.num_sms &&
         fwd_sm90_most_keys_per_tile(params) <= kFwdSm90MostKeysPerTileFromCounter;
}

}  // namespace flash
