#include "paged_gather.h"

#include <cstdint>

#include "cuda_check.h"
#include "grid_heads_batch.h"

namespace flash {
namespace {

constexpr int kRowsPerBlock = 8;
constexpr int kThreads = 128;

// One thread block per kRowsPerBlock keys of one sequence; its threads walk
// the nheads_k x head_dim elements of each row (2-byte copies: head dims need
// not be multiples of 8, and this path is not the one decode takes).
__global__ void gather_paged_rows_kernel(const PagedGatherParams params) {
  HeadBatch pair;  // one "head" per sequence: the grid's y and z are the sequences
  if (!block_head_batch(1, params.batch, pair)) return;
  const int batch = pair.batch;
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
    int page = table[page_index];
    page = page < 0 ? 0 : (page >= params.num_blocks ? params.num_blocks - 1 : page);
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
  if (params.batch == 0 || params.max_seqlen_k == 0) return;
  const dim3 grid = grid_over_heads_batch(
      (params.max_seqlen_k + kRowsPerBlock - 1) / kRowsPerBlock, 1, params.batch);
  gather_paged_rows_kernel<<<grid, kThreads, 0, stream>>>(params);
  FA_CUDA_CHECK(cudaGetLastError());
}

}  // namespace flash
