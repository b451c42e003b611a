// The main loop of the Hopper forward (fwd_kernel_sm90.h), as its two roles:
//   - FwdSm90MainloopLoad, the producer warpgroup: one thread loads Q, K and V
//     by TMA into the stages of fwd_pipeline_sm90.h;
//   - FwdSm90MainloopMma, the MMA warpgroups: per key tile S = Q K^T, the score
//     mods and the mask, the online softmax, dropout, and O += P V, taking
//     turns at the tensor cores.
// Shape comments name the modes of each MMA: S = Q K^T has the queries as M,
// the keys as N and the head dim as K; O += P V the queries as M, the head
// dim of V as N (Dv: d_v, below D = d_qk only in a specialised pair's
// kernel) and the keys as K.
#pragma once

#include <cmath>
#include <cstdint>
#include <utility>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "common/mask_rule.h"
#include "cuda/core/block_info.h"
#include "cuda/core/dropout.h"
#include "cuda/core/mask.h"
#include "cuda/core/paged_rows.h"
#include "cuda/core/params.h"
#include "cuda/core/score_mods.h"
#include "cuda/core/softmax.h"
#include "cuda/core/tile_ops.h"
#include "cuda/core/tile_ops_sm90.h"
#include "cuda/core/tma_loads_sm90.h"
#include "cuda/fwd/sm90/fwd_kernel_traits_sm90.h"
#include "cuda/fwd/sm90/fwd_pipeline_sm90.h"
#include "cuda/fwd/sm90/fwd_tile_scheduler_sm90.h"

namespace flash {

using namespace cute;

// The producer: one thread of the producer warpgroup issues every copy; the
// others have left the kernel.
template <typename Traits>
struct FwdSm90MainloopLoad {
  using Element = typename Traits::Element;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kHeadDimV = Traits::kHeadDimV;
  using Storage = FwdSm90SharedStorage<Traits>;

  const FwdParams& params;
  const FwdSm90Tma<Traits>& tma;
  FwdSm90Stages<Traits::kStages> stages;

