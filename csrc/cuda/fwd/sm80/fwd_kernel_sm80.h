// The FlashAttention-2 forward kernel: one thread block per (query block,
// head, batch). The Q tile stays in shared memory; K and V tiles stream
// through it; S = Q K^T and O += P V run on SM80 tensor-core MMAs; the online
// softmax keeps P in registers.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "common/mask_rule.h"
#include "cuda/core/block_info.h"
#include "cuda/core/dropout.h"
#include "cuda/core/grid_heads_batch.h"
#include "cuda/core/mask.h"
#include "cuda/core/paged_rows.h"
#include "cuda/core/params.h"
#include "cuda/core/score_mods.h"
#include "cuda/core/softmax.h"
#include "cuda/core/tile_ops.h"
#include "cuda/fwd/fwd_block_io.h"
#include "cuda/fwd/fwd_block_order.h"
#include "cuda/fwd/sm80/fwd_kernel_traits_sm80.h"

#ifndef FA_FWD_MIN_BLOCKS
#define FA_FWD_MIN_BLOCKS 1
#endif

namespace flash {

using namespace cute;

// kWithScoreExtras compiles in softcap, ALiBi and dropout. The plain variant
// (causal / local / bounds masking only) is the one training and serving hit
// most; keeping the extras out of it keeps its register allocation free of
// their live ranges.
template <typename Traits, bool kWithScoreExtras>
__global__ void __launch_bounds__(Traits::kNThreads, FA_FWD_MIN_BLOCKS)
    flash_fwd_kernel(const FwdParams params) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;

  extern __shared__ char smem[];
  HeadBatch pair;
  if (!block_head_batch(params.nheads, params.batch, pair)) return;
  const FwdBlockCoord coord = fwd_block_coord(/*causal=*/params.window_right >= 0, pair,
                                              params.nheads, params.nheads / params.nheads_k);
  const BlockInfo binfo(params, coord.batch);
  const FwdBlock block = fwd_block<kBlockM, kBlockN>(params, coord, binfo);
  if (block.rows_left <= 0) return;  // varlen: this sequence is shorter than the longest
  const int tidx = threadIdx.x;
  const int seqlen_q = binfo.seqlen_q;
  const int seqlen_k = binfo.seqlen_k;
  const int row_begin = block.row_begin;
  const int rows_left = block.rows_left;
  const int n_block_min = block.n_block_min;
  const int n_block_max = block.n_block_max;
  float* lse_rows = fwd_lse_rows(params, binfo, block);
  const auto global_tiles =
      fwd_global_tiles<Element, kBlockM, kBlockN, kHeadDim>(params, binfo, block);
  Tensor gQ = get<0>(global_tiles);  // (M, D)
  Tensor gK = get<1>(global_tiles);  // (N, D, n)
  Tensor gV = get<2>(global_tiles);  // (N, D, n)
  Tensor gO = get<3>(global_tiles);  // (M, D)

