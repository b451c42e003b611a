// What one forward thread block reads and writes, shared by the SM80-design
// kernel (fwd_kernel_sm80.h) and the Hopper one (fwd_kernel_sm90.h):
// its query rows and visible key blocks, the global tiles of Q, K, V and O of
// its (batch, head), and the epilogue that writes O and the lse.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

#include "common/mask_rule.h"
#include "cuda/core/block_info.h"
#include "cuda/core/params.h"
#include "cuda/core/tile_ops.h"
#include "cuda/fwd/fwd_block_order.h"

namespace flash {

using namespace cute;

// Query block m_block of (batch, head): rows [row_begin, row_begin +
// kBlockM) of its sequence, of which rows_left remain, and the key blocks
// [n_block_min, n_block_max) that some of those rows can see (the others are
// skipped, never masked).
struct FwdBlock {
  int m_block;
  int head;
  int batch;
  int head_kv;
  int row_begin;
  int rows_left;  // <= 0: the sequence (varlen) ends before this block
  int n_block_min;
  int n_block_max;
};

template <int kBlockM, int kBlockN>
__forceinline__ __device__ FwdBlock fwd_block(const FwdParams& params, const FwdBlockCoord& coord,
                                              const BlockInfo& binfo) {
  FwdBlock block;
  block.m_block = coord.m_block;
  block.head = coord.head;
  block.batch = coord.batch;
  block.head_kv = coord.head_kv;
  block.row_begin = coord.m_block * kBlockM;
  block.rows_left = binfo.seqlen_q - block.row_begin;
  const int row_end = block.row_begin + (block.rows_left < kBlockM ? block.rows_left : kBlockM);
  const KeyRange key_range =
      visible_key_range(block.row_begin, row_end, binfo.seqlen_q, binfo.seqlen_k,
                        params.window_left, params.window_right);
  block.n_block_min = key_range.begin / kBlockN;
  block.n_block_max = (key_range.end + kBlockN - 1) / kBlockN;
  return block;
}

// Global views of the block's (batch, head), (rows, head dim), tiled by
// block: gQ (kBlockM, D) and gO (kBlockM, Dv) at m_block, gK (kBlockN, D, n)
// and gV (kBlockN, Dv, n). V and O have head_dim_v columns, Q and K head_dim;
// the tiles are D = kHeadDim and Dv = kHeadDimV wide (the same but in a
// specialised (d_qk, d_v) pair's kernel), and the copies' column predicates
// keep to each tensor's own width.
template <typename Element, int kBlockM, int kBlockN, int kHeadDim, int kHeadDimV = kHeadDim>
__forceinline__ __device__ auto fwd_global_tiles(const FwdParams& params, const BlockInfo& binfo,
                                                 const FwdBlock& block) {
  const Element* q_ptr =
      static_cast<const Element*>(params.q_ptr) + binfo.q_offset(params.q, block.batch, block.head);
  const Element* k_ptr = static_cast<const Element*>(params.k_ptr) +
                         binfo.k_offset(params.k, block.batch, block.head_kv);
  const Element* v_ptr = static_cast<const Element*>(params.v_ptr) +
                         binfo.k_offset(params.v, block.batch, block.head_kv);
  Element* o_ptr =
      static_cast<Element*>(params.o_ptr) + binfo.q_offset(params.o, block.batch, block.head);
  Tensor mQ = make_tensor(make_gmem_ptr(q_ptr), make_shape(binfo.seqlen_q, params.head_dim),
                          make_stride(params.q.row_stride, _1{}));  // (seqlen_q, head_dim)
  Tensor mK = make_tensor(make_gmem_ptr(k_ptr), make_shape(binfo.seqlen_k, params.head_dim),
                          make_stride(params.k.row_stride, _1{}));  // (seqlen_k, head_dim)
  Tensor mV = make_tensor(make_gmem_ptr(v_ptr), make_shape(binfo.seqlen_k, params.head_dim_v),
                          make_stride(params.v.row_stride, _1{}));  // (seqlen_k, head_dim_v)
  Tensor mO = make_tensor(make_gmem_ptr(o_ptr), make_shape(binfo.seqlen_q, params.head_dim_v),
                          make_stride(params.o.row_stride, _1{}));  // (seqlen_q, head_dim_v)
  return make_tuple(
      local_tile(mQ, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(block.m_block, 0)),
      local_tile(mK, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, 0)),
      local_tile(mV, Shape<Int<kBlockN>, Int<kHeadDimV>>{}, make_coord(_, 0)),
      local_tile(mO, Shape<Int<kBlockM>, Int<kHeadDimV>>{}, make_coord(block.m_block, 0)));
}

// The block's rows of softmax_lse.
__forceinline__ __device__ float* fwd_lse_rows(const FwdParams& params, const BlockInfo& binfo,
                                               const FwdBlock& block) {
  return params.softmax_lse_ptr + binfo.lse_offset(params, block.batch, block.head) +
         block.row_begin;
}

