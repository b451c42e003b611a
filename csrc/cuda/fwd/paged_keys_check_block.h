// The index checks of one sequence of a paged varlen forward
// (FwdParams::block_table), done by one thread block: its first thread
// checks the key count (seqused_k, else its cu_seqlens_k length) against
// max_seqlen_k and the rows its block_table row addresses, then every thread
// checks a share of the table entries those keys use against the pool. The
// forward kernels clamp the same values without reporting them
// (BlockInfo::paged_seqlen_k, locate_paged_key in paged_rows.h); the blocks
// of this check run in a kernel of their own before them
// (paged_keys_check.cu), or in a split run's combine grid
// (splitkv_combine.h, KvcacheParams::combine_checks_paged_keys).
#pragma once

#include <cstdint>

#include "cuda/core/index_guards.h"
#include "cuda/core/params.h"

namespace flash {

// Sequence b's keys, reported and clamped as BlockInfo::paged_seqlen_k
// clamps them.
__device__ __forceinline__ int checked_paged_keys(const FwdParams& params, int batch) {
  const SequenceRows rows =
      guarded_sequence_rows(params.cu_seqlens_k, batch, INT32_MAX, params.seqlen_k,
                            IndexArg::kCuSeqlensK, params.index_errors);
  if (params.seqused_k != nullptr) {
    return guarded_seqused_k(params.seqused_k, batch, params.paged_max_seqlen_k, /*paged=*/true,
                             params.index_errors);
  }
  if (rows.length <= params.paged_max_seqlen_k) return rows.length;
  const int page_size = params.page_size.divisor;
  report_index_error(params.index_errors, IndexRule::kPagesPastTable, IndexArg::kBlockTable,
                     IndexOp::kVarlen, batch, 0, rows.length, params.paged_max_seqlen_k / page_size,
                     page_size);
  return params.paged_max_seqlen_k;
}

// Every thread of the block calls it, with the same batch; it reads only the
// call's inputs, so it waits for no kernel before it.
__device__ __forceinline__ void check_paged_keys_of_sequence(const FwdParams& params, int batch) {
  __shared__ int keys;
  if (threadIdx.x == 0) keys = checked_paged_keys(params, batch);
  __syncthreads();
  const int pages = (keys + params.page_size.divisor - 1) / params.page_size.divisor;
  const int* row = params.block_table + int64_t(batch) * params.block_table_batch_stride;
  for (int i = threadIdx.x; i < pages; i += blockDim.x) {
    guarded_page(params.index_errors, IndexOp::kVarlen, batch, i, row[i], params.num_pages);
  }
}

}  // namespace flash
