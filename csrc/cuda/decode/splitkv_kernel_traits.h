// Compile-time shape of the split-KV (decode) kernel for one (head dim, key
// tile, warp layout, dtype): its slab-by-slab shared-memory layouts, the MMA
// of one warp, and the copy atoms, which are the SM80 forward kernel's.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "cuda/decode/splitkv_tile_config.h"
#include "cuda/fwd/sm80/fwd_kernel_traits_sm80.h"

namespace flash {

using namespace cute;

// The split-KV (decode) kernel: kWarpsN warps side by side along the keys of a
// K/V tile, kWarpsV along the output columns (2 at d512, else 1), the rest
// along the query rows (splitkv_tile_config.h). Each warp runs its own
// 16 x kSlabN MMAs on its slab of keys with its own online softmax, and its
// P V on its kHeadDimV columns of the value dim; the warps' partial rows are
// merged once, at the end. So the tiles are laid out slab by slab: slab w of a
// K/V tile (keys w * kSlabN ...) and row slab w of the Q tile are each one
// contiguous swizzled tile, which a warp addresses on its own.
// kVInK_: V is read from the K tile (splitkv_reads_v_in_k): a stage holds a
// K tile alone, and each V view below points into it. CacheElement_: the
// cache's element, Element_ (q's) or cutlass::float_e4m3_t: an e4m3 cache's
// tiles are staged as bytes and converted into one Element tile set before
// the products (docs/fp8.md).
template <int kHeadDim_, int kBlockN_, int kWarpsN_, int kNWarps_, typename Element_,
          bool kVInK_ = false, typename CacheElement_ = Element_>
struct SplitKvKernelTraits {
  using Element = Element_;
  using CacheElement = CacheElement_;
  static constexpr bool kCacheFp8 = !std::is_same_v<CacheElement, Element>;
  static_assert(!kCacheFp8 || std::is_same_v<CacheElement, cutlass::float_e4m3_t>,
                "a cache of q's dtype, or e4m3");
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kWarpsN = kWarpsN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kWarpsV = splitkv_warps_v(kHeadDim);
  static constexpr int kWarpsM = kNWarps / (kWarpsN * kWarpsV);
  static constexpr int kBlockM = 16 * kWarpsM;
  static constexpr int kSlabN = kBlockN / kWarpsN;
  // The value dim (splitkv_head_dim_v: 512 at MLA's 576) and one warp's part of it.
  static constexpr int kHeadDimVTotal = splitkv_head_dim_v(kHeadDim);
  static constexpr int kHeadDimV = kHeadDimVTotal / kWarpsV;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kStages = splitkv_stages(kHeadDim, kWarpsN);
  static constexpr bool kVInK = kVInK_;
  static constexpr int kTilesPerStage = kVInK ? 1 : 2;  // (K) or (K, V)
  static_assert(!kVInK || (splitkv_reads_v_in_k(kHeadDim) && kHeadDimVTotal <= kHeadDim),
                "V read in the K tile: the value dim lies within the K tile's columns");
  // The two warps of a key slab split the k-slices of S (splitkv_splits_scores).
  static constexpr bool kSplitScores = splitkv_splits_scores(kHeadDim, kVInK);
  static_assert(!kSplitScores || (kWarpsV == 2 && (kHeadDim / 16) % 2 == 0),
                "two value halves, an even number of k16 slices of S");
  static_assert(kNWarps % (kWarpsN * kWarpsV) == 0 && kBlockN % (16 * kWarpsN) == 0,
                "whole warps per key slab and value part, at least one k16 step of P V per slab");
  static_assert(kWarpsV == 1 || kWarpsN > 1, "the 64-row variant keeps O whole in each warp");
  static_assert(kBlockM == splitkv_block_m(kHeadDim, kWarpsN) || kWarpsN == 1);

  // MMA atom, swizzle atom and copies as in the SM80 forward kernel's
  // traits (of a 64-row tile, which no part used here depends on).
  using FwdTraits = FwdKernelTraits<kHeadDim, 16 * kNWarps, kBlockN, kNWarps, Element>;
  using MmaAtom = typename FwdTraits::MmaAtom;
  // One warp's MMA: 16 rows x 16 (k16 steps of P V read 16 keys).
  using WarpMma = TiledMMA<MmaAtom, Layout<Shape<_1, _1, _1>>, Tile<_16, _16, _16>>;
  // The element of the V tile and of P in P V: q's, but float16 over an
  // e4m3 cache with bfloat16 q and a V tile of its own. e4m3 converts to
  // float16 in one instruction a pair (cvt.rn.f16x2.e4m3x2) and to bfloat16
  // in four (through fp32), and every e4m3 value is a float16 value, so V is
  // exact either way; P, in [0, 1], rounds to float16's 11 bits instead of
  // bfloat16's 8 (docs/fp8.md, "P V in float16").
  using ElementV =
      std::conditional_t<kCacheFp8 && !kVInK_ && std::is_same_v<Element, cutlass::bfloat16_t>,
                         cutlass::half_t, Element>;
  static_assert(sizeof(ElementV) == sizeof(Element), "V's tile has K's layout and bytes");
  using FwdTraitsV = FwdKernelTraits<kHeadDim, 16 * kNWarps, kBlockN, kNWarps, ElementV>;
  using WarpMmaPV =
      TiledMMA<typename FwdTraitsV::MmaAtom, Layout<Shape<_1, _1, _1>>, Tile<_16, _16, _16>>;
  using SmemLayoutAtom = typename FwdTraits::SmemLayoutAtom;
  using SmemCopyAtom = typename FwdTraits::SmemCopyAtom;
  using SmemCopyAtomTransposed = typename FwdTraitsV::SmemCopyAtomTransposed;
  using GmemTiledCopyQKV = typename FwdTraits::GmemTiledCopyQKV;
  static_assert(kBlockM % (kNThreads / FwdTraits::kGmemThreadsPerRow) == 0,
                "the Q tile is a whole number of global-copy passes");

