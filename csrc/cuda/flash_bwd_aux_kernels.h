// The small memory-bound kernels around the backward main kernel:
//   before: D = rowsum(dO * O) in fp32, per query row;
//   after:  dQ = scale * (sum of the dQ accumulator slices), cast to the input
//           dtype; under GQA, dK and dV of a kv head = the sum of its query
//           heads' fp32 shares, in head order.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "block_info.h"
#include "params.h"

namespace flash {

constexpr int kBwdAuxThreads = 256;
constexpr int kDotRowsPerBlock = kBwdAuxThreads / 32;  // one warp per row
constexpr int kConvertRowsPerBlock = 16;

// Grid: (ceil(seqlen_q / kDotRowsPerBlock), nheads, batch).
template <typename Element>
__global__ void __launch_bounds__(kBwdAuxThreads) flash_bwd_dot_do_o_kernel(const BwdParams params) {
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const BlockInfo binfo(params, batch);
  const int row = blockIdx.x * kDotRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= binfo.seqlen_q) return;
  const Element* o = static_cast<const Element*>(params.o_ptr) +
                     binfo.q_offset(params.o, batch, head) + row * params.o.row_stride;
  const Element* dout = static_cast<const Element*>(params.do_ptr) +
                        binfo.q_offset(params.dout, batch, head) + row * params.dout.row_stride;
  // 8 elements (16 bytes) per lane per step; rows start 16-byte aligned and
  // the head dim is a multiple of 8.
  constexpr int kVec = 8;
  float dot = 0.f;
  for (int col = lane * kVec; col < params.head_dim; col += 32 * kVec) {
    const uint4 o_bits = *reinterpret_cast<const uint4*>(o + col);
    const uint4 do_bits = *reinterpret_cast<const uint4*>(dout + col);
    const Element* o_vals = reinterpret_cast<const Element*>(&o_bits);
    const Element* do_vals = reinterpret_cast<const Element*>(&do_bits);
#pragma unroll
    for (int i = 0; i < kVec; ++i) dot += static_cast<float>(o_vals[i]) * static_cast<float>(do_vals[i]);
  }
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) dot += __shfl_xor_sync(0xffffffff, dot, mask);
  if (lane == 0) params.softmax_d_ptr[binfo.lse_offset(params, batch, head) + row] = dot;
}

// Grid: (ceil(seqlen_q / kConvertRowsPerBlock), nheads, batch).
template <typename Element, int kAccumHeadDim>
__global__ void __launch_bounds__(kBwdAuxThreads) flash_bwd_convert_dq_kernel(const BwdParams params) {
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const BlockInfo binfo(params, batch);
  const int row_begin = blockIdx.x * kConvertRowsPerBlock;
  if (row_begin >= binfo.seqlen_q) return;
  const float* accum = params.dq_accum_ptr +
                       (binfo.lse_offset(params, batch, head) + row_begin) * kAccumHeadDim;
  Element* dq = static_cast<Element*>(params.dq_ptr) + binfo.q_offset(params.dq, batch, head) +
                row_begin * params.dq.row_stride;
  const int rows = min(kConvertRowsPerBlock, binfo.seqlen_q - row_begin);
  for (int idx = threadIdx.x; idx < rows * params.head_dim; idx += kBwdAuxThreads) {
    const int r = idx / params.head_dim;
    const int c = idx - r * params.head_dim;
    const float* element = accum + r * kAccumHeadDim + c;
    float sum = 0.f;
    for (int split = 0; split < params.num_splits; ++split) {
      sum += element[split * params.dq_accum_split_stride];
    }
    dq[r * params.dq.row_stride + c] = static_cast<Element>(sum * params.softmax_scale);
  }
}

// Grid: (ceil(seqlen_k / kConvertRowsPerBlock), nheads_k, batch).
template <typename Element, int kAccumHeadDim>
__global__ void __launch_bounds__(kBwdAuxThreads) flash_bwd_reduce_dkv_kernel(const BwdParams params) {
  const int head_kv = blockIdx.y;
  const int batch = blockIdx.z;
  const BlockInfo binfo(params, batch);
  const int row_begin = blockIdx.x * kConvertRowsPerBlock;
  if (row_begin >= binfo.seqlen_k) return;
  const int group = params.nheads / params.nheads_k;
  const int64_t head_stride =
      int64_t(binfo.varlen ? params.total_k : params.seqlen_k) * kAccumHeadDim;
  const int64_t first_head = binfo.varlen
                                 ? int64_t(head_kv) * group * params.total_k + binfo.k_row_begin
                                 : (int64_t(batch) * params.nheads + int64_t(head_kv) * group) *
                                       params.seqlen_k;
  const int64_t accum_offset = (first_head + row_begin) * kAccumHeadDim;
  const float* dk_accum = params.dk_accum_ptr + accum_offset;
  const float* dv_accum = params.dv_accum_ptr + accum_offset;
  Element* dk = static_cast<Element*>(params.dk_ptr) + binfo.k_offset(params.dk, batch, head_kv) +
                row_begin * params.dk.row_stride;
  Element* dv = static_cast<Element*>(params.dv_ptr) + binfo.k_offset(params.dv, batch, head_kv) +
                row_begin * params.dv.row_stride;
  const int rows = min(kConvertRowsPerBlock, binfo.seqlen_k - row_begin);
  for (int idx = threadIdx.x; idx < rows * params.head_dim; idx += kBwdAuxThreads) {
    const int r = idx / params.head_dim;
    const int c = idx - r * params.head_dim;
    const int64_t element = int64_t(r) * kAccumHeadDim + c;
    float dk_sum = 0.f, dv_sum = 0.f;
    for (int g = 0; g < group; ++g) {
      dk_sum += dk_accum[g * head_stride + element];
      dv_sum += dv_accum[g * head_stride + element];
    }
    dk[r * params.dk.row_stride + c] = static_cast<Element>(dk_sum);
    dv[r * params.dv.row_stride + c] = static_cast<Element>(dv_sum);
  }
}

}  // namespace flash
