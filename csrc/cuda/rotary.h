// The rotary embedding of fwd_kvcache, one 8-element (16-byte) chunk of a
// head vector at a time. One definition for every kernel that rotates: the
// append / rotary pre-kernel (kvcache_append_rotary.cu) and the split-KV
// kernel, which rotates q and a decode step's new keys itself
// (flash_fwd_splitkv_kernel.h). Both must store the same bits as the CPU
// path, which rotates in fp32 with one rounding and no fused multiply-add.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace flash {

constexpr int kRotaryChunkElems = 8;  // one 16-byte chunk of 16-bit elements

template <typename T>
__device__ float rotary_to_float(T x);
template <>
__forceinline__ __device__ float rotary_to_float<__half>(__half x) { return __half2float(x); }
template <>
__forceinline__ __device__ float rotary_to_float<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

template <typename T>
__device__ T rotary_from_float(float x);
template <>
__forceinline__ __device__ __half rotary_from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__forceinline__ __device__ __nv_bfloat16 rotary_from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Element d of a head vector after rotation at one position: pairs (2m, 2m+1)
// when interleaved, else (m, m + rotary_dim / 2). Explicit _rn products keep
// the compiler from contracting into an FMA, matching the CPU rounding.
template <typename T>
__device__ T rotated_element(const T* src, int d, const T* cos_row, const T* sin_row,
                             int rotary_dim, bool interleaved) {
  if (d >= rotary_dim) return src[d];
  const int half = rotary_dim / 2;
  int m, first, second;
  if (interleaved) {
    m = d / 2;
    first = 2 * m;
    second = first + 1;
  } else {
    m = d < half ? d : d - half;
    first = m;
    second = m + half;
  }
  const float x0 = rotary_to_float(src[first]);
  const float x1 = rotary_to_float(src[second]);
  const float c = rotary_to_float(cos_row[m]);
  const float s = rotary_to_float(sin_row[m]);
  const float value = d == first ? __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s))
                                 : __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
  return rotary_from_float<T>(value);
}

// Elements d0 .. d0 + 7 of the head vector at src (global memory), rotated
// at the position whose tables rows are cos_row / sin_row where d < rotary_dim
// (a chunk past rotary_dim is a plain 16-byte load). The partner of an
// element may lie in another chunk (non-interleaved), so src is the whole
// vector, not the chunk. Not inlined: the split-KV kernel calls it from three
// places, and each inlined copy (eight elements of branches and loads) would
// add its length to the kernel.
template <typename T>
__device__ __noinline__ uint4 rotary_chunk(const T* src, int d0, const T* cos_row, const T* sin_row,
                              int rotary_dim, bool interleaved) {
  if (d0 >= rotary_dim) return *reinterpret_cast<const uint4*>(src + d0);
  alignas(16) T values[kRotaryChunkElems];
#pragma unroll
  for (int e = 0; e < kRotaryChunkElems; ++e) {
    values[e] = rotated_element(src, d0 + e, cos_row, sin_row, rotary_dim, interleaved);
  }
  return *reinterpret_cast<const uint4*>(values);
}

// The rows of the rotary tables (seqlen_ro, rotary_dim / 2) for one position.
template <typename T>
struct RotaryRows {
  const T* cos_row;
  const T* sin_row;
};

template <typename T>
__forceinline__ __device__ RotaryRows<T> rotary_rows(const void* cos, const void* sin,
                                                     int rotary_dim, int position) {
  const int64_t offset = int64_t(position) * (rotary_dim / 2);
  return {static_cast<const T*>(cos) + offset, static_cast<const T*>(sin) + offset};
}

}  // namespace flash
