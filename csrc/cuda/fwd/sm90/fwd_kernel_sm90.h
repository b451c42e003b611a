// The forward kernel on Hopper's warpgroup MMAs (wgmma, sm90a): the
// FlashAttention-2 walk of fwd_kernel_sm80.h (one thread block per query
// block, K/V tiles from the last visible key block down, online softmax with
// P kept in registers), with Q K^T read from shared memory and P V with P
// from registers at about twice the tensor-core rate of the SM80 mma.sync
// path. Within a warpgroup, S(i) = Q K(i)^T is issued together with P V of
// the tile before, and the softmax of S(i) runs while that product is on the
// tensor cores. The copies and the block-wide barriers stay out of the MMA
// warpgroups' loop:
//   - a producer warpgroup, one thread of it, loads Q, K and V by TMA into
//     two stages per tensor; each landed stage is announced on an mbarrier
//     ("full"), and each stage comes back once every MMA warpgroup's wgmmas
//     have read it ("empty");
//   - the two or three MMA warpgroups (64 query rows each; the tile table
//     says how many) take turns issuing their products (a named barrier per
//     turn), so one warpgroup's softmax runs while another's products occupy
//     the tensor cores, instead of all meeting at a block barrier every tile
//     with the tensor cores idle in between.
// It runs the causal / local / bounds mask and, in its kWithScoreMods
// variant, softcap and ALiBi before it (score_mods.h, in the contract's
// order), on TMA-describable inputs (16-byte aligned pointers, strides that
// are positive multiples of 16 bytes); the launcher sends dropout and
// anything else to fwd_kernel_sm80.h.
//
// The roles, each a type of its own: the tile schedulers
// (fwd_tile_scheduler_sm90.h), the producer's loads and the MMA warpgroups'
// main loop (fwd_mainloop_sm90.h), their epilogue (fwd_epilogue_sm90.h).
// Their member functions are all force-inlined and their state lives in
// registers of the one kernel.
#pragma once

#include <cmath>
#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_types.h>

#include "common/mask_rule.h"
#include "cuda/core/block_info.h"
#include "cuda/core/params.h"
#include "cuda/core/score_mods.h"
#include "cuda/core/softmax.h"
#include "cuda/core/tile_ops.h"
#include "cuda/core/tile_ops_sm90.h"
#include "cuda/core/tma_loads_sm90.h"
#include "cuda/fwd/fwd_block_io.h"
#include "cuda/fwd/fwd_block_order.h"
#include "cuda/fwd/sm90/fwd_epilogue_sm90.h"
#include "cuda/fwd/sm90/fwd_kernel_traits_sm90.h"
#include "cuda/fwd/sm90/fwd_mainloop_sm90.h"
#include "cuda/fwd/sm90/fwd_tile_scheduler_sm90.h"

namespace flash {

using namespace cute;

// The MMA warpgroups' work on one tile: the main loop over its key blocks
// (FwdSm90MainloopMma), then the epilogue. look_ahead() runs once: under the
// last P V, or right away for a tile with nothing to multiply.
template <typename Traits, bool kWithScoreMods, typename Mainloop, typename LookAhead>
__forceinline__ __device__ void fwd_sm90_mma_tile(const FwdParams& params, Mainloop& mainloop,
                                                  FwdSm90Epilogue<Traits>& epilogue,
                                                  const FwdSm90Tile& tile, LookAhead&& look_ahead) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  const BlockInfo& binfo = tile.binfo;
  const FwdBlock& block = tile.block;
  // varlen: this sequence is shorter than the longest
  if (block.rows_left <= 0) {
    if (mainloop.taker.takes_tiles) mainloop.taker.publish(mainloop.taker.take());
    look_ahead();
    return;
  }
  const int rows_left = block.rows_left;
  const int n_tiles = tile.n_key_blocks;
  float* lse_rows = fwd_lse_rows(params, binfo, block);
  const ScoreModsInUnits score_mods(
      params.softmax_scale, kWithScoreMods ? params.softcap : 0.f, mainloop.has_alibi,
      mainloop.has_alibi ? params.alibi_slopes[block.batch * params.alibi_batch_stride + block.head]
                         : 0.f);
  const float exp_scale_log2 =
      kWithScoreMods ? score_mods.exp_scale_log2() : params.softmax_scale_log2;
  Tensor gO = get<3>(
      fwd_global_tiles<Element, kBlockM, kBlockN, kHeadDim>(params, binfo, block));  // (kBlockM, D)
  if (n_tiles <= 0) {
    if (mainloop.taker.takes_tiles) mainloop.taker.publish(mainloop.taker.take());
    look_ahead();
    epilogue.store_empty_rows(gO, lse_rows, rows_left);
    return;
  }
  mainloop.start_turns();

