// The head dims each device serves (the op contract's "Head dims"): a
// multiple of 8 (the Python layer pads to one) from 8 up to a bound per
// device, checked at the ops' boundary (api/checks.cpp, api/kvcache_checks.cpp)
// and again by the CPU path itself.
//
// CUDA: the forward tile tables stop at 256 (fwd_tile_config.h; head dim 512
// and absorbed MLA's 576 / 512 are issue 56's, designed in
// docs/head_dims_dv_and_512.md): above it the forward runs on the split-KV
// kernel, up to 512 (fwd_kvcache also 576 with d_v <= 512), and the backward
// on the SM80 kernel's d512 row (bwd_tile_config.h, in head-dim slabs). CPU: the tiles work on
// column strips of 8 at any width, with per-thread scratch of a few rows of head_dim floats; the
// bound covers those head dims (and MLA's 576) with room, so that the CPU
// path computes the function the CUDA kernels will serve.
#pragma once

namespace flash {

// CUDA forward kernels (and the SDPA provider): the tile tables' 256.
constexpr int kMaxHeadDimCuda = 256;
// CUDA backward: up to 512, 257-512 on the SM80 kernel's d512 row.
constexpr int kMaxHeadDimCudaBwd = 512;
// CUDA forward: head dims 257-512 run on the split-KV kernel's d512 instance
// (splitkv_tile_config.h), forward only (no dropout, S_dmask or seqused_q).
constexpr int kMaxHeadDimCudaFwd = 512;
constexpr int kMaxHeadDimCpu = 1024;
// fwd_kvcache on CUDA: the split-KV kernel has d512 and d576 instances,
// whose warps split the value dim in halves (splitkv_tile_config.h,
// splitkv_warps_v); 576 is absorbed MLA's latent cache, with d_v <= 512.
constexpr int kMaxHeadDimCudaKvcache = 576;

// The forward ops' bound (the backward's is max_bwd_head_dim).
constexpr int max_head_dim(bool cuda) { return cuda ? kMaxHeadDimCudaFwd : kMaxHeadDimCpu; }
constexpr int max_bwd_head_dim(bool cuda) { return cuda ? kMaxHeadDimCudaBwd : kMaxHeadDimCpu; }
// Head dims served on CUDA by the split-KV kernel only (no forward or backward kernel).
constexpr bool splitkv_only_head_dim(int head_dim) { return head_dim > kMaxHeadDimCuda; }
constexpr int max_kvcache_head_dim(bool cuda) {
  return cuda ? kMaxHeadDimCudaKvcache : kMaxHeadDimCpu;
}

}  // namespace flash
