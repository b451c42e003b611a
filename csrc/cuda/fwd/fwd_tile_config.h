// The one table of forward tile configurations, per compiled head dim.
// Head dims between two entries run on the next larger one with the extra
// columns predicated off. The numbers behind each choice are in
// benchmarks/PERF_LOG.md.
#pragma once

namespace flash {

template <int kHeadDim>
struct FwdTileConfig;

// Three tiles per head dim: the plain kernel's, the one of the variant that
// carries softcap / ALiBi / dropout (on sm90, of these, only dropout), and
// the Hopper kernel's (plain, or with softcap / ALiBi)
// (fwd_kernel_sm90.h: one MMA warpgroup per 64 query rows and a TMA
// producer; block N 0 = the head dim stays on the SM80 kernel on sm90 too),
// with the fewest keys (max seqlen_k) from which the Hopper kernel runs by
// default. The Hopper kernel's grid that takes its tiles from a counter
// (short causal / local / varlen calls, fwd_tile_schedule.h) runs 128 query
// rows whatever block M says. d64 takes 192 rows (three MMA warpgroups)
// elsewhere: its softmax is as long as its products, and with two warpgroups
// each warp's instruction stream stalls on its own latencies (about 5
// cycles per issue); a third warpgroup gives the schedulers another warp.
// H100 microbench (PERF_LOG): non-causal +4-5% at 512-1024 keys, +14% at
// 2048-4096, causal +7-11% at 2048-4096 keys on one block per tile; on the
// counter grid 192 rows lost 17-18% at 512-1024 keys.
// The extras' extra registers make some tiles that win on the plain path
// spill heavily (d32 128 x 128: 120 B plain, 496 B with the extras, 231 vs
// 205 TFLOP/s plain but 62 vs 81 with extras). Hopper kernel against the
// SM80 one at 4096-8192 keys (H100 microbench, PERF_LOG): d64 1.29-1.40x,
// d96 1.48-1.60x, d128 1.76-1.95x, d160 1.78-1.81x, d192-256 1.99-2.16x.
// Below the key threshold it lost at short calls (d64 / d96 with 17 query
// rows and 128-300 keys 0.75-0.95x, d128 with 17 rows and 128 keys 0.89x;
// since then calls of many query blocks run it below the threshold too:
// fwd_sm90_by_shape in fwd_tile_schedule.h);
// d160-256 won everywhere measured. d32 stays on SM80 (H200 microbench:
// 1.01-1.12x at 4096-8192 keys, 0.66-0.86x at 1000 keys and fewer). d64 / d96 measured faster with
// 128-key than 64-key tiles.
// Hopper key tiles at d160-256 (H100 microbench, 1024-8192 keys, PERF_LOG):
// the S = Q K^T wgmma of a 64-key tile reads as many shared-memory bytes per
// cycle as the SM gives, so wider tiles win as far as shared memory holds
// two stages of K and V: d160 96 keys (+4-13% over 64), d192 96 (+4-6% from
// 4096 keys, level at 1024; 80 keys: +1-2%), d224 80 (+7-11%; 96 spills),
// d256 80 (+4-10%, level causal at 1024 keys). d192-256 lose the persistent
// grid with them (no room for a separate O tile) and still win. d128 keeps
// 128 keys (144-192: -1 to -10%).
// Below its key count the Hopper kernel runs calls of at least "blocks / SM"
// query blocks of 128 rows per SM (fwd_sm90_by_shape). H100, bf16, 17-128
// query rows, 128-256 keys, SM80 time / Hopper time by blocks per SM
// (PERF_LOG): d96 0.97-1.07x at 2, 1.06-1.11x at 3, 1.13-1.15x at 4; d128
// 0.83-1.07x at 2, 0.91-0.99x at 3, 1.01-1.08x at 4; d64 0.79-0.90x at 4
// with 17-128 rows, 0.95-1.05x at 6, 1.00-1.16x at 8. H200, 17-128 rows and
// 128-256 keys at 4 per SM: d96 0.85-1.37x (geomean 1.06; below 1.0 causal
// with 17 rows x 128 keys, 0.85x, and at 128 x 128, 0.95-0.99x), d128
// 0.88-1.27x (geomean 1.11; 0.88x causal 17 x 128); at 6 d96 0.92-1.35x,
// d128 1.12-1.42x (fwd_short_keys_blocks_per_sm.txt).
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
// clang-format on
// Compiled head dims, ascending; a request for head dim d runs on the first >= d.
constexpr int kCompiledHeadDims[] = {32, 64, 96, 128, 160, 192, 224, 256};

inline int round_up_head_dim(int head_dim) {
  for (int compiled : kCompiledHeadDims) {
    if (head_dim <= compiled) return compiled;
  }
  return -1;
}

}  // namespace flash
