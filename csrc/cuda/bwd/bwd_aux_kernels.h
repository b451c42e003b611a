// The small memory-bound kernels around the backward main kernel:
//   before: D = rowsum(dO * O) in fp32, per query row;
//   after:  dQ = scale * (sum of the dQ accumulator slices), cast to the input
//           dtype; under GQA, dK and dV of a kv head cast from its fp32 sums
//           (both templated on the main kernel's traits, whose partitions are
//           the accumulators' layout).
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "cuda/bwd/bwd_accum_layout.h"
#include "cuda/core/block_info.h"
#include "cuda/core/grid_heads_batch.h"
#include "cuda/core/params.h"

namespace flash {

using namespace cute;

constexpr int kBwdAuxThreads = 256;

// D = rowsum(dO * O): a row is split over kDotLanesPerRow lanes of 16-byte
// pieces, the largest power of two the compiled head dim fills, so that a warp
// reads several short rows at once (with one row per warp, half the lanes of
// a d128 warp and three quarters of a d64 one sat idle, well below the copy
// bandwidth: PERF_LOG 2026-11-24 c611237).
template <int kHeadDim>
constexpr int dot_lanes_per_row() {
  int lanes = 1;
  while (lanes * 2 <= 32 && lanes * 2 * 8 <= kHeadDim) lanes *= 2;
  return lanes;
}
// Rows per thread: each thread first loads its pieces of kDotRowsPerThread
// rows, then sums them, so that as many 16-byte loads per thread are in
// flight. At one row per thread each block made one load of O and one of dO
// per thread and left, and the kernel read at 70% of DRAM bandwidth (ncu,
// d128 causal 8k, PERF_LOG 2026-11-29, "ncu beside FA4").
constexpr int kDotRowsPerThread = 4;
template <int kHeadDim>
constexpr int dot_rows_per_block() {
  return kDotRowsPerThread * (kBwdAuxThreads / dot_lanes_per_row<kHeadDim>());
}

// Grid: (ceil(seqlen_q / dot_rows_per_block), (head, batch) pairs); the
// pairs of grid_heads_batch.h, here and in the kernels below. Thread t
// takes rows r * (threads / lanes per row) + t / lanes per row of its block.
template <typename Element, int kHeadDim>
__global__ void __launch_bounds__(kBwdAuxThreads)
    flash_bwd_dot_do_o_kernel(const BwdParams params) {
  constexpr int kLanesPerRow = dot_lanes_per_row<kHeadDim>();
  constexpr int kRowStep = kBwdAuxThreads / kLanesPerRow;
  // 8 elements (16 bytes) per lane per piece; rows start 16-byte aligned and
  // O's and dO's head dim, head_dim_v, is a multiple of 8.
  constexpr int kVec = 8;
  constexpr int kPieces = (kHeadDim + kLanesPerRow * kVec - 1) / (kLanesPerRow * kVec);
  HeadBatch pair;
  if (!block_head_batch(params.nheads, params.batch, pair)) return;
  const int head = pair.head;
  const int batch = pair.batch;
  const BlockInfo binfo(params, batch);
  const int first_row = blockIdx.x * dot_rows_per_block<kHeadDim>() + threadIdx.x / kLanesPerRow;
  const int lane = threadIdx.x % kLanesPerRow;
  const Element* o =
      static_cast<const Element*>(params.o_ptr) + binfo.q_offset(params.o, batch, head);
  const Element* dout =
      static_cast<const Element*>(params.do_ptr) + binfo.q_offset(params.dout, batch, head);
  uint4 o_bits[kDotRowsPerThread][kPieces];
  uint4 do_bits[kDotRowsPerThread][kPieces];
  CUTE_UNROLL
  for (int r = 0; r < kDotRowsPerThread; ++r) {
    const int row = first_row + r * kRowStep;
    CUTE_UNROLL
    for (int k = 0; k < kPieces; ++k) {
      const int col = (k * kLanesPerRow + lane) * kVec;
      const bool in_bounds = row < binfo.seqlen_q && col < params.head_dim_v;
      o_bits[r][k] =
          in_bounds ? *reinterpret_cast<const uint4*>(o + int64_t(row) * params.o.row_stride + col)
                    : make_uint4(0, 0, 0, 0);
      do_bits[r][k] =
          in_bounds
              ? *reinterpret_cast<const uint4*>(dout + int64_t(row) * params.dout.row_stride + col)
              : make_uint4(0, 0, 0, 0);
    }
  }
  // No early return: every lane of a row group takes part in the shuffles.
  CUTE_UNROLL
  for (int r = 0; r < kDotRowsPerThread; ++r) {
    float dot = 0.f;
    CUTE_UNROLL
    for (int k = 0; k < kPieces; ++k) {
      const Element* o_vals = reinterpret_cast<const Element*>(&o_bits[r][k]);
      const Element* do_vals = reinterpret_cast<const Element*>(&do_bits[r][k]);
      CUTE_UNROLL
      for (int i = 0; i < kVec; ++i) {
        dot += static_cast<float>(o_vals[i]) * static_cast<float>(do_vals[i]);
      }
    }
    CUTE_UNROLL
    for (int mask = kLanesPerRow / 2; mask > 0; mask >>= 1) {
      dot += __shfl_xor_sync(0xffffffff, dot, mask);
    }
    const int row = first_row + r * kRowStep;
    if (row < binfo.seqlen_q && lane == 0) {
      params.softmax_d_ptr[binfo.lse_offset(params, batch, head) + row] = dot;
    }
  }
}

// One block of a fragment-ordered fp32 accumulator (bwd_accum_layout.h) to the
// output dtype: thread t of the block reads back the values that thread t of
// the main kernel's TiledMma added, whole reductions' worth at a time (every
// warp load contiguous), sums num_slices slices slice_stride apart, scales,
// and the rows go through shared memory to leave as 16-byte row pieces (rows
// below `rows`, columns below head_dim). accum_thread is the block's start
// plus accum_thread_offset(tidx).
template <typename TiledMma, int kRows, int kHeadDim, int kChunkCols, typename Element>
__forceinline__ __device__ void store_accum_block(const float* accum_thread, int num_slices,
                                                  int64_t slice_stride, float scale, Element* out,
                                                  int64_t out_row_stride, int rows, int head_dim) {
  constexpr int kNThreads = decltype(size(TiledMma{}))::value;
  const int tidx = threadIdx.x;
  // Rows of the block, padded by 16 bytes so that the fragment writes (eight
  // rows by four column pairs per warp) and the 16-byte row reads both hit
  // every bank once. A block whose rows exceed a block's 48 KiB of static
  // shared memory (d512's 64-key dK / dV blocks) goes through it in groups of
  // columns, a chunk each.
  constexpr int kPad = 16 / int(sizeof(Element));
  constexpr bool kWhole = kRows * (kHeadDim + kPad) * int(sizeof(Element)) <= 48 * 1024;
  constexpr int kGroupCols = kWhole ? kHeadDim : kChunkCols;
  constexpr int kChunksPerGroup = kGroupCols / kChunkCols;
  constexpr int kRowPitch = kGroupCols + kPad;
  __shared__ alignas(16) char smem[kRows * kRowPitch * sizeof(Element)];
  Element* tile = reinterpret_cast<Element*>(smem);

  TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(tidx);
  // (MMA, MMA_M, MMA_N) -> (row, col)
  Tensor tCcC = thr_mma.partition_C(make_identity_tensor(Shape<Int<kRows>, Int<kChunkCols>>{}));
  constexpr int kValues = decltype(size(tCcC))::value;
  static_assert(kValues % kAccumVec == 0);
  CUTE_UNROLL
  for (int group = 0; group < kHeadDim / kGroupCols; ++group) {
    CUTE_UNROLL
    for (int group_chunk = 0; group_chunk < kChunksPerGroup; ++group_chunk) {
      const int chunk = group * kChunksPerGroup + group_chunk;
      const float* chunk_accum =
          accum_thread + accum_tile_offset<kRows, kHeadDim, kChunkCols>(0, chunk);
      // A slice's loads of the whole chunk first, then the sums: every load of
      // a slice is in flight at once. Summed per value over a slice loop around
      // each load, they went out one at a time, and the kernel read at 59% of
      // DRAM bandwidth against FA4's postprocess at 81% (PERF_LOG 2026-11-29,
      // "ncu beside FA4"). The same sums in the same slice order.
      float sum[kValues] = {};
      for (int slice = 0; slice < num_slices; ++slice) {
        if constexpr (kAccumVec == 4) {
          float4 v[kValues / 4];
          CUTE_UNROLL
          for (int g = 0; g < kValues / 4; ++g) {
            v[g] = *reinterpret_cast<const float4*>(
                chunk_accum + accum_value_offset<kNThreads>(4 * g) + slice * slice_stride);
          }
          CUTE_UNROLL
          for (int g = 0; g < kValues / 4; ++g) {
            sum[4 * g] += v[g].x;
            sum[4 * g + 1] += v[g].y;
            sum[4 * g + 2] += v[g].z;
            sum[4 * g + 3] += v[g].w;
          }
        } else {
          float v[kValues];
          CUTE_UNROLL
          for (int i = 0; i < kValues; ++i) {
            v[i] = chunk_accum[accum_value_offset<kNThreads>(i) + slice * slice_stride];
          }
          CUTE_UNROLL
          for (int i = 0; i < kValues; ++i) sum[i] += v[i];
        }
      }
      CUTE_UNROLL
      for (int i = 0; i < kValues; ++i) {
        const int row = get<0>(tCcC(i));
        const int col = group_chunk * kChunkCols + get<1>(tCcC(i));
        tile[row * kRowPitch + col] = static_cast<Element>(sum[i] * scale);
      }
    }
    __syncthreads();

    constexpr int kVec = 16 / int(sizeof(Element));
    constexpr int kPiecesPerRow = kGroupCols / kVec;
    for (int piece = tidx; piece < kRows * kPiecesPerRow; piece += kNThreads) {
      const int row = piece / kPiecesPerRow;
      const int col = (piece % kPiecesPerRow) * kVec;
      if (row < rows && group * kGroupCols + col < head_dim) {
        *reinterpret_cast<uint4*>(out + row * out_row_stride + group * kGroupCols + col) =
            *reinterpret_cast<const uint4*>(tile + row * kRowPitch + col);
      }
    }
    __syncthreads();  // the tile may be written again by the next group or call
  }
}

// Grid: (query blocks of the main kernel's kBlockM rows, (head, batch)), with
// the main kernel's thread count: dQ = scale * (sum of the accumulator's
// slices), from its dQ partition.
template <typename Traits>
__global__ void __launch_bounds__(Traits::kNThreads)
    flash_bwd_convert_dq_kernel(const BwdParams params) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kHeadDim = Traits::kHeadDim;
  const int m_block = blockIdx.x;
  HeadBatch pair;
  if (!block_head_batch(params.nheads, params.batch, pair)) return;
  const int head = pair.head;
  const int batch = pair.batch;
  const BlockInfo binfo(params, batch);
  const int row_begin = m_block * kBlockM;
  if (row_begin >= binfo.seqlen_q) return;
  const float* accum_thread =
      params.dq_accum_ptr + dq_accum_offset<kBlockM, kHeadDim>(params, binfo, batch, head) +
      accum_tile_offset<kBlockM, kHeadDim, kHeadDim>(m_block, 0) + accum_thread_offset(threadIdx.x);
  Element* dq = static_cast<Element*>(params.dq_ptr) + binfo.q_offset(params.dq, batch, head) +
                int64_t(row_begin) * params.dq.row_stride;
  store_accum_block<typename Traits::TiledMmadQ, kBlockM, kHeadDim, Traits::kDQChunkCols>(
      accum_thread, params.num_splits, params.dq_accum_split_stride, params.softmax_scale, dq,
      params.dq.row_stride, min(kBlockM, binfo.seqlen_q - row_begin), params.head_dim);
}

