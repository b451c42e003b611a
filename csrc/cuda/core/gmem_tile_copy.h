// The global <-> shared copy shape every kernel's traits share: 16 bytes per
// thread per access, and each row of a tile read by kThreadsPerRow
// consecutive threads over 64 (or, for head dims that are not a multiple of
// 64, 32) columns, so a warp reads whole 128- or 64-byte row pieces.
#pragma once

#include <cute/tensor.hpp>

namespace flash {

using namespace cute;

template <typename Element, int kHeadDim, int kNThreads>
struct GmemTileCopy {
  static constexpr int kBlockK = kHeadDim % 64 == 0 ? 64 : 32;
  static constexpr int kElemsPerLoad = sizeof(cute::uint128_t) / sizeof(Element);
  static constexpr int kThreadsPerRow = kBlockK / kElemsPerLoad;
  static constexpr int kRowsPerPass = kNThreads / kThreadsPerRow;
  using LayoutAtom =
      Layout<Shape<Int<kRowsPerPass>, Int<kThreadsPerRow>>, Stride<Int<kThreadsPerRow>, _1>>;
  // Global -> shared by cp.async, bypassing L1.
  using Load =
      decltype(make_tiled_copy(Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL<cute::uint128_t>, Element>{},
                               LayoutAtom{}, Layout<Shape<_1, Int<kElemsPerLoad>>>{}));
  // Registers -> global.
  using Store = decltype(make_tiled_copy(Copy_Atom<UniversalCopy<cute::uint128_t>, Element>{},
                                         LayoutAtom{}, Layout<Shape<_1, Int<kElemsPerLoad>>>{}));
};

}  // namespace flash
