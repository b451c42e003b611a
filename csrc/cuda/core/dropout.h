// Applies the contract's dropout mask (../common/philox.h) to a thread's
// fragment of P. One Philox draw covers 4 key columns; a thread holds column
// pairs (c, c+1) with c even, so each draw serves one pair (apply_dropout),
// or, with the lane exchange of PairedDropoutMask, two; in a transposed tile
// (keys as rows) four lanes share each draw (TransposedDropoutMask).
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

// The state of (batch, head) from a call's params (FwdParams or BwdParams:
// rng_state, dropout_threshold, nheads).
template <typename Params>
__forceinline__ __device__ DropoutState dropout_state_of(const Params& params, int batch,
                                                         int head) {
  return {static_cast<uint64_t>(params.rng_state[0]),
          static_cast<uint64_t>(params.rng_state[1]),
          params.dropout_threshold,
          batch,
          head,
          params.nheads};
}

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

// The draws of a thread's fragment of a transposed accumulator tile (keys as
// rows, queries as columns: the Hopper backward's S^T and dP^T), each Philox
// call made once per warp (docs/dropout_sm90.md, section 6). In the wgmma
// (and mma.sync m16n8) accumulator a thread holds keys (k, k + 8) and, per
// chunk i of 8 columns, the query pair 8 i + 2 (lane % 4) + {0, 1}; the
// four keys of one Philox group (one call: four consecutive keys of one
// query) are held by the four lanes lane % 16 / 4 = 0 .. 3 of a row of 16,
// each with its key % 4 = b, at lane offsets 4 and 8, all with the same
// queries. Lane b makes the calls of the element (r, c) = (b / 2, b % 2)
// of every chunk for all four, and a 4 x 4 bit transpose in two
// shfl.xor steps hands each lane its key's bit of every call. Same calls,
// same bits: the mask is the contract's (philox.h).
//
// draw() needs only (key, query), so the backward issues it under the
// wgmmas of S^T and dP^T; apply() masks dP^T before dS^T is made from it,
// and P^T after.
template <int kNChunks>
struct TransposedDropoutMask {
  // One nibble per chunk, 8 chunks per word: bit 4 i + 2 r + c is the keep
  // bit of element (ROW r, COL 2 i + c).
  static constexpr int kWords = (4 * kNChunks + 31) / 32;
  uint32_t keep[kWords];

  // coord: (ROW,COL) = (2,(2,kNChunks)) -> (key,query) of the tile, as
  // row_base + and col_base + offsets.
  template <typename TensorC>
  __forceinline__ __device__ void draw(const TensorC& coord, int key_base, int query_base,
                                       const DropoutState& dropout) {
    static_assert(decltype(size<0>(coord))::value == 2, "keys in pairs (k, k + 8)");
    static_assert(decltype(size<1>(coord))::value == 2 * kNChunks, "queries in pairs per chunk");
    // This lane's place in its key group (key_base is a multiple of 4), read
    // from the coordinates, so it holds for whatever lane order the
    // accumulator has as long as the group's lanes differ in lane bits 2, 3
    // by b (wgmma, mma.sync m16n8: lane 4 q + t holds key lane / 4).
    const int key0 = get<0>(coord(0, 0));
    const int b = key0 & 3;
    const bool second_key = (b & 2) != 0;    // r: this lane calls for key k + 8's group
    const bool second_query = (b & 1) != 0;  // c: and for query 2 i + 1 of each chunk
    const int group_key = (key_base + (second_key ? get<0>(coord(1, 0)) : key0)) & ~3;
    uint32_t own[kWords];
    CUTE_UNROLL
    for (int w = 0; w < kWords; ++w) own[w] = 0u;
    CUTE_UNROLL
    for (int i = 0; i < kNChunks; ++i) {
      const int query =
          query_base + (second_query ? get<1>(coord(0, 2 * i + 1)) : get<1>(coord(0, 2 * i)));
      const PhiloxOut bits = dropout_random_bits(dropout.seed, dropout.offset, dropout.batch,
                                                 dropout.head, dropout.nheads, query, group_key);
      uint32_t nibble = 0u;
      CUTE_UNROLL
      for (int k = 0; k < 4; ++k) nibble |= uint32_t(dropout_keep(bits, k, dropout.threshold)) << k;
      own[i / 8] |= nibble << (4 * (i % 8));
    }
    // The transpose of (lane's b, bit k) within each nibble: at step j a lane
    // keeps the bits whose k has bit j equal to b's, and takes the others
    // from the partner at lane offset 4 << j (b ^ (1 << j)), whose bit
    // k ^ (1 << j) they are. After both steps bit k of lane b is bit b of
    // lane k's nibble: 2 r + c of the call of element (r, c).
    CUTE_UNROLL
    for (int w = 0; w < kWords; ++w) {
      uint32_t word = own[w];
      CUTE_UNROLL
      for (int j = 0; j < 2; ++j) {
        const uint32_t high = j == 0 ? 0xAAAAAAAAu : 0xCCCCCCCCu;  // bits whose k has bit j
        const uint32_t theirs = __shfl_xor_sync(0xffffffffu, word, 4 << j);
        word = (b >> j) & 1 ? (word & high) | ((theirs >> (1 << j)) & ~high)
                            : (word & ~high) | ((theirs << (1 << j)) & high);
      }
      keep[w] = word;
    }
  }

  // Dropped elements of t (ROW,COL), laid out as draw()'s coord, become 0,
  // kept ones are multiplied by rescale.
  template <typename TensorT>
  __forceinline__ __device__ void apply(TensorT& t, float rescale) const {
    static_assert(decltype(size<0>(t))::value == 2, "keys in pairs (k, k + 8)");
    static_assert(decltype(size<1>(t))::value == 2 * kNChunks, "queries in pairs per chunk");
    CUTE_UNROLL
    for (int i = 0; i < kNChunks; ++i) {
      CUTE_UNROLL
      for (int r = 0; r < 2; ++r) {
        CUTE_UNROLL
        for (int c = 0; c < 2; ++c) {
          const bool kept = (keep[i / 8] >> (4 * (i % 8) + 2 * r + c)) & 1u;
          t(r, 2 * i + c) = kept ? t(r, 2 * i + c) * rescale : 0.f;
        }
      }
    }
  }
};

}  // namespace flash
