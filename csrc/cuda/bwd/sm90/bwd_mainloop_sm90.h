// The main loop of the Hopper backward (bwd_kernel_sm90.h), as its two roles:
//   - BwdSm90MainloopLoad, the producer warpgroup: K and V once per key block
//     and Q, dO of each query block by TMA (one thread), the block's lse and D
//     (one warp), into the stages of bwd_pipeline_sm90.h;
//   - BwdSm90MainloopMma, the two MMA warpgroups: per query block S^T, dP^T,
//     then P^T and dS^T, then dV, dQ and dK, dQ handed to the accumulator of
//     bwd_epilogue_sm90.h.
// Shape comments name the modes of each MMA: S^T = K Q^T and dP^T = V dO^T
// have the keys as M and the queries as N; dV += P^T dO and dK += dS^T Q the
// keys as M, the head dim as N, the queries as K; dQ = dS K the queries as M,
// the head dim as N, the keys as K. PIPE is a Q / dO stage, BUF a dS (P^T)
// buffer. D is d_qk's compiled width, Dv d_v's (Traits::kHeadDimV: V, dO,
// dV, and dP^T's K).
#pragma once

#include <cmath>
#include <cstdint>
#include <utility>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "common/mask_rule.h"
#include "cuda/bwd/bwd_block_io.h"
#include "cuda/bwd/bwd_pointwise.h"
#include "cuda/bwd/sm90/bwd_kernel_traits_sm90.h"
#include "cuda/bwd/sm90/bwd_pipeline_sm90.h"
#include "cuda/bwd/sm90/bwd_row_stats_sm90.h"
#include "cuda/core/block_info.h"
#include "cuda/core/dropout.h"
#include "cuda/core/mask.h"
#include "cuda/core/params.h"
#include "cuda/core/score_mods.h"
#include "cuda/core/tile_ops.h"
#include "cuda/core/tile_ops_sm90.h"
#include "cuda/core/tma_loads_sm90.h"

namespace flash {

using namespace cute;

// The producer warpgroup's copies. Only two of its threads load: lane 0 of
// warp 0 issues every TMA copy (load_tiles), warp 1 writes the row
// statistics (load_row_stats); the other warps have left the kernel or add
// dQ. kAscending: the query blocks' order (bwd_sm90_walk_query_blocks).
template <typename Traits, bool kAscending = false>
struct BwdSm90MainloopLoad {
  using Element = typename Traits::Element;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kHeadDimV = Traits::kHeadDimV;
  static_assert(kBlockM % 32 == 0, "the statistics warp's lanes take whole rows of 32");
  using Storage = BwdSm90SharedStorage<Traits>;
  using QStages = BwdSm90QStages<Traits::kStages>;

  const BwdParams& params;
  const BwdSm90Tma<Traits>& tma;
  const BlockInfo& binfo;
  const int head;
  const int batch;
  const float* lse_rows;
  const float* d_rows;

  __forceinline__ __device__ BwdSm90MainloopLoad(const BwdParams& params_,
                                                 const BwdSm90Tma<Traits>& tma_,
                                                 const BlockInfo& binfo_, int head_, int batch_)
      : params(params_), tma(tma_), binfo(binfo_), head(head_), batch(batch_) {
    const int64_t row_stats_offset = binfo.lse_offset(params, batch, head);
    lse_rows = params.softmax_lse_ptr + row_stats_offset;
    d_rows = params.softmax_d_ptr + row_stats_offset;
  }

  // The TMA thread: K and V over the last key block's, once its epilogue
  // (which stages dK / dV over them) is done, then Q and dO of each query
  // block as a stage comes free. Every key block takes one round of the K / V
  // barriers, an empty one too (its epilogue writes zeros through the same
  // tiles), which keeps both sides within one round of each other, where the
  // barriers' parity tells the rounds apart.
  __forceinline__ __device__ void load_tiles(const BwdKeyBlock& block, bool has_queries, int round,
                                             QStages& q_stages) const {
    auto& barriers = Storage::barriers();
    empty_barrier(barriers.kv_empty).wait((round & 1) ^ 1);
    if (!has_queries) {
      full_barrier(barriers.kv_full).arrive();
      return;
    }
    // Rows and columns past the tensors' ends land as zeros; a varlen block
    // reads on into the next sequence's rows, which the MMA warpgroups zero.
    Tensor sK = Storage::k();  // (N,D)
    Tensor sV = Storage::v();  // (N,Dv)
    Tensor gK =
        local_tile(tma_kv_of(tma.k, params, binfo, block.head_kv, batch, params.head_dim),
                   Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(block.n_block, 0));  // (N,D)
    Tensor gV =
        local_tile(tma_kv_of(tma.v, params, binfo, block.head_kv, batch, params.head_dim_v),
                   Shape<Int<kBlockN>, Int<kHeadDimV>>{}, make_coord(block.n_block, 0));  // (N,Dv)
    auto [tKgK, tKsK] =
        tma_partition(tma.k, group_modes<0, 2>(sK), group_modes<0, 2>(gK));  // (TMA), (TMA)
    auto [tVgV, tVsV] =
        tma_partition(tma.v, group_modes<0, 2>(sV), group_modes<0, 2>(gV));  // (TMA), (TMA)
    full_barrier(barriers.kv_full).arrive_and_expect_tx(Traits::kSmemSizeKV + Traits::kSmemSizeV);
    copy(tma.k.with(barriers.kv_full), tKgK, tKsK);
    copy(tma.v.with(barriers.kv_full), tVgV, tVsV);

    Tensor sQ = Storage::q();      // (M,D,PIPE)
    Tensor sdO = Storage::dout();  // (M,Dv,PIPE)
    Tensor gQ = local_tile(tma_q_of(tma.q, params, binfo, head, batch, params.head_dim),
                           Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(_, 0));  // (M,D,m)
    Tensor gdO = local_tile(tma_q_of(tma.dout, params, binfo, head, batch, params.head_dim_v),
                            Shape<Int<kBlockM>, Int<kHeadDimV>>{}, make_coord(_, 0));  // (M,Dv,m)
    auto [tQgQ, tQsQ] =
        tma_partition(tma.q, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));  // (TMA,m), (TMA,PIPE)
    auto [tdOgdO, tdOsdO] = tma_partition(tma.dout, group_modes<0, 2>(sdO),
                                          group_modes<0, 2>(gdO));  // (TMA,m), (TMA,PIPE)
    bwd_sm90_walk_query_blocks<kAscending>(
        block.m_block_min, block.m_block_max, [&](int m_block, bool) {
          const int stage = q_stages.stage();
          empty_barrier(barriers.q_empty[stage]).wait(q_stages.phase() ^ 1);
          full_barrier(barriers.q_full[stage])
              .arrive_and_expect_tx(Traits::kSmemSizeQdOBuffer + Traits::kSmemSizedOBuffer);
          copy(tma.q.with(barriers.q_full[stage]), tQgQ(_, m_block), tQsQ(_, stage));
          copy(tma.dout.with(barriers.q_full[stage]), tdOgdO(_, m_block), tdOsdO(_, stage));
          q_stages.advance();
        });
  }

