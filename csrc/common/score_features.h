// Which parts of the score rule a call turns on, each decided here once: the
// plans pick kernel variants by them, the launchers check the plan against
// them, and the CUDA kernels and the CPU path apply the rule by them.
#pragma once

#include <cfloat>

#include "common/host_device.h"

namespace flash {

// Whether softcap is on (s = softcap * tanh(s / softcap)); 0 disables it. The
// op checks refuse a negative softcap, except fwd_kvcache's, which takes it
// as off: every use of the value sits behind this test.
FA_HOST_DEVICE bool softcap_on(float softcap) { return softcap > 0.f; }

// Whether the plain score rule may fold the softmax scale into the exp2
// multiplier: it tracks each row's max of the raw scores, which is the max
// of the scaled ones only for a positive scale, and its exp2 lets a masked
// -inf become 0 untested, which a scale the device flushes to 0 would make
// NaN. Any other scale (a negative one is legal) takes the kernels'
// variants that scale each score first (the score-extras variants).
FA_HOST_DEVICE bool scale_is_positive_normal(float softmax_scale_log2) {
  return softmax_scale_log2 >= FLT_MIN;
}

// A negative normal scale: the Hopper kernels' kWithScoreMods variants keep
// such scores negated, in units of |scale| (ScoreModsInUnits,
// cuda/core/score_mods.h), so that their running max is the max of the
// scaled scores again and a masked score stays -inf.
FA_HOST_DEVICE bool scale_is_negative_normal(float softmax_scale_log2) {
  return softmax_scale_log2 <= -FLT_MIN;
}

// The score rule of a call, as the kernel variants divide it.
struct ScoreFeatures {
  bool softcap;
  bool alibi;
  bool dropout;
  bool scale_positive_normal;
  bool scale_negative_normal;

  // Softcap or ALiBi: the Hopper kernels' kWithScoreMods variants.
  FA_HOST_DEVICE bool has_mods() const { return softcap || alibi; }
  // The Hopper kernels' kWithScoreMods variants also draw dropout (one
  // instantiation fewer per head dim than a variant of its own,
  // docs/dropout_sm90.md), at the tiles with registers to spare for it
  // (plan.h fwd_sm90_draws_dropout, bwd_sm90_draws_dropout), and take a
  // negative scale.
  FA_HOST_DEVICE bool has_sm90_mods() const {
    return has_mods() || dropout || scale_negative_normal;
  }
  // A scale the Hopper kernels serve: normal, of either sign. Zero,
  // subnormal, infinite and NaN scales run the SM80 general variant.
  FA_HOST_DEVICE bool sm90_scale() const { return scale_positive_normal || scale_negative_normal; }
  // Anything beyond the plain rule: the SM80 and split-KV kernels'
  // kWithScoreExtras variants.
  FA_HOST_DEVICE bool has_extras() const { return has_mods() || dropout || !scale_positive_normal; }
};

FA_HOST_DEVICE ScoreFeatures score_features(float softcap, bool alibi, float dropout_p,
                                            float softmax_scale_log2) {
  return {softcap_on(softcap), alibi, dropout_p > 0.f, scale_is_positive_normal(softmax_scale_log2),
          scale_is_negative_normal(softmax_scale_log2)};
}

}  // namespace flash
