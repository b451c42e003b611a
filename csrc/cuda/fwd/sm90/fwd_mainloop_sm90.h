// The Hopper forward's main loop (fwd_kernel_sm90.h), as its two roles:
//   - FwdSm90MainloopLoad: the producer, one thread that loads Q, K and V by
//     TMA into the pipeline's stages;
//   - FwdSm90MainloopMma: the MMA warpgroups' walk over a query block's key
//     tiles, S = Q K^T, the score rule and online softmax, O += P V.
// Both walk the same pipeline: FwdSm90SmemTiles (the tiles in shared memory)
// and FwdSm90PipelineCursor (which stage and phase a load or a read takes).
#pragma once

#include <cstdint>
#include <utility>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>

#include "common/mask_rule.h"
#include "cuda/core/block_info.h"
#include "cuda/core/params.h"
#include "cuda/core/score_mods.h"
#include "cuda/core/softmax.h"
#include "cuda/core/tile_ops.h"
#include "cuda/core/tile_ops_sm90.h"
#include "cuda/core/tma_loads_sm90.h"
#include "cuda/fwd/fwd_block_io.h"
#include "cuda/fwd/sm90/fwd_kernel_traits_sm90.h"
#include "cuda/fwd/sm90/fwd_tile_scheduler_sm90.h"

namespace flash {

using namespace cute;

// Named barriers of the kernel (ids after those CUTLASS reserves): the MMA
// warpgroups' turns at issuing products (one per warpgroup, at most three),
// each warpgroup's own epilogue barrier, and the MMA warpgroups' meeting
// after a varlen tile's tail is zeroed.
enum class FwdSm90NamedBarrier : uint32_t { kTurnOfWarpGroup0 = 0, kEpilogue0 = 3, kZeroVTail = 6 };

// The kernel's tiles in shared memory, in this order, then the mbarriers
// (Traits::Barriers, at kSmemSizeTiles). O is staged in a tile of its own or
// over Q (Traits::kSeparateO).
template <typename Traits>
struct FwdSm90SmemTiles {
  using Element = typename Traits::Element;
  using SmemPtr = decltype(make_smem_ptr(std::declval<Element*>()));
  using TensorQ = decltype(make_tensor(std::declval<SmemPtr>(), typename Traits::SmemLayoutQ{}));
  using TensorKV = decltype(make_tensor(std::declval<SmemPtr>(), typename Traits::SmemLayoutKV{}));
  using TensorVt = decltype(make_tensor(std::declval<SmemPtr>(), typename Traits::SmemLayoutVt{}));
  using TensorO = decltype(make_tensor(std::declval<SmemPtr>(), typename Traits::SmemLayoutO{}));

  TensorQ sQ;    // (kBlockM, D)
  TensorKV sK;   // (kBlockN, D, stage)
  TensorKV sV;   // (kBlockN, D, stage)
  TensorVt sVt;  // (D, kBlockN, stage): sV read transposed
  TensorO sO;    // (kBlockM, D)

  __forceinline__ __device__ explicit FwdSm90SmemTiles(char* smem)
      : sQ(make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)),
                       typename Traits::SmemLayoutQ{})),
        sK(make_tensor(sQ.data() + size(sQ), typename Traits::SmemLayoutKV{})),
        sV(make_tensor(sK.data() + size(sK), typename Traits::SmemLayoutKV{})),
        sVt(make_tensor(sV.data(), typename Traits::SmemLayoutVt{})),
        sO(make_tensor(Traits::kSeparateO ? sV.data() + size(sV) : sQ.data(),
                       typename Traits::SmemLayoutO{})) {}
};

// Key tiles are counted across the block's query blocks: the walk's i-th
// K / V tile uses stage i % kStages, in that stage's (i / kStages)-th round;
// Q's j-th load is round j of its one buffer. The producer and the MMA
// warpgroups each keep their own count.
template <int kStages>
struct FwdSm90PipelineCursor {
  int kv_loads = 0;  // K / V tiles of the query blocks before this one
  int q_loads = 0;   // query blocks before this one

  static __forceinline__ __device__ int stage_of(int i) { return i % kStages; }
  static __forceinline__ __device__ uint32_t phase_of(int i) { return uint32_t((i / kStages) & 1); }
  // Tile i of the current query block.
  __forceinline__ __device__ int stage(int i) const { return stage_of(kv_loads + i); }
  __forceinline__ __device__ uint32_t phase(int i) const { return phase_of(kv_loads + i); }
};

// Producer: one thread issues every copy, into the stages the MMA warpgroups
// have handed back.
template <typename Traits>
struct FwdSm90MainloopLoad {
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;

