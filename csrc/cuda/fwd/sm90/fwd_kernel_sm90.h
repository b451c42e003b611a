// The forward kernel on Hopper's warpgroup MMAs (wgmma, sm90a): the
// FlashAttention-2 walk of fwd_kernel_sm80.h (one thread block per query
// block, K/V tiles from the last visible key block down, online softmax with
// P kept in registers), with Q K^T read from shared memory and P V with P
// from registers at about twice the tensor-core rate of the SM80 mma.sync
// path. Within a warpgroup, S(i) = Q K(i)^T is issued together with P V of
// the tile before, and the softmax of S(i) runs while that product is on the
// tensor cores. The copies and the block-wide barriers stay out of the MMA
// warpgroups' loop:
//   - a producer warpgroup, one thread of it, loads Q, K and V by TMA into
//     two stages per tensor; each landed stage is announced on an mbarrier
//     ("full"), and each stage comes back once every MMA warpgroup's wgmmas
//     have read it ("empty");
//   - the two or three MMA warpgroups (64 query rows each; the tile table
//     says how many) take turns issuing their products (a named barrier per
//     turn), so one warpgroup's softmax runs while another's products occupy
//     the tensor cores, instead of all meeting at a block barrier every tile
//     with the tensor cores idle in between.
// It runs the causal / local / bounds mask and, in its kWithScoreMods
// variant, softcap and ALiBi before it (score_mods.h, in the contract's
// order), on TMA-describable inputs (16-byte aligned pointers, strides that
// are positive multiples of 16 bytes); the launcher sends dropout and
// anything else to fwd_kernel_sm80.h.
#pragma once

#include <cmath>
#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
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
#include "cuda/fwd/fwd_block_order.h"
#include "cuda/fwd/sm90/fwd_kernel_traits_sm90.h"

