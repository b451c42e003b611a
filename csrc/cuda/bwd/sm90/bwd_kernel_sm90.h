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
// the whole block meet at the top of every query block: PERF_LOG 2026-11-24
// 29b2865, PERF_LOG 2026-11-24 f22e9b6.)
//
// The roles are types: the producer's loads and the MMA warpgroups' products
// in bwd_mainloop_sm90.h, the dQ accumulation and the dK / dV epilogue in
// bwd_epilogue_sm90.h, the shared memory, stage rounds and walk over key
// blocks (tile scheduler) in bwd_pipeline_sm90.h; the kernel below only sets
// them up and runs each role's walk.
//
// It runs the causal / local / bounds mask with a positive normal scale and,
// in its kWithScoreMods variant, softcap and ALiBi before the mask and
// dropout's keep mask (except on the 128-row d64 tile:
// BwdSm90KernelTraits::kDrawsDropout), on inputs TMA can describe; the
// launcher sends anything else to bwd_kernel_sm80.h.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "cuda/bwd/bwd_block_io.h"
#include "cuda/bwd/sm90/bwd_epilogue_sm90.h"
#include "cuda/bwd/sm90/bwd_kernel_traits_sm90.h"
#include "cuda/bwd/sm90/bwd_mainloop_sm90.h"
#include "cuda/bwd/sm90/bwd_pipeline_sm90.h"
#include "cuda/core/block_info.h"
#include "cuda/core/grid_heads_batch.h"
#include "cuda/core/params.h"
#include "cuda/core/tile_ops_sm90.h"
#include "cuda/core/tma_loads_sm90.h"

