// Tile shape of the split-KV (decode) kernel per compiled head dim. Decode has
// few query rows (seqlen_q x the GQA group), so the query tile is 64 rows;
// host code reads the key tile to choose the number of splits.
#pragma once

namespace flash {

constexpr int kSplitKvBlockM = 64;
constexpr int kSplitKvWarps = 4;
constexpr int kMaxKvSplits = 128;

constexpr int splitkv_block_n(int compiled_head_dim) {
  return compiled_head_dim <= 64 ? 128 : 64;
}

}  // namespace flash
