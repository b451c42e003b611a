// The index checks of a paged varlen forward (FwdParams::block_table), in
// one pass before the forward kernel (after a split run's kernels, which
// report none of these values: KvcacheParams::table_checked_after): each
// sequence's key count (seqused_k, else its cu_seqlens_k length) against
// max_seqlen_k and the rows its block_table row addresses, and the table
// entries of the pages its keys use against the pool. The forward kernels
// clamp the same values without reporting (BlockInfo::paged_seqlen_k,
// locate_paged_key in paged_rows.h): the guards inlined in every role's
// per-tile BlockInfo overran the Hopper producer's 24 registers, on paged
// calls and unpaged ones alike.
#pragma once

#include <cuda_runtime.h>

#include "cuda/core/params.h"

namespace flash {

// after_combine: launched right after a split run's combine kernel, as its
// programmatic dependent (sm90 and newer), so that the check, which reads
// only the call's inputs and waits for no kernel, runs beside the combine.
void launch_check_paged_keys(const FwdParams& params, cudaStream_t stream,
                             bool after_combine = false);

}  // namespace flash
