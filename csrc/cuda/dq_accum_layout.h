// Where each value of the fp32 dQ accumulator lives: the one rule for the
// backward main kernel, which adds its dQ fragments into it, and for the
// conversion kernel, which reads them back.
//
// A query block's rows (kBlockM x compiled head dim) take the same stretch of
// memory as in a row-major buffer, but inside it the values are in the order
// of the main kernel's dQ fragments: per head-dim chunk (kDQChunkCols columns),
// each thread's fragment values in groups of kDQAccumVec, and for each group
// the threads of the block one after another. Why: in the row-major order an
// MMA accumulator fragment covers eight rows per warp instruction, so every
// reduction reached the L2 as eight 32-byte pieces; here a warp instruction
// covers one contiguous span (32 x 16 bytes with sm90's 4-wide reduction).
// ncu, d256 bwd on an H100: the row-major order sent 4x the L2 reduction
// requests of SDPA's FlashAttention-2 kernel, and its warps spent 10% of their
// stall samples waiting for the load/store queue (lg_throttle), against 0.04%.
//
// The conversion kernel runs the same tiled-MMA partition to learn the (row,
// column) of each value. Sequences are padded to whole query blocks, so that
// the values of a block's rows never land in the next sequence's stretch:
//   fixed length: (batch, nheads, seqlen_q rounded up to kBlockM, head dim);
//   varlen:       (nheads, total_q + batch * kBlockM, head dim), sequence b
//                 starting at row cu_seqlens_q[b] + b * kBlockM.
// Rows of the padding get zeros (their P is 0) and are never read back.
#pragma once

#include <cstdint>

#include "params.h"
#if defined(__CUDACC__)
#include "block_info.h"
#endif

namespace flash {

// Values one reduction adds: red.global.add.v4.f32 exists from sm90 on.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
constexpr int kDQAccumVec = 4;
#else
constexpr int kDQAccumVec = 1;
#endif

// Rows per head of the accumulator: seqlen_q rounded up to whole blocks, or
// for varlen total_q plus a block per sequence. Host side, for its size and
// BwdParams::dq_accum_rows_per_head.
inline int64_t dq_accum_rows_per_head(bool varlen, int64_t seqlen_q_or_total_q, int batch,
                                      int block_m) {
  return varlen ? seqlen_q_or_total_q + int64_t(batch) * block_m
                : (seqlen_q_or_total_q + block_m - 1) / block_m * block_m;
}

#if defined(__CUDACC__)

// Element offset of the first row of (batch, head).
template <int kBlockM, int kHeadDim>
__forceinline__ __device__ int64_t dq_accum_offset(const BwdParams& params,
                                                   const BlockInfo& binfo, int batch, int head) {
  const int64_t row = binfo.varlen ? int64_t(head) * params.dq_accum_rows_per_head +
                                         binfo.q_row_begin + int64_t(batch) * kBlockM
                                   : (int64_t(batch) * params.nheads + head) *
                                         params.dq_accum_rows_per_head;
  return row * kHeadDim;
}

// Offset of query block m_block's chunk inside (batch, head)'s rows.
template <int kBlockM, int kHeadDim, int kDQChunkCols>
__forceinline__ __device__ int64_t dq_accum_tile_offset(int m_block, int chunk) {
  return int64_t(m_block) * kBlockM * kHeadDim + chunk * kBlockM * kDQChunkCols;
}

// Offset of fragment value i of thread tidx inside a chunk: a thread's own
// pointer (tidx * kDQAccumVec) plus a compile-time offset per value.
__forceinline__ __device__ int dq_accum_thread_offset(int tidx) { return tidx * kDQAccumVec; }

template <int kNThreads>
__forceinline__ __device__ constexpr int dq_accum_value_offset(int i) {
  return (i / kDQAccumVec) * (kDQAccumVec * kNThreads) + i % kDQAccumVec;
}
#endif  // __CUDACC__

}  // namespace flash
