// The tile scheduler of the Hopper forward (fwd_kernel_sm90.h): which
// (query block, head, batch) tiles a block runs, in which order.
#pragma once

#include <cstdint>

#include "cuda/core/block_info.h"
#include "cuda/core/params.h"
#include "cuda/core/tile_ops_sm90.h"
#include "cuda/fwd/fwd_block_order.h"
#include "cuda/fwd/sm90/fwd_pipeline_sm90.h"

namespace flash {

// The query block of a tile, its visible key blocks (none: the tile only
// writes empty rows) and whether it has rows at all (varlen).
struct FwdSm90Tile {
  BlockInfo binfo;
  FwdBlock block;
  int n_key_blocks;
};

// One block per SM or one per query block (the launcher's choice,
// launch_flash_fwd_sm90). A block's first tile of the (query block, head,
// batch) grid, in the order of fwd_block_order.h, is blockIdx.x. Its next
// ones are blockIdx.x + gridDim.x, ... when every tile does the same work;
// with a causal or local bound, or in a varlen batch, the tiles' work
// differs, and fixed shares leave some SMs with the long tiles at the end,
// so a block takes its next tile from a counter in global memory as it
// frees up (kTilesFromCounter; longest first, as the hardware hands out an
// ordinary grid). A persistent block's producer runs ahead into the next tile
// (its K / V stages as they come free, its Q once the MMA warpgroups have
// handed Q back), so a tile's prologue overlaps the last one's tail.
//
// Without a tile for O a block runs exactly one tile (the launcher's grid),
// in straight-line code: the loop around it cost the d256 kernel 150 B of
// spills.
//
// Tiles from the counter: the first wave is blockIdx.x, which needs none.
// One MMA thread takes the block's next tile while the first S of the
// current one is on the tensor cores (the atomic's latency hides behind it)
// and publishes it in a slot of shared memory (take_tile, publish_tile); the
// copy-issuing threads read it once they have issued the current tile's loads,
// and runs ahead into that tile; the MMA warpgroups read it under their last
// P V (up to d128, below) or once done with the current tile. So a block
// holds at most one tile it has not started. An index past the grid tells
// everyone to stop. (Not a thread of the producer warpgroup: any mbarrier
// work of a second producer thread made ptxas spill the copy-issuing
// thread's loop at its 24 registers.) A kernel of its own: the code for it
// slowed the fixed-share and one-block-per-tile grids (PERF_LOG 2026-11-24
// 30a90ef).
template <typename Traits, bool kTilesFromCounter>
struct FwdSm90TileScheduler {
  static_assert(Traits::kPersistent || !kTilesFromCounter, "only a persistent grid takes tiles");
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr bool kTakesTilesFromCounter = kTilesFromCounter;
  using Storage = FwdSm90SharedStorage<Traits>;

  // for_each_tile(body) calls body(tile, look_ahead), and body calls
  // look_ahead() once. On the counter's grid up to d128 it takes the next
  // tile and works out its block, a chain of dependent integer work and
  // parameter loads (varlen: of cu_seqlens), and the MMA warpgroups call it
  // under their last P V: the counter's query blocks are short, and the
  // chain had every MMA warp waiting on it between two of them; there it won
  // at short causal calls, while on the fixed-share grid and at d224 (more
  // spills) it lost (PERF_LOG 2026-11-24 fff1485). Its results are pinned by
  // an empty asm, without which ptxas sinks the chain below the wait for
  // that P V.
  static constexpr bool kLookAhead = kTilesFromCounter && Traits::kHeadDim <= 128;

  const FwdParams& params;
  const FwdTileDivisors& tile_divisors;
  const bool causal;
  const int64_t num_tiles;
  // The MMA thread that takes the tiles, and how many it has published.
  int tiles_published = 0;

  __forceinline__ __device__ FwdSm90TileScheduler(const FwdParams& params_,
                                                  const FwdTileDivisors& tile_divisors_)
      : params(params_),
        tile_divisors(tile_divisors_),
        causal(params_.window_right >= 0),
        num_tiles(int64_t((params_.seqlen_q + kBlockM - 1) / kBlockM) * params_.nheads *
                  params_.batch) {}

  __forceinline__ __device__ FwdSm90Tile tile_at(int64_t tile) const {
    const FwdBlockCoord coord = fwd_tile_coord(causal, tile, tile_divisors);
    const BlockInfo binfo(params, coord.batch);
    const FwdBlock block = fwd_block<kBlockM, kBlockN>(params, coord, binfo);
    return FwdSm90Tile{binfo, block, block.n_block_max - block.n_block_min};
  }

  // Every thread but the taker: the tile the taker published in its round.
  __forceinline__ __device__ int64_t next_tile(int round) const {
    auto& barriers = Storage::barriers();
    empty_barrier(barriers.tile_full).wait(round & 1);
    const int64_t next = barriers.scheduled_tile;
    empty_barrier(barriers.tile_empty).arrive();
    return next;
  }

  // The taker: the counter's next tile, and its publication once every
  // reader is done with the last one.
  __forceinline__ __device__ int64_t take_tile() const {
    return int64_t(gridDim.x) + int64_t(atomicAdd(params.tile_counter, 1ull));
  }
  __forceinline__ __device__ void publish_tile(int64_t next) {
    auto& barriers = Storage::barriers();
    empty_barrier(barriers.tile_empty).wait((tiles_published & 1) ^ 1);
    barriers.scheduled_tile = next;
    empty_barrier(barriers.tile_full).arrive();  // release: the slot is visible
    ++tiles_published;
  }

  template <typename Body>
  __forceinline__ __device__ void for_each_tile(Body&& body) const {
    if constexpr (kLookAhead) {
      int64_t tile_index = blockIdx.x;
      if (tile_index >= num_tiles) return;
      FwdSm90Tile tile = tile_at(tile_index);
      for (int round = 0;; ++round) {
        int64_t next_index = num_tiles;
        FwdSm90Tile next = tile;
        body(tile, [&] {
          next_index = next_tile(round);
          if (next_index < num_tiles) next = tile_at(next_index);
          const FwdBlock& b = next.block;
          asm volatile("" ::"r"(b.m_block), "r"(b.head), "r"(b.batch), "r"(b.head_kv),
                       "r"(b.row_begin), "r"(b.rows_left), "r"(b.n_block_min), "r"(b.n_block_max),
                       "r"(next.n_key_blocks), "r"(next.binfo.seqlen_q), "r"(next.binfo.seqlen_k),
                       "l"(next.binfo.q_row_begin), "l"(next.binfo.k_row_begin), "l"(next_index));
        });
        if (next_index >= num_tiles) break;
        tile_index = next_index;
        tile = next;
      }
    } else if constexpr (kTilesFromCounter) {
      int64_t tile_index = blockIdx.x;
      for (int round = 0; tile_index < num_tiles; ++round) {
        body(tile_at(tile_index), [] {});
        tile_index = next_tile(round);
      }
    } else if constexpr (Traits::kPersistent) {
      for (int64_t tile_index = blockIdx.x; tile_index < num_tiles; tile_index += gridDim.x) {
        body(tile_at(tile_index), [] {});
      }
    } else {
      body(tile_at(blockIdx.x), [] {});
    }
  }
};

}  // namespace flash
