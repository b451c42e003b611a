// The kernel of flash_attn_combine: merges the partial results of each query
// row by their lse, with the rule and edge cases of
// csrc/common/lse_combine_rule.h, in fp32.
//
// A kernel of its own rather than a generalised splitkv_combine_kernel: that
// one reads fwd_kvcache's contiguous fp32 accumulators at a compiled head dim,
// adds the attention sink, runs as a programmatic dependent of the split-KV
// kernel, and spreads one row over a whole block because decode has few rows.
// This one takes any strides, any head dim, three input and three output
// dtypes, and is built for the many rows of context parallelism and cascade
// attention (batch x seqlen x heads): one warp per row. Runtime strides and
// head dim in the decode kernel would cost it registers and address math on
// the decode path, for no gain there.
//
// Grid: one block of kCombineRowsPerBlock warps per kCombineRowsPerBlock rows
// (row = (b * seqlen + s) * nheads + h). Each lane holds kMaxCombineSplits /
// 32 of the row's split lse in registers; the warp reduces max and sum with
// shuffles, writes each split's weight into its own slice of shared memory
// (no other warp touches it: __syncwarp suffices), then its lanes take the
// head dim kVec columns at a time, kLoadsInFlight splits' loads issued before
// their products.
#pragma once

#include <cmath>
#include <cstdint>

#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

#include "common/lse_combine_rule.h"
#include "cuda/decode/lse_combine_params.h"

namespace flash {

constexpr int kCombineRowsPerBlock = 4;
constexpr int kCombineBlockThreads = 32 * kCombineRowsPerBlock;

template <typename In, typename Out, int kVec>
__global__ void __launch_bounds__(kCombineBlockThreads)
    lse_combine_kernel(const LseCombineParams p) {
  static_assert(kMaxCombineSplits % 32 == 0, "each lane holds whole split slots");
  constexpr int kSplitsPerLane = kMaxCombineSplits / 32;
  constexpr int kLoadsInFlight = 4;
  using InVec = cutlass::AlignedArray<In, kVec>;
  using OutVec = cutlass::AlignedArray<Out, kVec>;
  __shared__ float split_weight[kCombineRowsPerBlock][kMaxCombineSplits];

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t row = int64_t(blockIdx.x) * kCombineRowsPerBlock + warp;
  // A whole warp leaves together; nothing below synchronises across warps.
  if (row >= p.batch * p.seqlen * p.nheads) return;
  const int64_t head = row % p.nheads;
  const int64_t token = row / p.nheads;
  const int64_t i = token % p.seqlen;
  const int64_t batch = token / p.seqlen;
  const int num_splits = p.num_splits;

  const float* lse_row =
      p.lse_partial + batch * p.lse_batch_stride + i * p.lse_row_stride + head * p.lse_head_stride;
  float split_lse[kSplitsPerLane];
  float max_lse = -INFINITY;
  bool any_nan = false;
#pragma unroll
  for (int j = 0; j < kSplitsPerLane; ++j) {
    const int s = lane + 32 * j;
    split_lse[j] = s < num_splits ? combine_split_lse(lse_row[s * p.lse_split_stride]) : -INFINITY;
    any_nan |= isnan(split_lse[j]);
    max_lse = fmaxf(max_lse, split_lse[j]);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    max_lse = fmaxf(max_lse, __shfl_xor_sync(0xffffffff, max_lse, offset));
  }
  any_nan = __any_sync(0xffffffff, any_nan);
  float sum = 0.f;
  if (max_lse != -INFINITY) {
#pragma unroll
    for (int j = 0; j < kSplitsPerLane; ++j) {
      if (split_lse[j] != -INFINITY) sum += expf(split_lse[j] - max_lse);
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    sum += __shfl_xor_sync(0xffffffff, sum, offset);
  }
  const float row_lse = combined_lse(max_lse, sum, any_nan);
  if (lane == 0) p.softmax_lse[row] = row_lse;
  float* weight = split_weight[warp];
#pragma unroll
  for (int j = 0; j < kSplitsPerLane; ++j) {
    const int s = lane + 32 * j;
    if (s < num_splits) weight[s] = combine_weight(split_lse[j], max_lse, sum, any_nan);
  }
  __syncwarp();

  const In* in_row = static_cast<const In*>(p.out_partial) + batch * p.partial_batch_stride +
                     i * p.partial_row_stride + head * p.partial_head_stride;
  Out* out_row = static_cast<Out*>(p.out) + batch * p.out_batch_stride + i * p.out_row_stride +
                 head * p.out_head_stride;
  cutlass::NumericArrayConverter<float, In, kVec> to_float;
  cutlass::NumericArrayConverter<Out, float, kVec> to_out;
  for (int col = lane * kVec; col < p.head_dim; col += 32 * kVec) {
    cutlass::Array<float, kVec> acc;
    acc.fill(0.f);
    // A split of weight 0 (empty, or underflowed) is loaded with the others
    // (the address is inside out_partial) but never multiplied: its row may
    // hold anything, NaN included.
    auto accumulate = [&](int s, const InVec& x) {
      const float w = weight[s];
      if (w != 0.f) {
        const cutlass::Array<float, kVec> xf = to_float(x);
#pragma unroll
        for (int k = 0; k < kVec; ++k) acc[k] += w * xf[k];
      }
    };
    int s = 0;
    for (; s + kLoadsInFlight <= num_splits; s += kLoadsInFlight) {
      InVec x[kLoadsInFlight];
#pragma unroll
      for (int u = 0; u < kLoadsInFlight; ++u) {
        x[u] = *reinterpret_cast<const InVec*>(in_row + (s + u) * p.partial_split_stride + col);
      }
#pragma unroll
      for (int u = 0; u < kLoadsInFlight; ++u) accumulate(s + u, x[u]);
    }
    for (; s < num_splits; ++s) {
      accumulate(s, *reinterpret_cast<const InVec*>(in_row + s * p.partial_split_stride + col));
    }
    OutVec result;
    static_cast<cutlass::Array<Out, kVec>&>(result) = to_out(acc);
    *reinterpret_cast<OutVec*>(out_row + col) = result;
  }
}

}  // namespace flash
