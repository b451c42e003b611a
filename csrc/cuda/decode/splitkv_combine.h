// Merge of the split-KV partial results. Split s left, per query row, an fp32
// output O_s normalised over its own keys and its lse_s (-inf when it saw no
// key); the row's result is sum_s exp(lse_s - lse) O_s with
// lse = log (exp(sink) + sum_s exp(lse_s)), the head's attention sink (if
// any) entering once, here, as a split with no value.
//
// One thread block per (batch, head, query row). Decode at small batch has
// few rows (32 for one sequence of 32 heads), so the merge of one row is
// spread over the whole block: each thread owns 4 columns, and the block's
// threads form kSplitGroups groups that take every kSplitGroups-th split.
// The partial rows of all splits are requested at once, before the lse
// reduction (they do not depend on it), so the kernel costs about two memory
// latencies whatever the split count up to kLoadsInFlight * kSplitGroups.
//
// A varlen q (params.cu_seqlens_q) is one batch entry of total_q rows per
// head. Its rows outside every sequence (before cu_seqlens_q[0], from
// cu_seqlens_q[batch] on), which no work item visits, get out 0 and lse
// +inf, the CPU's empty row, without a read of their partials: no fill of
// the partial lse ahead of the split kernel.
//
// KvcacheParams::combine_checks_paged_keys: the grid's blocks past the rows,
// one per sequence, run the varlen op's index check of paged keys
// (paged_keys_check_block.h) instead, without waiting for the split kernel.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

#include "cuda/core/dependent_grid.h"
#include "cuda/core/params.h"
#include "cuda/core/softmax.h"
#include "cuda/decode/splitkv_tile_config.h"
#include "cuda/fwd/paged_keys_check_block.h"

