// Merge of the split-KV partial results. Split s left, per query row, an fp32
// output O_s normalised over its own keys and its lse_s (-inf when it saw no
// key); the row's result is sum_s exp(lse_s - lse) O_s with
// lse = log sum_s exp(lse_s). One warp per (batch, head, query row).
#pragma once

#include <cmath>

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

#include "params.h"
#include "splitkv_tile_config.h"

namespace flash {

constexpr int kCombineWarps = 4;

template <typename Element, int kHeadDim>
__global__ void __launch_bounds__(kCombineWarps * 32)
    splitkv_combine_kernel(const KvcacheParams params) {
  static_assert(kMaxKvSplits % 32 == 0, "each lane holds whole split slots");
  constexpr int kSplitsPerLane = kMaxKvSplits / 32;
  // Per warp: the weight exp(lse_s - lse) of each split, so that the output
  // loop below has only independent loads left (a dependent load per split
  // would cost one memory latency per split).
  __shared__ float split_weight[kCombineWarps][kMaxKvSplits];
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t row = int64_t(blockIdx.x) * kCombineWarps + warp;
  const int64_t rows_per_split = int64_t(params.batch) * params.nheads * params.seqlen_q;
  if (row >= rows_per_split) return;
  const int i = static_cast<int>(row % params.seqlen_q);
  const int head = static_cast<int>((row / params.seqlen_q) % params.nheads);
  const int batch = static_cast<int>(row / (int64_t(params.seqlen_q) * params.nheads));
  const int num_splits = params.num_splits;
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
  const bool empty = max_lse == -INFINITY;
  float sum = 0.f;
  CUTE_UNROLL
  for (int j = 0; j < kSplitsPerLane; ++j) {
    if (!empty && lse_split[j] != -INFINITY) sum += expf(lse_split[j] - max_lse);
  }
  CUTE_UNROLL
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffff, sum, offset);
  const float lse = empty ? INFINITY : max_lse + logf(sum);
  if (lane == 0) params.softmax_lse_ptr[row] = lse;
  CUTE_UNROLL
  for (int j = 0; j < kSplitsPerLane; ++j) {
    const int s = lane + 32 * j;
    if (s < num_splits) {
      split_weight[warp][s] =
          empty || lse_split[j] == -INFINITY ? 0.f : expf(lse_split[j] - lse);
    }
  }
  __syncwarp();

  Element* out_row = static_cast<Element*>(params.o_ptr) + batch * params.o.batch_stride +
                     int64_t(i) * params.o.row_stride + int64_t(head) * params.o.head_stride;
  const int64_t split_stride = rows_per_split * kHeadDim;
  const float* accum_row = params.out_accum_ptr + row * kHeadDim;
  cutlass::NumericArrayConverter<Element, float, 4> converter;
  // Each lane owns 4 consecutive columns; head_dim is a multiple of 8.
  for (int col = lane * 4; col < params.head_dim; col += 128) {
    cutlass::Array<float, 4> acc;
    acc.fill(0.f);
#pragma unroll 8
    for (int s = 0; s < num_splits; ++s) {
      const float weight = split_weight[warp][s];
      const float4 o = *reinterpret_cast<const float4*>(accum_row + s * split_stride + col);
      // A split that saw no key weighs nothing, whatever its row holds.
      if (weight != 0.f) {
        acc[0] += weight * o.x;
        acc[1] += weight * o.y;
        acc[2] += weight * o.z;
        acc[3] += weight * o.w;
      }
    }
    *reinterpret_cast<cutlass::Array<Element, 4>*>(out_row + col) = converter(acc);
  }
}

}  // namespace flash
