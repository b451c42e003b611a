// Host side of fwd_kvcache's attention: the split-KV kernel over the cache,
// then (num_splits > 1) the combine kernel, for one (dtype, compiled head dim).
// The append / rotary step runs before this (append_rotary_launch.h), or in
// the split-KV kernel (plan.append_in_attention). The plan (plan_decode,
// plan.h) picked the variant, split count, grid, clusters and shared memory;
// the op copied the fields the kernels read into the params.
#pragma once

#include <stdexcept>
#include <string>

#include <cuda_runtime.h>

#include "cuda/core/cuda_check.h"
#include "cuda/core/params.h"
#include "cuda/decode/splitkv_combine.h"
#include "cuda/decode/splitkv_kernel.h"
#include "cuda/decode/splitkv_kernel_traits.h"
#include "cuda/decode/splitkv_tile_config.h"
#include "cuda/launch/dependent_launch.h"
#include "cuda/launch/plan.h"

namespace flash {

// CacheElement: Element, or cutlass::float_e4m3_t for an e4m3 cache, whose
// kernels are the plain ones of one block per item (V read in the K tile too)
// and the score-extras one: no persistent grid and no in-kernel append (the
// plan picks neither for it).
template <typename Element, int kHeadDim, int kWarpsN, typename CacheElement = Element>
void launch_flash_fwd_splitkv(const KvcacheParams& params, const DecodePlan& plan,
                              cudaStream_t stream) {
  using Traits = SplitKvKernelTraits<kHeadDim, splitkv_block_n(kHeadDim), kWarpsN, kSplitKvWarps,
                                     Element, false, CacheElement>;
  constexpr bool kFp8 = Traits::kCacheFp8;
  const int rows_total = params.seqlen_q * (params.nheads / params.nheads_k);
  const int num_m_blocks = (rows_total + Traits::kBlockM - 1) / Traits::kBlockM;
  if (num_m_blocks == 0 || params.batch == 0 || params.nheads == 0) return;
  // Work items (splitkv_work_item.h) on x, which has no 65535 limit; the host
  // checked that they fit an int. plan.grid_blocks < num_items launches the
  // persistent grid, each block running several items.
  const int64_t num_items =
      int64_t(params.batch) * params.nheads_k * num_m_blocks * params.num_splits;
  const bool several_items = plan.grid_blocks < num_items;
  const dim3 grid(static_cast<unsigned>(several_items ? plan.grid_blocks : num_items));
  const bool with_score_extras = score_features_of(params).has_extras();
  // Only the decode variant's plain kernel has one instance per cache layout
  // (it carries the decode benchmarks; a contiguous cache skips the paged
  // path's per-row addressing: PERF_LOG 2026-11-23 47fdf30, 9ba5ee6), and over
  // a contiguous cache a persistent one (splitkv_grid_blocks); the others
  // serve both layouts with a block per item (six split-KV kernels per file).
  const bool varlen = params.cu_seqlens_q != nullptr || params.cu_seqlens_k_new != nullptr ||
                      params.cu_seqlens_k != nullptr;
  if (several_items &&
      (kWarpsN == 1 || with_score_extras || params.block_table != nullptr || varlen)) {
    throw std::runtime_error(
        "flash_attn_cuda: fwd_kvcache: a persistent split-KV grid needs the decode variant's "
        "plain kernel over a contiguous cache, in a fixed-length call");
  }
  // The append / rotary in the kernel (plan.append_in_attention) has
  // instances for the decode variant's plain kernels of one block per item.
  // Its table rows and new rows assume one query block (row 0 on).
  if (plan.append_in_attention != params.append_in_attention ||
      plan.num_splits != params.num_splits) {
    throw std::runtime_error(
        "flash_attn_cuda: fwd_kvcache: the params disagree with the decode plan");
  }
  if (plan.append_in_attention &&
      (several_items || kWarpsN == 1 || with_score_extras || num_m_blocks != 1 || varlen)) {
    throw std::runtime_error(
        "flash_attn_cuda: fwd_kvcache: only the decode variant's plain kernel with a block per "
        "item and one query block of a fixed-length call appends itself "
        "(plan.append_in_attention must be false)");
  }
  if (kFp8 && (several_items || plan.append_in_attention)) {
    throw std::runtime_error(
        "flash_attn_cuda: fwd_kvcache: an e4m3 cache has the kernels of one block per item, "
        "without the in-kernel append");
  }
  // A block of several items keeps its Q slots and merge bytes beside the
  // tiles: more than any block may hold at d512, where plan_decode never
  // picks the persistent grid (splitkv_grid_blocks).
  constexpr bool kPersistentFits =
      !kFp8 && kWarpsN > 1 && splitkv_smem_bytes(kHeadDim, kWarpsN, true) <= kSm90SmemPerBlock;
  if constexpr (!kPersistentFits) {
    if (several_items) {
      throw std::runtime_error(
          "flash_attn_cuda: fwd_kvcache: no persistent split-KV kernel at head dim " +
          std::to_string(kHeadDim));
    }
  }
  LaunchOptions options;
  options.programmatic = plan.programmatic_launch;
  options.cluster_x = plan.cluster_x;
  // V read in the K tile (plan.v_in_k, splitkv_reads_v_in_k): the plain
  // kernel of one block per item, its stages K tiles alone.
  if (plan.v_in_k) {
    if constexpr (splitkv_reads_v_in_k(kHeadDim) && kWarpsN > 1) {
      using VInKTraits = SplitKvKernelTraits<kHeadDim, splitkv_block_n(kHeadDim), kWarpsN,
                                             kSplitKvWarps, Element, true, CacheElement>;
      constexpr int kVInKSmem = VInKTraits::kSmemSize;
      static_assert(kVInKSmem == splitkv_smem_bytes(kHeadDim, kWarpsN, false, true, kFp8));
      if (with_score_extras || plan.append_in_attention || several_items ||
          plan.launch_smem != kVInKSmem) {
        throw std::runtime_error(
            "flash_attn_cuda: fwd_kvcache: V read in the K tile has the plain kernel of one "
            "block per item only, launched with its own shared memory");
      }
      const auto kernel =
          params.block_table != nullptr
              ? &flash_fwd_splitkv_kernel<VInKTraits, false, CacheLayout::kPaged, false>
              : &flash_fwd_splitkv_kernel<VInKTraits, false, CacheLayout::kContiguous, false>;
      launch_ex(kernel, grid, dim3(VInKTraits::kNThreads), kVInKSmem, stream, options, params);
      return;
    } else {
      throw std::runtime_error(
          "flash_attn_cuda: fwd_kvcache: no kernel reads V in the K tile at head dim " +
          std::to_string(kHeadDim));
    }
  }
  auto plain_kernel = [&] {
    if constexpr (kWarpsN > 1) {
      if constexpr (!kFp8) {
        if (plan.append_in_attention) {
          return params.block_table != nullptr
                     ? &flash_fwd_splitkv_kernel<Traits, false, CacheLayout::kPaged, false, true>
                     : &flash_fwd_splitkv_kernel<Traits, false, CacheLayout::kContiguous, false,
                                                 true>;
        }
      }
      if constexpr (kPersistentFits) {
        if (several_items) {
          return &flash_fwd_splitkv_kernel<Traits, false, CacheLayout::kContiguous, true>;
        }
      }
      return params.block_table != nullptr
                 ? &flash_fwd_splitkv_kernel<Traits, false, CacheLayout::kPaged, false>
                 : &flash_fwd_splitkv_kernel<Traits, false, CacheLayout::kContiguous, false>;
    } else {
      return &flash_fwd_splitkv_kernel<Traits, false, CacheLayout::kEither, false>;
    }
  };
  const auto kernel = with_score_extras
                          ? &flash_fwd_splitkv_kernel<Traits, true, CacheLayout::kEither, false>
                          : plain_kernel();
  constexpr int kSmemSize = Traits::kSmemSize;
  static_assert(kSmemSize == splitkv_smem_bytes(kHeadDim, kWarpsN, false, false, kFp8) &&
                    sizeof(Element) == 2,
                "host code sizes the grid from splitkv_smem_bytes");
  const int kernel_smem =
      plan.append_in_attention ? splitkv_append_smem_bytes(kHeadDim, kWarpsN) : kSmemSize;
  const int smem_bytes = several_items
                             ? splitkv_smem_bytes(kHeadDim, kWarpsN, true)
                             : (plan.launch_smem > kernel_smem ? plan.launch_smem : kernel_smem);
  launch_ex(kernel, grid, dim3(Traits::kNThreads), smem_bytes, stream, options, params);
}

// The plan picked the variant (plan.warps_n, splitkv_warps_n_for) and sized
// the split count for it.
template <typename Element, int kHeadDim, typename CacheElement = Element>
void run_flash_fwd_splitkv(const KvcacheParams& params, const DecodePlan& plan,
                           cudaStream_t stream) {
  constexpr int kDecodeWarpsN = splitkv_decode_warps_n(kHeadDim);
  // d512 has the decode variant only (splitkv_warps_n_for).
  constexpr bool kHasRowsVariant = splitkv_warps_v(kHeadDim) == 1;
  if (plan.warps_n == kDecodeWarpsN) {
    launch_flash_fwd_splitkv<Element, kHeadDim, kDecodeWarpsN, CacheElement>(params, plan, stream);
  } else if (kHasRowsVariant && plan.warps_n == 1) {
    if constexpr (kHasRowsVariant)
      launch_flash_fwd_splitkv<Element, kHeadDim, 1, CacheElement>(params, plan, stream);
  } else {
    throw std::runtime_error("flash_attn_cuda: fwd_kvcache: no split-KV kernel variant with " +
                             std::to_string(plan.warps_n) + " warps along the keys");
  }
  if (plan.num_splits > 1) {
    // The combine walks the partial rows (batch, nheads, seqlen_q) of the
    // output; a varlen q's (nheads, total_q) are those of one batch entry of
    // total_q rows (its out has batch stride 0).
    const int64_t rows = params.cu_seqlens_q != nullptr
                             ? int64_t(params.nheads) * params.total_q
                             : int64_t(params.batch) * params.nheads * params.seqlen_q;
    if (rows > 0x7fffffff) {
      throw std::runtime_error(
          "flash_attn_cuda: fwd_kvcache: batch * nheads * seqlen_q exceeds 2^31 - 1 rows");
    }
    if (rows == 0) return;
    LaunchOptions options;
    options.programmatic = plan.programmatic_launch;
    // A block per sequence after the rows runs the paged keys' index check.
    const int64_t blocks = rows + (params.combine_checks_paged_keys ? params.batch : 0);
    // The partial results are as wide as the value dim (splitkv_head_dim_v).
    launch_ex(&splitkv_combine_kernel<Element, splitkv_head_dim_v(kHeadDim)>,
              dim3(static_cast<unsigned>(blocks)), dim3(kCombineThreads), 0, stream, options,
              params);
  }
}

}  // namespace flash
