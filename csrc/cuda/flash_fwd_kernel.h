// The FlashAttention-2 forward kernel: one thread block per (query block,
// head, batch). The Q tile stays in shared memory; K and V tiles stream
// through it; S = Q K^T and O += P V run on SM80 tensor-core MMAs; the online
// softmax keeps P in registers.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "../common/mask_rule.h"
#include "block_info.h"
#include "dropout.h"
#include "fwd_block_order.h"
#include "kernel_traits.h"
#include "params.h"
#include "score_mods.h"
#include "softmax.h"
#include "tile_ops.h"

#ifndef FA_FWD_MIN_BLOCKS
#define FA_FWD_MIN_BLOCKS 1
#endif

namespace flash {

using namespace cute;

// Writes zeros to O and +inf to the lse of rows [0, seqlen_q) of this query
// block: the path of a block that sees no key at all.
template <typename Traits, typename TensorGO, typename TensorCoord>
__forceinline__ __device__ void write_empty_rows(const TensorGO& gO, const TensorCoord& cO,
                                                 float* lse_rows, int rows_left, int head_dim,
                                                 int tidx) {
  using Element = typename Traits::Element;
  typename Traits::GmemTiledCopyO gmem_tiled_copy_O;
  auto gmem_thr_copy_O = gmem_tiled_copy_O.get_thread_slice(tidx);
  Tensor tOgO = gmem_thr_copy_O.partition_D(gO);
  Tensor tOcO = gmem_thr_copy_O.partition_D(cO);
  Tensor tOrO = make_fragment_like<Element>(tOgO);
  clear(tOrO);
  Tensor tOpO = make_tensor<bool>(make_shape(size<2>(tOgO)));
  make_col_predicate(tOpO, tOcO, head_dim);
  store_tile_predicated(gmem_tiled_copy_O, tOrO, tOgO, tOcO, tOpO, rows_left);
  for (int row = tidx; row < Traits::kBlockM && row < rows_left; row += Traits::kNThreads) {
    lse_rows[row] = INFINITY;
  }
}

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
  const FwdBlockCoord coord = fwd_block_coord(/*causal=*/params.window_right >= 0);
  const int m_block = coord.m_block;
  const int head = coord.head;
  const int batch = coord.batch;
  const int tidx = threadIdx.x;

  const BlockInfo binfo(params, batch);
  const int seqlen_q = binfo.seqlen_q;
  const int seqlen_k = binfo.seqlen_k;
  const int row_begin = m_block * kBlockM;
  if (row_begin >= seqlen_q) return;  // varlen: this sequence is shorter than the longest
  const int rows_left = seqlen_q - row_begin;
  const int head_kv = head / (params.nheads / params.nheads_k);

  // Only key blocks that some row of this query block can see are visited.
  const KeyRange key_range =
      visible_key_range(row_begin, row_begin + (rows_left < kBlockM ? rows_left : kBlockM),
                        seqlen_q, seqlen_k, params.window_left, params.window_right);
  const int n_block_min = key_range.begin / kBlockN;
  const int n_block_max = (key_range.end + kBlockN - 1) / kBlockN;

  const Element* q_ptr = static_cast<const Element*>(params.q_ptr) +
                         binfo.q_offset(params.q, batch, head);
  const Element* k_ptr = static_cast<const Element*>(params.k_ptr) +
                         binfo.k_offset(params.k, batch, head_kv);
  const Element* v_ptr = static_cast<const Element*>(params.v_ptr) +
                         binfo.k_offset(params.v, batch, head_kv);
  Element* o_ptr = static_cast<Element*>(params.o_ptr) + binfo.q_offset(params.o, batch, head);
  float* lse_rows = params.softmax_lse_ptr + binfo.lse_offset(params, batch, head) + row_begin;

