// The forward kernel on Hopper's warpgroup MMAs (wgmma, sm90a): the
// FlashAttention-2 walk of fwd_kernel_sm80.h (one thread block per query
// block, K/V tiles from the last visible key block down, online softmax with
// P kept in registers), with Q K^T read from shared memory and P V with P
// from registers at about twice the tensor-core rate of the SM80 mma.sync
// path. Within a warpgroup, S(i) = Q K(i)^T is issued together with P V of
// the tile before, and the softmax of S(i) runs while that product is on the
// tensor cores. The copies and the block-wide barriers stay out of the MMA
// warpgroups' loop:
//   - a producer warpgroup, one thread of it (two or four warps to gather paged keys,
//     FwdSm90MainloopLoad), loads Q, K and V by TMA into two stages per
//     tensor; each landed stage is announced on an mbarrier
//     ("full"), and each stage comes back once every MMA warpgroup's wgmmas
//     have read it ("empty");
//   - the two or three MMA warpgroups (64 query rows each; the tile table
//     says how many) take turns issuing their products (a named barrier per
//     turn), so one warpgroup's softmax runs while another's products occupy
//     the tensor cores, instead of all meeting at a block barrier every tile
//     with the tensor cores idle in between.
// It runs the causal / local / bounds mask and, in its kWithScoreMods
// variant, softcap and ALiBi before it (score_mods.h, in the contract's
// order) and dropout after the softmax's row sums (dropout.h,
// PairedDropoutMask), on TMA-describable inputs (16-byte aligned pointers,
// strides that are positive multiples of 16 bytes); the launcher sends
// anything else to fwd_kernel_sm80.h.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>

#include "cuda/core/params.h"
#include "cuda/core/score_mods.h"
#include "cuda/core/tma_loads_sm90.h"
#include "cuda/fwd/fwd_block_io.h"
#include "cuda/fwd/sm90/fwd_epilogue_sm90.h"
#include "cuda/fwd/sm90/fwd_kernel_traits_sm90.h"
#include "cuda/fwd/sm90/fwd_mainloop_sm90.h"
#include "cuda/fwd/sm90/fwd_pipeline_sm90.h"
#include "cuda/fwd/sm90/fwd_tile_scheduler_sm90.h"