namespace flash {

constexpr int kCombineThreads = 128;

template <typename Element, int kHeadDim>
__global__ void __launch_bounds__(kCombineThreads)
    splitkv_combine_kernel(const KvcacheParams params) {
  static_assert(kMaxKvSplits % 32 == 0, "each lane holds whole split slots");
  static_assert(kHeadDim % 4 == 0 && kHeadDim / 4 <= kCombineThreads, "4 columns per thread");
  constexpr int kSplitsPerLane = kMaxKvSplits / 32;
  constexpr int kThreadsPerRow = kHeadDim / 4;
  constexpr int kSplitGroups = kCombineThreads / kThreadsPerRow;
  constexpr int kLoadsInFlight = 8;  // splits per thread requested together
  __shared__ float split_weight[kMaxKvSplits];
  __shared__ float4 group_sum[kSplitGroups][kThreadsPerRow];

  const int tid = threadIdx.x;
  const int group = tid / kThreadsPerRow;
  const int col = (tid % kThreadsPerRow) * 4;
  const int64_t row = blockIdx.x;
  const bool varlen = params.cu_seqlens_q != nullptr;
  // (batch, nheads, seqlen_q) rows, or (1, nheads, total_q) for a varlen q.
  const int seqlen_q = varlen ? params.total_q : params.seqlen_q;
  const int64_t rows_per_split = int64_t(varlen ? 1 : params.batch) * params.nheads * seqlen_q;
  if (row >= rows_per_split) {
    // A check block (combine_checks_paged_keys; the launcher adds them).
    check_paged_keys_of_sequence(params, static_cast<int>(row - rows_per_split));
    return;
  }
  const int i = static_cast<int>(row % seqlen_q);
  const int head = static_cast<int>((row / seqlen_q) % params.nheads);
  const int batch = static_cast<int>(row / (int64_t(seqlen_q) * params.nheads));
  // The inputs' offsets: written before the split kernel, so read before the wait.
  const bool outside =
      varlen && (i < params.cu_seqlens_q[0] || i >= params.cu_seqlens_q[params.batch]);
  const int num_splits = outside ? 0 : params.num_splits;
  // O's columns: head_dim_v is a multiple of 8, so a thread's 4 columns are
  // all in or all out; the partials hold nothing past it.
  const bool owns_columns = group < kSplitGroups && col < params.head_dim_v;
  const int64_t split_stride = rows_per_split * kHeadDim;
  const float* accum_row = params.out_accum_ptr + row * kHeadDim + col;
  wait_for_preceding_grid();

  float4 partial[kLoadsInFlight];
  CUTE_UNROLL
  for (int j = 0; j < kLoadsInFlight; ++j) {
    const int s = group + j * kSplitGroups;
    partial[j] = owns_columns && s < num_splits
                     ? *reinterpret_cast<const float4*>(accum_row + s * split_stride)
                     : make_float4(0.f, 0.f, 0.f, 0.f);
  }

  if (tid < 32) {
    const int lane = tid;
    const float sink = outside ? -INFINITY : row_sink(params, head);
    const float* lse_accum = params.lse_accum_ptr + row;
    float lse_split[kSplitsPerLane];
    float max_lse = -INFINITY;
    CUTE_UNROLL
    for (int j = 0; j < kSplitsPerLane; ++j) {
      const int s = lane + 32 * j;
      lse_split[j] = s < num_splits ? lse_accum[s * rows_per_split] : -INFINITY;
      max_lse = fmaxf(max_lse, lse_split[j]);
    }
    CUTE_UNROLL
    for (int offset = 16; offset > 0; offset /= 2) {
      max_lse = fmaxf(max_lse, __shfl_xor_sync(0xffffffff, max_lse, offset));
    }
    max_lse = fmaxf(max_lse, sink);
    const bool empty = max_lse == -INFINITY;
    float sum = lane == 0 && sink != -INFINITY ? expf(sink - max_lse) : 0.f;
    CUTE_UNROLL
    for (int j = 0; j < kSplitsPerLane; ++j) {
      if (!empty && lse_split[j] != -INFINITY) sum += expf(lse_split[j] - max_lse);
    }
    CUTE_UNROLL
    for (int offset = 16; offset > 0; offset /= 2) {
      sum += __shfl_xor_sync(0xffffffff, sum, offset);
    }
    const float lse = empty ? INFINITY : max_lse + logf(sum);
    if (lane == 0) params.softmax_lse_ptr[row] = lse;
    CUTE_UNROLL
    for (int j = 0; j < kSplitsPerLane; ++j) {
      const int s = lane + 32 * j;
      if (s < num_splits) {
        split_weight[s] = empty || lse_split[j] == -INFINITY ? 0.f : expf(lse_split[j] - lse);
      }
    }
  }
  __syncthreads();

  // A split that saw no key weighs nothing, whatever its row holds.
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  auto accumulate = [&](int s, const float4& o) {
    const float weight = split_weight[s];
    if (weight != 0.f) {
      acc.x += weight * o.x;
      acc.y += weight * o.y;
      acc.z += weight * o.z;
      acc.w += weight * o.w;
    }
  };
  if (owns_columns) {
    CUTE_UNROLL
    for (int j = 0; j < kLoadsInFlight; ++j) {
      const int s = group + j * kSplitGroups;
      if (s < num_splits) accumulate(s, partial[j]);
    }
    // More splits than one round covers (large head dims with many splits).
    for (int s = group + kLoadsInFlight * kSplitGroups; s < num_splits; s += kSplitGroups) {
      accumulate(s, *reinterpret_cast<const float4*>(accum_row + s * split_stride));
    }
  }
  if (group < kSplitGroups) group_sum[group][tid % kThreadsPerRow] = acc;
  __syncthreads();

  // The groups' sums are added in a fixed order: the result does not depend
  // on timing.
  if (group == 0 && owns_columns) {
    cutlass::Array<float, 4> total;
    total.fill(0.f);
    CUTE_UNROLL
    for (int g = 0; g < kSplitGroups; ++g) {
      const float4 part = group_sum[g][tid];
      total[0] += part.x;
      total[1] += part.y;
      total[2] += part.z;
      total[3] += part.w;
    }
    Element* out_row = static_cast<Element*>(params.o_ptr) + batch * params.o.batch_stride +
                       int64_t(i) * params.o.row_stride + int64_t(head) * params.o.head_stride;
    cutlass::NumericArrayConverter<Element, float, 4> converter;
    *reinterpret_cast<cutlass::Array<Element, 4>*>(out_row + col) = converter(total);
  }
}

}  // namespace flash
