// FP8 (float8_e4m3fn) semantics, one definition for the CPU path and the
// CUDA kernels (docs/fp8.md):
//   * an fp8 input element x of batch entry b and kv head g stands for the
//     real value x * descale[b, g] (dequantisation, fp32); a query head
//     reads the descale of its kv head;
//   * a 16-bit key or value appended into an fp8 cache is stored as the
//     e4m3 value nearest (ties to even) to value / descale[b, g], that
//     quotient taken in fp32 and first saturated to [-448, 448], so a value
//     past the range stores the largest finite e4m3 of its sign, never NaN
//     (torch's own conversion saturates in some versions and not in others;
//     saturating first makes the result the same everywhere). NaN stays NaN.
// The rounding to e4m3 itself is the caller's (c10::Float8_e4m3fn on the CPU,
// a saturating cvt on the GPU): both are round-to-nearest-even on the value
// returned here, which is already in range.
#pragma once

#include "common/host_device.h"

namespace flash {

// The largest finite float8_e4m3fn.
constexpr float kE4m3Max = 448.f;

FA_HOST_DEVICE float fp8_dequantize(float stored, float descale) { return stored * descale; }

// value / descale saturated to the e4m3 range; NaN passes through (both
// comparisons are false).
FA_HOST_DEVICE float fp8_scaled_for_store(float value, float descale) {
  const float scaled = value / descale;
  if (scaled > kE4m3Max) return kE4m3Max;
  if (scaled < -kE4m3Max) return -kE4m3Max;
  return scaled;
}

// Where the descale of (batch entry b, kv head g) lives: any strides (an
// expanded (batch, nheads_k) tensor of one value has strides 0). values null:
// descale 1.
struct Fp8Descale {
  const float* values = nullptr;
  long long batch_stride = 0;
  long long head_stride = 0;

  FA_HOST_DEVICE float at(long long b, long long kv_head) const {
    return values == nullptr ? 1.f : values[b * batch_stride + kv_head * head_stride];
  }
};

}  // namespace flash