// Writes zeros to O and empty_lse (+inf, or the head's sink: empty_row_lse)
// to the lse of rows [0, rows_left) of this query block: the path of a block
// that sees no key at all.
template <typename Traits, typename TensorGO, typename TensorCoord>
__forceinline__ __device__ void write_empty_rows(const TensorGO& gO, const TensorCoord& cO,
                                                 float* lse_rows, float empty_lse, int rows_left,
                                                 int head_dim, int tidx) {
  using Element = typename Traits::Element;
  typename Traits::GmemTiledCopyO gmem_tiled_copy_O;
  auto gmem_thr_copy_O = gmem_tiled_copy_O.get_thread_slice(tidx);
  Tensor tOgO = gmem_thr_copy_O.partition_D(gO);    // (CPY, CPY_M, CPY_D)
  Tensor tOcO = gmem_thr_copy_O.partition_D(cO);    // (CPY, CPY_M, CPY_D)
  Tensor tOrO = make_fragment_like<Element>(tOgO);  // (CPY, CPY_M, CPY_D)
  clear(tOrO);
  Tensor tOpO = make_tensor<bool>(make_shape(size<2>(tOgO)));  // (CPY_D)
  make_col_predicate(tOpO, tOcO, head_dim);
  store_tile_predicated(gmem_tiled_copy_O, tOrO, tOgO, tOcO, tOpO, rows_left);
  for (int row = tidx; row < Traits::kBlockM && row < rows_left; row += size(gmem_tiled_copy_O)) {
    lse_rows[row] = empty_lse;
  }
}

// Epilogue, first half: the normalised acc_o goes registers -> shared (sO,
// over Q, which its warps no longer read), and the thread holding column 0 of
// a row writes its lse. as_rowcol views the MMA's accumulator layout as
// (rows, cols).
template <typename Traits, typename TensorAcc, typename TiledMma, typename ThrMma,
          typename TensorSO, typename AsRowCol, int kNRows>
__forceinline__ __device__ void stage_output(const TensorAcc& acc_o, const TiledMma& tiled_mma,
                                             const ThrMma& thr_mma, TensorSO& sO,
                                             AsRowCol as_rowcol, const float (&lse)[kNRows],
                                             float* lse_rows, int rows_left, int tidx) {
  using Element = typename Traits::Element;
  Tensor rO = convert_type<Element>(acc_o);  // (MMA, MMA_M, MMA_D)
  auto smem_tiled_copy_O = make_tiled_copy_C(typename Traits::SmemCopyAtomO{}, tiled_mma);
  auto smem_thr_copy_O = smem_tiled_copy_O.get_thread_slice(tidx);
  Tensor taccOrO = smem_thr_copy_O.retile_S(rO);     // (CPY, CPY_M, CPY_D)
  Tensor taccOsO = smem_thr_copy_O.partition_D(sO);  // (CPY, CPY_M, CPY_D)
  copy(smem_tiled_copy_O, taccOrO, taccOsO);

  // (M, D) -> (row, col): D is O's width, sO's
  Tensor cO = make_identity_tensor(Shape<Int<Traits::kBlockM>, decltype(size<1>(sO))>{});
  Tensor taccOcO = thr_mma.partition_C(cO);  // (MMA, MMA_M, MMA_D)
  Tensor taccOcO_rowcol = make_tensor(taccOcO.data(), as_rowcol(taccOcO.layout()));  // (rows, cols)
  if (get<1>(taccOcO_rowcol(0, 0)) == 0) {
    CUTE_UNROLL
    for (int mi = 0; mi < kNRows; ++mi) {
      const int row = get<0>(taccOcO_rowcol(mi, 0));
      if (row < rows_left) lse_rows[row] = lse[mi];
    }
  }
}

// Epilogue, second half: rows [0, rows_left) of the staged tile sO go
// shared -> global by the threads of GmemTiledCopyO, as 16-byte,
// row-contiguous stores.
template <typename GmemTiledCopyO, typename TensorSO, typename TensorGO>
__forceinline__ __device__ void store_output(const TensorSO& sO, const TensorGO& gO, int rows_left,
                                             int head_dim, int tidx) {
  GmemTiledCopyO gmem_tiled_copy_O;
  auto gmem_thr_copy_O = gmem_tiled_copy_O.get_thread_slice(tidx);
  Tensor cO = make_identity_tensor(product_each(shape(sO)));   // (M, D) -> (row, col)
  Tensor tOsO = gmem_thr_copy_O.partition_S(sO);               // (CPY, CPY_M, CPY_D)
  Tensor tOgO = gmem_thr_copy_O.partition_D(gO);               // (CPY, CPY_M, CPY_D)
  Tensor tOcO = gmem_thr_copy_O.partition_D(cO);               // (CPY, CPY_M, CPY_D)
  Tensor tOpO = make_tensor<bool>(make_shape(size<2>(tOgO)));  // (CPY_D)
  make_col_predicate(tOpO, tOcO, head_dim);
  Tensor tOrO = make_fragment_like(tOsO);  // (CPY, CPY_M, CPY_D)
  copy(gmem_tiled_copy_O, tOsO, tOrO);
  store_tile_predicated(gmem_tiled_copy_O, tOrO, tOgO, tOcO, tOpO, rows_left);
}

// The whole epilogue for kernels whose every thread computes O.
template <typename Traits, typename TensorAcc, typename TiledMma, typename ThrMma,
          typename TensorSO, typename TensorGO, typename AsRowCol, int kNRows>
__forceinline__ __device__ void write_output(const TensorAcc& acc_o, const TiledMma& tiled_mma,
                                             const ThrMma& thr_mma, TensorSO& sO,
                                             const TensorGO& gO, AsRowCol as_rowcol,
                                             const float (&lse)[kNRows], float* lse_rows,
                                             int rows_left, int head_dim, int tidx) {
  __syncthreads();  // every warp is done with sQ
  stage_output<Traits>(acc_o, tiled_mma, thr_mma, sO, as_rowcol, lse, lse_rows, rows_left, tidx);
  __syncthreads();
  store_output<typename Traits::GmemTiledCopyO>(sO, gO, rows_left, head_dim, tidx);
}

}  // namespace flash
