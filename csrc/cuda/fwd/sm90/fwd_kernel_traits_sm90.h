// Compile-time shape of the Hopper (sm90a) forward kernel: warpgroup MMAs
// (wgmma) read Q, K and V straight from shared memory, so the tiles are laid
// out in the canonical GMMA layouts instead of the ldmatrix-friendly ones of
// fwd_kernel_traits_sm80.h, and TMA fills them.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "cuda/core/gmem_tile_copy.h"

namespace flash {

using namespace cute;

// The mbarriers of the Hopper forward's pipeline, after its tiles in shared
// memory. A stage's phase flips each time it is filled (full) or handed back
// (empty).
template <int kStages>
struct FwdSm90Barriers {
  uint64_t q_full;
  uint64_t q_empty;
  uint64_t k_full[kStages];
  uint64_t v_full[kStages];
  uint64_t k_empty[kStages];
  uint64_t v_empty[kStages];
  // A persistent grid scheduled by a counter (fwd_kernel_sm90.h): the
  // next tile a block took, published in one slot (full) and handed back once
  // everyone has read it (empty).
  uint64_t tile_full;
  uint64_t tile_empty;
  int64_t scheduled_tile;
};

// kHeadDim is d_qk, the width of Q and K; kHeadDimV is d_v, the width of V
// and O (the N of O += P V). A level-1 call (d_v below the compiled width,
// docs/head_dims_dv_and_512.md section 1) runs kHeadDimV = kHeadDim with V's
// extra columns zero; a specialised pair, (192, 128), has its own.
// kStages_: the K / V buffers, two but for the row gather's kernel
// (kGatherStages).
template <int kHeadDim_, int kBlockM_, int kBlockN_, typename Element_, int kHeadDimV_ = kHeadDim_,
          int kStages_ = 2>
struct FwdSm90KernelTraits {
  using Element = Element_;
  using ElementAccum = float;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  // One MMA warpgroup (4 warps) per 64 query rows: wgmma's M is 64, and a
  // row's scores stay inside one warp (the quad reductions of softmax.h
  // hold). One more warpgroup loads the tiles (fwd_kernel_sm90.h).
  static constexpr int kNMmaWarpGroups = kBlockM / 64;
  static constexpr int kNMmaThreads = 128 * kNMmaWarpGroups;
  static constexpr int kNThreads = kNMmaThreads + 128;
  static_assert(kNMmaWarpGroups == 2 || kNMmaWarpGroups == 3,
                "one producer and two or three MMA warpgroups");
  static_assert(kHeadDim % 32 == 0 && kHeadDimV % 32 == 0,
                "compiled head dims are multiples of 32");
  static_assert(kHeadDimV <= kHeadDim, "d_v <= d_qk (api/head_dims.h)");
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "wgmma N of Q K^T");
  // Registers move from the producer, which only issues copies, to the MMA
  // warpgroups (setmaxnreg): 24 + 2 x 240 per thread fits the 64 K register
  // file at 384 threads, 24 + 3 x 160 at 512.
  static constexpr int kProducerRegisters = 24;
  // Paged keys in pages that give boxes below kPagedBoxesMinRows are gathered by
  // the producer warpgroup's threads (FwdSm90MainloopLoad), each 16 bytes of
  // kThreadsPerRow consecutive threads per row piece, so a warp reads whole
  // 64- or 128-byte row pieces and the chunks of one swizzle-atom row land
  // on distinct banks. All four warps where their rows per pass divide the
  // key tile, else two (d224's 80 keys by 32-row passes).
  static constexpr int kNGatherThreads =
      kBlockN % (128 / GmemTileCopy<Element, kHeadDim, 128>::kThreadsPerRow) == 0 ? 128 : 64;
  using GmemTiledCopyKVGather = typename GmemTileCopy<Element, kHeadDim, kNGatherThreads>::Load;
  static_assert(kBlockN % GmemTileCopy<Element, kHeadDim, kNGatherThreads>::kRowsPerPass == 0,
                "the gather's passes tile the key tile");
  // One gather copy for K and V (FwdSm90MainloopLoad::gather_paged_key_tile
  // over a stage of either width): both widths split into row pieces of one
  // size, as both fill SmemLayoutAtom's rows, so a thread's rows, and the
  // lane that looks each up, are the same in K's stage and V's.
  static_assert(GmemTileCopy<Element, kHeadDimV, 128>::kThreadsPerRow ==
                    GmemTileCopy<Element, kHeadDim, 128>::kThreadsPerRow,
                "K and V rows in pieces of one size (both widths multiples of 64, or neither)");
  static constexpr int kMmaRegisters = kNMmaWarpGroups == 2 ? 240 : 160;
  // The row gather's instantiation (fwd_kernel_sm90.h, FwdSm90Keys::kPagedGather)
  // at head dims up to 128 with two MMA warpgroups: 56 + 2 x 224. Its
  // producer computes page lookups and row addresses and spilled them at 24
  // registers (ptxas, d128: 348-632 bytes); at 56 the H200 ran paged prefill
  // 5-7% faster (PERF_LOG 2026-11-29, paged registers). The TMA boxes, one
  // thread's like the contiguous keys', keep 24 + 2 x 240 in a kernel of
  // their own (kGatherRegisterSplit). At d192 / d256 the MMA warpgroups
  // spill inside their key loop at 224, and three MMA warpgroups have no
  // registers to give: those keep 24 + 240 / 160, and one paged
  // instantiation serves boxes and gather alike.
  static constexpr bool kGatherRegisterSplit = kNMmaWarpGroups == 2 && kHeadDim <= 128;
  static constexpr int kGatherProducerRegisters = kGatherRegisterSplit ? 56 : kProducerRegisters;
  static constexpr int kGatherMmaRegisters = kGatherRegisterSplit ? 224 : kMmaRegisters;
  static_assert(kGatherProducerRegisters * 128 + kGatherMmaRegisters * kNMmaThreads <=
                    kProducerRegisters * 128 + kMmaRegisters * kNMmaThreads,
                "the paged split takes no more of the register file than the plain one");
  // Whether the score-mods variant draws dropout (FwdSm90MainloopMma): under
  // S = Q K^T a thread holds S's and O's fp32 accumulators and P's 16-bit
  // pairs in flight. With 80 registers to spare beside them (d128) the
  // draws fit; with 52 (d256 at 80 keys) or 32 (d64's three warpgroups of
  // 160) they spilled in the loop (PERF_LOG 2026-11-29, issue 57 step 1), so
  // those head dims draw on tiles of their own (plan.h fwd_sm90_dropout_tile).
  // plan.h's fwd_sm90_draws_dropout, which fwd_launch.h checks against this.
  static constexpr int kInFlightRegisters = kBlockN / 2 + kHeadDimV / 2 + kBlockN / 4;
  static constexpr bool kDrawsDropout = kMmaRegisters - kInFlightRegisters >= 64;

