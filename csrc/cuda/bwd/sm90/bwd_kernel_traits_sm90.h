// Compile-time shape of the Hopper (sm90a) backward kernel
// (bwd_kernel_sm90.h) for one (head dim, tile, dtype, Q / dO stages):
// its three warpgroup MMAs, the canonical GMMA shared-memory layouts with the
// transposed views the MMAs read, and its pipeline (stages, mbarriers, the
// producer's and MMA warpgroups' registers). Two designs, by how the two MMA
// warpgroups share the block's keys:
//
//   kBlockN = 128 (head dims up to 128): a warpgroup per 64 keys, so every
//   product with the keys as rows (S^T, dP^T, dK, dV) runs one wgmma M=64
//   tile per warpgroup, and P^T and dS^T, computed as accumulators, feed dV
//   and dK straight from registers. Only dS goes through shared memory, for
//   dQ = dS K, where both warpgroups need every key.
//
//   kBlockN = 64 (head dims over 128, whose dK and dV of 64 keys would not
//   fit one warpgroup's registers): the warpgroups split S^T and dP^T by query
//   columns and dK, dV by head-dim columns; P^T and dS^T meet in shared
//   memory, and dV / dK read them from there.
//
// kHeadDimV (default kHeadDim): the width of V, dO and dV, for a specialised
// (d_qk, d_v) pair (docs/head_dims_dv_and_512.md, "The (192, 128) tiles"):
// dO's stages, V's tile, dP^T = V dO^T's K and dV's columns take it; Q, K,
// dK, dQ and S^T = K Q^T keep kHeadDim.
#pragma once

#include <type_traits>

#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "cuda/core/gmem_tile_copy.h"

namespace flash {

using namespace cute;

// The mbarriers of the kernel: a stage is one buffer of Q, of dO and of their
// row statistics, filled by the producer (TMA for Q and dO, one warp's loads
// for the statistics) and handed back by the MMA threads once their wgmmas
// have read it; K and V are loaded once per key block and handed back after
// its epilogue, which stages dK / dV over them.
template <int kStages>
struct BwdSm90Barriers {
  uint64_t q_full[kStages];
  uint64_t q_empty[kStages];
  uint64_t kv_full;
  uint64_t kv_empty;
};

template <int kHeadDim_, int kBlockM_, int kBlockN_, typename Element_, int kStages_,
          bool kStageDQ_ = true, int kHeadDimV_ = kHeadDim_>
struct BwdSm90KernelTraits {
  using Element = Element_;
  using ElementAccum = float;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDimV_;
  // Under GQA a key block's dK sums are one chunk of the head dim
  // (bwd_accum_layout.h; the SM80 kernel's slabs make more).
  static constexpr int kDKVChunkCols = kHeadDim;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  // The MMA warpgroups: kNThreads is theirs (their partitions are the
  // accumulators' layout, bwd_accum_layout.h, which the conversion kernels
  // read with as many threads); the launch adds a producer warpgroup.
  static constexpr int kNWarpGroups = 2;
  static constexpr int kNWarps = 4 * kNWarpGroups;
  static constexpr int kNThreads = 32 * kNWarps;
  static constexpr int kNLaunchThreads = kNThreads + 128;
  // As in the forward: 24 + 2 x 240 registers per thread fit the 64 K
  // register file at 384 threads.
  static constexpr int kProducerRegisters = 24;
  static constexpr int kMmaRegisters = 240;
  // True: a warpgroup per 64 keys, P^T and dS^T in registers; false: the
  // warpgroups split queries (S^T, dP^T) and head dim (dK, dV), P^T and dS^T
  // in shared memory.
  static constexpr bool kKeysPerWarpGroup = kBlockN == 64 * kNWarpGroups;
  static_assert(kKeysPerWarpGroup || kBlockN == 64, "64 keys, or 64 per warpgroup");
  static_assert(kBlockM == 64 || kBlockM == 128, "the dQ MMA tiles 64 or 128 query rows");
  static_assert(kKeysPerWarpGroup || kBlockM == 64, "the split design tiles 64 query rows");
  static_assert(kHeadDim % 32 == 0 && (kKeysPerWarpGroup ? kHeadDim <= 128 : kHeadDim > 128),
                "dK and dV of a warpgroup's share stay in its registers");
  // A pair runs the design of its d_qk: dQ, dK and S^T are d_qk's products.
  static_assert(kHeadDimV % 32 == 0 && kHeadDimV <= kHeadDim &&
                    (kHeadDimV == kHeadDim || !kKeysPerWarpGroup),
                "d_v <= d_qk, in whole 32 columns; a narrower d_v only in the split design");

