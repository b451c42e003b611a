// Online softmax over a stream of score tiles, one state per query row that
// the thread holds. Each score row is spread over the 4 threads of a quad (the
// m16n8 accumulator gives a thread 2 columns per n8 tile), so row reductions
// finish with two xor-shuffles inside the quad.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

#include "common/sink_norm.h"
#include "cuda/core/params.h"

namespace flash {

using namespace cute;

__forceinline__ __device__ float quad_allreduce_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
  return x;
}

__forceinline__ __device__ float quad_allreduce_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  x += __shfl_xor_sync(0xffffffff, x, 2);
  return x;
}

// The row rules shared by every kernel that ends a softmax: the running max
// is kept in score units (before exp_scale_log2) and is -inf while a row has
// seen only masked keys; scaling it as 0 then leaves exp2(-inf) = 0 instead
// of NaN. A row with no visible key gets output 0 and lse +inf.
__forceinline__ __device__ float scaled_row_max(float row_max, float exp_scale_log2) {
  return row_max == -INFINITY ? 0.f : row_max * exp_scale_log2;
}

__forceinline__ __device__ bool row_is_empty(float row_max, float row_sum) {
  return row_sum == 0.f || row_max == -INFINITY;
}

// Natural-log sum-exp of a row; lse_scale converts row_max back to natural
// score units.
__forceinline__ __device__ float row_lse(float row_max, float row_sum, float lse_scale) {
  return row_is_empty(row_max, row_sum) ? INFINITY : row_max * lse_scale + logf(row_sum);
}

// Attention sinks (FwdParams::learnable_sink): -inf stands for "no sink",
// which adds exp(-inf) = 0 to every denominator.
__forceinline__ __device__ float row_sink(const FwdParams& params, int head) {
  return params.learnable_sink != nullptr ? params.learnable_sink[head] : -INFINITY;
}

template <int kNRows>
struct OnlineSoftmax {
  // row_max is in score units (before exp_scale_log2); row_sum is this
  // thread's partial sum of exp over its own columns, reduced across the quad
  // only once, in finalize(): every quad member rescales by the same factor.
  float row_max[kNRows];
  float row_sum[kNRows];

  __forceinline__ __device__ OnlineSoftmax() {
    CUTE_UNROLL
    for (int i = 0; i < kNRows; ++i) {
      row_max[i] = -INFINITY;
      row_sum[i] = 0.f;
    }
  }

  // scores (rows, cols) becomes exp2(scores * exp_scale_log2 - running max),
  // and acc_o (rows, head dim) is rescaled to the new running max.
  //
  // kSkipUnmovedRescale: once a row has seen a few tiles its max rarely moves,
  // and then its correction is exactly 1 (exp2 of x - x). The rescale of
  // acc_o costs one FMUL per output element per tile, as many instructions as
  // the tile's P V MMAs at a 32-key tile, so the warp skips it when no row of
  // the warp moved. The warp vote needs every lane of the warp in the call.
  template <bool kSkipUnmovedRescale = false, typename TensorS, typename TensorO>
  __forceinline__ __device__ void update(TensorS& scores, TensorO& acc_o, float exp_scale_log2) {
    TileCorrection correction;
    float max_scaled[kNRows];
    move_row_max(scores, exp_scale_log2, correction, max_scaled);
    rescale_output<kSkipUnmovedRescale>(acc_o, correction);
    exponentiate(scores, exp_scale_log2, max_scaled);
  }

  // How acc_o must be rescaled after a tile: per row, exp2 of the old running
  // max minus the new one, and whether any row max of this thread moved.
  struct TileCorrection {
    float factor[kNRows];
    bool max_moved;
  };

  // update() without its acc_o rescale: a kernel whose previous P V is still
  // in flight on the tensor cores runs this meanwhile, and rescale_output()
  // once that product has landed.
  template <typename TensorS>
  __forceinline__ __device__ void update_scores(TensorS& scores, float exp_scale_log2,
                                                TileCorrection& correction) {
    float max_scaled[kNRows];
    move_row_max(scores, exp_scale_log2, correction, max_scaled);
    exponentiate(scores, exp_scale_log2, max_scaled);
  }

  template <bool kSkipUnmovedRescale = false, typename TensorO>
  __forceinline__ __device__ void rescale_output(TensorO& acc_o, const TileCorrection& correction) {
    if (!kSkipUnmovedRescale || __any_sync(0xffffffffu, correction.max_moved)) {
      CUTE_UNROLL
      for (int mi = 0; mi < kNRows; ++mi) {
        CUTE_UNROLL
        for (int di = 0; di < size<1>(acc_o); ++di) acc_o(mi, di) *= correction.factor[mi];
      }
    }
  }

