// Host side of the forward kernel: grid, shared-memory opt-in and launch for
// one (dtype, compiled head dim), with the tile shape from tile_config.h.
#pragma once

#include <cuda_runtime.h>

#include "cuda_check.h"
#include "flash_fwd_kernel.h"
#include "kernel_traits.h"
#include "params.h"
#include "return_probs.h"
#include "tile_config.h"

namespace flash {

template <typename Element, int kHeadDim>
void run_flash_fwd(const FwdParams& params, cudaStream_t stream) {
  using Config = FwdTileConfig<kHeadDim>;
  using Traits =
      FwdKernelTraits<kHeadDim, Config::kBlockM, Config::kBlockN, Config::kNWarps, Element>;
  const int num_m_blocks = (params.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM;
  if (num_m_blocks == 0 || params.batch == 0 || params.nheads == 0) return;
  // Query blocks on x (no 65535 limit); heads and batch on y and z.
  const dim3 grid(num_m_blocks, params.nheads, params.batch);
  const bool with_score_extras =
      params.softcap > 0.f || params.alibi_slopes != nullptr || params.dropout_p > 0.f;
  auto kernel = with_score_extras ? &flash_fwd_kernel<Traits, true> : &flash_fwd_kernel<Traits, false>;
  constexpr int kSmemSize = Traits::kSmemSize;
  if (kSmemSize >= 48 * 1024) {
    FA_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemSize));
  }
  kernel<<<grid, Traits::kNThreads, kSmemSize, stream>>>(params);
  FA_CUDA_CHECK(cudaGetLastError());
  if (params.p_ptr != nullptr) launch_return_probs(params, stream);
}

}  // namespace flash
