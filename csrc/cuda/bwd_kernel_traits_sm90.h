// Compile-time shape of the Hopper (sm90a) backward kernel for one (head dim,
// tile, dtype): its three warpgroup MMAs and the canonical GMMA shared-memory
// layouts with the transposed views the MMAs read. Two designs, by how the
// two warpgroups share the block's keys:
//
//   kBlockN = 128 (head dims up to 128; flash_bwd_sm90_ws_kernel.h): a
//   warpgroup per 64 keys, so every product with the keys as rows (S^T,
//   dP^T, dK, dV) runs one wgmma M=64 tile per warpgroup, and P^T and dS^T,
//   computed as accumulators, feed dV and dK straight from registers. Only dS
//   goes through shared memory, for dQ = dS K, where both warpgroups need
//   every key.
//
//   kBlockN = 64 (head dims over 128, whose dK and dV of 64 keys would not
//   fit one warpgroup's registers; flash_bwd_sm90_kernel.h): the warpgroups
//   split S^T and dP^T by query columns and dK, dV by head-dim columns; P^T
//   and dS^T meet in shared memory, and dV / dK read them from there.
#pragma once

#include <type_traits>

#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "gmem_tile_copy.h"

namespace flash {

using namespace cute;

template <int kHeadDim_, int kBlockM_, int kBlockN_, typename Element_, int kQdOBuffers_ = 2>
struct BwdSm90KernelTraits {
  using Element = Element_;
  using ElementAccum = float;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarpGroups = 2;
  static constexpr int kNWarps = 4 * kNWarpGroups;
  static constexpr int kNThreads = 32 * kNWarps;
  // True: a warpgroup per 64 keys, P^T and dS^T in registers; false: the
  // warpgroups split queries (S^T, dP^T) and head dim (dK, dV), P^T and dS^T
  // in shared memory.
  static constexpr bool kKeysPerWarpGroup = kBlockN == 64 * kNWarpGroups;
  static_assert(kKeysPerWarpGroup || kBlockN == 64, "64 keys, or 64 per warpgroup");
  static_assert(kBlockM == 64 || kBlockM == 128, "the dQ MMA tiles 64 or 128 query rows");
  static_assert(kKeysPerWarpGroup || kBlockM == 64, "the split design tiles 64 query rows");
  static_assert(kHeadDim % 32 == 0 && (kKeysPerWarpGroup ? kHeadDim <= 128 : kHeadDim > 128),
                "dK and dV of a warpgroup's share stay in its registers");

  // S^T = K Q^T and dP^T = V dO^T, (keys, queries): both operands K-major
  // (head dim contiguous) from shared memory.
  using WarpGroupsSdP = Layout<Shape<Int<kKeysPerWarpGroup ? kNWarpGroups : 1>,
                                     Int<kKeysPerWarpGroup ? 1 : kNWarpGroups>, _1>>;
  using TiledMmaSdP = decltype(make_tiled_mma(
      SM90::GMMA::ss_op_selector<
          Element, Element, ElementAccum,
          Shape<_64, Int<kKeysPerWarpGroup ? kBlockM : kBlockM / kNWarpGroups>, Int<kHeadDim>>>(),
      WarpGroupsSdP{}));
  // dV += P^T dO and dK += dS^T Q, (keys, head dim): A from registers (or,
  // split design, from shared memory), B (dO, Q) read along the head dim
  // (MN-major), so neither is transposed.
  using WarpGroupsdKV = WarpGroupsSdP;
  static constexpr int kDKVTileN = kKeysPerWarpGroup ? kHeadDim : kHeadDim / kNWarpGroups;
  using TiledMmadKV = std::conditional_t<
      kKeysPerWarpGroup,
      decltype(make_tiled_mma(
          SM90::GMMA::rs_op_selector<Element, Element, ElementAccum,
                                     Shape<_64, Int<kDKVTileN>, Int<kBlockM>>, GMMA::Major::K,
                                     GMMA::Major::MN>(),
          WarpGroupsdKV{})),
      decltype(make_tiled_mma(
          SM90::GMMA::ss_op_selector<Element, Element, ElementAccum,
                                     Shape<_64, Int<kDKVTileN>, Int<kBlockM>>, GMMA::Major::K,
                                     GMMA::Major::MN>(),
          WarpGroupsdKV{}))>;
  // dQ = dS K, (queries, head dim), both operands MN-major. 128 query rows:
  // a warpgroup per 64 rows; 64 rows: a warpgroup per half of the head dim.
  static constexpr int kDQWarpGroupsM = kBlockM / 64;
  static constexpr int kDQWarpGroupsN = kNWarpGroups / kDQWarpGroupsM;
  using TiledMmadQ = decltype(make_tiled_mma(
      SM90::GMMA::ss_op_selector<Element, Element, ElementAccum,
                                 Shape<_64, Int<kHeadDim / kDQWarpGroupsN>, Int<kBlockN>>,
                                 GMMA::Major::MN, GMMA::Major::MN>(),
      Layout<Shape<Int<kDQWarpGroupsM>, Int<kDQWarpGroupsN>, _1>>{}));
  // The dQ accumulator's layout (bwd_accum_layout.h) is this MMA's fragment
  // order, in one chunk of the whole head dim.
  static constexpr int kDQChunks = 1;
  static constexpr int kDQChunkCols = kHeadDim;

