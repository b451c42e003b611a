// Which query blocks a block of the Hopper forward (fwd_kernel_sm90.h)
// computes, and in what order: its tile schedulers. Every scheduler has the
// one interface the kernel's roles call,
//
//   scheduler.for_each_tile(body);  // body(const FwdSm90Tile&, look_ahead)
//
// where body calls look_ahead() exactly once per tile (where it does so is
// the role's choice: the producer after issuing a tile's loads, the MMA
// warpgroups under their last P V). The policy (order of the tiles, the
// divisors that find a tile's block) is fwd_block_order.h's and
// fwd_tile_schedule.h's; these types only walk it.
//
// One block per SM or one per query block (the launcher's choice,
// launch_flash_fwd_sm90). A block's first tile of the (query block, head,
// batch) grid, in the order of fwd_block_order.h, is blockIdx.x. Its next
// ones are blockIdx.x + gridDim.x, ... when every tile does the same work
// (FwdSm90StridedTileScheduler); with a causal or local bound, or in a varlen
// batch, the tiles' work differs, and fixed shares leave some SMs with the
// long tiles at the end, so a block takes its next tile from a counter in
// global memory as it frees up (FwdSm90CounterTileScheduler; longest first,
// as the hardware hands out an ordinary grid).
#pragma once

#include <cstdint>
#include <type_traits>

#include "cuda/core/block_info.h"
#include "cuda/core/params.h"
#include "cuda/core/tile_ops_sm90.h"
#include "cuda/fwd/fwd_block_io.h"
#include "cuda/fwd/fwd_block_order.h"
#include "cuda/fwd/fwd_tile_schedule.h"

namespace flash {

// The query block of a tile, its visible key blocks (none: the tile only
// writes empty rows) and whether it has rows at all (varlen).
struct FwdSm90Tile {
  BlockInfo binfo;
  FwdBlock block;
  int n_key_blocks;
};

// The grid's tiles and how to find a tile's block from its index: what every
// scheduler shares.
template <typename Traits>
struct FwdSm90TileGrid {
  const FwdParams& params;
  const FwdTileDivisors& tile_divisors;
  const bool causal;
  const int64_t num_tiles;

  __forceinline__ __device__ FwdSm90TileGrid(const FwdParams& params_,
                                             const FwdTileDivisors& tile_divisors_)
      : params(params_),
        tile_divisors(tile_divisors_),
        causal(params_.window_right >= 0),
        num_tiles(int64_t((params_.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM) *
                  params_.nheads * params_.batch) {}

  __forceinline__ __device__ FwdSm90Tile tile_at(int64_t tile) const {
    const FwdBlockCoord coord = fwd_tile_coord(causal, tile, tile_divisors);
    const BlockInfo binfo(params, coord.batch);
    const FwdBlock block = fwd_block<Traits::kBlockM, Traits::kBlockN>(params, coord, binfo);
    return FwdSm90Tile{binfo, block, block.n_block_max - block.n_block_min};
  }
};

// One tile per block, blockIdx.x (the launcher's grid), in straight-line
// code: a loop around it gave the d256 kernel spills (PERF_LOG 2026-11-24
// 688b18f).
template <typename Traits>
struct FwdSm90SingleTileScheduler {
  const FwdSm90TileGrid<Traits>& grid;

  template <typename Body>
  __forceinline__ __device__ void for_each_tile(Body&& body) const {
    body(grid.tile_at(blockIdx.x), [] {});
  }
};

// Fixed shares: tiles blockIdx.x, blockIdx.x + gridDim.x, ...
template <typename Traits>
struct FwdSm90StridedTileScheduler {
  const FwdSm90TileGrid<Traits>& grid;

