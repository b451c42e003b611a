// The work-item schedule of the split-KV kernel (splitkv_kernel.h). Its work
// items are (batch, kv head, query block, split) (splitkv_work_item.h). A
// thread block runs item blockIdx.x, then every gridDim.x-th item after it:
// launched with one block per item, that is one item; launched persistently
// (fewer blocks than items, one per SM), several.
#pragma once

#include "cuda/core/params.h"
#include "cuda/decode/splitkv_work_item.h"

namespace flash {

// kVarlen: as splitkv_item's.
template <int kBlockM, int kBlockN, bool kVarlen = true>
struct SplitKvScheduler {
  const KvcacheParams& params;
  const int num_m_blocks;
  const int num_items;

  __device__ SplitKvScheduler(const KvcacheParams& params_, int seqlen_q, int group)
      : params(params_),
        num_m_blocks((seqlen_q * group + kBlockM - 1) / kBlockM),
        num_items(params_.batch * params_.nheads_k * num_m_blocks * params_.num_splits) {}

  // The item a block runs after `item` (or `item` itself past the last one,
  // whose inputs are then loaded again, never used).
  __device__ int next_item(int item) const {
    return num_items - item > int(gridDim.x) ? item + int(gridDim.x) : item;
  }
  __device__ SplitKvItem item_at(int item, const SplitKvItemInputs& inputs) const {
    return splitkv_item<kBlockM, kBlockN, kVarlen>(params, item, num_m_blocks, inputs);
  }
  // `it`: the item the block computes as its `item`, set to the block's
  // first item by the caller. A later one comes from next_inputs, loaded one
  // item ahead, which then start loading for the item after it. (An item
  // returned by value here, rather than set in place, changed the kernel's
  // machine code.)
  template <bool kSeveralItems>
  __forceinline__ __device__ void to_item(SplitKvItem& it, int item,
                                          SplitKvItemInputs& next_inputs) const {
    if constexpr (kSeveralItems) {
      if (item != int(blockIdx.x)) {
        it = item_at(item, next_inputs);
        next_inputs = splitkv_item_inputs(params, next_item(item));  // in flight while `it` runs
      }
    }
  }
};

}  // namespace flash
