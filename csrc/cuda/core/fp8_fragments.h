// MMA fragments of m16n8k16 read straight from e4m3 bytes in shared memory
// and converted in registers (the split-KV kernel over an e4m3 cache,
// Traits::kFragmentsFromStage; docs/fp8.md, "Fragments straight from the
// e4m3 stage"). ldmatrix reads the bytes as 16-bit pairs.
//
// B of Q K^T (K: key n, head-dim column k). ldmatrix without transpose gives
// thread (g, t) = (lane / 4, lane % 4) bytes 4t..4t+3 of key g's 16 columns,
// where the MMA takes k slots 2t, 2t+1 (its first register) and 2t+8, 2t+9
// (its second). So slot 2t holds column 4t, 2t+1 column 4t+1, 2t+8 column
// 4t+2 and 2t+9 column 4t+3 of each 16-column slice; Q's A fragment must
// hold its columns in the same slots, which e4m3_column_pair_slot gives to
// the copy that puts Q into shared memory.
//
// B of P V (V: key k, value column n). ldmatrix.trans gives thread (g, t)
// keys 2t and 2t+1 of columns 2g and 2g+1; e4m3_key_pairs splits them into
// the key pair of column 2g and that of column 2g+1, the n = g slot of two
// MMAs: one over the slice's even columns, one over its odd ones.
#pragma once

#include <cstdint>

#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

namespace flash {

// The slot pair (slots 2s, 2s + 1) that column pair p (columns 2p, 2p + 1)
// of a 16-column slice takes in the A and B fragments of Q K^T.
__host__ __device__ constexpr int e4m3_column_pair_slot(int p) {
  return p % 2 == 0 ? p / 2 : 4 + p / 2;
}
static_assert(e4m3_column_pair_slot(0) == 0 && e4m3_column_pair_slot(1) == 4 &&
                  e4m3_column_pair_slot(6) == 3 && e4m3_column_pair_slot(7) == 7,
              "columns 4t, 4t+1 to slots 2t, 2t+1 and 4t+2, 4t+3 to slots 2t+8, 2t+9");

// ldmatrix of kMatrices 8 x 16-byte matrices (1, 2 or 4) from the row
// addresses of lanes 0 .. 8 * kMatrices - 1; kTrans transposes 16-bit pairs.
template <int kMatrices, bool kTrans>
__forceinline__ __device__ void ldsm_b16(uint32_t smem_addr, uint32_t (&r)[kMatrices]) {
  static_assert(kMatrices == 1 || kMatrices == 2 || kMatrices == 4);
  if constexpr (kMatrices == 4) {
    if constexpr (kTrans) {
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                   : "r"(smem_addr));
    } else {
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                   : "r"(smem_addr));
    }
  } else if constexpr (kMatrices == 2) {
    if constexpr (kTrans) {
      asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                   : "=r"(r[0]), "=r"(r[1])
                   : "r"(smem_addr));
    } else {
      asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                   : "=r"(r[0]), "=r"(r[1])
                   : "r"(smem_addr));
    }
  } else {
    if constexpr (kTrans) {
      asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n"
                   : "=r"(r[0])
                   : "r"(smem_addr));
    } else {
      asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n"
                   : "=r"(r[0])
                   : "r"(smem_addr));
    }
  }
}

// Four e4m3 bytes (the first in the low byte) as four Element values in two
// registers, the first two values in the first: exact, since every e4m3
// value is a float16 and a bfloat16 value (cvt.rn.f16x2.e4m3x2 on sm89 and
// later, through fp32 to bfloat16).
template <typename Element>
__forceinline__ __device__ void e4m3x4_to(uint32_t bytes, uint32_t& lo, uint32_t& hi) {
  using Source = cutlass::Array<cutlass::float_e4m3_t, 4>;
  using Result = cutlass::Array<Element, 4>;
  static_assert(sizeof(Source) == 4 && sizeof(Result) == 8);
  Source in;
  __builtin_memcpy(&in, &bytes, sizeof(in));
  const Result out = cutlass::NumericArrayConverter<Element, cutlass::float_e4m3_t, 4>{}(in);
  uint32_t words[2];
  __builtin_memcpy(words, &out, sizeof(words));
  lo = words[0];
  hi = words[1];
}

// ldmatrix.trans's register of thread (g, t): bytes V[2t][2g], V[2t][2g+1],
// V[2t+1][2g], V[2t+1][2g+1]. Returned as V[2t][2g], V[2t+1][2g] (the key
// pair of column 2g) then V[2t][2g+1], V[2t+1][2g+1] (that of column 2g+1).
__forceinline__ __device__ uint32_t e4m3_key_pairs(uint32_t bytes) {
  return __byte_perm(bytes, 0u, 0x3120);
}

}  // namespace flash
