// The pointwise middle of the backward pass, on one thread's fragment of the
// (query, key) tile: recompute P from the saved lse and turn dP into dS.
//
//   P     = exp(s - lse)                       (s after scale, softcap, ALiBi, mask)
//   P_out = P * keep / (1 - p_drop)            (what O was built from: feeds dV)
//   dP'   = dP * keep / (1 - p_drop)           (gradient w.r.t. the undropped P)
//   dS    = P * (dP' - D) * (1 - tanh^2)       (tanh term only under softcap)
//
// with D = rowsum(dO * O). dS is the gradient with respect to the raw score
// q.k divided by softmax_scale; the scale is applied once to dQ and dK.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

#include "common/mask_rule.h"
#include "common/philox.h"
#include "common/score_features.h"
#include "cuda/core/dropout.h"
#include "cuda/core/score_mods.h"

namespace flash {

using namespace cute;

struct BwdPointwiseArgs {
  float exp_scale_log2;  // multiplies s before exp2: log2(e), or softmax_scale*log2(e)
  float softcap;         // 0 when off
  float inv_softcap;
  bool has_alibi;
  float alibi_slope;
  int seqlen_q;
  int seqlen_k;
  bool has_dropout;
  float dropout_rescale;
};

// The plain score rule (no softcap, no dropout), in two steps.
//
// scores (rows, cols) holds s with the mask applied (-inf where hidden) and
// becomes P; lse_log2 is per row of the fragment (+inf for rows past the
// sequence and for rows that saw no key, so their P is 0).
//
// kScaleIsPositive (exp_scale_log2 positive and normal, so that flushing
// denormals cannot make it 0: the caller's runtime promise) lets a
// masked -inf flow through exp2 to 0 (-inf * scale - lse is -inf, lse being
// finite or +inf) instead of being tested per element; the test plus the
// predicated exp cost ~2 extra instructions per element in the hot loop.
// Otherwise the test stays: a negative scale would turn -inf into +inf, and
// a zero scale into NaN.
template <bool kScaleIsPositive = false, int kNRows, typename TensorS>
__forceinline__ __device__ void scores_to_p(TensorS& scores, const float (&lse_log2)[kNRows],
                                            float exp_scale_log2) {
  static_assert(decltype(size<0>(scores))::value == kNRows);
  CUTE_UNROLL
  for (int mi = 0; mi < kNRows; ++mi) {
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(scores); ++ni) {
      const float s = scores(mi, ni);
      const float p = exp2f(fmaf(s, exp_scale_log2, -lse_log2[mi]));
      scores(mi, ni) = kScaleIsPositive || s != -INFINITY ? p : 0.f;
    }
  }
}

// dp holds dO V^T and becomes dS = P * (dP - D).
template <int kNRows, typename TensorP, typename TensorDP>
__forceinline__ __device__ void p_to_ds(const TensorP& p, TensorDP& dp,
                                        const float (&row_d)[kNRows]) {
  static_assert(decltype(size<0>(dp))::value == kNRows);
  CUTE_UNROLL
  for (int mi = 0; mi < kNRows; ++mi) {
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(dp); ++ni) dp(mi, ni) = p(mi, ni) * (dp(mi, ni) - row_d[mi]);
  }
}

// lse * log2(e) for exp2. A row that saw no key has lse +inf from our forward;
// -inf (the other convention for an empty sum) is taken as +inf too, so that
// its masked -inf scores give P = 0, not NaN.
__forceinline__ __device__ float lse_to_log2(float lse) {
  return lse == -INFINITY ? INFINITY : lse * float(M_LOG2E);
}

