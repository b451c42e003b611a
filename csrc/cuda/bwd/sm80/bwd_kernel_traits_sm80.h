// Compile-time shape of the backward kernel for one (head dim, tile, dtype):
// the three tiled MMAs (S/dP, dK/dV, dQ), the shared-memory layouts with their
// transposed views, and the copy atoms. See bwd_tile_config.h for the table.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "cuda/bwd/bwd_tile_config.h"
#include "cuda/core/gmem_tile_copy.h"

namespace flash {

using namespace cute;

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kAtomLayoutMSdP_,
          int kAtomLayoutNdKV_, int kAtomLayoutMdQ_, bool kDoubleBufferQdO_, bool kDQBeforeDK_,
          typename Element_>
struct BwdKernelTraits {
  using Element = Element_;
  using ElementAccum = float;
  static constexpr int kHeadDim = kHeadDim_;
  // V, dO and dV at the compiled width (d_v < d_qk is zero-padded by the op
  // here); named for the conversion kernels this kernel shares with the
  // Hopper one, whose dV may have a width and MMA of its own.
  static constexpr int kHeadDimV = kHeadDim;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kAtomLayoutMSdP = kAtomLayoutMSdP_;
  static constexpr int kAtomLayoutNdKV = kAtomLayoutNdKV_;
  static constexpr int kAtomLayoutMdQ = kAtomLayoutMdQ_;
  static constexpr bool kDoubleBufferQdO = kDoubleBufferQdO_;
  static constexpr int kQdOBuffers = kDoubleBufferQdO ? 2 : 1;
  static constexpr bool kDQBeforeDK = kDQBeforeDK_;
  static_assert(kHeadDim % 32 == 0, "compiled head dims are multiples of 32");
  // dK, dV and dQ are computed slab by slab of the head dim (slab_cols,
  // one slab up to 256 columns, two at 512), S and dP at the full width.
  static constexpr int kSlabCols = slab_cols(kHeadDim);
  static constexpr int kSlabs = kHeadDim / kSlabCols;
  static_assert(kHeadDim % kSlabCols == 0, "whole slabs across the head dim");
  static_assert(kNWarps % kAtomLayoutMSdP == 0 && kNWarps % kAtomLayoutNdKV == 0 &&
                kNWarps % kAtomLayoutMdQ == 0);

  using MmaAtom = std::conditional_t<std::is_same_v<Element, cutlass::half_t>,
                                     MMA_Atom<SM80_16x8x16_F32F16F16F32_TN>,
                                     MMA_Atom<SM80_16x8x16_F32BF16BF16F32_TN>>;

  // Each warp covers 16 columns of a tile step (two n8 atoms), as ldmatrix.x4
  // of a B operand needs. No GEMM here reduces along a row across warps: P
  // comes from the saved lse, not from a running row max, so S may be split
  // over warps in both dimensions.
  template <int kWarpsM>
  using TiledMmaWithWarps =
      TiledMMA<MmaAtom, Layout<Shape<Int<kWarpsM>, Int<kNWarps / kWarpsM>, _1>>,
               Tile<Int<16 * kWarpsM>, Int<16 * (kNWarps / kWarpsM)>, _16>>;
  using TiledMmaSdP = TiledMmaWithWarps<kAtomLayoutMSdP>;  // (kBlockM, kBlockN)
  using TiledMmadKV = TiledMmaWithWarps<kAtomLayoutNdKV>;  // (kBlockN, slab)
  using TiledMmadV = TiledMmadKV;
  using TiledMmadQ = TiledMmaWithWarps<kAtomLayoutMdQ>;  // (kBlockM, slab)
  static_assert(kBlockM % (16 * kAtomLayoutMSdP) == 0 &&
                kBlockN % (16 * (kNWarps / kAtomLayoutMSdP)) == 0);
  static_assert(kBlockN % (16 * kAtomLayoutNdKV) == 0 &&
                kSlabCols % (16 * (kNWarps / kAtomLayoutNdKV)) == 0);
  static_assert(kBlockM % (16 * kAtomLayoutMdQ) == 0 &&
                kSlabCols % (16 * (kNWarps / kAtomLayoutMdQ)) == 0);

  // dQ = dS K runs over kDQChunks slices of the head dim, one after the other
  // (kDQChunksPerSlab in each slab's pass), so that its accumulator (which
  // lives beside dK and dV) stays at 32 registers a thread; at head dim 256 a
  // whole-width dQ tile would spill.
  static constexpr int kDQAccumPerThread = kBlockM * kSlabCols / kNThreads;
  static constexpr int kDQChunksPerSlab = kDQAccumPerThread > 32 ? kDQAccumPerThread / 32 : 1;
  static constexpr int kDQChunkCols = kSlabCols / kDQChunksPerSlab;
  static constexpr int kDQChunks = kHeadDim / kDQChunkCols;
  static_assert(kSlabCols % kDQChunksPerSlab == 0 &&
                kDQChunkCols % (16 * (kNWarps / kAtomLayoutMdQ)) == 0);
  // Under GQA the kv heads' dK / dV sums of a key block are laid out slab by
  // slab (bwd_accum_layout.h chunks), as each pass adds them.
  static constexpr int kDKVChunkCols = kSlabCols;

