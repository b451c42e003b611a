// The FlashAttention-2 backward main kernel: one thread block per (key block,
// head, batch). Its K and V tiles stay in shared memory and its dK, dV stay in
// registers while it walks the query blocks that can see its keys; per query
// block it recomputes S and P, forms dS, accumulates dK and dV, and adds its
// share of dQ into an fp32 buffer with atomicAdd.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "common/mask_rule.h"
#include "cuda/bwd/bwd_accum_layout.h"
#include "cuda/bwd/bwd_block_io.h"
#include "cuda/bwd/bwd_pointwise.h"
#include "cuda/bwd/sm80/bwd_kernel_traits_sm80.h"
#include "cuda/core/block_info.h"
#include "cuda/core/dropout.h"
#include "cuda/core/grid_heads_batch.h"
#include "cuda/core/mask.h"
#include "cuda/core/params.h"
#include "cuda/core/score_mods.h"
#include "cuda/core/tile_ops.h"

namespace flash {

using namespace cute;

// kWithScoreExtras compiles in softcap, ALiBi and dropout; the plain variant
// (causal / local / bounds masking only, a positive normal softmax scale)
// leaves their live ranges out of the register allocation, which is what
// keeps it free of spills.
template <typename Traits, bool kWithScoreExtras>
__forceinline__ __device__ void compute_key_block(const BwdParams& params, const BlockInfo& binfo,
                                                  int batch, int head, int n_block, int split) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kQdOBuffers = Traits::kQdOBuffers;

  extern __shared__ char smem[];
  const int tidx = threadIdx.x;
  const int seqlen_q = binfo.seqlen_q;
  const int seqlen_k = binfo.seqlen_k;
  const BwdKeyBlock block = bwd_key_block<kBlockM, kBlockN>(params, binfo, batch, head, n_block);
  const int col_begin = block.col_begin;
  const int cols_left = block.cols_left;
  const int m_block_min = block.m_block_min;
  const int m_block_max = block.m_block_max;
  float* dq_accum_thread =
      dq_accum_thread_ptr<kBlockM, kHeadDim>(params, binfo, block, split, tidx);
  const auto global_tiles =
      bwd_global_tiles<Element, kBlockM, kBlockN, kHeadDim>(params, binfo, block);
  Tensor gQ = get<0>(global_tiles);   // (M, D, m)
  Tensor gdO = get<1>(global_tiles);  // (M, D, m)
  Tensor gK = get<2>(global_tiles);   // (N, D)
  Tensor gV = get<3>(global_tiles);   // (N, D)
  // The saved lse and D = rowsum(dO * O) share softmax_lse's layout.
  const int64_t row_stats_offset = binfo.lse_offset(params, batch, head);
  const float* lse_rows = params.softmax_lse_ptr + row_stats_offset;
  const float* d_rows = params.softmax_d_ptr + row_stats_offset;