  const FwdParams& params;
  const FwdSm90Tma<Traits>& tma;
  typename Traits::Barriers& barriers;
  const FwdSm90SmemTiles<Traits>& smem;
  FwdSm90PipelineCursor<Traits::kStages> cursor{};

  // The tile's Q and its K / V tiles, in the order the MMA warpgroups read
  // them, then look_ahead().
  template <typename LookAhead>
  __forceinline__ __device__ void load(const FwdSm90Tile& tile, LookAhead&& look_ahead) {
    if (tile.block.rows_left <= 0 || tile.n_key_blocks <= 0) {
      look_ahead();
      return;
    }
    const FwdBlock& block = tile.block;
    Tensor gQ = local_tile(tma_q_of(tma.q, params, tile.binfo, block.head, block.batch),
                           Shape<Int<kBlockM>, Int<kHeadDim>>{},
                           make_coord(block.m_block, 0));  // (kBlockM, D)
    Tensor gK = local_tile(tma_kv_of(tma.k, params, tile.binfo, block.head_kv, block.batch),
                           Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, 0));  // (N, D, n)
    Tensor gV = local_tile(tma_kv_of(tma.v, params, tile.binfo, block.head_kv, block.batch),
                           Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, 0));  // (N, D, n)
    auto [tQgQ, tQsQ] =                                                              // (TMA), (TMA)
        tma_partition(tma.q, group_modes<0, 2>(smem.sQ), group_modes<0, 2>(gQ));
    auto [tKgK, tKsK] =  // (TMA, n), (TMA, stage)
        tma_partition(tma.k, group_modes<0, 2>(smem.sK), group_modes<0, 2>(gK));
    auto [tVgV, tVsV] =  // (TMA, n), (TMA, stage)
        tma_partition(tma.v, group_modes<0, 2>(smem.sV), group_modes<0, 2>(gV));
    // Rows and columns past the tensors' ends land as zeros, so a head dim
    // below kHeadDim and, in a fixed-length batch, the last K / V tile need
    // no predicates. A varlen tile reads on into the next sequence's rows
    // (see FwdSm90MainloopMma::zero_v_rows_past_end).
    auto load_k = [&](int i) {
      load_key_tile(tma.k, barriers.k_full, barriers.k_empty, tKgK, tKsK, block, i);
    };
    auto load_v = [&](int i) {
      load_key_tile(tma.v, barriers.v_full, barriers.v_empty, tVgV, tVsV, block, i);
    };
    // K(0) may go ahead of Q: its stage is free as soon as the last tile's
    // wgmmas have read it.
    load_k(0);
    empty_barrier(barriers.q_empty).wait((cursor.q_loads & 1) ^ 1);
    full_barrier(barriers.q_full).arrive_and_expect_tx(Traits::kSmemSizeQ);
    copy(tma.q.with(barriers.q_full), tQgQ, tQsQ);
    // The order the MMA warpgroups consume them: iteration i reads K(i) and
    // V(i - 1).
    for (int i = 1; i < tile.n_key_blocks; ++i) {
      load_k(i);
      load_v(i - 1);
    }
    load_v(tile.n_key_blocks - 1);
    cursor.kv_loads += tile.n_key_blocks;
    ++cursor.q_loads;
    look_ahead();
  }

 private:
  // Tile i of this query block's K or V into its stage, once the MMA
  // warpgroups have handed that stage back.
  template <typename TmaCopy, typename TensorG, typename TensorS>
  __forceinline__ __device__ void load_key_tile(const TmaCopy& tma_copy, uint64_t* full_stages,
                                                uint64_t* empty_stages, const TensorG& tXgX,
                                                const TensorS& tXsX, const FwdBlock& block, int i) {
    const int stage = cursor.stage(i);
    empty_barrier(empty_stages[stage]).wait(cursor.phase(i) ^ 1);
    full_barrier(full_stages[stage]).arrive_and_expect_tx(Traits::kSmemSizeKVStage);
    copy(tma_copy.with(full_stages[stage]), tXgX(_, block.n_block_max - 1 - i), tXsX(_, stage));
  }
};

// What the MMA warpgroups know of the query block they walk.
struct FwdSm90MmaTileInfo {
  const BlockInfo& binfo;
  const ScoreModsInUnits& score_mods;
  float exp_scale_log2;
  int row_begin;
  int n_block_max;
  int n_tiles;
  // The rows of a varlen sequence's last K / V tile past its end are the
  // next sequence's: their scores are masked, but P = 0 times a V that is
  // not finite would still reach O, so those V rows are zeroed before P V
  // reads them. Tile 0 is the only one that can reach past the end.
  int v_rows_past_end;
  bool zero_v_tail;
};

