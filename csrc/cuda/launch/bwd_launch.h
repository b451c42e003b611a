// Host side of the backward pass for one (dtype, compiled head dim): the
// D = rowsum(dO * O) kernel, the main dQ/dK/dV kernel, the dQ conversion and,
// under GQA, the dK/dV conversion from the kv heads' sums (or, deterministic,
// the group reduction of the per-head shares), all on one stream. The caller
// (flash_api_cuda.cpp) allocates and zeroes the accumulators. On sm90 the
// score rule without dropout runs the Hopper main kernel
// (bwd_kernel_sm90.h) at the head dims the tile table gives it; the conversion kernels then read
// the accumulators in its fragment order.
#pragma once

#include <cuda_runtime.h>

#include <limits>

#include "cuda/bwd/bwd_aux_kernels.h"
#include "cuda/bwd/bwd_tile_config.h"
#include "cuda/bwd/sm80/bwd_kernel_sm80.h"
#include "cuda/bwd/sm80/bwd_kernel_traits_sm80.h"
#include "cuda/bwd/sm90/bwd_kernel_sm90.h"
#include "cuda/core/cuda_check.h"
#include "cuda/core/grid_heads_batch.h"
#include "cuda/core/params.h"
#include "cuda/launch/dependent_launch.h"

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
template <int kHeadDim>
constexpr bool has_sm90_backward() {
#if defined(FLASH_ATTN_HAS_SM90A)
  return BwdTileConfig<kHeadDim>::kBlockMSm90 > 0;
#else
  return false;
#endif
}

template <typename Element, int kHeadDim>
using BwdSm90TraitsFor =
    BwdSm90KernelTraits<kHeadDim, BwdTileConfig<kHeadDim>::kBlockMSm90,
                        BwdTileConfig<kHeadDim>::kBlockN, Element, kBwdSm90QdOStages>;

// The steps after the main kernel: dQ from its accumulator and, under GQA,
// dK / dV from the kv heads' sums or shares. MainTraits is the main kernel's:
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

  // GQA/MQA: the main kernel's epilogue picks the same way (sums, or shares
  // when deterministic).
  if (params.nheads != params.nheads_k && !params.deterministic) {
    const int num_n_blocks = (params.seqlen_k + MainTraits::kBlockN - 1) / MainTraits::kBlockN;
    const dim3 dkv_grid = grid_over_heads_batch(num_n_blocks, params.nheads_k, params.batch);
    flash_bwd_convert_dkv_kernel<MainTraits>
        <<<dkv_grid, MainTraits::kNThreads, 0, stream>>>(params);
    FA_CUDA_CHECK(cudaGetLastError());
  } else if (params.nheads != params.nheads_k) {
    const dim3 dkv_grid =
        grid_over_heads_batch((params.seqlen_k + kConvertRowsPerBlock - 1) / kConvertRowsPerBlock,
                              params.nheads_k, params.batch);
    flash_bwd_reduce_dkv_kernel<Element, kHeadDim><<<dkv_grid, kBwdAuxThreads, 0, stream>>>(params);
    FA_CUDA_CHECK(cudaGetLastError());
  }
}

// Launches the Hopper main kernel if it takes this call: inputs TMA can
// describe, on a device with the shared memory for it (else the SM80 kernel
// runs the call, as in the forward). Returns whether it launched.
template <typename Element, int kHeadDim, bool kWithScoreMods>
bool launch_bwd_sm90_main(const BwdParams& params, dim3 grid, cudaStream_t stream) {
  using Sm90Traits = BwdSm90TraitsFor<Element, kHeadDim>;
  if (params.smem_per_block_optin < Sm90Traits::kSmemSize ||
      !BwdSm90Tma<Sm90Traits>::can_load(params)) {
    return false;
  }
  launch_with_dynamic_smem(&flash_bwd_sm90_kernel<Sm90Traits, kWithScoreMods>, grid,
                           dim3(Sm90Traits::kNLaunchThreads), Sm90Traits::kSmemSize, stream, params,
                           BwdSm90Tma<Sm90Traits>::make(params));
  return true;
}

