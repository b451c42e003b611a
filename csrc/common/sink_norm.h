// Attention sinks (learnable_sink): the end of a row's softmax with one more
// logit, the head's sink, in the denominator and no value row
// (docs/architecture.md, "The op contract"). One definition for the CPU path
// and the kernels.
#pragma once

#include <cmath>

#include "common/host_device.h"

namespace flash {

// -inf stands for "no sink": it adds exp(-inf) = 0 to every denominator.
// The lse of a row that saw no key: +inf, or the sink alone.
FA_HOST_DEVICE float empty_row_lse(float sink) { return sink == -INFINITY ? INFINITY : sink; }

struct RowNorm {
  float out_scale;  // multiplies the row's unnormalised output
  float lse;
};

// m_nat is the row max in natural score units, row_sum the sum of
// exp(s - m_nat) over its keys. Against m = max(m_nat, sink) both exps are at
// most 1, so a sink far above the scores cannot overflow, nor one far below
// take the row's sum to 0.
FA_HOST_DEVICE RowNorm row_norm_with_sink(float m_nat, float row_sum, bool empty, float sink,
                                          float out_rescale) {
  if (empty) return {0.f, empty_row_lse(sink)};
  const float m = fmaxf(m_nat, sink);
  const float kept = expf(m_nat - m);
  const float denom = row_sum * kept + expf(sink - m);
  return {out_rescale * kept / denom, m + logf(denom)};
}

}  // namespace flash