// The MMA warpgroups' main loop over one query block. The warpgroups issue
// their products in a cycle, 0, 1, (2,) 0, ...: each waits on its own turn,
// which the one before it hands on right after issuing, so 2 x 128 threads
// meet at each turn.
template <typename Traits, bool kTilesFromCounter, bool kWithScoreMods>
struct FwdSm90MainloopMma {
  static_assert(Traits::kNMmaWarpGroups <= 3,
                "one turn barrier per warpgroup, below kEpilogue0 (FwdSm90NamedBarrier)");
  using Element = typename Traits::Element;
  using NamedBarrier = cutlass::arch::NamedBarrier;
  using TiledMmaS = typename Traits::TiledMmaS;
  using TiledMmaO = typename Traits::TiledMmaO;
  using ThrMmaS = decltype(std::declval<TiledMmaS&>().get_thread_slice(0));
  using ThrMmaO = decltype(std::declval<TiledMmaO&>().get_thread_slice(0));
  using SmemTiles = FwdSm90SmemTiles<Traits>;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kNMmaThreads = Traits::kNMmaThreads;
  static constexpr int kNMmaWarpGroups = Traits::kNMmaWarpGroups;
  static constexpr uint32_t kTurnThreads = 2 * 128;

  // The accumulators of a query block, in registers.
  using AccS = decltype(partition_fragment_C(std::declval<TiledMmaS&>(),
                                             Shape<Int<kBlockM>, Int<kBlockN>>{}));
  using AccO = decltype(partition_fragment_C(std::declval<TiledMmaO&>(),
                                             Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  static constexpr int kNRows =
      decltype(size<0>(wgmma_acc_layout_as_rowcol(std::declval<AccO&>().layout())))::value;
  using Softmax = OnlineSoftmax<kNRows>;

  const FwdParams& params;
  typename Traits::Barriers& barriers;
  const SmemTiles& smem;
  const int mma_tidx;  // index among the MMA warpgroups' threads
  const int warp_group;
  const uint32_t my_turn;
  const uint32_t next_turn;
  const bool last_warp_group;
  TiledMmaS tiled_mma_s;
  TiledMmaO tiled_mma_o;
  ThrMmaS thr_mma_s;
  ThrMmaO thr_mma_o;
  using FragQ = decltype(std::declval<ThrMmaS&>().partition_fragment_A(
      std::declval<typename SmemTiles::TensorQ&>()));
  using FragK = decltype(std::declval<ThrMmaS&>().partition_fragment_B(
      std::declval<typename SmemTiles::TensorKV&>()));
  using FragVt = decltype(std::declval<ThrMmaO&>().partition_fragment_B(
      std::declval<typename SmemTiles::TensorVt&>()));
  using TensorCS = decltype(std::declval<ThrMmaS&>().partition_C(
      make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{})));
  using TensorCSRowCol =
      decltype(make_tensor(std::declval<TensorCS&>().data(),
                           wgmma_acc_layout_as_rowcol(std::declval<TensorCS&>().layout())));
  FragQ tSrQ;                  // (MMA, MMA_M, MMA_K): descriptors of sQ
  FragK tSrK;                  // (MMA, MMA_N, MMA_K, stage)
  FragVt tOrVt;                // (MMA, MMA_D, MMA_K, stage)
  TensorCSRowCol tScS_rowcol;  // (rows, cols) of S: each element's (row, key) in the tile
  const bool has_alibi;
  FwdSm90PipelineCursor<Traits::kStages> cursor{};
  // The MMA thread that takes the tiles from the counter.
  FwdSm90TileTaker<Traits, kTilesFromCounter> taker;

  __forceinline__ __device__ FwdSm90MainloopMma(const FwdParams& params_,
                                                typename Traits::Barriers& barriers_,
                                                const SmemTiles& smem_, int mma_tidx_)
      : params(params_),
        barriers(barriers_),
        smem(smem_),
        mma_tidx(mma_tidx_),
        warp_group(mma_tidx_ / 128),
        my_turn(uint32_t(FwdSm90NamedBarrier::kTurnOfWarpGroup0) + warp_group),
        next_turn(uint32_t(FwdSm90NamedBarrier::kTurnOfWarpGroup0) +
                  (warp_group + 1) % kNMmaWarpGroups),
        last_warp_group(warp_group == kNMmaWarpGroups - 1),
        thr_mma_s(tiled_mma_s.get_thread_slice(mma_tidx_)),
        thr_mma_o(tiled_mma_o.get_thread_slice(mma_tidx_)),
        tSrQ(thr_mma_s.partition_fragment_A(smem_.sQ)),
        tSrK(thr_mma_s.partition_fragment_B(smem_.sK)),
        tOrVt(thr_mma_o.partition_fragment_B(smem_.sVt)),
        tScS_rowcol(make_cs_rowcol(thr_mma_s)),
        has_alibi(kWithScoreMods && params_.alibi_slopes != nullptr),
        taker(params_, barriers_, mma_tidx_) {}

  // Warpgroup 0 issues first: the last one hands it the first turn.
  __forceinline__ __device__ void start_turns() const {
    if (last_warp_group) NamedBarrier::arrive(kTurnThreads, next_turn);
  }

  // The whole walk over the tile's key blocks, into acc_o and softmax:
  // iteration i computes S(i) = Q K(i)^T, and O += P(i-1) V(i-1) behind it
  // on the tensor cores while the softmax of S(i) runs. The first iteration
  // has no P V yet; it is peeled off at compile time (a branch around a
  // wgmma inside a batch makes ptxas serialize the batch). look_ahead() runs
  // under the last P V.
  template <typename LookAhead>
  __forceinline__ __device__ void mma(const FwdSm90Tile& tile, const ScoreModsInUnits& score_mods,
                                      float exp_scale_log2, AccS& acc_s, auto& tOrP, AccO& acc_o,
                                      Softmax& softmax, LookAhead&& look_ahead) {
    Tensor scores = make_tensor(acc_s.data(),
                                wgmma_acc_layout_as_rowcol(acc_s.layout()));  // (rows, cols)
    Tensor acc_o_rowcol = make_tensor(acc_o.data(),
                                      wgmma_acc_layout_as_rowcol(acc_o.layout()));  // (rows, D)

    full_barrier(barriers.q_full).wait(cursor.q_loads & 1);

    const int v_rows_past_end = tile.binfo.seqlen_k - (tile.block.n_block_max - 1) * kBlockN;
    const FwdSm90MmaTileInfo info{tile.binfo,
                                  score_mods,
                                  exp_scale_log2,
                                  tile.block.row_begin,
                                  tile.block.n_block_max,
                                  tile.n_key_blocks,
                                  v_rows_past_end,
                                  tile.binfo.varlen && v_rows_past_end < kBlockN};

    iteration(info, cute::false_type{}, 0, acc_s, scores, tOrP, acc_o, acc_o_rowcol, softmax);
    for (int i = 1; i < info.n_tiles; ++i) {
      iteration(info, cute::true_type{}, i, acc_s, scores, tOrP, acc_o, acc_o_rowcol, softmax);
    }

    // The last tile's P V. The last warpgroup takes the last turn, so it
    // hands none on.
    const int last = info.n_tiles - 1;
    if (last == 0 && info.zero_v_tail) zero_v_rows_past_end(info.v_rows_past_end);
    full_barrier(barriers.v_full[cursor.stage(last)]).wait(cursor.phase(last));
    NamedBarrier::arrive_and_wait(kTurnThreads, my_turn);
    warpgroup_fence_operand(tOrP);
    warpgroup_fence_operand(acc_o);
    warpgroup_arrive();
    wgmma_issue</*kZeroInit=*/false>(tiled_mma_o, tOrP, tOrVt(_, _, _, cursor.stage(last)), acc_o);
    warpgroup_commit_batch();
    if (!last_warp_group) NamedBarrier::arrive(kTurnThreads, next_turn);
    look_ahead();
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_o);
    empty_barrier(barriers.v_empty[cursor.stage(last)]).arrive();
  }

