// e4m3 (cutlass::float_e4m3_t) to 16-bit conversions of the kernels that read
// an FP8 KV cache (docs/fp8.md). Every e4m3 value is a float16 and a
// bfloat16 value, so the conversion is exact; CUTLASS's converters issue
// cvt.rn.f16x2.e4m3x2 on sm89 and later.
#pragma once

#include <cstdint>

#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

namespace flash {

// 8 e4m3 bytes at src (8-byte aligned) to 8 Element values at dst (16-byte
// aligned), both in shared memory.
template <typename Element>
__forceinline__ __device__ void convert_e4m3x8(const uint8_t* src, Element* dst) {
  using Source = cutlass::Array<cutlass::float_e4m3_t, 8>;
  using Result = cutlass::Array<Element, 8>;
  static_assert(sizeof(Source) == 8 && sizeof(Result) == 16);
  const Source in = *reinterpret_cast<const Source*>(src);
  *reinterpret_cast<Result*>(dst) =
      cutlass::NumericArrayConverter<Element, cutlass::float_e4m3_t, 8>{}(in);
}

}  // namespace flash
