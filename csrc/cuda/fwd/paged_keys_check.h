// The index checks of a paged varlen forward (FwdParams::block_table), in
// one pass before the forward kernel: each sequence's key count (seqused_k,
// else its cu_seqlens_k length) against max_seqlen_k and the rows its
// block_table row addresses, and the table entries of the pages its keys use
// against the pool. The forward kernels clamp the same values without
// reporting (BlockInfo::paged_seqlen_k, locate_paged_key in paged_rows.h):
// the guards inlined in every role's per-tile BlockInfo overran the Hopper
// producer's 24 registers, on paged calls and unpaged ones alike.
#pragma once

#include <cuda_runtime.h>

#include "cuda/core/params.h"

namespace flash {

void launch_check_paged_keys(const FwdParams& params, cudaStream_t stream);

}  // namespace flash
