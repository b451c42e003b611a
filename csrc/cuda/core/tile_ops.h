// Tile-level building blocks on CuTe tensors shared by the kernels: the two
// MMA loops (operands from shared memory, or A already in registers), the
// accumulator layout views, dtype conversion and bounds-checked tile copies.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

namespace flash {

using namespace cute;

// acc += A * B with both operands streamed from shared memory. The ldmatrix
// of k-slice i+1 is issued before the MMAs of slice i so they overlap. Over
// k-slices [kBegin, kEnd) only when given (kEnd -1: to the last).
template <int kBegin = 0, int kEnd = -1, typename TensorAcc, typename TensorA, typename TensorB,
          typename TensorSmemA, typename TensorSmemB, typename TiledMma, typename TiledCopyA,
          typename TiledCopyB, typename ThrCopyA, typename ThrCopyB>
__forceinline__ __device__ void gemm_smem_smem(TensorAcc& acc, TensorA& tCrA, TensorB& tCrB,
                                               const TensorSmemA& tCsA, const TensorSmemB& tCsB,
                                               const TiledMma& tiled_mma,
                                               const TiledCopyA& smem_tiled_copy_A,
                                               const TiledCopyB& smem_tiled_copy_B,
                                               const ThrCopyA& smem_thr_copy_A,
                                               const ThrCopyB& smem_thr_copy_B) {
  constexpr int kSlices = decltype(size<2>(tCrA))::value;
  constexpr int kLast = kEnd < 0 ? kSlices : kEnd;
  static_assert(0 <= kBegin && kBegin < kLast && kLast <= kSlices, "a range of the k-slices");
  Tensor tCrA_copy_view = smem_thr_copy_A.retile_D(tCrA);  // (CPY, CPY_M, CPY_K)
  Tensor tCrB_copy_view = smem_thr_copy_B.retile_D(tCrB);  // (CPY, CPY_N, CPY_K)
  copy(smem_tiled_copy_A, tCsA(_, _, Int<kBegin>{}), tCrA_copy_view(_, _, Int<kBegin>{}));
  copy(smem_tiled_copy_B, tCsB(_, _, Int<kBegin>{}), tCrB_copy_view(_, _, Int<kBegin>{}));
  CUTE_UNROLL
  for (int k = kBegin; k < kLast; ++k) {
    if (k < kLast - 1) {
      copy(smem_tiled_copy_A, tCsA(_, _, k + 1), tCrA_copy_view(_, _, k + 1));
      copy(smem_tiled_copy_B, tCsB(_, _, k + 1), tCrB_copy_view(_, _, k + 1));
    }
    cute::gemm(tiled_mma, tCrA(_, _, k), tCrB(_, _, k), acc);
  }
}

// acc += A * B with A already in registers (P in the forward pass) and B
// streamed from shared memory.
template <typename TensorAcc, typename TensorA, typename TensorB, typename TensorSmemB,
          typename TiledMma, typename TiledCopyB, typename ThrCopyB>
__forceinline__ __device__ void gemm_reg_smem(TensorAcc& acc, const TensorA& tCrA, TensorB& tCrB,
                                              const TensorSmemB& tCsB, const TiledMma& tiled_mma,
                                              const TiledCopyB& smem_tiled_copy_B,
                                              const ThrCopyB& smem_thr_copy_B) {
  Tensor tCrB_copy_view = smem_thr_copy_B.retile_D(tCrB);  // (CPY, CPY_N, CPY_K)
  copy(smem_tiled_copy_B, tCsB(_, _, _0{}), tCrB_copy_view(_, _, _0{}));
  CUTE_UNROLL
  for (int k = 0; k < size<2>(tCrA); ++k) {
    if (k < size<2>(tCrA) - 1) {
      copy(smem_tiled_copy_B, tCsB(_, _, k + 1), tCrB_copy_view(_, _, k + 1));
    }
    cute::gemm(tiled_mma, tCrA(_, _, k), tCrB(_, _, k), acc);
  }
}

// The SM80 accumulator fragment is ((2 cols, 2 row halves), MMA_M, MMA_N).
// Seen as (rows, cols) = ((2, MMA_M), (2, MMA_N)) each thread can walk its
// rows for the softmax.
template <typename Layout>
__forceinline__ __device__ auto acc_layout_as_rowcol(Layout acc_layout) {
  static_assert(decltype(rank<0>(acc_layout))::value == 2);
  static_assert(decltype(rank(acc_layout))::value == 3);
  auto l = logical_divide(acc_layout, Shape<_2>{});  // ((2, 2), MMA_M, MMA_N)
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)), make_layout(get<0, 0>(l), get<2>(l)));
}

// Two adjacent n8 accumulator tiles of m16n8k16 hold exactly the registers of
// one k16 A-operand fragment, so P feeds the PV MMA without a shuffle:
// ((2, 2), MMA_M, MMA_N) -> ((2, 2, 2), MMA_M, MMA_N / 2).
template <typename Layout>
__forceinline__ __device__ auto acc_layout_as_operand_a(Layout acc_layout) {
  static_assert(decltype(size<0>(acc_layout))::value == 4);
  static_assert(decltype(rank(acc_layout))::value == 3);
  auto l = logical_divide(acc_layout, Shape<Underscore, Underscore, _2>{});
  return make_layout(make_layout(get<0>(l), get<2, 0>(l)), get<1>(l), get<2, 1>(l));
}

