// Host side of the forward kernels: grid, shared-memory opt-in and launch for
// one (dtype, compiled head dim) or specialised (d_qk, d_v) pair, with the
// tile shapes from fwd_tile_config.h, of the kernel and grid that the plan
// (plan_fwd, plan.h) chose.
#pragma once

#include <stdexcept>
#include <string>

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
#include "cuda/launch/plan.h"

namespace flash {

// The SM80 kernel, plain or with softcap / ALiBi / dropout / a scale that
// is not positive and normal (kWithScoreExtras), on the tile and grid the
// plan took from Config's row (the table's, or FwdTileConfigLargeSmem's) for
// that variant.
template <typename Element, int kHeadDim, bool kWithScoreExtras, typename Config>
void launch_flash_fwd_sm80(const FwdParams& params, const FwdPlan& plan, cudaStream_t stream) {
  using Traits =
      FwdKernelTraits<kHeadDim, Config::kBlockM,
                      kWithScoreExtras ? Config::kBlockNExtras : Config::kBlockN,
                      kWithScoreExtras ? Config::kNWarpsExtras : Config::kNWarps, Element>;
  if (plan.block_m != Traits::kBlockM || plan.block_n != Traits::kBlockN ||
      plan.num_warps != Traits::kNWarps) {
    throw std::runtime_error(
        "flash_attn_cuda: the forward plan disagrees with the SM80 kernel's tile: " +
        describe(plan));
  }
  // Query blocks on x (no 65535 limit), (head, batch) pairs on y and z. The
  // kernel takes its block in the order of fwd_block_order.h.
  const dim3 grid = grid_over_heads_batch(plan.grid_x, params.nheads, params.batch);
  launch_with_dynamic_smem(&flash_fwd_kernel<Traits, kWithScoreExtras>, grid,
                           dim3(Traits::kNThreads), Traits::kSmemSize, stream, params);
}

// The Hopper kernel exists as machine code only when the build has sm_90a
// (FLASH_ATTN_CUDA_ARCHS; setup.py defines FLASH_ATTN_HAS_SM90A then).
template <int kHeadDim, int kHeadDimV = kHeadDim>
constexpr bool has_sm90_forward() {
#if defined(FLASH_ATTN_HAS_SM90A)
  return FwdTileConfig<kHeadDim, kHeadDimV>::kBlockNSm90 > 0;
#else
  return false;
#endif
}

// The Hopper kernel of 128-row query blocks, which the grid that takes its
// tiles from a counter runs (the op sizes the counter by its tiles), and the
// one of the table's query block (kBlockMSm90), which every other grid runs.
template <typename Element, int kHeadDim, int kHeadDimV = kHeadDim>
using FwdSm90Traits =
    FwdSm90KernelTraits<kHeadDim, kFwdSm90BlockM, FwdTileConfig<kHeadDim, kHeadDimV>::kBlockNSm90,
                        Element, kHeadDimV>;
template <typename Element, int kHeadDim, int kHeadDimV = kHeadDim>
using FwdSm90GridTraits =
    FwdSm90KernelTraits<kHeadDim, FwdTileConfig<kHeadDim, kHeadDimV>::kBlockMSm90,
                        FwdTileConfig<kHeadDim, kHeadDimV>::kBlockNSm90, Element, kHeadDimV>;
// The kernel of a call with dropout where the table's tile cannot draw it and
// another can (plan.h fwd_sm90_dropout_tile: d64 128 x 128, d256 128 x 64);
// elsewhere the table's, whose score-mods variant draws it or never runs it.
template <int kHeadDim, int kHeadDimV>
constexpr FwdSm90TileShape fwd_sm90_dropout_traits_tile() {
  using Config = FwdTileConfig<kHeadDim, kHeadDimV>;
  const FwdSm90TileShape tile =
      fwd_sm90_dropout_tile(kHeadDimV, Config::kBlockMSm90, Config::kBlockNSm90);
  return tile.block_m > 0 ? tile : FwdSm90TileShape{Config::kBlockMSm90, Config::kBlockNSm90};
}
template <typename Element, int kHeadDim, int kHeadDimV = kHeadDim>
using FwdSm90DropoutTraits =
    FwdSm90KernelTraits<kHeadDim, fwd_sm90_dropout_traits_tile<kHeadDim, kHeadDimV>().block_m,
                        fwd_sm90_dropout_traits_tile<kHeadDim, kHeadDimV>().block_n, Element,
                        kHeadDimV>;

// The row gather's kernel of a tile: Traits with the gather's K / V stages
// (kGatherStages: three where they fit, plan.h fwd_sm90_kv_stages).
template <typename Traits>
using FwdSm90GatherTraits =
    FwdSm90KernelTraits<Traits::kHeadDim, Traits::kBlockM, Traits::kBlockN,
                        typename Traits::Element, Traits::kHeadDimV, Traits::kGatherStages>;

// plan.h's rule for the row gather's stages and grid matches the traits.
template <typename Traits>
constexpr bool fwd_sm90_gather_traits_match_plan() {
  using Gather = FwdSm90GatherTraits<Traits>;
  return Gather::kStages == fwd_sm90_kv_stages(FwdKeys::kPagedGather, Traits::kHeadDim,
                                               Traits::kHeadDimV, Traits::kBlockM,
                                               Traits::kBlockN) &&
         Gather::kPersistent == fwd_sm90_persistent(Traits::kHeadDim, Traits::kHeadDimV,
                                                    Traits::kBlockM, Traits::kBlockN,
                                                    Gather::kStages) &&
         sizeof(typename Gather::Barriers) == fwd_sm90_barrier_bytes(Gather::kStages);
}

// The instantiation of the Hopper kernel for the plan's keys: contiguous,
// or paged by TMA boxes or the row gather, each in a kernel of its own where
// their register splits differ (Traits::kGatherRegisterSplit), else in one.
// A row gather on stages of its own (FwdSm90GatherTraits other than Traits)
// is launched on those traits (launch_flash_fwd_sm90), not from here.
template <typename Traits, bool kTilesFromCounter, bool kWithScoreMods>
auto fwd_sm90_kernel_for(FwdKeys keys) {
  using Keys = FwdSm90Keys;
  constexpr auto contiguous =
      &flash_fwd_sm90_kernel<Traits, kTilesFromCounter, kWithScoreMods, Keys::kContiguous>;
  if (keys == FwdKeys::kContiguous) return contiguous;
  if constexpr (Traits::kGatherRegisterSplit) {
    if (keys == FwdKeys::kPagedGather) {
      if constexpr (Traits::kGatherStages == Traits::kStages) {
        return &flash_fwd_sm90_kernel<Traits, kTilesFromCounter, kWithScoreMods,
                                      Keys::kPagedGather>;
      } else {
        throw std::runtime_error(
            "flash_attn_cuda: the Hopper forward's row gather runs on its own K / V stages "
            "(FwdSm90GatherTraits), not on this tile's");
      }
    }
    return &flash_fwd_sm90_kernel<Traits, kTilesFromCounter, kWithScoreMods, Keys::kPagedBoxes>;
  } else {
    return &flash_fwd_sm90_kernel<Traits, kTilesFromCounter, kWithScoreMods, Keys::kPagedEither>;
  }
}

// The Hopper kernel on the grid the plan chose (plan_fwd in plan.cpp says when
// each grid runs, and why): one block per SM walking query blocks in turn
// (fwd_kernel_sm90.h), a fixed share of them (kFixedShares) or the next one
// free from params.tile_counter (kTileCounter, fwd_tile_schedule.h); or one
// block per query block (kOnePerTile), which the hardware hands out as SMs
// come free (fixed shares against the hardware's order: PERF_LOG 2026-11-24
// 688b18f). kWithScoreMods (softcap, ALiBi or dropout) runs the kernel's variant with
// them on the fixed-share or one-per-tile grid; the counter grid's short
// causal tiles keep the plain rule only, one instantiation fewer per head dim.
// Dropout where the table's tile cannot draw it but another can (d64, d256:
// plan.h's fwd_sm90_dropout_tile) runs the score-mods variant of that tile's
// kernel on those grids.
template <typename Element, int kHeadDim, int kHeadDimV, bool kWithScoreMods>
void launch_flash_fwd_sm90(const FwdParams& params, const FwdPlan& plan, cudaStream_t stream) {
  // Paged keys (FwdPlan::keys) run a paged instantiation of the kernel
  // (fwd_sm90_kernel_for); pages that TMA boxes do not fit are gathered by
  // the producer warpgroup.
  const bool paged = plan.keys != FwdKeys::kContiguous;
  const bool gather_keys = plan.keys == FwdKeys::kPagedGather;
  const auto launch = [&](auto traits, auto kernel) {
    using Traits = decltype(traits);
    if (plan.block_m != Traits::kBlockM || plan.block_n != Traits::kBlockN ||
        paged != (params.block_table != nullptr) ||
        !FwdSm90Tma<Traits>::can_load(params, gather_keys) ||
        (params.dropout_p > 0.f && !(kWithScoreMods && Traits::kDrawsDropout))) {
      throw std::runtime_error(
          "flash_attn_cuda: the forward plan disagrees with the Hopper kernel (query block, "
          "TMA, paged keys or dropout rule): " +
          describe(plan));
    }
    launch_with_dynamic_smem(kernel, dim3(static_cast<unsigned>(plan.grid_x)),
                             dim3(Traits::kNThreads), Traits::kSmemSize, stream, params,
                             FwdSm90Tma<Traits>::make(params, gather_keys),
                             fwd_sm90_tile_divisors(params, Traits::kBlockM));
  };
  // The plan's keys on a tile's traits: the row gather on its own stages
  // where they differ (FwdSm90GatherTraits), the others on the tile's. False
  // where a persistent grid meets a kernel that is not.
  const auto launch_keys = [&](auto traits, auto tiles_from_counter, auto with_mods,
                               bool persistent_grid) {
    using TileTraits = decltype(traits);
    using GatherTraits = FwdSm90GatherTraits<TileTraits>;
    constexpr bool kCounter = decltype(tiles_from_counter)::value;
    constexpr bool kMods = decltype(with_mods)::value;
    if constexpr (GatherTraits::kStages != TileTraits::kStages) {
      if (plan.keys == FwdKeys::kPagedGather) {
        if constexpr (GatherTraits::kPersistent || !kCounter) {
          if (persistent_grid && !GatherTraits::kPersistent) return false;
          launch(GatherTraits{},
                 &flash_fwd_sm90_kernel<GatherTraits, kCounter, kMods, FwdSm90Keys::kPagedGather>);
          return true;
        }
        return false;
      }
    }
    launch(TileTraits{}, fwd_sm90_kernel_for<TileTraits, kCounter, kMods>(plan.keys));
    return true;
  };
  using CounterTraits = FwdSm90Traits<Element, kHeadDim, kHeadDimV>;
  static_assert(
      CounterTraits::kPersistent ==
          fwd_sm90_persistent(kHeadDim, kHeadDimV, CounterTraits::kBlockM, CounterTraits::kBlockN),
      "plan.h's rule for a persistent Hopper forward matches the traits");
  using Traits = FwdSm90GridTraits<Element, kHeadDim, kHeadDimV>;
  static_assert(Traits::kPersistent ==
                    fwd_sm90_persistent(kHeadDim, kHeadDimV, Traits::kBlockM, Traits::kBlockN),
                "plan.h's rule for a persistent Hopper forward matches the traits");
  static_assert(sizeof(typename Traits::Barriers) == fwd_sm90_barrier_bytes(Traits::kStages));
  static_assert(fwd_sm90_gather_traits_match_plan<Traits>() &&
                    fwd_sm90_gather_traits_match_plan<CounterTraits>(),
                "plan.h's rule for the row gather's stages matches the traits");
  static_assert(
      Traits::kDrawsDropout == fwd_sm90_draws_dropout(kHeadDimV, Traits::kBlockM, Traits::kBlockN),
      "plan.h's rule for the Hopper forward's dropout matches the traits");
  using DropoutTraits = FwdSm90DropoutTraits<Element, kHeadDim, kHeadDimV>;
  static_assert(
      DropoutTraits::kDrawsDropout ==
          fwd_sm90_draws_dropout(kHeadDimV, DropoutTraits::kBlockM, DropoutTraits::kBlockN),
      "plan.h's rule for the Hopper forward's dropout matches the traits");
  static_assert(fwd_sm90_gather_traits_match_plan<DropoutTraits>(),
                "plan.h's rule for the row gather's stages matches the traits");
  // A kernel of its own for dropout (fwd_sm90_dropout_tile), with the score mods.
  constexpr bool kDropoutTile =
      kWithScoreMods && !Traits::kDrawsDropout && DropoutTraits::kDrawsDropout;
  // The fixed-share (persistent_only) or one-per-tile grid; false if the
  // plan's kernel has no such grid.
  const auto launch_grid = [&](auto persistent_only) {
    constexpr bool kPersistentOnly = decltype(persistent_only)::value;
    if constexpr (kDropoutTile) {
      if (plan.block_m == DropoutTraits::kBlockM && plan.block_n == DropoutTraits::kBlockN) {
        if constexpr (!kPersistentOnly || DropoutTraits::kPersistent) {
          return launch_keys(DropoutTraits{}, cute::false_type{}, cute::true_type{},
                             kPersistentOnly);
        }
        return false;
      }
    }
    if constexpr (!kPersistentOnly || Traits::kPersistent) {
      return launch_keys(Traits{}, cute::false_type{}, cute::bool_constant<kWithScoreMods>{},
                         kPersistentOnly);
    }
    return false;
  };
  switch (plan.grid) {
    case FwdGrid::kTileCounter:
      if constexpr (CounterTraits::kPersistent && !kWithScoreMods) {
        if (params.tile_counter == nullptr) break;
        // Zeroed here, where the grid is launched, and not by the op, which
        // would zero it for calls that run another grid too.
        FA_CUDA_CHECK(
            cudaMemsetAsync(params.tile_counter, 0, sizeof(*params.tile_counter), stream));
        if (launch_keys(CounterTraits{}, cute::true_type{}, cute::false_type{}, true)) return;
      }
      break;
    case FwdGrid::kFixedShares:
      if (launch_grid(cute::true_type{})) return;
      break;
    case FwdGrid::kOnePerTile:
      if (launch_grid(cute::false_type{})) return;
      break;
    default: break;
  }
  throw std::runtime_error("flash_attn_cuda: no Hopper forward grid for this plan: " +
                           describe(plan));
}

// The plan (plan_fwd) names the kernel, variant and grid; this only launches.
// A specialised (d_qk, d_v) pair (kHeadDimV < kHeadDim) has a Hopper kernel
// only: plan_fwd sends the pair's SM80 calls to d_qk's launcher.
template <typename Element, int kHeadDim, int kHeadDimV = kHeadDim>
void run_flash_fwd(const FwdParams& params, const FwdPlan& plan, cudaStream_t stream) {
  if (plan.kernel != FwdKernel::kNone &&
      (plan.head_dim != kHeadDim || plan.head_dim_v != kHeadDimV)) {
    throw std::runtime_error(
        "flash_attn_cuda: the forward plan names another compiled (head dim, head dim v) than "
        "this launcher's: " +
        describe(plan));
  }
  switch (plan.kernel) {
    case FwdKernel::kNone: return;
    case FwdKernel::kSm90:
      if constexpr (has_sm90_forward<kHeadDim, kHeadDimV>()) {
        if (plan.variant == FwdVariant::kScoreMods) {
          launch_flash_fwd_sm90<Element, kHeadDim, kHeadDimV, true>(params, plan, stream);
        } else {
          launch_flash_fwd_sm90<Element, kHeadDim, kHeadDimV, false>(params, plan, stream);
        }
        break;
      } else {
        throw std::runtime_error(
            "flash_attn_cuda: the plan asks for a Hopper forward that this "
            "build lacks: " +
            describe(plan));
      }
    case FwdKernel::kSm80:
      if constexpr (kHeadDimV == kHeadDim) {
        const auto launch = [&](auto config) {
          using Config = decltype(config);
          if (plan.variant == FwdVariant::kScoreExtras) {
            launch_flash_fwd_sm80<Element, kHeadDim, true, Config>(params, plan, stream);
          } else {
            launch_flash_fwd_sm80<Element, kHeadDim, false, Config>(params, plan, stream);
          }
        };
        if (!plan.sm80_large_smem) {
          launch(FwdTileConfig<kHeadDim>{});
        } else if constexpr (FwdTileConfigLargeSmem<kHeadDim>::kExists) {
          launch(FwdTileConfigLargeSmem<kHeadDim>{});
        } else {
          throw std::runtime_error(
              "flash_attn_cuda: the plan asks for a large-shared-memory forward tile that this "
              "head dim lacks: " +
              describe(plan));
        }
        break;
      } else {
        throw std::runtime_error(
            "flash_attn_cuda: a specialised (head dim, head dim v) pair has no SM80 forward: " +
            describe(plan));
      }
    case FwdKernel::kSplitKv:
      throw std::runtime_error(
          "flash_attn_cuda: a split-KV forward plan runs through run_fwd_splitkv "
          "(ops/fwd_splitkv.cpp), not the forward launcher: " +
          describe(plan));
  }
  if (plan.return_probs) launch_return_probs(params, stream);
}

}  // namespace flash