  // Q, dO, K, V: (rows, head dim) in the widest swizzle whose row (64, 32 or
  // 16 elements) divides the head dim and, in the split design, each
  // warpgroup's half of it, which dK, dV and dQ read MN-major as whole atoms
  // (half of 160 or 224 takes the 32-byte swizzle, half of 192 the 64-byte).
  static constexpr int kHeadDimPerWarpGroup =
      kKeysPerWarpGroup ? kHeadDim : kHeadDim / kNWarpGroups;
  static constexpr int kSwizzleRow = kHeadDimPerWarpGroup % 64 == 0   ? 64
                                     : kHeadDimPerWarpGroup % 32 == 0 ? 32
                                                                      : 16;
  using SmemLayoutAtom = std::conditional_t<
      kSwizzleRow == 64, GMMA::Layout_K_SW128_Atom<Element>,
      std::conditional_t<kSwizzleRow == 32, GMMA::Layout_K_SW64_Atom<Element>,
                         GMMA::Layout_K_SW32_Atom<Element>>>;
  // Q and dO are double-buffered: the next query block's copies are issued
  // at the top of an iteration and have a whole iteration to land (the
  // warp-specialized kernel below may keep more in flight).
  static constexpr int kQdOBuffers = kQdOBuffers_;
  using SmemLayoutQdO = decltype(tile_to_shape(
      SmemLayoutAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kQdOBuffers>>{}));
  // One buffer of it: what one TMA copy of Q or dO fills.
  using SmemLayoutQdOBuffer =
      decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  // Q and dO seen as (head dim, query): the B operands of dK and dV.
  using SmemLayoutQdOt = decltype(composition(
      SmemLayoutQdO{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockM>, Int<kQdOBuffers>>{},
                                           Step<_2, _1, _3>{})));
  using SmemLayoutKV = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // K seen as (head dim, key): the B operand of dQ.
  using SmemLayoutKt = decltype(composition(
      SmemLayoutKV{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Step<_2, _1>{})));
  // dS as (query, key) with the queries contiguous, dQ's A operand read
  // MN-major; the warpgroups write it as dS^T (key, query), each thread two
  // neighbouring queries of a key at a time. Seen as (key, query), the same
  // bytes are the K-major A operand of dK in the split design; P^T, stored
  // only there, has the same layout.
  using SmemLayoutdS = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Element>{},
                                              Shape<Int<kBlockM>, Int<kBlockN>>{}));
  using SmemLayoutdSt = decltype(composition(
      SmemLayoutdS{}, make_layout(Shape<Int<kBlockN>, Int<kBlockM>>{}, GenRowMajor{})));

  // Registers -> shared for dS and the dK / dV epilogue: a thread holds
  // pairs of neighbouring columns of an accumulator.
  using SmemCopyAtomStore = Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<32>, Element>;

  using GmemCopy = GmemTileCopy<Element, kHeadDim, kNThreads>;
  static_assert(kBlockM % GmemCopy::kRowsPerPass == 0 && kBlockN % GmemCopy::kRowsPerPass == 0);
  using GmemTiledCopyLoad = typename GmemCopy::Load;
  using GmemTiledCopyStore = typename GmemCopy::Store;

  static constexpr int kSmemSizeQdOBuffer = kBlockM * kHeadDim * int(sizeof(Element));
  static constexpr int kSmemSizeQdO = kQdOBuffers * kSmemSizeQdOBuffer;
  static constexpr int kSmemSizeKV = kBlockN * kHeadDim * int(sizeof(Element));
  static constexpr int kSmemSizedS = kBlockM * kBlockN * int(sizeof(Element));
  static constexpr int kSmemSizeP = kKeysPerWarpGroup ? 0 : kSmemSizedS;
  // The lse and D = rowsum(dO * O) of each buffered query block, fp32.
  static constexpr int kSmemSizeRowStats = kQdOBuffers * 2 * kBlockM * int(sizeof(float));
  static_assert(2 * kBlockM <= kNThreads, "one row statistic copied per thread");
  static constexpr int kSmemSize =
      2 * kSmemSizeQdO + 2 * kSmemSizeKV + kSmemSizedS + kSmemSizeP + kSmemSizeRowStats;
};