  // The statistics warp: the lse and D of each query block, beside its Q and
  // dO; rows past the sequence get lse +inf and D 0, which make their P and
  // dS zero. The lse is stored in log2 units (lse_to_log2), once per row
  // here, where each MMA thread converted it again for every column it holds
  // (an FSETP, FSEL and FMUL per column and query block: 48 instructions per
  // warp at d128; PERF_LOG 2026-11-29, "ncu beside FA4").
  __forceinline__ __device__ void load_row_stats(const BwdKeyBlock& block, int lane,
                                                 QStages& q_stages) const {
    auto& barriers = Storage::barriers();
    bwd_sm90_walk_query_blocks<kAscending>(
        block.m_block_min, block.m_block_max, [&](int m_block, bool) {
          const int stage = q_stages.stage();
          const int rows_left = binfo.seqlen_q - m_block * kBlockM;
          empty_barrier(barriers.q_empty[stage]).wait(q_stages.phase() ^ 1);
          float* stats = Storage::row_stats(stage);
          CUTE_UNROLL
          for (int row = lane; row < kBlockM; row += 32) {
            const bool in_bounds = row < rows_left;
            stats[row] = in_bounds ? lse_to_log2(lse_rows[m_block * kBlockM + row]) : INFINITY;
            stats[kBlockM + row] = in_bounds ? d_rows[m_block * kBlockM + row] : 0.f;
          }
          full_barrier(barriers.q_full[stage]).arrive();
          q_stages.advance();
        });
  }
};

// (key, query) of each S^T element a thread holds, as (ROW,COL) of the
// accumulator (wgmma_acc_layout_as_rowcol).
template <typename Traits, typename ThrMmaSdP>
__forceinline__ __device__ auto bwd_sm90_score_coords(const ThrMmaSdP& thr_mma_sdp) {
  Tensor cSt = make_identity_tensor(
      Shape<Int<Traits::kBlockN>, Int<Traits::kBlockM>>{});  // (N,M) -> (key, query)
  Tensor tScS = thr_mma_sdp.partition_C(cSt);                // (MMA,MMA_M,MMA_N)
  return make_tensor(tScS.data(), wgmma_acc_layout_as_rowcol(tScS.layout()));  // (ROW,COL)
}

// The MMA warpgroups' products. Each warpgroup's slice: its 64 keys of S^T,
// dP^T, dK and dV (split design: its half of the query columns of S^T and
// dP^T, of the head-dim columns of dK and dV), and its half of dQ. Operands
// in shared memory are wgmma descriptors, partitioned once per warpgroup (in
// the constructor) and kept for the whole walk.
//
// kWithScoreMods: softcap, ALiBi and, where Traits::kDrawsDropout, dropout
// (each on at run time; docs/dropout_sm90.md, section 6); the plain and
// ordered variants carry none of their code.
template <typename Traits, bool kWithScoreMods, bool kAscending = false>
struct BwdSm90MainloopMma {
  using Element = typename Traits::Element;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kNMmaThreads = Traits::kNThreads;
  static_assert(kNMmaThreads == 256, "two MMA warpgroups");
  static_assert(Traits::kDSBuffers == 2, "dS (P^T) alternates between two buffers");
  using Storage = BwdSm90SharedStorage<Traits>;
  using QStages = BwdSm90QStages<Traits::kStages>;
  // The score-mods variant with shuffled statistics (128 rows) makes P^T and
  // dS^T in their 16-bit registers (score_mods_p_and_ds).
  static constexpr bool kConvertInPointwise = kWithScoreMods && Traits::kShuffleRowStats;
  // Dropout's keep mask, replayed where a thread has registers to spare for
  // its draws under S^T (plan.h bwd_sm90_draws_dropout): 64-row query blocks,
  // whose pass has P^T in fp32 after dS^T is made.
  static constexpr bool kDrawsDropout = kWithScoreMods && Traits::kDrawsDropout;
  static_assert(!kDrawsDropout || !kConvertInPointwise, "the mask zeroes P^T in fp32");
  // The columns whose lse a thread reads under S^T and dP^T, before their
  // wait, as FA3's mainloop reads its lse; the rest right after it. The
  // source page had the first exponential waiting on these loads (about 7%
  // of the d128 kernel's stall samples), yet reading them early measured
  // level on the H200 (PERF_LOG 2026-11-29 "statistics before the waits",
  // "candidate6 ba28c77"); all 16 read early spilled 64 more bytes.
  static constexpr int kLseColumnsEarly = 4;