  using WarpGroupLayout = Layout<Shape<Int<kNMmaWarpGroups>, _1, _1>>;
  // S = Q K^T: both operands from shared memory, K-major (head dim contiguous).
  using TiledMmaS =
      decltype(make_tiled_mma(SM90::GMMA::ss_op_selector<Element, Element, ElementAccum,
                                                         Shape<_64, Int<kBlockN>, Int<kHeadDim>>>(),
                              WarpGroupLayout{}));
  // O += P V: P from registers (the S accumulator converted in place), V from
  // shared memory read along the head dim (MN-major), so V is never transposed.
  using TiledMmaO =
      decltype(make_tiled_mma(SM90::GMMA::rs_op_selector<Element, Element, ElementAccum,
                                                         Shape<_64, Int<kHeadDimV>, Int<kBlockN>>,
                                                         GMMA::Major::K, GMMA::Major::MN>(),
                              WarpGroupLayout{}));
  // One wgmma instruction as wide as the tile: many of these widths (80, 96,
  // 112, 160, 224) are among CuTe's "extended" shapes, which its op selector only
  // offers when the file defines CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED first
  // (the instantiation files that need it do: generate_instantiations.py);
  // without it, it quietly tiles N = 16 or 32 instructions, and a 128 x 80
  // tile at d256 ran much slower than with one N = 80 (PERF_LOG 2026-11-25
  // 9de55ab).
  static_assert(size<1>(typename TiledMmaS::AtomShape_MNK{}) == kBlockN &&
                    size<1>(typename TiledMmaO::AtomShape_MNK{}) == kHeadDimV,
                "wgmma narrower than the tile: define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED before "
                "any CuTe header in this file (generate_instantiations.py)");

