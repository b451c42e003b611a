// The one table of forward tile configurations, per compiled head dim.
// Head dims between two entries run on the next larger one with the extra
// columns predicated off. The numbers behind each choice are in
// benchmarks/PERF_LOG.md.
#pragma once

namespace flash {

template <int kHeadDim>
struct FwdTileConfig;

// Three tiles per head dim: the plain kernel's, the one of the variant that
// carries softcap / ALiBi / dropout, and the key block of the Hopper kernel
// (flash_fwd_sm90_kernel.h: 128 query rows, two warpgroups; 0 = the head dim
// stays on the SM80 kernel on sm90 too). The extras' extra registers make
// some tiles that win on the plain path spill heavily (d32 128 x 128: 120 B
// plain, 496 B with the extras, 231 vs 205 TFLOP/s plain but 62 vs 81 with
// extras). The Hopper kernel runs where it was measured faster than the SM80
// one (H100 microbench, PERF_LOG): d128 1.06-1.19x, d160 1.17-1.21x, d192
// 1.32-1.55x, d224 1.24-1.43x, d256 1.22-1.49x; not at d96 (0.92-1.01x) or
// d64 (0.81-0.95x), where the softmax, not the MMAs, bounds a tile.
//                         head dim       block M  block N  warps     extras: block N  warps     sm90: block N
template <> struct FwdTileConfig<32>  { static constexpr int kBlockM = 128, kBlockN = 128, kNWarps = 4, kBlockNExtras = 64, kNWarpsExtras = 4, kBlockNSm90 = 0; };
template <> struct FwdTileConfig<64>  { static constexpr int kBlockM = 128, kBlockN = 64,  kNWarps = 4, kBlockNExtras = 64, kNWarpsExtras = 4, kBlockNSm90 = 0; };
template <> struct FwdTileConfig<96>  { static constexpr int kBlockM = 128, kBlockN = 64,  kNWarps = 4, kBlockNExtras = 64, kNWarpsExtras = 4, kBlockNSm90 = 0; };
template <> struct FwdTileConfig<128> { static constexpr int kBlockM = 128, kBlockN = 64,  kNWarps = 4, kBlockNExtras = 32, kNWarpsExtras = 4, kBlockNSm90 = 128; };
template <> struct FwdTileConfig<160> { static constexpr int kBlockM = 128, kBlockN = 32,  kNWarps = 4, kBlockNExtras = 64, kNWarpsExtras = 8, kBlockNSm90 = 64; };
template <> struct FwdTileConfig<192> { static constexpr int kBlockM = 128, kBlockN = 64,  kNWarps = 8, kBlockNExtras = 64, kNWarpsExtras = 8, kBlockNSm90 = 64; };
template <> struct FwdTileConfig<224> { static constexpr int kBlockM = 128, kBlockN = 64,  kNWarps = 8, kBlockNExtras = 64, kNWarpsExtras = 8, kBlockNSm90 = 64; };
template <> struct FwdTileConfig<256> { static constexpr int kBlockM = 128, kBlockN = 64,  kNWarps = 8, kBlockNExtras = 64, kNWarpsExtras = 8, kBlockNSm90 = 64; };

// Compiled head dims, ascending; a request for head dim d runs on the first >= d.
constexpr int kCompiledHeadDims[] = {32, 64, 96, 128, 160, 192, 224, 256};

inline int round_up_head_dim(int head_dim) {
  for (int compiled : kCompiledHeadDims) {
    if (head_dim <= compiled) return compiled;
  }
  return -1;
}

}  // namespace flash