  // Shared memory: Q and dO (one or two buffers each), K, V, P, dS.
  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)),
                          typename Traits::SmemLayoutQdO{});               // (M, D)
  Tensor sQt = make_tensor(sQ.data(), typename Traits::SmemLayoutQdOt{});  // (D, M)
  // (D, M)
  Tensor sQtNoSwizzle = make_tensor(sQ.data().get(), typename Traits::SmemLayoutQdOtNoSwizzle{});
  // (M, D)
  Tensor sdO = make_tensor(sQ.data() + kQdOBuffers * size(sQ), typename Traits::SmemLayoutQdO{});
  Tensor sdOt = make_tensor(sdO.data(), typename Traits::SmemLayoutQdOt{});  // (D, M)
  // (D, M)
  Tensor sdOtNoSwizzle = make_tensor(sdO.data().get(), typename Traits::SmemLayoutQdOtNoSwizzle{});
  // (N, D)
  Tensor sK = make_tensor(sdO.data() + kQdOBuffers * size(sdO), typename Traits::SmemLayoutKV{});
  Tensor sKt = make_tensor(sK.data(), typename Traits::SmemLayoutKt{});  // (D, N)
  // (D, N)
  Tensor sKtNoSwizzle = make_tensor(sK.data().get(), typename Traits::SmemLayoutKtNoSwizzle{});
  Tensor sV = make_tensor(sK.data() + size(sK), typename Traits::SmemLayoutKV{});   // (N, D)
  Tensor sP = make_tensor(sV.data() + size(sV), typename Traits::SmemLayoutPdS{});  // (M, N)
  Tensor sPt = make_tensor(sP.data(), typename Traits::SmemLayoutPdSt{});           // (N, M)
  // (N, M)
  Tensor sPtNoSwizzle = make_tensor(sP.data().get(), typename Traits::SmemLayoutPdStNoSwizzle{});
  Tensor sdS = make_tensor(sP.data() + size(sP), typename Traits::SmemLayoutPdS{});  // (M, N)
  Tensor sdSt = make_tensor(sdS.data(), typename Traits::SmemLayoutPdSt{});          // (N, M)
  // (N, M)
  Tensor sdStNoSwizzle = make_tensor(sdS.data().get(), typename Traits::SmemLayoutPdStNoSwizzle{});
  // Offset of the second Q / dO buffer; a whole number of swizzle periods, so
  // a partition of buffer 0 moved by it is a partition of buffer 1.
  constexpr int kQdOBufferElems = kBlockM * kHeadDim;
  // Per Q / dO buffer, the saved lse (kBlockM floats) then D of its rows.
  // They travel with Q and dO; lse is read after the S GEMM, D after the dP
  // GEMM. Loaded into registers at the top of the loop they lived across both
  // GEMMs, and at head dim 64 were spilled (PERF_LOG 2026-11-22 80906c6).
  float* smem_row_stats = reinterpret_cast<float*>(raw_pointer_cast(sdS.data() + size(sdS)));

  // Global -> shared copies.
  typename Traits::GmemTiledCopyLoad gmem_tiled_copy;
  auto gmem_thr_copy = gmem_tiled_copy.get_thread_slice(tidx);
  Tensor tQgQ = gmem_thr_copy.partition_S(gQ);                             // (CPY, CPY_M, CPY_D, m)
  Tensor tQsQ = gmem_thr_copy.partition_D(sQ);                             // (CPY, CPY_M, CPY_D)
  Tensor tdOgdO = gmem_thr_copy.partition_S(gdO);                          // (CPY, CPY_M, CPY_D, m)
  Tensor tdOsdO = gmem_thr_copy.partition_D(sdO);                          // (CPY, CPY_M, CPY_D)
  Tensor tKgK = gmem_thr_copy.partition_S(gK);                             // (CPY, CPY_N, CPY_D)
  Tensor tKsK = gmem_thr_copy.partition_D(sK);                             // (CPY, CPY_N, CPY_D)
  Tensor tVgV = gmem_thr_copy.partition_S(gV);                             // (CPY, CPY_N, CPY_D)
  Tensor tVsV = gmem_thr_copy.partition_D(sV);                             // (CPY, CPY_N, CPY_D)
  Tensor cQ = make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{});  // (M, D) -> (row, col)
  Tensor cKV = make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{});  // (N, D) -> (row, col)
  Tensor tQcQ = gmem_thr_copy.partition_S(cQ);                              // (CPY, CPY_M, CPY_D)
  Tensor tKVcKV = gmem_thr_copy.partition_S(cKV);                           // (CPY, CPY_N, CPY_D)
  Tensor tQpQ = make_tensor<bool>(make_shape(size<2>(tQsQ)));               // (CPY_D)
  Tensor tKVpKV = make_tensor<bool>(make_shape(size<2>(tKsK)));             // (CPY_D)
  make_col_predicate(tQpQ, tQcQ, params.head_dim);
  make_col_predicate(tKVpKV, tKVcKV, params.head_dim);
  // dO and V are read with Q's and K's predicates, at head_dim columns: for
  // d_v < d_qk the op pads them (BwdPlan::pad_v), since predicates of their
  // own spilled this kernel (it is at its register limit).
  // Whole tiles inside the tensors (all but the last block of a sequence whose
  // length is not a tile multiple) take the branch-free copy.
  const bool head_dim_is_full = params.head_dim == kHeadDim;

  auto load_q_do = [&](int m_block, int buffer) {
    // (CPY, CPY_M, CPY_D)
    Tensor tQsQ_buf = make_tensor(tQsQ.data() + buffer * kQdOBufferElems, tQsQ.layout());
    // (CPY, CPY_M, CPY_D)
    Tensor tdOsdO_buf = make_tensor(tdOsdO.data() + buffer * kQdOBufferElems, tdOsdO.layout());
    const int rows_left = seqlen_q - m_block * kBlockM;
    const bool all_in_bounds = head_dim_is_full && rows_left >= kBlockM;
    copy_tile_predicated(gmem_tiled_copy, tQgQ(_, _, _, m_block), tQsQ_buf, tQcQ, tQpQ, rows_left,
                         all_in_bounds);
    copy_tile_predicated(gmem_tiled_copy, tdOgdO(_, _, _, m_block), tdOsdO_buf, tQcQ, tQpQ,
                         rows_left, all_in_bounds);
    load_row_stats<kBlockM>(lse_rows + m_block * kBlockM, d_rows + m_block * kBlockM, rows_left,
                            smem_row_stats + buffer * 2 * kBlockM, tidx);
  };

  // S = Q K^T and dP = dO V^T.
  typename Traits::TiledMmaSdP tiled_mma_sdp;
  auto thr_mma_sdp = tiled_mma_sdp.get_thread_slice(tidx);
  Tensor tSrQ = thr_mma_sdp.partition_fragment_A(sQ);       // (MMA, MMA_M, MMA_D)
  Tensor tSrK = thr_mma_sdp.partition_fragment_B(sK);       // (MMA, MMA_N, MMA_D)
  Tensor tdPrdO = thr_mma_sdp.partition_fragment_A(sdO);    // (MMA, MMA_M, MMA_D)
  Tensor tdPrV = thr_mma_sdp.partition_fragment_B(sV);      // (MMA, MMA_N, MMA_D)
  CUTE_STATIC_ASSERT_V(size<2>(tSrQ) == size<2>(tSrK));     // MMA_D of Q K^T
  CUTE_STATIC_ASSERT_V(size<2>(tdPrdO) == size<2>(tdPrV));  // MMA_D of dO V^T
  auto smem_tiled_copy_QdO = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, tiled_mma_sdp);
  auto smem_thr_copy_QdO = smem_tiled_copy_QdO.get_thread_slice(tidx);
  Tensor tSsQ = smem_thr_copy_QdO.partition_S(sQ);     // (CPY, CPY_M, CPY_D)
  Tensor tdPsdO = smem_thr_copy_QdO.partition_S(sdO);  // (CPY, CPY_M, CPY_D)
  auto smem_tiled_copy_KV = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, tiled_mma_sdp);
  auto smem_thr_copy_KV = smem_tiled_copy_KV.get_thread_slice(tidx);
  Tensor tSsK = smem_thr_copy_KV.partition_S(sK);   // (CPY, CPY_N, CPY_D)
  Tensor tdPsV = smem_thr_copy_KV.partition_S(sV);  // (CPY, CPY_N, CPY_D)

  // P and dS: accumulator registers -> shared memory.
  auto smem_tiled_copy_PdS = make_tiled_copy_C(typename Traits::SmemCopyAtomStore{}, tiled_mma_sdp);
  auto smem_thr_copy_PdS = smem_tiled_copy_PdS.get_thread_slice(tidx);
  Tensor tPsP = smem_thr_copy_PdS.partition_D(sP);     // (CPY, CPY_M, CPY_N)
  Tensor tdSsdS = smem_thr_copy_PdS.partition_D(sdS);  // (CPY, CPY_M, CPY_N)

  // dV += P^T dO and dK += dS^T Q, both operands read transposed, over the
  // columns of one head-dim slab per pass (the slab loop below).
  typename Traits::TiledMmadKV tiled_mma_dkv;
  auto thr_mma_dkv = tiled_mma_dkv.get_thread_slice(tidx);
  Tensor tdVrPt = thr_mma_dkv.partition_fragment_A(sPtNoSwizzle);    // (MMA, MMA_N, MMA_M)
  Tensor tdKrdSt = thr_mma_dkv.partition_fragment_A(sdStNoSwizzle);  // (MMA, MMA_N, MMA_M)
  auto smem_tiled_copy_PdSt =
      make_tiled_copy_A(typename Traits::SmemCopyAtomTransposed{}, tiled_mma_dkv);
  auto smem_thr_copy_PdSt = smem_tiled_copy_PdSt.get_thread_slice(tidx);
  Tensor tdVsPt = smem_thr_copy_PdSt.partition_S(sPt);    // (CPY, CPY_N, CPY_M)
  Tensor tdKsdSt = smem_thr_copy_PdSt.partition_S(sdSt);  // (CPY, CPY_N, CPY_M)
  auto smem_tiled_copy_QdOt =
      make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, tiled_mma_dkv);
  auto smem_thr_copy_QdOt = smem_tiled_copy_QdOt.get_thread_slice(tidx);
  constexpr int kSlabCols = Traits::kSlabCols;
  // Rows [slab * kSlabCols, +kSlabCols) of a (head dim, X) view: the whole
  // view where one slab covers the head dim.
  auto slab_rows = [](int slab, const auto& t) {
    if constexpr (Traits::kSlabs == 1) {
      return t;
    } else {
      return local_tile(t, make_shape(Int<kSlabCols>{}, size<1>(t)), make_coord(slab, _0{}));
    }
  };

  // dQ = dS K.
  typename Traits::TiledMmadQ tiled_mma_dq;
  auto thr_mma_dq = tiled_mma_dq.get_thread_slice(tidx);
  Tensor tdQrdS = thr_mma_dq.partition_fragment_A(sdS);  // (MMA, MMA_M, MMA_N)
  // K^T in kDQChunks row slices of kDQChunkCols head-dim rows each,
  // kDQChunksPerSlab of them in each slab's pass.
  constexpr int kDQChunksPerSlab = Traits::kDQChunksPerSlab;
  constexpr int kDQChunkCols = Traits::kDQChunkCols;
  using DQChunkShapeKt = Shape<Int<kDQChunkCols>, Int<kBlockN>>;
  // (MMA, MMA_D, MMA_N), D: one chunk's kDQChunkCols
  Tensor tdQrKt =
      thr_mma_dq.partition_fragment_B(local_tile(sKtNoSwizzle, DQChunkShapeKt{}, make_coord(0, 0)));
  auto smem_tiled_copy_dS = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, tiled_mma_dq);
  auto smem_thr_copy_dS = smem_tiled_copy_dS.get_thread_slice(tidx);
  Tensor tdQsdS = smem_thr_copy_dS.partition_S(sdS);  // (CPY, CPY_M, CPY_N)
  auto smem_tiled_copy_Kt =
      make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, tiled_mma_dq);
  auto smem_thr_copy_Kt = smem_tiled_copy_Kt.get_thread_slice(tidx);
  Tensor tdQsKt = smem_thr_copy_Kt.partition_S(
      local_tile(sKt, DQChunkShapeKt{}, make_coord(_, 0)));  // (CPY, CPY_D, CPY_N, chunk)
  // (row, col) of each S element this thread holds.
  Tensor cS = make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{});  // (M, N) -> (row, col)
  Tensor tScS = thr_mma_sdp.partition_C(cS);                              // (MMA, MMA_M, MMA_N)
  // ((2, MMA_M), (2, MMA_N))
  Tensor tScS_rowcol = make_tensor(tScS.data(), acc_layout_as_rowcol(tScS.layout()));
  constexpr int kNRows = decltype(size<0>(tScS_rowcol))::value;

  const bool has_alibi = kWithScoreExtras && params.alibi_slopes != nullptr;
  const bool prescale_scores = kWithScoreExtras && (softcap_on(params.softcap) || has_alibi);
  BwdPointwiseArgs pointwise{};
  pointwise.exp_scale_log2 = prescale_scores ? float(M_LOG2E) : params.softmax_scale_log2;
  pointwise.softcap = kWithScoreExtras ? params.softcap : 0.f;
  pointwise.inv_softcap = softcap_on(pointwise.softcap) ? 1.f / pointwise.softcap : 0.f;
  pointwise.has_alibi = has_alibi;
  pointwise.alibi_slope =
      has_alibi ? params.alibi_slopes[batch * params.alibi_batch_stride + head] : 0.f;
  pointwise.seqlen_q = seqlen_q;
  pointwise.seqlen_k = seqlen_k;
  pointwise.has_dropout = kWithScoreExtras && params.dropout_p > 0.f;
  pointwise.dropout_rescale = params.dropout_rescale;
  DropoutState dropout{};
  if (pointwise.has_dropout) dropout = dropout_state_of(params, batch, head);

  // One pass per head-dim slab (one pass up to d256): S and dP at the full
  // width, dK, dV and dQ of the slab's columns.
  // A loop unrolled by the compiler rather than a lambda per slab: the
  // d256 kernels keep the machine code they had before slabs (cuobjdump).
  CUTE_UNROLL
  for (int slab = 0; slab < Traits::kSlabs; ++slab) {
    // (MMA, MMA_D, MMA_M), D: the slab's columns
    Tensor tdVrdOt = thr_mma_dkv.partition_fragment_B(slab_rows(slab, sdOtNoSwizzle));
    // (MMA, MMA_D, MMA_M)
    Tensor tdKrQt = thr_mma_dkv.partition_fragment_B(slab_rows(slab, sQtNoSwizzle));
    CUTE_STATIC_ASSERT_V(size<2>(tdVrPt) == size<2>(tdVrdOt));               // MMA_M of P^T dO
    CUTE_STATIC_ASSERT_V(size<2>(tdKrdSt) == size<2>(tdKrQt));               // MMA_M of dS^T Q
    Tensor tdVsdOt = smem_thr_copy_QdOt.partition_S(slab_rows(slab, sdOt));  // (CPY, CPY_D, CPY_M)
    Tensor tdKsQt = smem_thr_copy_QdOt.partition_S(slab_rows(slab, sQt));    // (CPY, CPY_D, CPY_M)
    // (MMA, MMA_N, MMA_D)
    Tensor acc_dk = partition_fragment_C(tiled_mma_dkv, Shape<Int<kBlockN>, Int<kSlabCols>>{});
    // (MMA, MMA_N, MMA_D)
    Tensor acc_dv = partition_fragment_C(tiled_mma_dkv, Shape<Int<kBlockN>, Int<kSlabCols>>{});
    clear(acc_dk);
    clear(acc_dv);
    if (slab > 0) {
      __syncthreads();  // the last pass is done with sQ / sdO (its loop, its staged stores)
    }

    if (m_block_max > m_block_min) {
      // Prologue: K, V and the last visible query block in flight together
      // (K and V once: later slabs' passes find them in place). Query blocks
      // run from high to low.
      if (slab == 0) {
        const bool kv_in_bounds = head_dim_is_full && cols_left >= kBlockN;
        copy_tile_predicated(gmem_tiled_copy, tKgK, tKsK, tKVcKV, tKVpKV, cols_left, kv_in_bounds);
        copy_tile_predicated(gmem_tiled_copy, tVgV, tVsV, tKVcKV, tKVpKV, cols_left, kv_in_bounds);
      }
      load_q_do(m_block_max - 1, 0);
      cute::cp_async_fence();

      int buffer = 0;
      for (int m_block = m_block_max - 1; m_block >= m_block_min; --m_block) {
        const int row_begin = m_block * kBlockM;

        // Q(m), dO(m), their row statistics (and K, V) have landed, and every
        // warp is done with the previous block: its buffer, sP and sdS may be
        // overwritten.
        cute::cp_async_wait<0>();
        __syncthreads();
        if (Traits::kDoubleBufferQdO && m_block > m_block_min) {
          load_q_do(m_block - 1, buffer ^ 1);
          cute::cp_async_fence();
        }
        const int buffer_offset = buffer * kQdOBufferElems;

        // (MMA, MMA_M, MMA_N)
        Tensor acc_s = partition_fragment_C(tiled_mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
        clear(acc_s);
        gemm_smem_smem(acc_s, tSrQ, tSrK, make_tensor(tSsQ.data() + buffer_offset, tSsQ.layout()),
                       tSsK, tiled_mma_sdp, smem_tiled_copy_QdO, smem_tiled_copy_KV,
                       smem_thr_copy_QdO, smem_thr_copy_KV);

        // The saved statistics of this thread's rows.
        const float* row_lse = smem_row_stats + buffer * 2 * kBlockM;
        const float* row_d_smem = row_lse + kBlockM;
        float lse_log2[kNRows];
        CUTE_UNROLL
        for (int mi = 0; mi < kNRows; ++mi) {
          lse_log2[mi] = lse_to_log2(row_lse[get<0>(tScS_rowcol(mi, 0))]);
        }

        // The forward's score rule, applied to the same (row, col) positions.
        // ((2, MMA_M), (2, MMA_N))
        Tensor scores = make_tensor(acc_s.data(), acc_layout_as_rowcol(acc_s.layout()));
        if (prescale_scores) {
          apply_scale_and_softcap(scores, params.softmax_scale, params.softcap);
          if (has_alibi) {
            apply_alibi(scores, tScS_rowcol, row_begin, col_begin, pointwise.alibi_slope, seqlen_q,
                        seqlen_k);
          }
        }
        if (!key_tile_fully_visible(row_begin, row_begin + kBlockM, col_begin, col_begin + kBlockN,
                                    seqlen_q, seqlen_k, params.window_left, params.window_right)) {
          apply_mask(scores, tScS_rowcol, row_begin, col_begin, seqlen_q, seqlen_k,
                     params.window_left, params.window_right);
        }

        // (MMA, MMA_M, MMA_N)
        Tensor acc_dp = partition_fragment_C(tiled_mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
        clear(acc_dp);
        gemm_smem_smem(acc_dp, tdPrdO, tdPrV,
                       make_tensor(tdPsdO.data() + buffer_offset, tdPsdO.layout()), tdPsV,
                       tiled_mma_sdp, smem_tiled_copy_QdO, smem_tiled_copy_KV, smem_thr_copy_QdO,
                       smem_thr_copy_KV);

        float row_d[kNRows];
        CUTE_UNROLL
        for (int mi = 0; mi < kNRows; ++mi) row_d[mi] = row_d_smem[get<0>(tScS_rowcol(mi, 0))];
        // ((2, MMA_M), (2, MMA_N))
        Tensor dp = make_tensor(acc_dp.data(), acc_layout_as_rowcol(acc_dp.layout()));
        if constexpr (kWithScoreExtras) {
          scores_to_p_and_ds(scores, dp, tScS_rowcol, row_begin, col_begin, lse_log2, row_d,
                             pointwise, dropout);
        } else {
          // The launcher sends any scale that is not positive and normal to the
          // extras variant. (P computed and stored before the dP GEMM, to
          // overlap its stores with that GEMM, measured slower: PERF_LOG
          // 2026-11-22 80906c6.)
          scores_to_p</*kScaleIsPositive=*/true>(scores, lse_log2, params.softmax_scale_log2);
          p_to_ds(scores, dp, row_d);
        }
        Tensor rP = convert_type<Element>(acc_s);    // (MMA, MMA_M, MMA_N)
        Tensor rdS = convert_type<Element>(acc_dp);  // (MMA, MMA_M, MMA_N)
        copy(smem_tiled_copy_PdS, smem_thr_copy_PdS.retile_S(rP), tPsP);
        copy(smem_tiled_copy_PdS, smem_thr_copy_PdS.retile_S(rdS), tdSsdS);
        __syncthreads();  // P and dS visible to every warp

        gemm_smem_smem(acc_dv, tdVrPt, tdVrdOt, tdVsPt,
                       make_tensor(tdVsdOt.data() + buffer_offset, tdVsdOt.layout()), tiled_mma_dkv,
                       smem_tiled_copy_PdSt, smem_tiled_copy_QdOt, smem_thr_copy_PdSt,
                       smem_thr_copy_QdOt);

        // dK += dS^T Q; before or after the dQ GEMM and its atomics, as the
        // tile table says (bwd_tile_config.h). The extras variant keeps dK
        // first: dQ first measured slower there at d128, no faster at d64
        // (PERF_LOG 2026-11-22 5987c63).
        constexpr bool kDQFirst = Traits::kDQBeforeDK && !kWithScoreExtras;
        auto accumulate_dk = [&] {
          gemm_smem_smem(acc_dk, tdKrdSt, tdKrQt, tdKsdSt,
                         make_tensor(tdKsQt.data() + buffer_offset, tdKsQt.layout()), tiled_mma_dkv,
                         smem_tiled_copy_PdSt, smem_tiled_copy_QdOt, smem_thr_copy_PdSt,
                         smem_thr_copy_QdOt);
        };
        if constexpr (!kDQFirst) accumulate_dk();

        // Every key block adds into the same dQ rows; in deterministic mode this
        // block is the only writer of its split slice, so the order is fixed.
        CUTE_UNROLL
        for (int slab_chunk = 0; slab_chunk < kDQChunksPerSlab; ++slab_chunk) {
          const int chunk = slab * kDQChunksPerSlab + slab_chunk;
          // (MMA, MMA_M, MMA_D), D: one chunk's kDQChunkCols
          Tensor acc_dq =
              partition_fragment_C(tiled_mma_dq, Shape<Int<kBlockM>, Int<kDQChunkCols>>{});
          clear(acc_dq);
          gemm_smem_smem(acc_dq, tdQrdS, tdQrKt, tdQsdS, tdQsKt(_, _, _, chunk), tiled_mma_dq,
                         smem_tiled_copy_dS, smem_tiled_copy_Kt, smem_thr_copy_dS,
                         smem_thr_copy_Kt);
          atomic_add_fragment<Traits::kNThreads>(
              acc_dq,
              dq_accum_thread + accum_tile_offset<kBlockM, kHeadDim, kDQChunkCols>(m_block, chunk));
        }

        if constexpr (kDQFirst) accumulate_dk();

        if (!Traits::kDoubleBufferQdO && m_block > m_block_min) {
          __syncthreads();  // every warp is done reading sQ and sdO
          load_q_do(m_block - 1, 0);
          cute::cp_async_fence();
        }
        if (Traits::kDoubleBufferQdO) buffer ^= 1;
      }
    }

    // A single pass stages dK / dV in K's and V's buffers; with more, K and
    // V serve the next pass, and Q's and dO's buffers (reloaded by it) stage.
    Element* stage_k = raw_pointer_cast(sK.data());
    Element* stage_v = raw_pointer_cast(sV.data());
    if constexpr (Traits::kSlabs > 1) {
      stage_k = raw_pointer_cast(sQ.data());
      stage_v = raw_pointer_cast(sdO.data());
    }
    store_dk_dv<Traits, kSlabCols>(acc_dk, acc_dv, tiled_mma_dkv, thr_mma_dkv, stage_k, stage_v,
                                   params, binfo, block, tidx, BlockBarrier{}, slab);
  }
}

// A tile that needs more shared memory than an sm80 block may have is only
// launched on newer devices (BwdTileConfigLargeSmem): its sm80 machine code
// is a trap rather than a kernel compiled for nothing.
template <typename Traits>
constexpr bool bwd_tile_fits_this_arch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  return Traits::kSmemSize <= 163 * 1024;
#else
  return true;
#endif
}

// Grid: (key blocks, or dQ splits when deterministic; (head, batch) pairs of
// grid_heads_batch.h). A split
// block walks key blocks split, split + gridDim.x, ... in order.
template <typename Traits, bool kWithScoreExtras>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    flash_bwd_dq_dk_dv_kernel(const BwdParams params) {
  if constexpr (bwd_tile_fits_this_arch<Traits>()) {
    HeadBatch pair;
    if (!block_head_batch(params.nheads, params.batch, pair)) return;
    const int head = pair.head;
    const int batch = pair.batch;
    const BlockInfo binfo(params, batch);
    const int num_n_blocks = (binfo.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN;
    const int split = params.deterministic ? blockIdx.x : 0;
    for (int n_block = blockIdx.x; n_block < num_n_blocks; n_block += gridDim.x) {
      compute_key_block<Traits, kWithScoreExtras>(params, binfo, batch, head, n_block, split);
      __syncthreads();  // the next key block reuses shared memory
    }
  } else {
    __trap();
  }
}

}  // namespace flash
