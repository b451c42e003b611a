// What one backward thread block reads and writes, shared by the SM80-design
// kernel (bwd_kernel_sm80.h) and the Hopper one (bwd_kernel_sm90.h):
// its key block and the query blocks that see it, the global tiles of its
// (batch, head), the row statistics that travel with each query block, the
// fp32 reductions into dQ (and the GQA sums), and the epilogue that writes dK
// and dV.
#pragma once

#include <cmath>
#include <cstdint>

#include <cute/tensor.hpp>

#include "cuda/bwd/bwd_accum_layout.h"
#include "cuda/core/block_info.h"
#include "cuda/core/gpu_semaphore.h"
#include "cuda/core/params.h"
#include "cuda/core/query_range.h"
#include "cuda/core/tile_ops.h"

namespace flash {

using namespace cute;

// Key block n_block of (batch, head): keys [col_begin, col_begin + kBlockN)
// of its sequence, of which cols_left remain, and the query blocks
// [m_block_min, m_block_max) whose rows see some of them.
struct BwdKeyBlock {
  int n_block;
  int head;
  int batch;
  int head_kv;
  int group;  // query heads per kv head
  int col_begin;
  int cols_left;
  int m_block_min;
  int m_block_max;
};

template <int kBlockM, int kBlockN>
__forceinline__ __device__ BwdKeyBlock bwd_key_block(const BwdParams& params,
                                                     const BlockInfo& binfo, int batch, int head,
                                                     int n_block) {
  BwdKeyBlock block;
  block.n_block = n_block;
  block.head = head;
  block.batch = batch;
  block.group = params.nheads / params.nheads_k;
  block.head_kv = head / block.group;
  block.col_begin = n_block * kBlockN;
  block.cols_left = binfo.seqlen_k - block.col_begin;
  const QueryRange query_range =
      visible_query_range(block.col_begin, block.col_begin + kBlockN, binfo.seqlen_q,
                          binfo.seqlen_k, params.window_left, params.window_right);
  block.m_block_min = query_range.begin / kBlockM;
  block.m_block_max = (query_range.end + kBlockM - 1) / kBlockM;
  return block;
}

// Global views of the block's (batch, head): gQ and gdO (kBlockM, D, m) over
// all query blocks, gK and gV (kBlockN, D) at the block's keys. dO and V have
// head_dim_v columns, Q and K head_dim; the tiles are D = kHeadDim wide.
template <typename Element, int kBlockM, int kBlockN, int kHeadDim>
__forceinline__ __device__ auto bwd_global_tiles(const BwdParams& params, const BlockInfo& binfo,
                                                 const BwdKeyBlock& block) {
  const Element* q_ptr =
      static_cast<const Element*>(params.q_ptr) + binfo.q_offset(params.q, block.batch, block.head);
  const Element* do_ptr = static_cast<const Element*>(params.do_ptr) +
                          binfo.q_offset(params.dout, block.batch, block.head);
  const Element* k_ptr = static_cast<const Element*>(params.k_ptr) +
                         binfo.k_offset(params.k, block.batch, block.head_kv);
  const Element* v_ptr = static_cast<const Element*>(params.v_ptr) +
                         binfo.k_offset(params.v, block.batch, block.head_kv);
  Tensor mQ = make_tensor(make_gmem_ptr(q_ptr), make_shape(binfo.seqlen_q, params.head_dim),
                          make_stride(params.q.row_stride, _1{}));  // (seqlen_q, head_dim)
  Tensor mdO = make_tensor(make_gmem_ptr(do_ptr), make_shape(binfo.seqlen_q, params.head_dim_v),
                           make_stride(params.dout.row_stride, _1{}));  // (seqlen_q, head_dim_v)
  Tensor mK = make_tensor(make_gmem_ptr(k_ptr), make_shape(binfo.seqlen_k, params.head_dim),
                          make_stride(params.k.row_stride, _1{}));  // (seqlen_k, head_dim)
  Tensor mV = make_tensor(make_gmem_ptr(v_ptr), make_shape(binfo.seqlen_k, params.head_dim_v),
                          make_stride(params.v.row_stride, _1{}));  // (seqlen_k, head_dim_v)
  return make_tuple(
      local_tile(mQ, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(_, 0)),
      local_tile(mdO, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(_, 0)),
      local_tile(mK, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(block.n_block, 0)),
      local_tile(mV, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(block.n_block, 0)));
}

// Copies the lse, then D, of the rows_left rows of a query block (from
// lse_rows / d_rows, its first row) into stats (2 * kBlockM floats), one
// 4-byte cp.async per thread on the first 2 * kBlockM threads: the
// statistics of a block start at any row, so 16-byte copies would not be
// aligned. Rows past the sequence get lse +inf and D 0, which make their P
// and dS zero.
template <int kBlockM>
__forceinline__ __device__ void load_row_stats(const float* lse_rows, const float* d_rows,
                                               int rows_left, float* stats, int tidx) {
  if (tidx < 2 * kBlockM) {
    const bool is_d = tidx >= kBlockM;
    const int row = tidx - (is_d ? kBlockM : 0);
    float& dst = stats[tidx];
    if (row < rows_left) {
      SM80_CP_ASYNC_CACHEALWAYS<float>::copy((is_d ? d_rows : lse_rows)[row], dst);
    } else {
      dst = is_d ? 0.f : INFINITY;
    }
  }
}

// This thread's place in the dQ accumulator slice `split` of (batch, head)
// (bwd_accum_layout.h).
template <int kBlockM, int kHeadDim>
__forceinline__ __device__ float* dq_accum_thread_ptr(const BwdParams& params,
                                                      const BlockInfo& binfo,
                                                      const BwdKeyBlock& block, int split,
                                                      int tidx) {
  return params.dq_accum_ptr + split * params.dq_accum_split_stride +
         dq_accum_offset<kBlockM, kHeadDim>(params, binfo, block.batch, block.head) +
         accum_thread_offset(tidx);
}

// Adds this thread's fragment of one chunk (dQ) or block (dK / dV sums) into
// an fp32 accumulator, as reductions without a return value, kAccumVec values
// each; thread_chunk is the thread's own place in it (bwd_accum_layout.h).
// Rows past the sequence add zeros into the padding, so no row needs a check.
template <int kNThreads, typename TensorAcc>
__forceinline__ __device__ void atomic_add_fragment(const TensorAcc& acc, float* thread_chunk) {
  static_assert(decltype(size(acc))::value % kAccumVec == 0);
  CUTE_UNROLL
  for (int i = 0; i < size(acc); i += kAccumVec) {
    float* dst = thread_chunk + accum_value_offset<kNThreads>(i);
    if constexpr (kAccumVec == 4) {
      atomicAdd(reinterpret_cast<float4*>(dst),
                make_float4(acc(i), acc(i + 1), acc(i + 2), acc(i + 3)));
    } else {
      atomicAdd(dst, acc(i));
    }
  }
}

// Epilogue: dK (scaled here: dS was taken with respect to the scaled score)
// and dV of the key block, from the dK / dV MMA's accumulators.
//   MHA: registers -> shared (over sK and sV, which the caller has finished
//        reading) -> global, with 16-byte stores;
//   GQA/MQA: added into the kv head's fp32 sums, which the conversion kernel
//        casts once every query head of the group is in; deterministic: in
//        head order (BwdDkvTurn).
// Traits gives SmemLayoutKV (one (kBlockN, head dim) tile), SmemCopyAtomStore
// and GmemTiledCopyStore; Traits::kNThreads threads (tidx from 0) take part,
// and sync() is their barrier (the whole block's, unless a kernel has threads
// of other roles).
struct BlockBarrier {
  __device__ void operator()() const { __syncthreads(); }
};

// GQA/MQA, deterministic mode: the query heads of a kv head add their dK / dV
// of a key block into the kv head's fp32 sums in head order, so the sums
// (and dK / dV) do not depend on which block adds first. Head g of the
// group waits until its (batch, kv head, key block) counter reaches g, adds,
// and increments it. A block waits only for the block of the head before
// it, same key block and batch, which has a lower linear index (heads run
// fastest in grid_heads_batch.h's pairs) and so was launched earlier: no
// block waits on one that cannot start. fp32 adds in a fixed order: the
// per-head shares this replaces, summed by a kernel of their own in head
// order, gave the same sums with 4x (at 4:1) the fp32 bytes, and cost up to
// 1.30x the default backward's time (PERF_LOG 2026-11-29).
struct BwdDkvTurn {
  int* counter;  // null outside deterministic GQA/MQA
  int turn;