template <typename Element, int kHeadDim>
void run_flash_bwd(const BwdParams& params, cudaStream_t stream) {
  using Traits = BwdTraitsFor<BwdTileConfig<kHeadDim>, kHeadDim, Element>;
  if (params.batch == 0 || params.nheads == 0 || params.seqlen_q == 0 || params.seqlen_k == 0) {
    return;
  }

  constexpr int kDotRows = dot_rows_per_block<kHeadDim>();
  const dim3 dot_grid = grid_over_heads_batch((params.seqlen_q + kDotRows - 1) / kDotRows,
                                              params.nheads, params.batch);
  flash_bwd_dot_do_o_kernel<Element, kHeadDim><<<dot_grid, kBwdAuxThreads, 0, stream>>>(params);
  FA_CUDA_CHECK(cudaGetLastError());

  const int num_n_blocks = (params.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN;
  const dim3 grid = grid_over_heads_batch(params.deterministic ? params.num_splits : num_n_blocks,
                                          params.nheads, params.batch);
  // The plain kernels also assume a positive, normal softmax scale
  // (scale_is_positive_normal); any other scale takes the general kernel,
  // which tests for a masked score.
  const bool scale_positive_normal = scale_is_positive_normal(params.softmax_scale_log2);
  const bool with_score_mods = params.softcap > 0.f || params.alibi_slopes != nullptr;
  const bool with_dropout = params.dropout_p > 0.f;
  const bool with_score_extras = with_score_mods || with_dropout || !scale_positive_normal;
  if constexpr (has_sm90_backward<kHeadDim>()) {
    using Sm90Traits = BwdSm90TraitsFor<Element, kHeadDim>;
    static_assert(
        Traits::kBlockM % Sm90Traits::kBlockM == 0 && Sm90Traits::kBlockN == Traits::kBlockN,
        "the table's block shape sizes the accumulators and the grid");
    // Softcap and ALiBi run the Hopper kernel's variant with them; dropout
    // (only the SM80 kernels draw its keep mask) and other scales do not.
    if (params.bwd_kernel != KernelChoice::kSm80 && !with_dropout && scale_positive_normal &&
        (with_score_mods ? launch_bwd_sm90_main<Element, kHeadDim, true>(params, grid, stream)
                         : launch_bwd_sm90_main<Element, kHeadDim, false>(params, grid, stream))) {
      run_flash_bwd_convert<Sm90Traits>(params, stream);
      return;
    }
  }
  if (with_score_extras) {
    launch_bwd_dq_dk_dv<Traits, true>(params, grid, stream);
  } else if constexpr (BwdTileConfigLargeSmem<kHeadDim>::kExists) {
    using LargeTraits = BwdTraitsFor<BwdTileConfigLargeSmem<kHeadDim>, kHeadDim, Element>;
    static_assert(LargeTraits::kBlockN == Traits::kBlockN, "one grid for both tiles");
    static_assert(LargeTraits::kBlockM == Traits::kBlockM &&
                      LargeTraits::kNWarps == Traits::kNWarps &&
                      LargeTraits::kAtomLayoutMdQ == Traits::kAtomLayoutMdQ,
                  "one dQ accumulator layout for both tiles (bwd_accum_layout.h)");
    static_assert(LargeTraits::kAtomLayoutNdKV == Traits::kAtomLayoutNdKV,
                  "one dK / dV sum layout for both tiles (bwd_accum_layout.h)");
    if (params.smem_per_block_optin >= LargeTraits::kSmemSize) {
      launch_bwd_dq_dk_dv<LargeTraits, false>(params, grid, stream);
    } else {
      launch_bwd_dq_dk_dv<Traits, false>(params, grid, stream);
    }
  } else {
    launch_bwd_dq_dk_dv<Traits, false>(params, grid, stream);
  }
  run_flash_bwd_convert<Traits>(params, stream);
}

}  // namespace flash
