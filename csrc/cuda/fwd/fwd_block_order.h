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
// still busy. So the query blocks of all heads of a batch entry are handed
// out together, the longest first. One batch entry and not more: every head
// of every entry at once was slower at head dim 64 (each head's K/V leaves L2
// before its next block reads it), and so were sections of (head, batch)
// pairs straddling entries (PERF_LOG 2026-11-24 7d8fe0d).
#pragma once

#include <cstdint>

#include "cuda/core/grid_heads_batch.h"
#include "cuda/core/int_divisor.h"
#include "cuda/fwd/fwd_tile_schedule.h"

namespace flash {

struct FwdBlockCoord {
  int m_block;
  int head;
  int batch;
  int head_kv;
};

// The 64-bit division the block walk falls back on where a dividend may pass
// 2^31 (IntDivisor is exact below it), with IntDivisor's divmod.
struct Int64Divisor {
  int64_t divisor;
  __device__ __forceinline__ void divmod(int64_t n, int64_t& quot, int64_t& rem) const {
    quot = n / divisor;
    rem = n - quot * divisor;
  }
};

// Block (m, head, batch) of a (num_m_blocks, nheads, batch) grid, in the
// order above; heads divides by nheads (IntDivisor or Int64Divisor, as Index).
template <typename Index, typename HeadsDivisor>
__device__ __forceinline__ FwdBlockCoord fwd_block_in_order(bool causal, int m, int head, int batch,
                                                            int num_m_blocks,
                                                            const HeadsDivisor& heads) {
  if (!causal) return {m, head, batch, 0};
  const Index in_batch = m + Index(num_m_blocks) * head;
  Index step, head_of_step;  // step 0 = handed out first in the batch entry
  heads.divmod(in_batch, step, head_of_step);
  return {int(num_m_blocks - 1 - step), int(head_of_step), batch, 0};
}

// Block (blockIdx.x, head, batch) of the SM80 kernel's grid
// (num_m_blocks, pairs of grid_heads_batch.h), with the pair already found.
__device__ __forceinline__ FwdBlockCoord fwd_block_coord(bool causal, HeadBatch pair, int nheads,
                                                         int heads_per_kv_head) {
  // 64-bit: num_m_blocks * nheads may pass 2^31 in a varlen batch of many
  // sequences and one long one (blocks past a short sequence's end exit).
  FwdBlockCoord coord = fwd_block_in_order<int64_t>(causal, int(blockIdx.x), pair.head, pair.batch,
                                                    int(gridDim.x), Int64Divisor{nheads});
  coord.head_kv = coord.head / heads_per_kv_head;
  return coord;
}

// A persistent grid walks the same blocks by a linear index: tile t is block
// (t mod num_m_blocks, (t / num_m_blocks) mod nheads, t / (num_m_blocks * nheads))
// of that grid, found with the launcher's divisors (fwd_tile_schedule.h).
__device__ __forceinline__ FwdBlockCoord fwd_tile_coord(bool causal, int64_t tile,
                                                        const FwdTileDivisors& divisors) {
  FwdBlockCoord coord;
  const int num_m_blocks = divisors.m_blocks.divisor;
  // Every dividend below is at most the tile's index; past 2^31 (varlen
  // batches of very many sequences), 64-bit division.
  if (tile < 2147483647) {
    int rest, m, batch, head;
    divisors.m_blocks.divmod(int(tile), rest, m);
    divisors.heads.divmod(rest, batch, head);
    coord = fwd_block_in_order<int>(causal, m, head, batch, num_m_blocks, divisors.heads);
  } else {
    const Int64Divisor heads{divisors.heads.divisor};
    int64_t rest, m, batch, head;
    Int64Divisor{num_m_blocks}.divmod(tile, rest, m);
    heads.divmod(rest, batch, head);
    coord = fwd_block_in_order<int64_t>(causal, int(m), int(head), int(batch), num_m_blocks, heads);
  }
  coord.head_kv = divisors.heads_per_kv_head.quotient(coord.head);
  return coord;
}

}  // namespace flash
