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
#include "cuda/core/params.h"
#include "cuda/core/score_mods.h"
#include "cuda/core/softmax.h"
#include "cuda/core/tile_ops.h"
#include "cuda/decode/rotary.h"
#include "cuda/decode/splitkv_append.h"
#include "cuda/decode/splitkv_epilogue.h"
#include "cuda/decode/splitkv_mainloop.h"
#include "cuda/decode/splitkv_producer.h"
#include "cuda/decode/splitkv_scheduler.h"
#include "cuda/decode/splitkv_tile_config.h"
#include "cuda/decode/splitkv_work_item.h"
#include "cuda/fwd/sm80/fwd_kernel_traits_sm80.h"
#include "cuda/launch/dependent_launch.h"

namespace flash {

using namespace cute;

// kSeveralItems: compiled for the persistent grid (a block may run several
// items); without it the block runs item blockIdx.x alone, and the grid must
// have a block per item. kAppends: compiled to do a decode step's append and
// rotary itself (params.append_in_attention); an instance of its own, so
// that the kernels of calls without them carry none of its code (with it
// compiled in and branched around, attention alone ran slower per call, though
// the main loop's machine code was the same: PERF_LOG 2026-11-24 13ddd85).
template <typename Traits, bool kWithScoreExtras, CacheLayout kLayout, bool kSeveralItems,
          bool kAppends = false>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    flash_fwd_splitkv_kernel(const KvcacheParams params) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kWarpsN = Traits::kWarpsN;
  constexpr int kSlabN = Traits::kSlabN;
  constexpr int kStages = Traits::kStages;

  // Launched as a dependent grid (params.programmatic_launch), this block may
  // be running before the kernel ahead of it in the stream (the append /
  // rotary step, or the caller's) has finished: nothing here reads global
  // memory before the wait. The combine kernel (if any) may be scheduled as
  // soon as every block of this grid runs: it waits for this grid's results
  // itself, and its launch latency then overlaps this kernel instead of
  // following it.
  wait_for_preceding_grid();
  allow_dependent_grid_launch();

  extern __shared__ char smem[];
  const int tidx = threadIdx.x;
  const int lane = tidx % 32;
  const int warp_n = (tidx / 32) % kWarpsN;  // which slab of keys of each tile
  const int warp_m = (tidx / 32) / kWarpsN;  // which 16 query rows

  const int group = params.nheads / params.nheads_k;
  const int seqlen_q = params.seqlen_q;
  const SplitKvScheduler<kBlockM, kBlockN> scheduler(params, seqlen_q, group);
  const int num_items = scheduler.num_items;

  // The append and the rotation of a decode step, done here rather than in a
  // kernel before this one (params.append_in_attention): that kernel's run
  // and the wait for it cost a step more than its copies (PERF_LOG 2026-11-23
  // b82fd11); SplitKvAppend does it. The host leaves
  // the persistent grid, whose blocks would wait once per item, and the
  // other cases of append_in_attention_fits (flash_api_cuda.cpp) to the
  // pre-kernel.
  static_assert(!(kAppends && kSeveralItems),
                "the persistent grid leaves the append to a pre-kernel");
  const bool append_here = kAppends && params.append_in_attention;
  const bool appending = append_here && params.seqlen_new > 0;
  const bool rotating = append_here && params.rotary_dim > 0;

  using Smem = SplitKvSmem<Traits, kSeveralItems>;
  const Smem smem_tiles(smem, warp_n, warp_m);
  constexpr int q_slots = Smem::kQSlots;
  Element* const kv_smem = smem_tiles.kv_smem;

