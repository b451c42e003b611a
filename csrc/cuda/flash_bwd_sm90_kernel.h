// The backward main kernel on Hopper's warpgroup MMAs (wgmma, sm90a) for the
// head dims over 128 (the split design of bwd_kernel_traits_sm90.h; the
// head dims up to 128 run flash_bwd_sm90_ws_kernel.h): the same
// FlashAttention-2 schedule as flash_bwd_kernel.h (one thread block per
// (key block, head, batch), K and V resident in shared memory, dK and dV in
// registers across the walk over the query blocks that see the keys, dQ added
// into an fp32 buffer), with the products issued by two warpgroups.
//
// Per query block the warpgroups compute the transposed scores S^T = K Q^T
// and dP^T = V dO^T, each for half of the query columns, so that P^T and
// dS^T come out in the (key, query) orientation that dV += P^T dO and
// dK += dS^T Q take as their A operand; both go through shared memory, where
// each warpgroup reads the whole of them for its half of the head-dim
// columns of dK and dV, and dS for dQ = dS K. It runs the plain score rule
// (causal / local / bounds masking, a positive normal scale); softcap / ALiBi
// / dropout stay on flash_bwd_kernel.h.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>

#include "../common/mask_rule.h"
#include "block_info.h"
#include "bwd_accum_layout.h"
#include "bwd_block_io.h"
#include "bwd_kernel_traits_sm90.h"
#include "flash_bwd_pointwise.h"
#include "params.h"
#include "score_mods.h"
#include "tile_ops.h"
#include "tile_ops_sm90.h"

