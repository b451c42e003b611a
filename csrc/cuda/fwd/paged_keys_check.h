// The index checks of a paged varlen forward (FwdParams::block_table), in
// one pass before the forward kernel (after a split run's kernels, which
// report none of these values): each sequence's key count (seqused_k,
// else its cu_seqlens_k length) against max_seqlen_k and the rows its
// block_table row addresses, and the table entries of the pages its keys use
// against the pool (paged_keys_check_block.h, one block per sequence). The
// forward kernels clamp the same values without reporting
// (BlockInfo::paged_seqlen_k, locate_paged_key in paged_rows.h): the guards
// inlined in every role's per-tile BlockInfo overran the Hopper producer's 24
// registers, on paged calls and unpaged ones alike. A split run's combine
// grid does the same blocks' work instead of this kernel
// (KvcacheParams::combine_checks_paged_keys).
#pragma once

#include <cuda_runtime.h>

#include "cuda/core/params.h"

namespace flash {

void launch_check_paged_keys(const FwdParams& params, cudaStream_t stream);

}  // namespace flash