  // A tile's Q, then its K / V tiles from the last visible key block down,
  // in the order the MMA warpgroups consume them. Rows and columns past the
  // tensors' ends land as zeros, so a head dim below kHeadDim (V's below
  // kHeadDimV) and, in a fixed-length batch, the last K / V tile need no
  // predicates. A varlen tile reads on into the next sequence's rows (see
  // FwdSm90MainloopMma::zero_v_rows_past_end).
  template <typename LookAhead>
  __forceinline__ __device__ void load(const FwdSm90Tile& tile, LookAhead&& look_ahead) {
    if (tile.block.rows_left <= 0 || tile.n_key_blocks <= 0) {
      look_ahead();
      return;
    }
    auto& barriers = Storage::barriers();
    const FwdBlock& block = tile.block;
    Tensor gQ =
        local_tile(tma_q_of(tma.q, params, tile.binfo, block.head, block.batch, params.head_dim),
                   Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(block.m_block, 0));  // (M,D)
    Tensor gK = local_tile(
        tma_kv_of(tma.k, params, tile.binfo, block.head_kv, block.batch, params.head_dim),
        Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, 0));  // (N,D,n)
    Tensor gV = local_tile(
        tma_kv_of(tma.v, params, tile.binfo, block.head_kv, block.batch, params.head_dim_v),
        Shape<Int<kBlockN>, Int<kHeadDimV>>{}, make_coord(_, 0));  // (N,Dv,n)
    Tensor sQ = Storage::q();                                      // (M,D)
    Tensor sK = Storage::k();                                      // (N,D,stage)
    Tensor sV = Storage::v();                                      // (N,Dv,stage)
    // One TMA box per tile: a stage holds one global tile.
    CUTE_STATIC_ASSERT_V(size<0>(sK) == size<0>(gK) && size<1>(sK) == size<1>(gK));
    CUTE_STATIC_ASSERT_V(size<0>(sV) == size<0>(gV) && size<1>(sV) == size<1>(gV));
    CUTE_STATIC_ASSERT_V(size<0>(sQ) == size<0>(gQ) && size<1>(sQ) == size<1>(gQ));
    // (TMA,TMA_M,TMA_D), (TMA,TMA_N,TMA_D,n) / (...,stage): one TMA copy per tile
    auto [tQgQ, tQsQ] = tma_partition(tma.q, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
    auto [tKgK, tKsK] = tma_partition(tma.k, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    auto [tVgV, tVsV] = tma_partition(tma.v, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
    // Paged keys (uniform over the call) go by boxes of pages instead.
    const bool paged = params.block_table != nullptr;
    auto load_k = [&](int i) {
      if (paged) {
        load_paged_key_tile(&tma.k_paged, barriers.k_full, barriers.k_empty, sK, tile, i);
      } else {
        load_key_tile<Traits::kSmemSizeKStage>(tma.k, barriers.k_full, barriers.k_empty, tKgK, tKsK,
                                               block.n_block_max, i);
      }
    };
    auto load_v = [&](int i) {
      if (paged) {
        load_paged_key_tile(&tma.v_paged, barriers.v_full, barriers.v_empty, sV, tile, i);
      } else {
        load_key_tile<Traits::kSmemSizeVStage>(tma.v, barriers.v_full, barriers.v_empty, tVgV, tVsV,
                                               block.n_block_max, i);
      }
    };
    // K(0) may go ahead of Q: its stage is free as soon as the last tile's
    // wgmmas have read it.
    load_k(0);
    empty_barrier(barriers.q_empty).wait(stages.q_phase() ^ 1);
    full_barrier(barriers.q_full).arrive_and_expect_tx(Traits::kSmemSizeQ);
    copy(tma.q.with(barriers.q_full), tQgQ, tQsQ);
    // The order the MMA warpgroups consume them: iteration i reads K(i) and
    // V(i - 1).
    for (int i = 1; i < tile.n_key_blocks; ++i) {
      load_k(i);
      load_v(i - 1);
    }
    load_v(tile.n_key_blocks - 1);
    stages.advance(tile.n_key_blocks);
    look_ahead();
  }

 private:
  // Tile i of this query block's K or V (kStageBytes a stage) into its
  // stage, once the MMA warpgroups have handed that stage back.
  template <int kStageBytes, typename TmaCopy, typename TensorG, typename TensorS>
  __forceinline__ __device__ void load_key_tile(const TmaCopy& tma_copy, uint64_t* full_stages,
                                                uint64_t* empty_stages, const TensorG& tXgX,
                                                const TensorS& tXsX, int n_block_max, int i) const {
    const int stage = stages.stage(i);
    empty_barrier(empty_stages[stage]).wait(stages.phase(i) ^ 1);
    full_barrier(full_stages[stage]).arrive_and_expect_tx(kStageBytes);
    copy(tma_copy.with(full_stages[stage]), tXgX(_, n_block_max - 1 - i), tXsX(_, stage));
  }

  // The same tile of paged keys (FwdSm90Tma::k_paged / v_paged): one TMA box
  // per piece of box_rows rows and swizzle atom of columns, each from its own
  // page, read in place. Only boxes holding keys below seqlen_k are issued,
  // so no table entry past the sequence's pages is read; the rows after them
  // keep what the stage held, which the mask hides (K) and
  // FwdSm90MainloopMma::zero_v_rows_past_end clears (V), as for the rows of
  // the next sequence an unpaged varlen tile reads. The stage sX is K's
  // (N,D,stage) or V's (N,Dv,stage): its width is the boxes' column range.
  template <typename TensorS>
  __forceinline__ __device__ void load_paged_key_tile(const TmaDescriptor* desc,
                                                      uint64_t* full_stages, uint64_t* empty_stages,
                                                      TensorS& sX, const FwdSm90Tile& tile,
                                                      int i) const {
    constexpr int kAtomCols = FwdSm90Tma<Traits>::kAtomCols;
    constexpr int kCols = decltype(size<1>(sX))::value;
    static_assert(kCols % kAtomCols == 0, "whole swizzle atoms across the head dim");
    // Table lookups go in groups: each TMA waits on its page's lookup, and
    // one at a time the thread waited out a load latency per box.
    constexpr int kLookups = 4;
    const int box_rows = tma.paged_box_rows;
    const int stage = stages.stage(i);
    const int key0 = (tile.block.n_block_max - 1 - i) * kBlockN;
    const int boxes = (min(kBlockN, tile.binfo.seqlen_k - key0) + box_rows - 1) / box_rows;
    for (int first = 0; first < boxes; first += kLookups) {
      int page[kLookups], row_in_page[kLookups];
      CUTE_UNROLL
      for (int u = 0; u < kLookups; ++u) {
        // Past the last box: the last box again (an entry the table holds), unused.
        const int box = min(first + u, boxes - 1);
        locate_paged_key(params, tile.block.batch, key0 + box * box_rows, page[u], row_in_page[u]);
      }
      // The first lookups run before the wait for the stage.
      if (first == 0) {
        empty_barrier(empty_stages[stage]).wait(stages.phase(i) ^ 1);
        full_barrier(full_stages[stage])
            .arrive_and_expect_tx(uint32_t(boxes * box_rows * kCols * sizeof(Element)));
      }
      CUTE_UNROLL
      for (int u = 0; u < kLookups; ++u) {
        if (first + u >= boxes) break;
        CUTE_UNROLL
        for (int col = 0; col < kCols; col += kAtomCols) {
          SM90_TMA_LOAD_4D::copy(desc, &full_stages[stage],
                                 static_cast<uint64_t>(TMA::CacheHintSm90::EVICT_NORMAL),
                                 &sX((first + u) * box_rows, col, stage), col, row_in_page[u],
                                 tile.block.head_kv, page[u]);
        }
      }
    }
  }
};

// The score coordinates (row, col) of an MMA thread's S accumulator.
template <typename Traits, typename ThrMmaS>
__forceinline__ __device__ auto fwd_sm90_score_coords(const ThrMmaS& thr_mma_s) {
  Tensor cS = make_identity_tensor(
      Shape<Int<Traits::kBlockM>, Int<Traits::kBlockN>>{});  // (M,N) -> (row,col)
  Tensor tScS = thr_mma_s.partition_C(cS);                   // (MMA,MMA_M,MMA_N)
  // (ROW,COL) = ((2,MMA_M),(2,N/8,MMA_N)), tile_ops_sm90.h
  return make_tensor(tScS.data(), wgmma_acc_layout_as_rowcol(tScS.layout()));
}

// The MMA warpgroups (64 query rows each) of a block. They issue their
// products in a cycle, 0, 1, (2,) 0, ...: each waits on its own turn, which
// the one before it hands on right after issuing, so 2 x 128 threads meet at
// each turn, and one warpgroup's softmax runs while another's products
// occupy the tensor cores.
//
// kWithScoreMods: the variant with softcap, ALiBi and dropout (each on at run
// time); the plain variant carries none of their code. Dropout only where
// Traits::kDrawsDropout (registers to spare under S): elsewhere its draws
// spilled in the loop, and would have slowed softcap / ALiBi calls too, so
// plan_fwd sends those calls to the SM80 kernel (PERF_LOG 2026-11-29, issue
// 57 step 1).
template <typename Traits, bool kWithScoreMods>
struct FwdSm90MainloopMma {
  using Element = typename Traits::Element;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDimV = Traits::kHeadDimV;
  static constexpr int kNMmaThreads = Traits::kNMmaThreads;
  static constexpr int kNMmaWarpGroups = Traits::kNMmaWarpGroups;
  static constexpr bool kWithDropout = kWithScoreMods && Traits::kDrawsDropout;
  static constexpr uint32_t kTurnThreads = 2 * 128;
  using Storage = FwdSm90SharedStorage<Traits>;
  using NamedBarrier = cutlass::arch::NamedBarrier;

  using TiledMmaS = typename Traits::TiledMmaS;
  using TiledMmaO = typename Traits::TiledMmaO;
  using ThrMmaS = decltype(TiledMmaS{}.get_thread_slice(0));
  using ThrMmaO = decltype(TiledMmaO{}.get_thread_slice(0));
  // The types of the partitions below, of ThrMma's operands over a
  // shared-memory view of type T.
  template <typename ThrMma, typename T>
  using FragmentA = decltype(std::declval<const ThrMma&>().partition_fragment_A(std::declval<T>()));
  template <typename ThrMma, typename T>
  using FragmentB = decltype(std::declval<const ThrMma&>().partition_fragment_B(std::declval<T>()));
  using SmemQ = decltype(Storage::q());
  using SmemKV = decltype(Storage::k());
  using SmemVt = decltype(Storage::vt());
  using ScoreCoords = decltype(fwd_sm90_score_coords<Traits>(std::declval<const ThrMmaS&>()));
  using FragmentO =
      decltype(partition_fragment_C(TiledMmaO{}, Shape<Int<kBlockM>, Int<kHeadDimV>>{}));
  // The rows of O a thread holds: (ROW,COL) view of its accumulator.
  static constexpr int kNRows =
      decltype(size<0>(wgmma_acc_layout_as_rowcol(std::declval<FragmentO>().layout())))::value;

  const FwdParams& params;
  // Threads [128, 384) of the block, from 0.
  const int mma_tidx;
  const int warp_group;
  const uint32_t my_turn;
  const uint32_t next_turn;
  const bool last_warp_group;

  TiledMmaS tiled_mma_s;
  TiledMmaO tiled_mma_o;
  ThrMmaS thr_mma_s;
  ThrMmaO thr_mma_o;
  FragmentA<ThrMmaS, SmemQ> tSrQ;    // (MMA,MMA_M,MMA_K)
  FragmentB<ThrMmaS, SmemKV> tSrK;   // (MMA,MMA_N,MMA_K,stage)
  FragmentB<ThrMmaO, SmemVt> tOrVt;  // (MMA,MMA_Dv,MMA_K,stage)
  ScoreCoords tScS_rowcol;           // (ROW,COL) -> (row,col)

  const bool has_alibi;
  const bool has_dropout;
  FwdSm90Stages<Traits::kStages> stages;

  __forceinline__ __device__ FwdSm90MainloopMma(const FwdParams& params_, int mma_tidx_)
      : params(params_),
        mma_tidx(mma_tidx_),
        warp_group(mma_tidx_ / 128),
        my_turn(uint32_t(FwdSm90NamedBarrier::kTurnOfWarpGroup0) + warp_group),
        next_turn(uint32_t(FwdSm90NamedBarrier::kTurnOfWarpGroup0) +
                  (warp_group + 1) % kNMmaWarpGroups),
        last_warp_group(warp_group == kNMmaWarpGroups - 1),
        thr_mma_s(tiled_mma_s.get_thread_slice(mma_tidx_)),
        thr_mma_o(tiled_mma_o.get_thread_slice(mma_tidx_)),
        tSrQ(thr_mma_s.partition_fragment_A(Storage::q())),
        tSrK(thr_mma_s.partition_fragment_B(Storage::k())),
        tOrVt(thr_mma_o.partition_fragment_B(Storage::vt())),
        tScS_rowcol(fwd_sm90_score_coords<Traits>(thr_mma_s)),
        has_alibi(kWithScoreMods && params_.alibi_slopes != nullptr),
        has_dropout(kWithDropout && params_.dropout_p > 0.f) {}

  // The score mods of a tile's (batch, head): softcap and ALiBi in the
  // kWithScoreMods variant, the plain scale otherwise (score_mods.h).
  __forceinline__ __device__ ScoreModsInUnits score_mods_of(const FwdBlock& block) const {
    return ScoreModsInUnits(
        params.softmax_scale, kWithScoreMods ? params.softcap : 0.f, has_alibi,
        has_alibi ? params.alibi_slopes[block.batch * params.alibi_batch_stride + block.head]
                  : 0.f);
  }

  // One query block with n_key_blocks > 0 key tiles: O (unnormalised until
  // the end) into acc_o and each row's lse. Iteration i: S(i) = Q K(i)^T,
  // and O += P(i-1) V(i-1) behind it on the tensor cores while the softmax of
  // S(i) runs. On the counter's grid the taker takes the next tile under the
  // first S (scheduler); look_ahead() runs under the last P V.
  template <typename Scheduler, typename LookAhead>
  __forceinline__ __device__ void mma(const FwdSm90Tile& tile, const ScoreModsInUnits& score_mods,
                                      bool takes_tiles, Scheduler& scheduler, FragmentO& acc_o,
                                      float (&lse)[kNRows], LookAhead&& look_ahead) {
    auto& barriers = Storage::barriers();
    const BlockInfo& binfo = tile.binfo;
    const FwdBlock& block = tile.block;
    const int row_begin = block.row_begin;
    const int n_block_max = block.n_block_max;
    const int n_tiles = tile.n_key_blocks;
    const float exp_scale_log2 =
        kWithScoreMods ? score_mods.exp_scale_log2() : params.softmax_scale_log2;
    // Warpgroup 0 issues first.
    if (last_warp_group) NamedBarrier::arrive(kTurnThreads, next_turn);

    clear(acc_o);
    // (MMA,MMA_M,MMA_N)
    Tensor acc_s = partition_fragment_C(tiled_mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});
    // (MMA,MMA_M,MMA_K): P as the A operand of O += P V, K = the N keys
    Tensor tOrP = make_tensor<Element>(wgmma_acc_layout_as_operand_a(acc_s.layout()));
    // (ROW,COL) views of S and O
    Tensor scores = make_tensor(acc_s.data(), wgmma_acc_layout_as_rowcol(acc_s.layout()));
    Tensor acc_o_rowcol = make_tensor(acc_o.data(), wgmma_acc_layout_as_rowcol(acc_o.layout()));
    // P is S converted element by element; the mask reads S's coordinates;
    // the softmax rescales the rows of O by the rows of S.
    CUTE_STATIC_ASSERT_V(size(tOrP) == size(acc_s));
    CUTE_STATIC_ASSERT_V(size<0>(scores) == size<0>(tScS_rowcol));
    CUTE_STATIC_ASSERT_V(size<1>(scores) == size<1>(tScS_rowcol));
    CUTE_STATIC_ASSERT_V(size<0>(scores) == size<0>(acc_o_rowcol));
    OnlineSoftmax<kNRows> softmax;

    // Dropout's keep bits of a tile are drawn while its S is on the tensor
    // cores and zero P after the softmax has summed it, as the SM80 kernel
    // does (the row sums and lse are of the undropped P; finalize() scales O
    // by 1 / (1 - p)). docs/dropout_sm90.md, section 3, design 1, and
    // section 5.
    static_assert(kNRows % 2 == 0, "a thread's rows come in pairs (r, r + 8)");
    using DropoutMask = PairedDropoutMask<kNRows / 2, decltype(size<1>(scores))::value / 2>;
    // The registers under S that Traits::kDrawsDropout counts.
    static_assert(!kWithDropout || decltype(size(acc_s))::value + decltype(size(acc_o))::value +
                                           decltype(size(tOrP))::value * sizeof(Element) / 4 ==
                                       Traits::kInFlightRegisters,
                  "S, O and P in flight as the traits count them");
    DropoutMask dropout_mask;

    full_barrier(barriers.q_full).wait(stages.q_phase());

    // The rows of a varlen sequence's last K / V tile past its end are the
    // next sequence's (zero_v_rows_past_end). Tile 0 is the only one that can
    // reach past the end.
    const int v_rows_past_end = binfo.seqlen_k - (n_block_max - 1) * kBlockN;
    const bool zero_v_tail = binfo.varlen && v_rows_past_end < kBlockN;

    // The first iteration has no P V yet; it is peeled off at compile time (a
    // branch around a wgmma inside a batch makes ptxas serialize the batch).
    auto iteration = [&](int i, auto has_pending_pv) {
      constexpr bool kHasPendingPv = decltype(has_pending_pv)::value;
      const int n_block = n_block_max - 1 - i;
      if (kHasPendingPv && i == 1 && zero_v_tail) zero_v_rows_past_end(v_rows_past_end);
      full_barrier(barriers.k_full[stages.stage(i)]).wait(stages.phase(i));
      NamedBarrier::arrive_and_wait(kTurnThreads, my_turn);
      warpgroup_fence_operand(acc_s);
      warpgroup_arrive();
      wgmma_issue</*kZeroInit=*/true>(tiled_mma_s, tSrQ, tSrK(_, _, _, stages.stage(i)), acc_s);
      warpgroup_commit_batch();
      int64_t taken_tile = 0;
      if (!kHasPendingPv && takes_tiles) taken_tile = scheduler.take_tile();
      if constexpr (kHasPendingPv) {
        full_barrier(barriers.v_full[stages.stage(i - 1)]).wait(stages.phase(i - 1));
        warpgroup_fence_operand(tOrP);
        warpgroup_fence_operand(acc_o);
        warpgroup_arrive();
        wgmma_issue</*kZeroInit=*/false>(tiled_mma_o, tOrP, tOrVt(_, _, _, stages.stage(i - 1)),
                                         acc_o);
        warpgroup_commit_batch();
      }
      NamedBarrier::arrive(kTurnThreads, next_turn);
      const int col_base = n_block * kBlockN;
      // Under S(i): the draws need only (row, col).
      if (kWithDropout && has_dropout) {
        // Seed and offset read per key tile (two cached loads under the
        // wgmma), not held across the loop: held, they pushed tile-level
        // values to the stack (PERF_LOG 2026-11-29, issue 57 step 1).
        const DropoutState dropout{static_cast<uint64_t>(params.rng_state[0]),
                                   static_cast<uint64_t>(params.rng_state[1]),
                                   params.dropout_threshold,
                                   block.batch,
                                   block.head,
                                   params.nheads};
        dropout_mask.draw(tScS_rowcol, row_begin, col_base, dropout);
      }
      warpgroup_wait<kHasPendingPv ? 1 : 0>();  // S(i) has landed
      warpgroup_fence_operand(acc_s);
      if (!kHasPendingPv && takes_tiles) scheduler.publish_tile(taken_tile);
      empty_barrier(barriers.k_empty[stages.stage(i)]).arrive();
      // With O staged apart, Q is free once the last S has landed.
      if (Traits::kSeparateO && i == n_tiles - 1) empty_barrier(barriers.q_empty).arrive();

      if constexpr (kWithScoreMods) {
        score_mods.apply_softcap(scores);
        if (has_alibi) {
          apply_alibi(scores, tScS_rowcol, row_begin, col_base, score_mods.alibi_slope,
                      binfo.seqlen_q, binfo.seqlen_k);
        }
      }
      if (!key_tile_fully_visible(row_begin, row_begin + kBlockM, col_base, col_base + kBlockN,
                                  binfo.seqlen_q, binfo.seqlen_k, params.window_left,
                                  params.window_right)) {
        apply_mask(scores, tScS_rowcol, row_begin, col_base, binfo.seqlen_q, binfo.seqlen_k,
                   params.window_left, params.window_right);
      }
      typename OnlineSoftmax<kNRows>::TileCorrection correction;
      softmax.update_scores(scores, exp_scale_log2, correction);
      if (kWithDropout && has_dropout) dropout_mask.apply(scores);

      if constexpr (kHasPendingPv) {
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc_o);
        warpgroup_fence_operand(tOrP);
        empty_barrier(barriers.v_empty[stages.stage(i - 1)]).arrive();
      }
      softmax.template rescale_output</*kSkipUnmovedRescale=*/true>(acc_o_rowcol, correction);
      convert_type_into(acc_s, tOrP);
    };

    iteration(0, cute::false_type{});
    for (int i = 1; i < n_tiles; ++i) iteration(i, cute::true_type{});

    // The last tile's P V. The last warpgroup takes the last turn, so it
    // hands none on.
    const int last = n_tiles - 1;
    if (last == 0 && zero_v_tail) zero_v_rows_past_end(v_rows_past_end);
    full_barrier(barriers.v_full[stages.stage(last)]).wait(stages.phase(last));
    NamedBarrier::arrive_and_wait(kTurnThreads, my_turn);
    warpgroup_fence_operand(tOrP);
    warpgroup_fence_operand(acc_o);
    warpgroup_arrive();
    wgmma_issue</*kZeroInit=*/false>(tiled_mma_o, tOrP, tOrVt(_, _, _, stages.stage(last)), acc_o);
    warpgroup_commit_batch();
    if (!last_warp_group) NamedBarrier::arrive(kTurnThreads, next_turn);
    look_ahead();
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_o);
    empty_barrier(barriers.v_empty[stages.stage(last)]).arrive();