  typename Traits::GmemTiledCopyQKV gmem_tiled_copy_QKV;
  auto gmem_thr_copy_QKV = gmem_tiled_copy_QKV.get_thread_slice(tidx);
  Tensor cQ = make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{});   // (M,D) -> (row,col)
  Tensor cKV = make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{});  // (N,D) -> (row,col)
  Tensor tQcQ = gmem_thr_copy_QKV.partition_S(cQ);                          // (CPY,CPY_M,CPY_D)
  Tensor tKVcKV = gmem_thr_copy_QKV.partition_S(cKV);                       // (CPY,CPY_N,CPY_D)

  // The producer roles (splitkv_producer.h). Paged cache: where this thread's
  // K/V copy rows of the tile being located are (SplitKvTileLoader::locate_tile).
  using TileLoader = SplitKvTileLoader<Traits, kLayout, kSeveralItems, kAppends>;
  int row_page[TileLoader::kCopyRows];
  int row_in_page[TileLoader::kCopyRows];
  bool row_shares_page[TileLoader::kCopyRows];
  TileLoader loader(params, smem_tiles, group, appending, gmem_thr_copy_QKV, tQcQ, tKVcKV, row_page,
                    row_in_page, row_shares_page);
  static_assert(!kAppends || q_slots == 1, "one Q slot before the table rows");
  const SplitKvAppend<Traits, kSeveralItems> append{
      params, smem_tiles, tidx, group, appending, rotating, smem_tiles.past_q_slots()};

  // The stream of copies: the key tiles of this block's items, item after
  // item, each from its last key block down (so that the block on a causal
  // diagonal comes first), an item's Q with its first tile. Items without
  // keys are skipped: they only write their empty output. Tile t of the
  // stream lives in stage t % kStages and is commit group t; every step
  // commits one group, empty or not, so "all but the newest kStages - 1
  // groups done" always means "the tile about to be computed is here".
  // With several items, the inputs of the stream's next item are loaded one
  // item ahead.
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
  // The append's work waits for the first tile's group, which the first tile
  // step waits for anyway; the other stages stay in flight meanwhile.
  if (append_here && first_item.has_keys()) {
    cute::cp_async_wait<kStages - 1>();
    __syncthreads();
    if (rotating) {
      append.rotate_in_smem(first_item);
      __syncthreads();
    }
    if (appending) append.append_to_cache(first_item);
  }

  // Each warp multiplies its 16 query rows by its slab of keys on its own.
  typename Traits::WarpMma warp_mma;
  auto thr_mma = warp_mma.get_thread_slice(lane);
  Tensor tSrQ = thr_mma.partition_fragment_A(smem_tiles.slab_q(0));  // (MMA,MMA_M,MMA_K)
  Tensor tSrK = thr_mma.partition_fragment_B(smem_tiles.slab_k(0));  // (MMA,MMA_N,MMA_K)
  // (MMA,MMA_D,MMA_K)
  Tensor tOrVt = thr_mma.partition_fragment_B(
      make_tensor(make_smem_ptr(kv_smem), typename Traits::SmemLayoutVtSlabNoSwizzle{}));
  Tensor acc_o = partition_fragment_C(warp_mma, Shape<_16, Int<kHeadDim>>{});  // (MMA,MMA_M,MMA_D)

  auto smem_tiled_copy_Q = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, warp_mma);
  auto smem_thr_copy_Q = smem_tiled_copy_Q.get_thread_slice(lane);
  auto smem_tiled_copy_K = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, warp_mma);
  auto smem_thr_copy_K = smem_tiled_copy_K.get_thread_slice(lane);
  auto smem_tiled_copy_V = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, warp_mma);
  auto smem_thr_copy_V = smem_tiled_copy_V.get_thread_slice(lane);

  // (row, col) of each accumulator element within the warp's 16 x kSlabN
  // scores; the warp's rows start at warp_row0 of the tile, its keys at
  // warp_n * kSlabN of each key tile.
  Tensor cS = make_identity_tensor(Shape<_16, Int<kSlabN>>{});  // (16,SLAB_N) -> (row,col)
  Tensor tScS = thr_mma.partition_C(cS);                        // (MMA,MMA_M,MMA_N)
  // (ROW,COL) = ((2,MMA_M),(2,MMA_N))
  Tensor tScS_rowcol = make_tensor(tScS.data(), acc_layout_as_rowcol(tScS.layout()));
  // (ROW,COL)
  Tensor acc_o_rowcol = make_tensor(acc_o.data(), acc_layout_as_rowcol(acc_o.layout()));
  // (MMA,MMA_M,MMA_D) -> (row,col)
  Tensor tOcO = thr_mma.partition_C(make_identity_tensor(Shape<_16, Int<kHeadDim>>{}));
  Tensor tOcO_rowcol = make_tensor(tOcO.data(), acc_layout_as_rowcol(tOcO.layout()));  // (ROW,COL)
  constexpr int kNRows = decltype(size<0>(acc_o_rowcol))::value;
  static_assert(kNRows == 2, "a thread holds two rows of the warp's 16");
  const int warp_row0 = 16 * warp_m;
  const int warp_col0 = kSlabN * warp_n;

  // The merge of the warps that share rows (one per key slab), in two steps
  // through shared memory. First each warp leaves, for each of its real rows,
  // its output row as it stands (not yet normalised) in o_parts and its
  // (row max, row sum) in row_stats; no barrier is needed for that. Then,
  // once a barrier has made them visible, every thread weighs and sums the
  // slabs' parts of a few output chunks and stores them with wide, coalesced
  // writes. A block of one item merges in the tiles' bytes. A block of
  // several merges in bytes of its own and puts the second step of an item
  // into its next item's first tile step, after that step's copies are
  // issued: until then no copy would be issued, and a stream that pauses once
  // per item loses its bandwidth for that long (PERF_LOG 2026-11-23 cccce8e).
  constexpr int kPartStride = splitkv_merge_row_floats(kHeadDim);
  static_assert(splitkv_merge_bytes(kHeadDim, kWarpsN) <=
                    Traits::kSmemSizeQ + Traits::kStages * Traits::kSmemSizeKV,
                "a block of one item merges in its tiles' shared memory");
  float* const o_parts =
      reinterpret_cast<float*>(kSeveralItems ? smem + splitkv_smem_bytes(kHeadDim, kWarpsN, true) -
                                                   splitkv_merge_bytes(kHeadDim, kWarpsN)
                                             : smem);
  float2* const row_stats = reinterpret_cast<float2*>(o_parts + kWarpsN * kBlockM * kPartStride);

  const bool has_alibi = kWithScoreExtras && params.alibi_slopes != nullptr;
  const bool prescale_scores =
      kWithScoreExtras &&
      (params.softcap > 0.f || has_alibi || !scale_is_positive_normal(params.softmax_scale_log2));
  const float exp_scale_log2 = prescale_scores ? float(M_LOG2E) : params.softmax_scale_log2;
  const float lse_scale = prescale_scores ? 1.f : params.softmax_scale;
  // A row that saw no key in this block's range gets output 0 and lse +inf
  // (final) or -inf (a partial result that must weigh nothing in the merge).
  const bool final_output = params.num_splits == 1;
  const int64_t rows_per_split = int64_t(params.batch) * params.nheads * seqlen_q;

  using MergeTarget = SplitKvMergeTarget;
  const SplitKvEpilogue<Traits, kSeveralItems> epilogue{
      params,   tidx,           o_parts,   row_stats,    group,
      seqlen_q, exp_scale_log2, lse_scale, final_output, rows_per_split};
  // The MMAs of a key tile (splitkv_mainloop.h).
  using Mma = SplitKvMma<Traits, kSeveralItems>;
  const Mma mma{smem_tiles,
                warp_mma,
                tSrQ,
                tSrK,
                tOrVt,
                acc_o,
                smem_tiled_copy_Q,
                smem_thr_copy_Q,
                smem_tiled_copy_K,
                smem_thr_copy_K,
                smem_tiled_copy_V,
                smem_thr_copy_V,
                acc_o_rowcol};
  // The item whose merge waits for its second step (several items).
  MergeTarget pending_merge{};
  bool merge_pending = false;

  int stage = 0;
  int q_slot = q_slots - 1;
  SplitKvItemInputs next_inputs{};
  if constexpr (kSeveralItems)
    next_inputs = splitkv_item_inputs(params, scheduler.next_item(blockIdx.x));
  for (int item = blockIdx.x; item < num_items; item += gridDim.x) {
    SplitKvItem it = first_item;
    if constexpr (kSeveralItems) {
      if (item != int(blockIdx.x)) {
        it = scheduler.item_at(item, next_inputs);
        next_inputs =
            splitkv_item_inputs(params, scheduler.next_item(item));  // in flight while `it` runs
      }
    }
    const int seqlen_k = it.seqlen_k;
    // Decode packs only seqlen_q x group rows (often 4-8): a warp whose rows
    // are all padding skips the MMAs and their shared-memory reads. No
    // barrier sits inside the skipped part, and its rows are never written.
    const bool warp_has_rows = warp_row0 < it.rows_left;

    // Per-row query index and (ALiBi) slope: packed rows of one tile belong
    // to different query heads.
    int row_query[kNRows];
    float row_slope[kNRows];
    CUTE_UNROLL
    for (int mi = 0; mi < kNRows; ++mi) {
      const int row = it.row_begin + warp_row0 + get<0>(tScS_rowcol(mi, 0));
      const PackedRow packed = unpack_row(row, group);
      row_query[mi] = packed.query;
      row_slope[mi] = has_alibi && row < it.row_begin + it.rows_left
                          ? params.alibi_slopes[it.batch * params.alibi_batch_stride +
                                                it.head_kv * group + packed.head_in_group]
                          : 0.f;
    }

    OnlineSoftmax<kNRows> softmax;
    clear(acc_o);
    if (it.has_keys()) q_slot = Smem::next_q_slot(q_slot);
    Tensor tSsQ = smem_thr_copy_Q.partition_S(smem_tiles.slab_q(q_slot));  // (CPY,CPY_M,CPY_K)

    for (int n_block = it.n_block_max - 1; n_block >= it.n_block_min; --n_block) {
      cute::cp_async_wait<kStages - 1>();
      __syncthreads();

      if (warp_has_rows) {
        // (MMA,MMA_M,MMA_N)
        Tensor acc_s = partition_fragment_C(warp_mma, Shape<_16, Int<kSlabN>>{});
        mma.qk(acc_s, tSsQ, stage);

        // (ROW,COL)
        Tensor scores = make_tensor(acc_s.data(), acc_layout_as_rowcol(acc_s.layout()));
        const int col_base = n_block * kBlockN + warp_col0;
        if (prescale_scores) {
          apply_scale_and_softcap(scores, params.softmax_scale, params.softcap);
          if (has_alibi) {
            CUTE_UNROLL
            for (int mi = 0; mi < kNRows; ++mi) {
              CUTE_UNROLL
              for (int ni = 0; ni < size<1>(scores); ++ni) {
                const int col = col_base + get<1>(tScS_rowcol(0, ni));
                scores(mi, ni) += alibi_bias(row_slope[mi], row_query[mi], col, seqlen_q, seqlen_k);
              }
            }
          }
        }
        if (!key_tile_fully_visible(it.query_first, it.query_last + 1, n_block * kBlockN,
                                    (n_block + 1) * kBlockN, seqlen_q, seqlen_k, params.window_left,
                                    params.window_right)) {
          CUTE_UNROLL
          for (int mi = 0; mi < kNRows; ++mi) {
            const KeyRange visible =
                visible_key_range(row_query[mi], row_query[mi] + 1, seqlen_q, seqlen_k,
                                  params.window_left, params.window_right);
            const int col_lo = visible.begin - col_base;
            const int col_hi = visible.end - col_base;
            CUTE_UNROLL
            for (int ni = 0; ni < size<1>(scores); ++ni) {
              const int col = get<1>(tScS_rowcol(0, ni));
              if (col < col_lo || col >= col_hi) scores(mi, ni) = -INFINITY;
            }
          }
        }

        mma.softmax_pv(acc_s, scores, softmax, exp_scale_log2, stage);
      }

      // Every warp is done with this stage before it is refilled.
      __syncthreads();
      producer.load_next_tile(stage, std::false_type{});
      stage = stage == kStages - 1 ? 0 : stage + 1;
      if (kSeveralItems && merge_pending) {
        epilogue.combine_parts(
            pending_merge);  // the parts were written before this step's barriers
        merge_pending = false;
      }
    }

    // Step 1 of the merge. A block of one item writes over its tiles, which
    // every warp is done with after the loop's last barrier. A block of
    // several makes sure that no thread still reads the previous item's
    // parts: its second step ran in this item's first tile step, and the
    // barriers of a second step (if any) separate the two.
    const int tile_steps = it.n_block_max - it.n_block_min;
    if constexpr (kSeveralItems) {
      if (merge_pending) {  // this item had no tile step to run it in
        __syncthreads();
        epilogue.combine_parts(pending_merge);
        merge_pending = false;
      }
      if (tile_steps < 2) __syncthreads();
    }
    if (warp_has_rows) {
      epilogue.write_parts(softmax, acc_o_rowcol, tScS_rowcol, tOcO_rowcol, warp_row0, warp_n, lane,
                           it.rows_left);
    }
    const MergeTarget target{it.batch, it.head_kv, it.split, it.row_begin, it.rows_left};
    if constexpr (kSeveralItems) {
      pending_merge = target;
      merge_pending = true;
    } else {
      __syncthreads();
      epilogue.combine_parts(target);
    }
    if constexpr (!kSeveralItems) break;
  }
  if (kSeveralItems && merge_pending) {
    __syncthreads();
    epilogue.combine_parts(pending_merge);
  }
}

}  // namespace flash
