// What the torch-free attention microbenchmarks share: random inputs, the
// backward's buffers and params, and event timing.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_runtime.h>

#include "cuda/bwd/bwd_accum_layout.h"
#include "cuda/core/cuda_check.h"
#include "cuda/core/params.h"

// Deterministic pseudo-random values in [-1, 1) by index and salt: not
// zeros, which run faster on tensor cores than real data.
__device__ __forceinline__ float random_in_unit(uint32_t i, uint32_t salt) {
  uint32_t x = i * 2654435761u ^ salt;
  x ^= x >> 15;
  x *= 2246822519u;
  x ^= x >> 13;
  return float(x & 0xFFFF) / 32768.f - 1.f;
}

template <typename T>
__global__ void fill_random(T* data, int64_t n, uint32_t salt) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    data[i] = T(random_in_unit(static_cast<uint32_t>(i), salt));
  }
}

// The same values into a tile in shared memory, by the block's `threads`
// threads (the microbenchmarks that keep their tiles resident).
template <typename T>
__device__ __forceinline__ void fill_random_tile(T* data, int n, uint32_t salt, int threads) {
  for (int i = threadIdx.x; i < n; i += threads) data[i] = T(random_in_unit(uint32_t(i), salt));
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

// A self-attention backward over contiguous (batch, seqlen, nheads, head_dim)
// tensors of Element (bf16): every buffer allocated (never freed: one problem
// per process), q, k, v, dO random, the dQ accumulator padded to query
// blocks of block_m rows (bwd_accum_layout.h), the default softmax scale. O
// and the lse are left for a forward kernel to write.
template <typename Element>
flash::BwdParams make_bwd_problem(int batch, int seqlen, int nheads, int head_dim, int block_m,
                                  bool causal, int window_left) {
  const int64_t elems = int64_t(batch) * seqlen * nheads * head_dim;
  const int64_t rows = int64_t(batch) * nheads * seqlen;
  Element *q, *k, *v, *o, *dout, *dq, *dk, *dv;
  for (Element** buffer : {&q, &k, &v, &o, &dout, &dq, &dk, &dv}) {
    FA_CUDA_CHECK(cudaMalloc(buffer, elems * sizeof(Element)));
  }
  float *lse, *softmax_d, *dq_accum;
  FA_CUDA_CHECK(cudaMalloc(&lse, rows * sizeof(float)));
  FA_CUDA_CHECK(cudaMalloc(&softmax_d, rows * sizeof(float)));
  const int64_t dq_accum_rows = flash::accum_rows_per_head(false, seqlen, batch, block_m);
  const int64_t dq_accum_elems = int64_t(batch) * nheads * dq_accum_rows * head_dim;
  FA_CUDA_CHECK(cudaMalloc(&dq_accum, dq_accum_elems * sizeof(float)));
  fill_random<<<1024, 256>>>(q, elems, 1);
  fill_random<<<1024, 256>>>(k, elems, 2);
  fill_random<<<1024, 256>>>(v, elems, 3);
  fill_random<<<1024, 256>>>(dout, elems, 4);

  flash::BwdParams params{};
  params.q_ptr = q;
  params.k_ptr = k;
  params.v_ptr = v;
  params.o_ptr = o;
  params.softmax_lse_ptr = lse;
  params.do_ptr = dout;
  params.dq_ptr = dq;
  params.dk_ptr = dk;
  params.dv_ptr = dv;
  params.softmax_d_ptr = softmax_d;
  params.dq_accum_ptr = dq_accum;
  params.dq_accum_split_stride = dq_accum_elems;  // one slice: its size
  params.dq_accum_rows_per_head = dq_accum_rows;
  params.num_splits = 1;
  const flash::QKVStrides strides{int64_t(seqlen) * nheads * head_dim, nheads * head_dim, head_dim};
  params.q = params.k = params.v = params.o = strides;
  params.dout = params.dq = params.dk = params.dv = strides;
  params.batch = batch;
  params.nheads = params.nheads_k = nheads;
  params.seqlen_q = params.seqlen_k = seqlen;
  params.head_dim = head_dim;
  params.head_dim_v = head_dim;
  params.softmax_scale = 1.f / sqrtf(float(head_dim));
  params.softmax_scale_log2 = params.softmax_scale * float(M_LOG2E);
  params.window_left = window_left;
  params.window_right = causal ? 0 : -1;
  params.dropout_rescale = 1.f;
  params.is_bf16 = true;
  return params;
}

// The device and arguments of a microbenchmark that loops one block per SM over
// resident tiles (headsplit_exchange.cu, pshare_d512.cu): `name [tiles per
// block, even] [blocks]`. False, with a message, when they are out of range.
struct TileLoopArgs {
  int clock_khz = 0;  // to turn milliseconds into cycles per tile
  int sms = 0;
  int n_tiles = 0;
  int blocks = 0;
};
inline bool parse_tile_loop_args(int argc, char** argv, const char* name, TileLoopArgs& args) {
  FA_CUDA_CHECK(cudaDeviceGetAttribute(&args.clock_khz, cudaDevAttrClockRate, 0));
  FA_CUDA_CHECK(cudaDeviceGetAttribute(&args.sms, cudaDevAttrMultiProcessorCount, 0));
  args.n_tiles = argc > 1 ? std::atoi(argv[1]) : 4096;
  args.blocks = argc > 2 ? std::atoi(argv[2]) : args.sms;
  if (args.n_tiles < 2 || args.n_tiles % 2 != 0 || args.blocks < 1) {
    std::fprintf(stderr, "%s: tiles must be even and >= 2 (got %d), blocks >= 1 (got %d)\n", name,
                 args.n_tiles, args.blocks);
    return false;
  }
  return true;
}
