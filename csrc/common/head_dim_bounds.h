// The head dims each device serves (the op contract's "Head dims"): a
// multiple of 8 (the Python layer pads to one) from 8 up to a bound per
// device, checked at the ops' boundary (api/checks.cpp, api/kvcache_checks.cpp)
// and again by the CPU path itself.
//
// CUDA: the Hopper tile tables stop at 256; head dims 257-512 run on the SM80
// kernels' d512 rows in passes over head-dim slabs (fwd_tile_config.h,
// bwd_tile_config.h; docs/head_dims_dv_and_512.md), the forward also on the
// split-KV kernel where its query rows fit one block, and fwd_kvcache serves
// absorbed MLA's 576 with d_v <= 512 on the split-KV kernel. CPU: the tiles work on
// column strips of 8 at any width, with per-thread scratch of a few rows of head_dim floats; the
// bound covers those head dims (and MLA's 576) with room, so that the CPU
// path computes the function the CUDA kernels will serve.
#pragma once

namespace flash {

// The SDPA provider, S_dmask and the Hopper kernels: 256.
constexpr int kMaxHeadDimCuda = 256;
// CUDA backward: up to 512, 257-512 on the SM80 kernel's d512 row.
constexpr int kMaxHeadDimCudaBwd = 512;
// CUDA forward: head dims 257-512 run on the SM80 kernel's d512 row in two
// passes over slabs of V (fwd_tile_config.h), or on the split-KV kernel's d512
// instance where the query rows fit one of its blocks; no S_dmask above 256.
constexpr int kMaxHeadDimCudaFwd = 512;
constexpr int kMaxHeadDimCpu = 1024;
// fwd_kvcache on CUDA: the split-KV kernel has d512 and d576 instances,
// whose warps split the value dim in halves (splitkv_tile_config.h,
// splitkv_warps_v); 576 is absorbed MLA's latent cache, with d_v <= 512.
constexpr int kMaxHeadDimCudaKvcache = 576;

// The forward ops' bound (the backward's is max_bwd_head_dim).
constexpr int max_head_dim(bool cuda) { return cuda ? kMaxHeadDimCudaFwd : kMaxHeadDimCpu; }
constexpr int max_bwd_head_dim(bool cuda) { return cuda ? kMaxHeadDimCudaBwd : kMaxHeadDimCpu; }
// Head dims served on CUDA by the split-KV kernel only: absorbed MLA's 576
// (fwd_kvcache; the forward ops stop at 512, on the SM80 kernel's d512 row
// above 256).
constexpr bool splitkv_only_head_dim(int head_dim) { return head_dim > kMaxHeadDimCudaFwd; }
constexpr int max_kvcache_head_dim(bool cuda) {
  return cuda ? kMaxHeadDimCudaKvcache : kMaxHeadDimCpu;
}

}  // namespace flash
