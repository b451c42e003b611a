// Applies the contract's dropout mask (../common/philox.h) to a thread's
// fragment of P. One Philox draw covers 4 key columns; a thread holds column
// pairs (c, c+1) with c even, so each draw serves one pair.
#pragma once

#include <cute/tensor.hpp>

#include "common/philox.h"

namespace flash {

using namespace cute;

struct DropoutState {
  uint64_t seed;
  uint64_t offset;
  uint32_t threshold;
  int batch;
  int head;
  int nheads;
};

// Dropped elements become 0 (or -|p| when negate_dropped, the encoding of the
// returned attention probabilities).
template <bool kNegateDropped = false, typename TensorP, typename TensorC>
__forceinline__ __device__ void apply_dropout(TensorP& p, const TensorC& coord, int row_base,
                                              int col_base, const DropoutState& dropout) {
  static_assert(decltype(size<1, 0>(p))::value == 2);
  CUTE_UNROLL
  for (int mi = 0; mi < size<0>(p); ++mi) {
    const int row = row_base + get<0>(coord(mi, 0));
    CUTE_UNROLL
    for (int nj = 0; nj < size<1, 1>(p); ++nj) {
      const int col0 = col_base + get<1>(coord(0, make_coord(0, nj)));
      const PhiloxOut bits = dropout_random_bits(dropout.seed, dropout.offset, dropout.batch,
                                                 dropout.head, dropout.nheads, row, col0);
      CUTE_UNROLL
      for (int j = 0; j < 2; ++j) {
        if (!dropout_keep(bits, col0 + j, dropout.threshold)) {
          auto& value = p(mi, make_coord(j, nj));
          value = kNegateDropped ? -value : 0.f;
        }
      }
    }
  }
}

}  // namespace flash
