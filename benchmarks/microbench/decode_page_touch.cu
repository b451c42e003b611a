// Why does flash-attn's (b, s, hk, d) cache stream ~0.7% slower than a
// head-major one at batch 16 x 128k keys on an H200, and not at 16k-32k
// (decode_read_pattern_b16.txt)? Two suspects, each with a walk that would
// remove it, all with one block per (batch, kv head), 64-key tiles and three
// cp.async stages, as the split-KV kernel streams:
// - address translation: a block's 256-byte rows are 2 KB apart, so it
//   enters a new 2 MB page every 16 tiles (every 128 in a head-major cache),
//   each time behind a translation miss. "touch N": at each 16th tile one
//   thread prefetches (prefetch.global.L2) the K and V rows N pages ahead,
//   so that the translation is done before the copies arrive there.
// - lockstep at power-of-two offsets: the 16 batch entries start together at
//   the same key, 2^k bytes apart. "skew": batch entry b starts its walk
//   b * tiles / 16 tiles in and wraps around; "skew small": b * 5 tiles in.
// No math, as decode_read_pattern.cu; both layouts for scale.
//   nvcc -std=c++20 -O3 -gencode arch=compute_90a,code=sm_90a decode_page_touch.cu -o dpt
//   ./dpt [batch ...] (default 16)
#include "decode_stream.cuh"

__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
}

// touch_pages > 0: prefetch touch_pages pages ahead, once per 16 tiles.
// skew: 0 none, 1 spread over the key range, 2 five tiles per batch entry.
template <bool kHeadMajor>
__global__ void stream_walk(const char* k, const char* v, int seqlen_k, int nheads_k,
                            int touch_pages, int skew, float* sink) {
  extern __shared__ char smem[];
  constexpr int kRows = 64;
  constexpr int kTileBytes = kRows * kRowBytes;
  constexpr int kTilesPerPage = (2 << 20) / (kRows * kNheadsK * kRowBytes);
  const int batch = blockIdx.x / nheads_k;
  const int head = blockIdx.x % nheads_k;
  const int num_tiles = seqlen_k / kRows;
  const int start = skew == 1 ? int(int64_t(batch) * num_tiles / gridDim.x * nheads_k)
                  : skew == 2 ? batch * 5 % num_tiles
                              : 0;
  auto row_offset = [&](int64_t key) {
    const int64_t row = kHeadMajor ? (int64_t(batch) * nheads_k + head) * seqlen_k + key
                                   : (int64_t(batch) * seqlen_k + key) * nheads_k + head;
    return row * kRowBytes;
  };
  auto walk_tile = [&](int tile) {
    const int t = tile + start;
    return t >= num_tiles ? t - num_tiles : t;
  };
  auto load = [&](int tile, int stage) {
    char* sk = smem + (2 * stage) * kTileBytes;
    char* sv = sk + kTileBytes;
    const int64_t key0 = int64_t(walk_tile(tile)) * kRows;
    for (int c = threadIdx.x; c < kTileBytes / 16; c += kThreads) {
      const int64_t offset = row_offset(key0 + c / (kRowBytes / 16)) + (c % (kRowBytes / 16)) * 16;
      cp_async_16(sk + c * 16, k + offset);
      cp_async_16(sv + c * 16, v + offset);
    }
  };
  auto touch = [&](int tile) {
    if (touch_pages == 0 || tile % kTilesPerPage != 0 || threadIdx.x >= 2) return;
    const int ahead = tile + touch_pages * kTilesPerPage;
    if (ahead >= num_tiles) return;
    const int64_t offset = row_offset(int64_t(walk_tile(ahead)) * kRows);
    prefetch_l2((threadIdx.x == 0 ? k : v) + offset);
  };
  const float acc = stream_tiles_cp_async<3>(smem, kTileBytes, num_tiles, load, touch);
  if (acc == 12345.f) sink[blockIdx.x] = acc;
}

int main(int argc, char** argv) {
  const cudaDeviceProp prop = device_properties();
  const int smem_per_sm = int(prop.sharedMemPerMultiprocessor);
  CHECK(cudaFuncSetAttribute(stream_walk<false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             int(prop.sharedMemPerBlockOptin)));
  CHECK(cudaFuncSetAttribute(stream_walk<true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             int(prop.sharedMemPerBlockOptin)));
  const std::vector<int> batches = batches_from_args(argc, argv, {16});
  const auto [k, v, sink, flush] = alloc_stream_buffers(kCacheBytes);

  struct Walk {
    const char* name;
    bool head_major;
    int touch_pages, skew;
  };
  const Walk walks[] = {
      {"bshd", false, 0, 0},          {"bshd touch 1", false, 1, 0},
      {"bshd touch 2", false, 2, 0},  {"bshd skew", false, 0, 1},
      {"bshd skew small", false, 0, 2}, {"bshd skew + touch 1", false, 1, 1},
      {"bhsd", true, 0, 0},           {"bhsd touch 1", true, 1, 0},
  };
  const int seqlens[] = {16384, 32768, 65536, 131072};
  // One block per SM, as the split-KV kernel runs its long streams.
  const int launch_smem = smem_per_sm / 2 + 1024;
  for (int round = 0; round < 2; ++round)
  for (int batch : batches)
  for (int seqlen_k : seqlens) {
    if (int64_t(batch) * seqlen_k > kMaxKeys) continue;
    const double bytes = 2.0 * batch * seqlen_k * kNheadsK * kRowBytes;
    const int blocks = batch * kNheadsK;
    for (const Walk& w : walks) {
      auto launch = [&] {
        if (w.head_major) {
          stream_walk<true><<<blocks, kThreads, launch_smem>>>(k, v, seqlen_k, kNheadsK,
                                                               w.touch_pages, w.skew, sink);
        } else {
          stream_walk<false><<<blocks, kThreads, launch_smem>>>(k, v, seqlen_k, kNheadsK,
                                                                w.touch_pages, w.skew, sink);
        }
      };
      const float median = median_ms(
          15, [&](int rep) { CHECK(cudaMemsetAsync(flush, rep, kFlushBytes)); }, launch);
      std::printf("b %2d sk %6d  %-22s %4d blocks %8.1f us  %.3f TB/s\n", batch, seqlen_k, w.name,
                  blocks, median * 1e3, bytes / (median * 1e-3) / 1e12);
    }
  }
  return 0;
}
