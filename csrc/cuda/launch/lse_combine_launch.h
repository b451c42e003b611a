// Host side of flash_attn_combine's kernel (decode/lse_combine_kernel.h).
#pragma once

#include <cuda_runtime.h>

#include "cuda/decode/lse_combine_params.h"

namespace flash {

// Launches the merge on `stream` (no host synchronisation). The caller has
// checked the params (api/combine_checks.h) and that rows exist.
void launch_lse_combine(const LseCombineParams& params, cudaStream_t stream);

}  // namespace flash