namespace flash {

using namespace cute;

// Grid: (key blocks, or dQ splits when deterministic; (head, batch) pairs of
// grid_heads_batch.h), as the SM80 kernel's; BwdSm90TileScheduler walks a
// block's key blocks.
//
// kWithScoreMods: S^T goes through softcap and ALiBi before the mask, kept
// in the units of ScoreModsInUnits (score_mods.h), and dropout's keep bits
// are drawn under S^T and dP^T (docs/dropout_sm90.md, section 6). Under softcap, P^T and
// dS^T are made in one pass once dP^T has landed too
// (softcapped_p_and_ds_transposed: the softcap's derivative comes from the
// kept score, which P overwrites), so its exponentials no longer run under
// the dP^T product; ALiBi alone keeps that overlap, as the plain rule.
//
// kOrderedDQ (deterministic mode, plan.ordered_dq; plain variant only): one
// key block per thread block, the last launched first, walking its query
// blocks from the first up, whose dQ additions wait for their turn
// (bwd_sm90_dq_turn: BwdSm90DQWriter, or BwdSm90DQOrder above head dim
// 128). A template flag, not a run-time branch, so that the
// default kernel keeps its code: the order warp's code beside the load
// warps' spilled theirs (PERF_LOG 2026-11-28, ordered dQ).
template <typename Traits, bool kWithScoreMods = false, bool kOrderedDQ = false>
__global__ void __launch_bounds__(Traits::kNLaunchThreads, 1)
    flash_bwd_sm90_kernel(const BwdParams params, const __grid_constant__ BwdSm90Tma<Traits> tma) {
#if defined(CUTE_ARCH_MMA_SM90A_ENABLED)
  static_assert(Traits::kNThreads == 256, "two MMA warpgroups");
  static_assert(Traits::kNLaunchThreads == Traits::kNThreads + 128, "and one producer warpgroup");
  static_assert(!(kOrderedDQ && kWithScoreMods), "ordered dQ is a variant of the plain kernel");
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kStages = Traits::kStages;
  constexpr int kNMmaThreads = Traits::kNThreads;

  using Storage = BwdSm90SharedStorage<Traits>;
  const int tidx = threadIdx.x;
  HeadBatch pair;
  if (!block_head_batch(params.nheads, params.batch, pair)) return;
  const int head = pair.head;
  const int batch = pair.batch;
  const BlockInfo binfo(params, batch);
  const BwdSm90TileScheduler<kBlockN, kStages, kOrderedDQ> scheduler(binfo.seqlen_k);
  // Deterministic with dQ splits: this block's slice (BwdSm90DQAccumulator).
  const int split = !kOrderedDQ && params.deterministic ? blockIdx.x : 0;
  auto& barriers = Storage::barriers();

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

  if (tidx < 128) {
    // The producer warpgroup: warp 0's lane 0 issues the TMA copies, warp 1
    // loads the row statistics, warp 2 adds the staged dQ of each query block
    // (BwdSm90DQWriter, where Traits::kDQThroughSmem; in deterministic mode with
    // ordered dQ, on the key block's turn) or else, ordered, keeps the order
    // of the MMA warps' additions (BwdSm90DQOrder).
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegisters>();
    const int warp = tidx / 32;
    const int lane = tidx % 32;
    if constexpr (Traits::kDQThroughSmem) {
      if (warp == 2) {
        const BwdSm90DQWriter<Traits, kOrderedDQ> dq_writer(params, binfo, batch, head, split);
        for (auto walk = scheduler.first(); scheduler.valid(walk); scheduler.advance(walk)) {
          dq_writer.write(bwd_key_block<kBlockM, kBlockN>(params, binfo, batch, head, walk.n_block),
                          lane);
        }
        return;
      }
    } else if constexpr (kOrderedDQ) {
      if (warp == 2) {
        const BwdSm90DQOrder<kBlockM, kBlockN> dq_order(params, binfo, batch, head);
        for (auto walk = scheduler.first(); scheduler.valid(walk); scheduler.advance(walk)) {
          dq_order.order(bwd_key_block<kBlockM, kBlockN>(params, binfo, batch, head, walk.n_block),
                         lane);
        }
        return;
      }
    }
    if (warp > 1) return;
    const BwdSm90MainloopLoad<Traits, kOrderedDQ> mainloop_load(params, tma, binfo, head, batch);
    for (auto walk = scheduler.first(); scheduler.valid(walk); scheduler.advance(walk)) {
      const BwdKeyBlock block =
          bwd_key_block<kBlockM, kBlockN>(params, binfo, batch, head, walk.n_block);
      const bool has_queries = block.m_block_max > block.m_block_min;
      if (warp == 0) {
        if (lane == 0) mainloop_load.load_tiles(block, has_queries, walk.round, walk.q_stages);
      } else if (has_queries) {
        mainloop_load.load_row_stats(block, lane, walk.q_stages);
      }
    }
    return;
  }

  // The MMA warpgroups: threads [128, 384), indexed from 0 for their
  // partitions (the accumulators' layout, which the conversion kernels read).
  cutlass::arch::warpgroup_reg_alloc<Traits::kMmaRegisters>();
  const int mma_tidx = tidx - 128;
  BwdSm90MainloopMma<Traits, kWithScoreMods, kOrderedDQ> mainloop(params, binfo, head, batch,
                                                                  mma_tidx);
  const BwdSm90Epilogue<Traits> epilogue(params, binfo, mma_tidx);
  for (auto walk = scheduler.first(); scheduler.valid(walk); scheduler.advance(walk)) {
    const BwdKeyBlock block =
        bwd_key_block<kBlockM, kBlockN>(params, binfo, batch, head, walk.n_block);
    const BwdSm90DQAccumulator<Traits, kOrderedDQ> dq_accum(params, binfo, block, split, mma_tidx);
    Tensor acc_dk = partition_fragment_C(
        mainloop.tiled_mma_dkv, Shape<Int<kBlockN>, Int<Traits::kHeadDim>>{});  // (MMA,MMA_M,MMA_N)
    Tensor acc_dv = partition_fragment_C(
        mainloop.tiled_mma_dv, Shape<Int<kBlockN>, Int<Traits::kHeadDimV>>{});  // (MMA,MMA_M,MMA_N)
    clear(acc_dk);
    clear(acc_dv);
    mainloop.mma(block, walk.round, walk.q_stages, acc_dk, acc_dv, dq_accum);
    epilogue.store(acc_dk, acc_dv, mainloop.tiled_mma_dkv, mainloop.thr_mma_dkv,
                   mainloop.tiled_mma_dv, mainloop.thr_mma_dv, block);
  }
#endif
}

}  // namespace flash