  // Q is the MMA warpgroups' until its last reader is done: with O staged
  // apart, once the last S has landed (in iteration()); else once O, staged
  // over it, has been stored.
  __forceinline__ __device__ void release_q_after_epilogue() {
    if (!Traits::kSeparateO) empty_barrier(barriers.q_empty).arrive();
  }

  // The query block is done: the next one's tiles follow its own in the
  // pipeline.
  __forceinline__ __device__ void advance(int n_tiles) {
    cursor.kv_loads += n_tiles;
    ++cursor.q_loads;
  }

 private:
  static __forceinline__ __device__ TensorCSRowCol make_cs_rowcol(const ThrMmaS& thr_mma) {
    Tensor cS = make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{});  // (kBlockM, kBlockN)
    Tensor tScS = thr_mma.partition_C(cS);                                  // (MMA, MMA_M, MMA_N)
    return make_tensor(tScS.data(), wgmma_acc_layout_as_rowcol(tScS.layout()));
  }

  // Zeroes tile 0's V rows past the sequence's end (FwdSm90MmaTileInfo).
  // Outside the turns: all MMA warpgroups meet here.
  __forceinline__ __device__ void zero_v_rows_past_end(int v_rows_past_end) {
    full_barrier(barriers.v_full[cursor.stage(0)]).wait(cursor.phase(0));
    Tensor sV_tile = smem.sV(_, _, cursor.stage(0));  // (kBlockN, D)
    for (int idx = mma_tidx; idx < (kBlockN - v_rows_past_end) * kHeadDim; idx += kNMmaThreads) {
      sV_tile(v_rows_past_end + idx / kHeadDim, idx % kHeadDim) = Element(0);
    }
    cutlass::arch::fence_view_async_shared();  // wgmma reads through the async proxy
    NamedBarrier::arrive_and_wait(kNMmaThreads, uint32_t(FwdSm90NamedBarrier::kZeroVTail));
  }

  // Iteration i of the walk (mma()).
  template <typename HasPendingPv>
  __forceinline__ __device__ void iteration(const FwdSm90MmaTileInfo& info, HasPendingPv, int i,
                                            AccS& acc_s, auto& scores, auto& tOrP, AccO& acc_o,
                                            auto& acc_o_rowcol, Softmax& softmax) {
    constexpr bool kHasPendingPv = HasPendingPv::value;
    const int n_block = info.n_block_max - 1 - i;
    if (kHasPendingPv && i == 1 && info.zero_v_tail) zero_v_rows_past_end(info.v_rows_past_end);
    full_barrier(barriers.k_full[cursor.stage(i)]).wait(cursor.phase(i));
    NamedBarrier::arrive_and_wait(kTurnThreads, my_turn);
    warpgroup_fence_operand(acc_s);
    warpgroup_arrive();
    wgmma_issue</*kZeroInit=*/true>(tiled_mma_s, tSrQ, tSrK(_, _, _, cursor.stage(i)), acc_s);
    warpgroup_commit_batch();
    int64_t taken_tile = 0;
    if (!kHasPendingPv && taker.takes_tiles) taken_tile = taker.take();
    if constexpr (kHasPendingPv) {
      full_barrier(barriers.v_full[cursor.stage(i - 1)]).wait(cursor.phase(i - 1));
      warpgroup_fence_operand(tOrP);
      warpgroup_fence_operand(acc_o);
      warpgroup_arrive();
      wgmma_issue</*kZeroInit=*/false>(tiled_mma_o, tOrP, tOrVt(_, _, _, cursor.stage(i - 1)),
                                       acc_o);
      warpgroup_commit_batch();
    }
    NamedBarrier::arrive(kTurnThreads, next_turn);
    warpgroup_wait<kHasPendingPv ? 1 : 0>();  // S(i) has landed
    warpgroup_fence_operand(acc_s);
    if (!kHasPendingPv && taker.takes_tiles) taker.publish(taken_tile);
    empty_barrier(barriers.k_empty[cursor.stage(i)]).arrive();
    // With O staged apart, Q is free once the last S has landed.
    if (Traits::kSeparateO && i == info.n_tiles - 1) empty_barrier(barriers.q_empty).arrive();

    // Softcap and ALiBi (kWithScoreMods), then the causal / local / bounds
    // mask.
    const BlockInfo& binfo = info.binfo;
    const int row_begin = info.row_begin;
    const int col_base = n_block * kBlockN;
    if constexpr (kWithScoreMods) {
      info.score_mods.apply_softcap(scores);
      if (has_alibi) {
        apply_alibi(scores, tScS_rowcol, row_begin, col_base, info.score_mods.alibi_slope,
                    binfo.seqlen_q, binfo.seqlen_k);
      }
    }
    if (!key_tile_fully_visible(row_begin, row_begin + kBlockM, col_base, col_base + kBlockN,
                                binfo.seqlen_q, binfo.seqlen_k, params.window_left,
                                params.window_right)) {
      apply_mask(scores, tScS_rowcol, row_begin, col_base, binfo.seqlen_q, binfo.seqlen_k,
                 params.window_left, params.window_right);
    }
    typename Softmax::TileCorrection correction;
    softmax.update_scores(scores, info.exp_scale_log2, correction);

    if constexpr (kHasPendingPv) {
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_o);
      warpgroup_fence_operand(tOrP);
      empty_barrier(barriers.v_empty[cursor.stage(i - 1)]).arrive();
    }
    softmax.template rescale_output</*kSkipUnmovedRescale=*/true>(acc_o_rowcol, correction);
    convert_type_into(acc_s, tOrP);
  }
};

}  // namespace flash
