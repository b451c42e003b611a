// The one table of backward tile configurations, per compiled head dim.
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
// From benchmarks/microbench/run_bwd_tile_sweep.sh on an H200 (bf16, whole
// backward, seqlen 16384, non-causal / causal TFLOP/s):
//   64:  128x128 w8 2,4,4 double 243.6 / 239.7 (132 B spill); same run:
//        4,4,4 single 232.0 / 218.9, 2,4,4 single 231.1 / 225.6, 4,4,2 single
//        238.1 / 233.0, 4,2,4 single 226.4 / 220.2, 64x128 2,4,4 double
//        224.7 / 223.6. (An earlier sweep, before the dQ-atomics change, had
//        found the double-buffered 128x128 no faster.) 160 KiB of smem: fits
//        an sm80 block (163 KiB).
//   128: 64x128 w8 2,4,2 double 208 / 207 (single: 193 / 194; 128x64 and
//        64x64 tiles: 131-157).
//   256: 64x64 w8 4,2,2 single 142 / 144 (204.9 / 210.2 after the
//        dQ-atomics change; 2,4,4: 191.7 / 196.1); double buffering gave
//        147 / 149 but needs 208 KiB, more than an sm80 block may have.
// dQ before dK, H100, seqlen 16384, same tiles (lse and D read from shared
// memory in both): d64 254.6 -> 274.3 / 249.0 -> 270.0, d128 296.3 -> 298.8 /
// 296.0 -> 297.6, d256 209.2 -> 203.6 / 210.3 -> 209.0. Head dims 32 and 96
// follow 64 and 128, 160-224 follow 256 (not measured).
#pragma once