  using TiledMmaSdP = typename Traits::TiledMmaSdP;
  using TiledMmadKV = typename Traits::TiledMmadKV;
  using TiledMmadV = typename Traits::TiledMmadV;
  using TiledMmadQ = typename Traits::TiledMmadQ;
  using ThrMmaSdP = decltype(TiledMmaSdP{}.get_thread_slice(0));
  using ThrMmadKV = decltype(TiledMmadKV{}.get_thread_slice(0));
  using ThrMmadV = decltype(TiledMmadV{}.get_thread_slice(0));
  using ThrMmadQ = decltype(TiledMmadQ{}.get_thread_slice(0));
  using SmemTiledCopyPdS =
      decltype(make_tiled_copy_C(typename Traits::SmemCopyAtomStore{}, TiledMmaSdP{}));
  using SmemThrCopyPdS = decltype(SmemTiledCopyPdS{}.get_thread_slice(0));
  // The types of the partitions below, of ThrMma's operands or of the dS
  // store's destination, over a shared-memory view of type T.
  template <typename ThrMma, typename T>
  using FragmentA = decltype(std::declval<const ThrMma&>().partition_fragment_A(std::declval<T>()));
  template <typename ThrMma, typename T>
  using FragmentB = decltype(std::declval<const ThrMma&>().partition_fragment_B(std::declval<T>()));
  template <typename T>
  using SmemPartition =
      decltype(std::declval<const SmemThrCopyPdS&>().partition_D(std::declval<T>()));
  using SmemQdO = decltype(Storage::q());
  using SmemQdOt = decltype(Storage::qt());
  using SmemdO = decltype(Storage::dout());
  using SmemdOt = decltype(Storage::doutt());
  using SmemV = decltype(Storage::v());
  using SmemKV = decltype(Storage::k());
  using SmemKt = decltype(Storage::kt());
  using SmemdS = decltype(Storage::ds());
  using SmemdSt = decltype(Storage::dst());
  // dS^T / P^T as the register stores see them: the swizzle applied to the
  // element offset from the buffer's (swizzle-aligned) base, not to the
  // 64-bit address. Swizzling the address lost its shared-memory space: the
  // 16 stores per thread and query block were generic ST.E behind 64-bit
  // address arithmetic (~100 instructions per warp at d128, and registers
  // that spilled; PERF_LOG 2026-11-29, "ncu beside FA4"). The same bytes.
  using SmemdStStore = decltype(as_position_independent_swizzle_tensor(Storage::dst()));
  using ScoreCoords = decltype(bwd_sm90_score_coords<Traits>(std::declval<const ThrMmaSdP&>()));
  // A thread's keep bits of S^T (ROW,COL): one nibble per chunk of 8 query
  // columns.
  using DropoutMask =
      TransposedDropoutMask<decltype(size<1>(std::declval<const ScoreCoords&>()))::value / 2>;

  const BwdParams& params;
  const BlockInfo& binfo;
  const int mma_tidx;
  // The warpgroup's first thread, warp-uniform: the operand descriptors below
  // are partitioned from it (warp_group_first_thread), the accumulators and
  // the dS store from mma_tidx.
  const int wg_tidx;