  typename Mainloop::AccO acc_o =
      partition_fragment_C(mainloop.tiled_mma_o, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  clear(acc_o);  // (MMA, MMA_M, MMA_D)
  typename Mainloop::AccS acc_s = partition_fragment_C(
      mainloop.tiled_mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});  // (MMA, MMA_M, MMA_N)
  // P, S converted in place: the A operand of P V.
  Tensor tOrP = make_tensor<Element>(
      wgmma_acc_layout_as_operand_a(acc_s.layout()));  // (MMA, MMA_M, (MMA_K, MMA_N))
  typename Mainloop::Softmax softmax;
  mainloop.mma(tile, score_mods, exp_scale_log2, acc_s, tOrP, acc_o, softmax, look_ahead);

  Tensor acc_o_rowcol = make_tensor(
      acc_o.data(), wgmma_acc_layout_as_rowcol(acc_o.layout()));  // (rows, D) of this thread
  float lse[Mainloop::kNRows];
  softmax.finalize(acc_o_rowcol, kWithScoreMods ? score_mods.unit : params.softmax_scale, 1.f, lse);
  epilogue.store(acc_o, lse, gO, lse_rows, rows_left);
  mainloop.release_q_after_epilogue();
  mainloop.advance(n_tiles);
}

// A producer warpgroup, of which one thread issues the TMA loads
// (FwdSm90MainloopLoad), and two or three MMA warpgroups
// (fwd_sm90_mma_tile), each walking the tiles of the block's scheduler
// (fwd_tile_scheduler_sm90.h). A persistent block's producer runs ahead into
// the next tile (its K / V stages as they come free, its Q once the MMA
// warpgroups have handed Q back), so a tile's prologue overlaps the last
// one's tail.
//
// kWithScoreMods: the scores go through softcap and ALiBi before the mask,
// kept in the units of ScoreModsInUnits (score_mods.h), which leave the
// scale or the softcap to the exp2 multiplier. Its own instantiation, so
// that the plain rule's loop carries none of it.
template <typename Traits, bool kTilesFromCounter, bool kWithScoreMods = false>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    flash_fwd_sm90_kernel(const FwdParams params, const __grid_constant__ FwdSm90Tma<Traits> tma,
                          const FwdTileDivisors tile_divisors) {
  static_assert(Traits::kPersistent || !kTilesFromCounter, "only a persistent grid takes tiles");
  static_assert(!(kTilesFromCounter && kWithScoreMods),
                "the counter grid runs the plain score rule (fwd_sm90_takes_tiles_from_counter)");
#if defined(CUTE_ARCH_MMA_SM90A_ENABLED)
  constexpr int kStages = Traits::kStages;
  constexpr int kNMmaThreads = Traits::kNMmaThreads;

  extern __shared__ char smem[];
  const int tidx = threadIdx.x;
  // The MMA warpgroups are the threads from 128 on: their index from 0.
  const int mma_tidx = tidx - 128;
  const FwdSm90TileGrid<Traits> grid(params, tile_divisors);
  const FwdSm90SmemTiles<Traits> tiles(smem);
  auto& barriers = *reinterpret_cast<typename Traits::Barriers*>(smem + Traits::kSmemSizeTiles);

  if (tidx == 0) {
    full_barrier(barriers.q_full).init(1);
    empty_barrier(barriers.q_empty).init(kNMmaThreads);
    CUTE_UNROLL
    for (int s = 0; s < kStages; ++s) {
      full_barrier(barriers.k_full[s]).init(1);
      full_barrier(barriers.v_full[s]).init(1);
      // Every MMA thread hands a stage back once its wgmmas have read it.
      empty_barrier(barriers.k_empty[s]).init(kNMmaThreads);
      empty_barrier(barriers.v_empty[s]).init(kNMmaThreads);
    }
    if constexpr (kTilesFromCounter) {
      empty_barrier(barriers.tile_full).init(1);
      // Read by every MMA thread and by the thread that issues the copies.
      empty_barrier(barriers.tile_empty).init(kNMmaThreads + 1);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  const auto scheduler = make_fwd_sm90_scheduler<Traits, kTilesFromCounter>(grid, barriers);
  if (tidx < 128) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegisters>();
    if (tidx != 0) return;
    FwdSm90MainloopLoad<Traits> producer{params, tma, barriers, tiles};
    scheduler.for_each_tile(
        [&](const FwdSm90Tile& tile, auto&& look_ahead) { producer.load(tile, look_ahead); });
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<Traits::kMmaRegisters>();
  FwdSm90MainloopMma<Traits, kTilesFromCounter, kWithScoreMods> mainloop(params, barriers, tiles,
                                                                         mma_tidx);
  FwdSm90Epilogue<Traits> epilogue(params, tiles.sO, mma_tidx, mainloop.warp_group,
                                   mainloop.tiled_mma_o, mainloop.thr_mma_o);
  scheduler.for_each_tile([&](const FwdSm90Tile& tile, auto&& look_ahead) {
    fwd_sm90_mma_tile<Traits, kWithScoreMods>(params, mainloop, epilogue, tile, look_ahead);
  });
#endif
}

}  // namespace flash
