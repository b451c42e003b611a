#include "cuda/fwd/paged_keys_check.h"

#include <cstdint>

#include "cuda/core/cuda_check.h"
#include "cuda/core/index_guards.h"
#include "cuda/launch/dependent_launch.h"

namespace flash {
namespace {

constexpr int kThreads = 128;

// Sequence b's keys, reported and clamped as BlockInfo::paged_seqlen_k
// clamps them.
__device__ int checked_paged_keys(const FwdParams& params, int batch) {
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

// One block per sequence: its first thread checks the key count, then every
// thread checks a share of the table entries those keys use.
__global__ void __launch_bounds__(kThreads) check_paged_keys_kernel(const FwdParams params) {
  __shared__ int keys;
  const int batch = blockIdx.x;
  if (threadIdx.x == 0) keys = checked_paged_keys(params, batch);
  __syncthreads();
  const int pages = (keys + params.page_size.divisor - 1) / params.page_size.divisor;
  const int* row = params.block_table + int64_t(batch) * params.block_table_batch_stride;
  for (int i = threadIdx.x; i < pages; i += kThreads) {
    guarded_page(params.index_errors, IndexOp::kVarlen, batch, i, row[i], params.num_pages);
  }
}

}  // namespace

void launch_check_paged_keys(const FwdParams& params, cudaStream_t stream, bool after_combine) {
  if (params.batch == 0 || params.block_table == nullptr) return;
  LaunchOptions options;
  options.programmatic = after_combine;
  launch_ex(&check_paged_keys_kernel, dim3(params.batch), dim3(kThreads), 0, stream, options,
            params);
}

}  // namespace flash
