// The step of fwd_kvcache that runs before attention when the attention
// kernel does not do it itself (params.append_in_attention): the new keys /
// values are written into the cache at positions cache_seqlens[b] + i
// (through the block table when paged), the keys rotated when rotary tables
// are given, and q rotated into params.q_ptr. Rotation happens in fp32 with
// one rounding and no fused multiply-add (rotary.h), so the cache holds the
// same bits as the CPU path.
#pragma once

#include <cuda_runtime.h>

#include "cuda/core/params.h"

namespace flash {

// Appends params.new_k / new_v (when seqlen_new > 0) and writes the rotated q
// (when rotary_dim > 0). Launch-only: no host synchronisation.
void launch_kvcache_append_rotary(const KvcacheParams& params, cudaStream_t stream);

}  // namespace flash
