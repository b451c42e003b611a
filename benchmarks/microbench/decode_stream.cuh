// What the decode stream microbenchmarks (decode_read_pattern.cu,
// decode_l2_policy.cu, decode_stream_variants.cu, decode_cluster_lockstep.cu)
// share: the cache geometry, the cp.async and mbarrier primitives, the two
// tile pipelines (cp.async commit groups, and mbarriers for bulk / TMA
// copies), and the timing loop.
// The pipelines are the split-KV kernel's with the math left out: kStages K/V
// tiles in flight, each stage refilled as soon as every thread has seen it,
// and one value per tile touched so that nothing is optimised away.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_runtime.h>

#define CHECK(x)                                                                      \
  do {                                                                                \
    cudaError_t e = (x);                                                              \
    if (e != cudaSuccess) {                                                           \
      std::printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e));           \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

// One key row of one kv head: head dim 128 in bf16.
constexpr int kHeadDim = 128;
constexpr int kRowBytes = kHeadDim * 2;
constexpr int kThreads = 128;
// The benchmarks' caches: 8 kv heads (GQA 32:8), batch x seqlen_k up to 16 x
// 128k keys; kCacheBytes is one of K or V.
constexpr int kNheadsK = 8;
constexpr int64_t kMaxKeys = 16 * 131072;
constexpr int64_t kCacheBytes = kMaxKeys * kNheadsK * kRowBytes;

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async_16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst)), "l"(src));
}
__device__ __forceinline__ void cp_async_fence() { asm volatile("cp.async.commit_group;\n"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)),
               "r"(bytes));
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "wait:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity));
}

// Called by every thread before the first load of stream_tiles_mbarrier.
template <int kStages>
__device__ __forceinline__ void init_stage_barriers(uint64_t* full) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) mbar_init(&full[s], 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
}

// cp.async pipeline: load(tile, stage) issues one tile's copies into a stage
// (K at smem + 2 * stage * tile_bytes, V after it); one commit group per tile.
// before_tile(tile), if given, runs before each tile is waited for.
struct NoHook {
  __device__ void operator()(int) const {}
};
template <int kStages, typename Load, typename BeforeTile = NoHook>
__device__ __forceinline__ float stream_tiles_cp_async(const char* smem, int tile_bytes,
                                                       int num_tiles, Load load,
                                                       BeforeTile before_tile = {}) {
  float acc = 0.f;
  for (int t = 0; t < kStages; ++t) {
    if (t < num_tiles) load(t, t);
    cp_async_fence();
  }
  int stage = 0;
  for (int t = 0; t < num_tiles; ++t) {
    before_tile(t);
    cp_async_wait<kStages - 1>();
    __syncthreads();
    acc += reinterpret_cast<const float*>(smem + (2 * stage) * tile_bytes)[threadIdx.x];
    __syncthreads();
    if (t + kStages < num_tiles) load(t + kStages, stage);
    cp_async_fence();
    stage = stage == kStages - 1 ? 0 : stage + 1;
  }
  return acc;
}

// mbarrier pipeline (bulk and TMA copies): load(tile, stage) posts the
// stage's byte count on full[stage] and issues the copies that complete it.
// full[] must be initialised (count 1) before the first call.
template <int kStages, typename Load>
__device__ __forceinline__ float stream_tiles_mbarrier(const char* smem, int tile_bytes,
                                                       int num_tiles, uint64_t* full, Load load) {
  float acc = 0.f;
  for (int t = 0; t < kStages && t < num_tiles; ++t) load(t, t);
  int stage = 0;
  uint32_t phase = 0;
  for (int t = 0; t < num_tiles; ++t) {
    mbar_wait(&full[stage], phase);
    acc += reinterpret_cast<const float*>(smem + (2 * stage) * tile_bytes)[threadIdx.x];
    __syncthreads();
    if (t + kStages < num_tiles) load(t + kStages, stage);
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
  return acc;
}

// Median time in ms of `reps` timed calls of launch(), each after before(rep)
// (the L2 flush, or nothing), with CUDA events around the call alone.
template <typename Before, typename Launch>
float median_ms(int reps, Before before, Launch launch) {
  cudaEvent_t start, end;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&end));
  launch();
  CHECK(cudaGetLastError());
  std::vector<float> times;
  for (int rep = 0; rep < reps; ++rep) {
    before(rep);
    CHECK(cudaEventRecord(start));
    launch();
    CHECK(cudaEventRecord(end));
    CHECK(cudaEventSynchronize(end));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, start, end));
    times.push_back(ms);
  }
  CHECK(cudaEventDestroy(start));
  CHECK(cudaEventDestroy(end));
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// The device buffers of a run: the K and V caches (kv_bytes each, filled with
// a constant: the stream does not look at the values), a sink for results the
// kernels must not drop, and the buffer whose 256 MB write flushes L2 as
// triton's do_bench does. (The benchmarks unpack it with a structured binding
// that their lambdas capture: C++20.)
constexpr int64_t kFlushBytes = 256 << 20;
struct StreamBuffers {
  char* k;
  char* v;
  float* sink;
  char* flush;
};
inline StreamBuffers alloc_stream_buffers(int64_t kv_bytes) {
  StreamBuffers buffers;
  CHECK(cudaMalloc(&buffers.k, kv_bytes));
  CHECK(cudaMalloc(&buffers.v, kv_bytes));
  CHECK(cudaMalloc(&buffers.sink, 1 << 20));
  CHECK(cudaMalloc(&buffers.flush, kFlushBytes));
  CHECK(cudaMemset(buffers.k, 1, kv_bytes));
  CHECK(cudaMemset(buffers.v, 1, kv_bytes));
  CHECK(cudaMemset(buffers.flush, 0, kFlushBytes));
  return buffers;
}

// Device 0, whose SM count and shared memory sizes the benchmarks size their
// grids and launches by.
inline cudaDeviceProp device_properties() {
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  return prop;
}

// The batch sizes named on the command line, or `fallback`.
inline std::vector<int> batches_from_args(int argc, char** argv, std::vector<int> fallback) {
  std::vector<int> batches;
  for (int i = 1; i < argc; ++i) batches.push_back(std::atoi(argv[i]));
  return batches.empty() ? fallback : batches;
}
