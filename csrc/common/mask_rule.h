// The one definition of which keys a query row sees, and of the ALiBi bias.
// Forward, backward, CPU and CUDA all call these; tests/reference.py restates
// the same rule independently in float64.
#pragma once

#include <cstdint>

#include "common/host_device.h"

namespace flash {

// Causal and local windows are one rule, aligned to the bottom-right corner of
// the (seqlen_q x seqlen_k) score matrix: row i sits on key diagonal
// i + seqlen_k - seqlen_q. A negative window side is unbounded. Causal is
// (window_left = -1, window_right = 0).
FA_HOST_DEVICE int key_diagonal(int row, int seqlen_q, int seqlen_k) {
  return row + seqlen_k - seqlen_q;
}

FA_HOST_DEVICE bool key_visible(int row, int col, int seqlen_q, int seqlen_k, int window_left,
                                int window_right) {
  const int diag = key_diagonal(row, seqlen_q, seqlen_k);
  return col >= 0 && col < seqlen_k && (window_left < 0 || col >= diag - window_left) &&
         (window_right < 0 || col <= diag + window_right);
}

// Half-open key interval [begin, end) that rows [row_begin, row_end) can see,
// clipped to [0, seqlen_k). Key blocks outside it are skipped, never masked.
struct KeyRange {
  int begin;
  int end;
};

FA_HOST_DEVICE KeyRange visible_key_range(int row_begin, int row_end, int seqlen_q, int seqlen_k,
                                          int window_left, int window_right) {
  int begin = 0;
  int end = seqlen_k;
  if (window_left >= 0) {
    const int lo = key_diagonal(row_begin, seqlen_q, seqlen_k) - window_left;
    begin = lo > 0 ? lo : 0;
  }
  if (window_right >= 0) {
    const int hi = key_diagonal(row_end - 1, seqlen_q, seqlen_k) + window_right + 1;
    end = hi < seqlen_k ? hi : seqlen_k;
  }
  if (end < begin) end = begin;
  return {begin, end};
}

// True when every (row, col) of the tile [row_begin, row_end) x [col_begin, col_end)
// is visible, so the tile can skip the per-element mask. Tiles on a window edge
// or past seqlen_k return false.
FA_HOST_DEVICE bool key_tile_fully_visible(int row_begin, int row_end, int col_begin, int col_end,
                                           int seqlen_q, int seqlen_k, int window_left,
                                           int window_right) {
  if (col_end > seqlen_k) return false;
  if (window_right >= 0 &&
      col_end - 1 > key_diagonal(row_begin, seqlen_q, seqlen_k) + window_right) {
    return false;
  }
  if (window_left >= 0 && col_begin < key_diagonal(row_end - 1, seqlen_q, seqlen_k) - window_left) {
    return false;
  }
  return true;
}

// ALiBi adds -slope * |i + seqlen_k - seqlen_q - j| to the (softcapped) score.
FA_HOST_DEVICE float alibi_bias(float slope, int row, int col, int seqlen_q, int seqlen_k) {
  const int dist = key_diagonal(row, seqlen_q, seqlen_k) - col;
  return -slope * static_cast<float>(dist < 0 ? -dist : dist);
}

}  // namespace flash
