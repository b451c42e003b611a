// The one table of backward tile configurations, per compiled head dim (and
// specialised (d_qk, d_v) pair, below the table).
//
// A thread block owns kBlockN keys and loops over query blocks of kBlockM
// rows. Warps tile each of the three GEMM shapes on their own grid:
//   S = Q K^T and dP = dO V^T   (kBlockM x kBlockN): kAtomLayoutMSdP warps on M
//   dK = dS^T Q, dV = P^T dO    (kBlockN x head dim): kAtomLayoutNdKV warps on N
//   dQ = dS K                   (kBlockM x head dim): kAtomLayoutMdQ warps on M
// The remaining warps of each grid tile its second dimension. dK and dV stay
// in registers for the whole loop, which is what bounds kBlockN * head dim.
// kDoubleBufferQdO loads the next Q and dO tiles during the current block's
// math; it is off where the second copy would not fit in an sm80's 163 KiB.
// kDQBeforeDK runs the dQ GEMM and issues its atomics before the dK GEMM, so
// that the atomics drain while the dK MMAs run, instead of ending the
// iteration with every warp waiting on the memory pipe (plain variant only;
// the softcap/ALiBi/dropout variant keeps dK first).
//
// The d64, d128 and d256 rows come from benchmarks/microbench/run_bwd_tile_sweep.sh
// (PERF_LOG 2026-11-22 78fc583, 2026-11-22 fe18f62): d64 128 x 128 with SdP
// atoms 2 and Q / dO double-buffered, which fits an sm80 block; d128 64 x 128
// double-buffered, well ahead of the 128 x 64 and 64 x 64 tiles; d256 64 x 64
// single-buffered, since double buffering needs more shared memory than an
// sm80 block may have (BwdTileConfigLargeSmem below takes it where it fits).
// dQ before dK won at d64, was level at d128 and lost at d256 (PERF_LOG
// 2026-11-22 80906c6). Head dims 32 and 96 follow 64 and 128, 160-224 follow
// 256 (not measured).
#pragma once

#include "cuda/core/head_dim_slabs.h"

