// return_softmax / return_attn_probs: a testing aid, so it is a plain kernel
// off the hot path, run after the forward kernel (it reads only q, k and the
// score parameters). It writes S_dmask in flash-attn 2.x's convention, with
// the same score rule as the forward kernel:
//
//   the keys of a row are cut into blocks of kReturnProbsBlockN columns from
//   key 0, visited from the last block to the first; a visible entry (i, j)
//   holds the softmax numerator exp(s_ij - m), m being row i's running max
//   over the blocks visited so far (block j / kReturnProbsBlockN and every
//   block after it), negated (sign bit set, -0.0 included) where dropout
//   dropped it. Masked entries, rows that see no key and (varlen) entries past
//   a sequence's lengths are not written: the host zero-fills the output.
//
// Recovering P takes the same blocks: P_ij = |S_ij| * exp(m - lse_i).
#pragma once

#include <cuda_runtime.h>

#include "cuda/core/params.h"

namespace flash {

// The key-block width of S_dmask. It must equal what
// flash_attn_cuda._get_block_size_n returns and the CPU path's kProbsBlockN
// (csrc/cpu/attention_cpu.h): one width for every device, head dim and dtype.
constexpr int kReturnProbsBlockN = 64;

void launch_return_probs(const FwdParams& params, cudaStream_t stream);

}  // namespace flash
