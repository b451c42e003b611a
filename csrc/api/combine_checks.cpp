#include "api/combine_checks.h"

#include <ATen/MemoryOverlap.h>

#include "common/lse_combine_rule.h"

namespace flash {
namespace {

constexpr const char* kPrefix = "flash_attn_combine";

bool is_combine_dtype(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16;
}

}  // namespace

CombineShape check_combine_args(const at::Tensor& out_partial, const at::Tensor& lse_partial) {
  TORCH_CHECK(is_combine_dtype(out_partial.scalar_type()), kPrefix,
              ": out_partial must have dtype float32, float16 or bfloat16, got ",
              out_partial.scalar_type());
  TORCH_CHECK(lse_partial.scalar_type() == at::kFloat, kPrefix,
              ": lse_partial must have dtype float32, got ", lse_partial.scalar_type());
  TORCH_CHECK(lse_partial.device() == out_partial.device(), kPrefix,
              ": lse_partial must be on the device of out_partial (", out_partial.device(),
              "), got ", lse_partial.device());
  TORCH_CHECK(lse_partial.dim() == 4 || lse_partial.dim() == 3, kPrefix,
              ": lse_partial must be 4-D (num_splits, batch, seqlen, nheads) or, varlen, 3-D "
              "(num_splits, total, nheads), got shape ",
              lse_partial.sizes());
  const bool varlen = lse_partial.dim() == 3;
  TORCH_CHECK(out_partial.dim() == lse_partial.dim() + 1, kPrefix, ": out_partial must be ",
              varlen ? "4-D (num_splits, total, nheads, head_dim) with a 3-D lse_partial"
                     : "5-D (num_splits, batch, seqlen, nheads, head_dim) with a 4-D lse_partial",
              ", got shape ", out_partial.sizes());
  TORCH_CHECK(out_partial.sizes().slice(0, lse_partial.dim()) == lse_partial.sizes(), kPrefix,
              ": out_partial ", out_partial.sizes(), " must have the shape of lse_partial ",
              lse_partial.sizes(), " plus a last dim (head_dim)");
  CombineShape shape;
  shape.varlen = varlen;
  shape.num_splits = out_partial.size(0);
  shape.batch = varlen ? 1 : out_partial.size(1);
  shape.seqlen = out_partial.size(varlen ? 1 : 2);
  shape.nheads = out_partial.size(-2);
  shape.head_dim = out_partial.size(-1);
  TORCH_CHECK(shape.num_splits >= 1 && shape.num_splits <= kMaxCombineSplits, kPrefix,
              ": num_splits (dim 0 of out_partial and lse_partial) must be in [1, ",
              kMaxCombineSplits, "], got ", shape.num_splits);
  TORCH_CHECK(shape.head_dim >= 1, kPrefix,
              ": head_dim (last dim of out_partial) must be at least 1, got ", shape.head_dim);
  return shape;
}

at::ScalarType combine_out_dtype(const at::Tensor& out_partial,
                                 std::optional<at::ScalarType> out_dtype) {
  const at::ScalarType dtype = out_dtype.value_or(out_partial.scalar_type());
  TORCH_CHECK(is_combine_dtype(dtype), kPrefix,
              ": out_dtype must be float32, float16 or bfloat16, got ", dtype);
  return dtype;
}

void check_combine_out(const at::Tensor& out, const at::Tensor& out_partial,
                       const at::Tensor& lse_partial) {
  const at::IntArrayRef expected = out_partial.sizes().slice(1);
  TORCH_CHECK(out.device() == out_partial.device(), kPrefix,
              ": out must be on the device of out_partial (", out_partial.device(), "), got ",
              out.device());
  TORCH_CHECK(is_combine_dtype(out.scalar_type()), kPrefix,
              ": out must have dtype float32, float16 or bfloat16, got ", out.scalar_type());
  TORCH_CHECK(
      out.sizes() == expected, kPrefix, ": out must have shape ",
      lse_partial.dim() == 3 ? "(total, nheads, head_dim)" : "(batch, seqlen, nheads, head_dim)",
      " = ", expected, " (out_partial's without num_splits), got ", out.sizes());
  TORCH_CHECK(at::has_internal_overlap(out) != at::MemOverlap::Yes, kPrefix,
              ": out must not have elements that share memory (e.g. an expanded tensor), got "
              "strides ",
              out.strides());
  for (const at::Tensor* input : {&out_partial, &lse_partial}) {
    if (input->numel() == 0 || out.numel() == 0) continue;
    const at::MemOverlapStatus overlap = at::get_overlap_status(out, *input);
    TORCH_CHECK(overlap != at::MemOverlapStatus::Full && overlap != at::MemOverlapStatus::Partial,
                kPrefix,
                ": out must not share memory with out_partial or lse_partial, which the kernel "
                "still reads while it writes out");
  }
}

}  // namespace flash
