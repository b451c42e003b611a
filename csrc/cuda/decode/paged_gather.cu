#include "cuda/decode/paged_gather.h"

#include <algorithm>
#include <climits>
#include <cstdint>

#include "cuda/core/cuda_check.h"
#include "cuda/core/grid_heads_batch.h"
#include "cuda/core/index_guards.h"

namespace flash {
namespace {

constexpr int kRowsPerBlock = 8;
constexpr int kThreads = 128;

// The caller's offsets, used keys and table width for sequence `batch` (the
// packed offsets the copies use are already cut to what the table addresses).
__device__ void check_sequence(const PagedGatherParams& params, int batch) {
  const SequenceRows rows =
      guarded_sequence_rows(params.cu_seqlens_k, batch, INT_MAX, params.max_seqlen_k_given,
                            IndexArg::kCuSeqlensK, params.index_errors);
  if (params.seqused_k != nullptr) {
    // The used keys replace the offsets' lengths; their bound already
    // includes the table's width.
    const int64_t capacity = int64_t(params.max_blocks_per_seq) * params.page_size.divisor;
    const int bound = static_cast<int>(
        capacity < params.max_seqlen_k_given ? capacity : params.max_seqlen_k_given);
    guarded_seqused_k(params.seqused_k, batch, bound, /*paged=*/true, params.index_errors);
    return;
  }
  const int64_t pages_needed =
      (int64_t(rows.length) + params.page_size.divisor - 1) / params.page_size.divisor;
  if (pages_needed > params.max_blocks_per_seq) {
    report_index_error(params.index_errors, IndexRule::kPagesPastTable, IndexArg::kBlockTable,
                       IndexOp::kVarlen, batch, 0, rows.length, params.max_blocks_per_seq,
                       params.page_size.divisor);
  }
}

// One thread block per kRowsPerBlock keys of one sequence; its threads walk
// the nheads_k x head_dim elements of each row (2-byte copies: head dims need
// not be multiples of 8, and this path is not the one decode takes).
__global__ void gather_paged_rows_kernel(const PagedGatherParams params) {
  HeadBatch pair;  // one "head" per sequence: the grid's y and z are the sequences
  if (!block_head_batch(1, params.batch, pair)) return;
  const int batch = pair.batch;
  if (blockIdx.x == 0 && threadIdx.x == 0) check_sequence(params, batch);
  const int row_begin = params.cu_seqlens_packed[batch];
  const int seqlen = params.cu_seqlens_packed[batch + 1] - row_begin;
  const int* table = params.block_table + batch * params.block_table_batch_stride;
  const int elems_per_row = params.nheads_k * params.head_dim;
  const uint16_t* k_cache = static_cast<const uint16_t*>(params.k_cache);
  const uint16_t* v_cache = static_cast<const uint16_t*>(params.v_cache);
  uint16_t* k_packed = static_cast<uint16_t*>(params.k_packed);
  uint16_t* v_packed = static_cast<uint16_t*>(params.v_packed);
  for (int r = 0; r < kRowsPerBlock; ++r) {
    const int key = blockIdx.x * kRowsPerBlock + r;
    if (key >= seqlen) return;
    int page_index, in_page;
    params.page_size.divmod(key, page_index, in_page);
    const int page = guarded_page(params.index_errors, IndexOp::kVarlen, batch, page_index,
                                  table[page_index], params.num_blocks);
    const int64_t k_row = page * params.k_block_stride + in_page * params.k_row_stride;
    const int64_t v_row = page * params.v_block_stride + in_page * params.v_row_stride;
    const int64_t dst_row = int64_t(row_begin + key) * elems_per_row;
    for (int i = threadIdx.x; i < elems_per_row; i += kThreads) {
      const int head = i / params.head_dim;
      const int d = i - head * params.head_dim;
      k_packed[dst_row + i] = k_cache[k_row + head * params.k_head_stride + d];
      v_packed[dst_row + i] = v_cache[v_row + head * params.v_head_stride + d];
    }
  }
}

}  // namespace

void launch_gather_paged_rows(const PagedGatherParams& params, cudaStream_t stream) {
  if (params.batch == 0) return;
  // At least one block per sequence: its first thread checks the offsets.
  const dim3 grid = grid_over_heads_batch(
      std::max((params.max_seqlen_k + kRowsPerBlock - 1) / kRowsPerBlock, 1), 1, params.batch);
  gather_paged_rows_kernel<<<grid, kThreads, 0, stream>>>(params);
  FA_CUDA_CHECK(cudaGetLastError());
}

}  // namespace flash
