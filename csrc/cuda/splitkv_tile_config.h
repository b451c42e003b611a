// Tile shape of the split-KV (decode) kernel per compiled head dim. Decode has
// few query rows (seqlen_q x the GQA group), so the query tile is 64 rows;
// host code reads the key tile and the shared-memory footprint to choose the
// number of splits.
#pragma once

namespace flash {

constexpr int kSplitKvBlockM = 64;
constexpr int kSplitKvWarps = 4;
constexpr int kMaxKvSplits = 128;
// (K tile, V tile) buffers: the next tile's copies overlap this tile's math.
constexpr int kSplitKvStages = 2;

// Key tile: 16-32 KB of K+V per stage. Above d128 the tile narrows to 32 keys
// so that two stages (and two blocks per SM on sm90) still fit, and the block
// stays under the 99 KB per block of sm86/sm89.
constexpr int splitkv_block_n(int compiled_head_dim) {
  return compiled_head_dim <= 64 ? 128 : (compiled_head_dim <= 128 ? 64 : 32);
}

// Dynamic shared memory of one thread block (16-bit elements): the Q tile and
// kSplitKvStages K and V tiles.
constexpr int splitkv_smem_bytes(int compiled_head_dim) {
  return 2 * compiled_head_dim *
         (kSplitKvBlockM + 2 * kSplitKvStages * splitkv_block_n(compiled_head_dim));
}
static_assert(splitkv_smem_bytes(256) <= 99 * 1024, "fits sm86/sm89 (99 KB per block)");

}  // namespace flash
