// Times one forward-kernel configuration without torch, for tile-shape
// experiments: each configuration is its own binary, so several compile in
// parallel in about a minute each. The numbers that settled the tile table
// (csrc/cuda/fwd/fwd_tile_config.h) come from benchmarks/microbench/run_tile_sweep.sh.
//
//   nvcc -std=c++20 -O3 --use_fast_math --expt-relaxed-constexpr -I csrc -I <cutlass>/include \
//     -gencode arch=compute_90,code=sm_90 -DHEAD_DIM=128 -DBLOCK_M=128 -DBLOCK_N=64 -DWARPS=4 \
//     benchmarks/microbench/fwd_microbench.cu -o fwd_d128
//   ./fwd_d128 [seqlen] [causal 0/1]
// -DWITH_EXTRAS=1 times the softcap/ALiBi/dropout variant of the kernel (run
// with the plain score rule, so only the cost of carrying the extras shows).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_runtime.h>

#include "cuda/core/cuda_check.h"
#include "cuda/fwd/sm80/fwd_kernel_sm80.h"
#include "microbench_util.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef WITH_EXTRAS
#define WITH_EXTRAS 0
#endif
#ifndef BLOCK_M
#define BLOCK_M 128
#endif
#ifndef BLOCK_N
#define BLOCK_N 64
#endif
#ifndef WARPS
#define WARPS 4
#endif

using Element = cutlass::bfloat16_t;
using Traits = flash::FwdKernelTraits<HEAD_DIM, BLOCK_M, BLOCK_N, WARPS, Element>;

int main(int argc, char** argv) {
  const int seqlen = argc > 1 ? atoi(argv[1]) : 4096;
  const bool causal = argc > 2 && atoi(argv[2]) != 0;
  const int nheads = 2048 / HEAD_DIM;
  const int batch = 16384 / seqlen;
  const int64_t elems = int64_t(batch) * seqlen * nheads * HEAD_DIM;

  Element *q, *k, *v, *o;
  float* lse;
  FA_CUDA_CHECK(cudaMalloc(&q, elems * sizeof(Element)));
  FA_CUDA_CHECK(cudaMalloc(&k, elems * sizeof(Element)));
  FA_CUDA_CHECK(cudaMalloc(&v, elems * sizeof(Element)));
  FA_CUDA_CHECK(cudaMalloc(&o, elems * sizeof(Element)));
  FA_CUDA_CHECK(cudaMalloc(&lse, int64_t(batch) * nheads * seqlen * sizeof(float)));
  fill_random<<<1024, 256>>>(q, elems, 1);
  fill_random<<<1024, 256>>>(k, elems, 2);
  fill_random<<<1024, 256>>>(v, elems, 3);

  flash::FwdParams params{};
  params.q_ptr = q;
  params.k_ptr = k;
  params.v_ptr = v;
  params.o_ptr = o;
  params.softmax_lse_ptr = lse;
  const flash::QKVStrides strides{int64_t(seqlen) * nheads * HEAD_DIM, nheads * HEAD_DIM, HEAD_DIM};
  params.q = params.k = params.v = params.o = strides;
  params.batch = batch;
  params.nheads = params.nheads_k = nheads;
  params.seqlen_q = params.seqlen_k = seqlen;
  params.head_dim = HEAD_DIM;
  params.head_dim_v = HEAD_DIM;
  params.softmax_scale = 1.f / sqrtf(float(HEAD_DIM));
  params.softmax_scale_log2 = params.softmax_scale * float(M_LOG2E);
  params.window_left = -1;
  params.window_right = causal ? 0 : -1;
  params.is_bf16 = true;

  auto kernel = &flash::flash_fwd_kernel<Traits, WITH_EXTRAS != 0>;
  FA_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Traits::kSmemSize));
  const dim3 grid((seqlen + BLOCK_M - 1) / BLOCK_M, nheads, batch);
  for (int i = 0; i < 10; ++i) kernel<<<grid, Traits::kNThreads, Traits::kSmemSize>>>(params);
  FA_CUDA_CHECK(cudaGetLastError());
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  constexpr int kIters = 30;
  std::vector<float> times;
  for (int i = 0; i < kIters; ++i) {
    cudaEventRecord(start);
    kernel<<<grid, Traits::kNThreads, Traits::kSmemSize>>>(params);
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float ms;
    cudaEventElapsedTime(&ms, start, stop);
    times.push_back(ms);
  }
  FA_CUDA_CHECK(cudaGetLastError());
  std::sort(times.begin(), times.end());
  const double ms = times[kIters / 2];
  const double flops = 4.0 * batch * nheads * double(seqlen) * seqlen * HEAD_DIM / (causal ? 2 : 1);
  int blocks_per_sm = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel, Traits::kNThreads,
                                                Traits::kSmemSize);
  printf("d=%d M=%d N=%d warps=%d seqlen=%d causal=%d: %.3f ms  %.1f TFLOP/s  (%d blocks/SM)\n",
         HEAD_DIM, BLOCK_M, BLOCK_N, WARPS, seqlen, causal, ms, flops / ms * 1e-9, blocks_per_sm);
  return 0;
}