// The mbarriers of the warp-specialized kernel: a stage is one buffer of Q,
// of dO and of their row statistics, filled by the producer (TMA for Q and
// dO, one warp's loads for the statistics) and handed back by the MMA
// threads once their wgmmas have read it; K and V are loaded once per key
// block and handed back after its epilogue, which stages dK / dV over them.
template <int kStages>
struct BwdSm90Barriers {
  uint64_t q_full[kStages];
  uint64_t q_empty[kStages];
  uint64_t kv_full;
  uint64_t kv_empty;
};

// The warp-specialized Hopper backward (flash_bwd_sm90_ws_kernel.h): the
// keys-per-warpgroup design above run by two MMA warpgroups (its kNThreads,
// whose MMA partitions the dQ accumulator and the conversion kernels follow)
// plus a producer warpgroup; Q / dO in kStages buffers, and dS in two, so
// that a warpgroup may write the next dS while the other still reads this
// one for dQ.
template <int kHeadDim_, int kBlockM_, int kBlockN_, typename Element_, int kStages_>
struct BwdSm90WsKernelTraits
    : BwdSm90KernelTraits<kHeadDim_, kBlockM_, kBlockN_, Element_, kStages_> {
  using Base = BwdSm90KernelTraits<kHeadDim_, kBlockM_, kBlockN_, Element_, kStages_>;
  using Element = typename Base::Element;
  static_assert(Base::kKeysPerWarpGroup, "the warp-specialized kernel has the 64-keys design");
  static constexpr int kStages = kStages_;
  static constexpr int kNMmaThreads = Base::kNThreads;
  static constexpr int kNLaunchThreads = kNMmaThreads + 128;
  // As in the forward: 24 + 2 x 240 registers per thread fit the 64 K
  // register file at 384 threads.
  static constexpr int kProducerRegisters = 24;
  static constexpr int kMmaRegisters = 240;
  static constexpr int kDSBuffers = 2;
  using SmemLayoutdS = decltype(tile_to_shape(
      GMMA::Layout_MN_SW128_Atom<Element>{},
      Shape<Int<Base::kBlockM>, Int<Base::kBlockN>, Int<kDSBuffers>>{}));
  using SmemLayoutdSt = decltype(composition(
      SmemLayoutdS{},
      make_ordered_layout(Shape<Int<Base::kBlockN>, Int<Base::kBlockM>, Int<kDSBuffers>>{},
                          Step<_2, _1, _3>{})));
  using Barriers = BwdSm90Barriers<kStages>;
  static constexpr int kSmemSizedS = kDSBuffers * Base::kSmemSizedS;
  static constexpr int kSmemSizeTiles = 2 * Base::kSmemSizeQdO + 2 * Base::kSmemSizeKV +
                                        kSmemSizedS + Base::kSmemSizeRowStats;
  static_assert(kSmemSizeTiles % 8 == 0, "the mbarriers follow the tiles");
  static constexpr int kSmemSize = kSmemSizeTiles + int(sizeof(Barriers));
};

}  // namespace flash
