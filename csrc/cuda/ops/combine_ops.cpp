// CUDA implementation of flash_attn::combine and combine_out: checks, the
// layout the kernel needs (last dims contiguous; anything else is copied, not
// refused), LseCombineParams, launch (decode/lse_combine_kernel.h).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>

#include "api/combine_checks.h"
#include "cuda/launch/lse_combine_launch.h"
#include "cuda/ops/op_common.h"

namespace flash {
namespace {

CombineDtype combine_dtype(at::ScalarType dtype) {
  switch (dtype) {
    case at::kHalf: return CombineDtype::kHalf;
    case at::kBFloat16: return CombineDtype::kBFloat16;
    default: return CombineDtype::kFloat;
  }
}

// The kernel reads and writes head_dim elements at stride 1.
at::Tensor last_dim_contiguous(const at::Tensor& t) {
  return t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous();
}

// Whether 4-element vectors of t, starting at every row, are aligned: the
// base and every stride of the row dims at a multiple of 4 elements.
bool rows_aligned_for_vec4(const at::Tensor& t) {
  const int64_t vec_bytes = 4 * t.element_size();
  if (reinterpret_cast<uintptr_t>(t.const_data_ptr()) % vec_bytes != 0) return false;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) {
    if (t.stride(d) % 4 != 0) return false;
  }
  return true;
}

// partial: (num_splits, [batch,] seqlen, nheads, head_dim), last dim
// contiguous; lse: fp32 of partial's shape without head_dim; out:
// partial's shape without num_splits, last dim contiguous; softmax_lse: fp32
// contiguous of lse's shape without num_splits.
void run_combine(const CombineShape& shape, const at::Tensor& partial, const at::Tensor& lse,
                 const at::Tensor& out, const at::Tensor& softmax_lse) {
  if (shape.batch * shape.seqlen * shape.nheads == 0) return;
  TORCH_CHECK(shape.head_dim <= std::numeric_limits<int>::max(),
              "flash_attn_combine: head_dim (last dim of out_partial) must be at most ",
              std::numeric_limits<int>::max(), ", got ", shape.head_dim);
  const int o = shape.varlen ? 0 : 1;  // partial / lse dims after num_splits start here
  LseCombineParams p{};
  p.out_partial = partial.const_data_ptr();
  p.partial_dtype = combine_dtype(partial.scalar_type());
  p.partial_split_stride = partial.stride(0);
  p.partial_batch_stride = shape.varlen ? 0 : partial.stride(1);
  p.partial_row_stride = partial.stride(1 + o);
  p.partial_head_stride = partial.stride(2 + o);
  p.lse_partial = lse.const_data_ptr<float>();
  p.lse_split_stride = lse.stride(0);
  p.lse_batch_stride = shape.varlen ? 0 : lse.stride(1);
  p.lse_row_stride = lse.stride(1 + o);
  p.lse_head_stride = lse.stride(2 + o);
  p.out = out.data_ptr();
  p.out_dtype = combine_dtype(out.scalar_type());
  p.out_batch_stride = shape.varlen ? 0 : out.stride(0);
  p.out_row_stride = out.stride(o);
  p.out_head_stride = out.stride(1 + o);
  p.softmax_lse = softmax_lse.data_ptr<float>();
  p.num_splits = static_cast<int>(shape.num_splits);
  p.batch = shape.batch;
  p.seqlen = shape.seqlen;
  p.nheads = shape.nheads;
  p.head_dim = static_cast<int>(shape.head_dim);
  p.vectorized =
      shape.head_dim % 4 == 0 && rows_aligned_for_vec4(partial) && rows_aligned_for_vec4(out);
  launch_lse_combine(p, at::cuda::getCurrentCUDAStream().stream());
}

// Checks, then the merge into out_target (the caller's out, or a new tensor);
// returns the tensor the kernel wrote (out_target, or a contiguous copy's
// source when out_target's last dim is strided) and softmax_lse.
std::tuple<at::Tensor, at::Tensor> combine_into(const at::Tensor& out_partial,
                                                const at::Tensor& lse_partial,
                                                const at::Tensor& out_target) {
  const CombineShape shape = check_combine_args(out_partial, lse_partial);
  const c10::cuda::CUDAGuard device_guard(out_partial.device());
  check_device_supported(out_partial);
  const at::Tensor partial = last_dim_contiguous(out_partial);
  at::Tensor softmax_lse =
      at::empty(lse_partial.sizes().slice(1), lse_partial.options().dtype(at::kFloat));
  const bool direct = out_target.size(-1) <= 1 || out_target.stride(-1) == 1;
  const at::Tensor buffer =
      direct ? out_target : at::empty_like(out_target, at::MemoryFormat::Contiguous);
  run_combine(shape, partial, lse_partial, buffer, softmax_lse);
  if (!direct) out_target.copy_(buffer);
  return {out_target, softmax_lse};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> combine_cuda(const at::Tensor& out_partial,
                                                const at::Tensor& lse_partial,
                                                std::optional<at::ScalarType> out_dtype) {
  check_combine_args(out_partial, lse_partial);
  const at::ScalarType dtype = combine_out_dtype(out_partial, out_dtype);
  const at::Tensor out =
      at::empty(out_partial.sizes().slice(1), out_partial.options().dtype(dtype));
  return combine_into(out_partial, lse_partial, out);
}

at::Tensor combine_out_cuda(const at::Tensor& out_partial, const at::Tensor& lse_partial,
                            const at::Tensor& out) {
  check_combine_args(out_partial, lse_partial);
  check_combine_out(out, out_partial, lse_partial);
  return std::get<1>(combine_into(out_partial, lse_partial, out));
}

}  // namespace flash
