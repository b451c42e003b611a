// The split-KV (flash-decoding) forward kernel of fwd_kvcache. Its work items
// are (batch, kv head, query block, split) (splitkv_work_item.h): the query
// rows of all query heads that share the kv head are packed into the M
// dimension of the tile (packed row r = query i * group + g), so each K/V tile
// read from the cache serves the whole group. Split s walks its share of the
// key blocks and writes either the final output (one split) or an fp32
// partial output and its lse, merged afterwards by splitkv_combine_kernel.
//
// A thread block runs item blockIdx.x, then every gridDim.x-th item after it.
// Launched with one block per item, that is one item. Launched persistently
// (fewer blocks than items, one per SM) a block streams the K/V tiles of its
// items back to back: the copies of the next item's first tiles are in
// flight while the current item's last tiles are computed, and the item's
// output is merged and stored while the next item's tiles stream, so no SM
// waits out a block's start (Q, the first tile's latency) or a merge once
// per item.
//
// Differences from fwd_kernel_sm80.h: per-batch key counts (cache_seqlens,
// leftpad), K/V rows addressed one by one (a paged cache maps each row through
// the block table), the GQA packing of rows, which makes the row -> (query,
// head) mapping and hence the mask and ALiBi slope per row, and the warps:
// with few rows they split each K/V tile by keys, each running its own online
// softmax, and their rows are merged once at the end (SplitKvKernelTraits).
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "common/mask_rule.h"
#include "cuda/core/dependent_grid.h"
#include "cuda/core/params.h"
#include "cuda/core/score_mods.h"
#include "cuda/core/softmax.h"
#include "cuda/core/tile_ops.h"
#include "cuda/decode/rotary.h"
#include "cuda/decode/splitkv_append.h"
#include "cuda/decode/splitkv_epilogue.h"
#include "cuda/decode/splitkv_kernel_traits.h"
#include "cuda/decode/splitkv_mainloop.h"
#include "cuda/decode/splitkv_merge_schedule.h"
#include "cuda/decode/splitkv_producer.h"
#include "cuda/decode/splitkv_scheduler.h"
#include "cuda/decode/splitkv_tile_config.h"
#include "cuda/decode/splitkv_work_item.h"