  // A key block's counter per head-dim slab of the SM80 kernel (its passes
  // add their slabs' sums in turn each; dkv_semaphore_n_blocks counts the
  // (key block, slab) pairs).
  __forceinline__ __device__ BwdDkvTurn(const BwdParams& params, const BwdKeyBlock& block,
                                        int slab = 0, int slabs = 1)
      : counter(params.dkv_semaphore == nullptr
                    ? nullptr
                    : params.dkv_semaphore +
                          (int64_t(block.batch) * params.nheads_k + block.head_kv) *
                              params.dkv_semaphore_n_blocks +
                          block.n_block * slabs + slab),
        turn(block.head - block.head_kv * block.group) {}

  // Before the adds: one thread waits for the turn, sync() tells the others.
  template <typename Sync>
  __forceinline__ __device__ void wait(int tidx, Sync sync) const {
    if (counter == nullptr) return;
    if (tidx == 0) semaphore_wait_for(counter, turn);
    sync();
  }
  // After them: the barrier orders every thread's adds before thread 0's
  // release, which is cumulative (gpu_semaphore.h; the ordered dQ's pattern).
  // No __threadfence: a fence in a kernel makes ptxas turn each of its fp32
  // reductions (dQ's too) into an atomic that waits for its reply, ATOMG in
  // place of REDG, at every head dim that adds dQ per thread (d64, d256:
  // PERF_LOG 2026-11-29, "REDG, not ATOMG").
  template <typename Sync>
  __forceinline__ __device__ void release(int tidx, Sync sync) const {
    if (counter == nullptr) return;
    sync();
    if (tidx == 0) semaphore_release_increment(counter);
  }
};
// store_dk_dv's staging tile: K's layout for the whole head dim, the slab's
// (the SM80 kernel's SmemLayoutdKVSlab) below it.
template <typename Traits, bool kWholeHeadDim>
struct DkvStageLayout {
  using type = typename Traits::SmemLayoutKV;
};
template <typename Traits>
struct DkvStageLayout<Traits, false> {
  using type = typename Traits::SmemLayoutdKVSlab;
};

// dK (scaled) and dV of a key block: to dk / dv through a staging tile in
// shared memory (smem_k, smem_v), or under GQA added to the kv head's sums.
// The SM80 kernel's head-dim slabs (kSlabCols columns, the slab-th; the
// whole head dim by default) each store their own columns.
template <typename Traits, int kSlabCols = Traits::kHeadDim, typename TensorAcc, typename TiledMma,
          typename ThrMma, typename Sync = BlockBarrier>
__forceinline__ __device__ void store_dk_dv(
    TensorAcc& acc_dk, const TensorAcc& acc_dv, const TiledMma& tiled_mma_dkv,
    const ThrMma& thr_mma_dkv, typename Traits::Element* smem_k, typename Traits::Element* smem_v,
    const BwdParams& params, const BlockInfo& binfo, const BwdKeyBlock& block, int tidx,
    Sync sync = {}, int slab = 0) {
  using Element = typename Traits::Element;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kSlabs = kHeadDim / kSlabCols;
  static_assert(kHeadDim % kSlabCols == 0, "whole slabs of the head dim");
  using SmemLayoutStage = typename DkvStageLayout<Traits, kSlabs == 1>::type;
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dk); ++i) acc_dk(i) *= params.softmax_scale;

  // (N, D) -> (row, col), D: the slab's columns
  Tensor cdKV = make_identity_tensor(Shape<Int<kBlockN>, Int<kSlabCols>>{});
  if (block.group == 1) {
    Tensor rdK = convert_type<Element>(acc_dk);                          // (MMA, MMA_N, MMA_D)
    Tensor rdV = convert_type<Element>(acc_dv);                          // (MMA, MMA_N, MMA_D)
    Tensor sdK = make_tensor(make_smem_ptr(smem_k), SmemLayoutStage{});  // (N, D)
    Tensor sdV = make_tensor(make_smem_ptr(smem_v), SmemLayoutStage{});  // (N, D)
    auto smem_tiled_copy_dKV =
        make_tiled_copy_C(typename Traits::SmemCopyAtomStore{}, tiled_mma_dkv);
    auto smem_thr_copy_dKV = smem_tiled_copy_dKV.get_thread_slice(tidx);
    sync();  // every warp is done reading sK (dQ) and sV (dP)
    copy(smem_tiled_copy_dKV, smem_thr_copy_dKV.retile_S(rdK), smem_thr_copy_dKV.partition_D(sdK));
    copy(smem_tiled_copy_dKV, smem_thr_copy_dKV.retile_S(rdV), smem_thr_copy_dKV.partition_D(sdV));
    sync();

    Element* dk_ptr = static_cast<Element*>(params.dk_ptr) +
                      binfo.k_offset(params.dk, block.batch, block.head_kv);
    Element* dv_ptr = static_cast<Element*>(params.dv_ptr) +
                      binfo.k_offset(params.dv, block.batch, block.head_kv);
    Tensor mdK = make_tensor(make_gmem_ptr(dk_ptr), make_shape(binfo.seqlen_k, params.head_dim),
                             make_stride(params.dk.row_stride, _1{}));  // (seqlen_k, head_dim)
    Tensor mdV = make_tensor(make_gmem_ptr(dv_ptr), make_shape(binfo.seqlen_k, params.head_dim_v),
                             make_stride(params.dv.row_stride, _1{}));  // (seqlen_k, head_dim_v)
    // (N, D)
    Tensor gdK =
        local_tile(mdK, Shape<Int<kBlockN>, Int<kSlabCols>>{}, make_coord(block.n_block, slab));
    // (N, D)
    Tensor gdV =
        local_tile(mdV, Shape<Int<kBlockN>, Int<kSlabCols>>{}, make_coord(block.n_block, slab));
    typename Traits::GmemTiledCopyStore gmem_tiled_copy_dKV;
    auto gmem_thr_copy_dKV = gmem_tiled_copy_dKV.get_thread_slice(tidx);
    Tensor tdKsdK = gmem_thr_copy_dKV.partition_S(sdK);                // (CPY, CPY_N, CPY_D)
    Tensor tdKgdK = gmem_thr_copy_dKV.partition_D(gdK);                // (CPY, CPY_N, CPY_D)
    Tensor tdVsdV = gmem_thr_copy_dKV.partition_S(sdV);                // (CPY, CPY_N, CPY_D)
    Tensor tdVgdV = gmem_thr_copy_dKV.partition_D(gdV);                // (CPY, CPY_N, CPY_D)
    Tensor tdKVcdKV = gmem_thr_copy_dKV.partition_D(cdKV);             // (CPY, CPY_N, CPY_D)
    Tensor tdKVpdKV = make_tensor<bool>(make_shape(size<2>(tdKgdK)));  // (CPY_D)
    // The slab's columns below head_dim (head_dim_v for dV).
    make_col_predicate(tdKVpdKV, tdKVcdKV, params.head_dim - slab * kSlabCols);
    // dV has head_dim_v columns; its predicate is evaluated at the store (a
    // second array in registers spilled the SM80 backward).
    const auto tdVpdV = cols_below(tdKVcdKV, params.head_dim_v - slab * kSlabCols);  // (CPY_D)
    Tensor tdKrdK = make_fragment_like(tdKsdK);  // (CPY, CPY_N, CPY_D)
    Tensor tdVrdV = make_fragment_like(tdVsdV);  // (CPY, CPY_N, CPY_D)
    copy(gmem_tiled_copy_dKV, tdKsdK, tdKrdK);
    copy(gmem_tiled_copy_dKV, tdVsdV, tdVrdV);
    store_tile_predicated(gmem_tiled_copy_dKV, tdKrdK, tdKgdK, tdKVcdKV, tdKVpdKV, block.cols_left);
    store_tile_predicated(gmem_tiled_copy_dKV, tdVrdV, tdVgdV, tdKVcdKV, tdVpdV, block.cols_left);
  } else {
    const int64_t sum_offset =
        dkv_sum_offset<kBlockN, kHeadDim>(params, binfo, block.batch, block.head_kv) +
        accum_tile_offset<kBlockN, kHeadDim, kSlabCols>(block.n_block, slab) +
        accum_thread_offset(tidx);
    const BwdDkvTurn dkv_turn(params, block, slab, kSlabs);
    dkv_turn.wait(tidx, sync);
    atomic_add_fragment<Traits::kNThreads>(acc_dk, params.dk_sum_ptr + sum_offset);
    atomic_add_fragment<Traits::kNThreads>(acc_dv, params.dv_sum_ptr + sum_offset);
    dkv_turn.release(tidx, sync);
  }
}

