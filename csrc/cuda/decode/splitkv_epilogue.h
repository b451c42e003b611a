// The epilogue role of the split-KV kernel (splitkv_kernel.h): the merge of
// the warps that share query rows (one per key slab) and the store of an
// item's output, final or partial with its lse.
#pragma once

#include <cmath>
#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/array.h>

#include "cuda/core/params.h"
#include "cuda/core/softmax.h"
#include "cuda/decode/splitkv_tile_config.h"
#include "cuda/decode/splitkv_work_item.h"

namespace flash {

// Where an item's results go: what the second step of its merge needs, kept
// while a block of several items goes on to its next item.
struct SplitKvMergeTarget {
  int batch, head_kv, split, row_begin, rows_left;
  int q_row0;  // the batch entry's first row of q / out (varlen q), else 0
};

template <typename Traits, bool kSeveralItems>
struct SplitKvEpilogue {
  using Element = typename Traits::Element;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kHeadDimV = Traits::kHeadDimVTotal;  // O's columns
  static constexpr int kWarpsN = Traits::kWarpsN;
  static constexpr int kPartStride = splitkv_merge_row_floats(kHeadDim);

  const KvcacheParams& params;
  const int tidx;
  float* const o_parts;
  float2* const row_stats;
  const int group;
  const int seqlen_q;
  const float exp_scale_log2;
  const float lse_scale;
  const bool final_output;
  const int64_t rows_per_split;
  // An e4m3 cache's v_descale of the block's item (one item a block): O's
  // rows are scaled by it in the merge (docs/fp8.md).
  const float v_descale = 1.f;

  // Step 1, by each warp with rows: its output rows as they stand (not yet
  // normalised) into o_parts, at its columns from vcol0 on, and its (row max,
  // row sum) into row_stats, for its real rows; the warps of one slab that
  // hold other columns (Traits::kWarpsV) have the same statistics, which the
  // first of them writes. No barrier is needed before it.
  template <typename Softmax, typename AccORowcol, typename TScSRowcol, typename TOcORowcol>
  __device__ void write_parts(const Softmax& softmax, const AccORowcol& acc_o_rowcol,
                              const TScSRowcol& tScS_rowcol, const TOcORowcol& tOcO_rowcol,
                              int warp_row0, int vcol0, int warp_n, int warp_v, int lane,
                              int rows_left) const {
    constexpr int kNRows = decltype(cute::size<0>(acc_o_rowcol))::value;
    CUTE_UNROLL
    for (int mi = 0; mi < kNRows; ++mi) {
      const float row_sum = quad_allreduce_sum(softmax.row_sum[mi]);
      const int tile_row = warp_row0 + cute::get<0>(tScS_rowcol(mi, 0));
      if (tile_row >= rows_left) continue;
      if (lane % 4 == 0 && warp_v == 0) {
        row_stats[tile_row * kWarpsN + warp_n] = make_float2(softmax.row_max[mi], row_sum);
      }
      float* part_row = o_parts + (warp_n * kBlockM + tile_row) * kPartStride + vcol0;
      if constexpr (Traits::kFragmentsFromStage) {
        // n-blocks 2h and 2h + 1 hold the even and odd columns of slice h
        // (SplitKvMma::pv_from_stage): a thread's four values of a row there
        // are columns 16h + 4t .. 16h + 4t + 3, in the order below.
        CUTE_UNROLL
        for (int ni = 0; ni < cute::size<1>(acc_o_rowcol); ni += 4) {
          const int col = ni / 4 * 16 + 4 * (lane % 4);
          *reinterpret_cast<float4*>(part_row + col) =
              make_float4(acc_o_rowcol(mi, ni), acc_o_rowcol(mi, ni + 2), acc_o_rowcol(mi, ni + 1),
                          acc_o_rowcol(mi, ni + 3));
        }
      } else {
        CUTE_UNROLL
        for (int ni = 0; ni < cute::size<1>(acc_o_rowcol); ni += 2) {
          const int col = cute::get<1>(tOcO_rowcol(0, ni));
          *reinterpret_cast<float2*>(part_row + col) =
              make_float2(acc_o_rowcol(mi, ni), acc_o_rowcol(mi, ni + 1));
        }
      }
    }
  }