  // Identity tensors give each element's (row, col) inside a tile, for bounds.
  Tensor cQ = make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{});   // (M, D) -> (row, col)
  Tensor cKV = make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{});  // (N, D) -> (row, col)

  if (n_block_max <= n_block_min) {
    write_empty_rows<Traits>(gO, cQ, lse_rows, empty_row_lse(row_sink(params, block.head)),
                             rows_left, params.head_dim_v, tidx);
    return;
  }

  // (M, D)
  Tensor sQ =
      make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(sQ.data() + size(sQ), typename Traits::SmemLayoutKV{});  // (N, D)
  // (N, Dv): Dv a slab's columns of V (kSlabCols; the head dim with one slab)
  Tensor sV = make_tensor(sK.data() + size(sK), typename Traits::SmemLayoutV{});
  Tensor sVt = make_tensor(sV.data(), typename Traits::SmemLayoutVt{});  // (Dv, N)
  // (Dv, N)
  Tensor sVtNoSwizzle = make_tensor(sV.data().get(), typename Traits::SmemLayoutVtNoSwizzle{});
  // P V reads V through this transposed view of the same bytes.
  constexpr int kSlabCols = Traits::kSlabCols;
  static_assert(kHeadDim % kSlabCols == 0, "whole slabs of the head dim");
  CUTE_STATIC_ASSERT_V(size<0>(sVt) == Int<kSlabCols>{});
  CUTE_STATIC_ASSERT_V(size<1>(sVt) == Int<kBlockN>{});

  // Global -> shared copies (cp.async, 16 bytes per thread per access).
  typename Traits::GmemTiledCopyQKV gmem_tiled_copy_QKV;
  auto gmem_thr_copy_QKV = gmem_tiled_copy_QKV.get_thread_slice(tidx);
  Tensor tQgQ = gmem_thr_copy_QKV.partition_S(gQ);               // (CPY, CPY_M, CPY_D)
  Tensor tQsQ = gmem_thr_copy_QKV.partition_D(sQ);               // (CPY, CPY_M, CPY_D)
  Tensor tKgK = gmem_thr_copy_QKV.partition_S(gK);               // (CPY, CPY_N, CPY_D, n)
  Tensor tKsK = gmem_thr_copy_QKV.partition_D(sK);               // (CPY, CPY_N, CPY_D)
  Tensor tVsV = gmem_thr_copy_QKV.partition_D(sV);               // (CPY, CPY_N, CPY_Dv)
  Tensor tQcQ = gmem_thr_copy_QKV.partition_S(cQ);               // (CPY, CPY_M, CPY_D)
  Tensor tKVcKV = gmem_thr_copy_QKV.partition_S(cKV);            // (CPY, CPY_N, CPY_D)
  Tensor tQpQ = make_tensor<bool>(make_shape(size<2>(tQsQ)));    // (CPY_D)
  Tensor tKVpKV = make_tensor<bool>(make_shape(size<2>(tKsK)));  // (CPY_D): K's columns
  // The copies, their coordinates and predicates index one tile alike.
  CUTE_STATIC_ASSERT_V(size<1>(tKgK) == size<1>(tKsK));
  CUTE_STATIC_ASSERT_V(size<2>(tKgK) == size<2>(tKsK));
  CUTE_STATIC_ASSERT_V(size<1>(tKVcKV) == size<1>(tKsK));
  CUTE_STATIC_ASSERT_V(size<1>(tQcQ) == size<1>(tQsQ));
  make_col_predicate(tQpQ, tQcQ, params.head_dim);
  make_col_predicate(tKVpKV, tKVcKV, params.head_dim);
  const bool full_head_dim = params.head_dim == kHeadDim;
  // Key block n of K or V (x_cols columns, of predicate tXpX) into shared
  // memory: a tile of the (seqlen_k, x_cols) view, or paged keys row by row
  // through the block table, read in place (rows past seqlen_k are
  // zero-filled, never read). Whole tiles need no predication: every key
  // block but a ragged last one, when the tensor fills the compiled width.
  // (x_ptr, x_cols: the tensor's first column of the tile and its columns
  // from there; tXcX the tile's coordinates.)
  auto copy_kv_tile = [&](const auto& tXgX, auto& tXsX, const auto& tXcX, const auto& tXpX,
                          bool x_full_width, int x_cols, const void* x_ptr, const QKVStrides& s,
                          int n) {
    if (params.block_table == nullptr) {
      copy_tile_predicated(gmem_tiled_copy_QKV, tXgX(_, _, _, n), tXsX, tXcX, tXpX,
                           seqlen_k - n * kBlockN, x_full_width && (n + 1) * kBlockN <= seqlen_k);
      return;
    }
    const Element* x_head =
        static_cast<const Element*>(x_ptr) + int64_t(block.head_kv) * s.head_stride;
    copy_rows_async(tXsX, tXcX, seqlen_k - n * kBlockN, x_cols, x_head, [&](int row) {
      return x_head + paged_key_offset(params, block.batch, n * kBlockN + row, s);
    });
  };
  auto copy_k_tile = [&](int n) {
    copy_kv_tile(tKgK, tKsK, tKVcKV, tKVpKV, full_head_dim, params.head_dim, params.k_ptr, params.k,
                 n);
  };

  // MMA partitions: S = Q K^T is (M, N); O = P V is (M, Dv), a slab's columns.
  typename Traits::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(tidx);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);             // (MMA, MMA_M, MMA_D)
  Tensor tSrK = thr_mma.partition_fragment_B(sK);             // (MMA, MMA_N, MMA_D)
  Tensor tOrVt = thr_mma.partition_fragment_B(sVtNoSwizzle);  // (MMA, MMA_Dv, MMA_N)
  CUTE_STATIC_ASSERT_V(size<2>(tSrQ) == size<2>(tSrK));       // MMA_D of Q K^T

  // Shared -> register copies (ldmatrix; transposed for V).
  auto smem_tiled_copy_Q = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_copy_Q = smem_tiled_copy_Q.get_thread_slice(tidx);
  Tensor tSsQ = smem_thr_copy_Q.partition_S(sQ);  // (CPY, CPY_M, CPY_D)
  auto smem_tiled_copy_K = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_copy_K = smem_tiled_copy_K.get_thread_slice(tidx);
  Tensor tSsK = smem_thr_copy_K.partition_S(sK);  // (CPY, CPY_N, CPY_D)
  auto smem_tiled_copy_V = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, tiled_mma);
  auto smem_thr_copy_V = smem_tiled_copy_V.get_thread_slice(tidx);
  Tensor tOsVt = smem_thr_copy_V.partition_S(sVt);  // (CPY, CPY_Dv, CPY_N)

  // (row, col) of each score element this thread holds, as a (rows, cols) view.
  Tensor cS = make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{});  // (M, N) -> (row, col)
  Tensor tScS = thr_mma.partition_C(cS);                                  // (MMA, MMA_M, MMA_N)
  // ((2, MMA_M), (2, MMA_N))
  Tensor tScS_rowcol = make_tensor(tScS.data(), acc_layout_as_rowcol(tScS.layout()));

  // Scores go through scale/softcap/ALiBi in natural units when any of those
  // is on; otherwise the scale is folded into the exp2 multiplier for free.
  const float alibi_slope =
      !kWithScoreExtras || params.alibi_slopes == nullptr
          ? 0.f
          : params.alibi_slopes[block.batch * params.alibi_batch_stride + block.head];
  const bool has_alibi = kWithScoreExtras && params.alibi_slopes != nullptr;
  const bool prescale_scores =
      kWithScoreExtras && (softcap_on(params.softcap) || has_alibi ||
                           !scale_is_positive_normal(params.softmax_scale_log2));
  const float exp_scale_log2 = prescale_scores ? float(M_LOG2E) : params.softmax_scale_log2;
  const float lse_scale = prescale_scores ? 1.f : params.softmax_scale;
  const bool has_dropout = kWithScoreExtras && params.dropout_p > 0.f;
  DropoutState dropout{};
  if (has_dropout) dropout = dropout_state_of(params, block.batch, block.head);

  // One pass per slab of V's columns (one pass up to d256): each recomputes
  // S and the softmax at the full head dim, the same in every pass, and
  // accumulates its slab of O. A loop the compiler unrolls, as the
  // backward's (bwd_kernel_sm80.h: a lambda per slab went to local memory).
  constexpr bool kStageOverK =
      cosize_v<typename Traits::SmemLayoutOSlab> <= cosize_v<typename Traits::SmemLayoutKV>;
  CUTE_UNROLL
  for (int slab = 0; slab < Traits::kSlabs; ++slab) {
    if constexpr (Traits::kSlabs > 1) {
      if (slab * kSlabCols >= params.head_dim_v) break;  // V has no columns left
      __syncthreads();                                   // the last pass is done with its staged O
    }
    // V's tiles and O's: the slab's columns of the (N, D, n) and (M, D) tiles.
    auto slab_of = [&](const auto& tile) {
      if constexpr (Traits::kSlabs == 1) {
        return tile;
      } else {
        return make_tensor(tile.data() + slab * kSlabCols,
                           make_layout(replace<1>(tile.shape(), Int<kSlabCols>{}), tile.stride()));
      }
    };
    Tensor gVs = slab_of(gV);                          // (N, Dv, n)
    Tensor gOs = slab_of(gO);                          // (M, Dv)
    Tensor tVgV = gmem_thr_copy_QKV.partition_S(gVs);  // (CPY, CPY_N, CPY_Dv, n)
    // (CPY, CPY_N, CPY_Dv) -> (row, col): K's with one slab
    auto tVcV = [&] {
      if constexpr (Traits::kSlabs == 1) {
        return tKVcKV;
      } else {
        return gmem_thr_copy_QKV.partition_S(
            make_identity_tensor(Shape<Int<kBlockN>, Int<kSlabCols>>{}));
      }
    }();
    Tensor tVpV = make_tensor<bool>(make_shape(size<2>(tVsV)));  // (CPY_Dv): V's columns
    CUTE_STATIC_ASSERT_V(size<2>(tVgV) == size<2>(tVsV));
    // V's columns from head_dim_v on are zero-filled: O's columns there are
    // never stored, and zeros keep them finite.
    const int cols_v = params.head_dim_v - slab * kSlabCols;
    make_col_predicate(tVpV, tVcV, cols_v);
    const bool full_cols_v =
        Traits::kSlabs == 1 ? params.head_dim_v == kHeadDim : cols_v >= kSlabCols;
    auto copy_v_tile = [&](int n) {
      copy_kv_tile(tVgV, tVsV, tVcV, tVpV, full_cols_v, cols_v,
                   static_cast<const Element*>(params.v_ptr) + slab * kSlabCols, params.v, n);
    };

    // (MMA, MMA_M, MMA_Dv)
    Tensor acc_o = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kSlabCols>>{});
    clear(acc_o);
    CUTE_STATIC_ASSERT_V(size<1>(tOrVt) == size<2>(acc_o));  // MMA_Dv of P V
    // ((2, MMA_M), (2, MMA_Dv))
    Tensor acc_o_rowcol = make_tensor(acc_o.data(), acc_layout_as_rowcol(acc_o.layout()));
    // The softmax rescales the rows of O by the rows of S.
    CUTE_STATIC_ASSERT_V(size<0>(tScS_rowcol) == size<0>(acc_o_rowcol));
    constexpr int kNRows = decltype(size<0>(acc_o_rowcol))::value;

    // Prologue: Q (in the first pass, or in each where the last one staged
    // its O over Q) and the last visible K block in flight together. Key
    // blocks run from high to low so that a causal mask's diagonal block, the
    // one that needs per-element masking, comes first.
    int n_block = n_block_max - 1;
    if (slab == 0 || !kStageOverK) {
      copy_tile_predicated(gmem_tiled_copy_QKV, tQgQ, tQsQ, tQcQ, tQpQ, rows_left,
                           full_head_dim && rows_left >= kBlockM);
    }
    copy_k_tile(n_block);
    cute::cp_async_fence();

    OnlineSoftmax<kNRows> softmax;

    for (; n_block >= n_block_min; --n_block) {
      // (MMA, MMA_M, MMA_N)
      Tensor acc_s = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
      clear(acc_s);
      // K(n) has landed, and every warp is done reading V(n+1): V(n) may overwrite it.
      cute::cp_async_wait<0>();
      __syncthreads();
      copy_v_tile(n_block);
      cute::cp_async_fence();

      gemm_smem_smem(acc_s, tSrQ, tSrK, tSsQ, tSsK, tiled_mma, smem_tiled_copy_Q, smem_tiled_copy_K,
                     smem_thr_copy_Q, smem_thr_copy_K);

      // ((2, MMA_M), (2, MMA_N))
      Tensor scores = make_tensor(acc_s.data(), acc_layout_as_rowcol(acc_s.layout()));
      const int col_base = n_block * kBlockN;
      if (prescale_scores) {
        apply_scale_and_softcap(scores, params.softmax_scale, params.softcap);
        if (has_alibi) {
          apply_alibi(scores, tScS_rowcol, row_begin, col_base, alibi_slope, seqlen_q, seqlen_k);
        }
      }
      if (!key_tile_fully_visible(row_begin, row_begin + kBlockM, col_base, col_base + kBlockN,
                                  seqlen_q, seqlen_k, params.window_left, params.window_right)) {
        apply_mask(scores, tScS_rowcol, row_begin, col_base, seqlen_q, seqlen_k, params.window_left,
                   params.window_right);
      }

      // V(n) has landed and every warp is done reading K(n): prefetch K(n-1)
      // so it loads during the softmax and P V.
      cute::cp_async_wait<0>();
      __syncthreads();
      if (n_block > n_block_min) {
        copy_k_tile(n_block - 1);
        cute::cp_async_fence();
      }

      softmax.template update</*kSkipUnmovedRescale=*/true>(scores, acc_o_rowcol, exp_scale_log2);
      if (has_dropout) apply_dropout(scores, tScS_rowcol, row_begin, col_base, dropout);

      Tensor rP = convert_type<Element>(acc_s);  // (MMA, MMA_M, MMA_N)
      // (MMA, MMA_M, MMA_N / 2): A of P V
      Tensor tOrP = make_tensor(rP.data(), acc_layout_as_operand_a(rP.layout()));
      gemm_reg_smem(acc_o, tOrP, tOrVt, tOsVt, tiled_mma, smem_tiled_copy_V, smem_thr_copy_V);
    }

    float lse[kNRows];
    softmax.finalize(acc_o_rowcol, lse_scale, has_dropout ? params.dropout_rescale : 1.f, lse,
                     row_sink(params, block.head));

    // O staged over Q with one slab. With more, a slab's O over K's tile where
    // it fits (the next pass reloads K and finds Q in place), else over Q,
    // which the next pass reloads (128 x 32 tiles). Every pass writes the
    // same lse.
    if constexpr (Traits::kSlabs == 1) {
      Tensor sO = make_tensor(sQ.data(), typename Traits::SmemLayoutO{});  // (M, D)
      write_output<Traits>(
          acc_o, tiled_mma, thr_mma, sO, gOs,
          [](auto layout) { return acc_layout_as_rowcol(layout); }, lse, lse_rows, rows_left,
          params.head_dim_v, tidx);
    } else {
      static_assert(
          cosize_v<typename Traits::SmemLayoutOSlab> <= cosize_v<typename Traits::SmemLayoutQ>,
          "a slab's O tile fits Q's");
      // (M, Dv)
      Tensor sO =
          make_tensor(kStageOverK ? sK.data() : sQ.data(), typename Traits::SmemLayoutOSlab{});
      write_output<Traits>(
          acc_o, tiled_mma, thr_mma, sO, gOs,
          [](auto layout) { return acc_layout_as_rowcol(layout); }, lse, lse_rows, rows_left,
          cols_v, tidx);
    }
  }
}

}  // namespace flash
