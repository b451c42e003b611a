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

namespace flash {

constexpr int kCombineWarps = 4;

template <typename Element, int kHeadDim>
__global__ void __launch_bounds__(kCombineWarps * 32)
    splitkv_combine_kernel(const KvcacheParams params) {
  const int lane = threadIdx.x % 32;
  const int64_t row = int64_t(blockIdx.x) * kCombineWarps + threadIdx.x / 32;
  const int64_t rows_per_split = int64_t(params.batch) * params.nheads * params.seqlen_q;
  if (row >= rows_per_split) return;
  const int i = static_cast<int>(row % params.seqlen_q);
  const int head = static_cast<int>((row / params.seqlen_q) % params.nheads);
  const int batch = static_cast<int>(row / (int64_t(params.seqlen_q) * params.nheads));
  const int num_splits = params.num_splits;
  const float* lse_accum = params.lse_accum_ptr + row;

  float max_lse = -INFINITY;
  for (int s = lane; s < num_splits; s += 32) max_lse = fmaxf(max_lse, lse_accum[s * rows_per_split]);
  CUTE_UNROLL
  for (int offset = 16; offset > 0; offset /= 2) {
    max_lse = fmaxf(max_lse, __shfl_xor_sync(0xffffffff, max_lse, offset));
  }
  const bool empty = max_lse == -INFINITY;
  float sum = 0.f;
  if (!empty) {
    for (int s = lane; s < num_splits; s += 32) sum += expf(lse_accum[s * rows_per_split] - max_lse);
  }
  CUTE_UNROLL
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffff, sum, offset);
  const float lse = empty ? INFINITY : max_lse + logf(sum);
  if (lane == 0) params.softmax_lse_ptr[row] = lse;

  Element* out_row = static_cast<Element*>(params.o_ptr) + batch * params.o.batch_stride +
                     int64_t(i) * params.o.row_stride + int64_t(head) * params.o.head_stride;
  const int64_t split_stride = rows_per_split * kHeadDim;
  const float* accum_row = params.out_accum_ptr + row * kHeadDim;
  cutlass::NumericArrayConverter<Element, float, 4> converter;
  // Each lane owns 4 consecutive columns; head_dim is a multiple of 8.
  for (int col = lane * 4; col < params.head_dim; col += 128) {
    cutlass::Array<float, 4> acc;
    acc.fill(0.f);
    if (!empty) {
      for (int s = 0; s < num_splits; ++s) {
        const float lse_s = lse_accum[s * rows_per_split];
        if (lse_s == -INFINITY) continue;
        const float weight = expf(lse_s - lse);
        const float4 o = *reinterpret_cast<const float4*>(accum_row + s * split_stride + col);
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
