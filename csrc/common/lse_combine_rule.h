// The merge rule of flash_attn_combine (docs/architecture.md, "The op
// contract"): partial results of one query row over disjoint key sets, each
// normalised over its own keys, merged by their log-sum-exp. One definition
// of the edge cases for the CPU path and the kernel.
//
//   m = max_i lse_i, sum = sum_i exp(lse_i - m), lse = m + log(sum),
//   out = sum_i (exp(lse_i - m) / sum) * out_i.
//
// A split with no key says so by its lse: -inf (the mathematical value), or
// +inf, the value this project's forwards write for a row that sees no key.
// Both contribute nothing, whatever its out row holds. A row whose splits are
// all empty gets out = 0 and lse = +inf, the project's empty row, so the
// result can itself be a partial of a later merge. A NaN lse in any split
// makes the row's lse and out NaN: the caller sees the bad input instead of a
// result that quietly left a split out.
#pragma once

#include <cmath>

#include "common/host_device.h"

namespace flash {

// The most splits one call merges: the kernel keeps one weight per split of a
// row in shared memory and each of a warp's lanes holds kMaxCombineSplits / 32
// lse values in registers. Checked on the host (api/combine_checks.cpp).
constexpr int kMaxCombineSplits = 256;

// A split's lse with both empty-row values mapped to -inf, which weighs 0.
FA_HOST_DEVICE float combine_split_lse(float lse) { return lse == INFINITY ? -INFINITY : lse; }

// The row's lse from the max of its split lse (-inf when every split is empty)
// and sum_i exp(lse_i - max) over the non-empty ones.
FA_HOST_DEVICE float combined_lse(float max_lse, float sum, bool any_nan) {
  if (any_nan) return NAN;
  return max_lse == -INFINITY ? INFINITY : max_lse + logf(sum);
}

// The weight of split i in the row's out: exp(lse_i - max_lse) / sum, which
// equals exp(lse_i - lse) but does not go through the rounded lse (at an lse
// of 3e4 one fp32 ulp of it is 2e-3 of every weight). 0 for an empty split or
// row (the caller skips a weight of 0, so an empty split's out row is never
// read into the result); NaN when the row has a NaN lse.
FA_HOST_DEVICE float combine_weight(float split_lse, float max_lse, float sum, bool any_nan) {
  if (any_nan) return NAN;
  if (split_lse == -INFINITY) return 0.f;
  return expf(split_lse - max_lse) / sum;
}

}  // namespace flash
