// Compile-time shape of the SM80 forward kernel for one (head dim, tile,
// dtype): shared-memory layouts, the tiled MMA, and the copy atoms that move
// tiles between global memory, shared memory and registers. The split-KV
// kernel's traits (decode/splitkv_kernel_traits.h) take their atoms from here.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "cuda/core/gmem_tile_copy.h"
#include "cuda/core/head_dim_slabs.h"

namespace flash {

using namespace cute;

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, typename Element_>
struct FwdKernelTraits {
  using Element = Element_;
  using ElementAccum = float;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = kNWarps * 32;
  static_assert(kHeadDim % 32 == 0, "compiled head dims are multiples of 32");
  static_assert(kBlockM % (16 * kNWarps) == 0,
                "each warp owns whole 16-row MMA slabs of the query tile");
  // O = P V is computed slab by slab of V's columns (cuda/core/head_dim_slabs.h:
  // one slab up to 256, two at 512), S = Q K^T at the full width in each
  // pass. (The split-KV kernel's traits, which take only this struct's atoms,
  // instantiate it at 576 too: flash_fwd_kernel asserts whole slabs.)
  static constexpr int kSlabCols = slab_cols(kHeadDim);
  static constexpr int kSlabs = kHeadDim / kSlabCols;

  using MmaAtom = std::conditional_t<std::is_same_v<Element, cutlass::half_t>,
                                     MMA_Atom<SM80_16x8x16_F32F16F16F32_TN>,
                                     MMA_Atom<SM80_16x8x16_F32BF16BF16F32_TN>>;
  // Warps tile the M (query row) dimension only, so every score row lives in
  // one warp and the softmax reductions never leave it.
  using TiledMma =
      TiledMMA<MmaAtom, Layout<Shape<Int<kNWarps>, _1, _1>>, Tile<Int<16 * kNWarps>, _16, _16>>;

  // Shared-memory rows are read by ldmatrix 8 rows x 16 bytes at a time. A
  // swizzle over 8-row atoms of 64 (or 32) elements spreads those 8 rows over
  // all 32 banks, for both the row-major reads of Q/K and the transposed reads
  // of V.
  static constexpr int kBlockKSmem = kHeadDim % 64 == 0 ? 64 : 32;
  static constexpr int kSwizzleBits = kBlockKSmem == 64 ? 3 : 2;
  using SmemLayoutAtom =
      decltype(composition(Swizzle<kSwizzleBits, 3, 3>{},
                           Layout<Shape<_8, Int<kBlockKSmem>>, Stride<Int<kBlockKSmem>, _1>>{}));
  using SmemLayoutQ =
      decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutKV =
      decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // V's tile: a slab's columns (K's layout with one slab).
  using SmemLayoutV =
      decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockN>, Int<kSlabCols>>{}));
  // V seen as (head dim, key): the B operand of P V without moving data.
  using SmemLayoutVt = decltype(composition(
      SmemLayoutV{}, make_layout(Shape<Int<kSlabCols>, Int<kBlockN>>{}, GenRowMajor{})));
  using SmemLayoutVtNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutVt{}));
  // O staged for its store: the whole tile over Q, or with more slabs than
  // one a slab's over K or Q (flash_fwd_kernel).
  using SmemLayoutO = SmemLayoutQ;
  using SmemLayoutOSlab =
      decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockM>, Int<kSlabCols>>{}));

  using SmemCopyAtom = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomTransposed = Copy_Atom<SM75_U16x8_LDSM_T, Element>;
  using SmemCopyAtomO = Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<128>, Element>;

  using GmemCopy = GmemTileCopy<Element, kHeadDim, kNThreads>;
  static_assert(GmemCopy::kBlockK == kBlockKSmem, "a copied row piece is a row of the smem atom");
  static constexpr int kGmemThreadsPerRow = GmemCopy::kThreadsPerRow;
  using GmemTiledCopyQKV = typename GmemCopy::Load;
  using GmemTiledCopyO = typename GmemCopy::Store;

  static constexpr int kSmemSizeQ = kBlockM * kHeadDim * int(sizeof(Element));
  static constexpr int kSmemSizeKV = kBlockN * (kHeadDim + kSlabCols) * int(sizeof(Element));
  static constexpr int kSmemSize = kSmemSizeQ + kSmemSizeKV;
};
}  // namespace flash
