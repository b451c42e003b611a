// Argument checks of flash_attn::combine and combine_out (both devices): the
// layouts, dtypes and bounds of docs/architecture.md ("flash_attn_combine").
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace flash {

// The problem a combine call describes. Fixed length: out_partial
// (num_splits, batch, seqlen, nheads, head_dim), lse_partial
// (num_splits, batch, seqlen, nheads). Varlen: out_partial
// (num_splits, total, nheads, head_dim), lse_partial (num_splits, total,
// nheads), described here as batch = 1, seqlen = total.
struct CombineShape {
  int64_t num_splits;
  int64_t batch;
  int64_t seqlen;
  int64_t nheads;
  int64_t head_dim;
  bool varlen;
};

// out_partial: fp32, fp16 or bf16, any strides; lse_partial: fp32, any
// strides, on out_partial's device; num_splits in [1, kMaxCombineSplits],
// head_dim >= 1.
CombineShape check_combine_args(const at::Tensor& out_partial, const at::Tensor& lse_partial);

// The dtype of out: out_dtype, else out_partial's; fp32, fp16 or bf16.
at::ScalarType combine_out_dtype(const at::Tensor& out_partial,
                                 std::optional<at::ScalarType> out_dtype);

// The caller's out of combine_out: out_partial's shape without its first dim,
// fp32, fp16 or bf16, on out_partial's device, any strides without elements
// that share memory, no memory shared with the inputs.
void check_combine_out(const at::Tensor& out, const at::Tensor& out_partial,
                       const at::Tensor& lse_partial);

}  // namespace flash