  template <typename Body>
  __forceinline__ __device__ void for_each_tile(Body&& body) const {
    for (int64_t tile_index = blockIdx.x; tile_index < grid.num_tiles; tile_index += gridDim.x) {
      body(grid.tile_at(tile_index), [] {});
    }
  }
};

// Tiles from the counter: the first wave is blockIdx.x, which needs none.
// One MMA thread takes the block's next tile while the first S of the
// current one is on the tensor cores (the atomic's latency hides behind it)
// and publishes it in a slot of shared memory (FwdSm90TileTaker); the
// copy-issuing thread reads it once it has issued the current tile's loads,
// and runs ahead into that tile; the MMA warpgroups read it under their last
// P V (kLookAhead, below) or once done with the current tile. So a block
// holds at most one tile it has not started. An index past the grid tells
// everyone to stop. (Not a thread of the producer warpgroup: any mbarrier
// work of a second producer thread made ptxas spill the copy-issuing
// thread's loop at its 24 registers.) A kernel of its own: the code for it
// slowed the fixed-share and one-block-per-tile grids (PERF_LOG 2026-11-24
// 30a90ef).
//
// kLookAhead (up to d128): look_ahead() takes the next tile and works out its
// block, a chain of dependent integer work and parameter loads (varlen: of
// cu_seqlens), and the MMA warpgroups call it under their last P V: the
// counter's query blocks are short, and the chain had every MMA warp waiting
// on it between two of them. On the fixed-share grid it cost time, and at
// d224 the registers it holds cost spills (PERF_LOG 2026-11-24 fff1485). Its
// results are pinned by an empty asm, without which ptxas sinks the chain
// below the wait for that P V.
template <typename Traits, bool kLookAhead>
struct FwdSm90CounterTileScheduler {
  const FwdSm90TileGrid<Traits>& grid;
  typename Traits::Barriers& barriers;

  // The tile published for round `round`, handed back once read.
  __forceinline__ __device__ int64_t next_tile(int round) const {
    empty_barrier(barriers.tile_full).wait(round & 1);
    const int64_t next = barriers.scheduled_tile;
    empty_barrier(barriers.tile_empty).arrive();
    return next;
  }

  template <typename Body>
  __forceinline__ __device__ void for_each_tile(Body&& body) const {
    const int64_t num_tiles = grid.num_tiles;
    if constexpr (kLookAhead) {
      int64_t tile_index = blockIdx.x;
      if (tile_index >= num_tiles) return;
      FwdSm90Tile tile = grid.tile_at(tile_index);
      for (int round = 0;; ++round) {
        int64_t next_index = num_tiles;
        FwdSm90Tile next = tile;
        body(tile, [&] {
          next_index = next_tile(round);
          if (next_index < num_tiles) next = grid.tile_at(next_index);
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
    } else {
      int64_t tile_index = blockIdx.x;
      for (int round = 0; tile_index < num_tiles; ++round) {
        body(grid.tile_at(tile_index), [] {});
        tile_index = next_tile(round);
      }
    }
  }
};

// The kernel's scheduler: the counter's (look-ahead up to d128), the fixed
// shares of a persistent grid, or one tile per block.
template <typename Traits, bool kTilesFromCounter>
using FwdSm90TileScheduler =
    std::conditional_t<kTilesFromCounter,
                       FwdSm90CounterTileScheduler<Traits, (Traits::kHeadDim <= 128)>,
                       std::conditional_t<Traits::kPersistent, FwdSm90StridedTileScheduler<Traits>,
                                          FwdSm90SingleTileScheduler<Traits>>>;

template <typename Traits, bool kTilesFromCounter>
__forceinline__ __device__ FwdSm90TileScheduler<Traits, kTilesFromCounter> make_fwd_sm90_scheduler(
    const FwdSm90TileGrid<Traits>& grid, typename Traits::Barriers& barriers) {
  if constexpr (kTilesFromCounter) {
    return {grid, barriers};
  } else {
    return {grid};
  }
}

// The counter's other end, in the MMA thread that takes the tiles: the next
// tile from the counter (past the first wave), and its publication in the
// slot the scheduler's next_tile() reads. A no-op on the other grids.
template <typename Traits, bool kTilesFromCounter>
struct FwdSm90TileTaker {
  const FwdParams& params;
  typename Traits::Barriers& barriers;
  const bool takes_tiles;
  int tiles_published = 0;

  __forceinline__ __device__ FwdSm90TileTaker(const FwdParams& params_,
                                              typename Traits::Barriers& barriers_, int mma_tidx)
      : params(params_), barriers(barriers_), takes_tiles(kTilesFromCounter && mma_tidx == 0) {}

  __forceinline__ __device__ int64_t take() const {
    return int64_t(gridDim.x) + int64_t(atomicAdd(params.tile_counter, 1ull));
  }
  __forceinline__ __device__ void publish(int64_t next) {
    empty_barrier(barriers.tile_empty).wait((tiles_published & 1) ^ 1);
    barriers.scheduled_tile = next;
    empty_barrier(barriers.tile_full).arrive();  // release: the slot is visible
    ++tiles_published;
  }
};

}  // namespace flash
