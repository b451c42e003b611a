// The backward main kernel on Hopper's warpgroup MMAs (wgmma, sm90a),
// warp-specialized. One thread block per (key block, head, batch) as in
// bwd_kernel_sm80.h: K and V resident in shared memory, dK and dV in
// registers across the walk over the query blocks that see the keys (from the
// last down), dQ of each query block added into an fp32 buffer. Per query
// block the two MMA warpgroups compute the transposed scores S^T = K Q^T and
// dP^T = V dO^T, so that P^T and dS^T come out of the accumulators in the
// (key, query) orientation that dV += P^T dO and dK += dS^T Q take as their
// A operand: from registers where each warpgroup owns 64 keys (head dims up
// to 128), through shared memory where the two split the columns (head dims
// 192 and 256; bwd_kernel_traits_sm90.h has both designs). dS always goes
// through shared memory, for dQ = dS K, where each warpgroup needs every key.
//
// The copies are out of the MMA warpgroups' loop:
//   - a producer warpgroup loads K and V once per key block and Q, dO of each
//     query block by TMA (one thread), and the block's lse and D (one warp),
//     into kStages buffers; a stage is announced on its "full" mbarrier once
//     all of it has landed and handed back on its "empty" one once every MMA
//     thread's wgmmas have read it;
//   - the MMA warpgroups meet only on dS (a named barrier of their 256
//     threads), and dS (P^T too) has two buffers, so that a warpgroup may
//     write the next query block's while the other still reads this one's.
// (The cp.async kernel this replaced had every thread issue the copies and
// the whole block meet at the top of every query block: H100, main kernel,
// +5-11% at d128, +10-18% at d64, +10-21% at d192 / d256 over it.)
//
// It runs the causal / local / bounds mask with a positive normal scale and,
// in its kWithScoreMods variant, softcap and ALiBi before the mask, on
// inputs TMA can describe; the launcher sends dropout and anything else to
// bwd_kernel_sm80.h.
#pragma once

#include <cmath>
#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_types.h>

#include "common/mask_rule.h"
#include "cuda/bwd/bwd_accum_layout.h"
#include "cuda/bwd/bwd_block_io.h"
#include "cuda/bwd/bwd_pointwise.h"
#include "cuda/bwd/sm90/bwd_kernel_traits_sm90.h"
#include "cuda/core/block_info.h"
#include "cuda/core/grid_heads_batch.h"
#include "cuda/core/params.h"
#include "cuda/core/score_mods.h"
#include "cuda/core/tile_ops.h"
#include "cuda/core/tile_ops_sm90.h"
#include "cuda/core/tma_loads_sm90.h"

