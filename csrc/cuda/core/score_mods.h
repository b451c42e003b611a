// What happens to a tile of raw Q K^T scores before the softmax, in contract
// order: scale, softcap, ALiBi, then the causal / local / bounds mask
// (mask.h). The ALiBi distance lives in common/mask_rule.h; this header
// applies it to a thread's fragment.
//
// Fragments are (rows, cols) views of the accumulator; coord is the identity
// tensor partitioned the same way, giving each element's (row, col) in the tile.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

#include "common/mask_rule.h"
#include "common/score_features.h"

namespace flash {

using namespace cute;

// s = softcap * tanh(s * scale / softcap), or s * scale when softcap is 0:
// either way the scores leave in natural (scaled) units.
template <typename TensorS>
__forceinline__ __device__ void apply_scale_and_softcap(TensorS& scores, float softmax_scale,
                                                        float softcap) {
  if (softcap_on(softcap)) {
    const float pre = softmax_scale / softcap;
    CUTE_UNROLL
    for (int i = 0; i < size(scores); ++i) scores(i) = softcap * tanhf(scores(i) * pre);
  } else {
    CUTE_UNROLL
    for (int i = 0; i < size(scores); ++i) scores(i) *= softmax_scale;
  }
}

// alibi_bias over a fragment, as two float operations per element: each
// row's distance to the thread's first column (integer, then float) less
// each column's offset from it, and one FFMA with |.| and the slope. The
// offsets are compile-time constants (the partition's layout is static;
// only its origin depends on the thread), so no float per column stays live
// across tiles. The same values as alibi_bias while distances stay below
// 2^24 keys (exact floats), rounded the same way past that.
template <typename TensorS, typename TensorC>
__forceinline__ __device__ void apply_alibi(TensorS& scores, const TensorC& coord, int row_base,
                                            int col_base, float slope, int seqlen_q, int seqlen_k) {
  const int col0 = get<1>(coord(0, 0));
  CUTE_UNROLL
  for (int mi = 0; mi < size<0>(scores); ++mi) {
    const int row = row_base + get<0>(coord(mi, 0));
    const float row_distance =
        static_cast<float>(key_diagonal(row, seqlen_q, seqlen_k) - (col_base + col0));
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(scores); ++ni) {
      const float col_offset = static_cast<float>(get<1>(coord(0, ni)) - col0);
      scores(mi, ni) = fmaf(-slope, fabsf(row_distance - col_offset), scores(mi, ni));
    }
  }
}

// The same bias on a transposed tile, as the Hopper backward holds S^T:
// rows are keys, columns query rows. The ALiBi distance of element (mi, ni)
// is |alibi_key_distance(mi) + alibi_query_offset(ni)|: a key row's distance
// to the thread's first query row, plus each query's constant offset from
// it (softcapped_p_and_ds_transposed recomputes the bias the same way).
template <typename TensorC>
__forceinline__ __device__ float alibi_key_distance(const TensorC& coord, int mi, int key_base,
                                                    int query_base, int seqlen_q, int seqlen_k) {
  return static_cast<float>(key_diagonal(query_base + get<1>(coord(0, 0)), seqlen_q, seqlen_k) -
                            (key_base + get<0>(coord(mi, 0))));
}

template <typename TensorC>
__forceinline__ __device__ float alibi_query_offset(const TensorC& coord, int ni) {
  return static_cast<float>(get<1>(coord(0, ni)) - get<1>(coord(0, 0)));
}

template <typename TensorS, typename TensorC>
__forceinline__ __device__ void apply_alibi_transposed(TensorS& scores, const TensorC& coord,
                                                       int key_base, int query_base, float slope,
                                                       int seqlen_q, int seqlen_k) {
  CUTE_UNROLL
  for (int mi = 0; mi < size<0>(scores); ++mi) {
    const float key_distance =
        alibi_key_distance(coord, mi, key_base, query_base, seqlen_q, seqlen_k);
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(scores); ++ni) {
      scores(mi, ni) =
          fmaf(-slope, fabsf(key_distance + alibi_query_offset(coord, ni)), scores(mi, ni));
    }
  }
}

// The Hopper kernels keep a score in units of `unit` (natural score = unit x
// kept score): the softcap when it is on, else |softmax scale|. So neither
// costs a multiply per element: the scale or the softcap goes into the exp2
// multiplier (unit x log2 e) and the lse (x unit), and ALiBi adds its bias
// divided by the unit (alibi_bias is linear in the slope). Under softcap the
// kept score is tanh(raw x scale / softcap) + bias / softcap, so the tanh
// that the softcap's derivative needs is the kept score less the bias. A
// negative scale without softcap keeps -raw (+ bias / unit): the unit stays
// positive, so the running max is the max of the natural scores and a masked
// score stays -inf (score_features.h scale_is_negative_normal).
struct ScoreModsInUnits {
  float unit;
  float tanh_prescale;  // scale / softcap; 0: no softcap
  float alibi_slope;    // slope / unit; 0: no ALiBi
  bool has_softcap;
  bool has_alibi;
  bool negates;  // a negative scale without softcap

  // alibi_slope: the call's slope for this (batch, head), when it has ALiBi.
  __forceinline__ __device__ ScoreModsInUnits(float softmax_scale, float softcap, bool alibi,
                                              float slope)
      : unit(softcap_on(softcap) ? softcap : fabsf(softmax_scale)),
        tanh_prescale(softcap_on(softcap) ? softmax_scale / softcap : 0.f),
        alibi_slope(alibi ? slope / unit : 0.f),
        has_softcap(softcap_on(softcap)),
        has_alibi(alibi),
        negates(!softcap_on(softcap) && softmax_scale < 0.f) {}

  __forceinline__ __device__ float exp_scale_log2() const { return unit * float(M_LOG2E); }

  // Raw Q K^T -> kept score, before ALiBi and the mask.
  template <typename TensorS>
  __forceinline__ __device__ void keep(TensorS& scores) const {
    if (has_softcap) {
      CUTE_UNROLL
      for (int i = 0; i < size(scores); ++i) scores(i) = tanhf(scores(i) * tanh_prescale);
    } else if (negates) {
      CUTE_UNROLL
      for (int i = 0; i < size(scores); ++i) scores(i) = -scores(i);
    }
  }
};

}  // namespace flash
