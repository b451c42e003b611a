// The one table of forward tile configurations, per compiled head dim (and
// specialised (d_qk, d_v) pair).
// Head dims between two entries run on the next larger one with the extra
// columns predicated off. The numbers behind each choice are in
// benchmarks/PERF_LOG.md.
#pragma once

namespace flash {

// Keyed on the compiled (d_qk, d_v): d_v = d_qk for every head dim (a
// smaller d_v runs on it with V's extra columns zero: level 1,
// docs/head_dims_dv_and_512.md section 1), plus the specialised pairs below.
template <int kHeadDim, int kHeadDimV = kHeadDim>
struct FwdTileConfig;

// Three tiles per head dim: the plain kernel's, the one of the variant that
// carries softcap / ALiBi / dropout (on sm90, only dropout at d256 and a
// scale that is not positive and normal), and the Hopper kernel's (plain,
// or with softcap / ALiBi / dropout; dropout at d64 on its 128-row tile,
// plan.cpp's fwd_sm90_grid_block_m)
// (fwd_kernel_sm90.h: one MMA warpgroup per 64 query rows and a TMA
// producer; block N 0 = the head dim stays on the SM80 kernel on sm90 too),
// with the fewest keys (max seqlen_k) from which the Hopper kernel runs by
// default. The Hopper kernel's grid that takes its tiles from a counter
// (short causal / local / varlen calls, fwd_sm90_takes_tiles_from_counter in
// launch/plan.cpp) runs 128 query rows whatever block M says. d64 takes 192
// rows (three MMA warpgroups) elsewhere: its softmax is as long as its
// products, and with two warpgroups each warp's instruction stream stalls on
// its own latencies; a third warpgroup gives the schedulers another warp. On
// the counter grid 192 rows lost at 512-1024 keys, so it keeps 128 (PERF_LOG
// 2026-11-24 ffeaa39).
// The extras' extra registers make some tiles that win on the plain path
// spill heavily, so the extras variant of d32 and d160 keeps the smaller
// tile (PERF_LOG 2026-11-22 fe18f62).
// The Hopper kernel beats the SM80 one from d64 up at 4096-8192 keys, and
// at d160-256 everywhere measured; below the key threshold it lost on short
// calls of few query blocks (since then calls of many query blocks run it
// below the threshold too: fwd_sm90_by_shape in launch/plan.cpp). d32
// stays on SM80: little gain at long key counts, a loss at short ones. d64 /
// d96 take 128-key tiles, faster than 64-key ones (PERF_LOG 2026-11-24
// 4fb1ffe).
// Hopper key tiles at d160-256: the S = Q K^T wgmma of a 64-key tile reads as
// many shared-memory bytes per cycle as the SM gives, so wider tiles win as
// far as shared memory holds two stages of K and V: 96 keys at d160 / d192,
// 80 at d224 (96 spills) and d256. d192-256 lose the persistent grid with
// them (no room for a separate O tile) and still win. d128 keeps 128 keys:
// 144-192 were slower (PERF_LOG 2026-11-25 9de55ab).
// Below its key count the Hopper kernel runs calls of at least "blocks / SM"
// query blocks of 128 rows per SM (fwd_sm90_by_shape). 8 at d64, where it
// lost at 4 and was about level at 6; 4 at d96 / d128, where it won on every
// shape swept on one GPU and on balance on the other, whose losses were short
// calls, the worst causal ones of 17 query rows (PERF_LOG 2026-11-25 76288cf,
// 2026-11-25 7860f70, 2026-11-25 61bb2cb).
// clang-format off
//                         head dim       block M  block N  warps     extras: block N  warps     sm90: block M  block N  from keys  or blocks / SM
template <> struct FwdTileConfig<32>  { static constexpr int kBlockM = 128, kBlockN = 128, kNWarps = 4, kBlockNExtras = 64, kNWarpsExtras = 4, kBlockMSm90 = 128, kBlockNSm90 = 0,   kMinSeqlenKSm90 = 0,   kMinBlocksPerSmSm90 = 0; };
template <> struct FwdTileConfig<64>  { static constexpr int kBlockM = 128, kBlockN = 64,  kNWarps = 4, kBlockNExtras = 64, kNWarpsExtras = 4, kBlockMSm90 = 192, kBlockNSm90 = 128, kMinSeqlenKSm90 = 512, kMinBlocksPerSmSm90 = 8; };
template <> struct FwdTileConfig<96>  { static constexpr int kBlockM = 128, kBlockN = 64,  kNWarps = 4, kBlockNExtras = 64, kNWarpsExtras = 4, kBlockMSm90 = 128, kBlockNSm90 = 128, kMinSeqlenKSm90 = 512, kMinBlocksPerSmSm90 = 4; };
template <> struct FwdTileConfig<128> { static constexpr int kBlockM = 128, kBlockN = 64,  kNWarps = 4, kBlockNExtras = 32, kNWarpsExtras = 4, kBlockMSm90 = 128, kBlockNSm90 = 128, kMinSeqlenKSm90 = 256, kMinBlocksPerSmSm90 = 4; };
template <> struct FwdTileConfig<160> { static constexpr int kBlockM = 128, kBlockN = 32,  kNWarps = 4, kBlockNExtras = 64, kNWarpsExtras = 8, kBlockMSm90 = 128, kBlockNSm90 = 96,  kMinSeqlenKSm90 = 0,   kMinBlocksPerSmSm90 = 0; };
template <> struct FwdTileConfig<192> { static constexpr int kBlockM = 128, kBlockN = 64,  kNWarps = 8, kBlockNExtras = 64, kNWarpsExtras = 8, kBlockMSm90 = 128, kBlockNSm90 = 96,  kMinSeqlenKSm90 = 0,   kMinBlocksPerSmSm90 = 0; };
template <> struct FwdTileConfig<224> { static constexpr int kBlockM = 128, kBlockN = 64,  kNWarps = 8, kBlockNExtras = 64, kNWarpsExtras = 8, kBlockMSm90 = 128, kBlockNSm90 = 80,  kMinSeqlenKSm90 = 0,   kMinBlocksPerSmSm90 = 0; };
template <> struct FwdTileConfig<256> { static constexpr int kBlockM = 128, kBlockN = 64,  kNWarps = 8, kBlockNExtras = 64, kNWarpsExtras = 8, kBlockMSm90 = 128, kBlockNSm90 = 80,  kMinSeqlenKSm90 = 0,   kMinBlocksPerSmSm90 = 0; };
template <> struct FwdTileConfig<512> { static constexpr int kBlockM = 64,  kBlockN = 64,  kNWarps = 4, kBlockNExtras = 32, kNWarpsExtras = 4, kBlockMSm90 = 0,   kBlockNSm90 = 0,   kMinSeqlenKSm90 = 0,   kMinBlocksPerSmSm90 = 0; };
// Head dim 512: the SM80 kernel only, in two passes over 256-column slabs of V
// (cuda/core/head_dim_slabs.h), each recomputing S over all 512 columns, so
// that O is d256's (64 x 256 over 4 warps: 128 registers a thread). Q, K
// whole and a slab of V: 160 KiB, which sm80 and sm90 blocks hold and sm86 /
// sm89 blocks do not (plan_fwd: no kernel there). Calls whose query rows fit
// one split-KV block run that kernel, as at every head dim.
// The specialised pairs (level 2): a Hopper kernel only (SM80 columns 0: the
// SM80 path runs the pair on d_qk's row); plan_fwd sends d_qk in (160, 192]
// with d_v <= 128 here. (192, 128): P V is 128 columns wide, not 192, and
// the smaller V and O tiles leave room for 112-key tiles with O staged apart
// (persistent), 220 KiB; 128 keys fit only with O over Q, 240 KiB otherwise
// (docs/head_dims_dv_and_512.md, "The (192, 128) tiles").
template <> struct FwdTileConfig<192, 128> { static constexpr int kBlockM = 0, kBlockN = 0, kNWarps = 0, kBlockNExtras = 0, kNWarpsExtras = 0, kBlockMSm90 = 128, kBlockNSm90 = 112, kMinSeqlenKSm90 = 0, kMinBlocksPerSmSm90 = 0; };
// clang-format on

// SM80-kernel tiles for devices whose blocks may opt in to more shared memory
// than an sm80 block's 163 KiB (sm90: 227 KiB), where that pays; plan_fwd
// takes one where the device holds it (FwdPlan::sm80_large_smem).
//   512: 128 rows with 8 warps (64 keys: 224 KiB; 32 keys for the score
//        extras: 176 KiB), against the table's 64 rows with 4 warps: twice the
//        warps an SM and each K / V tile used by twice the queries (PERF_LOG
//        2026-12-01, "d512 forward tiles").
template <int kHeadDim>
struct FwdTileConfigLargeSmem {
  static constexpr bool kExists = false;
  static constexpr int kBlockM = 0, kBlockN = 0, kNWarps = 0, kBlockNExtras = 0, kNWarpsExtras = 0;
};
template <>
struct FwdTileConfigLargeSmem<512> {
  static constexpr bool kExists = true;
  static constexpr int kBlockM = 128, kBlockN = 64, kNWarps = 8, kBlockNExtras = 32,
                       kNWarpsExtras = 8;
};

// Compiled head dims, ascending; a request for head dim d runs on the first >= d.
// 576 (absorbed MLA, d_v <= 512) has the split-KV (fwd_kvcache) kernel only:
// the forward and backward ops bound the head dim at 512 (head_dim_bounds.h)
// before they look here.
constexpr int kCompiledHeadDims[] = {32, 64, 96, 128, 160, 192, 224, 256, 512, 576};

inline int round_up_head_dim(int head_dim) {
  for (int compiled : kCompiledHeadDims) {
    if (head_dim <= compiled) return compiled;
  }
  return -1;
}

}  // namespace flash