namespace flash {

using namespace cute;

template <typename Traits>
__forceinline__ __device__ void compute_key_block_sm90(const BwdParams& params,
                                                       const BlockInfo& binfo, int batch,
                                                       int head, int n_block, int split) {
  static_assert(!Traits::kKeysPerWarpGroup,
                "the keys-per-warpgroup design runs flash_bwd_sm90_ws_kernel.h");
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;

  extern __shared__ char smem[];
  const int tidx = threadIdx.x;
  const int seqlen_q = binfo.seqlen_q;
  const int seqlen_k = binfo.seqlen_k;
  const BwdKeyBlock block = bwd_key_block<kBlockM, kBlockN>(params, binfo, batch, head, n_block);
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

  // Shared memory: Q and dO (two buffers each), K, V, dS, P^T, then the row
  // statistics of each buffer.
  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)),
                          typename Traits::SmemLayoutQdO{});  // (M, D, buffer)
  Tensor sQt = make_tensor(sQ.data(), typename Traits::SmemLayoutQdOt{});
  Tensor sdO = make_tensor(sQ.data() + size(sQ), typename Traits::SmemLayoutQdO{});
  Tensor sdOt = make_tensor(sdO.data(), typename Traits::SmemLayoutQdOt{});
  Tensor sK = make_tensor(sdO.data() + size(sdO), typename Traits::SmemLayoutKV{});
  Tensor sKt = make_tensor(sK.data(), typename Traits::SmemLayoutKt{});
  Tensor sV = make_tensor(sK.data() + size(sK), typename Traits::SmemLayoutKV{});
  Tensor sdS = make_tensor(sV.data() + size(sV), typename Traits::SmemLayoutdS{});
  Tensor sdSt = make_tensor(sdS.data(), typename Traits::SmemLayoutdSt{});
  Tensor sPt = make_tensor(sdS.data() + size(sdS), typename Traits::SmemLayoutdSt{});
  float* smem_row_stats = reinterpret_cast<float*>(
      smem + 2 * Traits::kSmemSizeQdO + 2 * Traits::kSmemSizeKV + Traits::kSmemSizedS +
      Traits::kSmemSizeP);

  typename Traits::GmemTiledCopyLoad gmem_tiled_copy;
  auto gmem_thr_copy = gmem_tiled_copy.get_thread_slice(tidx);
  Tensor tQgQ = gmem_thr_copy.partition_S(gQ);  // (CPY, CPY_M, CPY_D, m)
  Tensor tQsQ = gmem_thr_copy.partition_D(sQ);  // (CPY, CPY_M, CPY_D, buffer)
  Tensor tdOgdO = gmem_thr_copy.partition_S(gdO);
  Tensor tdOsdO = gmem_thr_copy.partition_D(sdO);
  Tensor tKgK = gmem_thr_copy.partition_S(gK);
  Tensor tKsK = gmem_thr_copy.partition_D(sK);
  Tensor tVgV = gmem_thr_copy.partition_S(gV);
  Tensor tVsV = gmem_thr_copy.partition_D(sV);
  Tensor cQ = make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{});
  Tensor cKV = make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor tQcQ = gmem_thr_copy.partition_S(cQ);
  Tensor tKVcKV = gmem_thr_copy.partition_S(cKV);
  Tensor tQpQ = make_tensor<bool>(make_shape(size<2>(tQsQ)));
  Tensor tKVpKV = make_tensor<bool>(make_shape(size<2>(tKsK)));
  make_col_predicate(tQpQ, tQcQ, params.head_dim);
  make_col_predicate(tKVpKV, tKVcKV, params.head_dim);
  const bool head_dim_is_full = params.head_dim == kHeadDim;

  auto load_q_do = [&](int m_block, int buffer) {
    const int rows_left = seqlen_q - m_block * kBlockM;
    const bool all_in_bounds = head_dim_is_full && rows_left >= kBlockM;
    Tensor tQsQ_buf = tQsQ(_, _, _, buffer);
    Tensor tdOsdO_buf = tdOsdO(_, _, _, buffer);
    copy_tile_predicated(gmem_tiled_copy, tQgQ(_, _, _, m_block), tQsQ_buf, tQcQ, tQpQ,
                         rows_left, all_in_bounds);
    copy_tile_predicated(gmem_tiled_copy, tdOgdO(_, _, _, m_block), tdOsdO_buf, tQcQ, tQpQ,
                         rows_left, all_in_bounds);
    load_row_stats<kBlockM>(lse_rows + m_block * kBlockM, d_rows + m_block * kBlockM, rows_left,
                            smem_row_stats + buffer * 2 * kBlockM, tidx);
  };

  // Each warpgroup's slice of the products: its 64 keys of S^T, dP^T, dK and
  // dV (split design: its half of the query columns of S^T and dP^T, of the
  // head-dim columns of dK and dV), and its half of dQ. Operands in shared
  // memory are wgmma descriptors.
  typename Traits::TiledMmaSdP tiled_mma_sdp;
  auto thr_mma_sdp = tiled_mma_sdp.get_thread_slice(tidx);
  Tensor tSrK = thr_mma_sdp.partition_fragment_A(sK);
  Tensor tSrQ = thr_mma_sdp.partition_fragment_B(sQ);  // (MMA, MMA_N, MMA_K, buffer)
  Tensor tdPrV = thr_mma_sdp.partition_fragment_A(sV);
  Tensor tdPrdO = thr_mma_sdp.partition_fragment_B(sdO);

  typename Traits::TiledMmadKV tiled_mma_dkv;
  auto thr_mma_dkv = tiled_mma_dkv.get_thread_slice(tidx);
  Tensor tdVrdOt = thr_mma_dkv.partition_fragment_B(sdOt);  // (MMA, MMA_D, MMA_K, buffer)
  Tensor tdKrQt = thr_mma_dkv.partition_fragment_B(sQt);
  Tensor acc_dk = partition_fragment_C(tiled_mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor acc_dv = partition_fragment_C(tiled_mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  clear(acc_dk);
  clear(acc_dv);

  typename Traits::TiledMmadQ tiled_mma_dq;
  auto thr_mma_dq = tiled_mma_dq.get_thread_slice(tidx);
  Tensor tdQrdS = thr_mma_dq.partition_fragment_A(sdS);
  Tensor tdQrKt = thr_mma_dq.partition_fragment_B(sKt);

  Tensor acc_s = partition_fragment_C(tiled_mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
  Tensor acc_dp = partition_fragment_C(tiled_mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
  // P^T and dS^T converted in registers, on their way to shared memory.
  Tensor tdVrPt = make_tensor<Element>(wgmma_acc_layout_as_operand_a(acc_s.layout()));
  Tensor tdKrdSt = make_tensor<Element>(wgmma_acc_layout_as_operand_a(acc_dp.layout()));
  // dS^T (and P^T) registers -> shared, two neighbouring queries (4 bytes)
  // per store.
  auto smem_tiled_copy_PdS =
      make_tiled_copy_C(typename Traits::SmemCopyAtomStore{}, tiled_mma_sdp);
  auto smem_thr_copy_PdS = smem_tiled_copy_PdS.get_thread_slice(tidx);
  Tensor tdSsdS = smem_thr_copy_PdS.partition_D(sdSt);
  Tensor tPsP = smem_thr_copy_PdS.partition_D(sPt);

  // (key, query) of each S^T element this thread holds.
  Tensor cSt = make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockM>>{});
  Tensor tScS = thr_mma_sdp.partition_C(cSt);
  Tensor tScS_rowcol = make_tensor(tScS.data(), wgmma_acc_layout_as_rowcol(tScS.layout()));
  Tensor scores = make_tensor(acc_s.data(), wgmma_acc_layout_as_rowcol(acc_s.layout()));
  Tensor dp = make_tensor(acc_dp.data(), wgmma_acc_layout_as_rowcol(acc_dp.layout()));

  // Copies land through the generic proxy, wgmma reads through the async one:
  // every thread's copies have landed and are visible to wgmma, and every
  // warpgroup is done with the buffers the next copies overwrite.
  auto wait_for_copies = [&]() {
    cute::cp_async_wait<0>();
    cutlass::arch::fence_view_async_shared();
    __syncthreads();
  };

  const int m_block_min = block.m_block_min;
  const int m_block_max = block.m_block_max;
  if (m_block_max > m_block_min) {
    // Prologue: K, V and the last visible query block in flight together.
    // Query blocks run from high to low.
    const bool kv_in_bounds = head_dim_is_full && block.cols_left >= kBlockN;
    copy_tile_predicated(gmem_tiled_copy, tKgK, tKsK, tKVcKV, tKVpKV, block.cols_left,
                         kv_in_bounds);
    copy_tile_predicated(gmem_tiled_copy, tVgV, tVsV, tKVcKV, tKVpKV, block.cols_left,
                         kv_in_bounds);
    load_q_do(m_block_max - 1, 0);
    cute::cp_async_fence();

    int buffer = 0;
    for (int m_block = m_block_max - 1; m_block >= m_block_min; --m_block) {
      const int row_begin = m_block * kBlockM;
      wait_for_copies();  // Q(m), dO(m), their statistics (and K, V)

      warpgroup_fence_operand(acc_s);
      warpgroup_fence_operand(acc_dp);
      warpgroup_arrive();
      wgmma_issue</*kZeroInit=*/true>(tiled_mma_sdp, tSrK, tSrQ(_, _, _, buffer), acc_s);
      warpgroup_commit_batch();
      wgmma_issue</*kZeroInit=*/true>(tiled_mma_sdp, tdPrV, tdPrdO(_, _, _, buffer), acc_dp);
      warpgroup_commit_batch();
      // The next query block's copies are issued behind the wgmmas, which
      // run on their own (H100: +0.5-2.6% at d128 over issuing them first).
      if (m_block > m_block_min) {
        load_q_do(m_block - 1, buffer ^ 1);
        cute::cp_async_fence();
      }
      warpgroup_wait<1>();  // S^T has landed; dP^T may still run
      warpgroup_fence_operand(acc_s);

      const float* row_lse = smem_row_stats + buffer * 2 * kBlockM;
      const float* row_d = row_lse + kBlockM;
      if (!key_tile_fully_visible(row_begin, row_begin + kBlockM, block.col_begin,
                                  block.col_begin + kBlockN, seqlen_q, seqlen_k,
                                  params.window_left, params.window_right)) {
        apply_mask_transposed(scores, tScS_rowcol, block.col_begin, row_begin, seqlen_q, seqlen_k,
                              params.window_left, params.window_right);
      }
      scores_to_p_transposed(scores, tScS_rowcol, row_lse, params.softmax_scale_log2);

      warpgroup_wait<0>();  // dP^T
      warpgroup_fence_operand(acc_dp);
      p_to_ds_transposed(scores, dp, tScS_rowcol, row_d);
      // Converted only now, so that the fp32 P and its bf16 copy are never
      // live together (with 128-query tiles at d64 they spilled).
      convert_type_into(acc_s, tdVrPt);
      convert_type_into(acc_dp, tdKrdSt);
      Tensor tdSrdS = make_tensor(tdKrdSt.data(), acc_dp.layout());
      copy(smem_tiled_copy_PdS, smem_thr_copy_PdS.retile_S(tdSrdS), tdSsdS);

      Tensor acc_dq = partition_fragment_C(tiled_mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
      warpgroup_fence_operand(acc_dv);
      warpgroup_fence_operand(acc_dk);
      warpgroup_fence_operand(tdVrPt);
      warpgroup_fence_operand(tdKrdSt);
      // Every product needs both warpgroups' halves of P^T or dS^T, read
      // from shared memory.
      Tensor tdVsPt = thr_mma_dkv.partition_fragment_A(sPt);
      Tensor tdKsdSt = thr_mma_dkv.partition_fragment_A(sdSt);
      Tensor tPrP = make_tensor(tdVrPt.data(), acc_s.layout());
      copy(smem_tiled_copy_PdS, smem_thr_copy_PdS.retile_S(tPrP), tPsP);
      cutlass::arch::fence_view_async_shared();  // P, dS stores -> wgmma
      __syncthreads();
      warpgroup_fence_operand(acc_dq);
      warpgroup_arrive();
      wgmma_issue</*kZeroInit=*/false>(tiled_mma_dkv, tdVsPt, tdVrdOt(_, _, _, buffer), acc_dv);
      warpgroup_commit_batch();
      wgmma_issue</*kZeroInit=*/true>(tiled_mma_dq, tdQrdS, tdQrKt, acc_dq);
      warpgroup_commit_batch();
      wgmma_issue</*kZeroInit=*/false>(tiled_mma_dkv, tdKsdSt, tdKrQt(_, _, _, buffer), acc_dk);
      warpgroup_commit_batch();
      warpgroup_wait<1>();  // dV, dQ
      warpgroup_fence_operand(acc_dq);
      // Every key block adds into the same dQ rows; in deterministic mode this
      // block is the only writer of its split slice, so the order is fixed.
      atomic_add_fragment<Traits::kNThreads>(
          acc_dq, dq_accum_thread + accum_tile_offset<kBlockM, kHeadDim, kHeadDim>(m_block, 0));
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_dv);
      warpgroup_fence_operand(acc_dk);
      warpgroup_fence_operand(tdVrPt);
      warpgroup_fence_operand(tdKrdSt);
      buffer ^= 1;
    }
  }

  store_dk_dv<Traits>(acc_dk, acc_dv, tiled_mma_dkv, thr_mma_dkv, raw_pointer_cast(sK.data()),
                      raw_pointer_cast(sV.data()), params, binfo, block, tidx);
}

// Grid: (key blocks, or dQ splits when deterministic; heads; batch), as the
// SM80 kernel's.
template <typename Traits>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    flash_bwd_sm90_kernel(const BwdParams params) {
#if defined(CUTE_ARCH_MMA_SM90A_ENABLED)
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const BlockInfo binfo(params, batch);
  const int num_n_blocks = (binfo.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN;
  const int split = params.deterministic ? blockIdx.x : 0;
  for (int n_block = blockIdx.x; n_block < num_n_blocks; n_block += gridDim.x) {
    compute_key_block_sm90<Traits>(params, binfo, batch, head, n_block, split);
    __syncthreads();  // the next key block reuses shared memory
  }
#endif
}

}  // namespace flash
