// The backward pass walks the mask from the key side: a thread block owns a
// key block and needs the query rows that see at least one of its keys. This
// is the inverse of visible_key_range (../common/mask_rule.h), derived from
// the same rule: row i sees key j iff
//   i + seqlen_k - seqlen_q - window_left <= j <= i + seqlen_k - seqlen_q + window_right
// (a negative side unbounded).
#pragma once

#include "common/host_device.h"
#include "common/mask_rule.h"

namespace flash {

struct QueryRange {
  int begin;
  int end;
};

// Half-open row interval [begin, end) of rows that see some key of
// [col_begin, col_end) (clipped to [0, seqlen_k)), clipped to [0, seqlen_q).
// Query blocks outside it contribute nothing to this key block.
FA_HOST_DEVICE QueryRange visible_query_range(int col_begin, int col_end, int seqlen_q,
                                              int seqlen_k, int window_left, int window_right) {
  if (col_end > seqlen_k) col_end = seqlen_k;
  if (col_begin < 0) col_begin = 0;
  if (col_end <= col_begin || seqlen_q <= 0) return {0, 0};
  // key_diagonal(i) = i + diagonal_offset.
  const int diagonal_offset = key_diagonal(0, seqlen_q, seqlen_k);
  int begin = 0;
  int end = seqlen_q;
  if (window_right >= 0) {
    // The first key of the block is the easiest to see from above:
    // j <= i + offset + right  <=>  i >= j - offset - right.
    const int lo = col_begin - diagonal_offset - window_right;
    begin = lo > 0 ? lo : 0;
  }
  if (window_left >= 0) {
    // The last key is the easiest to see from below:
    // j >= i + offset - left  <=>  i <= j - offset + left.
    const int hi = (col_end - 1) - diagonal_offset + window_left + 1;
    end = hi < seqlen_q ? hi : seqlen_q;
  }
  if (end < begin) end = begin;
  return {begin, end};
}

}  // namespace flash