  // The widest swizzle whose row both head dims fill: 128-byte rows (64
  // elements) spread wgmma's 8-row core matrices over all banks. TMA writes
  // the tiles in the same swizzle; one atom for every tile keeps one box
  // width for paged K and V (FwdSm90Tma::kAtomCols).
  using SmemLayoutAtom =
      std::conditional_t<kHeadDim % 64 == 0 && kHeadDimV % 64 == 0,
                         GMMA::Layout_K_SW128_Atom<Element>, GMMA::Layout_K_SW64_Atom<Element>>;
  using SmemLayoutQ =
      decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  // Two stages each of K and V: a stage is refilled once every MMA warpgroup's
  // wgmmas have read it, so the next tile's copy overlaps this tile's math.
  static constexpr int kStages = kStages_;
  using SmemLayoutK =
      decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutV = decltype(tile_to_shape(SmemLayoutAtom{},
                                             Shape<Int<kBlockN>, Int<kHeadDimV>, Int<kStages>>{}));
  // What one TMA copy fills.
  using SmemLayoutKStage = decltype(SmemLayoutK{}(_, _, _0{}));
  using SmemLayoutVStage = decltype(SmemLayoutV{}(_, _, _0{}));
  // V seen as (head dim, key): a K-major atom read transposed is the MN-major
  // atom of the same swizzle, which is what P V's B operand asks for.
  using SmemLayoutVt = decltype(composition(
      SmemLayoutV{}, make_ordered_layout(Shape<Int<kHeadDimV>, Int<kBlockN>, Int<kStages>>{},
                                         Step<_2, _1, _3>{})));
  using SmemLayoutO =
      decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockM>, Int<kHeadDimV>>{}));

  // O stores: by all MMA warpgroups (a block that sees no key), or by each
  // warpgroup for its own 64 rows.
  using GmemTiledCopyO = typename GmemTileCopy<Element, kHeadDimV, kNMmaThreads>::Store;
  using GmemTiledCopyOWarpGroup = typename GmemTileCopy<Element, kHeadDimV, 128>::Store;
  // Registers -> shared for O: a thread holds column pairs of the accumulator.
  using SmemCopyAtomO = Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<32>, Element>;

  static constexpr int kSmemSizeQ = kBlockM * kHeadDim * int(sizeof(Element));
  static constexpr int kSmemSizeO = kBlockM * kHeadDimV * int(sizeof(Element));
  static constexpr int kSmemSizeKStage = kBlockN * kHeadDim * int(sizeof(Element));
  static constexpr int kSmemSizeVStage = kBlockN * kHeadDimV * int(sizeof(Element));
  using Barriers = FwdSm90Barriers<kStages>;
  static constexpr int kSmemSizeBarriers = int(sizeof(Barriers));
  static constexpr int kSmemSizeQKV = kSmemSizeQ + kStages * (kSmemSizeKStage + kSmemSizeVStage);
  // O is staged in a tile of its own where shared memory allows (227 KB a
  // block on sm90), so that a persistent block's next Q can land while this
  // query block's O is written out; else over Q (which is at least as large:
  // d_v <= d_qk).
  static constexpr bool kSeparateO = kSmemSizeQKV + kSmemSizeO + kSmemSizeBarriers <= 227 * 1024;
  // Only then does a block walk several query blocks (the next one's Q
  // would otherwise wait for this one's O to leave).
  static constexpr bool kPersistent = kSeparateO;
  static constexpr int kSmemSizeTiles = kSmemSizeQKV + (kSeparateO ? kSmemSizeO : 0);
  static constexpr int kSmemSize = kSmemSizeTiles + kSmemSizeBarriers;
  static_assert(kSmemSize <= 227 * 1024, "Q, the stages of K and V, and the mbarriers fit");
  // The row gather's kernel (FwdSm90GatherTraits in fwd_launch.h) takes a
  // third stage of K and V where its register split applies and Q with three
  // stages fits a block, O then staged over Q (so one block per tile at
  // d128): its MMA warpgroups waited on the full barriers of K and V where
  // the TMA kernels' did not (ncu of pages of 16 rows, PERF_LOG 2026-12-01
  // "a third stage for the row gather"), so the gather gets a key tile more
  // of lead. plan.h's fwd_sm90_kv_stages, which fwd_launch.h checks against
  // this.
  static constexpr int kGatherStages =
      kGatherRegisterSplit && kSmemSizeQ + 3 * (kSmemSizeKStage + kSmemSizeVStage) +
                                      int(sizeof(FwdSm90Barriers<3>)) <=
                                  227 * 1024
          ? 3
          : 2;
};

}  // namespace flash
