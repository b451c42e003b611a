// The row statistics (lse, D) of a query block as the Hopper backward's MMA
// threads read them in 128-row query blocks (d64, bwd_tile_config.h): per
// column of their (key, query) fragments of S^T and dP^T.
//
// Read from shared memory per column (what the 64-row kernels do,
// bwd_pointwise.h's scores_to_p_transposed), the 32 query columns a thread
// holds at 128 rows become 32 lse and 32 D loads that ptxas issues ahead of
// the exponentials and holds beside the 192 accumulator registers of S^T,
// dP^T, dK and dV: 128 rows spilled (PERF_LOG 2026-11-24 ee3e75a, and again
// at the dq-d64 base: 52 B stores, 72 B loads). Here each lane holds its
// share of them instead, and a shuffle fetches each column's value from the
// lane that holds it when it is used: 4 lse and 4 D registers per thread.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

#include "cuda/bwd/bwd_pointwise.h"
#include "cuda/core/score_mods.h"

namespace flash {

using namespace cute;

// The statistics of a query block of kBlockM rows, shared among the 8 lanes
// of a warp whose wgmma accumulator fragments hold the same columns.
//
// A thread of a (64 keys, kBlockM queries) wgmma accumulator holds the
// queries 8 j + 2 q + c, for its lane's q = lane % 4, each 8-column group j
// of the kBlockM / 8 and c in {0, 1}; in (ROW,COL) order
// (wgmma_acc_layout_as_rowcol) column ni is c = ni % 2, j = ni / 2. The 8
// lanes of a q (lane / 4 = r in 0 .. 7) hold the same columns: lane r keeps
// those of the groups j = r + 8 h, kHeld of them, both columns c. A column's
// value is then in lane (j % 8) * 4 + q, register 2 (j / 8) + c.
template <int kBlockM>
struct BwdSm90ShuffledRowStats {
  static constexpr int kGroups = kBlockM / 8;
  static_assert(kGroups % 8 == 0, "each of 8 lanes holds whole groups");
  static constexpr int kHeld = kGroups / 8;
  static constexpr int kValues = 2 * kHeld;

  float lse_log2_held[kValues];  // lse * log2(e) (lse_to_log2)
  float d_held[kValues];

  // block_lse_log2, block_d: the query block's lse (log2 units) and D in
  // shared memory, one per query row. Loads every held value (load_all) or,
  // with kLazy, none: the caller loads each held group (load_held) before its
  // columns, so that only one group's values are live at a time.
  template <bool kLazy = false>
  __forceinline__ __device__ BwdSm90ShuffledRowStats(const float* block_lse_log2_,
                                                     const float* block_d_, int lane,
                                                     cute::bool_constant<kLazy> = {})
      : block_lse_log2(block_lse_log2_),
        block_d(block_d_),
        first_col(8 * (lane / 4) + 2 * (lane % 4)) {
    if constexpr (!kLazy) {
      for_each(make_seq<kHeld>{}, [&](auto h) { load_held(h); });
    }
  }

  // The values of held group h: the columns of groups j = lane / 4 + 8 h.
  template <int kH>
  __forceinline__ __device__ void load_held(Int<kH>) {
    static_assert(kH >= 0 && kH < kHeld);
    CUTE_UNROLL
    for (int c = 0; c < 2; ++c) {
      const int col = first_col + 64 * kH + c;
      lse_log2_held[2 * kH + c] = block_lse_log2[col];
      d_held[2 * kH + c] = block_d[col];
    }
  }

  // The lse (log2 units) and D of (ROW,COL) column ni.
  template <int kNi>
  __forceinline__ __device__ float lse_log2(Int<kNi>) const {
    return from_lane<kNi>(lse_log2_held[held_index(kNi)]);
  }
  template <int kNi>
  __forceinline__ __device__ float d(Int<kNi>) const {
    return from_lane<kNi>(d_held[held_index(kNi)]);
  }

 private:
  const float* block_lse_log2;
  const float* block_d;
  const int first_col;  // 8 (lane / 4) + 2 (lane % 4): group lane / 4, column c = 0

  static constexpr int held_index(int ni) { return 2 * (ni / 2 / 8) + ni % 2; }