namespace flash {

using namespace cute;

// Named barriers of the kernel (ids after those CUTLASS reserves): the MMA
// warpgroups' turns at issuing products (one per warpgroup, at most three),
// each warpgroup's own epilogue barrier, and the MMA warpgroups' meeting
// after a varlen tile's tail is zeroed.
enum class FwdSm90NamedBarrier : uint32_t { kTurnOfWarpGroup0 = 0, kEpilogue0 = 3, kZeroVTail = 6 };

// One block per SM or one per query block (the launcher's choice,
// launch_flash_fwd_sm90). A block's first tile of the (query block, head,
// batch) grid, in the order of fwd_block_order.h, is blockIdx.x. Its next
// ones are blockIdx.x + gridDim.x, ... when every tile does the same work;
// with a causal or local bound, or in a varlen batch, the tiles' work
// differs, and fixed shares leave some SMs with the long tiles at the end,
// so a block takes its next tile from a counter in global memory as it
// frees up (kTilesFromCounter; longest first, as the hardware hands out an
// ordinary grid). A persistent block's producer runs
// ahead into the next tile (its K / V stages as they come free, its Q once
// the MMA warpgroups have handed Q back), so a tile's prologue overlaps the
// last one's tail.
//
// kWithScoreMods: the scores go through softcap and ALiBi before the mask,
// kept in the units of ScoreModsInUnits (score_mods.h), which leave the
// scale or the softcap to the exp2 multiplier. Its own instantiation, so
// that the plain rule's loop carries none of it.
template <typename Traits, bool kTilesFromCounter, bool kWithScoreMods = false>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    flash_fwd_sm90_kernel(const FwdParams params, const __grid_constant__ FwdSm90Tma<Traits> tma,
                          const FwdTileDivisors tile_divisors) {
  static_assert(Traits::kPersistent || !kTilesFromCounter, "only a persistent grid takes tiles");
  static_assert(!(kTilesFromCounter && kWithScoreMods),
                "the counter grid runs the plain score rule (fwd_sm90_takes_tiles_from_counter)");
#if defined(CUTE_ARCH_MMA_SM90A_ENABLED)
  using Element = typename Traits::Element;
  using NamedBarrier = cutlass::arch::NamedBarrier;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kStages = Traits::kStages;
  constexpr int kNMmaThreads = Traits::kNMmaThreads;

  extern __shared__ char smem[];
  const int tidx = threadIdx.x;
  // The MMA warpgroups are threads [128, 384): their index from 0.
  const int mma_tidx = tidx - 128;
  const bool causal = params.window_right >= 0;
  const int num_m_blocks = (params.seqlen_q + kBlockM - 1) / kBlockM;
  const int64_t num_tiles = int64_t(num_m_blocks) * params.nheads * params.batch;

  // (M,D)
  Tensor sQ =
      make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(sQ.data() + size(sQ), typename Traits::SmemLayoutKV{});  // (N,D,stage)
  Tensor sV = make_tensor(sK.data() + size(sK), typename Traits::SmemLayoutKV{});  // (N,D,stage)
  Tensor sVt = make_tensor(sV.data(), typename Traits::SmemLayoutVt{});            // (D,N,stage)
  Tensor sO = make_tensor(Traits::kSeparateO ? sV.data() + size(sV) : sQ.data(),
                          typename Traits::SmemLayoutO{});  // (M,D)
  auto& barriers = *reinterpret_cast<typename Traits::Barriers*>(smem + Traits::kSmemSizeTiles);

  if (tidx == 0) {
    full_barrier(barriers.q_full).init(1);
    empty_barrier(barriers.q_empty).init(kNMmaThreads);
    CUTE_UNROLL
    for (int s = 0; s < kStages; ++s) {
      full_barrier(barriers.k_full[s]).init(1);
      full_barrier(barriers.v_full[s]).init(1);
      // Every MMA thread hands a stage back once its wgmmas have read it.
      empty_barrier(barriers.k_empty[s]).init(kNMmaThreads);
      empty_barrier(barriers.v_empty[s]).init(kNMmaThreads);
    }
    if constexpr (kTilesFromCounter) {
      empty_barrier(barriers.tile_full).init(1);
      // Read by every MMA thread and by the thread that issues the copies.
      empty_barrier(barriers.tile_empty).init(kNMmaThreads + 1);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  // The query block of a tile, its visible key blocks (none: the tile only
  // writes empty rows) and whether it has rows at all (varlen).
  struct Tile {
    BlockInfo binfo;
    FwdBlock block;
    int n_key_blocks;
  };
  auto tile_at = [&](int64_t tile) {
    const FwdBlockCoord coord = fwd_tile_coord(causal, tile, tile_divisors);
    const BlockInfo binfo(params, coord.batch);
    const FwdBlock block = fwd_block<kBlockM, kBlockN>(params, coord, binfo);
    return Tile{binfo, block, block.n_block_max - block.n_block_min};
  };

  // A block's tiles, in turn. Without a tile for O a block runs exactly one
  // (the launcher's grid), in straight-line code: the loop around it cost the
  // d256 kernel 150 B of spills.
  //
  // Tiles from the counter: the first wave is blockIdx.x, which needs none.
  // One MMA thread takes the block's next tile while the first S of the
  // current one is on the tensor cores (the atomic's latency hides behind
  // it) and publishes it in a slot of shared memory; the copy-issuing thread
  // reads it once it has issued the current tile's loads, and runs ahead into
  // that tile; the MMA warpgroups read it under their last P V (up to d128,
  // below) or once done with the current tile. So a block
  // holds at most one tile it has not started. An index past the grid tells
  // everyone to stop. (Not a thread of the producer warpgroup: any mbarrier
  // work of a second producer thread made ptxas spill the copy-issuing
  // thread's loop at its 24 registers.) A kernel of its own: the code for it
  // slowed the fixed-share and one-block-per-tile grids (PERF_LOG 2026-11-24
  // 30a90ef).
  auto next_tile = [&](int round) -> int64_t {
    empty_barrier(barriers.tile_full).wait(round & 1);
    const int64_t next = barriers.scheduled_tile;
    empty_barrier(barriers.tile_empty).arrive();
    return next;
  };
  // body(tile, look_ahead) calls look_ahead() once. On the counter's grid up
  // to d128 it takes the next tile and works out its block, a chain of
  // dependent integer work and parameter loads (varlen: of cu_seqlens), and
  // the MMA warpgroups call it under their last P V: the counter's query
  // blocks are short, and the chain had every MMA warp waiting on it between
  // two of them; there it won at short causal calls, while on the
  // fixed-share grid and at d224 (more spills) it lost (PERF_LOG 2026-11-24
  // fff1485). Its
  // results are pinned by an empty asm, without which ptxas sinks the chain
  // below the wait for that P V.
  constexpr bool kLookAhead = kTilesFromCounter && kHeadDim <= 128;
  auto for_each_tile = [&](auto&& body) {
    if constexpr (kLookAhead) {
      int64_t tile_index = blockIdx.x;
      if (tile_index >= num_tiles) return;
      Tile tile = tile_at(tile_index);
      for (int round = 0;; ++round) {
        int64_t next_index = num_tiles;
        Tile next = tile;
        body(tile, [&] {
          next_index = next_tile(round);
          if (next_index < num_tiles) next = tile_at(next_index);
          const FwdBlock& b = next.block;
          asm volatile("" ::"r"(b.m_block), "r"(b.head), "r"(b.batch), "r"(b.head_kv),
                       "r"(b.row_begin), "r"(b.rows_left), "r"(b.n_block_min), "r"(b.n_block_max),
                       "r"(next.n_key_blocks), "r"(next.binfo.seqlen_q), "r"(next.binfo.seqlen_k),
                       "l"(next.binfo.q_row_begin), "l"(next.binfo.k_row_begin), "l"(next_index));
        });
        if (next_index >= num_tiles) break;
        tile_index = next_index;
        tile = next;
      }
    } else if constexpr (kTilesFromCounter) {
      int64_t tile_index = blockIdx.x;
      for (int round = 0; tile_index < num_tiles; ++round) {
        body(tile_at(tile_index), [] {});
        tile_index = next_tile(round);
      }
    } else if constexpr (Traits::kPersistent) {
      for (int64_t tile_index = blockIdx.x; tile_index < num_tiles; tile_index += gridDim.x) {
        body(tile_at(tile_index), [] {});
      }
    } else {
      body(tile_at(blockIdx.x), [] {});
    }
  };

  // Key tiles are counted across the block's query blocks: the walk's i-th
  // K / V tile uses stage i % kStages, in that stage's (i / kStages)-th round;
  // Q's j-th load is round j of its one buffer.
  auto stage_of = [](int i) { return i % kStages; };
  auto phase_of = [](int i) { return uint32_t((i / kStages) & 1); };

  if (tidx < 128) {
    // Producer: one thread issues every copy.
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegisters>();
    if (tidx != 0) return;
    int kv_loads = 0;
    int q_loads = 0;
    auto load_tile = [&](const Tile& tile, auto&& look_ahead) {
      if (tile.block.rows_left <= 0 || tile.n_key_blocks <= 0) {
        look_ahead();
        return;
      }
      const FwdBlock& block = tile.block;
      Tensor gQ =
          local_tile(tma_q_of(tma.q, params, tile.binfo, block.head, block.batch),
                     Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(block.m_block, 0));  // (M,D)
      Tensor gK = local_tile(tma_kv_of(tma.k, params, tile.binfo, block.head_kv, block.batch),
                             Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, 0));  // (N, D, n)
      Tensor gV = local_tile(tma_kv_of(tma.v, params, tile.binfo, block.head_kv, block.batch),
                             Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, 0));  // (N, D, n)
      auto [tQgQ, tQsQ] = tma_partition(tma.q, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
      auto [tKgK, tKsK] = tma_partition(tma.k, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
      auto [tVgV, tVsV] = tma_partition(tma.v, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
      // Rows and columns past the tensors' ends land as zeros, so a head dim
      // below kHeadDim and, in a fixed-length batch, the last K / V tile need
      // no predicates. A varlen tile reads on into the next sequence's rows
      // (see zero_v_rows_past_end).
      // Tile i of this query block's K or V into its stage, once the MMA
      // warpgroups have handed that stage back.
      auto load_key_tile = [&](const auto& tma_copy, uint64_t* full_stages, uint64_t* empty_stages,
                               const auto& tXgX, const auto& tXsX, int i) {
        const int stage = stage_of(kv_loads + i);
        empty_barrier(empty_stages[stage]).wait(phase_of(kv_loads + i) ^ 1);
        full_barrier(full_stages[stage]).arrive_and_expect_tx(Traits::kSmemSizeKVStage);
        copy(tma_copy.with(full_stages[stage]), tXgX(_, block.n_block_max - 1 - i), tXsX(_, stage));
      };
      auto load_k = [&](int i) {
        load_key_tile(tma.k, barriers.k_full, barriers.k_empty, tKgK, tKsK, i);
      };
      auto load_v = [&](int i) {
        load_key_tile(tma.v, barriers.v_full, barriers.v_empty, tVgV, tVsV, i);
      };
      // K(0) may go ahead of Q: its stage is free as soon as the last tile's
      // wgmmas have read it.
      load_k(0);
      empty_barrier(barriers.q_empty).wait((q_loads & 1) ^ 1);
      full_barrier(barriers.q_full).arrive_and_expect_tx(Traits::kSmemSizeQ);
      copy(tma.q.with(barriers.q_full), tQgQ, tQsQ);
      // The order the MMA warpgroups consume them: iteration i reads K(i) and
      // V(i - 1).
      for (int i = 1; i < tile.n_key_blocks; ++i) {
        load_k(i);
        load_v(i - 1);
      }
      load_v(tile.n_key_blocks - 1);
      kv_loads += tile.n_key_blocks;
      ++q_loads;
      look_ahead();
    };
    for_each_tile(load_tile);
    return;
  }

  // MMA warpgroups.
  cutlass::arch::warpgroup_reg_alloc<Traits::kMmaRegisters>();
  constexpr int kNMmaWarpGroups = Traits::kNMmaWarpGroups;
  const int warp_group = mma_tidx / 128;
  // The warpgroups issue their products in a cycle, 0, 1, (2,) 0, ...: each
  // waits on its own turn, which the one before it hands on right after
  // issuing, so 2 x 128 threads meet at each turn.
  constexpr uint32_t kTurnThreads = 2 * 128;
  const uint32_t my_turn = uint32_t(FwdSm90NamedBarrier::kTurnOfWarpGroup0) + warp_group;
  const uint32_t next_turn =
      uint32_t(FwdSm90NamedBarrier::kTurnOfWarpGroup0) + (warp_group + 1) % kNMmaWarpGroups;
  const bool last_warp_group = warp_group == kNMmaWarpGroups - 1;
  const uint32_t my_epilogue = uint32_t(FwdSm90NamedBarrier::kEpilogue0) + warp_group;

  typename Traits::TiledMmaS tiled_mma_s;
  typename Traits::TiledMmaO tiled_mma_o;
  auto thr_mma_s = tiled_mma_s.get_thread_slice(mma_tidx);
  auto thr_mma_o = tiled_mma_o.get_thread_slice(mma_tidx);
  Tensor tSrQ = thr_mma_s.partition_fragment_A(sQ);    // (MMA, MMA_M, MMA_K)
  Tensor tSrK = thr_mma_s.partition_fragment_B(sK);    // (MMA, MMA_N, MMA_K, stage)
  Tensor tOrVt = thr_mma_o.partition_fragment_B(sVt);  // (MMA, MMA_D, MMA_K, stage)
  Tensor cS = make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{});  // (M,N) -> (row,col)
  Tensor tScS = thr_mma_s.partition_C(cS);                                // (MMA,MMA_M,MMA_N)
  // (ROW,COL) = ((2,MMA_M),(2,N/8,MMA_N)), tile_ops_sm90.h
  Tensor tScS_rowcol = make_tensor(tScS.data(), wgmma_acc_layout_as_rowcol(tScS.layout()));
  auto rows_of_warp_group = [&](auto& tile) {
    return local_tile(tile, Shape<_64, Int<kHeadDim>>{}, make_coord(warp_group, 0));
  };

  const bool has_alibi = kWithScoreMods && params.alibi_slopes != nullptr;

  int kv_loads = 0;
  int q_loads = 0;
  // The MMA thread that takes the tiles from the counter.
  const bool takes_tiles = kTilesFromCounter && mma_tidx == 0;
  int tiles_published = 0;
  auto take_tile = [&]() {
    return int64_t(gridDim.x) + int64_t(atomicAdd(params.tile_counter, 1ull));
  };
  auto publish_tile = [&](int64_t next) {
    empty_barrier(barriers.tile_empty).wait((tiles_published & 1) ^ 1);
    barriers.scheduled_tile = next;
    empty_barrier(barriers.tile_full).arrive();  // release: the slot is visible
    ++tiles_published;
  };
  auto compute_tile = [&](const Tile& tile, auto&& look_ahead) {
    const BlockInfo& binfo = tile.binfo;
    const FwdBlock& block = tile.block;
    // varlen: this sequence is shorter than the longest
    if (block.rows_left <= 0) {
      if (takes_tiles) publish_tile(take_tile());
      look_ahead();
      return;
    }
    const int row_begin = block.row_begin;
    const int rows_left = block.rows_left;
    const int n_block_max = block.n_block_max;
    const int n_tiles = tile.n_key_blocks;
    float* lse_rows = fwd_lse_rows(params, binfo, block);
    const ScoreModsInUnits score_mods(
        params.softmax_scale, kWithScoreMods ? params.softcap : 0.f, has_alibi,
        has_alibi ? params.alibi_slopes[block.batch * params.alibi_batch_stride + block.head]
                  : 0.f);
    const float exp_scale_log2 =
        kWithScoreMods ? score_mods.exp_scale_log2() : params.softmax_scale_log2;
    // (M,D)
    Tensor gO = get<3>(fwd_global_tiles<Element, kBlockM, kBlockN, kHeadDim>(params, binfo, block));
    if (n_tiles <= 0) {
      if (takes_tiles) publish_tile(take_tile());
      look_ahead();
      Tensor cO = make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{});  // (M,D) -> (row,col)
      write_empty_rows<Traits>(gO, cO, lse_rows, rows_left, params.head_dim, mma_tidx);
      return;
    }
    // Warpgroup 0 issues first.
    if (last_warp_group) NamedBarrier::arrive(kTurnThreads, next_turn);

    // (MMA,MMA_M,MMA_D)
    Tensor acc_o = partition_fragment_C(tiled_mma_o, Shape<Int<kBlockM>, Int<kHeadDim>>{});
    clear(acc_o);
    // (MMA,MMA_M,MMA_N)
    Tensor acc_s = partition_fragment_C(tiled_mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});
    // (MMA,MMA_M,MMA_K): P as the A operand of O += P V, K = the N keys
    Tensor tOrP = make_tensor<Element>(wgmma_acc_layout_as_operand_a(acc_s.layout()));
    // (ROW,COL) views of S and O
    Tensor scores = make_tensor(acc_s.data(), wgmma_acc_layout_as_rowcol(acc_s.layout()));
    Tensor acc_o_rowcol = make_tensor(acc_o.data(), wgmma_acc_layout_as_rowcol(acc_o.layout()));
    constexpr int kNRows = decltype(size<0>(acc_o_rowcol))::value;
    OnlineSoftmax<kNRows> softmax;
    auto stage = [&](int i) { return stage_of(kv_loads + i); };
    auto phase = [&](int i) { return phase_of(kv_loads + i); };

    full_barrier(barriers.q_full).wait(q_loads & 1);

    // The rows of a varlen sequence's last K / V tile past its end are the
    // next sequence's: their scores are masked, but P = 0 times a V that is
    // not finite would still reach O, so those V rows are zeroed before P V
    // reads them. Tile 0 is the only one that can reach past the end. Outside
    // the turns: all MMA warpgroups meet here.
    const int v_rows_past_end = binfo.seqlen_k - (n_block_max - 1) * kBlockN;
    const bool zero_v_tail = binfo.varlen && v_rows_past_end < kBlockN;
    auto zero_v_rows_past_end = [&]() {
      full_barrier(barriers.v_full[stage(0)]).wait(phase(0));
      Tensor sV_tile = sV(_, _, stage(0));  // (N,D)
      for (int idx = mma_tidx; idx < (kBlockN - v_rows_past_end) * kHeadDim; idx += kNMmaThreads) {
        sV_tile(v_rows_past_end + idx / kHeadDim, idx % kHeadDim) = Element(0);
      }
      cutlass::arch::fence_view_async_shared();  // wgmma reads through the async proxy
      NamedBarrier::arrive_and_wait(kNMmaThreads, uint32_t(FwdSm90NamedBarrier::kZeroVTail));
    };

    // Iteration i: S(i) = Q K(i)^T, and O += P(i-1) V(i-1) behind it on the
    // tensor cores while the softmax of S(i) runs. The first iteration has
    // no P V yet; it is peeled off at compile time (a branch around a wgmma
    // inside a batch makes ptxas serialize the batch).
    auto iteration = [&](int i, auto has_pending_pv) {
      constexpr bool kHasPendingPv = decltype(has_pending_pv)::value;
      const int n_block = n_block_max - 1 - i;
      if (kHasPendingPv && i == 1 && zero_v_tail) zero_v_rows_past_end();
      full_barrier(barriers.k_full[stage(i)]).wait(phase(i));
      NamedBarrier::arrive_and_wait(kTurnThreads, my_turn);
      warpgroup_fence_operand(acc_s);
      warpgroup_arrive();
      wgmma_issue</*kZeroInit=*/true>(tiled_mma_s, tSrQ, tSrK(_, _, _, stage(i)), acc_s);
      warpgroup_commit_batch();
      int64_t taken_tile = 0;
      if (!kHasPendingPv && takes_tiles) taken_tile = take_tile();
      if constexpr (kHasPendingPv) {
        full_barrier(barriers.v_full[stage(i - 1)]).wait(phase(i - 1));
        warpgroup_fence_operand(tOrP);
        warpgroup_fence_operand(acc_o);
        warpgroup_arrive();
        wgmma_issue</*kZeroInit=*/false>(tiled_mma_o, tOrP, tOrVt(_, _, _, stage(i - 1)), acc_o);
        warpgroup_commit_batch();
      }
      NamedBarrier::arrive(kTurnThreads, next_turn);
      warpgroup_wait<kHasPendingPv ? 1 : 0>();  // S(i) has landed
      warpgroup_fence_operand(acc_s);
      if (!kHasPendingPv && takes_tiles) publish_tile(taken_tile);
      empty_barrier(barriers.k_empty[stage(i)]).arrive();
      // With O staged apart, Q is free once the last S has landed.
      if (Traits::kSeparateO && i == n_tiles - 1) empty_barrier(barriers.q_empty).arrive();

      const int col_base = n_block * kBlockN;
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

      if constexpr (kHasPendingPv) {
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc_o);
        warpgroup_fence_operand(tOrP);
        empty_barrier(barriers.v_empty[stage(i - 1)]).arrive();
      }
      softmax.template rescale_output</*kSkipUnmovedRescale=*/true>(acc_o_rowcol, correction);
      convert_type_into(acc_s, tOrP);
    };

    iteration(0, cute::false_type{});
    for (int i = 1; i < n_tiles; ++i) iteration(i, cute::true_type{});

    // The last tile's P V. The last warpgroup takes the last turn, so it
    // hands none on.
    const int last = n_tiles - 1;
    if (last == 0 && zero_v_tail) zero_v_rows_past_end();
    full_barrier(barriers.v_full[stage(last)]).wait(phase(last));
    NamedBarrier::arrive_and_wait(kTurnThreads, my_turn);
    warpgroup_fence_operand(tOrP);
    warpgroup_fence_operand(acc_o);
    warpgroup_arrive();
    wgmma_issue</*kZeroInit=*/false>(tiled_mma_o, tOrP, tOrVt(_, _, _, stage(last)), acc_o);
    warpgroup_commit_batch();
    if (!last_warp_group) NamedBarrier::arrive(kTurnThreads, next_turn);
    look_ahead();
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_o);
    empty_barrier(barriers.v_empty[stage(last)]).arrive();

