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
//   nvcc -std=c++20 -O3 -gencode arch=compute_90,code=sm_90 decode_l2_policy.cu -o dl2
//   ./dl2 [batch ...] (default 16 64)
#include "decode_stream.cuh"

constexpr int kRows = 64;
constexpr int kStages = 3;

enum Hint { kNone, kPrefetch256, kEvictFirst, kEvictFirstPrefetch256, kNumHints };
const char* const kHintNames[] = {"no hint", "L2::256B", "evict_first", "evict_first+256B"};

template <int kHint>
__device__ __forceinline__ void cp_async_16_hinted(void* dst, const void* src, uint64_t policy) {
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
      cp_async_16_hinted<kHint>(sk + c * 16, k + offset + p * 16, policy);
      cp_async_16_hinted<kHint>(sv + c * 16, v + offset + p * 16, policy);
    }
  };
  const float acc = stream_tiles_cp_async<kStages>(smem, kTileBytes, num_tiles, load);
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
  const cudaDeviceProp prop = device_properties();
  const int sms = prop.multiProcessorCount;
  const int smem = 2 * kStages * kRows * kRowBytes;
  void (*kernels[kNumHints])(const char*, const char*, int, int, float*) = {
      stream_kv<kNone>, stream_kv<kPrefetch256>, stream_kv<kEvictFirst>,
      stream_kv<kEvictFirstPrefetch256>};
  for (auto kernel : kernels) {
    CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  }
  const int nheads_k = kNheadsK;
  const std::vector<int> batches = batches_from_args(argc, argv, {16, 64});
  const auto [k, v, sink, flush] = alloc_stream_buffers(kCacheBytes);
  std::printf("%s, %d SMs, L2 %d MB\n", prop.name, sms, prop.l2CacheSize >> 20);
  const char* const flush_names[] = {"write 256 MB", "read 256 MB", "none"};

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
      auto flush_l2 = [&](int rep) {
        if (flush_mode == 0) CHECK(cudaMemsetAsync(flush, rep, kFlushBytes));
        if (flush_mode == 1) {
          read_buffer<<<4 * sms, 512>>>(reinterpret_cast<const int4*>(flush), kFlushBytes / 16,
                                        sink);
        }
      };
      const float median = median_ms(21, flush_l2, launch);
      std::printf("b %2d sk %6d  flush %-12s %-17s %8.1f us  %.3f TB/s\n", batch, seqlen_k,
                  flush_names[flush_mode], kHintNames[hint], median * 1e3,
                  bytes / (median * 1e-3) / 1e12);
    }
  }
  return 0;
}