// A per-column statistic of a transposed (key, query) fragment, as the Hopper
// kernels hold S^T and dP^T: the query block's lse (in log2 units,
// lse_to_log2, as the Hopper statistics warp stores it) or D, one per query
// row in shared memory, read into registers (stats: (COL)) at each column's
// query row, which tScS_rowcol gives (the (key, query) coordinates of every
// element); columns [kBegin, kEnd) only, so that a caller can read the first
// ones earlier than the rest.
template <int kBegin, int kEnd, typename TensorC, typename TensorStats>
__forceinline__ __device__ void load_column_stats(const float* block_stats,
                                                  const TensorC& tScS_rowcol, TensorStats& stats) {
  static_assert(0 <= kBegin && kBegin <= kEnd, "a range of columns");
  CUTE_STATIC_ASSERT_V(size(stats) == size<1>(tScS_rowcol));
  CUTE_STATIC_ASSERT_V(Int<kEnd>{} <= size(stats));
  CUTE_UNROLL
  for (int ni = kBegin; ni < kEnd; ++ni) stats(ni) = block_stats[get<1>(tScS_rowcol(0, ni))];
}

// The plain score rule on a transposed (key, query) fragment: lse_log2 holds
// each column's lse (load_column_stats). Only a positive normal scale
// comes here (the launcher's promise), so, as with kScaleIsPositive above, a
// masked -inf score reaches exp2 as -inf and gives 0.
template <typename TensorS, typename TensorStats>
__forceinline__ __device__ void scores_to_p_transposed(TensorS& scores, const TensorStats& lse_log2,
                                                       float exp_scale_log2) {
  CUTE_STATIC_ASSERT_V(size<1>(scores) == size(lse_log2));
  CUTE_UNROLL
  for (int ni = 0; ni < size<1>(scores); ++ni) {
    CUTE_UNROLL
    for (int mi = 0; mi < size<0>(scores); ++mi) {
      scores(mi, ni) = exp2f(fmaf(scores(mi, ni), exp_scale_log2, -lse_log2(ni)));
    }
  }
}

// dp holds dP^T = V dO^T and becomes dS^T = P^T * (dP^T - D), D per column
// (load_column_stats).
template <typename TensorP, typename TensorDP, typename TensorStats>
__forceinline__ __device__ void p_to_ds_transposed(const TensorP& p, TensorDP& dp,
                                                   const TensorStats& d) {
  CUTE_STATIC_ASSERT_V(size<1>(dp) == size(d));
  CUTE_UNROLL
  for (int ni = 0; ni < size<1>(dp); ++ni) {
    CUTE_UNROLL
    for (int mi = 0; mi < size<0>(dp); ++mi) dp(mi, ni) = p(mi, ni) * (dp(mi, ni) - d(ni));
  }
}

// Softcap (with or without ALiBi) on a transposed (key, query) fragment,
// as the Hopper backward's kWithScoreMods variant runs it, once both
// products have landed: scores holds the kept scores of ScoreModsInUnits
// (score_mods.h; tanh + bias / softcap, -inf where masked) and becomes P^T;
// dp holds dP^T and becomes dS^T = P^T * (dP^T - D) * (1 - tanh^2), the tanh
// being the kept score less the bias (apply_alibi_transposed's arithmetic).
// The statistics are per column, in registers, as in scores_to_p_transposed.
template <typename TensorS, typename TensorDP, typename TensorC, typename TensorStats>
__forceinline__ __device__ void softcapped_p_and_ds_transposed(
    TensorS& scores, TensorDP& dp, const TensorC& tScS_rowcol, int key_base, int query_base,
    int seqlen_q, int seqlen_k, const TensorStats& lse_log2_cols, const TensorStats& d_cols,
    const ScoreModsInUnits& score_mods) {
  const float exp_scale_log2 = score_mods.exp_scale_log2();
  // The ALiBi distances as apply_alibi_transposed makes them.
  constexpr int kNKeys = decltype(size<0>(scores))::value;
  float key_distance[kNKeys];
  CUTE_UNROLL
  for (int mi = 0; mi < kNKeys; ++mi) {
    key_distance[mi] =
        alibi_key_distance(tScS_rowcol, mi, key_base, query_base, seqlen_q, seqlen_k);
  }
  CUTE_UNROLL
  for (int ni = 0; ni < size<1>(scores); ++ni) {
    const float lse_log2 = lse_log2_cols(ni);
    const float d = d_cols(ni);
    CUTE_UNROLL
    for (int mi = 0; mi < size<0>(scores); ++mi) {
      const float kept = scores(mi, ni);
      const float p = exp2f(fmaf(kept, exp_scale_log2, -lse_log2));
      float tanh_value = kept;
      if (score_mods.has_alibi) {
        tanh_value = fmaf(score_mods.alibi_slope,
                          fabsf(key_distance[mi] + alibi_query_offset(tScS_rowcol, ni)), kept);
      }
      // A masked score (-inf) has p = 0 and no tanh: its dS is 0, not NaN.
      const float dtanh = p > 0.f ? fmaf(-tanh_value, tanh_value, 1.f) : 0.f;
      scores(mi, ni) = p;
      dp(mi, ni) = p * (dp(mi, ni) - d) * dtanh;
    }
  }
}

