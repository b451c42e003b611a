// What happens to a tile of raw Q K^T scores before the softmax, in contract
// order: scale, softcap, ALiBi, then the causal / local / bounds mask. The
// rule itself (which key a row sees, the ALiBi distance) lives in
// ../common/mask_rule.h; this header applies it to a thread's fragment.
//
// Fragments are (rows, cols) views of the accumulator; coord is the identity
// tensor partitioned the same way, giving each element's (row, col) in the tile.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

#include "../common/mask_rule.h"
#include "bwd_mask_range.h"

namespace flash {

using namespace cute;

// s = softcap * tanh(s * scale / softcap), or s * scale when softcap is 0:
// either way the scores leave in natural (scaled) units.
template <typename TensorS>
__forceinline__ __device__ void apply_scale_and_softcap(TensorS& scores, float softmax_scale,
                                                        float softcap) {
  if (softcap > 0.f) {
    const float pre = softmax_scale / softcap;
    CUTE_UNROLL
    for (int i = 0; i < size(scores); ++i) scores(i) = softcap * tanhf(scores(i) * pre);
  } else {
    CUTE_UNROLL
    for (int i = 0; i < size(scores); ++i) scores(i) *= softmax_scale;
  }
}

template <typename TensorS, typename TensorC>
__forceinline__ __device__ void apply_alibi(TensorS& scores, const TensorC& coord, int row_base,
                                            int col_base, float slope, int seqlen_q,
                                            int seqlen_k) {
  CUTE_UNROLL
  for (int mi = 0; mi < size<0>(scores); ++mi) {
    const int row = row_base + get<0>(coord(mi, 0));
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(scores); ++ni) {
      const int col = col_base + get<1>(coord(0, ni));
      scores(mi, ni) += alibi_bias(slope, row, col, seqlen_q, seqlen_k);
    }
  }
}

// The same bias on a transposed tile, as the Hopper backward holds S^T:
// rows are keys, columns query rows.
template <typename TensorS, typename TensorC>
__forceinline__ __device__ void apply_alibi_transposed(TensorS& scores, const TensorC& coord,
                                                       int key_base, int query_base, float slope,
                                                       int seqlen_q, int seqlen_k) {
  CUTE_UNROLL
  for (int mi = 0; mi < size<0>(scores); ++mi) {
    const int key = key_base + get<0>(coord(mi, 0));
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(scores); ++ni) {
      const int query = query_base + get<1>(coord(0, ni));
      scores(mi, ni) += alibi_bias(slope, query, key, seqlen_q, seqlen_k);
    }
  }
}

// Each row's visible keys form one interval (the window rule), so the bounds
// are computed once per row and each element costs two compares.
template <typename TensorS, typename TensorC>
__forceinline__ __device__ void apply_mask(TensorS& scores, const TensorC& coord, int row_base,
                                           int col_base, int seqlen_q, int seqlen_k,
                                           int window_left, int window_right) {
  CUTE_UNROLL
  for (int mi = 0; mi < size<0>(scores); ++mi) {
    const int row = row_base + get<0>(coord(mi, 0));
    const KeyRange visible =
        visible_key_range(row, row + 1, seqlen_q, seqlen_k, window_left, window_right);
    const int col_lo = visible.begin - col_base;
    const int col_hi = visible.end - col_base;
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(scores); ++ni) {
      const int col = get<1>(coord(0, ni));
      if (col < col_lo || col >= col_hi) scores(mi, ni) = -INFINITY;
    }
  }
}

// The same rule on a transposed tile, as the Hopper backward holds S^T: rows
// are keys (row_base + coord row) and columns query rows (col_base + coord
// col). A key's visible query rows form one interval too (bwd_mask_range.h),
// which also hides the query rows past seqlen_q.
template <typename TensorS, typename TensorC>
__forceinline__ __device__ void apply_mask_transposed(TensorS& scores, const TensorC& coord,
                                                      int key_base, int query_base,
                                                      int seqlen_q, int seqlen_k,
                                                      int window_left, int window_right) {
  CUTE_UNROLL
  for (int mi = 0; mi < size<0>(scores); ++mi) {
    const int key = key_base + get<0>(coord(mi, 0));
    const QueryRange visible =
        visible_query_range(key, key + 1, seqlen_q, seqlen_k, window_left, window_right);
    const int query_lo = visible.begin - query_base;
    const int query_hi = visible.end - query_base;
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(scores); ++ni) {
      const int query = get<1>(coord(0, ni));
      if (query < query_lo || query >= query_hi) scores(mi, ni) = -INFINITY;
    }
  }
}

}  // namespace flash
