// Warpgroup-MMA (wgmma, sm90a) counterparts of tile_ops.h: the MMA loop, the
// views of its accumulator that the softmax and the P V product need, and
// the mbarrier roles of the warp-specialized kernels.
#pragma once

#include <cstdint>

#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

namespace flash {

using namespace cute;

// A warp-specialized kernel keeps its mbarriers as plain 64-bit words in
// shared memory (a struct in its traits); these are the two roles a word
// plays. A "full" barrier takes the producer's arrival with the byte count
// its TMA copies will complete; an "empty" one the consumers' arrivals once
// they are done with a buffer.
__forceinline__ __device__ cutlass::arch::ClusterTransactionBarrier& full_barrier(uint64_t& word) {
  return reinterpret_cast<cutlass::arch::ClusterTransactionBarrier&>(word);
}
__forceinline__ __device__ cutlass::arch::ClusterBarrier& empty_barrier(uint64_t& word) {
  return reinterpret_cast<cutlass::arch::ClusterBarrier&>(word);
}

// Issues acc (= or +=) A * B over all k-slices as wgmmas, without the
// fences, commit and wait around them: the kernel overlaps two products and
// places those itself. B always comes from shared memory (descriptors); A
// from shared memory too, or from registers (P). kZeroInit makes the first
// slice overwrite acc, which saves clearing it.
template <bool kZeroInit, typename TiledMma, typename TensorA, typename TensorB, typename TensorAcc>
__forceinline__ __device__ void wgmma_issue(TiledMma& tiled_mma, const TensorA& tCrA,
                                            const TensorB& tCrB, TensorAcc& acc) {
  if constexpr (kZeroInit) tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(tCrA); ++k) {
    cute::gemm(tiled_mma, tCrA(_, _, k), tCrB(_, _, k), acc);
    tiled_mma.accumulate_ = GMMA::ScaleOut::One;
  }
}

// The first thread (from 0) of the warpgroup of MMA thread mma_tidx, made
// warp-uniform by a shuffle from lane 0. A wgmma operand in shared memory is
// a descriptor that depends on the warpgroup alone: partitioned from this
// index it is a uniform value that ptxas keeps in uniform registers.
// Partitioned from mma_tidx itself, every HGMMA first moved its descriptors
// into them (R2UR, UMOV, UIADD3: ~6 instructions per HGMMA, ~130 per warp and
// query block of the d128 backward; PERF_LOG 2026-11-29, "ncu beside FA4").
// Accumulator partitions (partition_C) stay per thread.
__forceinline__ __device__ int warp_group_first_thread(int mma_tidx) {
  return __shfl_sync(0xffffffff, mma_tidx / 128, 0) * 128;
}

// The wgmma accumulator fragment is ((2 cols, 2 row halves, N/8 col groups),
// MMA_M, MMA_N); as (rows, cols) = ((2, MMA_M), (2, N/8, MMA_N)) a thread
// walks its rows for the softmax. The 4 threads sharing a row are a quad, as
// with the SM80 m16n8 accumulator.
template <typename AccLayout>
__forceinline__ __device__ auto wgmma_acc_layout_as_rowcol(AccLayout acc_layout) {
  static_assert(decltype(rank<0>(acc_layout))::value == 3);
  static_assert(decltype(rank(acc_layout))::value == 3);
  return make_layout(make_layout(get<0, 1>(acc_layout), get<1>(acc_layout)),
                     make_layout(get<0, 0>(acc_layout), get<0, 2>(acc_layout), get<2>(acc_layout)));
}

// Two neighbouring 8-column groups of the accumulator hold exactly the
// registers of a k16 slice of wgmma's register A operand (16-bit types), so
// P feeds P V without a shuffle: ((2, 2, N/8), MMA_M, MMA_N) ->
// ((2, 2, 2), MMA_M, (N/16, MMA_N)).
template <typename AccLayout>
__forceinline__ __device__ auto wgmma_acc_layout_as_operand_a(AccLayout acc_layout) {
  static_assert(decltype(rank<0>(acc_layout))::value == 3);
  static_assert(decltype(size<0, 2>(acc_layout))::value % 2 == 0);
  auto col_groups = logical_divide(get<0, 2>(acc_layout), Layout<_2>{});  // (2, N/16)
  return make_layout(make_layout(get<0, 0>(acc_layout), get<0, 1>(acc_layout), get<0>(col_groups)),
                     get<1>(acc_layout), make_layout(get<1>(col_groups), get<2>(acc_layout)));
}

}  // namespace flash
