// Where each value of the backward's fp32 accumulators lives: the dQ
// accumulator, and under GQA (default, non-deterministic mode) the kv heads'
// dK and dV sums. One rule for the main kernel, which adds its MMA fragments
// into them, and for the conversion kernels, which read them back.
//
// A block of rows (kBlockM query rows for dQ, kBlockN key rows for dK / dV,
// by the compiled head dim) takes the same stretch of memory as in a
// row-major buffer, but inside it the values are in the order of the main
// kernel's fragments: per chunk of columns (dQ runs its GEMM in kDQChunkCols
// slices; dK / dV in one), each thread's fragment values in groups of
// kAccumVec, and for each group the threads of the block one after another.
// Why: in the row-major order an MMA accumulator fragment covers eight rows
// per warp instruction, so every reduction reached the L2 as eight 32-byte
// pieces; here a warp instruction covers one contiguous span (32 x 16 bytes
// with sm90's 4-wide reduction). The row-major order sent several times the L2
// reduction requests of SDPA's FlashAttention-2 kernel, and its warps stalled
// on the load/store queue (lg_throttle) where that kernel's did not (PERF_LOG
// 2026-11-24 dd8d476).
//
// The conversion kernels run the same tiled-MMA partition to learn the (row,
// column) of each value. Sequences are padded to whole blocks, so that the
// values of a block's rows never land in the next sequence's stretch:
//   fixed length: (batch, heads, seqlen rounded up to the block, head dim);
//   varlen:       (heads, total + batch * block rows, head dim), sequence b
//                 starting at row cu_seqlens[b] + b * block rows.
// Rows of the padding get zeros (their P is 0) and are never read back.
#pragma once

#include <cstdint>

#include "cuda/core/params.h"
#if defined(__CUDACC__)
#include "cuda/core/block_info.h"
#endif

namespace flash {

// Values one reduction adds: red.global.add.v4.f32 exists from sm90 on.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
constexpr int kAccumVec = 4;
#else
constexpr int kAccumVec = 1;
#endif

// Rows per head of an accumulator: the sequence length rounded up to whole
// blocks, or for varlen the total plus a block per sequence. Host side, for
// the sizes and BwdParams::dq_accum_rows_per_head / dkv_sum_rows_per_head.
inline int64_t accum_rows_per_head(bool varlen, int64_t seqlen_or_total, int batch,
                                   int block_rows) {
  return varlen ? seqlen_or_total + int64_t(batch) * block_rows
                : (seqlen_or_total + block_rows - 1) / block_rows * block_rows;
}

#if defined(__CUDACC__)

// Element offset of the first row of (batch, head) in an accumulator of
// `heads` heads.
template <int kBlockRows, int kHeadDim>
__forceinline__ __device__ int64_t accum_head_offset(int64_t rows_per_head, int heads, bool varlen,
                                                     int64_t varlen_row_begin, int batch,
                                                     int head) {
  const int64_t row =
      varlen ? int64_t(head) * rows_per_head + varlen_row_begin + int64_t(batch) * kBlockRows
             : (int64_t(batch) * heads + head) * rows_per_head;
  return row * kHeadDim;
}

template <int kBlockM, int kHeadDim>
__forceinline__ __device__ int64_t dq_accum_offset(const BwdParams& params, const BlockInfo& binfo,
                                                   int batch, int head) {
  return accum_head_offset<kBlockM, kHeadDim>(params.dq_accum_rows_per_head, params.nheads,
                                              binfo.varlen, binfo.q_row_begin, batch, head);
}

template <int kBlockN, int kHeadDim>
__forceinline__ __device__ int64_t dkv_sum_offset(const BwdParams& params, const BlockInfo& binfo,
                                                  int batch, int head_kv) {
  return accum_head_offset<kBlockN, kHeadDim>(params.dkv_sum_rows_per_head, params.nheads_k,
                                              binfo.varlen, binfo.k_row_begin, batch, head_kv);
}

// Offset of chunk `chunk` (of kChunkCols columns) of block `block` inside a
// head's rows.
template <int kBlockRows, int kHeadDim, int kChunkCols>
__forceinline__ __device__ int64_t accum_tile_offset(int block, int chunk) {
  return int64_t(block) * kBlockRows * kHeadDim + chunk * kBlockRows * kChunkCols;
}

// Offset of fragment value i of thread tidx inside a chunk: a thread's own
// pointer (tidx * kAccumVec) plus a compile-time offset per value.
__forceinline__ __device__ int accum_thread_offset(int tidx) { return tidx * kAccumVec; }

template <int kNThreads>
__forceinline__ __device__ constexpr int accum_value_offset(int i) {
  return (i / kAccumVec) * (kAccumVec * kNThreads) + i % kAccumVec;
}
#endif  // __CUDACC__

}  // namespace flash
