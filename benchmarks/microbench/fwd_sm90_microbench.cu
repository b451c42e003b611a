// The Hopper (wgmma) forward kernel against the SM80 one, without torch: both
// run on the same inputs, their outputs and lse are compared element by
// element (the SM80 kernel is the one the test suite checks against an fp32
// reference), then each is timed with events after warm-up.
//
//   nvcc -std=c++20 -O3 --use_fast_math --expt-relaxed-constexpr -I csrc -I <cutlass>/include \
//     -gencode arch=compute_90a,code=sm_90a -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED \
//     -DHEAD_DIM=128 -DBLOCK_M=128 -DBLOCK_N=128 \
//     benchmarks/microbench/fwd_sm90_microbench.cu -o fwd_sm90_d128
//   ./fwd_sm90_d128 [seqlen_q] [causal 0/1] [seqlen_k] [window_left]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_runtime.h>

#include "cuda/core/cuda_check.h"
#include "cuda/fwd/fwd_tile_config.h"
#include "cuda/fwd/fwd_tile_schedule.h"
#include "cuda/fwd/sm80/fwd_kernel_sm80.h"
#include "cuda/launch/fwd_launch.h"
#include "microbench_util.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef BLOCK_M
#define BLOCK_M 128
#endif
#ifndef BLOCK_N
#define BLOCK_N 128
#endif

using Element = cutlass::bfloat16_t;
using Config = flash::FwdTileConfig<HEAD_DIM>;
using RefTraits =
    flash::FwdKernelTraits<HEAD_DIM, Config::kBlockM, Config::kBlockN, Config::kNWarps, Element>;
using Traits = flash::FwdSm90KernelTraits<HEAD_DIM, BLOCK_M, BLOCK_N, Element>;

template <typename Kernel, typename... Extra>
double time_ms(Kernel kernel, dim3 grid, int threads, int smem, const flash::FwdParams& params,
               const Extra&... extra) {
  return median_ms([&] { kernel<<<grid, threads, smem>>>(params, extra...); }, 30, 10);
}

// Largest |difference| of o / lse against the reference, and the NaN count.
struct Diff {
  double max_o = 0, max_lse = 0;
  int64_t bad = 0;
};
template <typename Element>
Diff compare(const Element* o, const Element* o_ref, const float* lse, const float* lse_ref,
             int64_t q_elems, int64_t lse_elems) {
  std::vector<Element> h_o(q_elems), h_ref(q_elems);
  std::vector<float> h_lse(lse_elems), h_lse_ref(lse_elems);
  FA_CUDA_CHECK(cudaMemcpy(h_o.data(), o, q_elems * sizeof(Element), cudaMemcpyDeviceToHost));
  FA_CUDA_CHECK(cudaMemcpy(h_ref.data(), o_ref, q_elems * sizeof(Element), cudaMemcpyDeviceToHost));
  FA_CUDA_CHECK(cudaMemcpy(h_lse.data(), lse, lse_elems * sizeof(float), cudaMemcpyDeviceToHost));
  FA_CUDA_CHECK(
      cudaMemcpy(h_lse_ref.data(), lse_ref, lse_elems * sizeof(float), cudaMemcpyDeviceToHost));
  Diff diff;
  for (int64_t i = 0; i < q_elems; ++i) {
    const double d = std::fabs(double(float(h_o[i])) - double(float(h_ref[i])));
    if (!(d <= 1e30))
      ++diff.bad;  // NaN
    else
      diff.max_o = std::max(diff.max_o, d);
  }
  for (int64_t i = 0; i < lse_elems; ++i) {
    if (std::isinf(h_lse_ref[i]) && h_lse[i] == h_lse_ref[i]) continue;
    const double d = std::fabs(double(h_lse[i]) - double(h_lse_ref[i]));
    if (!(d <= 1e30))
      ++diff.bad;
    else
      diff.max_lse = std::max(diff.max_lse, d);
  }
  return diff;
}

