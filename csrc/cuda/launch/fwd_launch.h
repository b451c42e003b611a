// Host side of the forward kernels: grid, shared-memory opt-in and launch for
// one (dtype, compiled head dim), with the tile shapes from fwd_tile_config.h,
// and the choice between the SM80 kernel and the Hopper one.
#pragma once

#include <cuda_runtime.h>

#include "cuda/core/cuda_check.h"
#include "cuda/core/grid_heads_batch.h"
#include "cuda/core/params.h"
#include "cuda/fwd/fwd_tile_config.h"
#include "cuda/fwd/fwd_tile_schedule.h"
#include "cuda/fwd/return_probs.h"
#include "cuda/fwd/sm80/fwd_kernel_sm80.h"
#include "cuda/fwd/sm80/fwd_kernel_traits_sm80.h"
#include "cuda/fwd/sm90/fwd_kernel_sm90.h"
#include "cuda/fwd/sm90/fwd_kernel_traits_sm90.h"
#include "cuda/launch/dependent_launch.h"

namespace flash {

// One variant of the kernel (plain, or with softcap / ALiBi / dropout), each
// with its own tile from the table.
template <typename Element, int kHeadDim, bool kWithScoreExtras>
void launch_flash_fwd_variant(const FwdParams& params, cudaStream_t stream) {
  using Config = FwdTileConfig<kHeadDim>;
  using Traits =
      FwdKernelTraits<kHeadDim, Config::kBlockM,
                      kWithScoreExtras ? Config::kBlockNExtras : Config::kBlockN,
                      kWithScoreExtras ? Config::kNWarpsExtras : Config::kNWarps, Element>;
  const int num_m_blocks = (params.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM;
  // Query blocks on x (no 65535 limit), (head, batch) pairs on y and z. The
  // kernel takes its block in the order of fwd_block_order.h.
  const dim3 grid = grid_over_heads_batch(num_m_blocks, params.nheads, params.batch);
  launch_with_dynamic_smem(&flash_fwd_kernel<Traits, kWithScoreExtras>, grid,
                           dim3(Traits::kNThreads), Traits::kSmemSize, stream, params);
}

// The Hopper kernel exists as machine code only when the build has sm_90a
// (FLASH_ATTN_CUDA_ARCHS; setup.py defines FLASH_ATTN_HAS_SM90A then).
template <int kHeadDim>
constexpr bool has_sm90_forward() {
#if defined(FLASH_ATTN_HAS_SM90A)
  return FwdTileConfig<kHeadDim>::kBlockNSm90 > 0;
#else
  return false;
#endif
}

// The Hopper kernel of 128-row query blocks, which the grid that takes its
// tiles from a counter runs (the op sizes the counter by its tiles), and the
// one of the table's query block (kBlockMSm90), which every other grid runs.
template <typename Element, int kHeadDim>
using FwdSm90Traits =
    FwdSm90KernelTraits<kHeadDim, kFwdSm90BlockM, FwdTileConfig<kHeadDim>::kBlockNSm90, Element>;
template <typename Element, int kHeadDim>
using FwdSm90GridTraits = FwdSm90KernelTraits<kHeadDim, FwdTileConfig<kHeadDim>::kBlockMSm90,
                                              FwdTileConfig<kHeadDim>::kBlockNSm90, Element>;

// The Hopper kernel's grid: one block per SM when there are more query
// blocks than SMs, each block walking query blocks in turn
// (fwd_kernel_sm90.h): a fixed share of them when they all do the same
// work (fixed length, no causal or local bound); where they differ and are
// short, the next one free, from params.tile_counter (fwd_tile_schedule.h);
// else one block per query block, which the hardware hands out as SMs come
// free. H100 microbench (PERF_LOG): the fixed shares ran non-causal d64 /
// d128 3-20% faster (most at 512 keys), but causal d128 up to 21% slower than
// the hardware's order; at d256 (no tile for O) it did not win.
// kWithScoreMods (softcap or ALiBi) runs the kernel's variant with them on
// the fixed-share or one-per-tile grid; the counter grid's short causal
// tiles keep the plain rule only, one instantiation fewer per head dim.
template <typename Element, int kHeadDim, bool kWithScoreMods>
void launch_flash_fwd_sm90(const FwdParams& params, cudaStream_t stream) {
  const auto launch = [&](auto traits, auto kernel, int64_t grid_size) {
    using Traits = decltype(traits);
    launch_with_dynamic_smem(kernel, dim3(grid_size), dim3(Traits::kNThreads), Traits::kSmemSize,
                             stream, params, FwdSm90Tma<Traits>::make(params),
                             fwd_sm90_tile_divisors(params, Traits::kBlockM));
  };
  using CounterTraits = FwdSm90Traits<Element, kHeadDim>;
  if constexpr (CounterTraits::kPersistent && !kWithScoreMods) {
    // (The rule asks for more tiles than SMs itself, counted in this grid's
    // 128-row tiles.)
    if (params.tile_counter != nullptr && fwd_sm90_takes_tiles_from_counter(params)) {
      // Zeroed here, where the grid is chosen, and not by the op, which
      // would zero it for calls that run another grid too.
      FA_CUDA_CHECK(cudaMemsetAsync(params.tile_counter, 0, sizeof(*params.tile_counter), stream));
      launch(CounterTraits{}, &flash_fwd_sm90_kernel<CounterTraits, true>, params.num_sms);
      return;
    }
  }
  using Traits = FwdSm90GridTraits<Element, kHeadDim>;
  const int64_t num_tiles = fwd_sm90_num_tiles(params, Traits::kBlockM);
  const bool more_tiles_than_sms = params.num_sms > 0 && num_tiles > params.num_sms;
  if constexpr (Traits::kPersistent) {
    // Fixed shares also where one block per tile would not fit grid x (a
    // varlen batch of very many sequences: the grid counts the longest one's
    // query blocks in each).
    if (more_tiles_than_sms &&
        (!fwd_tiles_differ_in_work(params) || num_tiles > kFwdSm90MaxGridTiles)) {
      launch(Traits{}, &flash_fwd_sm90_kernel<Traits, false, kWithScoreMods>, params.num_sms);
      return;
    }
  }
  launch(Traits{}, &flash_fwd_sm90_kernel<Traits, false, kWithScoreMods>, num_tiles);
}

template <typename Element, int kHeadDim>
void run_flash_fwd(const FwdParams& params, cudaStream_t stream) {
  if (params.seqlen_q == 0 || params.batch == 0 || params.nheads == 0) return;
  const bool with_score_mods = params.softcap > 0.f || params.alibi_slopes != nullptr;
  const bool with_dropout = params.dropout_p > 0.f;
  const bool scale_positive_normal = scale_is_positive_normal(params.softmax_scale_log2);
  const bool with_score_extras = with_score_mods || with_dropout || !scale_positive_normal;
  if constexpr (has_sm90_forward<kHeadDim>()) {
    // By shape (fwd_sm90_by_shape); inputs TMA cannot describe, dropout
    // (only the SM80 kernels draw its keep mask) and a scale that is not
    // positive (scale_is_positive_normal) run the SM80 kernel whatever was
    // asked for.
    const bool sm90 = params.fwd_kernel == KernelChoice::kSm90 ||
                      (params.fwd_kernel == KernelChoice::kAuto &&
                       fwd_sm90_by_shape(params, FwdTileConfig<kHeadDim>::kMinSeqlenKSm90,
                                         FwdTileConfig<kHeadDim>::kMinBlocksPerSmSm90));
    using Traits = FwdSm90GridTraits<Element, kHeadDim>;
    // A grid of one block per tile beyond grid x's limit runs the SM80
    // kernel's 3-D grid instead (only the persistent grids walk that many).
    const bool grid_fits =
        Traits::kPersistent || fwd_sm90_num_tiles(params, Traits::kBlockM) <= kFwdSm90MaxGridTiles;
    if (sm90 && grid_fits && !with_dropout && scale_positive_normal &&
        FwdSm90Tma<Traits>::can_load(params)) {
      if (with_score_mods) {
        launch_flash_fwd_sm90<Element, kHeadDim, true>(params, stream);
      } else {
        launch_flash_fwd_sm90<Element, kHeadDim, false>(params, stream);
      }
      if (params.p_ptr != nullptr) launch_return_probs(params, stream);
      return;
    }
  }
  if (with_score_extras) {
    launch_flash_fwd_variant<Element, kHeadDim, true>(params, stream);
  } else {
    launch_flash_fwd_variant<Element, kHeadDim, false>(params, stream);
  }
  if (params.p_ptr != nullptr) launch_return_probs(params, stream);
}

}  // namespace flash