namespace flash {

using namespace cute;

// kSeveralItems: compiled for the persistent grid (a block may run several
// items); without it the block runs item blockIdx.x alone, and the grid must
// have a block per item. kAppends: compiled to do a decode step's append and
// rotary itself (params.append_in_attention); an instance of its own, so
// that the kernels of calls without them carry none of its code (with it
// compiled in and branched around, attention alone ran slower per call, though
// the main loop's machine code was the same: PERF_LOG 2026-11-24 13ddd85).
//
// The append and the rotation of a decode step are done here rather than in
// a kernel before this one (params.append_in_attention): that kernel's run
// and the wait for it cost a step more than its copies (PERF_LOG 2026-11-23
// b82fd11); SplitKvAppend does it. The host leaves the persistent grid, whose
// blocks would wait once per item, and the other cases of
// append_in_attention_fits (launch/plan.cpp) to the pre-kernel.
//
// Launched as a dependent grid (params.programmatic_launch), a block may be
// running before the kernel ahead of it in the stream (the append / rotary
// step, or the caller's) has finished: nothing reads global memory before
// the wait. The combine kernel (if any) may be scheduled as soon as every
// block of this grid runs: it waits for this grid's results itself, and its
// launch latency then overlaps this kernel instead of following it.
template <typename Traits, bool kWithScoreExtras, CacheLayout kLayout, bool kSeveralItems,
          bool kAppends = false>
__global__ void __launch_bounds__(Traits::kNThreads,
                                  splitkv_launch_min_blocks(Traits::kHeadDim, Traits::kWarpsN,
                                                            Traits::kVInK, Traits::kCacheFp8,
                                                            kWithScoreExtras))
    flash_fwd_splitkv_kernel(const KvcacheParams params) {
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kWarpsN = Traits::kWarpsN;
  constexpr int kSlabN = Traits::kSlabN;
  constexpr int kStages = Traits::kStages;

  wait_for_preceding_grid();
  allow_dependent_grid_launch();

  extern __shared__ char smem[];
  const int tidx = threadIdx.x;
  const int lane = tidx % 32;
  constexpr int kWarpsV = Traits::kWarpsV;
  const int warp_n = (tidx / 32) % kWarpsN;              // which slab of keys of each tile
  const int warp_v = (tidx / 32 / kWarpsN) % kWarpsV;    // which columns of the value dim
  const int warp_m = (tidx / 32) / (kWarpsN * kWarpsV);  // which 16 query rows

  const int group = params.nheads / params.nheads_k;
  const int seqlen_q = params.seqlen_q;
  const SplitKvScheduler<kBlockM, kBlockN, !kSeveralItems> scheduler(params, seqlen_q, group);
  const int num_items = scheduler.num_items;

  static_assert(!(kAppends && kSeveralItems),
                "the persistent grid leaves the append to a pre-kernel");
  static_assert(!(kAppends && Traits::kVInK),
                "V read in the K tile: an append into a shared cache runs in the pre-kernel");
  const bool append_here = kAppends && params.append_in_attention;
  const bool appending = append_here && params.seqlen_new > 0;
  const bool rotating = append_here && params.rotary_dim > 0;

  using Smem = SplitKvSmem<Traits, kSeveralItems>;
  const Smem smem_tiles(smem, warp_n, warp_m, warp_v);
  constexpr int q_slots = Smem::kQSlots;

  SplitKvGmemPartition<Traits> gmem(tidx);

  // The producer roles (splitkv_producer.h) and their stream of copies.
  // Paged cache: where this thread's K/V copy rows of the tile being located
  // are (SplitKvTileLoader::locate_tile).
  using TileLoader = SplitKvTileLoader<Traits, kLayout, kSeveralItems, kAppends>;
  int row_page[TileLoader::kCopyRows];
  int row_in_page[TileLoader::kCopyRows];
  bool row_shares_page[TileLoader::kCopyRows];
  TileLoader loader(params, smem_tiles, group, appending, gmem.gmem_thr_copy_QKV, gmem.tQcQ,
                    gmem.tKVcKV, row_page, row_in_page, row_shares_page);
  static_assert(!kAppends || q_slots == 1, "one Q slot before the table rows");
  const SplitKvAppend<Traits, kSeveralItems> append{
      params, smem_tiles, tidx, group, appending, rotating, smem_tiles.past_q_slots()};

  const SplitKvItem first_item =
      scheduler.item_at(blockIdx.x, splitkv_item_inputs(params, blockIdx.x));
  SplitKvItem load_item_work = first_item;
  int load_item = blockIdx.x;
  int load_n_block = first_item.n_block_max - 1;
  int load_q_slot = first_item.has_keys() ? 0 : q_slots - 1;
  SplitKvItemInputs load_next_inputs{};
  if constexpr (kSeveralItems) {
    load_next_inputs = splitkv_item_inputs(params, scheduler.next_item(load_item));
  }
  const SplitKvItemAdvance<Traits, kLayout, kSeveralItems, kAppends> advance_load_item{
      load_item, num_items,    load_item_work, scheduler, load_next_inputs,
      params,    load_n_block, load_q_slot,    loader};
  const SplitKvProducer<Traits, kLayout, kSeveralItems, kAppends> producer{
      load_n_block, load_item, num_items, load_item_work, loader, load_q_slot, advance_load_item};
  if (first_item.has_keys()) {
    loader.locate_tile(first_item, load_n_block);
    if (append_here) append.load_inputs(first_item);
  } else {
    advance_load_item();
  }
  CUTE_UNROLL
  for (int stage = 0; stage < kStages; ++stage) producer.load_next_tile(stage, std::true_type{});
  if (append_here && first_item.has_keys())
    splitkv_append_after_prologue<kStages>(append, first_item, appending, rotating);

  // Each warp multiplies its 16 query rows by its slab of keys on its own.
  using Tiling = SplitKvWarpTiling<Traits, kSeveralItems>;
  Tiling warp(lane, warp_n, warp_m, warp_v);
  SplitKvWarpFragments<Traits, kSeveralItems> frag;
  const SplitKvMma<Traits, kSeveralItems> mma{smem_tiles, warp, frag};
  using ScoreMod = SplitKvScoreMod<Traits, decltype(warp.tScS_rowcol), Tiling::kNRows>;
  // An e4m3 cache's descales of the block's one item (docs/fp8.md): K's
  // fold into the scores' scale, V's into the merge's weights.
  float k_descale = 1.f, v_descale = 1.f;
  if constexpr (Traits::kCacheFp8) {
    static_assert(!kSeveralItems && !kAppends, "an e4m3 cache: one item a block, no append");
    k_descale = kvcache_descale(params.k_descale_ptr, params.k_descale, first_item);
    v_descale = kvcache_descale(params.v_descale_ptr, params.v_descale, first_item);
    if constexpr (Traits::kQInHalf) {
      // Q came with the first tile's copies (block-uniform: one item).
      if (first_item.has_keys()) {
        cute::cp_async_wait<kStages - 1>();
        k_descale *= smem_tiles.q_slot_to_half(0, tidx);
      }
    }
  }
  using ScoreScale = SplitKvScoreScale<kWithScoreExtras, Traits::kCacheFp8>;
  const ScoreScale scale = [&] {
    if constexpr (Traits::kCacheFp8) {
      return ScoreScale(params, k_descale);
    } else {
      return ScoreScale(params);
    }
  }();

  using Merge = SplitKvMergeSchedule<Traits, kSeveralItems>;
  float* const o_parts = Merge::o_parts(smem);
  // A row that saw no key in this block's range gets output 0 and lse +inf
  // (final) or -inf (a partial result that must weigh nothing in the merge).
  const bool final_output = params.num_splits == 1;
  const int64_t rows_per_split = splitkv_rows_per_split(params);
  float2* const row_stats = Merge::row_stats(o_parts);
  const float exp_scale_log2 = scale.exp_scale_log2, lse_scale = scale.lse_scale;
  const SplitKvEpilogue<Traits, kSeveralItems> epilogue{
      params,         tidx,      o_parts,      row_stats,      group,    seqlen_q,
      exp_scale_log2, lse_scale, final_output, rows_per_split, v_descale};
  Merge merge;

  int stage = 0;
  int q_slot = q_slots - 1;
  SplitKvItemInputs next_inputs{};
  if constexpr (kSeveralItems)
    next_inputs = splitkv_item_inputs(params, scheduler.next_item(blockIdx.x));
  for (int item = blockIdx.x; item < num_items; item += gridDim.x) {
    SplitKvItem it = first_item;
    scheduler.template to_item<kSeveralItems>(it, item, next_inputs);
    // Decode packs only seqlen_q x group rows (often 4-8): a warp whose rows
    // are all padding skips the MMAs and their shared-memory reads. No
    // barrier sits inside the skipped part, and its rows are never written.
    const bool warp_has_rows = warp.warp_row0 < it.rows_left;
    const ScoreMod score_mod(params, it, warp.tScS_rowcol, scale, group, warp.warp_row0);
    OnlineSoftmax<Tiling::kNRows> softmax;
    clear(frag.acc_o);
    if (it.has_keys()) q_slot = Smem::next_q_slot(q_slot);
    // (CPY,CPY_M,CPY_K)
    Tensor tSsQ = warp.smem_thr_copy_Q.partition_S(smem_tiles.slab_q(q_slot));

    for (int n_block = it.n_block_max - 1; n_block >= it.n_block_min; --n_block) {
      cute::cp_async_wait<kStages - 1>();
      if constexpr (Traits::kCacheFp8 && !Traits::kFragmentsFromStage) loader.convert_stage(stage);
      __syncthreads();
      if (warp_has_rows) {
        // (MMA,MMA_M,MMA_N)
        Tensor acc_s = partition_fragment_C(warp.warp_mma, Shape<_16, Int<kSlabN>>{});
        mma.qk(acc_s, tSsQ, stage);
        // (ROW,COL)
        Tensor scores = make_tensor(acc_s.data(), acc_layout_as_rowcol(acc_s.layout()));
        const int col_base = n_block * kBlockN + warp.warp_col0;
        score_mod.apply_extras(scores, warp.tScS_rowcol, params, scale, it.seqlen_q, it.seqlen_k,
                               col_base);
        if (!key_tile_fully_visible(it.query_first, it.query_last + 1, n_block * kBlockN,
                                    (n_block + 1) * kBlockN, it.seqlen_q, it.seqlen_k,
                                    params.window_left, params.window_right)) {
          // The mask stays here: as a SplitKvScoreMod method it changed the
          // machine code of the contiguous-cache kernels.
          CUTE_UNROLL
          for (int mi = 0; mi < Tiling::kNRows; ++mi) {
            const KeyRange visible =
                visible_key_range(score_mod.row_query[mi], score_mod.row_query[mi] + 1, it.seqlen_q,
                                  it.seqlen_k, params.window_left, params.window_right);
            const int col_lo = visible.begin - col_base;
            const int col_hi = visible.end - col_base;
            CUTE_UNROLL
            for (int ni = 0; ni < size<1>(scores); ++ni) {
              const int col = get<1>(warp.tScS_rowcol(0, ni));
              if (col < col_lo || col >= col_hi) scores(mi, ni) = -INFINITY;
            }
          }
        }
        mma.softmax_pv(acc_s, scores, softmax, scale.exp_scale_log2, stage);
      }
      // Every warp is done with this stage before it is refilled.
      __syncthreads();
      producer.load_next_tile(stage, std::false_type{});
      stage = stage == kStages - 1 ? 0 : stage + 1;
      merge.after_tile_step(epilogue);
    }
    merge.end_item(epilogue, it, warp_has_rows, softmax, warp, frag, warp_n, warp_v, lane);
    if constexpr (!kSeveralItems) break;
  }
  merge.end_block(epilogue);
}

}  // namespace flash
