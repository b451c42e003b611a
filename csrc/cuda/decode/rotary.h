// The rotary embedding of fwd_kvcache, one 8-element (16-byte) chunk of a
// head vector at a time (rotary_chunk, from global memory, any even
// rotary_dim: the append / rotary pre-kernel, append_rotary_kernel.h) or
// one 16-element unit in registers (rotate_unit: the split-KV kernel, which
// rotates q and a decode step's new keys in shared memory itself,
// splitkv_kernel.h). One pair rule for both (rotated_first /
// rotated_second). Both must store the same bits as the CPU path, which
// rotates in fp32 with one rounding and no fused multiply-add.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace flash {

constexpr int kRotaryChunkElems = 8;  // one 16-byte chunk of 16-bit elements

template <typename T>
__device__ float rotary_to_float(T x);
template <>
__forceinline__ __device__ float rotary_to_float<__half>(__half x) {
  return __half2float(x);
}
template <>
__forceinline__ __device__ float rotary_to_float<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

template <typename T>
__device__ T rotary_from_float(float x);
template <>
__forceinline__ __device__ __half rotary_from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__forceinline__ __device__ __nv_bfloat16 rotary_from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// One rotated pair: (x0, x1) -> (x0 c - x1 s, x0 s + x1 c). Explicit _rn
// products keep the compiler from contracting into an FMA, matching the CPU
// rounding.
__forceinline__ __device__ float rotated_first(float x0, float x1, float c, float s) {
  return __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
}
__forceinline__ __device__ float rotated_second(float x0, float x1, float c, float s) {
  return __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
}

// Element d of a head vector after rotation at one position: pairs (2m, 2m+1)
// when interleaved, else (m, m + rotary_dim / 2).
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
  const float value = d == first ? rotated_first(x0, x1, c, s) : rotated_second(x0, x1, c, s);
  return rotary_from_float<T>(value);
}

// Elements d0 .. d0 + 7 of the head vector at src (global memory), rotated
// at the position whose tables rows are cos_row / sin_row where d < rotary_dim
// (a chunk past rotary_dim is a plain 16-byte load). The partner of an
// element may lie in another chunk (non-interleaved), so src is the whole
// vector, not the chunk. Not inlined: each inlined copy is eight elements of
// branches and loads, and the pre-kernel calls it for keys and for q.
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

// One rotation unit of 16 elements, where rotary_dim is a multiple of 16:
// the chunks a = [8u, 8u + 8) and b = a + rotary_dim / 2 (not interleaved),
// or a = [16u, 16u + 8) and b = a + 8 (interleaved), rotated in place with
// the table entries [8u, 8u + 8) of the position (cos8, sin8). A unit holds
// both halves of every pair it rotates, so whoever owns it needs no other
// element: the split-KV kernel rotates in shared memory with one unit per
// thread and no barrier between reading and writing.
template <typename T>
__device__ void rotate_unit(uint4& a, uint4& b, const uint4& cos8, const uint4& sin8,
                            bool interleaved) {
  T* const xa = reinterpret_cast<T*>(&a);
  T* const xb = reinterpret_cast<T*>(&b);
  const T* const c = reinterpret_cast<const T*>(&cos8);
  const T* const s = reinterpret_cast<const T*>(&sin8);
  if (interleaved) {
#pragma unroll
    for (int chunk = 0; chunk < 2; ++chunk) {
      T* const x = chunk == 0 ? xa : xb;
#pragma unroll
      for (int j = 0; j < kRotaryChunkElems / 2; ++j) {
        const float x0 = rotary_to_float(x[2 * j]);
        const float x1 = rotary_to_float(x[2 * j + 1]);
        const float cj = rotary_to_float(c[chunk * kRotaryChunkElems / 2 + j]);
        const float sj = rotary_to_float(s[chunk * kRotaryChunkElems / 2 + j]);
        x[2 * j] = rotary_from_float<T>(rotated_first(x0, x1, cj, sj));
        x[2 * j + 1] = rotary_from_float<T>(rotated_second(x0, x1, cj, sj));
      }
    }
  } else {
#pragma unroll
    for (int e = 0; e < kRotaryChunkElems; ++e) {
      const float x0 = rotary_to_float(xa[e]);
      const float x1 = rotary_to_float(xb[e]);
      const float ce = rotary_to_float(c[e]);
      const float se = rotary_to_float(s[e]);
      xa[e] = rotary_from_float<T>(rotated_first(x0, x1, ce, se));
      xb[e] = rotary_from_float<T>(rotated_second(x0, x1, ce, se));
    }
  }
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