  TiledMmaSdP tiled_mma_sdp;
  ThrMmaSdP thr_mma_sdp;
  FragmentA<ThrMmaSdP, SmemKV> tSrK;   // (MMA,MMA_M,MMA_K)
  FragmentB<ThrMmaSdP, SmemQdO> tSrQ;  // (MMA,MMA_N,MMA_K,PIPE)
  // dP^T through S^T's MMA (Traits::TiledMmadP is its type), K = d_v.
  FragmentA<ThrMmaSdP, SmemV> tdPrV;    // (MMA,MMA_M,MMA_K)
  FragmentB<ThrMmaSdP, SmemdO> tdPrdO;  // (MMA,MMA_N,MMA_K,PIPE)
  TiledMmadKV tiled_mma_dkv;
  ThrMmadKV thr_mma_dkv;
  // dV's MMA: dK's where d_v = d_qk, N = d_v (or its half) for a pair.
  TiledMmadV tiled_mma_dv;
  ThrMmadV thr_mma_dv;
  FragmentB<ThrMmadV, SmemdOt> tdVrdOt;   // (MMA,MMA_N,MMA_K,PIPE)
  FragmentB<ThrMmadKV, SmemQdOt> tdKrQt;  // (MMA,MMA_N,MMA_K,PIPE)
  TiledMmadQ tiled_mma_dq;
  ThrMmadQ thr_mma_dq;
  FragmentA<ThrMmadQ, SmemdS> tdQrdS;  // (MMA,MMA_M,MMA_K,BUF)
  FragmentB<ThrMmadQ, SmemKt> tdQrKt;  // (MMA,MMA_N,MMA_K)
  // dS^T (and, split design, P^T) registers -> shared, two neighbouring
  // queries (4 bytes) per store.
  SmemTiledCopyPdS smem_tiled_copy_PdS;
  SmemThrCopyPdS smem_thr_copy_PdS;
  SmemPartition<SmemdStStore> tdSsdS;  // (CPY,CPY_M,CPY_N,BUF)
  SmemPartition<SmemdStStore> tPsP;    // (CPY,CPY_M,CPY_N,BUF)
  // Split design: dV and dK read all of P^T / dS^T from shared memory.
  FragmentA<ThrMmadV, SmemdSt> tdVsPt;    // (MMA,MMA_M,MMA_K,BUF)
  FragmentA<ThrMmadKV, SmemdSt> tdKsdSt;  // (MMA,MMA_M,MMA_K,BUF)
  ScoreCoords tScS_rowcol;                // (ROW,COL)

  const bool has_alibi;
  const bool has_dropout;
  const ScoreModsInUnits score_mods;
  const float exp_scale_log2;

  __forceinline__ __device__ BwdSm90MainloopMma(const BwdParams& params_, const BlockInfo& binfo_,
                                                int head, int batch, int mma_tidx_)
      : params(params_),
        binfo(binfo_),
        mma_tidx(mma_tidx_),
        wg_tidx(warp_group_first_thread(mma_tidx_)),
        thr_mma_sdp(tiled_mma_sdp.get_thread_slice(mma_tidx)),
        tSrK(tiled_mma_sdp.get_thread_slice(wg_tidx).partition_fragment_A(Storage::k())),
        tSrQ(tiled_mma_sdp.get_thread_slice(wg_tidx).partition_fragment_B(Storage::q())),
        tdPrV(tiled_mma_sdp.get_thread_slice(wg_tidx).partition_fragment_A(Storage::v())),
        tdPrdO(tiled_mma_sdp.get_thread_slice(wg_tidx).partition_fragment_B(Storage::dout())),
        thr_mma_dkv(tiled_mma_dkv.get_thread_slice(mma_tidx)),
        thr_mma_dv(tiled_mma_dv.get_thread_slice(mma_tidx)),
        tdVrdOt(tiled_mma_dv.get_thread_slice(wg_tidx).partition_fragment_B(Storage::doutt())),
        tdKrQt(tiled_mma_dkv.get_thread_slice(wg_tidx).partition_fragment_B(Storage::qt())),
        thr_mma_dq(tiled_mma_dq.get_thread_slice(mma_tidx)),
        tdQrdS(tiled_mma_dq.get_thread_slice(wg_tidx).partition_fragment_A(Storage::ds())),
        tdQrKt(tiled_mma_dq.get_thread_slice(wg_tidx).partition_fragment_B(Storage::kt())),
        smem_tiled_copy_PdS(make_tiled_copy_C(typename Traits::SmemCopyAtomStore{}, tiled_mma_sdp)),
        smem_thr_copy_PdS(smem_tiled_copy_PdS.get_thread_slice(mma_tidx)),
        tdSsdS(
            smem_thr_copy_PdS.partition_D(as_position_independent_swizzle_tensor(Storage::dst()))),
        tPsP(smem_thr_copy_PdS.partition_D(as_position_independent_swizzle_tensor(Storage::pt()))),
        tdVsPt(tiled_mma_dv.get_thread_slice(wg_tidx).partition_fragment_A(Storage::pt())),
        tdKsdSt(tiled_mma_dkv.get_thread_slice(wg_tidx).partition_fragment_A(Storage::dst())),
        tScS_rowcol(bwd_sm90_score_coords<Traits>(thr_mma_sdp)),
        has_alibi(kWithScoreMods && params.alibi_slopes != nullptr),
        has_dropout(kDrawsDropout && params.dropout_p > 0.f),
        score_mods(params.softmax_scale, kWithScoreMods ? params.softcap : 0.f, has_alibi,
                   has_alibi ? params.alibi_slopes[batch * params.alibi_batch_stride + head] : 0.f),
        exp_scale_log2(kWithScoreMods ? score_mods.exp_scale_log2() : params.softmax_scale_log2) {}

  // dK and dV of one key block, accumulated over the query blocks that see
  // it, in the order of bwd_sm90_walk_query_blocks; each block's dQ goes to
  // dq_accum. (first is compared in the walk, where both sides are loop
  // values: compared inside query_block against its parameter, the operands
  // swap and the SASS changes.)
  template <typename TensorAccDK, typename TensorAccDV, typename DQAccum>
  __forceinline__ __device__ void mma(const BwdKeyBlock& block, int round, QStages& q_stages,
                                      TensorAccDK& acc_dk, TensorAccDV& acc_dv,
                                      const DQAccum& dq_accum) {
    const int m_block_min = block.m_block_min;
    const int m_block_max = block.m_block_max;
    full_barrier(Storage::barriers().kv_full).wait(round & 1);
    if (m_block_max > m_block_min) {
      bwd_sm90_walk_query_blocks<kAscending>(
          m_block_min, m_block_max, [&](int m_block, bool first) {
            query_block(block, m_block, first, q_stages, acc_dk, acc_dv, dq_accum);
            q_stages.advance();
          });
    }
  }