template <typename To, typename Engine, typename Layout>
__forceinline__ __device__ auto convert_type(const Tensor<Engine, Layout>& tensor) {
  using From = typename Engine::value_type;
  constexpr int kNumel = decltype(size(tensor))::value;
  cutlass::NumericArrayConverter<To, From, kNumel> converter;
  auto frag = converter(*reinterpret_cast<const cutlass::Array<From, kNumel>*>(tensor.data()));
  return make_tensor(make_rmem_ptr<To>(&frag), tensor.layout());
}

// convert_type into an existing register tensor of the same size (a
// fragment that lives across loop iterations).
template <typename EngineSrc, typename LayoutSrc, typename EngineDst, typename LayoutDst>
__forceinline__ __device__ void convert_type_into(const Tensor<EngineSrc, LayoutSrc>& src,
                                                  Tensor<EngineDst, LayoutDst>& dst) {
  using From = typename EngineSrc::value_type;
  using To = typename EngineDst::value_type;
  constexpr int kNumel = decltype(size(src))::value;
  static_assert(kNumel == decltype(size(dst))::value);
  cutlass::NumericArrayConverter<To, From, kNumel> converter;
  *reinterpret_cast<cutlass::Array<To, kNumel>*>(dst.data()) =
      converter(*reinterpret_cast<const cutlass::Array<From, kNumel>*>(src.data()));
}

// Global -> shared tile copy, predicated per (row, column chunk): rows at or
// past max_row and column chunks past the head dim are zero-filled instead of
// read. Zero, not left stale, because a garbage K row could be NaN (0 * NaN
// survives masking in P V) and padded head-dim columns enter Q K^T.
// all_in_bounds (a whole tile inside the tensor, the common case) takes a
// branch-free path.
template <typename TiledCopy, typename TensorSrc, typename TensorDst, typename TensorCoord,
          typename TensorColPred>
__forceinline__ __device__ void copy_tile_predicated(const TiledCopy& tiled_copy,
                                                     const TensorSrc& src, TensorDst& dst,
                                                     const TensorCoord& identity,
                                                     const TensorColPred& col_in_bounds,
                                                     int max_row, bool all_in_bounds = false) {
  if (all_in_bounds) {
    copy(tiled_copy, src, dst);
    return;
  }
  CUTE_UNROLL
  for (int m = 0; m < size<1>(src); ++m) {
    if (get<0>(identity(0, m, 0)) < max_row) {
      CUTE_UNROLL
      for (int k = 0; k < size<2>(src); ++k) {
        if (col_in_bounds(k)) {
          copy(tiled_copy, src(_, m, k), dst(_, m, k));
        } else {
          clear(dst(_, m, k));
        }
      }
    } else {
      clear(dst(_, m, _));
    }
  }
}

// Register -> global store of an output tile, dropping rows past max_row and
// column chunks past the head dim.
template <typename TiledCopy, typename TensorSrc, typename TensorDst, typename TensorCoord,
          typename TensorColPred>
__forceinline__ __device__ void store_tile_predicated(const TiledCopy& tiled_copy,
                                                      const TensorSrc& src, TensorDst& dst,
                                                      const TensorCoord& identity,
                                                      const TensorColPred& col_in_bounds,
                                                      int max_row) {
  CUTE_UNROLL
  for (int m = 0; m < size<1>(src); ++m) {
    if (get<0>(identity(0, m, 0)) < max_row) {
      CUTE_UNROLL
      for (int k = 0; k < size<2>(src); ++k) {
        if (col_in_bounds(k)) copy(tiled_copy, src(_, m, k), dst(_, m, k));
      }
    }
  }
}

template <typename Tensor0, typename Tensor1>
__forceinline__ __device__ void make_col_predicate(Tensor0& col_in_bounds, const Tensor1& identity,
                                                   int head_dim) {
  CUTE_UNROLL
  for (int k = 0; k < size(col_in_bounds); ++k) {
    col_in_bounds(k) = get<1>(identity(0, 0, k)) < head_dim;
  }
}

// The column predicate of make_col_predicate, evaluated where a copy reads it
// instead of held in registers: for a kernel already at its register limit
// (the SM80 backward's epilogue), where one more predicate array spilled. identity is a copy
// partition of an identity tensor, (CPY, CPY_M, CPY_D) -> (row, col); cols is the tensor's width,
// referred to where it lives (a kernel parameter) rather than copied into a register.
template <typename TensorCoord>
struct ColsBelow {
  const TensorCoord& identity;
  const int& cols;
  __forceinline__ __device__ bool operator()(int k) const {
    return get<1>(identity(0, 0, k)) < cols;
  }
};
template <typename TensorCoord>
__forceinline__ __device__ ColsBelow<TensorCoord> cols_below(const TensorCoord& identity,
                                                             const int& cols) {
  return {identity, cols};
}

}  // namespace flash
