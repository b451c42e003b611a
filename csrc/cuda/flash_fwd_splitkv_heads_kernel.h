// The split-KV decode kernel over every kv head of a key range, for long
// contiguous caches. On flash-attn's (batch, seqlen, kv head, head dim)
// cache the kv heads of one key are one span (2 KB at 8 heads x d128 bf16).
// The one-kv-head blocks of flash_fwd_splitkv_kernel.h each read a 256-byte
// piece of every span of their keys, and the blocks of one batch entry go at
// their own pace; here one block reads the whole spans of kSlabKeys keys at a
// time, 32 KB of K and 32 KB of V per tile, as it would walk a head-major
// cache. On the H200 that streamed a long cache ~0.7% faster (PERF_LOG).
//
// Work items are (batch, group of kHeads kv heads, split), numbered (batch,
// group) fastest; one block per item. Warp w owns kv head group * kHeads + w:
// its packed query rows (seqlen_q x the GQA group, at most 16, in the same
// order as flash_fwd_splitkv_kernel.h), its slab of each tile (that head's
// keys), its online softmax and its output rows. Warps share no rows, so
// nothing is merged between them; the block barriers only keep the heads'
// copies of a tile together. What the host sends here
// (splitkv_heads_kernel_fits, flash_api_cuda.cpp): a contiguous cache, no
// softcap / ALiBi, no append of its own (a pre-kernel writes new rows and a
// rotated q first).
#pragma once

#include <cmath>
#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "../common/mask_rule.h"
#include "dependent_launch.h"
#include "flash_fwd_splitkv_kernel.h"
#include "kernel_traits.h"
#include "params.h"
#include "softmax.h"
#include "splitkv_work_item.h"
#include "tile_ops.h"