// The full score rule, after both GEMMs: scores (rows, cols) holds s with the
// mask applied (-inf where hidden) and becomes P_out; dp holds dO V^T and
// becomes dS. lse_log2 / row_d are per row of the fragment (+inf / 0 for rows
// past the sequence, so their P is 0).
template <int kNRows, typename TensorS, typename TensorDP, typename TensorC>
__forceinline__ __device__ void scores_to_p_and_ds(TensorS& scores, TensorDP& dp,
                                                   const TensorC& coord, int row_base, int col_base,
                                                   const float (&lse_log2)[kNRows],
                                                   const float (&row_d)[kNRows],
                                                   const BwdPointwiseArgs& args,
                                                   const DropoutState& dropout) {
  static_assert(decltype(size<0>(scores))::value == kNRows);
  static_assert(decltype(size<1, 0>(scores))::value == 2);
  // softcap is never negative here (the backward ops refuse it), so 0 is
  // softcap_on's "off". Tested as == 0, the slow path below stays one loop;
  // as !softcap_on, the compiler splits it in two and the d128 score-extras
  // kernel needs 344 bytes of stack instead of 128 (PERF_LOG 2026-11-28).
  if (!args.has_dropout && args.softcap == 0.f) {
    scores_to_p(scores, lse_log2, args.exp_scale_log2);
    p_to_ds(scores, dp, row_d);
    return;
  }
  CUTE_UNROLL
  for (int mi = 0; mi < kNRows; ++mi) {
    const int row = row_base + get<0>(coord(mi, 0));
    CUTE_UNROLL
    for (int nj = 0; nj < size<1, 1>(scores); ++nj) {
      const int col0 = col_base + get<1>(coord(0, make_coord(0, nj)));
      // One Philox draw covers this thread's column pair (col0 is even), the
      // same draw the forward made for these elements.
      PhiloxOut bits{};
      if (args.has_dropout) {
        bits = dropout_random_bits(dropout.seed, dropout.offset, dropout.batch, dropout.head,
                                   dropout.nheads, row, col0);
      }
      CUTE_UNROLL
      for (int j = 0; j < 2; ++j) {
        const int col = col0 + j;
        const float s = scores(mi, make_coord(j, nj));
        const float p = s == -INFINITY ? 0.f : exp2f(fmaf(s, args.exp_scale_log2, -lse_log2[mi]));
        float p_out = p;
        float dp_kept = dp(mi, make_coord(j, nj));
        if (args.has_dropout) {
          const bool keep = dropout_keep(bits, col, dropout.threshold);
          p_out = keep ? p * args.dropout_rescale : 0.f;
          dp_kept = keep ? dp_kept * args.dropout_rescale : 0.f;
        }
        float ds = p * (dp_kept - row_d[mi]);
        if (softcap_on(args.softcap) && p > 0.f) {
          // s = softcap * tanh(.) + alibi: recover tanh from s rather than
          // keeping a second score tile in registers.
          float capped = s;
          if (args.has_alibi) {
            capped -= alibi_bias(args.alibi_slope, row, col, args.seqlen_q, args.seqlen_k);
          }
          const float tanh_value = capped * args.inv_softcap;
          ds *= 1.f - tanh_value * tanh_value;
        }
        scores(mi, make_coord(j, nj)) = p_out;
        dp(mi, make_coord(j, nj)) = ds;
      }
    }
  }
}

}  // namespace flash
