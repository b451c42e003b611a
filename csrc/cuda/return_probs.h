// return_softmax / return_attn_probs: a testing aid, so it is a plain kernel
// off the hot path, run after the forward kernel has written the lse. It
// writes the normalised probabilities exp(s - lse) with the same score rule as
// the forward kernel, and negates the elements that dropout dropped.
#pragma once

#include <cuda_runtime.h>

#include "params.h"

namespace flash {

void launch_return_probs(const FwdParams& params, cudaStream_t stream);

}  // namespace flash
