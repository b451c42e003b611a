// What the kernel of flash_attn_combine reads (lse_combine_kernel.h): plain
// pointers, element strides and sizes, no torch types. Filled by
// csrc/cuda/ops/combine_ops.cpp. The varlen layout is batch = 1, seqlen = total.
#pragma once

#include <cstdint>

namespace flash {

enum class CombineDtype : int { kFloat, kHalf, kBFloat16 };

struct LseCombineParams {
  // (num_splits, batch, seqlen, nheads, head_dim), last dim contiguous.
  const void* out_partial;
  CombineDtype partial_dtype;
  int64_t partial_split_stride, partial_batch_stride, partial_row_stride, partial_head_stride;
  // fp32 (num_splits, batch, seqlen, nheads), any strides.
  const float* lse_partial;
  int64_t lse_split_stride, lse_batch_stride, lse_row_stride, lse_head_stride;
  // (batch, seqlen, nheads, head_dim), last dim contiguous.
  void* out;
  CombineDtype out_dtype;
  int64_t out_batch_stride, out_row_stride, out_head_stride;
  // fp32 (batch, seqlen, nheads), contiguous.
  float* softmax_lse;

  int num_splits;  // in [1, kMaxCombineSplits]
  int64_t batch, seqlen, nheads;
  int head_dim;
  // 4 columns per load and store: head_dim, the strides and both base
  // pointers allow aligned 4-element vectors (set by the op).
  bool vectorized;
};

}  // namespace flash