// store_dk_dv for a specialised (d_qk, d_v) pair (Traits::kHeadDimV <
// kHeadDim, the Hopper kernel only): dV has an MMA of its own (tiled_mma_dv,
// N = d_v) and Traits's SmemLayoutV, GmemTiledCopyStoreV tiles of kHeadDimV
// columns. Under GQA dV's fp32 sums are rows of kHeadDimV columns (the op
// sizes them by BwdPlan::head_dim_v), as flash_bwd_convert_dkv_kernel reads
// them.
// (A function of its own, so that
// every kernel of one MMA keeps store_dk_dv's code: the SM80 kernel, at 255
// registers, allocated them differently through a shared generic version.)
template <typename Traits, typename TensorAccDK, typename TensorAccDV, typename TiledMmaDK,
          typename ThrMmaDK, typename TiledMmaDV, typename ThrMmaDV, typename Sync = BlockBarrier>
__forceinline__ __device__ void store_dk_dv_pair(
    TensorAccDK& acc_dk, const TensorAccDV& acc_dv, const TiledMmaDK& tiled_mma_dk,
    const ThrMmaDK& thr_mma_dk, const TiledMmaDV& tiled_mma_dv, const ThrMmaDV& thr_mma_dv,
    typename Traits::Element* smem_k, typename Traits::Element* smem_v, const BwdParams& params,
    const BlockInfo& binfo, const BwdKeyBlock& block, int tidx, Sync sync = {}) {
  using Element = typename Traits::Element;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kHeadDimV = Traits::kHeadDimV;
  static_assert(kHeadDimV < kHeadDim, "one width: store_dk_dv");
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dk); ++i) acc_dk(i) *= params.softmax_scale;

  Tensor cdKV = make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{});  // (N, D) -> (row, col)
  Tensor cdV =
      make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDimV>>{});  // (N, Dv) -> (row, col)
  if (block.group == 1) {
    Tensor rdK = convert_type<Element>(acc_dk);  // (MMA, MMA_N, MMA_D)
    Tensor rdV = convert_type<Element>(acc_dv);  // (MMA, MMA_N, MMA_Dv)
    Tensor sdK = make_tensor(make_smem_ptr(smem_k), typename Traits::SmemLayoutKV{});  // (N, D)
    Tensor sdV = make_tensor(make_smem_ptr(smem_v), typename Traits::SmemLayoutV{});   // (N, Dv)
    auto smem_tiled_copy_dK = make_tiled_copy_C(typename Traits::SmemCopyAtomStore{}, tiled_mma_dk);
    auto smem_thr_copy_dK = smem_tiled_copy_dK.get_thread_slice(tidx);
    auto smem_tiled_copy_dV = make_tiled_copy_C(typename Traits::SmemCopyAtomStore{}, tiled_mma_dv);
    auto smem_thr_copy_dV = smem_tiled_copy_dV.get_thread_slice(tidx);
    sync();  // every warp is done reading sK (dQ) and sV (dP)
    copy(smem_tiled_copy_dK, smem_thr_copy_dK.retile_S(rdK), smem_thr_copy_dK.partition_D(sdK));
    copy(smem_tiled_copy_dV, smem_thr_copy_dV.retile_S(rdV), smem_thr_copy_dV.partition_D(sdV));
    sync();

    Element* dk_ptr = static_cast<Element*>(params.dk_ptr) +
                      binfo.k_offset(params.dk, block.batch, block.head_kv);
    Element* dv_ptr = static_cast<Element*>(params.dv_ptr) +
                      binfo.k_offset(params.dv, block.batch, block.head_kv);
    Tensor mdK = make_tensor(make_gmem_ptr(dk_ptr), make_shape(binfo.seqlen_k, params.head_dim),
                             make_stride(params.dk.row_stride, _1{}));  // (seqlen_k, head_dim)
    Tensor mdV = make_tensor(make_gmem_ptr(dv_ptr), make_shape(binfo.seqlen_k, params.head_dim_v),
                             make_stride(params.dv.row_stride, _1{}));  // (seqlen_k, head_dim_v)
    // (N, D)
    Tensor gdK =
        local_tile(mdK, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(block.n_block, 0));
    // (N, Dv)
    Tensor gdV =
        local_tile(mdV, Shape<Int<kBlockN>, Int<kHeadDimV>>{}, make_coord(block.n_block, 0));
    typename Traits::GmemTiledCopyStore gmem_tiled_copy_dK;
    auto gmem_thr_copy_dK = gmem_tiled_copy_dK.get_thread_slice(tidx);
    typename Traits::GmemTiledCopyStoreV gmem_tiled_copy_dV;
    auto gmem_thr_copy_dV = gmem_tiled_copy_dV.get_thread_slice(tidx);
    Tensor tdKsdK = gmem_thr_copy_dK.partition_S(sdK);                 // (CPY, CPY_N, CPY_D)
    Tensor tdKgdK = gmem_thr_copy_dK.partition_D(gdK);                 // (CPY, CPY_N, CPY_D)
    Tensor tdVsdV = gmem_thr_copy_dV.partition_S(sdV);                 // (CPY, CPY_N, CPY_Dv)
    Tensor tdVgdV = gmem_thr_copy_dV.partition_D(gdV);                 // (CPY, CPY_N, CPY_Dv)
    Tensor tdKVcdKV = gmem_thr_copy_dK.partition_D(cdKV);              // (CPY, CPY_N, CPY_D)
    Tensor tdVcdV = gmem_thr_copy_dV.partition_D(cdV);                 // (CPY, CPY_N, CPY_Dv)
    Tensor tdKVpdKV = make_tensor<bool>(make_shape(size<2>(tdKgdK)));  // (CPY_D)
    make_col_predicate(tdKVpdKV, tdKVcdKV, params.head_dim);
    // dV has head_dim_v columns; its predicate is evaluated at the store (a
    // second array in registers spilled the SM80 backward).
    const auto tdVpdV = cols_below(tdVcdV, params.head_dim_v);  // (CPY_Dv)
    Tensor tdKrdK = make_fragment_like(tdKsdK);                 // (CPY, CPY_N, CPY_D)
    Tensor tdVrdV = make_fragment_like(tdVsdV);                 // (CPY, CPY_N, CPY_Dv)
    copy(gmem_tiled_copy_dK, tdKsdK, tdKrdK);
    copy(gmem_tiled_copy_dV, tdVsdV, tdVrdV);
    store_tile_predicated(gmem_tiled_copy_dK, tdKrdK, tdKgdK, tdKVcdKV, tdKVpdKV, block.cols_left);
    store_tile_predicated(gmem_tiled_copy_dV, tdVrdV, tdVgdV, tdVcdV, tdVpdV, block.cols_left);
  } else {
    // The kv head's sums, each in the fragment order of its MMA
    // (bwd_accum_layout.h), dV's rows kHeadDimV wide; deterministic: in head
    // order (BwdDkvTurn).
    const BwdDkvTurn dkv_turn(params, block);
    dkv_turn.wait(tidx, sync);
    atomic_add_fragment<Traits::kNThreads>(
        acc_dk, params.dk_sum_ptr +
                    dkv_sum_offset<kBlockN, kHeadDim>(params, binfo, block.batch, block.head_kv) +
                    accum_tile_offset<kBlockN, kHeadDim, kHeadDim>(block.n_block, 0) +
                    accum_thread_offset(tidx));
    atomic_add_fragment<Traits::kNThreads>(
        acc_dv, params.dv_sum_ptr +
                    dkv_sum_offset<kBlockN, kHeadDimV>(params, binfo, block.batch, block.head_kv) +
                    accum_tile_offset<kBlockN, kHeadDimV, kHeadDimV>(block.n_block, 0) +
                    accum_thread_offset(tidx));
    dkv_turn.release(tidx, sync);
  }
}

}  // namespace flash
