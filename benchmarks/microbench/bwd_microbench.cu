// Times one backward tile configuration without torch, for tile-shape
// experiments: each configuration is its own binary, so several compile in
// parallel. The forward kernel (the shipped tile table) runs once to produce
// O and the lse the backward needs; then the backward runs as the launcher
// runs it (D = rowsum(dO * O), dQ accumulator zeroing, main kernel, dQ
// conversion) and is timed with CUDA events. The main kernel is also timed
// alone, to separate it from the memory-bound steps around it.
//
//   nvcc -std=c++20 -O3 --use_fast_math --expt-relaxed-constexpr -I csrc -I <cutlass>/include \
//     -gencode arch=compute_90,code=sm_90 -DHEAD_DIM=128 -DBLOCK_M=64 -DBLOCK_N=128 -DWARPS=8 \
//     -DATOM_SDP=2 -DATOM_DKV=4 -DATOM_DQ=2 -DDOUBLE_BUFFER=1 -DDQ_BEFORE_DK=1 \
//     benchmarks/microbench/bwd_microbench.cu -o bwd_d128
//   ./bwd_d128 [seqlen] [causal 0/1]
//
// Without the tile macros the head dim's entry of csrc/cuda/bwd/bwd_tile_config.h
// is timed. -DWITH_EXTRAS=1 times the softcap/ALiBi/dropout variant of the
// main kernel (run with the plain score rule, so only its cost shows).
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
#include "microbench_util.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
using TableConfig = flash::BwdTileConfig<HEAD_DIM>;
#ifndef BLOCK_M
#define BLOCK_M TableConfig::kBlockM
#endif
#ifndef BLOCK_N
#define BLOCK_N TableConfig::kBlockN
#endif
#ifndef WARPS
#define WARPS TableConfig::kNWarps
#endif
#ifndef ATOM_SDP
#define ATOM_SDP TableConfig::kAtomLayoutMSdP
#endif
#ifndef ATOM_DKV
#define ATOM_DKV TableConfig::kAtomLayoutNdKV
#endif
#ifndef ATOM_DQ
#define ATOM_DQ TableConfig::kAtomLayoutMdQ
#endif
#ifndef DOUBLE_BUFFER
#define DOUBLE_BUFFER TableConfig::kDoubleBufferQdO
#endif
#ifndef DQ_BEFORE_DK
#define DQ_BEFORE_DK TableConfig::kDQBeforeDK
#endif
#ifndef WITH_EXTRAS
#define WITH_EXTRAS 0
#endif

using Element = cutlass::bfloat16_t;
using Traits = flash::BwdKernelTraits<HEAD_DIM, BLOCK_M, BLOCK_N, WARPS, ATOM_SDP, ATOM_DKV,
                                      ATOM_DQ, bool(DOUBLE_BUFFER), bool(DQ_BEFORE_DK), Element>;
using FwdConfig = flash::FwdTileConfig<HEAD_DIM>;
using FwdTraits = flash::FwdKernelTraits<HEAD_DIM, FwdConfig::kBlockM, FwdConfig::kBlockN,
                                         FwdConfig::kNWarps, Element>;

