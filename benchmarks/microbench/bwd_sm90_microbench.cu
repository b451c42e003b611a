// The Hopper (wgmma) backward main kernel (bwd_kernel_sm90.h) against
// the SM80 one, without torch: the forward produces O and the lse,
// then each backward runs as the launcher runs it (D = rowsum(dO * O), dQ
// accumulator zeroing, main kernel, dQ conversion with the kernel's own
// fragment order) on the same inputs. dQ, dK and dV are compared element by
// element (the SM80 kernel is the one the test suite checks against an fp32
// reference), then each is timed with events after warm-up, whole and main
// kernel alone.
//
//   nvcc -std=c++20 -O3 --use_fast_math --expt-relaxed-constexpr -I csrc -I <cutlass>/include \
//     -gencode arch=compute_90a,code=sm_90a -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED \
//     -DFLASH_ATTN_HAS_SM90A -DHEAD_DIM=128 \
//     benchmarks/microbench/bwd_sm90_microbench.cu -o bwd_sm90_d128
//   ./bwd_sm90_d128 [seqlen] [causal 0/1] [window_left]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_runtime.h>

#include "cuda/bwd/bwd_aux_kernels.h"
#include "cuda/bwd/bwd_tile_config.h"
#include "cuda/bwd/sm80/bwd_kernel_sm80.h"
#include "cuda/core/cuda_check.h"
#include "cuda/fwd/fwd_tile_config.h"
#include "cuda/fwd/sm80/fwd_kernel_sm80.h"
#include "cuda/launch/bwd_launch.h"
#include "microbench_util.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif

using Element = cutlass::bfloat16_t;
using Config = flash::BwdTileConfig<HEAD_DIM>;
using RefTraits = flash::BwdTraitsFor<Config, HEAD_DIM, Element>;
// The Hopper kernel's accumulator order.
using Traits = flash::BwdSm90TraitsFor<Element, HEAD_DIM>;
using FwdConfig = flash::FwdTileConfig<HEAD_DIM>;
using FwdTraits = flash::FwdKernelTraits<HEAD_DIM, FwdConfig::kBlockM, FwdConfig::kBlockN,
                                         FwdConfig::kNWarps, Element>;