  // dQ = dS K, (queries, head dim): 128 query rows take a warpgroup per 64
  // rows; 64 rows a warpgroup per half of the head dim.
  static constexpr int kDQWarpGroupsM = kBlockM / 64;
  static constexpr int kDQWarpGroupsN = kNWarpGroups / kDQWarpGroupsM;
  static constexpr int kDQTileN = kHeadDim / kDQWarpGroupsN;

  // Q, dO, K, V, (rows, head dim), are laid out in the widest swizzle whose
  // row (64, 32 or 16 elements) divides each warpgroup's share of the head
  // dim in dK / dV (all of it, or in the split design half) and in dQ: those
  // products read Q, dO and K MN-major, and an MN-major instruction spans
  // whole atoms. Half of 160 or 224 takes the 32-byte swizzle, half of 192
  // the 64-byte. dQ's halves at d64 (32 columns) and d96 (48) take the 64-
  // and 32-byte swizzles, one N = 32 or N = 48 instruction each, where the
  // wider swizzle of their dK / dV alone left strings of N = 16
  // (PERF_LOG 2026-11-25 ee579b0).
  // dV's share (kHeadDimV) is read MN-major from dO as dK's from Q, so it
  // joins the rule; at (192, 128) its half, 64, divides the 64-byte swizzle
  // of the d_qk halves (96).
  static constexpr int kHeadDimPerWarpGroup =
      kKeysPerWarpGroup ? kHeadDim : kHeadDim / kNWarpGroups;
  static constexpr int kHeadDimVPerWarpGroup =
      kKeysPerWarpGroup ? kHeadDimV : kHeadDimV / kNWarpGroups;
  static constexpr int kSwizzleRow =
      kHeadDimPerWarpGroup % 64 == 0 && kHeadDimVPerWarpGroup % 64 == 0 && kDQTileN % 64 == 0 ? 64
      : kHeadDimPerWarpGroup % 32 == 0 && kHeadDimVPerWarpGroup % 32 == 0 && kDQTileN % 32 == 0
          ? 32
          : 16;