 private:
  // One query block (first: the walk's first): its Q / dO stage waited for,
  // handed back at the end.
  template <typename TensorAccDK, typename TensorAccDV, typename DQAccum>
  __forceinline__ __device__ void query_block(const BwdKeyBlock& block, int m_block, bool first,
                                              const QStages& q_stages, TensorAccDK& acc_dk,
                                              TensorAccDV& acc_dv, const DQAccum& dq_accum) {
    auto& barriers = Storage::barriers();
    const int row_begin = m_block * kBlockM;
    const int stage = q_stages.stage();
    // dS alternates between its buffers: a warpgroup writes buffer b only
    // after both have passed the dS barrier of the other buffer, that is,
    // after both are done reading b (issue_dv_dq_dk).
    const int ds_buffer = q_stages.count & 1;
    full_barrier(barriers.q_full[stage]).wait(q_stages.phase());
    // The walk's first block zeroes the key tail; the highest (the first
    // unless kAscending) the query tail.
    if (binfo.varlen && (kAscending ? first || m_block == block.m_block_max - 1 : first)) {
      zero_varlen_tails(block, row_begin, stage, first);
    }

    Tensor acc_s = partition_fragment_C(tiled_mma_sdp,
                                        Shape<Int<kBlockN>, Int<kBlockM>>{});  // (MMA,MMA_M,MMA_N)
    Tensor acc_dp = partition_fragment_C(tiled_mma_sdp,
                                         Shape<Int<kBlockN>, Int<kBlockM>>{});  // (MMA,MMA_M,MMA_N)
    // The registers under S^T that Traits::kDrawsDropout counts.
    static_assert(!kDrawsDropout || decltype(size(acc_s) + size(acc_dp) + size(acc_dk) +
                                             size(acc_dv))::value == Traits::kAccumulatorRegisters,
                  "S^T, dP^T, dK and dV as the traits count them");
    DropoutMask dropout_mask;
    Tensor tLSErLSE = make_tensor<float>(make_shape(size<1>(tScS_rowcol)));  // (COL)
    issue_s_dp(acc_s, acc_dp, stage, [&] {
      // Under S^T and dP^T: the first columns' lse (kLseColumnsEarly; the
      // shuffled statistics load theirs in their pass), and the draws, which
      // need only (key, query).
      if constexpr (!Traits::kShuffleRowStats) {
        load_column_stats<0, kLseColumnsEarly>(Storage::row_stats(stage), tScS_rowcol, tLSErLSE);
      }
      if constexpr (kDrawsDropout) {
        if (has_dropout) draw_dropout(dropout_mask, block, row_begin);
      }
    });
    // P^T and dS^T in the register layout of the dV / dK A operand,
    // converted only after the pointwise pass, so that the fp32 P and its
    // 16-bit copy are never live together (with 128-query tiles at d64 they
    // spilled); the score-mods variant at 128 rows converts column pairs as
    // it makes them (score_mods_p_and_ds_transposed_shuffled).
    Tensor tdVrPt =
        make_tensor<Element>(wgmma_acc_layout_as_operand_a(acc_s.layout()));  // (MMA,MMA_M,MMA_K)
    Tensor tdKrdSt =
        make_tensor<Element>(wgmma_acc_layout_as_operand_a(acc_dp.layout()));  // (MMA,MMA_M,MMA_K)
    if constexpr (kConvertInPointwise) {
      Tensor p_out = make_tensor(tdVrPt.data(),
                                 wgmma_acc_layout_as_rowcol(acc_s.layout()));  // (ROW,COL)
      Tensor ds_out = make_tensor(tdKrdSt.data(),
                                  wgmma_acc_layout_as_rowcol(acc_dp.layout()));  // (ROW,COL)
      score_mods_p_and_ds(acc_s, acc_dp, p_out, ds_out, block, row_begin, stage);
    } else {
      p_and_ds(acc_s, acc_dp, block, row_begin, stage, tLSErLSE, dropout_mask);
      convert_type_into(acc_s, tdVrPt);
      convert_type_into(acc_dp, tdKrdSt);
    }
    Tensor tdSrdS = make_tensor(tdKrdSt.data(), acc_dp.layout());  // (MMA,MMA_M,MMA_N)
    // dS^T as the dK operand and as the dS store: one register array.
    CUTE_STATIC_ASSERT_V(size(tdKrdSt) == size(acc_dp));
    CUTE_STATIC_ASSERT_V(size(tdVrPt) == size(acc_s));
    copy(smem_tiled_copy_PdS, smem_thr_copy_PdS.retile_S(tdSrdS), tdSsdS(_, _, _, ds_buffer));

    Tensor acc_dq = partition_fragment_C(
        tiled_mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});  // (MMA,MMA_M,MMA_N)
    issue_dv_dq_dk(acc_s, tdVrPt, tdKrdSt, acc_dq, acc_dk, acc_dv, stage, ds_buffer);
    warpgroup_wait<1>();  // dV, dQ
    warpgroup_fence_operand(acc_dq);
    dq_accum.add(acc_dq, m_block);
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_dv);
    warpgroup_fence_operand(acc_dk);
    warpgroup_fence_operand(tdVrPt);
    warpgroup_fence_operand(tdKrdSt);
    // This thread's wgmmas are done with the stage's Q and dO, and it has
    // read the stage's statistics.
    empty_barrier(barriers.q_empty[stage]).arrive();
  }

  // Varlen: the TMA tiles past a sequence's end hold the next sequence's rows
  // (or rows of no sequence, whatever they hold). Their scores are masked and
  // their P is 0, but 0 times a K, V, Q or dO that is not finite would still
  // reach dQ, dK or dV, so those rows are zeroed before the first product
  // reads them: the key block's last keys (with_keys: at the walk's first
  // query block), and the last rows of its highest query block.
  __forceinline__ __device__ void zero_varlen_tails(const BwdKeyBlock& block, int row_begin,
                                                    int stage, bool with_keys) const {
    const int seqlen_q = binfo.seqlen_q;
    const bool zero_kv = with_keys && block.cols_left < kBlockN;
    const bool zero_q = seqlen_q - row_begin < kBlockM;
    if (zero_kv || zero_q) {
      if (zero_kv) {
        zero_rows_from(Storage::k(), block.cols_left);
        zero_rows_from(Storage::v(), block.cols_left);
      }
      if (zero_q) {
        zero_rows_from(Storage::q()(_, _, stage), seqlen_q - row_begin);
        zero_rows_from(Storage::dout()(_, _, stage), seqlen_q - row_begin);
      }
      cutlass::arch::fence_view_async_shared();  // wgmma reads through the async proxy
      cutlass::arch::NamedBarrier::arrive_and_wait(kNMmaThreads,
                                                   uint32_t(BwdSm90NamedBarrier::kZeroTails));
    }
  }

  // Zeroes rows [first_row, kRows) of a (kRows, kCols) shared tile: kCols
  // the head dim, or d_v for V and dO.
  template <typename TensorTile>
  __forceinline__ __device__ void zero_rows_from(TensorTile&& tile, int first_row) const {
    constexpr int kRows = decltype(size<0>(tile))::value;
    constexpr int kCols = decltype(size<1>(tile))::value;
    static_assert(kCols == kHeadDim || kCols == Traits::kHeadDimV, "(rows, head dim or d_v)");
    for (int idx = mma_tidx; idx < (kRows - first_row) * kCols; idx += kNMmaThreads) {
      tile(first_row + idx / kCols, idx % kCols) = Element(0);
    }
  }

  // S^T = K Q^T, then dP^T = V dO^T, then under_products() while they run;
  // returns once S^T has landed, dP^T may still run.
  template <typename TensorAcc, typename UnderProducts>
  __forceinline__ __device__ void issue_s_dp(TensorAcc& acc_s, TensorAcc& acc_dp, int stage,
                                             UnderProducts&& under_products) {
    warpgroup_fence_operand(acc_s);
    warpgroup_fence_operand(acc_dp);
    warpgroup_arrive();
    wgmma_issue</*kZeroInit=*/true>(tiled_mma_sdp, tSrK, tSrQ(_, _, _, stage), acc_s);
    warpgroup_commit_batch();
    wgmma_issue</*kZeroInit=*/true>(tiled_mma_sdp, tdPrV, tdPrdO(_, _, _, stage), acc_dp);
    warpgroup_commit_batch();
    under_products();
    warpgroup_wait<1>();  // S^T has landed; dP^T may still run
    warpgroup_fence_operand(acc_s);
  }

  // The keep bits of this query block's S^T (kDrawsDropout), as the forward
  // drew them. Seed and offset read per query block (two cached loads under
  // the wgmmas), not held across the walk, as in the forward, where holding
  // them spilled (docs/dropout_sm90.md, section 5).
  __forceinline__ __device__ void draw_dropout(DropoutMask& dropout_mask, const BwdKeyBlock& block,
                                               int row_begin) const {
    dropout_mask.draw(tScS_rowcol, block.col_begin, row_begin,
                      dropout_state_of(params, block.batch, block.head));
  }

  // S^T -> P^T in acc_s and dP^T -> dS^T in acc_dp: the score mods, the mask,
  // the exponentials against the stage's lse (tLSErLSE, read under the
  // products, unless kShuffleRowStats), dS against its D, and dropout as the
  // SM80 backward applies it (scores_to_p_and_ds): dP^T masked and rescaled
  // before dS^T is made from it, P^T after (dS^T takes the undropped P^T).
  // Waits for dP^T.
  template <typename TensorAcc, typename TensorStats>
  __forceinline__ __device__ void p_and_ds(TensorAcc& acc_s, TensorAcc& acc_dp,
                                           const BwdKeyBlock& block, int row_begin, int stage,
                                           TensorStats& tLSErLSE, const DropoutMask& dropout_mask) {
    Tensor scores =
        make_tensor(acc_s.data(), wgmma_acc_layout_as_rowcol(acc_s.layout()));  // (ROW,COL)
    Tensor dp =
        make_tensor(acc_dp.data(), wgmma_acc_layout_as_rowcol(acc_dp.layout()));  // (ROW,COL)
    // The mask and the pointwise P / dS read S^T's coordinates.
    CUTE_STATIC_ASSERT_V(size<0>(scores) == size<0>(tScS_rowcol));
    CUTE_STATIC_ASSERT_V(size<1>(scores) == size<1>(tScS_rowcol));
    const int seqlen_q = binfo.seqlen_q;
    const int seqlen_k = binfo.seqlen_k;
    const float* row_lse_log2 = Storage::row_stats(stage);
    const float* row_d = row_lse_log2 + kBlockM;
    if constexpr (!Traits::kShuffleRowStats) {
      load_column_stats<kLseColumnsEarly, decltype(size(tLSErLSE))::value>(row_lse_log2,
                                                                           tScS_rowcol, tLSErLSE);
    }
    if constexpr (kWithScoreMods) {
      score_mods.keep(scores);
      if (has_alibi) {
        apply_alibi_transposed(scores, tScS_rowcol, block.col_begin, row_begin,
                               score_mods.alibi_slope, seqlen_q, seqlen_k);
      }
    }
    if (!key_tile_fully_visible(row_begin, row_begin + kBlockM, block.col_begin,
                                block.col_begin + kBlockN, seqlen_q, seqlen_k, params.window_left,
                                params.window_right)) {
      if constexpr (Traits::kShuffleRowStats) {
        apply_mask_transposed_by_offset(scores, tScS_rowcol, block.col_begin, row_begin, seqlen_q,
                                        seqlen_k, params.window_left, params.window_right);
      } else {
        apply_mask_transposed(scores, tScS_rowcol, block.col_begin, row_begin, seqlen_q, seqlen_k,
                              params.window_left, params.window_right);
      }
    }
    if constexpr (Traits::kShuffleRowStats) {
      static_assert(!kWithScoreMods, "score_mods_p_and_ds");
      const BwdSm90ShuffledRowStats<kBlockM> stats(row_lse_log2, row_d, mma_tidx % 32);
      scores_to_p_transposed_shuffled(scores, stats, exp_scale_log2);
      warpgroup_wait<0>();  // dP^T
      warpgroup_fence_operand(acc_dp);
      p_to_ds_transposed_shuffled(scores, dp, stats);
    } else if (kWithScoreMods && score_mods.has_softcap) {
      warpgroup_wait<0>();  // dP^T
      warpgroup_fence_operand(acc_dp);
      Tensor tDrD = make_tensor<float>(make_shape(size<1>(tScS_rowcol)));  // (COL)
      load_column_stats<0, decltype(size(tDrD))::value>(row_d, tScS_rowcol, tDrD);
      if constexpr (kDrawsDropout) {
        if (has_dropout) dropout_mask.apply(dp, params.dropout_rescale);
      }
      softcapped_p_and_ds_transposed(scores, dp, tScS_rowcol, block.col_begin, row_begin, seqlen_q,
                                     seqlen_k, tLSErLSE, tDrD, score_mods);
      if constexpr (kDrawsDropout) {
        if (has_dropout) dropout_mask.apply(scores, params.dropout_rescale);
      }
    } else {
      scores_to_p_transposed(scores, tLSErLSE, exp_scale_log2);
      warpgroup_wait<0>();  // dP^T
      warpgroup_fence_operand(acc_dp);
      // D only now: its wait is short, and read earlier it would be live
      // beside everything the products hold (PERF_LOG 2026-11-29
      // "statistics before the waits").
      Tensor tDrD = make_tensor<float>(make_shape(size<1>(tScS_rowcol)));  // (COL)
      load_column_stats<0, decltype(size(tDrD))::value>(row_d, tScS_rowcol, tDrD);
      if constexpr (kDrawsDropout) {
        if (has_dropout) dropout_mask.apply(dp, params.dropout_rescale);
      }
      p_to_ds_transposed(scores, dp, tDrD);
      if constexpr (kDrawsDropout) {
        if (has_dropout) dropout_mask.apply(scores, params.dropout_rescale);
      }
    }
  }

  // The score-mods variant at 128 rows (kConvertInPointwise): the score
  // mods and the mask on S^T, then, once dP^T has landed, P^T and dS^T
  // made and converted into p_out, ds_out ((ROW,COL) views of the dV / dK
  // operand registers) in one pass, softcap or not.
  template <typename TensorAcc, typename TensorOut>
  __forceinline__ __device__ void score_mods_p_and_ds(TensorAcc& acc_s, TensorAcc& acc_dp,
                                                      TensorOut& p_out, TensorOut& ds_out,
                                                      const BwdKeyBlock& block, int row_begin,
                                                      int stage) {
    Tensor scores =
        make_tensor(acc_s.data(), wgmma_acc_layout_as_rowcol(acc_s.layout()));  // (ROW,COL)
    Tensor dp =
        make_tensor(acc_dp.data(), wgmma_acc_layout_as_rowcol(acc_dp.layout()));  // (ROW,COL)
    CUTE_STATIC_ASSERT_V(size<0>(scores) == size<0>(tScS_rowcol));
    CUTE_STATIC_ASSERT_V(size<1>(scores) == size<1>(tScS_rowcol));
    const int seqlen_q = binfo.seqlen_q;
    const int seqlen_k = binfo.seqlen_k;
    score_mods.keep(scores);
    if (has_alibi) {
      apply_alibi_transposed(scores, tScS_rowcol, block.col_begin, row_begin,
                             score_mods.alibi_slope, seqlen_q, seqlen_k);
    }
    if (!key_tile_fully_visible(row_begin, row_begin + kBlockM, block.col_begin,
                                block.col_begin + kBlockN, seqlen_q, seqlen_k, params.window_left,
                                params.window_right)) {
      apply_mask_transposed_by_offset(scores, tScS_rowcol, block.col_begin, row_begin, seqlen_q,
                                      seqlen_k, params.window_left, params.window_right);
    }
    warpgroup_wait<0>();  // dP^T
    warpgroup_fence_operand(acc_dp);
    // The statistics only now, one held group at a time (the pass loads
    // them), not live through the score mods, the mask and the wait.
    const float* row_lse_log2 = Storage::row_stats(stage);
    BwdSm90ShuffledRowStats<kBlockM> stats(row_lse_log2, row_lse_log2 + kBlockM, mma_tidx % 32,
                                           true_type{});
    // Softcap or not, as two passes, not a test per element.
    if (score_mods.has_softcap) {
      score_mods_p_and_ds_transposed_shuffled</*kSoftcap=*/true>(
          scores, dp, p_out, ds_out, tScS_rowcol, block.col_begin, row_begin, seqlen_q, seqlen_k,
          stats, score_mods);
    } else {
      score_mods_p_and_ds_transposed_shuffled</*kSoftcap=*/false>(
          scores, dp, p_out, ds_out, tScS_rowcol, block.col_begin, row_begin, seqlen_q, seqlen_k,
          stats, score_mods);
    }
  }

  // dV += P^T dO, dQ = dS K, dK += dS^T Q, in three wgmma batches, behind the
  // dS barrier of the two warpgroups (dS^T is already in shared memory).
  template <typename TensorAccS, typename TensorOpA, typename TensorAccDQ, typename TensorAccDK,
            typename TensorAccDV>
  __forceinline__ __device__ void issue_dv_dq_dk(const TensorAccS& acc_s, TensorOpA& tdVrPt,
                                                 TensorOpA& tdKrdSt, TensorAccDQ& acc_dq,
                                                 TensorAccDK& acc_dk, TensorAccDV& acc_dv,
                                                 int stage, int ds_buffer) {
    warpgroup_fence_operand(acc_dv);
    warpgroup_fence_operand(acc_dk);
    warpgroup_fence_operand(tdVrPt);
    warpgroup_fence_operand(tdKrdSt);
    if constexpr (Traits::kKeysPerWarpGroup) {
      // dV += P^T dO runs while the warpgroups meet on dS; then dQ = dS K,
      // then dK += dS^T Q, so that dQ lands first and its reductions drain
      // while dK is on the tensor cores (against dV and dK before the barrier
      // and dQ last: PERF_LOG 2026-11-24 ee3e75a).
      warpgroup_arrive();
      wgmma_issue</*kZeroInit=*/false>(tiled_mma_dv, tdVrPt, tdVrdOt(_, _, _, stage), acc_dv);
      warpgroup_commit_batch();
      cutlass::arch::fence_view_async_shared();  // dS stores -> wgmma
      cutlass::arch::NamedBarrier::arrive_and_wait(kNMmaThreads,
                                                   uint32_t(BwdSm90NamedBarrier::kDSWritten));
      warpgroup_fence_operand(acc_dq);
      warpgroup_arrive();
      wgmma_issue</*kZeroInit=*/true>(tiled_mma_dq, tdQrdS(_, _, _, ds_buffer), tdQrKt, acc_dq);
      warpgroup_commit_batch();
      wgmma_issue</*kZeroInit=*/false>(tiled_mma_dkv, tdKrdSt, tdKrQt(_, _, _, stage), acc_dk);
      warpgroup_commit_batch();
    } else {
      // Every product needs both warpgroups' halves of P^T or dS^T, read
      // from shared memory (P^T has the buffers of dS).
      Tensor tPrP = make_tensor(tdVrPt.data(), acc_s.layout());  // (MMA,MMA_M,MMA_N)
      copy(smem_tiled_copy_PdS, smem_thr_copy_PdS.retile_S(tPrP), tPsP(_, _, _, ds_buffer));
      cutlass::arch::fence_view_async_shared();  // P, dS stores -> wgmma
      cutlass::arch::NamedBarrier::arrive_and_wait(kNMmaThreads,
                                                   uint32_t(BwdSm90NamedBarrier::kDSWritten));
      warpgroup_fence_operand(acc_dq);
      warpgroup_arrive();
      wgmma_issue</*kZeroInit=*/false>(tiled_mma_dv, tdVsPt(_, _, _, ds_buffer),
                                       tdVrdOt(_, _, _, stage), acc_dv);
      warpgroup_commit_batch();
      wgmma_issue</*kZeroInit=*/true>(tiled_mma_dq, tdQrdS(_, _, _, ds_buffer), tdQrKt, acc_dq);
      warpgroup_commit_batch();
      wgmma_issue</*kZeroInit=*/false>(tiled_mma_dkv, tdKsdSt(_, _, _, ds_buffer),
                                       tdKrQt(_, _, _, stage), acc_dk);
      warpgroup_commit_batch();
    }
  }
};

}  // namespace flash
