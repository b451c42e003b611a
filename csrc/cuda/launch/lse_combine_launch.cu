// One instantiation of lse_combine_kernel per (input dtype, output dtype,
// vector width): 18 small kernels, picked here at run time.
#include "cuda/launch/lse_combine_launch.h"

#include <cstdint>
#include <stdexcept>

#include "cuda/core/cuda_check.h"
#include "cuda/decode/lse_combine_kernel.h"

namespace flash {
namespace {

template <typename In, typename Out>
void launch_typed(const LseCombineParams& p, cudaStream_t stream) {
  const int64_t rows = p.batch * p.seqlen * p.nheads;
  const int64_t blocks = (rows + kCombineRowsPerBlock - 1) / kCombineRowsPerBlock;
  if (blocks > INT32_MAX) throw std::runtime_error("flash_attn_combine: too many rows for a grid");
  const dim3 grid(static_cast<unsigned>(blocks));
  if (p.vectorized) {
    lse_combine_kernel<In, Out, 4><<<grid, kCombineBlockThreads, 0, stream>>>(p);
  } else {
    lse_combine_kernel<In, Out, 1><<<grid, kCombineBlockThreads, 0, stream>>>(p);
  }
  FA_CUDA_CHECK(cudaGetLastError());
}

template <typename In>
void launch_for_out(const LseCombineParams& p, cudaStream_t stream) {
  switch (p.out_dtype) {
    case CombineDtype::kFloat: return launch_typed<In, float>(p, stream);
    case CombineDtype::kHalf: return launch_typed<In, cutlass::half_t>(p, stream);
    case CombineDtype::kBFloat16: return launch_typed<In, cutlass::bfloat16_t>(p, stream);
  }
}

}  // namespace

void launch_lse_combine(const LseCombineParams& params, cudaStream_t stream) {
  switch (params.partial_dtype) {
    case CombineDtype::kFloat: return launch_for_out<float>(params, stream);
    case CombineDtype::kHalf: return launch_for_out<cutlass::half_t>(params, stream);
    case CombineDtype::kBFloat16: return launch_for_out<cutlass::bfloat16_t>(params, stream);
  }
}

}  // namespace flash