  // S^T = K Q^T and dP^T = V dO^T, (keys, queries): both operands K-major
  // (head dim contiguous) from shared memory.
  using WarpGroupsSdP = Layout<Shape<Int<kKeysPerWarpGroup ? kNWarpGroups : 1>,
                                     Int<kKeysPerWarpGroup ? 1 : kNWarpGroups>, _1>>;
  using TiledMmaSdP = decltype(make_tiled_mma(
      SM90::GMMA::ss_op_selector<
          Element, Element, ElementAccum,
          Shape<_64, Int<kKeysPerWarpGroup ? kBlockM : kBlockM / kNWarpGroups>, Int<kHeadDim>>>(),
      WarpGroupsSdP{}));
  // dP^T's own, with K = d_v: the same instruction and warpgroups (the
  // selector reads K only for its multiple of 16), so the same type as
  // TiledMmaSdP, and its fragments of V and dO are kHeadDimV deep.
  using TiledMmadP = decltype(make_tiled_mma(
      SM90::GMMA::ss_op_selector<
          Element, Element, ElementAccum,
          Shape<_64, Int<kKeysPerWarpGroup ? kBlockM : kBlockM / kNWarpGroups>, Int<kHeadDimV>>>(),
      WarpGroupsSdP{}));
  static_assert(std::is_same_v<TiledMmadP, TiledMmaSdP>,
                "S^T and dP^T share the accumulator layout that P^T / dS^T are made in");
  // dV += P^T dO and dK += dS^T Q, (keys, head dim): A from registers (or,
  // split design, from shared memory), B (dO, Q) read along the head dim
  // (MN-major), so neither is transposed.
  using WarpGroupsdKV = WarpGroupsSdP;
  static constexpr int kDKVTileN = kKeysPerWarpGroup ? kHeadDim : kHeadDim / kNWarpGroups;
  using TiledMmadKV = std::conditional_t<
      kKeysPerWarpGroup,
      decltype(make_tiled_mma(SM90::GMMA::rs_op_selector<Element, Element, ElementAccum,
                                                         Shape<_64, Int<kDKVTileN>, Int<kBlockM>>,
                                                         GMMA::Major::K, GMMA::Major::MN>(),
                              WarpGroupsdKV{})),
      decltype(make_tiled_mma(SM90::GMMA::ss_op_selector<Element, Element, ElementAccum,
                                                         Shape<_64, Int<kDKVTileN>, Int<kBlockM>>,
                                                         GMMA::Major::K, GMMA::Major::MN>(),
                              WarpGroupsdKV{}))>;
  // dV += P^T dO at d_v columns (its warpgroup's share of them): dK's MMA
  // where d_v = d_qk, the same type then.
  static constexpr int kDVTileN = kKeysPerWarpGroup ? kHeadDimV : kHeadDimV / kNWarpGroups;
  using TiledMmadV =
      std::conditional_t<kHeadDimV == kHeadDim, TiledMmadKV,
                         decltype(make_tiled_mma(
                             SM90::GMMA::ss_op_selector<Element, Element, ElementAccum,
                                                        Shape<_64, Int<kDVTileN>, Int<kBlockM>>,
                                                        GMMA::Major::K, GMMA::Major::MN>(),
                             WarpGroupsdKV{}))>;
  // dQ = dS K, (queries, head dim), both operands MN-major, warpgroups as
  // above.
  using TiledMmadQ =
      decltype(make_tiled_mma(SM90::GMMA::ss_op_selector<Element, Element, ElementAccum,
                                                         Shape<_64, Int<kDQTileN>, Int<kBlockN>>,
                                                         GMMA::Major::MN, GMMA::Major::MN>(),
                              Layout<Shape<Int<kDQWarpGroupsM>, Int<kDQWarpGroupsN>, _1>>{}));
  // One wgmma instruction per tile width, as in the forward
  // (fwd_kernel_traits_sm90.h): the split design's head-dim halves of 80 and 112
  // and d96's dQ halves of 48 are CuTe's extended shapes; tiled from N = 16
  // instructions they cost the d160 / d224 backward (PERF_LOG 2026-11-25
  // 9de55ab).
  static_assert(size<1>(typename TiledMmaSdP::AtomShape_MNK{}) ==
                        (kKeysPerWarpGroup ? kBlockM : kBlockM / kNWarpGroups) &&
                    size<1>(typename TiledMmadKV::AtomShape_MNK{}) == kDKVTileN &&
                    size<1>(typename TiledMmadV::AtomShape_MNK{}) == kDVTileN &&
                    size<1>(typename TiledMmadQ::AtomShape_MNK{}) == kDQTileN,
                "wgmma narrower than the tile: define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED before "
                "any CuTe header in this file (generate_instantiations.py)");
  // The dQ accumulator's layout (bwd_accum_layout.h) is this MMA's fragment
  // order, in one chunk of the whole head dim.
  static constexpr int kDQChunks = 1;
  static constexpr int kDQChunkCols = kHeadDim;
  // dQ through shared memory: the MMA warpgroups store each query block's dQ
  // in that order into a staging buffer, which one producer warp adds into
  // the accumulator's (contiguous) block with one bulk reduction
  // (BwdSm90DQWriter), so that the MMA warps issue no global reductions.
  // Head dims up to 128 (d128: 161 + 32 KiB), where the tile table asks for
  // it (kStageDQ_, bwd_sm90_stage_dq); the split design (d256: 225 KiB
  // already) keeps each thread's reductions.
  static constexpr bool kDQThroughSmem = kKeysPerWarpGroup && kStageDQ_;
  // 128 query rows (d64): the MMA threads hold a share of the query block's
  // lse and D and shuffle each column's in (BwdSm90ShuffledRowStats), where
  // reading all 32 columns of each from shared memory spilled, and mask by
  // compile-time column offsets (apply_mask_transposed_by_offset); the
  // score-mods variant makes P^T and dS^T in their 16-bit registers
  // (BwdSm90MainloopMma::score_mods_p_and_ds). 64 rows keep the code they
  // had, which fits there.
  static constexpr bool kShuffleRowStats = kKeysPerWarpGroup && kBlockM == 128;
  // Whether the score-mods variant draws dropout (BwdSm90MainloopMma,
  // docs/dropout_sm90.md section 6): under S^T and dP^T a thread holds their
  // fp32 accumulators and dK's and dV's. With at least 48 of its registers
  // to spare beside them (d128 48, d96 80, the split design 80-128) the
  // draws run there; the 128-row d64 tile makes P^T in 16-bit registers in
  // its pass (kShuffleRowStats, score mods) and has no fp32 P^T to zero.
  // plan.h's bwd_sm90_draws_dropout, which bwd_launch.h checks against this.
  static constexpr int kAccumulatorRegisters =
      (2 * kBlockN * kBlockM + kBlockN * (kHeadDim + kHeadDimV)) / kNThreads;
  static constexpr bool kDrawsDropout =
      !kShuffleRowStats && kMmaRegisters - kAccumulatorRegisters >= 48;