    float lse[kNRows];
    softmax.finalize(acc_o_rowcol, kWithScoreMods ? score_mods.unit : params.softmax_scale, 1.f,
                     lse);

    // Each warpgroup stages its own 64 rows of O (over its own rows of Q,
    // which only its own finished wgmmas read, unless O has a tile of its
    // own) and stores them. The barrier before: every thread of the
    // warpgroup is done reading the last query block's O.
    NamedBarrier::arrive_and_wait(128, my_epilogue);
    stage_output<Traits>(
        acc_o, tiled_mma_o, thr_mma_o, sO,
        [](auto layout) { return wgmma_acc_layout_as_rowcol(layout); }, lse, lse_rows, rows_left,
        mma_tidx);
    NamedBarrier::arrive_and_wait(128, my_epilogue);
    Tensor sO_warp_group = rows_of_warp_group(sO);  // (64,D): this warpgroup's rows
    Tensor gO_warp_group = rows_of_warp_group(gO);  // (64,D)
    store_output<typename Traits::GmemTiledCopyOWarpGroup>(
        sO_warp_group, gO_warp_group, rows_left - 64 * warp_group, params.head_dim, mma_tidx % 128);
    if (!Traits::kSeparateO) empty_barrier(barriers.q_empty).arrive();
    kv_loads += n_tiles;
    ++q_loads;
  };
  for_each_tile(compute_tile);
#endif
}

}  // namespace flash