int main(int argc, char** argv) {
  const int seqlen = argc > 1 ? atoi(argv[1]) : 4096;
  const bool causal = argc > 2 && atoi(argv[2]) != 0;
  const int window_left = argc > 3 ? atoi(argv[3]) : -1;
  const int nheads = 2048 / HEAD_DIM;
  const int batch = std::max(1, 16384 / seqlen);
  flash::BwdParams params = make_bwd_problem<Element>(batch, seqlen, nheads, HEAD_DIM,
                                                      Config::kBlockM, causal, window_left);
  const int64_t elems = int64_t(batch) * seqlen * nheads * HEAD_DIM;
  float* dq_accum = params.dq_accum_ptr;
  const int64_t dq_accum_elems = params.dq_accum_split_stride;

  const flash::FwdParams& fwd_params = params;
  auto fwd_kernel = &flash::flash_fwd_kernel<FwdTraits, false>;
  FA_CUDA_CHECK(cudaFuncSetAttribute(fwd_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     FwdTraits::kSmemSize));
  const dim3 fwd_grid((seqlen + FwdTraits::kBlockM - 1) / FwdTraits::kBlockM, nheads, batch);
  fwd_kernel<<<fwd_grid, FwdTraits::kNThreads, FwdTraits::kSmemSize>>>(fwd_params);
  FA_CUDA_CHECK(cudaGetLastError());

  constexpr int kDotRows = flash::dot_rows_per_block<HEAD_DIM>();
  const dim3 dot_grid((seqlen + kDotRows - 1) / kDotRows, nheads, batch);
  const dim3 grid((seqlen + Config::kBlockN - 1) / Config::kBlockN, nheads, batch);
  const dim3 dq_grid((seqlen + Config::kBlockM - 1) / Config::kBlockM, nheads, batch);
  const dim3 dq_grid_sm90((seqlen + Traits::kBlockM - 1) / Traits::kBlockM, nheads, batch);

  auto ref_kernel = &flash::flash_bwd_dq_dk_dv_kernel<RefTraits, false>;
  FA_CUDA_CHECK(cudaFuncSetAttribute(ref_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     RefTraits::kSmemSize));
  // What plan_bwd checks before it picks the Hopper kernel.
  int smem_optin = 0;
  FA_CUDA_CHECK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
  if (smem_optin < Traits::kSmemSize || !flash::BwdSm90Tma<Traits>::can_load(params)) {
    printf("no Hopper kernel takes this problem\n");
    return 1;
  }
  auto run_ref_main = [&] {
    ref_kernel<<<grid, RefTraits::kNThreads, RefTraits::kSmemSize>>>(params);
  };
  // The plan's field the launcher checks against the kernel: its query block.
  flash::BwdPlan plan;
  plan.block_m = Traits::kBlockM;
  auto run_sm90_main = [&] {
    flash::launch_bwd_sm90_main<Traits, false>(params, plan, grid, nullptr);
  };
  auto run_ref = [&] {
    flash::flash_bwd_dot_do_o_kernel<Element, HEAD_DIM>
        <<<dot_grid, flash::kBwdAuxThreads>>>(params);
    cudaMemsetAsync(dq_accum, 0, dq_accum_elems * sizeof(float));
    run_ref_main();
    flash::flash_bwd_convert_dq_kernel<RefTraits><<<dq_grid, RefTraits::kNThreads>>>(params);
  };
  auto run_sm90 = [&] {
    flash::flash_bwd_dot_do_o_kernel<Element, HEAD_DIM>
        <<<dot_grid, flash::kBwdAuxThreads>>>(params);
    cudaMemsetAsync(dq_accum, 0, dq_accum_elems * sizeof(float));
    run_sm90_main();
    flash::flash_bwd_convert_dq_kernel<Traits><<<dq_grid_sm90, Traits::kNThreads>>>(params);
  };

  // Reference outputs, then the Hopper kernel's into poisoned buffers.
  run_ref();
  FA_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<Element> ref[3], got[3];
  Element* outputs[3] = {static_cast<Element*>(params.dq_ptr), static_cast<Element*>(params.dk_ptr),
                         static_cast<Element*>(params.dv_ptr)};
  for (int t = 0; t < 3; ++t) {
    ref[t].resize(elems);
    got[t].resize(elems);
    FA_CUDA_CHECK(
        cudaMemcpy(ref[t].data(), outputs[t], elems * sizeof(Element), cudaMemcpyDeviceToHost));
  }
  // The Hopper kernel's outputs against the reference, from poisoned
  // buffers.
  auto check = [&](auto&& run, double* max_diff, double* max_ref) {
    for (int t = 0; t < 3; ++t) {
      FA_CUDA_CHECK(cudaMemset(outputs[t], 0xff, elems * sizeof(Element)));  // NaN
    }
    run();
    FA_CUDA_CHECK(cudaDeviceSynchronize());
    bool ok = true;
    for (int t = 0; t < 3; ++t) {
      FA_CUDA_CHECK(
          cudaMemcpy(got[t].data(), outputs[t], elems * sizeof(Element), cudaMemcpyDeviceToHost));
      max_diff[t] = 0;
      max_ref[t] = 0;
      for (int64_t i = 0; i < elems; ++i) {
        const float r = float(ref[t][i]);
        const float g = float(got[t][i]);
        const double diff = std::isfinite(g) ? std::fabs(double(g) - r) : INFINITY;
        max_diff[t] = std::max(max_diff[t], diff);
        max_ref[t] = std::max(max_ref[t], double(std::fabs(r)));
      }
      // Both in bf16 from fp32 sums in different orders: a few bf16 ulps of
      // the largest value.
      if (!(max_diff[t] <= 0.02 * max_ref[t] + 1e-3)) ok = false;
    }
    return ok;
  };
  double max_diff[3], max_ref[3];
  const bool ok = check(run_sm90, max_diff, max_ref);

  const double ref_ms = median_ms(run_ref, 20, 5);
  const double sm90_ms = median_ms(run_sm90, 20, 5);
  const double ref_main_ms = median_ms(run_ref_main, 20, 5);
  const double sm90_main_ms = median_ms(run_sm90_main, 20, 5);
  double flops = 2.5 * 4.0 * batch * nheads * double(seqlen) * seqlen * HEAD_DIM;
  if (causal) flops /= 2;
  printf(
      "d=%d M=%d N=%d seqlen=%d causal=%d wl=%d: %s | max|diff| dq %.2e dk %.2e dv %.2e (max|ref| "
      "%.2e %.2e %.2e) | bwd sm80 %.3f ms %.1f TFLOP/s, sm90 %.3f ms %.1f TFLOP/s (%.2fx) | main "
      "sm80 %.3f sm90 %.3f ms (%.2fx)\n",
      HEAD_DIM, Traits::kBlockM, Config::kBlockN, seqlen, causal, window_left,
      ok ? "match" : "MISMATCH", max_diff[0], max_diff[1], max_diff[2], max_ref[0], max_ref[1],
      max_ref[2], ref_ms, flops / ref_ms * 1e-9, sm90_ms, flops / sm90_ms * 1e-9, ref_ms / sm90_ms,
      ref_main_ms, sm90_main_ms, ref_main_ms / sm90_main_ms);
  return ok ? 0 : 1;
}