  // Q, dO, K, V: (rows, head dim) in the swizzle of SmemLayoutAtom below.
  using SmemLayoutAtom =
      std::conditional_t<kSwizzleRow == 64, GMMA::Layout_K_SW128_Atom<Element>,
                         std::conditional_t<kSwizzleRow == 32, GMMA::Layout_K_SW64_Atom<Element>,
                                            GMMA::Layout_K_SW32_Atom<Element>>>;
  // Q and dO have kStages buffers (stages of the producer's pipeline).
  static constexpr int kStages = kStages_;
  using SmemLayoutQdO =
      decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStages>>{}));
  // One buffer of it: what one TMA copy of Q or dO fills.
  using SmemLayoutQdOBuffer =
      decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  // Q and dO seen as (head dim, query): the B operands of dK and dV.
  using SmemLayoutQdOt = decltype(composition(
      SmemLayoutQdO{},
      make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockM>, Int<kStages>>{}, Step<_2, _1, _3>{})));
  // dO at d_v columns: its stages, one buffer, and its (d_v, query) view.
  using SmemLayoutdO = decltype(tile_to_shape(SmemLayoutAtom{},
                                              Shape<Int<kBlockM>, Int<kHeadDimV>, Int<kStages>>{}));
  using SmemLayoutdOBuffer =
      decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockM>, Int<kHeadDimV>>{}));
  using SmemLayoutdOt = decltype(composition(
      SmemLayoutdO{}, make_ordered_layout(Shape<Int<kHeadDimV>, Int<kBlockM>, Int<kStages>>{},
                                          Step<_2, _1, _3>{})));
  using SmemLayoutKV =
      decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // V (and the epilogue's dV over it) at d_v columns.
  using SmemLayoutV =
      decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockN>, Int<kHeadDimV>>{}));
  // K seen as (head dim, key): the B operand of dQ.
  using SmemLayoutKt = decltype(composition(
      SmemLayoutKV{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Step<_2, _1>{})));
  // dS as (query, key) with the queries contiguous, dQ's A operand read
  // MN-major; the warpgroups write it as dS^T (key, query), each thread two
  // neighbouring queries of a key at a time. Seen as (key, query), the same
  // bytes are the K-major A operand of dK in the split design; P^T, stored
  // only there, has the same layout. Two buffers, so that a warpgroup may
  // write the next query block's while the other still reads this one's.
  static constexpr int kDSBuffers = 2;
  using SmemLayoutdS = decltype(tile_to_shape(
      GMMA::Layout_MN_SW128_Atom<Element>{}, Shape<Int<kBlockM>, Int<kBlockN>, Int<kDSBuffers>>{}));
  using SmemLayoutdSt = decltype(composition(
      SmemLayoutdS{}, make_ordered_layout(Shape<Int<kBlockN>, Int<kBlockM>, Int<kDSBuffers>>{},
                                          Step<_2, _1, _3>{})));

  // Registers -> shared for dS and the dK / dV epilogue: a thread holds
  // pairs of neighbouring columns of an accumulator.
  using SmemCopyAtomStore = Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<32>, Element>;

  // The epilogue's dK / dV stores (bwd_block_io.h).
  using GmemCopy = GmemTileCopy<Element, kHeadDim, kNThreads>;
  static_assert(kBlockN % GmemCopy::kRowsPerPass == 0, "the epilogue stores whole passes");
  using GmemTiledCopyStore = typename GmemCopy::Store;
  using GmemCopyV = GmemTileCopy<Element, kHeadDimV, kNThreads>;
  static_assert(kBlockN % GmemCopyV::kRowsPerPass == 0, "the epilogue stores whole passes");
  using GmemTiledCopyStoreV = typename GmemCopyV::Store;

  static constexpr int kSmemSizeQdOBuffer = kBlockM * kHeadDim * int(sizeof(Element));
  static constexpr int kSmemSizeQdO = kStages * kSmemSizeQdOBuffer;
  static constexpr int kSmemSizedOBuffer = kBlockM * kHeadDimV * int(sizeof(Element));
  static constexpr int kSmemSizedO = kStages * kSmemSizedOBuffer;
  static constexpr int kSmemSizeKV = kBlockN * kHeadDim * int(sizeof(Element));
  static constexpr int kSmemSizeV = kBlockN * kHeadDimV * int(sizeof(Element));
  static constexpr int kSmemSizedS = kDSBuffers * kBlockM * kBlockN * int(sizeof(Element));
  static constexpr int kSmemSizeP = kKeysPerWarpGroup ? 0 : kSmemSizedS;
  // The lse and D = rowsum(dO * O) of each stage's query block, fp32.
  static constexpr int kSmemSizeRowStats = kStages * 2 * kBlockM * int(sizeof(float));
  // dQ's staging buffer (kDQThroughSmem), one query block in fp32.
  static constexpr int kSmemSizeDQ = kDQThroughSmem ? kBlockM * kHeadDim * int(sizeof(float)) : 0;
  static constexpr int kSmemSizeTiles = kSmemSizeQdO + kSmemSizedO + kSmemSizeKV + kSmemSizeV +
                                        kSmemSizedS + kSmemSizeP + kSmemSizeRowStats + kSmemSizeDQ;
  using Barriers = BwdSm90Barriers<kStages>;
  static_assert(kSmemSizeTiles % 8 == 0, "the mbarriers follow the tiles");
  static_assert((kSmemSizeTiles - kSmemSizeDQ) % 128 == 0,
                "dQ's staging buffer starts aligned for the bulk reduction (16 bytes)");
  static constexpr int kSmemSize = kSmemSizeTiles + int(sizeof(Barriers));
};

}  // namespace flash