  // Q, dO, K, V tiles: rows of head dim, swizzled over 8-row atoms so that
  // ldmatrix reads (plain and transposed) hit all 32 banks.
  static constexpr int kBlockKSmem = kHeadDim % 64 == 0 ? 64 : 32;
  static constexpr int kSwizzleBits = kBlockKSmem == 64 ? 3 : 2;
  using SmemLayoutAtom =
      decltype(composition(Swizzle<kSwizzleBits, 3, 3>{},
                           Layout<Shape<_8, Int<kBlockKSmem>>, Stride<Int<kBlockKSmem>, _1>>{}));
  using SmemLayoutQdO =
      decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  // Q and dO seen as (head dim, query): the B operands of dK = dS^T Q and dV = P^T dO.
  using SmemLayoutQdOt = decltype(composition(
      SmemLayoutQdO{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockM>>{}, GenRowMajor{})));
  using SmemLayoutQdOtNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutQdOt{}));
  using SmemLayoutKV =
      decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // K seen as (head dim, key): the B operand of dQ = dS K.
  using SmemLayoutKt = decltype(composition(
      SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, GenRowMajor{})));
  using SmemLayoutKtNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutKt{}));
  // A slab's dK or dV tile staged for its store (store_dk_dv): in K's or V's
  // buffer with one slab, in Q's or dO's with more (K and V stay for the
  // next slab's pass).
  using SmemLayoutdKVSlab =
      decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockN>, Int<kSlabCols>>{}));
  static_assert(kSlabs == 1 || kBlockN * kSlabCols <= kBlockM * kHeadDim,
                "a slab's dK / dV tile fits the Q / dO buffers it is staged in");

  // P and dS tiles (query, key), written from the S/dP accumulators and read
  // back plain (dQ) and transposed (dK, dV).
  static constexpr int kBlockKSmemPdS = kBlockN % 64 == 0 ? 64 : 32;
  static constexpr int kSwizzleBitsPdS = kBlockKSmemPdS == 64 ? 3 : 2;
  using SmemLayoutAtomPdS = decltype(composition(
      Swizzle<kSwizzleBitsPdS, 3, 3>{},
      Layout<Shape<_8, Int<kBlockKSmemPdS>>, Stride<Int<kBlockKSmemPdS>, _1>>{}));
  using SmemLayoutPdS =
      decltype(tile_to_shape(SmemLayoutAtomPdS{}, Shape<Int<kBlockM>, Int<kBlockN>>{}));
  using SmemLayoutPdSt = decltype(composition(
      SmemLayoutPdS{}, make_layout(Shape<Int<kBlockN>, Int<kBlockM>>{}, GenRowMajor{})));
  using SmemLayoutPdStNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutPdSt{}));

  using SmemCopyAtom = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomTransposed = Copy_Atom<SM75_U16x8_LDSM_T, Element>;
  using SmemCopyAtomStore = Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<128>, Element>;

  using GmemCopy = GmemTileCopy<Element, kHeadDim, kNThreads>;
  static_assert(GmemCopy::kBlockK == kBlockKSmem, "a copied row piece is a row of the smem atom");
  static_assert(kBlockM % GmemCopy::kRowsPerPass == 0 && kBlockN % GmemCopy::kRowsPerPass == 0);
  using GmemTiledCopyLoad = typename GmemCopy::Load;
  using GmemTiledCopyStore = typename GmemCopy::Store;

  static constexpr int kSmemSizeQdO = kBlockM * kHeadDim * int(sizeof(Element));
  static constexpr int kSmemSizeKV = kBlockN * kHeadDim * int(sizeof(Element));
  static constexpr int kSmemSizePdS = kBlockM * kBlockN * int(sizeof(Element));
  // The lse and D = rowsum(dO * O) of each buffered query block, fp32.
  static constexpr int kSmemSizeRowStats = 2 * kBlockM * int(sizeof(float));
  static_assert(2 * kBlockM <= kNThreads, "one row statistic copied per thread");
  static constexpr int kSmemSize = 2 * kQdOBuffers * kSmemSizeQdO + 2 * kSmemSizeKV +
                                   2 * kSmemSizePdS + kQdOBuffers * kSmemSizeRowStats;
};

}  // namespace flash