  // value as held by lane (j % 8) * 4 + this lane's q: a shuffle whose
  // segment mask keeps the source lane's low two bits (q) from this lane and
  // takes bits 2-4 from the immediate, so no lane index is computed
  // (PTX shfl.sync: j = (lane & segmask) | (b & ~segmask); c = segmask << 8 |
  // clamp, the clamp 31 never binding).
  template <int kNi>
  static __forceinline__ __device__ float from_lane(float value) {
    static_assert(kNi >= 0 && kNi < 2 * kGroups);
    constexpr int kSourceHigh = (kNi / 2 % 8) * 4;
    float out;
    asm volatile("shfl.sync.idx.b32 %0, %1, %2, 0x31f, 0xffffffff;"
                 : "=f"(out)
                 : "f"(value), "n"(kSourceHigh));
    return out;
  }
};

// scores_to_p_transposed (bwd_pointwise.h) with the statistics shuffled in.
template <typename TensorS, typename RowStats>
__forceinline__ __device__ void scores_to_p_transposed_shuffled(TensorS& scores,
                                                                const RowStats& stats,
                                                                float exp_scale_log2) {
  constexpr int kNCols = decltype(size<1>(scores))::value;
  static_assert(kNCols == 2 * RowStats::kGroups, "a thread's columns of the query block");
  for_each(make_seq<kNCols>{}, [&](auto ni) {
    const float lse_log2 = stats.lse_log2(ni);
    CUTE_UNROLL
    for (int mi = 0; mi < size<0>(scores); ++mi) {
      scores(mi, ni) = exp2f(fmaf(scores(mi, ni), exp_scale_log2, -lse_log2));
    }
  });
}

// p_to_ds_transposed (bwd_pointwise.h) with the statistics shuffled in.
template <typename TensorP, typename TensorDP, typename RowStats>
__forceinline__ __device__ void p_to_ds_transposed_shuffled(const TensorP& p, TensorDP& dp,
                                                            const RowStats& stats) {
  constexpr int kNCols = decltype(size<1>(dp))::value;
  static_assert(kNCols == 2 * RowStats::kGroups, "a thread's columns of the query block");
  for_each(make_seq<kNCols>{}, [&](auto ni) {
    const float d = stats.d(ni);
    CUTE_UNROLL
    for (int mi = 0; mi < size<0>(dp); ++mi) dp(mi, ni) = p(mi, ni) * (dp(mi, ni) - d);
  });
}

// softcapped_p_and_ds_transposed (bwd_pointwise.h) with the statistics
// shuffled in, for the kWithScoreMods variant with softcap (kSoftcap) or
// without (the plain rule, dS^T = P^T (dP^T - D), ALiBi or not), once dP^T
// has landed, writing P^T and dS^T straight into their 16-bit operand
// registers (p_out, ds_out: (ROW,COL) views of them), two neighbouring
// columns (one register) at a time. Where the fp32 results waited for one
// conversion after the pass, they spilled beside S^T, dP^T, dK and dV at 128
// query rows; so each column pair's inputs die as its outputs, half the
// size, are made. The caller picks kSoftcap once per query block: a test
// per element kept the loop's values live on both sides and spilled.
// stats: constructed lazily; the pass loads each held group before its
// columns.
template <bool kSoftcap, typename TensorS, typename TensorDP, typename TensorOut, typename TensorC,
          typename RowStats>
__forceinline__ __device__ void score_mods_p_and_ds_transposed_shuffled(
    const TensorS& scores, const TensorDP& dp, TensorOut& p_out, TensorOut& ds_out,
    const TensorC& tScS_rowcol, int key_base, int query_base, int seqlen_q, int seqlen_k,
    RowStats& stats, const ScoreModsInUnits& score_mods) {
  using Element = typename TensorOut::value_type;
  const float exp_scale_log2 = score_mods.exp_scale_log2();
  constexpr int kNKeys = decltype(size<0>(scores))::value;
  constexpr int kNCols = decltype(size<1>(scores))::value;
  static_assert(kNCols == 2 * RowStats::kGroups, "a thread's columns of the query block");
  CUTE_STATIC_ASSERT_V(size(p_out) == size(scores) && size(ds_out) == size(dp));
  float key_distance[kNKeys];
  CUTE_UNROLL
  for (int mi = 0; mi < kNKeys; ++mi) {
    key_distance[mi] =
        alibi_key_distance(tScS_rowcol, mi, key_base, query_base, seqlen_q, seqlen_k);
  }
  cutlass::NumericArrayConverter<Element, float, 2> to_pair;
  for_each(make_seq<kNCols / 2>{}, [&](auto j) {
    constexpr int kNi0 = 2 * decltype(j)::value;
    if constexpr (decltype(j)::value % 8 == 0) stats.load_held(Int<decltype(j)::value / 8>{});
    const float lse_log2[2] = {stats.lse_log2(Int<kNi0>{}), stats.lse_log2(Int<kNi0 + 1>{})};
    const float d[2] = {stats.d(Int<kNi0>{}), stats.d(Int<kNi0 + 1>{})};
    CUTE_UNROLL
    for (int mi = 0; mi < kNKeys; ++mi) {
      cutlass::Array<float, 2> p, ds;
      CUTE_UNROLL
      for (int c = 0; c < 2; ++c) {
        const float kept = scores(mi, kNi0 + c);
        p[c] = exp2f(fmaf(kept, exp_scale_log2, -lse_log2[c]));
        ds[c] = p[c] * (dp(mi, kNi0 + c) - d[c]);
        if constexpr (kSoftcap) {
          // The tanh is the kept score less the ALiBi bias (as
          // softcapped_p_and_ds_transposed recomputes it).
          float tanh_value = kept;
          if (score_mods.has_alibi) {
            tanh_value =
                fmaf(score_mods.alibi_slope,
                     fabsf(key_distance[mi] + alibi_query_offset(tScS_rowcol, kNi0 + c)), kept);
          }
          // A masked score (-inf) has p = 0 and no tanh: its dS is 0, not NaN.
          ds[c] *= p[c] > 0.f ? fmaf(-tanh_value, tanh_value, 1.f) : 0.f;
        }
      }
      const cutlass::Array<Element, 2> p_pair = to_pair(p);
      const cutlass::Array<Element, 2> ds_pair = to_pair(ds);
      p_out(mi, kNi0) = p_pair[0];
      p_out(mi, kNi0 + 1) = p_pair[1];
      ds_out(mi, kNi0) = ds_pair[0];
      ds_out(mi, kNi0 + 1) = ds_pair[1];
    }
  });
}

}  // namespace flash
