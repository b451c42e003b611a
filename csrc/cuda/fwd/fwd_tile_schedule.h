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
// kMinBlocksPerSmSm90 of 128 rows per SM (the measurements beside the
// table). H100, bf16, 17-512 query rows and 128-512 keys, SM80 time /
// Hopper time (PERF_LOG): with 16k tokens (5-31 query blocks per SM)
// 1.02-1.69x at d64 / d96 / d128 (level to 0.96x at d64 with 17 rows and
// 128 keys); with 2 sequences (0.5-2 blocks per SM, calls of ~30 us)
// 0.81-0.98x.
inline bool fwd_sm90_by_shape(const FwdParams& params, int min_seqlen_k, int min_blocks_per_sm) {
  return params.seqlen_k >= min_seqlen_k ||
         (params.num_sms > 0 &&
          fwd_sm90_num_tiles(params) >= int64_t(min_blocks_per_sm) * params.num_sms);
}

// What the Hopper kernel divides a tile's index by to find its block
// (fwd_tile_coord in fwd_block_order.h), as multiply-highs: a persistent
// block finds its next tile between two query blocks, with every MMA warp
// waiting, and as 64-bit divisions that step took 250-360 cycles longer
// (H100 trace, PERF_LOG), 2-4% of a forward at 512 keys.
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
// of in fixed shares. H100, varlen bf16 forward of 7-121 random-length
// sequences (32k tokens), non-causal: fixed shares were 5-31% slower at d128
// than the counter (up to 2048 keys) or one block per query block (PERF_LOG).
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
// kernel instantiation fewer per head dim). H100 microbench, causal,
// against one block per tile (PERF_LOG): d64 +22% at 512 keys, +5% at 2048,
// level at 4096, -1% to -5% at 8192; d128 +11% / +2-3% / -1% / -2%; a
// 512-key window at 4096 keys +10% / +5-7%. Varlen, non-causal, past 2048
// keys: one block per query block 2-5% faster than the counter.
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
