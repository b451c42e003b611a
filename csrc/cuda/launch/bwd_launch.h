// Host side of the backward pass for one (dtype, compiled head dim, or
// specialised (d_qk, d_v) pair, whose main kernel is the Hopper one only): the
// D = rowsum(dO * O) kernel, the main dQ/dK/dV kernel, the dQ conversion and,
// under GQA, the dK/dV conversion from the kv heads' sums, all on one
// stream. The caller (ops/bwd_ops.cpp) allocates and zeroes the
// accumulators and makes the plan (plan_bwd, plan.h) this switches on. Where
// the plan picks the Hopper main kernel (bwd_kernel_sm90.h), the conversion
// kernels read the accumulators in its fragment order.
#pragma once

#include <cuda_runtime.h>

#include <limits>
#include <stdexcept>
#include <type_traits>

#include "cuda/bwd/bwd_aux_kernels.h"
#include "cuda/bwd/bwd_tile_config.h"
#include "cuda/bwd/sm80/bwd_kernel_sm80.h"
#include "cuda/bwd/sm80/bwd_kernel_traits_sm80.h"
#include "cuda/bwd/sm90/bwd_kernel_sm90.h"
#include "cuda/core/cuda_check.h"
#include "cuda/core/grid_heads_batch.h"
#include "cuda/core/params.h"
#include "cuda/launch/dependent_launch.h"
#include "cuda/launch/plan.h"

