// The small memory-bound kernels around the backward main kernel:
//   before: D = rowsum(dO * O) in fp32, per query row;
//   after:  dQ = scale * (sum of the dQ accumulator slices), cast to the input
//           dtype (templated on the main kernel's traits, whose dQ partition
//           is the accumulator's layout); under GQA, dK and dV of a kv head = the sum of its query
//           heads' fp32 shares, in head order.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "block_info.h"
#include "dq_accum_layout.h"
#include "params.h"

namespace flash {

using namespace cute;

constexpr int kBwdAuxThreads = 256;
constexpr int kConvertRowsPerBlock = 16;

// D = rowsum(dO * O): a row is split over kDotLanesPerRow lanes of 16-byte
// pieces, the largest power of two the compiled head dim fills, so that a warp
// reads several short rows at once (with one row per warp, half the lanes of
// a d128 warp and three quarters of a d64 one sat idle: 65% of the copy
// bandwidth on an H100).
template <int kHeadDim>
constexpr int dot_lanes_per_row() {
  int lanes = 1;
  while (lanes * 2 <= 32 && lanes * 2 * 8 <= kHeadDim) lanes *= 2;
  return lanes;
}
template <int kHeadDim>
constexpr int dot_rows_per_block() {
  return kBwdAuxThreads / dot_lanes_per_row<kHeadDim>();
}

// Grid: (ceil(seqlen_q / dot_rows_per_block), nheads, batch).
template <typename Element, int kHeadDim>
__global__ void __launch_bounds__(kBwdAuxThreads) flash_bwd_dot_do_o_kernel(const BwdParams params) {
  constexpr int kLanesPerRow = dot_lanes_per_row<kHeadDim>();
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const BlockInfo binfo(params, batch);
  const int row = blockIdx.x * dot_rows_per_block<kHeadDim>() + threadIdx.x / kLanesPerRow;
  const int lane = threadIdx.x % kLanesPerRow;
  // No early return: every lane of a row group takes part in the shuffles.
  const bool row_in_bounds = row < binfo.seqlen_q;
  const Element* o = static_cast<const Element*>(params.o_ptr) +
                     binfo.q_offset(params.o, batch, head) + int64_t(row) * params.o.row_stride;
  const Element* dout = static_cast<const Element*>(params.do_ptr) +
                        binfo.q_offset(params.dout, batch, head) +
                        int64_t(row) * params.dout.row_stride;
  // 8 elements (16 bytes) per lane per step; rows start 16-byte aligned and
  // the head dim is a multiple of 8.
  constexpr int kVec = 8;
  float dot = 0.f;
  if (row_in_bounds) {
    for (int col = lane * kVec; col < params.head_dim; col += kLanesPerRow * kVec) {
      const uint4 o_bits = *reinterpret_cast<const uint4*>(o + col);
      const uint4 do_bits = *reinterpret_cast<const uint4*>(dout + col);
      const Element* o_vals = reinterpret_cast<const Element*>(&o_bits);
      const Element* do_vals = reinterpret_cast<const Element*>(&do_bits);
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        dot += static_cast<float>(o_vals[i]) * static_cast<float>(do_vals[i]);
      }
    }
  }
#pragma unroll
  for (int mask = kLanesPerRow / 2; mask > 0; mask >>= 1) {
    dot += __shfl_xor_sync(0xffffffff, dot, mask);
  }
  if (row_in_bounds && lane == 0) {
    params.softmax_d_ptr[binfo.lse_offset(params, batch, head) + row] = dot;
  }
}

// Grid: (query blocks of the main kernel's kBlockM rows, nheads, batch), with
// the main kernel's thread count: thread t reads back the values that thread
// t's dQ fragments added (dq_accum_layout.h), whole reductions' worth at a
// time, so every warp load is contiguous. The block's rows go through shared
// memory to leave as 16-byte row pieces.
template <typename Traits>
__global__ void __launch_bounds__(Traits::kNThreads)
    flash_bwd_convert_dq_kernel(const BwdParams params) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kNThreads = Traits::kNThreads;
  constexpr int kDQChunkCols = Traits::kDQChunkCols;
  const int m_block = blockIdx.x;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const BlockInfo binfo(params, batch);
  const int row_begin = m_block * kBlockM;
  if (row_begin >= binfo.seqlen_q) return;
  const int tidx = threadIdx.x;
  const float* accum_thread = params.dq_accum_ptr +
                              dq_accum_offset<kBlockM, kHeadDim>(params, binfo, batch, head) +
                              dq_accum_thread_offset(tidx);

  // Rows of the block, padded by 16 bytes so that the fragment writes (eight
  // rows by four column pairs per warp) and the 16-byte row reads both hit
  // every bank once.
  constexpr int kRowPitch = kHeadDim + 16 / int(sizeof(Element));
  __shared__ alignas(16) char smem[kBlockM * kRowPitch * sizeof(Element)];
  Element* tile = reinterpret_cast<Element*>(smem);

  typename Traits::TiledMmadQ tiled_mma_dq;
  auto thr_mma_dq = tiled_mma_dq.get_thread_slice(tidx);
  Tensor tdQcdQ = thr_mma_dq.partition_C(
      make_identity_tensor(Shape<Int<kBlockM>, Int<kDQChunkCols>>{}));
  constexpr int kValues = decltype(size(tdQcdQ))::value;
  static_assert(kValues % kDQAccumVec == 0);
  CUTE_UNROLL
  for (int chunk = 0; chunk < Traits::kDQChunks; ++chunk) {
    const float* chunk_accum =
        accum_thread + dq_accum_tile_offset<kBlockM, kHeadDim, kDQChunkCols>(m_block, chunk);
    CUTE_UNROLL
    for (int i = 0; i < kValues; i += kDQAccumVec) {
      float sum[kDQAccumVec] = {};
      const float* group = chunk_accum + dq_accum_value_offset<kNThreads>(i);
      for (int split = 0; split < params.num_splits; ++split) {
        const float* slice = group + split * params.dq_accum_split_stride;
        if constexpr (kDQAccumVec == 4) {
          const float4 v = *reinterpret_cast<const float4*>(slice);
          sum[0] += v.x;
          sum[1] += v.y;
          sum[2] += v.z;
          sum[3] += v.w;
        } else {
          sum[0] += *slice;
        }
      }
      CUTE_UNROLL
      for (int j = 0; j < kDQAccumVec; ++j) {
        const int row = get<0>(tdQcdQ(i + j));
        const int col = chunk * kDQChunkCols + get<1>(tdQcdQ(i + j));
        tile[row * kRowPitch + col] = static_cast<Element>(sum[j] * params.softmax_scale);
      }
    }
  }
  __syncthreads();

  constexpr int kVec = 16 / int(sizeof(Element));
  constexpr int kPiecesPerRow = kHeadDim / kVec;
  const int rows = min(kBlockM, binfo.seqlen_q - row_begin);
  Element* dq = static_cast<Element*>(params.dq_ptr) + binfo.q_offset(params.dq, batch, head) +
                int64_t(row_begin) * params.dq.row_stride;
  for (int piece = tidx; piece < kBlockM * kPiecesPerRow; piece += kNThreads) {
    const int row = piece / kPiecesPerRow;
    const int col = (piece % kPiecesPerRow) * kVec;
    if (row < rows && col < params.head_dim) {
      *reinterpret_cast<uint4*>(dq + row * params.dq.row_stride + col) =
          *reinterpret_cast<const uint4*>(tile + row * kRowPitch + col);
    }
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