  // Global views of this (batch, head): (rows, head dim), tiled by block.
  Tensor mQ = make_tensor(make_gmem_ptr(q_ptr), make_shape(seqlen_q, params.head_dim),
                          make_stride(params.q.row_stride, _1{}));
  Tensor mK = make_tensor(make_gmem_ptr(k_ptr), make_shape(seqlen_k, params.head_dim),
                          make_stride(params.k.row_stride, _1{}));
  Tensor mV = make_tensor(make_gmem_ptr(v_ptr), make_shape(seqlen_k, params.head_dim),
                          make_stride(params.v.row_stride, _1{}));
  Tensor mO = make_tensor(make_gmem_ptr(o_ptr), make_shape(seqlen_q, params.head_dim),
                          make_stride(params.o.row_stride, _1{}));
  Tensor gQ = local_tile(mQ, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, 0));
  Tensor gK = local_tile(mK, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, 0));  // (N, D, n)
  Tensor gV = local_tile(mV, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, 0));
  Tensor gO = local_tile(mO, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, 0));

  // Identity tensors give each element's (row, col) inside a tile, for bounds.
  Tensor cQ = make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{});
  Tensor cKV = make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{});

  if (n_block_max <= n_block_min) {
    write_empty_rows<Traits>(gO, cQ, lse_rows, rows_left, params.head_dim, tidx);
    return;
  }

  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)),
                          typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(sQ.data() + size(sQ), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(sK.data() + size(sK), typename Traits::SmemLayoutKV{});
  Tensor sVt = make_tensor(sV.data(), typename Traits::SmemLayoutVt{});
  Tensor sVtNoSwizzle = make_tensor(sV.data().get(), typename Traits::SmemLayoutVtNoSwizzle{});

  // Global -> shared copies (cp.async, 16 bytes per thread per access).
  typename Traits::GmemTiledCopyQKV gmem_tiled_copy_QKV;
  auto gmem_thr_copy_QKV = gmem_tiled_copy_QKV.get_thread_slice(tidx);
  Tensor tQgQ = gmem_thr_copy_QKV.partition_S(gQ);
  Tensor tQsQ = gmem_thr_copy_QKV.partition_D(sQ);
  Tensor tKgK = gmem_thr_copy_QKV.partition_S(gK);  // (CPY, CPY_N, CPY_D, n)
  Tensor tKsK = gmem_thr_copy_QKV.partition_D(sK);
  Tensor tVgV = gmem_thr_copy_QKV.partition_S(gV);
  Tensor tVsV = gmem_thr_copy_QKV.partition_D(sV);
  Tensor tQcQ = gmem_thr_copy_QKV.partition_S(cQ);
  Tensor tKVcKV = gmem_thr_copy_QKV.partition_S(cKV);
  Tensor tQpQ = make_tensor<bool>(make_shape(size<2>(tQsQ)));
  Tensor tKVpKV = make_tensor<bool>(make_shape(size<2>(tKsK)));
  make_col_predicate(tQpQ, tQcQ, params.head_dim);
  make_col_predicate(tKVpKV, tKVcKV, params.head_dim);
  const bool full_head_dim = params.head_dim == kHeadDim;
  // Whole K/V tiles need no predication: every key block but a ragged last one.
  auto kv_tile_in_bounds = [&](int n) { return full_head_dim && (n + 1) * kBlockN <= seqlen_k; };

  // MMA partitions: S = Q K^T is (M, N); O = P V is (M, D).
  typename Traits::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(tidx);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);
  Tensor tSrK = thr_mma.partition_fragment_B(sK);
  Tensor tOrVt = thr_mma.partition_fragment_B(sVtNoSwizzle);
  Tensor acc_o = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  clear(acc_o);

  // Shared -> register copies (ldmatrix; transposed for V).
  auto smem_tiled_copy_Q = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_copy_Q = smem_tiled_copy_Q.get_thread_slice(tidx);
  Tensor tSsQ = smem_thr_copy_Q.partition_S(sQ);
  auto smem_tiled_copy_K = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_copy_K = smem_tiled_copy_K.get_thread_slice(tidx);
  Tensor tSsK = smem_thr_copy_K.partition_S(sK);
  auto smem_tiled_copy_V = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, tiled_mma);
  auto smem_thr_copy_V = smem_tiled_copy_V.get_thread_slice(tidx);
  Tensor tOsVt = smem_thr_copy_V.partition_S(sVt);

  // (row, col) of each score element this thread holds, as a (rows, cols) view.
  Tensor cS = make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{});
  Tensor tScS = thr_mma.partition_C(cS);
  Tensor tScS_rowcol = make_tensor(tScS.data(), acc_layout_as_rowcol(tScS.layout()));
  Tensor acc_o_rowcol = make_tensor(acc_o.data(), acc_layout_as_rowcol(acc_o.layout()));
  constexpr int kNRows = decltype(size<0>(acc_o_rowcol))::value;

  // Scores go through scale/softcap/ALiBi in natural units when any of those
  // is on; otherwise the scale is folded into the exp2 multiplier for free.
  const float alibi_slope =
      !kWithScoreExtras || params.alibi_slopes == nullptr
          ? 0.f
          : params.alibi_slopes[batch * params.alibi_batch_stride + head];
  const bool has_alibi = kWithScoreExtras && params.alibi_slopes != nullptr;
  const bool prescale_scores = kWithScoreExtras && (params.softcap > 0.f || has_alibi);
  const float exp_scale_log2 = prescale_scores ? float(M_LOG2E) : params.softmax_scale_log2;
  const float lse_scale = prescale_scores ? 1.f : params.softmax_scale;
  const bool has_dropout = kWithScoreExtras && params.dropout_p > 0.f;
  DropoutState dropout{};
  if (has_dropout) {
    dropout = {static_cast<uint64_t>(params.rng_state[0]),
               static_cast<uint64_t>(params.rng_state[1]),
               params.dropout_threshold,
               batch,
               head,
               params.nheads};
  }

  // Prologue: Q and the last visible K block in flight together. Key blocks
  // run from high to low so that a causal mask's diagonal block, the one that
  // needs per-element masking, comes first.
  int n_block = n_block_max - 1;
  copy_tile_predicated(gmem_tiled_copy_QKV, tQgQ, tQsQ, tQcQ, tQpQ, rows_left,
                       full_head_dim && rows_left >= kBlockM);
  copy_tile_predicated(gmem_tiled_copy_QKV, tKgK(_, _, _, n_block), tKsK, tKVcKV, tKVpKV,
                       seqlen_k - n_block * kBlockN, kv_tile_in_bounds(n_block));
  cute::cp_async_fence();

  OnlineSoftmax<kNRows> softmax;

  for (; n_block >= n_block_min; --n_block) {
    Tensor acc_s = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
    clear(acc_s);
    // K(n) has landed, and every warp is done reading V(n+1): V(n) may overwrite it.
    cute::cp_async_wait<0>();
    __syncthreads();
    copy_tile_predicated(gmem_tiled_copy_QKV, tVgV(_, _, _, n_block), tVsV, tKVcKV, tKVpKV,
                         seqlen_k - n_block * kBlockN, kv_tile_in_bounds(n_block));
    cute::cp_async_fence();

    gemm_smem_smem(acc_s, tSrQ, tSrK, tSsQ, tSsK, tiled_mma, smem_tiled_copy_Q, smem_tiled_copy_K,
                   smem_thr_copy_Q, smem_thr_copy_K);

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
      copy_tile_predicated(gmem_tiled_copy_QKV, tKgK(_, _, _, n_block - 1), tKsK, tKVcKV, tKVpKV,
                           seqlen_k - (n_block - 1) * kBlockN, kv_tile_in_bounds(n_block - 1));
      cute::cp_async_fence();
    }

    softmax.template update</*kSkipUnmovedRescale=*/true>(scores, acc_o_rowcol, exp_scale_log2);
    if (has_dropout) apply_dropout(scores, tScS_rowcol, row_begin, col_base, dropout);

    Tensor rP = convert_type<Element>(acc_s);
    Tensor tOrP = make_tensor(rP.data(), acc_layout_as_operand_a(rP.layout()));
    gemm_reg_smem(acc_o, tOrP, tOrVt, tOsVt, tiled_mma, smem_tiled_copy_V, smem_thr_copy_V);
  }

  float lse[kNRows];
  softmax.finalize(acc_o_rowcol, lse_scale, has_dropout ? params.dropout_rescale : 1.f, lse);

  // Epilogue: O goes registers -> shared (over Q, which no warp reads any
  // more) -> global, so the global stores are 16-byte and row-contiguous.
  Tensor rO = convert_type<Element>(acc_o);
  Tensor sO = make_tensor(sQ.data(), typename Traits::SmemLayoutO{});
  auto smem_tiled_copy_O = make_tiled_copy_C(typename Traits::SmemCopyAtomO{}, tiled_mma);
  auto smem_thr_copy_O = smem_tiled_copy_O.get_thread_slice(tidx);
  Tensor taccOrO = smem_thr_copy_O.retile_S(rO);
  Tensor taccOsO = smem_thr_copy_O.partition_D(sO);
  __syncthreads();  // all warps are done with sQ
  copy(smem_tiled_copy_O, taccOrO, taccOsO);

  // lse: the thread holding column 0 of a row writes it.
  Tensor cO = make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{});
  Tensor taccOcO = thr_mma.partition_C(cO);
  Tensor taccOcO_rowcol = make_tensor(taccOcO.data(), acc_layout_as_rowcol(taccOcO.layout()));
  if (get<1>(taccOcO_rowcol(0, 0)) == 0) {
    CUTE_UNROLL
    for (int mi = 0; mi < kNRows; ++mi) {
      const int row = get<0>(taccOcO_rowcol(mi, 0));
      if (row < rows_left) lse_rows[row] = lse[mi];
    }
  }

  typename Traits::GmemTiledCopyO gmem_tiled_copy_O;
  auto gmem_thr_copy_O = gmem_tiled_copy_O.get_thread_slice(tidx);
  Tensor tOsO = gmem_thr_copy_O.partition_S(sO);
  Tensor tOgO = gmem_thr_copy_O.partition_D(gO);
  Tensor tOcO = gmem_thr_copy_O.partition_D(cO);
  Tensor tOpO = make_tensor<bool>(make_shape(size<2>(tOgO)));
  make_col_predicate(tOpO, tOcO, params.head_dim);
  __syncthreads();
  Tensor tOrO = make_fragment_like(tOsO);
  copy(gmem_tiled_copy_O, tOsO, tOrO);
  store_tile_predicated(gmem_tiled_copy_O, tOrO, tOgO, tOcO, tOpO, rows_left);
}

}  // namespace flash