  // A slab starts at a multiple of 512 elements, above the swizzle's bits, so
  // the slab-by-slab tile and one slab seen alone swizzle alike.
  using SmemLayoutQSlab = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<_16, Int<kHeadDim>>{}));
  using SmemLayoutQ =
      decltype(tile_to_shape(SmemLayoutQSlab{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutKVSlab =
      decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kSlabN>, Int<kHeadDim>>{}));
  using SmemLayoutKV =
      decltype(tile_to_shape(SmemLayoutKVSlab{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // A warp's part of the V slab seen as (head dim, key), (kHeadDimV, kSlabN):
  // the B operand of P V without moving data. The slab is laid out in strips
  // of the swizzle atom's 64 columns, each kSlabN x 64 elements long and a
  // whole number of swizzle periods (512 elements), so the part of warp v is
  // this layout at kHeadDimV * kSlabN * v elements further (SplitKvSmem::slab_vt).
  using SmemLayoutVtSlab = decltype(composition(
      SmemLayoutKVSlab{}, make_layout(Shape<Int<kHeadDimV>, Int<kSlabN>>{}, GenRowMajor{})));
  static_assert(kWarpsV == 1 || (kHeadDimV % 64 == 0 && (kHeadDimV * kSlabN) % 512 == 0),
                "a value part starts at a strip of the swizzle atom");
  using SmemLayoutVtSlabNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutVtSlab{}));
  static constexpr int kQSlabElems = 16 * kHeadDim;
  static constexpr int kKVSlabElems = kSlabN * kHeadDim;
  static_assert(kQSlabElems % 512 == 0 && kKVSlabElems % 512 == 0);

  static constexpr int kSmemSizeQ = kBlockM * kHeadDim * int(sizeof(Element));
  static constexpr int kSmemSizeKV = kTilesPerStage * kBlockN * kHeadDim * int(sizeof(Element));
  static constexpr int kSmemSizeScoreExchange = kSplitScores ? 4 * kNWarps * 16 * kSlabN : 0;
  // Over an e4m3 cache: the warps load their K and V fragments from the
  // staged bytes and convert them in registers (splitkv_fragments_from_stage;
  // docs/fp8.md, "Fragments straight from the e4m3 stage").
  static constexpr bool kFragmentsFromStage =
      splitkv_fragments_from_stage(kHeadDim, kWarpsN, kVInK, kCacheFp8);
  // The staged bytes of a K or V tile there, slab by slab like the 16-bit
  // tiles: rows of 64-byte atoms of 8 rows whose 16-byte units are swizzled
  // by the row (bits 4-5 by bits 7-8), so that the 8 rows ldmatrix reads at
  // one unit lie on distinct banks, and a copy's 8 bytes stay in one unit.
  using SmemLayoutStagingAtom =
      decltype(composition(Swizzle<2, 4, 3>{}, Layout<Shape<_8, _64>, Stride<_64, _1>>{}));
  // Other instances (d160's rows are no whole number of atoms) never read
  // these layouts: they get one atom's width so that the types still exist.
  static constexpr int kStagingCols = kFragmentsFromStage ? kHeadDim : 64;
  using SmemLayoutStagingSlab =
      decltype(tile_to_shape(SmemLayoutStagingAtom{}, Shape<Int<kSlabN>, Int<kStagingCols>>{}));
  using SmemLayoutStaging =
      decltype(tile_to_shape(SmemLayoutStagingSlab{}, Shape<Int<kBlockN>, Int<kStagingCols>>{}));
  static_assert(!kFragmentsFromStage || (kSlabN % 16 == 0 && kHeadDim % 64 == 0),
                "whole 16-key steps of P V and 64-byte atoms across a row");
  // Element tile sets the products read: one per stage, or with an e4m3
  // cache the one its stages are converted into (and the stages' own bytes),
  // or none where the fragments come from the stage.
  static constexpr int kTileSets = kFragmentsFromStage ? 0 : (kCacheFp8 ? 1 : kStages);
  static constexpr int kSmemSizeStaging =
      kCacheFp8 ? kStages * kTilesPerStage * kBlockN * kHeadDim : 0;
  static constexpr int kSmemSizeTiles =
      kSmemSizeQ + kTileSets * kSmemSizeKV + kSmemSizeScoreExchange + kSmemSizeStaging;
  // A block of one item merges its warps' rows in the same bytes at the end
  // (SplitKvMergeSchedule); the staged fragments alone can be fewer (d256).
  static constexpr int kSmemSize = kSmemSizeTiles < splitkv_merge_bytes(kHeadDim, kWarpsN)
                                       ? splitkv_merge_bytes(kHeadDim, kWarpsN)
                                       : kSmemSizeTiles;
};

}  // namespace flash
