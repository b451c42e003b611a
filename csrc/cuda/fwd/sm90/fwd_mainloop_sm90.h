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

// How the producer reads K / V: one TMA copy per key tile, or paged keys
// (FwdParams::block_table) by TMA boxes inside pages or gathered row by row
// (FwdSm90Tma::gather_keys; plan_fwd's FwdPlan::keys).
enum class FwdSm90KeyLoad { kTiles, kPagedBoxes, kPagedGather };

// The producer: kThreads threads of the producer warpgroup issue the copies,
// the others leave the kernel. One thread issues every TMA copy, of
// contiguous keys or of paged keys' boxes (at most kMaxBoxes a key tile);
// kNGatherThreads gather paged keys by cp.async. Q is one TMA copy of thread
// 0. One instantiation per key load, each entered only by its threads (the
// kernel).
template <typename Traits, FwdSm90KeyLoad kKeys>
struct FwdSm90MainloopLoad {
  using Element = typename Traits::Element;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kHeadDimV = Traits::kHeadDimV;
  using Storage = FwdSm90SharedStorage<Traits>;
  static constexpr int kThreads =
      kKeys == FwdSm90KeyLoad::kPagedGather ? Traits::kNGatherThreads : 1;
  // Boxes of at least kPagedBoxesMinRows rows (FwdSm90Tma::can_load) cover a
  // key tile in at most this many.
  static constexpr int kMaxBoxes = kBlockN >= kPagedBoxesMinRows ? kBlockN / kPagedBoxesMinRows : 1;
  // The arrivals that fill a K / V stage: the arming thread's
  // arrive_and_expect_tx (TMA), or each gathering thread's
  // cp.async.mbarrier.arrive.noinc.
  static constexpr int kFullArrivals = kKeys == FwdSm90KeyLoad::kPagedGather ? kThreads : 1;

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
    Tensor sQ = Storage::q();                                                            // (M,D)
    CUTE_STATIC_ASSERT_V(size<0>(sQ) == size<0>(gQ) && size<1>(sQ) == size<1>(gQ));
    // (TMA,TMA_M,TMA_D): one TMA copy per tile
    auto [tQgQ, tQsQ] = tma_partition(tma.q, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
    // K(0) may go ahead of Q: its stage is free as soon as the last tile's
    // wgmmas have read it.
    auto load_q = [&] {
      if (kThreads > 1 && threadIdx.x != 0) return;
      empty_barrier(barriers.q_empty).wait(stages.q_phase() ^ 1);
      full_barrier(barriers.q_full).arrive_and_expect_tx(Traits::kSmemSizeQ);
      copy(tma.q.with(barriers.q_full), tQgQ, tQsQ);
    };
    // The order the MMA warpgroups consume them: iteration i reads K(i) and
    // V(i - 1).
    auto load_all = [&](auto&& load_k, auto&& load_v) {
      load_k(0);
      load_q();
      for (int i = 1; i < tile.n_key_blocks; ++i) {
        load_k(i);
        load_v(i - 1);
      }
      load_v(tile.n_key_blocks - 1);
    };
    if constexpr (kKeys == FwdSm90KeyLoad::kTiles) {
      Tensor gK = local_tile(
          tma_kv_of(tma.k, params, tile.binfo, block.head_kv, block.batch, params.head_dim),
          Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, 0));  // (N,D,n)
      Tensor gV = local_tile(
          tma_kv_of(tma.v, params, tile.binfo, block.head_kv, block.batch, params.head_dim_v),
          Shape<Int<kBlockN>, Int<kHeadDimV>>{}, make_coord(_, 0));  // (N,Dv,n)
      Tensor sK = Storage::k();                                      // (N,D,stage)
      Tensor sV = Storage::v();                                      // (N,Dv,stage)
      // One TMA box per tile: a stage holds one global tile.
      CUTE_STATIC_ASSERT_V(size<0>(sK) == size<0>(gK) && size<1>(sK) == size<1>(gK));
      CUTE_STATIC_ASSERT_V(size<0>(sV) == size<0>(gV) && size<1>(sV) == size<1>(gV));
      // (TMA,TMA_N,TMA_D,n) / (...,stage): one TMA copy per tile
      auto [tKgK, tKsK] = tma_partition(tma.k, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
      auto [tVgV, tVsV] = tma_partition(tma.v, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
      load_all(
          [&](int i) {
            load_key_tile<Traits::kSmemSizeKStage>(tma.k, barriers.k_full, barriers.k_empty, tKgK,
                                                   tKsK, block.n_block_max, i);
          },
          [&](int i) {
            load_key_tile<Traits::kSmemSizeVStage>(tma.v, barriers.v_full, barriers.v_empty, tVgV,
                                                   tVsV, block.n_block_max, i);
          });
    } else {
      load_paged<kKeys == FwdSm90KeyLoad::kPagedGather>(tile, load_all);
    }
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

  // The first key of key tile i.
  __forceinline__ __device__ int first_key_of(const FwdSm90Tile& tile, int i) const {
    return (tile.block.n_block_max - 1 - i) * kBlockN;
  }

  // Paged keys. The boxes' thread looks up the page of each box of a key
  // tile; each lane of a gathering warp looks up the pages of a few keys,
  // and its warp takes them by shuffles. At K(i) each looking-up thread
  // prefetches its table lines of key tile i + 1 into L1 (no register waits
  // on a prefetch), so the lookups of K(i + 1) and V(i + 1) hit L1: held in
  // registers instead, one tile ahead, the entries were spilled right after
  // their loads at the producer's 24 registers, which waited out the load
  // there (ptxas, sm_90a). Only keys below seqlen_k are looked up or
  // prefetched: no table entry past the sequence's pages is read.
  //
  // The gather's copy (Traits::GmemTiledCopyKVGather): thread t copies row
  // t / kThreadsPerRow of each pass of kRowsPerPass rows, so warp w copies
  // rows [w * kWarpRows, (w + 1) * kWarpRows) of each pass; its lanes look
  // up those rows of every pass, kGatherLookups each.
  using GatherCopy = GmemTileCopy<Element, kHeadDim, Traits::kNGatherThreads>;
  static constexpr int kWarpRows = 32 / GatherCopy::kThreadsPerRow;
  static constexpr int kGatherPasses = kBlockN / GatherCopy::kRowsPerPass;
  static constexpr int kGatherLookups = (kWarpRows * kGatherPasses + 31) / 32;
  static_assert(32 % GatherCopy::kThreadsPerRow == 0, "a warp copies whole rows");
  template <int kLookups_>
  struct TableEntries {
    static constexpr int kLookups = kLookups_;
    int entry[kLookups];
  };

  // The key tile row of lookup j of this thread: a gathering lane's, or the
  // first row of box j.
  template <bool kGather>
  __forceinline__ __device__ int paged_lookup_row(int j) const {
    if constexpr (kGather) {
      const int slot = j * 32 + threadIdx.x % 32;
      const int warp = threadIdx.x / 32;
      return slot < kWarpRows * kGatherPasses
                 ? slot / kWarpRows * GatherCopy::kRowsPerPass + warp * kWarpRows + slot % kWarpRows
                 : kBlockN;
    } else {
      return j * tma.paged_box_rows;
    }
  }

  // The table entry of lookup j of this thread in key tile i: its address,
  // or null where it looks up no key.
  template <bool kGather>
  __forceinline__ __device__ const int* paged_entry_address(const FwdSm90Tile& tile, int i,
                                                            int j) const {
    const int key = first_key_of(tile, i) + paged_lookup_row<kGather>(j);
    if (paged_lookup_row<kGather>(j) >= kBlockN || key >= tile.binfo.seqlen_k) return nullptr;
    return paged_table_address(params, tile.block.batch, params.page_size.quotient(key));
  }

  template <bool kGather, typename LoadAll>
  __forceinline__ __device__ void load_paged(const FwdSm90Tile& tile, LoadAll&& load_all) {
    using Entries = TableEntries<kGather ? kGatherLookups : kMaxBoxes>;
    auto& barriers = Storage::barriers();
    Tensor sK = Storage::k();  // (N,D,stage)
    Tensor sV = Storage::v();  // (N,Dv,stage)
    // sX: K's stage (N,D,stage) or V's (N,Dv,stage), tensors of two types
    // where d_v < d_qk, so the caller names it.
    auto load_tile = [&](auto& sX, bool is_v, int i) {
      // The lookups go ahead of the wait for the stage.
      Entries entries;
      CUTE_UNROLL
      for (int j = 0; j < Entries::kLookups; ++j) {
        const int* entry = paged_entry_address<kGather>(tile, i, j);
        // Read-only path: the lines prefetched at K(i - 1).
        entries.entry[j] = entry != nullptr ? __ldg(entry) : 0;
      }
      if constexpr (kGather) {
        gather_paged_key_tile(static_cast<const Element*>(is_v ? params.v_ptr : params.k_ptr),
                              is_v ? params.v : params.k,
                              is_v ? params.head_dim_v : params.head_dim,
                              is_v ? barriers.v_full : barriers.k_full,
                              is_v ? barriers.v_empty : barriers.k_empty, sX, tile, i, entries);
      } else {
        load_paged_key_tile(is_v ? &tma.v_paged : &tma.k_paged,
                            is_v ? barriers.v_full : barriers.k_full,
                            is_v ? barriers.v_empty : barriers.k_empty, sX, tile, i, entries);
      }
    };
    load_all(
        [&](int i) {
          if (i + 1 < tile.n_key_blocks) {
            CUTE_UNROLL
            for (int j = 0; j < Entries::kLookups; ++j) {
              const int* entry = paged_entry_address<kGather>(tile, i + 1, j);
              if (entry != nullptr) asm volatile("prefetch.global.L1 [%0];" ::"l"(entry));
            }
          }
          load_tile(sK, false, i);
        },
        [&](int i) { load_tile(sV, true, i); });
  }

  // By TMA boxes (FwdSm90Tma::k_paged / v_paged): box b of a key tile,
  // box_rows rows from one page, one TMA copy per swizzle atom of columns,
  // all issued by one thread, as contiguous keys' tiles are (a warp with a
  // lane per box, sharing the gather's kernel, ran pages of 64 and 256 rows
  // 1.11x slower; PERF_LOG 2026-12-01, boxes from one thread). Only boxes holding keys below
  // seqlen_k are issued; the rows after them keep what the stage held, which
  // the mask hides (K) and FwdSm90MainloopMma::zero_v_rows_past_end clears
  // (V), as for the rows of the next sequence an unpaged varlen tile reads.
  // The stage's full barrier is armed with the bytes of every box issued
  // (arrive_and_expect_tx, its one arrival) before the first box. The stage
  // sX is K's (N,D,stage) or V's (N,Dv,stage): its width is the boxes'
  // column range and, with the boxes' rows, the bytes they bring.
  template <typename TensorS, typename Entries>
  __forceinline__ __device__ void load_paged_key_tile(const TmaDescriptor* desc,
                                                      uint64_t* full_stages, uint64_t* empty_stages,
                                                      TensorS sX, const FwdSm90Tile& tile, int i,
                                                      const Entries& entries) const {
    constexpr int kAtomCols = FwdSm90Tma<Traits>::kAtomCols;
    constexpr int kCols = decltype(size<1>(sX))::value;
    static_assert(kCols % kAtomCols == 0, "whole swizzle atoms across the head dim");
    static_assert(Entries::kLookups == kMaxBoxes, "one table entry per box");
    constexpr int kAtoms = kCols / kAtomCols;
    const int box_rows = tma.paged_box_rows;
    const int stage = stages.stage(i);
    const int key0 = first_key_of(tile, i);
    const int rows = min(kBlockN, tile.binfo.seqlen_k - key0);
    // Whole boxes; box_rows is a power of two (paged_box_rows.h), so a shift
    // instead of a division.
    const int boxes = (rows + box_rows - 1) >> (__ffs(box_rows) - 1);
    // Each box's page, row and stage address ahead of the wait for the
    // stage, so that between the stage coming free and its copies there is
    // only the barrier's arming (written after the wait, ptxas left about 50
    // instructions there, the contiguous keys' loop 10-18).
    int page[kMaxBoxes], row_in_page[kMaxBoxes];
    Element* dst[kMaxBoxes][kAtoms];
    CUTE_UNROLL
    for (int b = 0; b < kMaxBoxes; ++b) {
      const int key = key0 + b * box_rows;
      page[b] = clamp_paged_entry(params, entries.entry[b]);
      row_in_page[b] = key - params.page_size.quotient(key) * params.page_size.divisor;
      CUTE_UNROLL
      for (int a = 0; a < kAtoms; ++a) dst[b][a] = &sX(b * box_rows, a * kAtomCols, stage);
    }
    const uint32_t bytes = uint32_t(boxes * box_rows * kCols * sizeof(Element));
    empty_barrier(empty_stages[stage]).wait(stages.phase(i) ^ 1);
    full_barrier(full_stages[stage]).arrive_and_expect_tx(bytes);
    CUTE_UNROLL
    for (int b = 0; b < kMaxBoxes; ++b) {
      if (b < boxes) {
        CUTE_UNROLL
        for (int a = 0; a < kAtoms; ++a) {
          SM90_TMA_LOAD_4D::copy(desc, &full_stages[stage],
                                 static_cast<uint64_t>(TMA::CacheHintSm90::EVICT_NORMAL), dst[b][a],
                                 a * kAtomCols, row_in_page[b], tile.block.head_kv, page[b]);
        }
      }
    }
  }

  // Gathered row by row (FwdSm90Tma::gather_keys): the kNGatherThreads
  // threads copy 16-byte chunks by cp.async into the same swizzled stage a
  // TMA box would fill (CuTe's partition of the stage applies the swizzle),
  // then each arrives on the stage's full barrier once its copies have
  // landed (cp.async.mbarrier.arrive.noinc: the barrier counts those
  // arrivals, kFullArrivals). As in CUTLASS's cp.async GMMA mainloop
  // (sm90_mma_multistage_gmma_ss_warpspecialized.hpp), the MMA warpgroups'
  // wait on that barrier is all that orders the copies before their wgmmas'
  // reads: no proxy fence. A thread takes its row's
  // offset from the lane that looked it up (two shuffles a row, in place of
  // a lookup per thread and row). Rows at or past seqlen_k, and columns past
  // the tensor's width (cols), are zero-filled without a read. The stage sX
  // is K's (N,D,stage) or V's (N,Dv,stage): the copy covers its columns.
  template <typename TensorS, typename Entries>
  __forceinline__ __device__ void gather_paged_key_tile(const Element* ptr,
                                                        const QKVStrides& strides, int cols,
                                                        uint64_t* full_stages,
                                                        uint64_t* empty_stages, TensorS sX,
                                                        const FwdSm90Tile& tile, int i,
                                                        const Entries& entries) const {
    using GmemTiledCopy = typename Traits::GmemTiledCopyKVGather;
    const int lane = threadIdx.x % 32;
    const int stage = stages.stage(i);
    const int key0 = first_key_of(tile, i);
    const int rows = tile.binfo.seqlen_k - key0;
    const Element* head = ptr + int64_t(tile.block.head_kv) * strides.head_stride;
    // The element offsets of this lane's looked-up rows from the head's first.
    int64_t offsets[kGatherLookups];
    CUTE_UNROLL
    for (int j = 0; j < kGatherLookups; ++j) {
      const int key = key0 + paged_lookup_row<true>(j);
      const int row_in_page = key - params.page_size.quotient(key) * params.page_size.divisor;
      offsets[j] = int64_t(clamp_paged_entry(params, entries.entry[j])) * strides.batch_stride +
                   int64_t(row_in_page) * strides.row_stride;
    }
    auto thr_copy = GmemTiledCopy{}.get_thread_slice(threadIdx.x);
    Tensor tKsK = thr_copy.partition_D(sX(_, _, stage));  // (CPY,CPY_N,CPY_D)
    // (N,D) or (N,Dv) -> (row,col): the stage's own width
    Tensor cK = make_identity_tensor(Shape<Int<kBlockN>, decltype(size<1>(sX))>{});
    Tensor tKcK = thr_copy.partition_D(cK);  // (CPY,CPY_N,CPY_D) -> (row,col)
    static_assert(decltype(size<1>(tKsK))::value == kGatherPasses, "one row per pass");
    // The swizzle permutes 16-byte chunks inside spans of 8 rows (1024
    // bytes with 128-byte rows, 512 with 64-byte ones) from a 1024-byte
    // aligned stage. A thread's chunks lie whole 1024-byte spans apart, so
    // CuTe swizzles the address of its first chunk and the others are that
    // address plus their plain offsets (constants), instead of a swizzle of
    // a 64-bit address per chunk.
    constexpr int kSwizzlePeriod = 1024 / int(sizeof(Element));
    static_assert(decltype(stride<1>(tKsK))::value % kSwizzlePeriod == 0 &&
                      decltype(stride<2>(tKsK))::value % kSwizzlePeriod == 0,
                  "the chunks of a thread are whole swizzle periods apart");
    static_assert(Traits::kSmemSizeQ % 1024 == 0 && Traits::kSmemSizeKStage % 1024 == 0 &&
                      Traits::kSmemSizeVStage % 1024 == 0,
                  "stages start on swizzle periods");
    const uint32_t smem0 = static_cast<uint32_t>(__cvta_generic_to_shared(&tKsK(0, 0, 0)));
    // This thread's first chunk; the others are constant rows and columns on.
    const int row0 = get<0>(tKcK(0, 0, 0));
    const int col0 = get<1>(tKcK(0, 0, 0));
    const Element* src0 = head + col0;
    const int rows_left = rows - row0;
    const int cols_left = cols - col0;
    const int first_lane = lane / GatherCopy::kThreadsPerRow;
    empty_barrier(empty_stages[stage]).wait(stages.phase(i) ^ 1);
    CUTE_UNROLL
    for (int m = 0; m < kGatherPasses; ++m) {
      // This thread's row of pass m is slot m * kWarpRows + lane /
      // kThreadsPerRow of its warp's lookups (paged_lookup_row), a lane's
      // slots j * 32 + lane; kWarpRows divides 32, so the slot's j is the
      // pass's. Every lane shuffles; a row past seqlen_k gets a row offset
      // of page 0 (entry 0), which its zero-fill does not read.
      const int64_t offset =
          __shfl_sync(0xffffffff, offsets[m * kWarpRows / 32], m * kWarpRows % 32 + first_lane);
      const bool row_ok = get<0>(tKcK(0, m, 0)) - row0 < rows_left;
      CUTE_UNROLL
      for (int k = 0; k < size<2>(tKsK); ++k) {
        const int col = get<1>(tKcK(0, m, k)) - col0;
        cp_async_16_or_zero(smem0 + uint32_t(tKsK.layout()(0, m, k) * sizeof(Element)),
                            src0 + offset + col, row_ok && col < cols_left);
      }
    }
    cutlass::arch::cpasync_barrier_arrive_noinc(&full_stages[stage]);
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

    // Whether every row of the block sees every key of iteration i's tile.
    auto tile_visible = [&](int i) {
      const int col = (n_block_max - 1 - i) * kBlockN;
      return key_tile_fully_visible(row_begin, row_begin + kBlockM, col, col + kBlockN,
                                    binfo.seqlen_q, binfo.seqlen_k, params.window_left,
                                    params.window_right);
    };

    // The rows of a varlen sequence's last K / V tile past its end are the
    // next sequence's (zero_v_rows_past_end). Tile 0 is the only one that can
    // reach past the end.
    const int v_rows_past_end = binfo.seqlen_k - (n_block_max - 1) * kBlockN;
    const bool zero_v_tail = binfo.varlen && v_rows_past_end < kBlockN;

    // The first iteration has no P V yet; it is peeled off at compile time (a
    // branch around a wgmma inside a batch makes ptxas serialize the batch).
    // may_mask: false for the tiles every row sees whole (the loops below),
    // which then carry no visibility test and no mask.
    auto iteration = [&](int i, auto has_pending_pv, auto may_mask) {
      constexpr bool kHasPendingPv = decltype(has_pending_pv)::value;
      constexpr bool kMayMask = decltype(may_mask)::value;
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
      const int col_base = n_block * kBlockN;
      // Under S(i): the draws need only (row, col). They run inside this
      // warpgroup's turn, beside the other warpgroup's softmax rather than
      // its draws: 1-3% faster at d128 than both warpgroups drawing at once
      // (PERF_LOG 2026-11-30, "dropout draws in turns").
      if (kWithDropout && has_dropout) {
        // Seed and offset read per key tile (two cached loads under the
        // wgmma), not held across the loop: held, they pushed tile-level
        // values to the stack (PERF_LOG 2026-11-29, issue 57 step 1).
        dropout_mask.draw(tScS_rowcol, row_begin, col_base,
                          dropout_state_of(params, block.batch, block.head));
      }
      NamedBarrier::arrive(kTurnThreads, next_turn);
      warpgroup_wait<kHasPendingPv ? 1 : 0>();  // S(i) has landed
      warpgroup_fence_operand(acc_s);
      if (!kHasPendingPv && takes_tiles) scheduler.publish_tile(taken_tile);
      empty_barrier(barriers.k_empty[stages.stage(i)]).arrive();
      // With O staged apart, Q is free once the last S has landed.
      if (Traits::kSeparateO && i == n_tiles - 1) empty_barrier(barriers.q_empty).arrive();

      if constexpr (kWithScoreMods) {
        score_mods.keep(scores);
        if (has_alibi) {
          apply_alibi(scores, tScS_rowcol, row_begin, col_base, score_mods.alibi_slope,
                      binfo.seqlen_q, binfo.seqlen_k);
        }
      }
      if (kMayMask && !tile_visible(i)) {
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

    // The tiles that need the mask are a run at each end of the walk (it goes
    // from the last key tile down): the diagonal or a right window, and a left
    // window's edge; seqlen_k's partial tile is tile 0. The visible tiles
    // between them take an iteration without the mask's test and code, as
    // FA3's and FA4's separate masking loops do: 2-5% faster at d128 from 1k
    // keys non-causal and 4k causal (PERF_LOG 2026-11-30 "forward masking
    // loops"). Not in the score-mods variant, where the second copy of the
    // body pushed the draws and ALiBi values to the stack (ptxas, d128: a 1.7
    // KB frame), nor on the counter's grid (short causal, local and varlen
    // calls), whose few tiles a query block ran 0.5-2% slower so, nor above
    // d128, where the copies put spill reloads in the d256 loop (ptxas: 12 /
    // 40 bytes, none before).
    constexpr bool kMaskingLoops =
        !kWithScoreMods && !Scheduler::kTakesTilesFromCounter && Traits::kHeadDim <= 128;
    iteration(0, cute::false_type{}, cute::true_type{});
    if constexpr (!kMaskingLoops) {
      for (int i = 1; i < n_tiles; ++i) iteration(i, cute::true_type{}, cute::true_type{});
    } else {
      int visible_begin = 1;
      while (visible_begin < n_tiles && !tile_visible(visible_begin)) ++visible_begin;
      int visible_end = n_tiles;
      while (visible_end > visible_begin && !tile_visible(visible_end - 1)) --visible_end;
      for (int i = 1; i < n_tiles; ++i) {
        if (i < visible_begin || i >= visible_end) {
          iteration(i, cute::true_type{}, cute::true_type{});
        } else {
          iteration(i, cute::true_type{}, cute::false_type{});
        }
      }
    }

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
