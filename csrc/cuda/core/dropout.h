// Applies the contract's dropout mask (../common/philox.h) to a thread's
// fragment of P. One Philox draw covers 4 key columns; a thread holds column
// pairs (c, c+1) with c even, so each draw serves one pair (apply_dropout),
// or, with the lane exchange of PairedDropoutMask, two.
#pragma once

#include <cstdint>

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

// The draws of a thread's fragment of an accumulator tile with half the
// Philox calls of apply_dropout (docs/dropout_sm90.md, section 2). In the
// wgmma (and mma.sync m16n8) accumulator, a thread holds rows (r, r + 8) of
// each row pair and, per chunk of 8 columns, the column pair 8j + {0, 1}
// (the "lower" lane) or 8j + {2, 3} (its partner lane ^ 1, the "upper"
// one) of one four-column Philox group, or the same for 8j + {4..7}. So
// both lanes of a pair need the same two calls per chunk: the lower lane
// makes the one of row r, the upper the one of row r + 8, each keeps all
// four keep bits, and one shfl.xor 1 per word of 8 chunks trades them.
// Same calls, same bits: the mask is the contract's (philox.h).
//
// draw() needs only (row, col), so the forward issues it under the wgmma of
// S and apply() after the softmax has taken its row sums.
template <int kNRowPairs, int kNChunks>
struct PairedDropoutMask {
  // 4 keep bits per chunk (one Philox call), 8 chunks per word.
  static constexpr int kWords = (4 * kNChunks + 31) / 32;
  uint32_t own[kNRowPairs][kWords];  // the bits this thread drew, of its row of each pair
  bool upper;                        // this thread holds columns {2, 3} of its groups

  // coord: (ROW,COL) = ((2,kNRowPairs),(2,kNChunks)) -> (row,col) of the tile.
  template <typename TensorC>
  __forceinline__ __device__ void draw(const TensorC& coord, int row_base, int col_base,
                                       const DropoutState& dropout) {
    static_assert(decltype(size<0>(coord))::value == 2 * kNRowPairs, "rows in pairs (r, r + 8)");
    static_assert(decltype(size<1>(coord))::value == 2 * kNChunks, "columns in pairs per chunk");
    // Which half of its groups this thread holds: columns {2, 3} of a group
    // make it the upper lane, which draws row r + 8. Read from the
    // coordinates, so it holds for whatever lane order the accumulator has,
    // as long as the partner holding the other half is lane ^ 1 (wgmma and
    // mma.sync m16n8: lane 4q + t holds columns 2t, 2t + 1 of each chunk).
    upper = (get<1>(coord(0, 0)) & 2) != 0;
    CUTE_UNROLL
    for (int m = 0; m < kNRowPairs; ++m) {
      const int row = row_base + (upper ? get<0>(coord(2 * m + 1, 0)) : get<0>(coord(2 * m, 0)));
      CUTE_UNROLL
      for (int w = 0; w < kWords; ++w) own[m][w] = 0u;
      CUTE_UNROLL
      for (int c = 0; c < kNChunks; ++c) {
        const int col0 = col_base + (get<1>(coord(0, 2 * c)) & ~3);
        const PhiloxOut bits = dropout_random_bits(dropout.seed, dropout.offset, dropout.batch,
                                                   dropout.head, dropout.nheads, row, col0);
        uint32_t keep = 0u;
        CUTE_UNROLL
        for (int k = 0; k < 4; ++k) keep |= uint32_t(dropout_keep(bits, k, dropout.threshold)) << k;
        own[m][c / 8] |= keep << (4 * (c % 8));
      }
    }
  }

  // Dropped elements of p (ROW,COL), laid out as draw()'s coord, become 0.
  template <typename TensorP>
  __forceinline__ __device__ void apply(TensorP& p) const {
    static_assert(decltype(size<0>(p))::value == 2 * kNRowPairs, "rows in pairs (r, r + 8)");
    static_assert(decltype(size<1>(p))::value == 2 * kNChunks, "columns in pairs per chunk");
    CUTE_UNROLL
    for (int m = 0; m < kNRowPairs; ++m) {
      CUTE_UNROLL
      for (int w = 0; w < kWords; ++w) {
        const uint32_t theirs = __shfl_xor_sync(0xffffffffu, own[m][w], 1);
        // Row r's bits come from the lower lane, row r + 8's from the upper;
        // this thread's columns are bits {0, 1} (lower) or {2, 3} (upper) of
        // each chunk's four.
        const int shift = upper ? 2 : 0;
        const uint32_t rows[2] = {(upper ? theirs : own[m][w]) >> shift,
                                  (upper ? own[m][w] : theirs) >> shift};
        CUTE_UNROLL
        for (int i = 0; i < 2; ++i) {
          CUTE_UNROLL
          for (int c = 8 * w; c < 8 * w + 8 && c < kNChunks; ++c) {
            CUTE_UNROLL
            for (int k = 0; k < 2; ++k) {
              const bool keep = (rows[i] >> (4 * (c % 8) + k)) & 1u;
              auto& value = p(2 * m + i, 2 * c + k);
              value = keep ? value : 0.f;
            }
          }
        }
      }
    }
  }
};

}  // namespace flash
