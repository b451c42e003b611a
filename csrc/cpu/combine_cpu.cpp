// CPU implementation of flash_attn::combine and combine_out: the merge of
// partial attention results by their lse (csrc/common/lse_combine_rule.h),
// in fp32, parallel over rows (batch, seqlen, head).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>

#include "api/combine_checks.h"
#include "common/lse_combine_rule.h"

namespace flash::cpu {
namespace {

// partial: fp32 (num_splits, rows, head_dim), lse: fp32 (num_splits, rows),
// both contiguous; writes out: fp32 (rows, head_dim) and softmax_lse: (rows,).
void combine_rows(const float* partial, const float* lse, float* out, float* softmax_lse,
                  int64_t num_splits, int64_t rows, int64_t head_dim) {
  // Rows are independent; a grain of a few rows' work keeps tiny calls serial.
  const int64_t grain = std::max<int64_t>(1, 4096 / (num_splits * head_dim));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::array<float, kMaxCombineSplits> split_lse;
    std::array<float, kMaxCombineSplits> weight;
    for (int64_t row = begin; row < end; ++row) {
      float max_lse = -INFINITY;
      bool any_nan = false;
      for (int64_t s = 0; s < num_splits; ++s) {
        split_lse[s] = combine_split_lse(lse[s * rows + row]);
        any_nan |= std::isnan(split_lse[s]);
        max_lse = std::fmax(max_lse, split_lse[s]);
      }
      float sum = 0.f;
      if (max_lse != -INFINITY) {
        for (int64_t s = 0; s < num_splits; ++s) {
          if (split_lse[s] != -INFINITY) sum += std::exp(split_lse[s] - max_lse);
        }
      }
      const float row_lse = combined_lse(max_lse, sum, any_nan);
      softmax_lse[row] = row_lse;
      for (int64_t s = 0; s < num_splits; ++s) {
        weight[s] = combine_weight(split_lse[s], max_lse, sum, any_nan);
      }
      float* out_row = out + row * head_dim;
      std::fill(out_row, out_row + head_dim, 0.f);
      for (int64_t s = 0; s < num_splits; ++s) {
        if (weight[s] == 0.f) continue;
        const float* in_row = partial + (s * rows + row) * head_dim;
        for (int64_t c = 0; c < head_dim; ++c) out_row[c] += weight[s] * in_row[c];
      }
    }
  });
}

// The merged out in fp32 with out_partial's shape minus num_splits, and the
// fp32 lse with lse_partial's shape minus num_splits.
std::tuple<at::Tensor, at::Tensor> combine_fp32(const at::Tensor& out_partial,
                                                const at::Tensor& lse_partial) {
  const CombineShape shape = check_combine_args(out_partial, lse_partial);
  const int64_t rows = shape.batch * shape.seqlen * shape.nheads;
  const at::Tensor partial = out_partial.to(at::kFloat).contiguous();
  const at::Tensor lse = lse_partial.contiguous();
  at::Tensor out = at::empty(out_partial.sizes().slice(1), partial.options());
  at::Tensor softmax_lse = at::empty(lse_partial.sizes().slice(1), lse.options());
  if (rows > 0) {
    combine_rows(partial.const_data_ptr<float>(), lse.const_data_ptr<float>(),
                 out.mutable_data_ptr<float>(), softmax_lse.mutable_data_ptr<float>(),
                 shape.num_splits, rows, shape.head_dim);
  }
  return {out, softmax_lse};
}

std::tuple<at::Tensor, at::Tensor> combine_cpu(const at::Tensor& out_partial,
                                               const at::Tensor& lse_partial,
                                               std::optional<at::ScalarType> out_dtype) {
  check_combine_args(out_partial, lse_partial);
  const at::ScalarType dtype = combine_out_dtype(out_partial, out_dtype);
  auto [out, softmax_lse] = combine_fp32(out_partial, lse_partial);
  return {out.to(dtype), softmax_lse};
}

at::Tensor combine_out_cpu(const at::Tensor& out_partial, const at::Tensor& lse_partial,
                           const at::Tensor& out) {
  check_combine_args(out_partial, lse_partial);
  check_combine_out(out, out_partial, lse_partial);
  auto [out_fp32, softmax_lse] = combine_fp32(out_partial, lse_partial);
  out.copy_(out_fp32);
  return softmax_lse;
}

}  // namespace
}  // namespace flash::cpu

TORCH_LIBRARY_IMPL(flash_attn, CPU, m) {
  m.impl("combine", &flash::cpu::combine_cpu);
  m.impl("combine_out", &flash::cpu::combine_out_cpu);
}