namespace flash {

using namespace cute;

// Named barriers of the MMA warpgroups (ids after those CUTLASS reserves):
// both warpgroups' dS is in shared memory; the epilogue's staging of dK / dV;
// a varlen block's rows of another sequence are zeroed.
enum class BwdSm90NamedBarrier : uint32_t { kDSWritten = 0, kEpilogue = 1, kZeroTails = 2 };

// The epilogue's barrier (store_dk_dv): the 256 MMA threads only.
struct BwdSm90EpilogueBarrier {
  __device__ void operator()() const {
    cutlass::arch::NamedBarrier::arrive_and_wait(256, uint32_t(BwdSm90NamedBarrier::kEpilogue));
  }
};

// Grid: (key blocks, or dQ splits when deterministic; (head, batch) pairs of
// grid_heads_batch.h), as the SM80 kernel's; a block walks key blocks
// blockIdx.x, blockIdx.x + gridDim.x, ... (more than one only in
// deterministic mode).
//
// kWithScoreMods: S^T goes through softcap and ALiBi before the mask, kept
// in the units of ScoreModsInUnits (score_mods.h). Under softcap, P^T and
// dS^T are made in one pass once dP^T has landed too
// (softcapped_p_and_ds_transposed: the softcap's derivative comes from the
// kept score, which P overwrites), so its exponentials no longer run under
// the dP^T product; ALiBi alone keeps that overlap, as the plain rule.
template <typename Traits, bool kWithScoreMods = false>
__global__ void __launch_bounds__(Traits::kNLaunchThreads, 1)
    flash_bwd_sm90_kernel(const BwdParams params, const __grid_constant__ BwdSm90Tma<Traits> tma) {
#if defined(CUTE_ARCH_MMA_SM90A_ENABLED)
  using Element = typename Traits::Element;
  using NamedBarrier = cutlass::arch::NamedBarrier;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kStages = Traits::kStages;
  constexpr int kNMmaThreads = Traits::kNThreads;
  static_assert(kNMmaThreads == 256, "two MMA warpgroups");

  extern __shared__ char smem[];
  const int tidx = threadIdx.x;
  HeadBatch pair;
  if (!block_head_batch(params.nheads, params.batch, pair)) return;
  const int head = pair.head;
  const int batch = pair.batch;
  const BlockInfo binfo(params, batch);
  const int seqlen_q = binfo.seqlen_q;
  const int seqlen_k = binfo.seqlen_k;
  const int num_n_blocks = (seqlen_k + kBlockN - 1) / kBlockN;
  const int split = params.deterministic ? blockIdx.x : 0;

  // Shared memory: Q and dO (kStages buffers each), K, V, dS and (split
  // design) P^T (two buffers each), the row statistics of each Q / dO stage,
  // then the mbarriers.
  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)),
                          typename Traits::SmemLayoutQdO{});  // (M, D, stage)
  Tensor sQt = make_tensor(sQ.data(), typename Traits::SmemLayoutQdOt{});
  Tensor sdO = make_tensor(sQ.data() + size(sQ), typename Traits::SmemLayoutQdO{});
  Tensor sdOt = make_tensor(sdO.data(), typename Traits::SmemLayoutQdOt{});
  Tensor sK = make_tensor(sdO.data() + size(sdO), typename Traits::SmemLayoutKV{});
  Tensor sKt = make_tensor(sK.data(), typename Traits::SmemLayoutKt{});
  Tensor sV = make_tensor(sK.data() + size(sK), typename Traits::SmemLayoutKV{});
  Tensor sdS = make_tensor(sV.data() + size(sV), typename Traits::SmemLayoutdS{});  // (M, N, buf)
  Tensor sdSt = make_tensor(sdS.data(), typename Traits::SmemLayoutdSt{});
  // P^T, in shared memory in the split design only (Traits::kSmemSizeP).
  Tensor sPt = make_tensor(sdS.data() + size(sdS), typename Traits::SmemLayoutdSt{});
  float* smem_row_stats =
      reinterpret_cast<float*>(smem + 2 * Traits::kSmemSizeQdO + 2 * Traits::kSmemSizeKV +
                               Traits::kSmemSizedS + Traits::kSmemSizeP);
  auto& barriers = *reinterpret_cast<typename Traits::Barriers*>(smem + Traits::kSmemSizeTiles);

  if (tidx == 0) {
    CUTE_UNROLL
    for (int s = 0; s < kStages; ++s) {
      // The TMA thread's arrival (with the bytes) and the statistics warp's.
      full_barrier(barriers.q_full[s]).init(1 + 32);
      empty_barrier(barriers.q_empty[s]).init(kNMmaThreads);
    }
    full_barrier(barriers.kv_full).init(1);
    empty_barrier(barriers.kv_empty).init(kNMmaThreads);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  // The block's query-block loads are counted across its key blocks: the
  // j-th uses stage j % kStages, in that stage's (j / kStages)-th round.
  auto stage_of = [](int j) { return j % kStages; };
  auto phase_of = [](int j) { return uint32_t((j / kStages) & 1); };

  if (tidx < 128) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegisters>();
    const int warp = tidx / 32;
    const int lane = tidx % 32;
    if (warp > 1) return;
    const int64_t row_stats_offset = binfo.lse_offset(params, batch, head);
    const float* lse_rows = params.softmax_lse_ptr + row_stats_offset;
    const float* d_rows = params.softmax_d_ptr + row_stats_offset;
    int q_loads = 0;
    int key_blocks = 0;
    for (int n_block = blockIdx.x; n_block < num_n_blocks; n_block += gridDim.x, ++key_blocks) {
      const BwdKeyBlock block =
          bwd_key_block<kBlockM, kBlockN>(params, binfo, batch, head, n_block);
      const bool has_queries = block.m_block_max > block.m_block_min;
      if (warp == 0) {
        if (lane != 0) continue;
        // K and V over the last key block's, once its epilogue (which stages
        // dK / dV over them) is done. Every key block takes one round of the
        // K / V barriers, an empty one too (its epilogue writes zeros through
        // the same tiles), which keeps both sides within one round of each
        // other, where the barriers' parity tells the rounds apart.
        empty_barrier(barriers.kv_empty).wait((key_blocks & 1) ^ 1);
        if (!has_queries) {
          full_barrier(barriers.kv_full).arrive();
          continue;
        }
        // Rows and columns past the tensors' ends land as zeros; a varlen
        // block reads on into the next sequence's rows, which the MMA
        // warpgroups zero.
        Tensor gK = local_tile(tma_kv_of(tma.k, params, binfo, block.head_kv, batch),
                               Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, 0));
        Tensor gV = local_tile(tma_kv_of(tma.v, params, binfo, block.head_kv, batch),
                               Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, 0));
        auto [tKgK, tKsK] = tma_partition(tma.k, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
        auto [tVgV, tVsV] = tma_partition(tma.v, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
        full_barrier(barriers.kv_full).arrive_and_expect_tx(2 * Traits::kSmemSizeKV);
        copy(tma.k.with(barriers.kv_full), tKgK, tKsK);
        copy(tma.v.with(barriers.kv_full), tVgV, tVsV);

        // (M, D, m): every query block of the sequence.
        Tensor gQ = local_tile(tma_q_of(tma.q, params, binfo, head, batch),
                               Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(_, 0));
        Tensor gdO = local_tile(tma_q_of(tma.dout, params, binfo, head, batch),
                                Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(_, 0));
        auto [tQgQ, tQsQ] = tma_partition(tma.q, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
        auto [tdOgdO, tdOsdO] =
            tma_partition(tma.dout, group_modes<0, 2>(sdO), group_modes<0, 2>(gdO));
        for (int m_block = block.m_block_max - 1; m_block >= block.m_block_min;
             --m_block, ++q_loads) {
          const int stage = stage_of(q_loads);
          empty_barrier(barriers.q_empty[stage]).wait(phase_of(q_loads) ^ 1);
          full_barrier(barriers.q_full[stage]).arrive_and_expect_tx(2 * Traits::kSmemSizeQdOBuffer);
          copy(tma.q.with(barriers.q_full[stage]), tQgQ(_, m_block), tQsQ(_, stage));
          copy(tma.dout.with(barriers.q_full[stage]), tdOgdO(_, m_block), tdOsdO(_, stage));
        }
      } else if (has_queries) {
        // The lse and D of each query block, beside its Q and dO: rows past
        // the sequence get lse +inf and D 0, which make their P and dS zero.
        for (int m_block = block.m_block_max - 1; m_block >= block.m_block_min;
             --m_block, ++q_loads) {
          const int stage = stage_of(q_loads);
          const int rows_left = seqlen_q - m_block * kBlockM;
          empty_barrier(barriers.q_empty[stage]).wait(phase_of(q_loads) ^ 1);
          float* stats = smem_row_stats + stage * 2 * kBlockM;
          CUTE_UNROLL
          for (int row = lane; row < kBlockM; row += 32) {
            const bool in_bounds = row < rows_left;
            stats[row] = in_bounds ? lse_rows[m_block * kBlockM + row] : INFINITY;
            stats[kBlockM + row] = in_bounds ? d_rows[m_block * kBlockM + row] : 0.f;
          }
          full_barrier(barriers.q_full[stage]).arrive();
        }
      }
    }
    return;
  }

  // MMA warpgroups: threads [128, 384), indexed from 0 for their partitions
  // (the accumulators' layout, which the conversion kernels read).
  cutlass::arch::warpgroup_reg_alloc<Traits::kMmaRegisters>();
  const int mma_tidx = tidx - 128;

  // Each warpgroup's slice of the products: its 64 keys of S^T, dP^T, dK and
  // dV (split design: its half of the query columns of S^T and dP^T, of the
  // head-dim columns of dK and dV), and its half of dQ. Operands in shared
  // memory are wgmma descriptors.
  typename Traits::TiledMmaSdP tiled_mma_sdp;
  auto thr_mma_sdp = tiled_mma_sdp.get_thread_slice(mma_tidx);
  Tensor tSrK = thr_mma_sdp.partition_fragment_A(sK);
  Tensor tSrQ = thr_mma_sdp.partition_fragment_B(sQ);  // (MMA, MMA_N, MMA_K, stage)
  Tensor tdPrV = thr_mma_sdp.partition_fragment_A(sV);
  Tensor tdPrdO = thr_mma_sdp.partition_fragment_B(sdO);

  typename Traits::TiledMmadKV tiled_mma_dkv;
  auto thr_mma_dkv = tiled_mma_dkv.get_thread_slice(mma_tidx);
  Tensor tdVrdOt = thr_mma_dkv.partition_fragment_B(sdOt);  // (MMA, MMA_D, MMA_K, stage)
  Tensor tdKrQt = thr_mma_dkv.partition_fragment_B(sQt);

  typename Traits::TiledMmadQ tiled_mma_dq;
  auto thr_mma_dq = tiled_mma_dq.get_thread_slice(mma_tidx);
  Tensor tdQrdS = thr_mma_dq.partition_fragment_A(sdS);  // (MMA, MMA_M, MMA_K, buf)
  Tensor tdQrKt = thr_mma_dq.partition_fragment_B(sKt);

  // dS^T (and, split design, P^T) registers -> shared, two neighbouring
  // queries (4 bytes) per store.
  auto smem_tiled_copy_PdS = make_tiled_copy_C(typename Traits::SmemCopyAtomStore{}, tiled_mma_sdp);
  auto smem_thr_copy_PdS = smem_tiled_copy_PdS.get_thread_slice(mma_tidx);
  Tensor tdSsdS = smem_thr_copy_PdS.partition_D(sdSt);  // (CPY, CPY_N, CPY_M, buf)
  Tensor tPsP = smem_thr_copy_PdS.partition_D(sPt);
  // Split design: dV and dK read all of P^T / dS^T from shared memory.
  Tensor tdVsPt = thr_mma_dkv.partition_fragment_A(sPt);  // (MMA, MMA_N, MMA_K, buf)
  Tensor tdKsdSt = thr_mma_dkv.partition_fragment_A(sdSt);

  // (key, query) of each S^T element this thread holds.
  Tensor cSt = make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockM>>{});
  Tensor tScS = thr_mma_sdp.partition_C(cSt);
  Tensor tScS_rowcol = make_tensor(tScS.data(), wgmma_acc_layout_as_rowcol(tScS.layout()));

  const bool has_alibi = kWithScoreMods && params.alibi_slopes != nullptr;
  const ScoreModsInUnits score_mods(
      params.softmax_scale, kWithScoreMods ? params.softcap : 0.f, has_alibi,
      has_alibi ? params.alibi_slopes[batch * params.alibi_batch_stride + head] : 0.f);
  const float exp_scale_log2 =
      kWithScoreMods ? score_mods.exp_scale_log2() : params.softmax_scale_log2;

  // Zeroes rows [first_row, kRows) of a (kRows, head dim) shared tile.
  auto zero_rows_from = [&](auto&& tile, int first_row) {
    constexpr int kRows = decltype(size<0>(tile))::value;
    for (int idx = mma_tidx; idx < (kRows - first_row) * kHeadDim; idx += kNMmaThreads) {
      tile(first_row + idx / kHeadDim, idx % kHeadDim) = Element(0);
    }
  };

  int q_loads = 0;
  int key_blocks = 0;
  for (int n_block = blockIdx.x; n_block < num_n_blocks; n_block += gridDim.x, ++key_blocks) {
    const BwdKeyBlock block = bwd_key_block<kBlockM, kBlockN>(params, binfo, batch, head, n_block);
    float* dq_accum_thread =
        dq_accum_thread_ptr<kBlockM, kHeadDim>(params, binfo, block, split, mma_tidx);
    Tensor acc_dk = partition_fragment_C(tiled_mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
    Tensor acc_dv = partition_fragment_C(tiled_mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
    clear(acc_dk);
    clear(acc_dv);

    const int m_block_min = block.m_block_min;
    const int m_block_max = block.m_block_max;
    full_barrier(barriers.kv_full).wait(key_blocks & 1);
    if (m_block_max > m_block_min) {
      for (int m_block = m_block_max - 1; m_block >= m_block_min; --m_block, ++q_loads) {
        const int row_begin = m_block * kBlockM;
        const int stage = stage_of(q_loads);
        // dS alternates between its buffers: a warpgroup writes buffer b
        // only after both have passed the dS barrier of the other buffer,
        // that is, after both are done reading b (see below).
        const int ds_buffer = q_loads & 1;
        full_barrier(barriers.q_full[stage]).wait(phase_of(q_loads));

        // Varlen: the TMA tiles past a sequence's end hold the next
        // sequence's rows (or rows of no sequence, whatever they hold). Their
        // scores are masked and their P is 0, but 0 times a K, V, Q or dO
        // that is not finite would still reach dQ, dK or dV, so those rows
        // are zeroed before the first product reads them: the key block's
        // last keys, and the last rows of its highest query block.
        if (binfo.varlen && m_block == m_block_max - 1) {
          const bool zero_kv = block.cols_left < kBlockN;
          const bool zero_q = seqlen_q - row_begin < kBlockM;
          if (zero_kv || zero_q) {
            if (zero_kv) {
              zero_rows_from(sK, block.cols_left);
              zero_rows_from(sV, block.cols_left);
            }
            if (zero_q) {
              zero_rows_from(sQ(_, _, stage), seqlen_q - row_begin);
              zero_rows_from(sdO(_, _, stage), seqlen_q - row_begin);
            }
            cutlass::arch::fence_view_async_shared();  // wgmma reads through the async proxy
            NamedBarrier::arrive_and_wait(kNMmaThreads, uint32_t(BwdSm90NamedBarrier::kZeroTails));
          }
        }

        Tensor acc_s = partition_fragment_C(tiled_mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
        Tensor acc_dp = partition_fragment_C(tiled_mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
        Tensor scores = make_tensor(acc_s.data(), wgmma_acc_layout_as_rowcol(acc_s.layout()));
        Tensor dp = make_tensor(acc_dp.data(), wgmma_acc_layout_as_rowcol(acc_dp.layout()));
        warpgroup_fence_operand(acc_s);
        warpgroup_fence_operand(acc_dp);
        warpgroup_arrive();
        wgmma_issue</*kZeroInit=*/true>(tiled_mma_sdp, tSrK, tSrQ(_, _, _, stage), acc_s);
        warpgroup_commit_batch();
        wgmma_issue</*kZeroInit=*/true>(tiled_mma_sdp, tdPrV, tdPrdO(_, _, _, stage), acc_dp);
        warpgroup_commit_batch();
        warpgroup_wait<1>();  // S^T has landed; dP^T may still run
        warpgroup_fence_operand(acc_s);

        const float* row_lse = smem_row_stats + stage * 2 * kBlockM;
        const float* row_d = row_lse + kBlockM;
        if constexpr (kWithScoreMods) {
          score_mods.apply_softcap(scores);
          if (has_alibi) {
            apply_alibi_transposed(scores, tScS_rowcol, block.col_begin, row_begin,
                                   score_mods.alibi_slope, seqlen_q, seqlen_k);
          }
        }
        if (!key_tile_fully_visible(row_begin, row_begin + kBlockM, block.col_begin,
                                    block.col_begin + kBlockN, seqlen_q, seqlen_k,
                                    params.window_left, params.window_right)) {
          apply_mask_transposed(scores, tScS_rowcol, block.col_begin, row_begin, seqlen_q, seqlen_k,
                                params.window_left, params.window_right);
        }
        if (kWithScoreMods && score_mods.has_softcap) {
          warpgroup_wait<0>();  // dP^T
          warpgroup_fence_operand(acc_dp);
          softcapped_p_and_ds_transposed(scores, dp, tScS_rowcol, block.col_begin, row_begin,
                                         seqlen_q, seqlen_k, row_lse, row_d, score_mods);
        } else {
          scores_to_p_transposed(scores, tScS_rowcol, row_lse, exp_scale_log2);
          warpgroup_wait<0>();  // dP^T
          warpgroup_fence_operand(acc_dp);
          p_to_ds_transposed(scores, dp, tScS_rowcol, row_d);
        }
        // P^T and dS^T in the register layout of the dV / dK A operand,
        // converted only now, so that the fp32 P and its 16-bit copy are
        // never live together (with 128-query tiles at d64 they spilled).
        Tensor tdVrPt = make_tensor<Element>(wgmma_acc_layout_as_operand_a(acc_s.layout()));
        Tensor tdKrdSt = make_tensor<Element>(wgmma_acc_layout_as_operand_a(acc_dp.layout()));
        convert_type_into(acc_s, tdVrPt);
        convert_type_into(acc_dp, tdKrdSt);
        Tensor tdSrdS = make_tensor(tdKrdSt.data(), acc_dp.layout());
        copy(smem_tiled_copy_PdS, smem_thr_copy_PdS.retile_S(tdSrdS), tdSsdS(_, _, _, ds_buffer));

        Tensor acc_dq = partition_fragment_C(tiled_mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
        warpgroup_fence_operand(acc_dv);
        warpgroup_fence_operand(acc_dk);
        warpgroup_fence_operand(tdVrPt);
        warpgroup_fence_operand(tdKrdSt);
        if constexpr (Traits::kKeysPerWarpGroup) {
          // dV += P^T dO runs while the warpgroups meet on dS; then dQ = dS K,
          // then dK += dS^T Q, so that dQ lands first and its reductions
          // drain while dK is on the tensor cores (H100, cp.async kernel,
          // against dV and dK before the barrier and dQ last: d128 +8%, d64
          // +6%).
          warpgroup_arrive();
          wgmma_issue</*kZeroInit=*/false>(tiled_mma_dkv, tdVrPt, tdVrdOt(_, _, _, stage), acc_dv);
          warpgroup_commit_batch();
          cutlass::arch::fence_view_async_shared();  // dS stores -> wgmma
          NamedBarrier::arrive_and_wait(kNMmaThreads, uint32_t(BwdSm90NamedBarrier::kDSWritten));
          warpgroup_fence_operand(acc_dq);
          warpgroup_arrive();
          wgmma_issue</*kZeroInit=*/true>(tiled_mma_dq, tdQrdS(_, _, _, ds_buffer), tdQrKt, acc_dq);
          warpgroup_commit_batch();
          wgmma_issue</*kZeroInit=*/false>(tiled_mma_dkv, tdKrdSt, tdKrQt(_, _, _, stage), acc_dk);
          warpgroup_commit_batch();
        } else {
          // Every product needs both warpgroups' halves of P^T or dS^T, read
          // from shared memory (P^T has the buffers of dS).
          Tensor tPrP = make_tensor(tdVrPt.data(), acc_s.layout());
          copy(smem_tiled_copy_PdS, smem_thr_copy_PdS.retile_S(tPrP), tPsP(_, _, _, ds_buffer));
          cutlass::arch::fence_view_async_shared();  // P, dS stores -> wgmma
          NamedBarrier::arrive_and_wait(kNMmaThreads, uint32_t(BwdSm90NamedBarrier::kDSWritten));
          warpgroup_fence_operand(acc_dq);
          warpgroup_arrive();
          wgmma_issue</*kZeroInit=*/false>(tiled_mma_dkv, tdVsPt(_, _, _, ds_buffer),
                                           tdVrdOt(_, _, _, stage), acc_dv);
          warpgroup_commit_batch();
          wgmma_issue</*kZeroInit=*/true>(tiled_mma_dq, tdQrdS(_, _, _, ds_buffer), tdQrKt, acc_dq);
          warpgroup_commit_batch();
          wgmma_issue</*kZeroInit=*/false>(tiled_mma_dkv, tdKsdSt(_, _, _, ds_buffer),
                                           tdKrQt(_, _, _, stage), acc_dk);
          warpgroup_commit_batch();
        }
        warpgroup_wait<1>();  // dV, dQ
        warpgroup_fence_operand(acc_dq);
        // Every key block adds into the same dQ rows; in deterministic mode
        // this block is the only writer of its split slice, so the order is
        // fixed.
        atomic_add_fragment<kNMmaThreads>(
            acc_dq, dq_accum_thread + accum_tile_offset<kBlockM, kHeadDim, kHeadDim>(m_block, 0));
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc_dv);
        warpgroup_fence_operand(acc_dk);
        warpgroup_fence_operand(tdVrPt);
        warpgroup_fence_operand(tdKrdSt);
        // This thread's wgmmas are done with the stage's Q and dO, and it has
        // read the stage's statistics.
        empty_barrier(barriers.q_empty[stage]).arrive();
      }
    }

    store_dk_dv<Traits>(acc_dk, acc_dv, tiled_mma_dkv, thr_mma_dkv, raw_pointer_cast(sK.data()),
                        raw_pointer_cast(sV.data()), params, binfo, block, mma_tidx,
                        BwdSm90EpilogueBarrier{});
    // The epilogue's generic-proxy reads and writes of sK / sV come before
    // the next key block's TMA writes.
    cutlass::arch::fence_view_async_shared();
    empty_barrier(barriers.kv_empty).arrive();
  }
#endif
}

}  // namespace flash
