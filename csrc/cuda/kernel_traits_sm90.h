// Compile-time shape of the Hopper (sm90a) forward kernel: warpgroup MMAs
// (wgmma) read Q, K and V straight from shared memory, so the tiles are laid
// out in the canonical GMMA layouts instead of the ldmatrix-friendly ones of
// kernel_traits.h.
#pragma once

#include <type_traits>

#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "gmem_tile_copy.h"

namespace flash {

using namespace cute;

template <int kHeadDim_, int kBlockM_, int kBlockN_, typename Element_>
struct FwdSm90KernelTraits {
  using Element = Element_;
  using ElementAccum = float;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  // One warpgroup (4 warps) per 64 query rows: wgmma's M is 64, and a row's
  // scores stay inside one warp (the quad reductions of softmax.h hold).
  static constexpr int kNWarpGroups = kBlockM / 64;
  static constexpr int kNWarps = 4 * kNWarpGroups;
  static constexpr int kNThreads = 32 * kNWarps;
  static_assert(kBlockM % 64 == 0, "wgmma tiles the query rows by 64");
  static_assert(kHeadDim % 32 == 0, "compiled head dims are multiples of 32");
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "wgmma N of Q K^T");

  using WarpGroupLayout = Layout<Shape<Int<kNWarpGroups>, _1, _1>>;
  // S = Q K^T: both operands from shared memory, K-major (head dim contiguous).
  using TiledMmaS = decltype(make_tiled_mma(
      SM90::GMMA::ss_op_selector<Element, Element, ElementAccum,
                                 Shape<_64, Int<kBlockN>, Int<kHeadDim>>>(),
      WarpGroupLayout{}));
  // O += P V: P from registers (the S accumulator converted in place), V from
  // shared memory read along the head dim (MN-major), so V is never transposed.
  using TiledMmaO = decltype(make_tiled_mma(
      SM90::GMMA::rs_op_selector<Element, Element, ElementAccum,
                                 Shape<_64, Int<kHeadDim>, Int<kBlockN>>, GMMA::Major::K,
                                 GMMA::Major::MN>(),
      WarpGroupLayout{}));

  // The widest swizzle whose row the head dim fills: 128-byte rows (64
  // elements) spread wgmma's 8-row core matrices over all banks.
  using SmemLayoutAtom =
      std::conditional_t<kHeadDim % 64 == 0, GMMA::Layout_K_SW128_Atom<Element>,
                         GMMA::Layout_K_SW64_Atom<Element>>;
  using SmemLayoutQ = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  // K and V are double-buffered: the copies of the next tiles are issued at
  // the top of an iteration and have a whole iteration to land.
  static constexpr int kStages = 2;
  using SmemLayoutKV = decltype(tile_to_shape(
      SmemLayoutAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  // V seen as (head dim, key): a K-major atom read transposed is the MN-major
  // atom of the same swizzle, which is what P V's B operand asks for.
  using SmemLayoutVt = decltype(composition(
      SmemLayoutKV{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{},
                                          Step<_2, _1, _3>{})));
  using SmemLayoutO = SmemLayoutQ;

  using GmemCopy = GmemTileCopy<Element, kHeadDim, kNThreads>;
  static_assert(kBlockN % GmemCopy::kRowsPerPass == 0,
                "a K/V tile is a whole number of passes of the block's copy");
  using GmemTiledCopyQKV = typename GmemCopy::Load;
  using GmemTiledCopyO = typename GmemCopy::Store;
  // Registers -> shared for O: a thread holds column pairs of the accumulator.
  using SmemCopyAtomO = Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<32>, Element>;

  static constexpr int kSmemSizeQ = kBlockM * kHeadDim * int(sizeof(Element));
  static constexpr int kSmemSizeKV = 2 * kStages * kBlockN * kHeadDim * int(sizeof(Element));
  static constexpr int kSmemSize = kSmemSizeQ + kSmemSizeKV;
};

}  // namespace flash