int main(int argc, char** argv) {
  const int seqlen_q = argc > 1 ? atoi(argv[1]) : 4096;
  const bool causal = argc > 2 && atoi(argv[2]) != 0;
  const int seqlen_k = argc > 3 ? atoi(argv[3]) : seqlen_q;
  const int window_left = argc > 4 ? atoi(argv[4]) : -1;
  const int nheads = 2048 / HEAD_DIM;
  const int batch = std::max(1, 16384 / seqlen_q);
  const int64_t q_elems = int64_t(batch) * seqlen_q * nheads * HEAD_DIM;
  const int64_t k_elems = int64_t(batch) * seqlen_k * nheads * HEAD_DIM;
  const int64_t lse_elems = int64_t(batch) * nheads * seqlen_q;

  Element *q, *k, *v, *o, *o_ref;
  float *lse, *lse_ref;
  FA_CUDA_CHECK(cudaMalloc(&q, q_elems * sizeof(Element)));
  FA_CUDA_CHECK(cudaMalloc(&k, k_elems * sizeof(Element)));
  FA_CUDA_CHECK(cudaMalloc(&v, k_elems * sizeof(Element)));
  FA_CUDA_CHECK(cudaMalloc(&o, q_elems * sizeof(Element)));
  FA_CUDA_CHECK(cudaMalloc(&o_ref, q_elems * sizeof(Element)));
  FA_CUDA_CHECK(cudaMalloc(&lse, lse_elems * sizeof(float)));
  FA_CUDA_CHECK(cudaMalloc(&lse_ref, lse_elems * sizeof(float)));
  fill_random<<<1024, 256>>>(q, q_elems, 1);
  fill_random<<<1024, 256>>>(k, k_elems, 2);
  fill_random<<<1024, 256>>>(v, k_elems, 3);
  // Poison: a row the kernel fails to write shows up as NaN.
  FA_CUDA_CHECK(cudaMemset(o, 0xff, q_elems * sizeof(Element)));
  FA_CUDA_CHECK(cudaMemset(lse, 0xff, lse_elems * sizeof(float)));

  flash::FwdParams params{};
  params.q_ptr = q;
  params.k_ptr = k;
  params.v_ptr = v;
  params.o_ptr = o_ref;
  params.softmax_lse_ptr = lse_ref;
  params.q = params.o = {int64_t(seqlen_q) * nheads * HEAD_DIM, nheads * HEAD_DIM, HEAD_DIM};
  params.k = params.v = {int64_t(seqlen_k) * nheads * HEAD_DIM, nheads * HEAD_DIM, HEAD_DIM};
  params.batch = batch;
  params.nheads = params.nheads_k = nheads;
  params.seqlen_q = seqlen_q;
  params.seqlen_k = seqlen_k;
  params.head_dim = HEAD_DIM;
  params.head_dim_v = HEAD_DIM;
  params.softmax_scale = 1.f / sqrtf(float(HEAD_DIM));
  params.softmax_scale_log2 = params.softmax_scale * float(M_LOG2E);
  params.window_left = window_left;
  params.window_right = causal ? 0 : -1;
  params.is_bf16 = true;

  auto ref_kernel = &flash::flash_fwd_kernel<RefTraits, false>;
  FA_CUDA_CHECK(cudaFuncSetAttribute(ref_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     RefTraits::kSmemSize));
  const dim3 ref_grid((seqlen_q + RefTraits::kBlockM - 1) / RefTraits::kBlockM, nheads, batch);
  const double ref_ms =
      time_ms(ref_kernel, ref_grid, RefTraits::kNThreads, RefTraits::kSmemSize, params);

  params.o_ptr = o;
  params.softmax_lse_ptr = lse;
  const auto tma = flash::FwdSm90Tma<Traits>::make(params, /*gather_keys=*/false);
  const auto tile_divisors = flash::fwd_sm90_tile_divisors(params, Traits::kBlockM);
  int num_sms = 0;
  FA_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, 0));
  // The Hopper kernel on the launcher's grid without a tile counter (fixed
  // shares without a causal / local bound, else one block per query block),
  // then, for a causal / local bound, on the persistent grid that takes its
  // tiles from the counter, zeroed before each call as the op does (whatever
  // the launcher's key-count rule would pick).
  const int64_t num_tiles = flash::fwd_sm90_num_tiles(params, Traits::kBlockM);
  const bool more_tiles_than_sms = num_tiles > num_sms;
  const bool differ = flash::fwd_tiles_differ_in_work(params);
  const dim3 grid(Traits::kPersistent && more_tiles_than_sms && !differ ? num_sms : num_tiles);
  const bool with_counter = Traits::kPersistent && more_tiles_than_sms && differ;
  unsigned long long* tile_counter;
  FA_CUDA_CHECK(cudaMalloc(&tile_counter, sizeof(unsigned long long)));
  auto launch = [&](bool counter) {
    if (!counter) {
      flash::flash_fwd_sm90_kernel<Traits, false>
          <<<grid, Traits::kNThreads, Traits::kSmemSize>>>(params, tma, tile_divisors);
      return;
    }
    if constexpr (Traits::kPersistent) {
      flash::FwdParams counter_params = params;
      counter_params.tile_counter = tile_counter;
      FA_CUDA_CHECK(cudaMemsetAsync(tile_counter, 0, sizeof(unsigned long long)));
      flash::flash_fwd_sm90_kernel<Traits, true>
          <<<num_sms, Traits::kNThreads, Traits::kSmemSize>>>(counter_params, tma, tile_divisors);
    }
  };
  auto run_sm90 = [&](bool counter) {
    FA_CUDA_CHECK(cudaMemset(o, 0xff, q_elems * sizeof(Element)));
    FA_CUDA_CHECK(cudaMemset(lse, 0xff, lse_elems * sizeof(float)));
    launch(counter);
    FA_CUDA_CHECK(cudaDeviceSynchronize());
    return compare(o, o_ref, lse, lse_ref, q_elems, lse_elems);
  };
  for (auto kernel : {&flash::flash_fwd_sm90_kernel<Traits, false>,
                      &flash::flash_fwd_sm90_kernel<Traits, Traits::kPersistent>}) {
    FA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       Traits::kSmemSize));
  }
  const Diff diff = run_sm90(false);
  const double ms = median_ms([&] { launch(false); }, 30, 10);
  Diff counter_diff;
  double counter_ms = 0;
  if (with_counter) {
    counter_diff = run_sm90(true);
    counter_ms = median_ms([&] { launch(true); }, 30, 10);
  }

  double visible = 0;  // exact count of visible (row, key) pairs, for FLOPs
  for (int r = 0; r < seqlen_q; ++r) {
    const flash::KeyRange kr =
        flash::visible_key_range(r, r + 1, seqlen_q, seqlen_k, window_left, causal ? 0 : -1);
    visible += kr.end - kr.begin;
  }
  const double flops = 4.0 * batch * nheads * visible * HEAD_DIM;
  printf(
      "d=%d M=%d N=%d sq=%d sk=%d causal=%d wl=%d: max|dO|=%.3g max|dlse|=%.3g nan=%lld | "
      "sm90 (%d blocks) %.3f ms %.1f TFLOP/s | sm80 %.3f ms %.1f TFLOP/s | %.3fx",
      HEAD_DIM, BLOCK_M, BLOCK_N, seqlen_q, seqlen_k, causal, window_left, diff.max_o, diff.max_lse,
      (long long)diff.bad, grid.x, ms, flops / ms * 1e-9, ref_ms, flops / ref_ms * 1e-9,
      ref_ms / ms);
  if (with_counter) {
    printf(
        " | counter (%d blocks): max|dO|=%.3g max|dlse|=%.3g nan=%lld %.3f ms %.1f TFLOP/s, "
        "%.3fx the grid without",
        num_sms, counter_diff.max_o, counter_diff.max_lse, (long long)counter_diff.bad, counter_ms,
        flops / counter_ms * 1e-9, ms / counter_ms);
  }
  printf("\n");
  auto ok = [](const Diff& d) { return d.bad == 0 && d.max_o < 2e-2 && d.max_lse < 1e-3; };
  return ok(diff) && (!with_counter || ok(counter_diff)) ? 0 : 1;
}
