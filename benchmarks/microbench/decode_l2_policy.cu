// Does the L2 state a decode kernel starts from cost it time, and does a
// cache hint on its K/V reads change that? The benchmark protocol flushes L2
// before every timed call by writing a 256 MB buffer (triton's do_bench), so
// each call starts with L2 full of dirty lines; in serving, L2 likewise holds
// what the previous kernels wrote. Every line the stream brings in evicts one
// of those and, while they last, that eviction is a write-back to DRAM on top
// of the reads. A K/V line is used once, so it can be marked evict_first:
// lines brought in then tend to evict each other, not the dirty lines.
// Stream: one block per (batch, kv head) over flash-attn's (b, s, hk, d)
// cache, 64-key tiles, three cp.async stages, no math (as decode_read_pattern).
//   nvcc -std=c++17 -O3 -gencode arch=compute_90,code=sm_90 decode_l2_policy.cu -o dl2
//   ./dl2 [batch ...] (default 16 64)
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
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

constexpr int kHeadDim = 128;
constexpr int kRowBytes = kHeadDim * 2;
constexpr int kThreads = 128;
constexpr int kRows = 64;
constexpr int kStages = 3;

enum Hint { kNone, kPrefetch256, kEvictFirst, kEvictFirstPrefetch256, kNumHints };
const char* const kHintNames[] = {"no hint", "L2::256B", "evict_first", "evict_first+256B"};

template <int kHint>
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, uint64_t policy) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  if constexpr (kHint == kNone) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src));
  } else if constexpr (kHint == kPrefetch256) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" ::"r"(d), "l"(src));
  } else if constexpr (kHint == kEvictFirst) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\n" ::"r"(d),
                 "l"(src), "l"(policy));
  } else {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::256B [%0], [%1], 16, %2;\n" ::"r"(d),
                 "l"(src), "l"(policy));
  }
}
__device__ __forceinline__ void cp_async_fence() { asm volatile("cp.async.commit_group;\n"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

template <int kHint>
__global__ void stream_kv(const char* k, const char* v, int seqlen_k, int nheads_k, float* sink) {
  extern __shared__ char smem[];
  uint64_t policy = 0;
  if constexpr (kHint == kEvictFirst || kHint == kEvictFirstPrefetch256) {
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  }
  const int batch = blockIdx.x / nheads_k;
  const int head = blockIdx.x % nheads_k;
  constexpr int kTileBytes = kRows * kRowBytes;
  constexpr int kChunks = kTileBytes / 16;
  const int num_tiles = seqlen_k / kRows;
  auto load = [&](int tile, int stage) {
    char* sk = smem + (2 * stage) * kTileBytes;
    char* sv = sk + kTileBytes;
    for (int c = threadIdx.x; c < kChunks; c += kThreads) {
      const int p = c % (kRowBytes / 16);
      const int r = c / (kRowBytes / 16);
      const int64_t key = int64_t(tile) * kRows + r;
      const int64_t offset = ((int64_t(batch) * seqlen_k + key) * nheads_k + head) * kRowBytes;
      cp_async_16<kHint>(sk + c * 16, k + offset + p * 16, policy);
      cp_async_16<kHint>(sv + c * 16, v + offset + p * 16, policy);
    }
  };
  float acc = 0.f;
  for (int t = 0; t < kStages; ++t) {
    if (t < num_tiles) load(t, t);
    cp_async_fence();
  }
  int stage = 0;
  for (int t = 0; t < num_tiles; ++t) {
    cp_async_wait<kStages - 1>();
    __syncthreads();
    acc += reinterpret_cast<const float*>(smem + (2 * stage) * kTileBytes)[threadIdx.x];
    __syncthreads();
    if (t + kStages < num_tiles) load(t + kStages, stage);
    cp_async_fence();
    stage = stage == kStages - 1 ? 0 : stage + 1;
  }
  if (acc == 12345.f) sink[blockIdx.x] = acc;
}

// Reads a buffer: fills L2 with clean lines (a flush that leaves nothing to
// write back).
__global__ void read_buffer(const int4* buf, int64_t n, float* sink) {
  int acc = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    acc ^= buf[i].x;
  }
  if (acc == 0x12345) sink[0] = acc;
}

int main(int argc, char** argv) {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const int smem = 2 * kStages * kRows * kRowBytes;
  void (*kernels[kNumHints])(const char*, const char*, int, int, float*) = {
      stream_kv<kNone>, stream_kv<kPrefetch256>, stream_kv<kEvictFirst>,
      stream_kv<kEvictFirstPrefetch256>};
  for (auto kernel : kernels) {
    CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  }
  const int nheads_k = 8;
  std::vector<int> batches;
  for (int i = 1; i < argc; ++i) batches.push_back(std::atoi(argv[i]));
  if (batches.empty()) batches = {16, 64};
  constexpr int64_t kMaxKeys = 16 * 131072;
  const int64_t max_bytes = kMaxKeys * nheads_k * kRowBytes;
  char *k, *v;
  float* sink;
  CHECK(cudaMalloc(&k, max_bytes));
  CHECK(cudaMalloc(&v, max_bytes));
  CHECK(cudaMalloc(&sink, 1 << 20));
  CHECK(cudaMemset(k, 1, max_bytes));
  CHECK(cudaMemset(v, 1, max_bytes));
  constexpr int64_t kFlushBytes = 256 << 20;
  char* flush;
  CHECK(cudaMalloc(&flush, kFlushBytes));
  CHECK(cudaMemset(flush, 0, kFlushBytes));
  std::printf("%s, %d SMs, L2 %d MB\n", prop.name, sms, prop.l2CacheSize >> 20);
  const char* const flush_names[] = {"write 256 MB", "read 256 MB", "none"};

  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  for (int round = 0; round < 2; ++round)
  for (int batch : batches)
  for (int seqlen_k : {4096, 8192, 16384, 131072}) {
    if (int64_t(batch) * seqlen_k > kMaxKeys) continue;
    const double bytes = 2.0 * batch * seqlen_k * nheads_k * kRowBytes;
    for (int flush_mode = 0; flush_mode < 3; ++flush_mode)
    for (int hint = 0; hint < kNumHints; ++hint) {
      auto launch = [&] {
        kernels[hint]<<<batch * nheads_k, kThreads, smem>>>(k, v, seqlen_k, nheads_k, sink);
      };
      launch();
      CHECK(cudaGetLastError());
      std::vector<float> times;
      for (int rep = 0; rep < 21; ++rep) {
        if (flush_mode == 0) CHECK(cudaMemsetAsync(flush, rep, kFlushBytes));
        if (flush_mode == 1) {
          read_buffer<<<4 * sms, 512>>>(reinterpret_cast<const int4*>(flush), kFlushBytes / 16,
                                        sink);
        }
        CHECK(cudaEventRecord(a));
        launch();
        CHECK(cudaEventRecord(b));
        CHECK(cudaEventSynchronize(b));
        float ms;
        CHECK(cudaEventElapsedTime(&ms, a, b));
        times.push_back(ms);
      }
      std::sort(times.begin(), times.end());
      const float median = times[times.size() / 2];
      std::printf("b %2d sk %6d  flush %-12s %-17s %8.1f us  %.3f TB/s\n", batch, seqlen_k,
                  flush_names[flush_mode], kHintNames[hint], median * 1e3,
                  bytes / (median * 1e-3) / 1e12);
    }
  }
  return 0;
}