namespace flash {

template <typename Config, int kHeadDim, typename Element>
using BwdTraitsFor =
    BwdKernelTraits<kHeadDim, Config::kBlockM, Config::kBlockN, Config::kNWarps,
                    Config::kAtomLayoutMSdP, Config::kAtomLayoutNdKV, Config::kAtomLayoutMdQ,
                    Config::kDoubleBufferQdO, Config::kDQBeforeDK, Element>;

template <typename Traits, bool kWithScoreExtras>
void launch_bwd_dq_dk_dv(const BwdParams& params, dim3 grid, cudaStream_t stream) {
  launch_with_dynamic_smem(&flash_bwd_dq_dk_dv_kernel<Traits, kWithScoreExtras>, grid,
                           dim3(Traits::kNThreads), Traits::kSmemSize, stream, params);
}

// The Hopper kernel exists as machine code only when the build has sm_90a
// (setup.py defines FLASH_ATTN_HAS_SM90A then), at the head dims its tile
// table column has.
template <int kHeadDim, int kHeadDimV = kHeadDim>
constexpr bool has_sm90_backward() {
#if defined(FLASH_ATTN_HAS_SM90A)
  return BwdTileConfig<kHeadDim, kHeadDimV>::kBlockMSm90 > 0;
#else
  return false;
#endif
}

template <typename Element, int kHeadDim, bool kOrderedDQ = false, int kHeadDimV = kHeadDim>
using BwdSm90TraitsFor =
    BwdSm90KernelTraits<kHeadDim, BwdTileConfig<kHeadDim, kHeadDimV>::kBlockMSm90,
                        BwdTileConfig<kHeadDim, kHeadDimV>::kBlockN, Element, kBwdSm90QdOStages,
                        bwd_sm90_stage_dq<kHeadDim>(kOrderedDQ), kHeadDimV>;
// The Hopper kernel of a call with dropout where the table's tile does not
// draw it and another does (plan.h bwd_sm90_dropout_block_m: d64 at 64 rows);
// elsewhere the table's.
template <int kHeadDim, int kHeadDimV>
constexpr int bwd_sm90_dropout_traits_block_m() {
  using Config = BwdTileConfig<kHeadDim, kHeadDimV>;
  const int block_m =
      bwd_sm90_dropout_block_m(kHeadDim, kHeadDimV, Config::kBlockMSm90, Config::kBlockN);
  return block_m > 0 ? block_m : Config::kBlockMSm90;
}
template <typename Element, int kHeadDim, int kHeadDimV = kHeadDim>
using BwdSm90DropoutTraitsFor =
    BwdSm90KernelTraits<kHeadDim, bwd_sm90_dropout_traits_block_m<kHeadDim, kHeadDimV>(),
                        BwdTileConfig<kHeadDim, kHeadDimV>::kBlockN, Element, kBwdSm90QdOStages,
                        bwd_sm90_stage_dq<kHeadDim>(false), kHeadDimV>;

// The steps after the main kernel: dQ from its accumulator and, under GQA,
// dK / dV from the kv heads' sums. MainTraits is the main kernel's:
// its MMA partitions are the accumulators' layout (bwd_accum_layout.h).
template <typename MainTraits>
void run_flash_bwd_convert(const BwdParams& params, cudaStream_t stream) {
  using Element = typename MainTraits::Element;
  constexpr int kHeadDim = MainTraits::kHeadDim;
  const dim3 dq_grid =
      grid_over_heads_batch((params.seqlen_q + MainTraits::kBlockM - 1) / MainTraits::kBlockM,
                            params.nheads, params.batch);
  flash_bwd_convert_dq_kernel<MainTraits><<<dq_grid, MainTraits::kNThreads, 0, stream>>>(params);
  FA_CUDA_CHECK(cudaGetLastError());

  // GQA/MQA: dK and dV from the kv heads' fp32 sums (deterministic mode
  // filled them in head order, BwdDkvTurn).
  if (params.nheads != params.nheads_k) {
    const int num_n_blocks = (params.seqlen_k + MainTraits::kBlockN - 1) / MainTraits::kBlockN;
    const dim3 dkv_grid = grid_over_heads_batch(num_n_blocks, params.nheads_k, params.batch);
    flash_bwd_convert_dkv_kernel<MainTraits>
        <<<dkv_grid, MainTraits::kNThreads, 0, stream>>>(params);
    FA_CUDA_CHECK(cudaGetLastError());
  }
}

// The Hopper main kernel of Sm90Traits; the plan checked that the device's
// blocks hold its shared memory and that TMA can describe the inputs.
template <typename Sm90Traits, bool kWithScoreMods, bool kOrderedDQ = false>
void launch_bwd_sm90_main(const BwdParams& params, const BwdPlan& plan, dim3 grid,
                          cudaStream_t stream) {
  if (plan.block_m != Sm90Traits::kBlockM || !BwdSm90Tma<Sm90Traits>::can_load(params) ||
      (params.dropout_p > 0.f && !(kWithScoreMods && Sm90Traits::kDrawsDropout))) {
    throw std::runtime_error(
        "flash_attn_cuda: the backward plan disagrees with the Hopper kernel (query block, TMA "
        "or dropout rule): " +
        describe(plan));
  }
  static_assert(Sm90Traits::kDrawsDropout ==
                    bwd_sm90_draws_dropout(Sm90Traits::kHeadDim, Sm90Traits::kHeadDimV,
                                           Sm90Traits::kBlockM, Sm90Traits::kBlockN),
                "plan.h's rule for the Hopper backward's dropout matches the traits");
  // The dQ order counters are per query block of this kernel's tile.
  if (kOrderedDQ &&
      (params.dq_semaphore == nullptr ||
       int64_t(params.dq_semaphore_m_blocks) * Sm90Traits::kBlockM < params.seqlen_q)) {
    throw std::runtime_error(
        "flash_attn_cuda: the dQ order counters do not cover the Hopper kernel's query blocks");
  }
  launch_with_dynamic_smem(&flash_bwd_sm90_kernel<Sm90Traits, kWithScoreMods, kOrderedDQ>, grid,
                           dim3(Sm90Traits::kNLaunchThreads), Sm90Traits::kSmemSize, stream, params,
                           BwdSm90Tma<Sm90Traits>::make(params));
}

// The SM80 main kernel (the table's tile, or the large-shared-memory one) and
// its conversions, which read the accumulators in the layout of the tile that
// ran.
template <typename Element, int kHeadDim>
void run_flash_bwd_sm80(const BwdParams& params, const BwdPlan& plan, dim3 grid,
                        cudaStream_t stream) {
  using Traits = BwdTraitsFor<BwdTileConfig<kHeadDim>, kHeadDim, Element>;
  // The plain kernels assume a positive, normal softmax scale
  // (scale_is_positive_normal); any other scale takes the general kernel,
  // which tests for a masked score (the plan's kScoreExtras).
  static_assert(bwd_sm80_smem_bytes(kHeadDim, Traits::kBlockM, Traits::kBlockN,
                                    BwdTileConfig<kHeadDim>::kDoubleBufferQdO) == Traits::kSmemSize,
                "plan.h sizes the SM80 backward's shared memory as its traits do");
  const bool extras = plan.variant == FwdVariant::kScoreExtras;
  if (plan.kernel == BwdKernel::kSm80LargeSmem) {
    using Large = BwdTileConfigLargeSmem<kHeadDim>;
    if constexpr (Large::kExists) {
      using LargeTraits = BwdTraitsFor<Large, kHeadDim, Element>;
      static_assert(bwd_sm80_smem_bytes(kHeadDim, LargeTraits::kBlockM, LargeTraits::kBlockN,
                                        Large::kDoubleBufferQdO) == LargeTraits::kSmemSize,
                    "plan.h sizes the SM80 backward's shared memory as its traits do");
      static_assert(bwd_block_shape_of<kHeadDim>().block_m % LargeTraits::kBlockM == 0 &&
                        bwd_block_shape_of<kHeadDim>().block_n % LargeTraits::kBlockN == 0,
                    "the accumulators' blocks hold the tile's");
      // A tile of the table's block shape and warp layouts (d256's, which
      // differs in its buffers only) shares the table's conversion kernels.
      constexpr bool kSameAccumLayout = LargeTraits::kBlockM == Traits::kBlockM &&
                                        LargeTraits::kBlockN == Traits::kBlockN &&
                                        LargeTraits::kNWarps == Traits::kNWarps &&
                                        LargeTraits::kAtomLayoutMdQ == Traits::kAtomLayoutMdQ &&
                                        LargeTraits::kAtomLayoutNdKV == Traits::kAtomLayoutNdKV;
      using ConvertTraits = std::conditional_t<kSameAccumLayout, Traits, LargeTraits>;
      if (!extras) {
        launch_bwd_dq_dk_dv<LargeTraits, false>(params, grid, stream);
      } else if constexpr (Large::kServesScoreExtras) {
        launch_bwd_dq_dk_dv<LargeTraits, true>(params, grid, stream);
      } else {
        throw std::runtime_error(
            "flash_attn_cuda: the plan asks for the score extras on a large-shared-memory "
            "backward tile that serves the plain variant only: " +
            describe(plan));
      }
      run_flash_bwd_convert<ConvertTraits>(params, stream);
      return;
    } else {
      throw std::runtime_error(
          "flash_attn_cuda: the plan asks for a large-shared-memory backward tile that this "
          "head dim lacks");
    }
  }
  if (extras) {
    launch_bwd_dq_dk_dv<Traits, true>(params, grid, stream);
  } else {
    launch_bwd_dq_dk_dv<Traits, false>(params, grid, stream);
  }
  run_flash_bwd_convert<Traits>(params, stream);
}

// The plan (plan_bwd) names the main kernel, its variant and the grid's
// width (key blocks, or the deterministic dQ splits); this only launches.
// A specialised (d_qk, d_v) pair (kHeadDimV < kHeadDim) has a Hopper kernel
// only: plan_bwd sends the pair's other calls to d_qk's launcher (level 1).
template <typename Element, int kHeadDim, int kHeadDimV = kHeadDim>
void run_flash_bwd(const BwdParams& params, const BwdPlan& plan, cudaStream_t stream) {
  using Traits = BwdTraitsFor<BwdTileConfig<kHeadDim>, kHeadDim, Element>;
  if (plan.kernel == BwdKernel::kNone) return;
  int block_n = Traits::kBlockN;  // the grid's key blocks
  if constexpr (BwdTileConfigLargeSmem<kHeadDim>::kExists) {
    if (plan.kernel == BwdKernel::kSm80LargeSmem) {
      block_n = BwdTileConfigLargeSmem<kHeadDim>::kBlockN;
    }
  }
  if (plan.block_n != block_n || plan.num_splits != params.num_splits) {
    throw std::runtime_error("flash_attn_cuda: the backward plan disagrees with the params");
  }
  if (plan.head_dim != kHeadDim || plan.head_dim_v != kHeadDimV) {
    throw std::runtime_error(
        "flash_attn_cuda: the backward plan names another compiled (head dim, head dim v) than "
        "this launcher's: " +
        describe(plan));
  }

  // D = rowsum(dO * O) over d_v columns, its lanes sized by the compiled d_v.
  constexpr int kDotRows = dot_rows_per_block<kHeadDimV>();
  const dim3 dot_grid = grid_over_heads_batch((params.seqlen_q + kDotRows - 1) / kDotRows,
                                              params.nheads, params.batch);
  flash_bwd_dot_do_o_kernel<Element, kHeadDimV><<<dot_grid, kBwdAuxThreads, 0, stream>>>(params);
  FA_CUDA_CHECK(cudaGetLastError());

  const dim3 grid = grid_over_heads_batch(plan.grid_x, params.nheads, params.batch);
  if (plan.kernel == BwdKernel::kSm90) {
    if constexpr (has_sm90_backward<kHeadDim, kHeadDimV>()) {
      using Sm90Traits = BwdSm90TraitsFor<Element, kHeadDim, false, kHeadDimV>;
      static_assert(
          Traits::kBlockM % Sm90Traits::kBlockM == 0 && Sm90Traits::kBlockN == Traits::kBlockN,
          "the table's block shape sizes the accumulators and the grid");
      using Sm90OrderedTraits = BwdSm90TraitsFor<Element, kHeadDim, true, kHeadDimV>;
      static_assert(Sm90OrderedTraits::kSmemSize ==
                            bwd_sm90_smem_bytes(kHeadDim, kHeadDimV, Sm90Traits::kBlockM,
                                                Sm90Traits::kBlockN, kBwdSm90QdOStages) &&
                        Sm90Traits::kSmemSize <= Sm90OrderedTraits::kSmemSize &&
                        Sm90OrderedTraits::kSmemSize <= kSm90SmemPerBlock,
                    "plan.h sizes the Hopper backward's shared memory as its largest variant's");
      // Softcap, ALiBi and dropout (where the tile draws it,
      // bwd_sm90_draws_dropout) run the Hopper kernel's variant with them;
      // other scales do not.
      // Ordered dQ (deterministic, plan.ordered_dq) is a variant of the
      // plain kernel.
      // Dropout where the table's tile does not draw it runs a tile of its
      // own (bwd_sm90_dropout_block_m), whose MMA partitions lay out the dQ
      // accumulator, so its conversion too.
      using Sm90DropoutTraits = BwdSm90DropoutTraitsFor<Element, kHeadDim, kHeadDimV>;
      static_assert(Traits::kBlockM % Sm90DropoutTraits::kBlockM == 0 &&
                        Sm90DropoutTraits::kBlockN == Traits::kBlockN &&
                        Sm90DropoutTraits::kSmemSize <= kSm90SmemPerBlock,
                    "the table's block shape sizes the accumulators and the grid");
      if constexpr (Sm90DropoutTraits::kBlockM != Sm90Traits::kBlockM) {
        if (plan.variant == FwdVariant::kScoreMods && plan.block_m == Sm90DropoutTraits::kBlockM) {
          launch_bwd_sm90_main<Sm90DropoutTraits, true>(params, plan, grid, stream);
          run_flash_bwd_convert<Sm90DropoutTraits>(params, stream);
          return;
        }
      }
      if (plan.variant == FwdVariant::kScoreMods) {
        launch_bwd_sm90_main<Sm90Traits, true>(params, plan, grid, stream);
      } else if (plan.ordered_dq) {
        launch_bwd_sm90_main<Sm90OrderedTraits, false, true>(params, plan, grid, stream);
      } else {
        launch_bwd_sm90_main<Sm90Traits, false>(params, plan, grid, stream);
      }
      run_flash_bwd_convert<Sm90Traits>(params, stream);
      return;
    } else {
      throw std::runtime_error(
          "flash_attn_cuda: the plan asks for a Hopper backward that this build lacks");
    }
  }
  if constexpr (kHeadDimV != kHeadDim) {
    throw std::runtime_error(
        "flash_attn_cuda: a specialised (head dim, head dim v) pair has the Hopper backward "
        "only: " +
        describe(plan));
  } else {
    run_flash_bwd_sm80<Element, kHeadDim>(params, plan, grid, stream);
  }
}

}  // namespace flash
