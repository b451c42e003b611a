#include "cuda/fwd/paged_keys_check.h"

#include "cuda/core/cuda_check.h"
#include "cuda/fwd/paged_keys_check_block.h"

namespace flash {
namespace {

constexpr int kThreads = 128;

// One block per sequence.
__global__ void __launch_bounds__(kThreads) check_paged_keys_kernel(const FwdParams params) {
  check_paged_keys_of_sequence(params, blockIdx.x);
}

}  // namespace

void launch_check_paged_keys(const FwdParams& params, cudaStream_t stream) {
  if (params.batch == 0 || params.block_table == nullptr) return;
  check_paged_keys_kernel<<<params.batch, kThreads, 0, stream>>>(params);
  FA_CUDA_CHECK(cudaGetLastError());
}

}  // namespace flash
