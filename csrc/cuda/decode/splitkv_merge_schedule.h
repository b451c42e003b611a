// When the split-KV kernel (splitkv_kernel.h) runs the two steps of an
// item's merge (SplitKvEpilogue), and in which shared-memory bytes.
//
// The merge of the warps that share rows (one per key slab) goes through
// shared memory in two steps. First each warp leaves, for each of its real
// rows, its output row as it stands (not yet normalised) in o_parts and its
// (row max, row sum) in row_stats; no barrier is needed for that. Then, once
// a barrier has made them visible, every thread weighs and sums the slabs'
// parts of a few output chunks and stores them with wide, coalesced writes.
// A block of one item merges in the tiles' bytes. A block of several merges
// in bytes of its own and puts the second step of an item into its next
// item's first tile step, after that step's copies are issued: until then no
// copy would be issued, and a stream that pauses once per item loses its
// bandwidth for that long (PERF_LOG 2026-11-23 cccce8e).
#pragma once

#include <cute/tensor.hpp>

#include "cuda/decode/splitkv_epilogue.h"
#include "cuda/decode/splitkv_tile_config.h"
#include "cuda/decode/splitkv_work_item.h"

namespace flash {

template <typename Traits, bool kSeveralItems>
struct SplitKvMergeSchedule {
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kWarpsN = Traits::kWarpsN;
  static constexpr int kPartStride = splitkv_merge_row_floats(kHeadDim);
  static_assert(splitkv_merge_bytes(kHeadDim, kWarpsN) <= Traits::kSmemSize,
                "a block of one item merges in its tiles' shared memory");
  using Epilogue = SplitKvEpilogue<Traits, kSeveralItems>;

  // The merge's bytes: the parts, then the row stats.
  static __forceinline__ __device__ float* o_parts(char* smem) {
    return reinterpret_cast<float*>(kSeveralItems
                                        ? smem + splitkv_smem_bytes(kHeadDim, kWarpsN, true) -
                                              splitkv_merge_bytes(kHeadDim, kWarpsN)
                                        : smem);
  }
  static __forceinline__ __device__ float2* row_stats(float* o_parts) {
    return reinterpret_cast<float2*>(o_parts + kWarpsN * kBlockM * kPartStride);
  }

  // The item whose merge waits for its second step (several items).
  SplitKvMergeTarget pending_merge{};
  bool merge_pending = false;

  // After a tile step's copies are issued: the second step of the previous
  // item's merge, whose parts were written before this step's barriers.
  __forceinline__ __device__ void after_tile_step(const Epilogue& epilogue) {
    if (kSeveralItems && merge_pending) {
      epilogue.combine_parts(pending_merge);
      merge_pending = false;
    }
  }

  // After an item's last tile step: step 1 of its merge, and its step 2
  // (one item) or the note that it waits (several). A block of one item
  // writes over its tiles, which every warp is done with after the loop's
  // last barrier. A block of several makes sure that no thread still reads
  // the previous item's parts: its second step ran in this item's first tile
  // step, and the barriers of a second step (if any) separate the two.
  template <typename Softmax, typename Tiling, typename Fragments>
  __forceinline__ __device__ void end_item(const Epilogue& epilogue, const SplitKvItem& it,
                                           bool warp_has_rows, const Softmax& softmax,
                                           const Tiling& w, const Fragments& f, int warp_n,
                                           int warp_v, int lane) {
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
      epilogue.write_parts(softmax, f.acc_o_rowcol(), w.tScS_rowcol, w.tOcO_rowcol, w.warp_row0,
                           w.warp_vcol0, warp_n, warp_v, lane, it.rows_left);
    }
    const SplitKvMergeTarget target{it.batch,     it.head_kv,   it.split,
                                    it.row_begin, it.rows_left, it.q_row0};
    if constexpr (kSeveralItems) {
      pending_merge = target;
      merge_pending = true;
    } else {
      __syncthreads();
      epilogue.combine_parts(target);
    }
  }

  // After the block's last item (several items): its step 2.
  __forceinline__ __device__ void end_block(const Epilogue& epilogue) const {
    if (kSeveralItems && merge_pending) {
      __syncthreads();
      epilogue.combine_parts(pending_merge);
    }
  }
};

}  // namespace flash