namespace flash {

template <int kHeadDim>
struct BwdTileConfig;

// clang-format off
//                         head dim      block M  block N  warps  SdP  dKV  dQ   Hopper block M;  double buffer, dQ before dK
template <> struct BwdTileConfig<32>  { static constexpr int kBlockM = 64,  kBlockN = 128, kNWarps = 8, kAtomLayoutMSdP = 2, kAtomLayoutNdKV = 4, kAtomLayoutMdQ = 4, kBlockMSm90 = 64; static constexpr bool kDoubleBufferQdO = true, kDQBeforeDK = true; };
template <> struct BwdTileConfig<64>  { static constexpr int kBlockM = 128, kBlockN = 128, kNWarps = 8, kAtomLayoutMSdP = 2, kAtomLayoutNdKV = 4, kAtomLayoutMdQ = 4, kBlockMSm90 = 64; static constexpr bool kDoubleBufferQdO = true, kDQBeforeDK = true; };
template <> struct BwdTileConfig<96>  { static constexpr int kBlockM = 64,  kBlockN = 128, kNWarps = 8, kAtomLayoutMSdP = 2, kAtomLayoutNdKV = 4, kAtomLayoutMdQ = 4, kBlockMSm90 = 64; static constexpr bool kDoubleBufferQdO = true, kDQBeforeDK = true; };
template <> struct BwdTileConfig<128> { static constexpr int kBlockM = 64,  kBlockN = 128, kNWarps = 8, kAtomLayoutMSdP = 2, kAtomLayoutNdKV = 4, kAtomLayoutMdQ = 2, kBlockMSm90 = 64; static constexpr bool kDoubleBufferQdO = true, kDQBeforeDK = true; };
template <> struct BwdTileConfig<160> { static constexpr int kBlockM = 64,  kBlockN = 64,  kNWarps = 8, kAtomLayoutMSdP = 4, kAtomLayoutNdKV = 4, kAtomLayoutMdQ = 4, kBlockMSm90 = 64; static constexpr bool kDoubleBufferQdO = true, kDQBeforeDK = false; };
template <> struct BwdTileConfig<192> { static constexpr int kBlockM = 64,  kBlockN = 64,  kNWarps = 8, kAtomLayoutMSdP = 4, kAtomLayoutNdKV = 2, kAtomLayoutMdQ = 2, kBlockMSm90 = 64; static constexpr bool kDoubleBufferQdO = true, kDQBeforeDK = false; };
template <> struct BwdTileConfig<224> { static constexpr int kBlockM = 64,  kBlockN = 64,  kNWarps = 8, kAtomLayoutMSdP = 4, kAtomLayoutNdKV = 4, kAtomLayoutMdQ = 4, kBlockMSm90 = 64; static constexpr bool kDoubleBufferQdO = false, kDQBeforeDK = false; };
template <> struct BwdTileConfig<256> { static constexpr int kBlockM = 64,  kBlockN = 64,  kNWarps = 8, kAtomLayoutMSdP = 4, kAtomLayoutNdKV = 2, kAtomLayoutMdQ = 2, kBlockMSm90 = 64; static constexpr bool kDoubleBufferQdO = false, kDQBeforeDK = false; };
// clang-format on

// kBlockMSm90: the query rows per block of the Hopper kernel
// (bwd_kernel_sm90.h; bwd_kernel_traits_sm90.h has its two designs; 0:
// the SM80 kernel runs that head dim on sm90 too). A divisor of kBlockM, so
// that the dQ accumulator, padded to whole kBlockM blocks, fits it too. H100
// microbench, Hopper against the SM80 kernel at seqlen 777-8192, whole
// backward: d160 1.10-1.31x and d224 1.24-1.42x, whose head-dim halves (80,
// 112) only fit the 32-byte swizzle
// (results/NVIDIA_H100/bwd_sm90_ws_d160_d224.txt; before the kernel's warp
// specialization they measured 0.92-0.96x and 0.97-1.07x and stayed on the
// SM80 kernel: bwd_sm90_wide_head_dims.txt).
// Same kBlockN. H100 microbench, d64, against the table's 128 rows: +0.5-1%
// and no spill (120 bytes at 128 rows).
//
// kBwdSm90QdOStages: the Q / dO buffers of the Hopper kernel's producer
// pipeline. H100 microbench, d128, main kernel: 2 against 3 stages
// 0.99-1.02x at seqlen 1000-16384, in 32 KiB less shared memory (and d256
// has room for 2 only: 225 KiB).
constexpr int kBwdSm90QdOStages = 2;
//
// Tiles for devices whose blocks may opt in to more shared memory than an
// sm80 block's 163 KiB (sm90: 227 KiB), at the head dims where that pays; the
// launcher takes one when the device has room for it, for the plain kernel
// variant (the softcap/ALiBi/dropout variant keeps the table's tile). Same
// kBlockN as the table's, which the grid and the deterministic dQ splits use.
//   256: Q and dO double-buffered (209 KiB) and dQ before dK: microbench,
//        H200, bf16, seqlen 4096 / 16384, non-causal and causal: 6.708 /
//        3.537 / 25.896 / 12.623 ms -> 6.328 / 3.448 / 24.537 / 12.103 ms
//        (results/NVIDIA_H200/bwd_d256_sweep.txt); whole backward against
//        SDPA FLASH at seqlen >= 2048: 0.81-0.93x -> 0.86-0.96x.
template <int kHeadDim>
struct BwdTileConfigLargeSmem {
  static constexpr bool kExists = false;
};
template <>
struct BwdTileConfigLargeSmem<256> : BwdTileConfig<256> {
  static constexpr bool kExists = true, kDoubleBufferQdO = true, kDQBeforeDK = true;
};

// The block shape of a compiled head dim, for the host code that sizes the dQ
// accumulator (padded to whole query blocks) and the deterministic dQ splits
// (one per key block at most); zeros for a head dim with no entry.
struct BwdBlockShape {
  int block_m;
  int block_n;
};

template <int kHeadDim>
constexpr BwdBlockShape bwd_block_shape_of() {
  return {BwdTileConfig<kHeadDim>::kBlockM, BwdTileConfig<kHeadDim>::kBlockN};
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
    default: return {0, 0};
  }
}

}  // namespace flash