int main(int argc, char** argv) {
  const int seqlen = argc > 1 ? atoi(argv[1]) : 4096;
  const bool causal = argc > 2 && atoi(argv[2]) != 0;
  const int nheads = 2048 / HEAD_DIM;
  const int batch = std::max(1, 16384 / seqlen);
  // dQ accumulator padded to whole query blocks (bwd_accum_layout.h).
  flash::BwdParams params =
      make_bwd_problem<Element>(batch, seqlen, nheads, HEAD_DIM, BLOCK_M, causal, -1);
  const int64_t elems = int64_t(batch) * seqlen * nheads * HEAD_DIM;
  float* dq_accum = params.dq_accum_ptr;
  const int64_t dq_accum_elems = params.dq_accum_split_stride;

  // O and the lse, from the forward kernel of the shipped table.
  const flash::FwdParams& fwd_params = params;
  auto fwd_kernel = &flash::flash_fwd_kernel<FwdTraits, false>;
  FA_CUDA_CHECK(cudaFuncSetAttribute(fwd_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     FwdTraits::kSmemSize));
  const dim3 fwd_grid((seqlen + FwdTraits::kBlockM - 1) / FwdTraits::kBlockM, nheads, batch);
  fwd_kernel<<<fwd_grid, FwdTraits::kNThreads, FwdTraits::kSmemSize>>>(fwd_params);
  FA_CUDA_CHECK(cudaGetLastError());
  FA_CUDA_CHECK(cudaDeviceSynchronize());

  auto kernel = &flash::flash_bwd_dq_dk_dv_kernel<Traits, bool(WITH_EXTRAS)>;
  constexpr int kSmemSize = Traits::kSmemSize;
  FA_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemSize));
  constexpr int kDotRows = flash::dot_rows_per_block<HEAD_DIM>();
  const dim3 dot_grid((seqlen + kDotRows - 1) / kDotRows, nheads, batch);
  const dim3 grid((seqlen + BLOCK_N - 1) / BLOCK_N, nheads, batch);
  const dim3 dq_grid((seqlen + BLOCK_M - 1) / BLOCK_M, nheads, batch);
  auto run_main = [&] { kernel<<<grid, Traits::kNThreads, kSmemSize>>>(params); };
  auto run_backward = [&] {
    flash::flash_bwd_dot_do_o_kernel<Element, HEAD_DIM>
        <<<dot_grid, flash::kBwdAuxThreads>>>(params);
    cudaMemsetAsync(dq_accum, 0, dq_accum_elems * sizeof(float));
    run_main();
    flash::flash_bwd_convert_dq_kernel<Traits><<<dq_grid, Traits::kNThreads>>>(params);
  };
  for (int i = 0; i < 5; ++i) run_backward();
  FA_CUDA_CHECK(cudaGetLastError());
  FA_CUDA_CHECK(cudaDeviceSynchronize());

  // Checksums of dQ, dK, dV (first 2^20 elements): every configuration of a
  // head dim must print the same numbers up to fp32 summation order, and a
  // wrong tile shape shows up here rather than as a fast number.
  double checksums[3];
  const Element* outputs[3] = {static_cast<Element*>(params.dq_ptr),
                               static_cast<Element*>(params.dk_ptr),
                               static_cast<Element*>(params.dv_ptr)};
  std::vector<Element> host(std::min<int64_t>(elems, 1 << 20));
  for (int t = 0; t < 3; ++t) {
    FA_CUDA_CHECK(
        cudaMemcpy(host.data(), outputs[t], host.size() * sizeof(Element), cudaMemcpyDeviceToHost));
    double abs_sum = 0;
    for (const Element& x : host) {
      if (!std::isfinite(float(x))) {
        printf("non-finite output %d\n", t);
        return 1;
      }
      abs_sum += std::fabs(float(x));
    }
    checksums[t] = abs_sum / host.size();
  }

  constexpr int kIters = 20;
  const double total_ms = median_ms(run_backward, kIters);
  const double main_ms = median_ms(run_main, kIters);
  const double flops =
      2.5 * 4.0 * batch * nheads * double(seqlen) * seqlen * HEAD_DIM / (causal ? 2 : 1);
  cudaFuncAttributes attributes;
  FA_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
  int blocks_per_sm = 0;
  FA_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel,
                                                              Traits::kNThreads, kSmemSize));
  printf(
      "d=%d M=%d N=%d warps=%d atoms=%d,%d,%d dbuf=%d dq_first=%d extras=%d seqlen=%d causal=%d: "
      "bwd %.3f ms %.1f TFLOP/s | main %.3f ms %.1f TFLOP/s | %d regs, %d B local, %d KiB smem, "
      "%d blocks/SM | mean |dq|,|dk|,|dv| %.6e %.6e %.6e\n",
      HEAD_DIM, BLOCK_M, BLOCK_N, WARPS, ATOM_SDP, ATOM_DKV, ATOM_DQ, int(DOUBLE_BUFFER),
      int(DQ_BEFORE_DK), WITH_EXTRAS, seqlen, causal, total_ms, flops / total_ms * 1e-9, main_ms,
      flops / main_ms * 1e-9, attributes.numRegs, int(attributes.localSizeBytes), kSmemSize / 1024,
      blocks_per_sm, checksums[0], checksums[1], checksums[2]);
  return 0;
}