// Grid: (key blocks of the main kernel's kBlockN rows, (kv head, batch)), with
// the main kernel's thread count: GQA/MQA dK and dV from the kv heads' fp32
// sums (non-deterministic mode), from the main kernel's dK / dV partition.
template <typename Traits>
__global__ void __launch_bounds__(Traits::kNThreads)
    flash_bwd_convert_dkv_kernel(const BwdParams params) {
  using Element = typename Traits::Element;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  const int n_block = blockIdx.x;
  HeadBatch pair;
  if (!block_head_batch(params.nheads_k, params.batch, pair)) return;
  const int head_kv = pair.head;
  const int batch = pair.batch;
  const BlockInfo binfo(params, batch);
  const int row_begin = n_block * kBlockN;
  if (row_begin >= binfo.seqlen_k) return;
  // A key block's sums, in chunks of kDKVChunkCols columns (the SM80
  // kernel's head-dim slabs; one chunk otherwise).
  constexpr int kChunkCols = Traits::kDKVChunkCols;
  const int64_t sum_offset = dkv_sum_offset<kBlockN, kHeadDim>(params, binfo, batch, head_kv) +
                             accum_tile_offset<kBlockN, kHeadDim, kChunkCols>(n_block, 0) +
                             accum_thread_offset(threadIdx.x);
  const int rows = min(kBlockN, binfo.seqlen_k - row_begin);
  Element* dk = static_cast<Element*>(params.dk_ptr) + binfo.k_offset(params.dk, batch, head_kv) +
                int64_t(row_begin) * params.dk.row_stride;
  Element* dv = static_cast<Element*>(params.dv_ptr) + binfo.k_offset(params.dv, batch, head_kv) +
                int64_t(row_begin) * params.dv.row_stride;
  using TiledMma = typename Traits::TiledMmadKV;
  // dK carries the softmax scale already (the main kernel applies it).
  store_accum_block<TiledMma, kBlockN, kHeadDim, kChunkCols>(
      params.dk_sum_ptr + sum_offset, 1, 0, 1.f, dk, params.dk.row_stride, rows, params.head_dim);
  // dV's sums are rows of kHeadDimV columns where d_v has its own width
  // (store_dk_dv_pair).
  constexpr int kHeadDimV = Traits::kHeadDimV;
  const int64_t dv_sum_offset =
      kHeadDimV == kHeadDim ? sum_offset
                            : dkv_sum_offset<kBlockN, kHeadDimV>(params, binfo, batch, head_kv) +
                                  accum_tile_offset<kBlockN, kHeadDimV, kHeadDimV>(n_block, 0) +
                                  accum_thread_offset(threadIdx.x);
  store_accum_block<typename Traits::TiledMmadV, kBlockN, kHeadDimV,
                    kHeadDimV == kHeadDim ? kChunkCols : kHeadDimV>(
      params.dv_sum_ptr + dv_sum_offset, 1, 0, 1.f, dv, params.dv.row_stride, rows,
      params.head_dim_v);
}

}  // namespace flash