namespace flash {

using namespace cute;

template <typename Traits>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    flash_fwd_splitkv_heads_kernel(const KvcacheParams params) {
  using Element = typename Traits::Element;
  constexpr int kHeads = Traits::kHeads;
  constexpr int kSlabKeys = Traits::kSlabKeys;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kStages = Traits::kStages;
  constexpr int kTileElems = Traits::kTileElems;
  constexpr int kSlabElems = Traits::kSlabElems;

  // As in flash_fwd_splitkv_kernel.h: no global read before the wait.
  wait_for_preceding_grid();
  allow_dependent_grid_launch();

  extern __shared__ char smem[];
  const int tidx = threadIdx.x;
  const int lane = tidx % 32;
  const int warp = tidx / 32;  // the warp's kv head within the block's group

  const int group = params.nheads / params.nheads_k;
  const int seqlen_q = params.seqlen_q;
  const int rows_total = seqlen_q * group;
  const int batch_groups = params.batch * (params.nheads_k / kHeads);
  SplitKvItem it;
  it.split = blockIdx.x / batch_groups;
  it.batch = (blockIdx.x % batch_groups) / (params.nheads_k / kHeads);
  it.head_kv = (blockIdx.x % batch_groups) % (params.nheads_k / kHeads) * kHeads;
  it.row_begin = 0;
  it.rows_left = rows_total;
  it.query_first = 0;
  it.query_last = seqlen_q - 1;
  splitkv_item_keys<kSlabKeys>(params, splitkv_batch_inputs(params, it.batch), true, it);
  const int seqlen_k = it.seqlen_k;

  const Element* const q_ptr = static_cast<const Element*>(params.q_ptr);
  const Element* const k_ptr = static_cast<const Element*>(params.k_ptr);
  const Element* const v_ptr = static_cast<const Element*>(params.v_ptr);

  // Shared memory: kStages (K tile, V tile) stages, then the Q tile; tile
  // row r is row r % 16 of slab (kv head) r / 16.
  Element* const kv_smem = reinterpret_cast<Element*>(smem);
  Element* const q_smem = kv_smem + 2 * kStages * kTileElems;
  auto stage_k = [&](int stage) {
    return make_tensor(make_smem_ptr(kv_smem + (2 * stage) * kTileElems),
                       typename Traits::SmemLayoutTile{});
  };
  auto stage_v = [&](int stage) {
    return make_tensor(make_smem_ptr(kv_smem + (2 * stage + 1) * kTileElems),
                       typename Traits::SmemLayoutTile{});
  };
  auto slab_k = [&](int stage) {
    return make_tensor(make_smem_ptr(kv_smem + (2 * stage) * kTileElems + warp * kSlabElems),
                       typename Traits::SmemLayoutSlab{});
  };
  auto slab_vt = [&](int stage) {
    return make_tensor(make_smem_ptr(kv_smem + (2 * stage + 1) * kTileElems + warp * kSlabElems),
                       typename Traits::SmemLayoutVtSlab{});
  };
  Tensor sQ = make_tensor(make_smem_ptr(q_smem), typename Traits::SmemLayoutTile{});
  Tensor sQ_slab =
      make_tensor(make_smem_ptr(q_smem + warp * kSlabElems), typename Traits::SmemLayoutSlab{});

  typename Traits::GmemTiledCopyQKV gmem_tiled_copy_QKV;
  auto gmem_thr_copy_QKV = gmem_tiled_copy_QKV.get_thread_slice(tidx);
  Tensor tTcT = gmem_thr_copy_QKV.partition_S(
      make_identity_tensor(Shape<Int<Traits::kTileRows>, Int<kHeadDim>>{}));
  constexpr int kCopyRows = decltype(size<1>(tTcT))::value;
  constexpr int kCopyCols = decltype(size<2>(tTcT))::value;

  // Q: slab h holds the packed rows of kv head head_kv + h; rows past
  // rows_total and columns past head_dim are zero-filled.
  auto load_q = [&] {
    Tensor tQsQ = gmem_thr_copy_QKV.partition_D(sQ);
    const Element* q_batch = q_ptr + it.batch * params.q.batch_stride;
    CUTE_UNROLL
    for (int m = 0; m < kCopyRows; ++m) {
      const int tile_row = get<0>(tTcT(0, m, 0));
      const int packed_row = tile_row % 16;
      const PackedRow packed = unpack_row(packed_row, group);
      const int head = (it.head_kv + tile_row / 16) * group + packed.head_in_group;
      const bool row_ok = packed_row < rows_total;
      const Element* q_row = row_ok ? q_batch + int64_t(packed.query) * params.q.row_stride +
                                          int64_t(head) * params.q.head_stride
                                    : q_ptr;
      CUTE_UNROLL
      for (int k = 0; k < kCopyCols; ++k) {
        const int col = get<1>(tTcT(0, m, k));
        const bool ok = row_ok && col < params.head_dim;
        cp_async_16_or_zero(&tQsQ(0, m, k), ok ? q_row + col : q_ptr, ok);
      }
    }
  };

  // K and V of key block n_block (kSlabKeys keys of every kv head of the
  // group) into one stage; keys past seqlen_k and columns past head_dim are
  // zero-filled.
  const Element* const k_group = k_ptr + int64_t(it.cache.entry) * params.k.batch_stride +
                                 int64_t(it.head_kv) * params.k.head_stride;
  const Element* const v_group = v_ptr + int64_t(it.cache.entry) * params.v.batch_stride +
                                 int64_t(it.head_kv) * params.v.head_stride;
  auto load_tile = [&](int n_block, int stage) {
    Tensor tKsK = gmem_thr_copy_QKV.partition_D(stage_k(stage));
    Tensor tVsV = gmem_thr_copy_QKV.partition_D(stage_v(stage));
    const int keys_in_tile = seqlen_k - n_block * kSlabKeys;
    const int64_t first_position = it.cache.leftpad + int64_t(n_block) * kSlabKeys;
    CUTE_UNROLL
    for (int m = 0; m < kCopyRows; ++m) {
      const int tile_row = get<0>(tTcT(0, m, 0));
      const int key = tile_row % kSlabKeys;
      const int64_t head = tile_row / kSlabKeys;
      const bool row_ok = key < keys_in_tile;
      const Element* k_row = k_group + (first_position + key) * params.k.row_stride +
                             head * params.k.head_stride;
      const Element* v_row = v_group + (first_position + key) * params.v.row_stride +
                             head * params.v.head_stride;
      CUTE_UNROLL
      for (int k = 0; k < kCopyCols; ++k) {
        const int col = get<1>(tTcT(0, m, k));
        const bool ok = row_ok && col < params.head_dim;
        cp_async_16_or_zero(&tKsK(0, m, k), k_row + col, ok);
        cp_async_16_or_zero(&tVsV(0, m, k), v_row + col, ok);
      }
    }
  };

  // The walk runs from the last key block down, as in
  // flash_fwd_splitkv_kernel.h; tile t lives in stage t % kStages and is
  // commit group t (Q joins group 0). Every step commits a group, empty or
  // not, so "all but the newest kStages - 1 groups done" always means "the
  // tile about to be computed is here".
  int load_n_block = it.n_block_max - 1;
  auto load_next_tile = [&](int stage) {
    if (load_n_block >= it.n_block_min) load_tile(load_n_block--, stage);
    cute::cp_async_fence();
  };
  load_q();
  CUTE_UNROLL
  for (int stage = 0; stage < kStages; ++stage) load_next_tile(stage);

  typename Traits::WarpMma warp_mma;
  auto thr_mma = warp_mma.get_thread_slice(lane);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ_slab);
  Tensor tSrK = thr_mma.partition_fragment_B(slab_k(0));
  Tensor tOrVt = thr_mma.partition_fragment_B(make_tensor(
      make_smem_ptr(kv_smem), typename Traits::SmemLayoutVtSlabNoSwizzle{}));
  Tensor acc_o = partition_fragment_C(warp_mma, Shape<_16, Int<kHeadDim>>{});
  auto smem_tiled_copy_Q = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, warp_mma);
  auto smem_thr_copy_Q = smem_tiled_copy_Q.get_thread_slice(lane);
  auto smem_tiled_copy_K = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, warp_mma);
  auto smem_thr_copy_K = smem_tiled_copy_K.get_thread_slice(lane);
  auto smem_tiled_copy_V = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, warp_mma);
  auto smem_thr_copy_V = smem_tiled_copy_V.get_thread_slice(lane);
  Tensor tSsQ = smem_thr_copy_Q.partition_S(sQ_slab);

  // (row, col) of each accumulator element within the warp's 16 x kSlabKeys
  // scores and 16 x kHeadDim output.
  Tensor tScS = thr_mma.partition_C(make_identity_tensor(Shape<_16, Int<kSlabKeys>>{}));
  Tensor tScS_rowcol = make_tensor(tScS.data(), acc_layout_as_rowcol(tScS.layout()));
  Tensor acc_o_rowcol = make_tensor(acc_o.data(), acc_layout_as_rowcol(acc_o.layout()));
  Tensor tOcO = thr_mma.partition_C(make_identity_tensor(Shape<_16, Int<kHeadDim>>{}));
  Tensor tOcO_rowcol = make_tensor(tOcO.data(), acc_layout_as_rowcol(tOcO.layout()));
  constexpr int kNRows = decltype(size<0>(acc_o_rowcol))::value;
  static_assert(kNRows == 2, "a thread holds two rows of the warp's 16");
  int row_query[kNRows];
  CUTE_UNROLL
  for (int mi = 0; mi < kNRows; ++mi) {
    row_query[mi] = unpack_row(get<0>(tScS_rowcol(mi, 0)), group).query;
  }

  OnlineSoftmax<kNRows> softmax;
  clear(acc_o);
  int stage = 0;
  for (int n_block = it.n_block_max - 1; n_block >= it.n_block_min; --n_block) {
    cute::cp_async_wait<kStages - 1>();
    __syncthreads();

    Tensor acc_s = partition_fragment_C(warp_mma, Shape<_16, Int<kSlabKeys>>{});
    clear(acc_s);
    Tensor tSsK = smem_thr_copy_K.partition_S(slab_k(stage));
    gemm_smem_smem(acc_s, tSrQ, tSrK, tSsQ, tSsK, warp_mma, smem_tiled_copy_Q, smem_tiled_copy_K,
                   smem_thr_copy_Q, smem_thr_copy_K);

    Tensor scores = make_tensor(acc_s.data(), acc_layout_as_rowcol(acc_s.layout()));
    const int col_base = n_block * kSlabKeys;
    if (!key_tile_fully_visible(it.query_first, it.query_last + 1, col_base,
                                col_base + kSlabKeys, seqlen_q, seqlen_k, params.window_left,
                                params.window_right)) {
      CUTE_UNROLL
      for (int mi = 0; mi < kNRows; ++mi) {
        const KeyRange visible = visible_key_range(row_query[mi], row_query[mi] + 1, seqlen_q,
                                                   seqlen_k, params.window_left,
                                                   params.window_right);
        CUTE_UNROLL
        for (int ni = 0; ni < size<1>(scores); ++ni) {
          const int key = col_base + get<1>(tScS_rowcol(0, ni));
          if (key < visible.begin || key >= visible.end) scores(mi, ni) = -INFINITY;
        }
      }
    }
    softmax.update(scores, acc_o_rowcol, params.softmax_scale_log2);

    Tensor rP = convert_type<Element>(acc_s);
    Tensor tOrP = make_tensor(rP.data(), acc_layout_as_operand_a(rP.layout()));
    Tensor tOsVt = smem_thr_copy_V.partition_S(slab_vt(stage));
    gemm_reg_smem(acc_o, tOrP, tOrVt, tOsVt, warp_mma, smem_tiled_copy_V, smem_thr_copy_V);

    // Every warp is done with this stage before it is refilled.
    __syncthreads();
    load_next_tile(stage);
    stage = stage == kStages - 1 ? 0 : stage + 1;
  }
  cute::cp_async_wait<0>();

  // Each warp's real rows, normalised by their own sum: the final output
  // (16-bit) and lse (one split), or this split's fp32 partial output and
  // lse for splitkv_combine_kernel. A row that saw no key gets output 0 and
  // lse +inf (final) or -inf (a partial that must weigh nothing).
  const bool final_output = params.num_splits == 1;
  const int64_t rows_per_split = int64_t(params.batch) * params.nheads * seqlen_q;
  CUTE_UNROLL
  for (int mi = 0; mi < kNRows; ++mi) {
    const float row_sum = quad_allreduce_sum(softmax.row_sum[mi]);
    const int packed_row = get<0>(tScS_rowcol(mi, 0));
    if (packed_row >= rows_total) continue;
    const PackedRow packed = unpack_row(packed_row, group);
    const int head = (it.head_kv + warp) * group + packed.head_in_group;
    const int64_t lse_index = (int64_t(it.batch) * params.nheads + head) * seqlen_q + packed.query;
    const float row_max = softmax.row_max[mi];
    const float inv_sum = row_is_empty(row_max, row_sum) ? 0.f : 1.f / row_sum;
    const float lse = row_lse(row_max, row_sum, params.softmax_scale);
    if (final_output) {
      Element* out_row = static_cast<Element*>(params.o_ptr) +
                         it.batch * params.o.batch_stride +
                         int64_t(packed.query) * params.o.row_stride +
                         int64_t(head) * params.o.head_stride;
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(acc_o_rowcol); ni += 2) {
        const int col = get<1>(tOcO_rowcol(0, ni));
        if (col >= params.head_dim) continue;
        cutlass::Array<Element, 2> pair;
        pair[0] = static_cast<Element>(acc_o_rowcol(mi, ni) * inv_sum);
        pair[1] = static_cast<Element>(acc_o_rowcol(mi, ni + 1) * inv_sum);
        *reinterpret_cast<cutlass::Array<Element, 2>*>(out_row + col) = pair;
      }
      if (lane % 4 == 0) params.softmax_lse_ptr[lse_index] = lse;
    } else {
      const int64_t partial_row = it.split * rows_per_split + lse_index;
      float* accum_row = params.out_accum_ptr + partial_row * kHeadDim;
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(acc_o_rowcol); ni += 2) {
        const int col = get<1>(tOcO_rowcol(0, ni));
        if (col >= params.head_dim) continue;
        *reinterpret_cast<float2*>(accum_row + col) =
            make_float2(acc_o_rowcol(mi, ni) * inv_sum, acc_o_rowcol(mi, ni + 1) * inv_sum);
      }
      if (lane % 4 == 0) params.lse_accum_ptr[partial_row] = lse == INFINITY ? -INFINITY : lse;
    }
  }
}

}  // namespace flash
