// Which (query block, head, batch) each thread block of the forward grid
// computes, in the order the hardware hands blocks out (x fastest, then y,
// then z).
//
// Without a causal (right) bound every query block of a head does the same
// work, and the blocks of one head are handed out one after the other: they
// run side by side and read that head's K/V from DRAM once, then from L2.
//
// With a causal bound the work grows along the sequence: query block m sees
// about m + 1 key blocks. Handed out head by head, the last head's longest
// blocks start when little else is left, and the grid ends with a few SMs
// still busy (on an H100 this order made a causal forward with 16 heads 4-16%
// faster). So the query blocks of all heads of a batch entry are handed out
// together, the longest first. One batch entry and not more: in the sweep
// recorded in benchmarks/PERF_LOG.md, every head of every entry at once was
// 10% slower at head dim 64 (each head's K/V leaves L2 before its next block
// reads it), and sections of 25 (head, batch) pairs, straddling entries, 7%.
#pragma once

#include <cstdint>

namespace flash {

struct FwdBlockCoord {
  int m_block;
  int head;
  int batch;
};

// Block (m, head, batch) of a (num_m_blocks, nheads, batch) grid, in the
// order above.
__device__ __forceinline__ FwdBlockCoord fwd_block_coord(bool causal, int m, int head, int batch,
                                                         int num_m_blocks, int nheads) {
  if (!causal) return {m, head, batch};
  // 64-bit: num_m_blocks * nheads may pass 2^32 in a varlen batch of many
  // sequences and one long one (blocks past a short sequence's end exit).
  const int64_t in_batch = m + int64_t(num_m_blocks) * head;
  const int64_t step = in_batch / nheads;  // 0 = handed out first in the batch entry
  return {int(num_m_blocks - 1 - step), int(in_batch - step * nheads), batch};
}

// The grid is (num_m_blocks, nheads, batch), within CUDA's per-dimension
// limits for any shape.
__device__ __forceinline__ FwdBlockCoord fwd_block_coord(bool causal) {
  return fwd_block_coord(causal, int(blockIdx.x), int(blockIdx.y), int(blockIdx.z),
                         int(gridDim.x), int(gridDim.y));
}

// A persistent grid walks the same blocks by a linear index: tile t is block
// (t mod num_m_blocks, (t / num_m_blocks) mod nheads, t / (num_m_blocks * nheads))
// of that grid.
__device__ __forceinline__ FwdBlockCoord fwd_tile_coord(bool causal, int64_t tile,
                                                        int num_m_blocks, int nheads) {
  const int64_t rest = tile / num_m_blocks;
  return fwd_block_coord(causal, int(tile - rest * num_m_blocks), int(rest % nheads),
                         int(rest / nheads), num_m_blocks, nheads);
}

}  // namespace flash
