// A value head dim d_v smaller than the query/key head dim d_qk (the op
// contract's "Head dims") on the CPU path: it runs the d_qk problem on v
// zero-padded to d_qk and keeps the first d_v columns of its results. A zero
// column of V gives a zero column of O, so the padded problem's first d_v
// columns are the answer; in the backward, dO and O are padded the same way,
// so D = rowsum(dO * O) and dP = dO V^T, and with them dQ and dK, are those of
// the unpadded problem, and dV's padded columns are dropped. The CUDA kernels
// rest on the same argument without the copies: they read V, dO and O at d_v
// columns with the rest of each tile zero-filled (FwdParams::head_dim_v).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

#include "api/kvcache_checks.h"

namespace flash {

// t with its last dim zero-padded to head_dim (a new contiguous tensor), or t
// itself when its last dim is head_dim already.
at::Tensor pad_head_dim(const at::Tensor& t, int64_t head_dim);

// The first head_dim columns of t's last dim as a contiguous tensor, or t
// itself when its last dim is head_dim already.
at::Tensor crop_head_dim(const at::Tensor& t, int64_t head_dim);

// fwd_kvcache with d_v < d_qk: the attention reads a zero-padded copy of
// v_cache, into which the op's existing append writes the new rows; this copies
// those rows (their first d_v columns) back into the caller's v_cache, which is
// never padded. The new rows of batch b sit at positions cache_seqlens[b] + i,
// i < seqlen_new, of cache row cache_batch_idx[b] (b without it) or, paged, of
// the pages its block_table row (cache_batch_idx[b], else b) names. Positions and pages are clamped
// into the tensors, not checked: a bad index value is the op's to report (docs/memory_safety.md),
// and a clamped position copies the padded copy's row back onto the row it was made from. ATen
// only, so no host read of the index tensors (CUDA graph capture stays possible).
void copy_appended_v_rows(const at::Tensor& v_cache, const at::Tensor& v_cache_padded,
                          const KvcacheShape& shape, const at::Tensor& cache_seqlens,
                          const std::optional<at::Tensor>& cache_batch_idx,
                          const std::optional<at::Tensor>& block_table);

}  // namespace flash
