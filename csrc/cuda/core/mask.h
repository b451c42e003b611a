// The causal / local / bounds mask on a thread's fragment of a score tile:
// the last step before the softmax (score_mods.h has the steps before it).
// The rule itself, which key a query row sees, is common/mask_rule.h's and
// query_range.h's; this header applies it.
//
// Fragments are (rows, cols) views of the accumulator; coord is the identity
// tensor partitioned the same way, giving each element's (row, col) in the tile.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

#include "common/mask_rule.h"
#include "cuda/core/query_range.h"

namespace flash {

using namespace cute;

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
// col). A key's visible query rows form one interval too (query_range.h),
// which also hides the query rows past seqlen_q.
template <typename TensorS, typename TensorC>
__forceinline__ __device__ void apply_mask_transposed(TensorS& scores, const TensorC& coord,
                                                      int key_base, int query_base, int seqlen_q,
                                                      int seqlen_k, int window_left,
                                                      int window_right) {
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

// apply_mask_transposed with each column's place taken as its offset from
// the thread's first column, a compile-time constant, against per-row bounds
// moved by that first column: one compare with an immediate per element and
// no register per column. Where each column's index was computed once for
// both rows, the Hopper backward's 128-query tiles held 32 of them through
// the mask, its register peak (bwd_mainloop_sm90.h).
template <typename TensorS, typename TensorC>
__forceinline__ __device__ void apply_mask_transposed_by_offset(TensorS& scores,
                                                                const TensorC& coord, int key_base,
                                                                int query_base, int seqlen_q,
                                                                int seqlen_k, int window_left,
                                                                int window_right) {
  const int query0 = get<1>(coord(0, 0));
  CUTE_UNROLL
  for (int mi = 0; mi < size<0>(scores); ++mi) {
    const int key = key_base + get<0>(coord(mi, 0));
    const QueryRange visible =
        visible_query_range(key, key + 1, seqlen_q, seqlen_k, window_left, window_right);
    const int offset_lo = visible.begin - query_base - query0;
    const int offset_hi = visible.end - query_base - query0;
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(scores); ++ni) {
      const int offset = get<1>(coord(0, ni)) - query0;
      if (offset < offset_lo || offset >= offset_hi) scores(mi, ni) = -INFINITY;
    }
  }
}

}  // namespace flash
