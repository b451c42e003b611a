// e4m3 (cutlass::float_e4m3_t) conversions of the kernels that read and
// append to an FP8 KV cache (docs/fp8.md). Every e4m3 value is a float16 and
// a bfloat16 value, so reading converts exactly; CUTLASS's converters issue
// cvt.rn.f16x2.e4m3x2 on sm89 and later.
#pragma once

#include <cstdint>

#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

namespace flash {

// 8 e4m3 bytes at src (8-byte aligned) to 8 Element values at dst (16-byte
// aligned), both in shared memory: one 8-byte load and one 16-byte store.
// cutlass::Array is aligned to its element only, so a load or store through
// it may be split into 2-byte pieces; a warp's split 16-byte stores cost
// 4 times the wavefronts (PERF_LOG 2026-11-30 "FP8 KV cache, measured").
template <typename Element>
__forceinline__ __device__ void convert_e4m3x8(const uint8_t* src, Element* dst) {
  using Source = cutlass::Array<cutlass::float_e4m3_t, 8>;
  using Result = cutlass::Array<Element, 8>;
  static_assert(sizeof(Source) == sizeof(uint2) && sizeof(Result) == sizeof(uint4));
  const uint2 in_bits = *reinterpret_cast<const uint2*>(src);
  Source in;
  __builtin_memcpy(&in, &in_bits, sizeof(in));
  const Result out = cutlass::NumericArrayConverter<Element, cutlass::float_e4m3_t, 8>{}(in);
  uint4 out_bits;
  __builtin_memcpy(&out_bits, &out, sizeof(out_bits));
  *reinterpret_cast<uint4*>(dst) = out_bits;
}

// 8 values of q's dtype (Element, one 16-byte chunk) as an e4m3 cache stores
// them with `descale` (docs/fp8.md, "The append quantisation rule"): the
// value divided by the descale in fp32 (IEEE division, also under
// --use_fast_math), clamped to [-448, 448] with NaN kept, rounded to the
// nearest e4m3 (ties to even; cvt.rn.satfinite on sm89 and later).
template <typename Element>
__forceinline__ __device__ uint2 quantize_e4m3x8(uint4 chunk, float descale) {
  using Values = cutlass::Array<Element, 8>;
  using Stored = cutlass::Array<cutlass::float_e4m3_t, 8>;
  static_assert(sizeof(Values) == 16 && sizeof(Stored) == 8);
  const Values values = *reinterpret_cast<const Values*>(&chunk);
  cutlass::Array<float, 8> scaled;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < 8; ++i) {
    const float x = __fdiv_rn(static_cast<float>(values[i]), descale);
    scaled[i] = x > 448.f ? 448.f : (x < -448.f ? -448.f : x);  // NaN compares false: kept
  }
  const Stored stored = cutlass::NumericArrayConverter<cutlass::float_e4m3_t, float, 8>{}(scaled);
  return *reinterpret_cast<const uint2*>(&stored);
}

}  // namespace flash