  // The max of row mi of this thread's scores and init, over four
  // independent chains: one chain is a dependent max per column (32 deep at
  // 128 keys) before the row's exponentials can start, four are 8 + 2 deep,
  // as FA4's row max. Measured level with one chain on the H200 (PERF_LOG
  // 2026-11-29 "candidate6 ba28c77"): kept as the shorter path. A max is exact,
  // so the result does not depend on the order; a NaN score is passed over as
  // before (fmaxf returns the other operand, and no chain starts at NaN).
  template <typename TensorS>
  __forceinline__ __device__ static float thread_row_max(const TensorS& scores, int mi,
                                                         float init) {
    constexpr int kCols = decltype(size<1>(scores))::value;
    // Short rows (the SM80 tiles of 32 keys: 8 columns) keep one chain: four
    // gained little there and spilled 12 more bytes in the d128 extras kernel.
    constexpr int kChains = kCols >= 16 && kCols % 4 == 0 ? 4 : 1;
    float chain[kChains];
    CUTE_UNROLL
    for (int c = 0; c < kChains; ++c) chain[c] = init;
    CUTE_UNROLL
    for (int ni = 0; ni < kCols; ++ni) {
      chain[ni % kChains] = fmaxf(chain[ni % kChains], scores(mi, ni));
    }
    CUTE_UNROLL
    for (int c = 1; c < kChains; ++c) chain[0] = fmaxf(chain[0], chain[c]);
    return chain[0];
  }

  // The running max takes in the tile; the row sums follow it.
  template <typename TensorS>
  __forceinline__ __device__ void move_row_max(const TensorS& scores, float exp_scale_log2,
                                               TileCorrection& correction,
                                               float (&max_scaled)[kNRows]) {
    static_assert(decltype(size<0>(scores))::value == kNRows);
    correction.max_moved = false;
    CUTE_UNROLL
    for (int mi = 0; mi < kNRows; ++mi) {
      float tile_max = thread_row_max(scores, mi, row_max[mi]);
      tile_max = quad_allreduce_max(tile_max);
      correction.max_moved |= tile_max != row_max[mi];
      max_scaled[mi] = scaled_row_max(tile_max, exp_scale_log2);
      correction.factor[mi] = exp2f(row_max[mi] * exp_scale_log2 - max_scaled[mi]);
      row_max[mi] = tile_max;
      row_sum[mi] *= correction.factor[mi];
    }
  }

  // Scores become exp2(score * exp_scale_log2 - running max); their sum joins
  // the row sums.
  template <typename TensorS>
  __forceinline__ __device__ void exponentiate(TensorS& scores, float exp_scale_log2,
                                               const float (&max_scaled)[kNRows]) {
    CUTE_UNROLL
    for (int mi = 0; mi < kNRows; ++mi) {
      float tile_sum = 0.f;
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(scores); ++ni) {
        const float p = exp2f(scores(mi, ni) * exp_scale_log2 - max_scaled[mi]);
        scores(mi, ni) = p;
        tile_sum += p;
      }
      row_sum[mi] += tile_sum;
    }
  }

  // Normalises acc_o and returns each row's lse (row_lse). out_rescale
  // carries the dropout 1/(1-p). sink: the head's attention sink, or -inf;
  // a call without one keeps the plain path, whose results the sink path
  // would only reproduce through extra exps.
  template <typename TensorO>
  __forceinline__ __device__ void finalize(TensorO& acc_o, float lse_scale, float out_rescale,
                                           float (&lse)[kNRows], float sink = -INFINITY) {
    CUTE_UNROLL
    for (int mi = 0; mi < kNRows; ++mi) {
      const float sum = quad_allreduce_sum(row_sum[mi]);
      float inv_sum;
      if (sink == -INFINITY) {
        inv_sum = row_is_empty(row_max[mi], sum) ? 0.f : out_rescale / sum;
        lse[mi] = row_lse(row_max[mi], sum, lse_scale);
      } else {
        const RowNorm norm = row_norm_with_sink(row_max[mi] * lse_scale, sum,
                                                row_is_empty(row_max[mi], sum), sink, out_rescale);
        inv_sum = norm.out_scale;
        lse[mi] = norm.lse;
      }
      CUTE_UNROLL
      for (int di = 0; di < size<1>(acc_o); ++di) acc_o(mi, di) *= inv_sum;
    }
  }
};

}  // namespace flash