  // Step 2, by every thread: output chunks of 4 columns, each the slabs'
  // parts weighted by their share of the row's softmax over all slabs, to
  // the final output (16-bit) or to this split's fp32 partial output; the
  // thread of a row's first chunk also writes its lse.
  __device__ void combine_parts(const SplitKvMergeTarget& target) const {
    constexpr int kChunksPerRow = kHeadDimV / 4;
    CUTE_UNROLL
    for (int chunk = tidx; chunk < kBlockM * kChunksPerRow; chunk += Traits::kNThreads) {
      const int tile_row = chunk / kChunksPerRow;
      const int col = (chunk % kChunksPerRow) * 4;
      if (tile_row >= target.rows_left) break;  // the rows run in order
      if (col >= params.head_dim_v) continue;   // O's columns only
      float2 stats[kWarpsN];
      float max_all = -INFINITY;
      CUTE_UNROLL
      for (int w = 0; w < kWarpsN; ++w) {
        stats[w] = row_stats[tile_row * kWarpsN + w];
        max_all = fmaxf(max_all, stats[w].x);
      }
      const float max_scaled = scaled_row_max(max_all, exp_scale_log2);
      float sum_all = 0.f;
      CUTE_UNROLL
      for (int w = 0; w < kWarpsN; ++w) {
        stats[w].x = exp2f(stats[w].x * exp_scale_log2 - max_scaled);  // the slab's rescale
        sum_all += stats[w].x * stats[w].y;
      }
      const bool empty = row_is_empty(max_all, sum_all);
      const PackedRow packed = unpack_row(target.row_begin + tile_row, group);
      const int head = target.head_kv * group + packed.head_in_group;
      // A partial result leaves the sink to the combine kernel, which adds it
      // once per row.
      const float sink = final_output ? row_sink(params, head) : -INFINITY;
      float inv_sum = empty ? 0.f : 1.f / sum_all;
      float lse = row_lse(max_all, sum_all, lse_scale);
      if (sink != -INFINITY) {
        const RowNorm norm = row_norm_with_sink(max_all * lse_scale, sum_all, empty, sink, 1.f);
        inv_sum = norm.out_scale;
        lse = norm.lse;
      }
      float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
      CUTE_UNROLL
      for (int w = 0; w < kWarpsN; ++w) {
        float weight = stats[w].x * inv_sum;
        if constexpr (Traits::kCacheFp8) weight *= v_descale;
        const float4 part = *reinterpret_cast<const float4*>(
            o_parts + (w * kBlockM + tile_row) * kPartStride + col);
        sum.x += weight * part.x;
        sum.y += weight * part.y;
        sum.z += weight * part.z;
        sum.w += weight * part.w;
      }
      // The lse is (batch, nheads, seqlen_q), or (nheads, total_q) for a
      // varlen q, whose out has batch stride 0.
      const int64_t row_of_q = int64_t(target.q_row0) + packed.query;
      const int64_t lse_index =
          params.cu_seqlens_q != nullptr
              ? int64_t(head) * params.total_q + row_of_q
              : (int64_t(target.batch) * params.nheads + head) * seqlen_q + packed.query;
      if (final_output) {
        Element* out_row = static_cast<Element*>(params.o_ptr) +
                           target.batch * params.o.batch_stride + row_of_q * params.o.row_stride +
                           int64_t(head) * params.o.head_stride;
        cutlass::Array<Element, 4> quad;
        quad[0] = static_cast<Element>(sum.x);
        quad[1] = static_cast<Element>(sum.y);
        quad[2] = static_cast<Element>(sum.z);
        quad[3] = static_cast<Element>(sum.w);
        *reinterpret_cast<cutlass::Array<Element, 4>*>(out_row + col) = quad;
      } else {
        const int64_t partial_row = target.split * rows_per_split + lse_index;
        *reinterpret_cast<float4*>(params.out_accum_ptr + partial_row * kHeadDimV + col) = sum;
      }
      if (col == 0) {
        if (final_output) {
          params.softmax_lse_ptr[lse_index] = lse;
        } else {
          params.lse_accum_ptr[target.split * rows_per_split + lse_index] =
              lse == INFINITY ? -INFINITY : lse;
        }
      }
    }
  }
};

}  // namespace flash