    softmax.finalize(acc_o_rowcol, kWithScoreMods ? score_mods.unit : params.softmax_scale,
                     kWithDropout && has_dropout ? params.dropout_rescale : 1.f, lse,
                     row_sink(params, block.head));
  }

 private:
  // The rows of a varlen sequence's last K / V tile past its end are the
  // next sequence's: their scores are masked, but P = 0 times a V that is not
  // finite would still reach O, so those V rows of tile 0 are zeroed before P
  // V reads them. Outside the turns: all MMA warpgroups meet here.
  __forceinline__ __device__ void zero_v_rows_past_end(int v_rows_past_end) const {
    full_barrier(Storage::barriers().v_full[stages.stage(0)]).wait(stages.phase(0));
    Tensor sV_tile = Storage::v()(_, _, stages.stage(0));  // (N,Dv)
    for (int idx = mma_tidx; idx < (kBlockN - v_rows_past_end) * kHeadDimV; idx += kNMmaThreads) {
      sV_tile(v_rows_past_end + idx / kHeadDimV, idx % kHeadDimV) = Element(0);
    }
    cutlass::arch::fence_view_async_shared();  // wgmma reads through the async proxy
    NamedBarrier::arrive_and_wait(kNMmaThreads, uint32_t(FwdSm90NamedBarrier::kZeroVTail));
  }
};

}  // namespace flash