namespace flash {

using namespace cute;

// The kernel is a skeleton of its roles: the tile scheduler
// (fwd_tile_scheduler_sm90.h) hands the tiles to the producer
// (FwdSm90MainloopLoad) and to the MMA warpgroups (FwdSm90MainloopMma, then
// FwdSm90Epilogue), which meet at the mbarriers of fwd_pipeline_sm90.h.
//
// kWithScoreMods: the scores go through softcap and ALiBi before the mask,
// kept in the units of ScoreModsInUnits (score_mods.h), which leave the
// scale or the softcap to the exp2 multiplier, and P through dropout. Its
// own instantiation, so that the plain rule's loop carries none of it;
// dropout shares it rather than adding one per head dim and grid (each of
// the three is a uniform run-time test there).
//
// kKeys: contiguous K / V, or paged ones (FwdParams::block_table) by TMA
// boxes or gathered (FwdSm90Tma::gather_keys). Paged keys have
// instantiations of their own: beside the paged producer code, the
// one-thread loop of contiguous keys went from no spills to hundreds of
// bytes (ptxas, d128 bf16), and the paged branch inside that loop had cost
// it 120-136 bytes. Boxes and gather are two where the gather takes
// registers from the MMA warpgroups (Traits::kGatherRegisterSplit), else
// one (kPagedEither) that reads gather_keys at run time.
enum class FwdSm90Keys { kContiguous, kPagedBoxes, kPagedGather, kPagedEither };

template <typename Traits, bool kTilesFromCounter, bool kWithScoreMods = false,
          FwdSm90Keys kKeys = FwdSm90Keys::kContiguous>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    flash_fwd_sm90_kernel(const FwdParams params, const __grid_constant__ FwdSm90Tma<Traits> tma,
                          const FwdTileDivisors tile_divisors) {
  static_assert(Traits::kPersistent || !kTilesFromCounter, "only a persistent grid takes tiles");
  static_assert(!(kTilesFromCounter && kWithScoreMods),
                "the counter grid runs the plain score rule (plan_fwd picks it so)");
  static_assert(kKeys == FwdSm90Keys::kContiguous ||
                    (kKeys == FwdSm90Keys::kPagedEither) == !Traits::kGatherRegisterSplit,
                "boxes and gather have kernels of their own exactly where their register "
                "splits differ");
#if defined(CUTE_ARCH_MMA_SM90A_ENABLED)
  using Storage = FwdSm90SharedStorage<Traits>;
  using Mainloop = FwdSm90MainloopMma<Traits, kWithScoreMods>;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kHeadDimV = Traits::kHeadDimV;

  const int tidx = threadIdx.x;
  // The MMA warpgroups are threads [128, 384): their index from 0.
  const int mma_tidx = tidx - 128;
  FwdSm90TileScheduler<Traits, kTilesFromCounter> scheduler(params, tile_divisors);
  using LoadTiles = FwdSm90MainloopLoad<Traits, FwdSm90KeyLoad::kTiles>;
  using LoadBoxes = FwdSm90MainloopLoad<Traits, FwdSm90KeyLoad::kPagedBoxes>;
  using LoadGather = FwdSm90MainloopLoad<Traits, FwdSm90KeyLoad::kPagedGather>;
  constexpr bool kPaged = kKeys != FwdSm90Keys::kContiguous;
  // The launcher runs a paged instantiation for paged keys only.
  const bool gather =
      kKeys == FwdSm90Keys::kPagedGather || (kKeys == FwdSm90Keys::kPagedEither && tma.gather_keys);
  constexpr bool kGatherRegisters = kKeys == FwdSm90Keys::kPagedGather;
  static_assert(LoadBoxes::kThreads == LoadTiles::kThreads &&
                    LoadBoxes::kFullArrivals == LoadTiles::kFullArrivals,
                "one thread issues contiguous tiles and paged boxes alike");
  if (tidx == 0) {
    Storage::template init_barriers<kTilesFromCounter>(
        gather ? LoadGather::kFullArrivals : LoadTiles::kFullArrivals,
        gather ? LoadGather::kThreads : LoadTiles::kThreads);
  }
  __syncthreads();

  if (tidx < 128) {
    // The producer warpgroup: the threads that issue the copies
    // (FwdSm90MainloopLoad::kThreads) stay.
    cutlass::arch::warpgroup_reg_dealloc<kGatherRegisters ? Traits::kGatherProducerRegisters
                                                          : Traits::kProducerRegisters>();
    auto produce = [&](auto mainloop_load) {
      scheduler.for_each_tile([&](const FwdSm90Tile& tile, auto&& look_ahead) {
        mainloop_load.load(tile, look_ahead);
      });
    };
    if constexpr (kPaged) {
      const int warp = cutlass::canonical_warp_idx_sync();
      if (!gather) {
        if (tidx == 0) produce(LoadBoxes{params, tma, {}});
      } else if (warp < LoadGather::kThreads / 32) {
        produce(LoadGather{params, tma, {}});
      }
    } else {
      if (tidx == 0) produce(LoadTiles{params, tma, {}});
    }
    return;
  }

  // The MMA warpgroups.
  cutlass::arch::warpgroup_reg_alloc<kGatherRegisters ? Traits::kGatherMmaRegisters
                                                      : Traits::kMmaRegisters>();
  Mainloop mainloop(params, mma_tidx);
  const FwdSm90Epilogue<Traits> epilogue(params, mma_tidx);
  // The MMA thread that takes the tiles from the counter.
  const bool takes_tiles = kTilesFromCounter && mma_tidx == 0;
  scheduler.for_each_tile([&](const FwdSm90Tile& tile, auto&& look_ahead) {
    const BlockInfo& binfo = tile.binfo;
    const FwdBlock& block = tile.block;
    // varlen: this sequence is shorter than the longest
    if (block.rows_left <= 0) {
      if (takes_tiles) scheduler.publish_tile(scheduler.take_tile());
      look_ahead();
      return;
    }
    float* lse_rows = fwd_lse_rows(params, binfo, block);
    const ScoreModsInUnits score_mods = mainloop.score_mods_of(block);
    // (M,Dv)
    Tensor gO =
        get<3>(fwd_global_tiles<typename Traits::Element, kBlockM, kBlockN, kHeadDim, kHeadDimV>(
            params, binfo, block));
    if (tile.n_key_blocks <= 0) {
      if (takes_tiles) scheduler.publish_tile(scheduler.take_tile());
      look_ahead();
      epilogue.store_empty(gO, lse_rows, block.head, block.rows_left);
      return;
    }
    typename Mainloop::FragmentO acc_o;  // (MMA,MMA_M,MMA_D)
    float lse[Mainloop::kNRows];
    mainloop.mma(tile, score_mods, takes_tiles, scheduler, acc_o, lse, look_ahead);
    epilogue.store(acc_o, mainloop.tiled_mma_o, mainloop.thr_mma_o, lse, lse_rows, gO,
                   block.rows_left);
    mainloop.stages.advance(tile.n_key_blocks);
  });
#endif
}

}  // namespace flash