namespace flash {

// Keyed on the compiled (d_qk, d_v): d_v = d_qk for every head dim (a
// smaller d_v runs on it with dO's and V's extra columns zero: level 1,
// docs/head_dims_dv_and_512.md section 1), plus the specialised pairs below.
template <int kHeadDim, int kHeadDimV = kHeadDim>
struct BwdTileConfig;

// clang-format off
//                         head dim      block M  block N  warps  SdP  dKV  dQ   Hopper block M;  double buffer, dQ before dK
template <> struct BwdTileConfig<32>  { static constexpr int kBlockM = 64,  kBlockN = 128, kNWarps = 8, kAtomLayoutMSdP = 2, kAtomLayoutNdKV = 4, kAtomLayoutMdQ = 4, kBlockMSm90 = 64; static constexpr bool kDoubleBufferQdO = true, kDQBeforeDK = true; };
template <> struct BwdTileConfig<64>  { static constexpr int kBlockM = 128, kBlockN = 128, kNWarps = 8, kAtomLayoutMSdP = 2, kAtomLayoutNdKV = 4, kAtomLayoutMdQ = 4, kBlockMSm90 = 128; static constexpr bool kDoubleBufferQdO = true, kDQBeforeDK = true; };
template <> struct BwdTileConfig<96>  { static constexpr int kBlockM = 64,  kBlockN = 128, kNWarps = 8, kAtomLayoutMSdP = 2, kAtomLayoutNdKV = 4, kAtomLayoutMdQ = 4, kBlockMSm90 = 64; static constexpr bool kDoubleBufferQdO = true, kDQBeforeDK = true; };
template <> struct BwdTileConfig<128> { static constexpr int kBlockM = 64,  kBlockN = 128, kNWarps = 8, kAtomLayoutMSdP = 2, kAtomLayoutNdKV = 4, kAtomLayoutMdQ = 2, kBlockMSm90 = 64; static constexpr bool kDoubleBufferQdO = true, kDQBeforeDK = true; };
template <> struct BwdTileConfig<160> { static constexpr int kBlockM = 64,  kBlockN = 64,  kNWarps = 8, kAtomLayoutMSdP = 4, kAtomLayoutNdKV = 4, kAtomLayoutMdQ = 4, kBlockMSm90 = 64; static constexpr bool kDoubleBufferQdO = true, kDQBeforeDK = false; };
template <> struct BwdTileConfig<192> { static constexpr int kBlockM = 64,  kBlockN = 64,  kNWarps = 8, kAtomLayoutMSdP = 4, kAtomLayoutNdKV = 2, kAtomLayoutMdQ = 2, kBlockMSm90 = 64; static constexpr bool kDoubleBufferQdO = true, kDQBeforeDK = false; };
template <> struct BwdTileConfig<224> { static constexpr int kBlockM = 64,  kBlockN = 64,  kNWarps = 8, kAtomLayoutMSdP = 4, kAtomLayoutNdKV = 4, kAtomLayoutMdQ = 4, kBlockMSm90 = 64; static constexpr bool kDoubleBufferQdO = false, kDQBeforeDK = false; };
template <> struct BwdTileConfig<256> { static constexpr int kBlockM = 64,  kBlockN = 64,  kNWarps = 8, kAtomLayoutMSdP = 4, kAtomLayoutNdKV = 2, kAtomLayoutMdQ = 2, kBlockMSm90 = 64; static constexpr bool kDoubleBufferQdO = false, kDQBeforeDK = false; };
template <> struct BwdTileConfig<512> { static constexpr int kBlockM = 32,  kBlockN = 32,  kNWarps = 4, kAtomLayoutMSdP = 2, kAtomLayoutNdKV = 2, kAtomLayoutMdQ = 2, kBlockMSm90 = 0;  static constexpr bool kDoubleBufferQdO = false, kDQBeforeDK = false; };
// clang-format on

// kBlockMSm90: the query rows per block of the Hopper kernel
// (bwd_kernel_sm90.h; bwd_kernel_traits_sm90.h has its two designs; 0:
// the SM80 kernel runs that head dim on sm90 too). A divisor of kBlockM, so
// that the dQ accumulator, padded to whole kBlockM blocks, fits it too. d160
// and d224, whose head-dim halves (80, 112) only fit the 32-byte swizzle, run
// the Hopper kernel since its warp specialization made it faster than the
// SM80 one there (PERF_LOG 2026-11-24 81742f7; before, it was not: PERF_LOG
// 2026-11-24 e4bfd00).
// Same kBlockN. d64 takes the table's 128 rows, FA4's 128 x 128 (PERF_LOG
// "Hopper design", hypothesis 2): S^T / dP^T as N = 128 wgmmas and half the
// fixed costs per query block of 64 rows. 128 rows spilled (PERF_LOG
// 2026-11-24 ee3e75a) until the MMA threads shuffled the row statistics in,
// masked by compile-time column offsets and, with score mods, made P^T / dS^T
// in their 16-bit registers (BwdSm90KernelTraits::kShuffleRowStats; PERF_LOG
// 2026-11-29, d64 with 128-row query blocks).
//
// Head dim 512 (docs/head_dims_dv_and_512.md section 3, "SM80"): the SM80
// kernel only, in two passes over head-dim slabs of 256 columns
// (slab_cols, cuda/core/head_dim_slabs.h): each pass recomputes S and dP at the full width and
// accumulates dK, dV and dQ of its slab, so that the accumulators are d256's
// (dK + dV 32 x 256 over 4 warps: 128 registers a thread). 32 x 32 with Q,
// dO, K and V whole: 132.25 KiB of shared memory, which sm80 and sm90 blocks
// hold and sm86 / sm89 blocks (99 KiB) do not (plan_bwd refuses there).
// Correctness first: the recompute makes 7 units of MMA work of the 5 a
// single pass does.
//
// Specialised pairs: a Hopper kernel only (plan_bwd sends the pair's SM80
// calls to d_qk's row at level 1), whose block shape is d_qk's, so that the
// accumulators, the grid and the deterministic dQ splits are sized by
// d_qk's row (bwd_block_shape).
//   (192, 128), DeepSeek MLA training: d192's split design, 64 x 64
//   (docs/head_dims_dv_and_512.md, "The (192, 128) tiles"). Per MMA thread,
//   S^T and dP^T 64 x 32 (16 + 16 registers), dK 64 x 96 (48), dV 64 x 64
//   (32): 112 accumulators of its 240, against d192's 128. Shared memory,
//   two Q / dO stages: Q 48 KiB + dO 32 + K 24 + V 16 + dS 16 + P^T 16 +
//   statistics 1 = 153 KiB (d192: 177). The keys-per-warpgroup design
//   (128 keys) would hold dK 64 x 192 + dV 64 x 128 + S^T + dP^T 64 x 64 =
//   224 accumulators, over 240 with addresses.
template <>
struct BwdTileConfig<192, 128> : BwdTileConfig<192> {};

// kBwdSm90QdOStages: the Q / dO buffers of the Hopper kernel's producer
// pipeline. 3 stages were no faster than 2 (PERF_LOG 2026-11-24 29b2865),
// which take 32 KiB less shared memory (and d256 has room for 2 only:
// 225 KiB).
constexpr int kBwdSm90QdOStages = 2;
//
// bwd_sm90_stage_dq: whether the Hopper kernel's MMA warps hand each query
// block's dQ to a producer warp through shared memory, which adds it with one
// bulk reduction (bwd_kernel_traits_sm90.h, kDQThroughSmem), instead of
// adding their fragments with per-thread reductions. The ordered
// (deterministic) variant always stages where the design has room (head dims
// up to 128): the writer warp then waits for the turns, not the MMA warps
// (+12-20%, PERF_LOG 2026-11-29 527b077). The default variant stages above
// d64 only: staging made d128 2-3.5% faster but d64 2.6-3.0% slower (same
// entry), whose shorter query blocks leave the single staging buffer's bulk
// reduction exposed.
template <int kHeadDim>
constexpr bool bwd_sm90_stage_dq(bool ordered_dq) {
  return ordered_dq || kHeadDim > 64;
}
//
// Tiles for devices whose blocks may opt in to more shared memory than an
// sm80 block's 163 KiB (sm90: 227 KiB), at the head dims where that pays; the
// plan takes one when the device has room for it, for the plain kernel
// variant, and for the softcap/ALiBi/dropout one where kServesScoreExtras.
// A tile of another block shape or warp layout than the table's has its own
// grid (plan.block_n) and accumulator layout (its conversion kernels); the
// host sizes the accumulators by the larger of the two (bwd_block_shape).
//   256: Q and dO double-buffered (209 KiB) and dQ before dK, faster in the
//        microbench and in the whole backward (PERF_LOG 2026-11-22
//        (microbench), 2026-11-22 31bd5d4). Plain variant only.
//   512: 32 x 64 with 8 warps (200.25 KiB, K and V of 64 keys whole): 0.73-
//        0.85x the time of the table's 32 x 32 with 4 warps (PERF_LOG
//        2026-12-01, "d512 backward tiles"), twice the warps an SM and each
//        Q / dO tile used by twice the keys. Both variants.
template <int kHeadDim>
struct BwdTileConfigLargeSmem {
  static constexpr bool kExists = false, kServesScoreExtras = false;
  static constexpr int kBlockM = 0, kBlockN = 0;  // none
};
template <>
struct BwdTileConfigLargeSmem<256> : BwdTileConfig<256> {
  static constexpr bool kExists = true, kServesScoreExtras = false;
  static constexpr bool kDoubleBufferQdO = true, kDQBeforeDK = true;
};
template <>
struct BwdTileConfigLargeSmem<512> : BwdTileConfig<512> {
  static constexpr bool kExists = true, kServesScoreExtras = true;
  static constexpr int kBlockN = 64, kNWarps = 8, kAtomLayoutNdKV = 4;
};

// The block shape of a compiled head dim, for the host code that sizes the dQ
// accumulator and the dK / dV sums (padded to whole blocks); zeros for a head
// dim with no entry. The grid's key blocks are the plan's (BwdPlan::block_n).
struct BwdBlockShape {
  int block_m;
  int block_n;
  int slabs = 1;  // head-dim slabs of the SM80 kernel (slab_cols); the dK / dV
                  // sums under GQA and the deterministic turns count (key block, slab)
};

// The table's tile, or the large-shared-memory one where it is larger: an
// accumulator padded to these blocks holds either kernel's.
template <int kHeadDim>
constexpr BwdBlockShape bwd_block_shape_of() {
  using C = BwdTileConfig<kHeadDim>;
  using L = BwdTileConfigLargeSmem<kHeadDim>;  // block shape 0 x 0 where none exists
  constexpr int block_m = L::kBlockM > C::kBlockM ? L::kBlockM : C::kBlockM;
  constexpr int block_n = L::kBlockN > C::kBlockN ? L::kBlockN : C::kBlockN;
  if constexpr (L::kExists) {
    static_assert(block_m % L::kBlockM == 0 && block_m % C::kBlockM == 0 &&
                      block_n % L::kBlockN == 0 && block_n % C::kBlockN == 0,
                  "blocks of either tile divide the accumulators' blocks");
  }
  return {block_m, block_n, kHeadDim / slab_cols(kHeadDim)};
}

inline BwdBlockShape bwd_block_shape(int compiled_head_dim) {
  switch (compiled_head_dim) {
    case 32: return bwd_block_shape_of<32>();
    case 64: return bwd_block_shape_of<64>();
    case 96: return bwd_block_shape_of<96>();
    case 128: return bwd_block_shape_of<128>();
    case 160: return bwd_block_shape_of<160>();
    case 192: return bwd_block_shape_of<192>();
    case 224: return bwd_block_shape_of<224>();
    case 256: return bwd_block_shape_of<256>();
    case 512: return bwd_block_shape_of<512>();
    default: return {0, 0};
  }
}

}  // namespace flash
