// What the torch-free attention microbenchmarks share: random inputs and
// event timing.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include <cuda_runtime.h>

#include "cuda/cuda_check.h"

// Deterministic pseudo-random fill in [-1, 1): never zeros, which run faster
// on tensor cores than real data.
template <typename T>
__global__ void fill_random(T* data, int64_t n, uint32_t salt) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ salt;
    x ^= x >> 15;
    x *= 2246822519u;
    x ^= x >> 13;
    data[i] = T(float(x & 0xFFFF) / 32768.f - 1.f);
  }
}

// Median of `iters` event-timed calls of launch(), after `warmup` untimed ones.
template <typename Launch>
double median_ms(Launch launch, int iters, int warmup = 0) {
  for (int i = 0; i < warmup; ++i) launch();
  cudaEvent_t start, stop;
  FA_CUDA_CHECK(cudaEventCreate(&start));
  FA_CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<float> times;
  for (int i = 0; i < iters; ++i) {
    FA_CUDA_CHECK(cudaEventRecord(start));
    launch();
    FA_CUDA_CHECK(cudaEventRecord(stop));
    FA_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms;
    FA_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms);
  }
  FA_CUDA_CHECK(cudaGetLastError());
  FA_CUDA_CHECK(cudaEventDestroy(start));
  FA_CUDA_CHECK(cudaEventDestroy(stop));
  std::sort(times.begin(), times.end());
  return times[iters / 2];
}
