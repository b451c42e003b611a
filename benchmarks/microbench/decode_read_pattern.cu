// How fast can a decode kernel stream a KV cache, as a function of how a
// thread block walks it? No math: each block copies its K/V rows into a ring
// of shared-memory stages with cp.async, exactly as the split-KV kernel does,
// and touches one value per stage. The question it answers: on flash-attn's
// (batch, seqlen, kv head, head dim) cache, does a block that reads the rows
// of 2 (or 4) neighbouring kv heads at once - 512 B (1 KB) contiguous per key
// instead of 256 B - stream faster, and how close does that come to a
// head-major cache, where one head's keys are contiguous? And a block that
// reads all 8 kv heads of a key range (2 KB contiguous per key, the key range
// split so that the grid still covers every SM)?
//   nvcc -std=c++20 -O3 -gencode arch=compute_90,code=sm_90 decode_read_pattern.cu -o drp
//   ./drp [batch ...] (default 64; prints one line per pattern and shape)
#include "decode_stream.cuh"

// heads_per_block neighbouring kv heads, rows_per_head keys of each per tile,
// kStages tiles in flight; the keys split into blockIdx.y's ranges.
// head_major: the cache is (b, hk, s, d).
template <int kStages>
__global__ void stream_kv(const char* k, const char* v, int seqlen_k, int nheads_k,
                          int heads_per_block, int rows_per_head, bool head_major,
                          float* sink) {
  extern __shared__ char smem[];
  const int groups = nheads_k / heads_per_block;
  const int batch = blockIdx.x / groups;
  const int head0 = (blockIdx.x % groups) * heads_per_block;
  const int tile_bytes = heads_per_block * rows_per_head * kRowBytes;  // one of K or V
  const int chunks = tile_bytes / 16;
  const int all_tiles = seqlen_k / rows_per_head;
  const int first_tile = int(int64_t(blockIdx.y) * all_tiles / gridDim.y);
  const int num_tiles = int(int64_t(blockIdx.y + 1) * all_tiles / gridDim.y) - first_tile;

  auto load = [&](int tile, int stage) {
    char* sk = smem + (2 * stage) * tile_bytes;
    char* sv = sk + tile_bytes;
    for (int c = threadIdx.x; c < chunks; c += kThreads) {
      // chunk c: key row r of the tile, head h of the block's heads, 16 B piece
      // p; consecutive threads take consecutive bytes of memory.
      const int p = c % (kRowBytes / 16);
      const int h = (c / (kRowBytes / 16)) % heads_per_block;
      const int r = c / (kRowBytes / 16) / heads_per_block;
      const int64_t key = int64_t(first_tile + tile) * rows_per_head + r;
      int64_t offset;
      if (head_major) {
        offset = ((int64_t(batch) * nheads_k + head0 + h) * seqlen_k + key) * kRowBytes;
      } else {
        offset = ((int64_t(batch) * seqlen_k + key) * nheads_k + head0 + h) * kRowBytes;
      }
      cp_async_16(sk + c * 16, k + offset + p * 16);
      cp_async_16(sv + c * 16, v + offset + p * 16);
    }
  };

  const float acc = stream_tiles_cp_async<kStages>(smem, tile_bytes, num_tiles, load);
  if (acc == 12345.f) sink[blockIdx.x] = acc;
}

int main(int argc, char** argv) {
  const cudaDeviceProp prop = device_properties();
  const int sms = prop.multiProcessorCount;
  const int smem_optin = int(prop.sharedMemPerBlockOptin);
  const int smem_per_sm = int(prop.sharedMemPerMultiprocessor);
  CHECK(cudaFuncSetAttribute(stream_kv<3>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             smem_optin));
  CHECK(cudaFuncSetAttribute(stream_kv<2>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             smem_optin));
  const int nheads_k = kNheadsK;
  const std::vector<int> batches = batches_from_args(argc, argv, {64});
  const auto [k, v, sink, flush] = alloc_stream_buffers(kCacheBytes);

  // Device copy bandwidth (read + write bytes), for scale.
  {
    cudaEvent_t a, b;
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
    for (int i = 0; i < 3; ++i) CHECK(cudaMemcpy(v, k, kCacheBytes, cudaMemcpyDeviceToDevice));
    CHECK(cudaEventRecord(a));
    for (int i = 0; i < 10; ++i) CHECK(cudaMemcpy(v, k, kCacheBytes, cudaMemcpyDeviceToDevice));
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    std::printf("copy  %.3f TB/s (read + write)\n", 2.0 * kCacheBytes * 10 / (ms * 1e-3) / 1e12);
  }

  struct Pattern {
    const char* name;
    int heads_per_block, rows_per_head, stages;
    bool head_major, one_per_sm;
    int splits;  // of the key range; 0: the fewest that give every SM a block
  };
  const Pattern patterns[] = {
      {"bshd 1 head x64 rows s3 1/SM", 1, 64, 3, false, true, 1},
      {"bshd 1 head x64 rows s3 2/SM", 1, 64, 3, false, false, 1},
      {"bshd 2 heads x32 rows s3 2/SM", 2, 32, 3, false, false, 1},
      {"bshd 2 heads x32 rows s3 1/SM", 2, 32, 3, false, true, 1},
      {"bshd 2 heads x64 rows s3 1/SM", 2, 64, 3, false, true, 1},
      {"bshd 2 heads x64 rows s2 1/SM", 2, 64, 2, false, true, 1},
      {"bshd 4 heads x16 rows s3 2/SM", 4, 16, 3, false, false, 1},
      {"bshd 4 heads x32 rows s3 1/SM", 4, 32, 3, false, true, 1},
      {"bshd 8 heads x16 rows s3 1/SM", 8, 16, 3, false, true, 1},
      {"bshd 8 heads x16 rows s3 1/SM split", 8, 16, 3, false, true, 0},
      {"bshd 8 heads x8 rows s3 2/SM split", 8, 8, 3, false, false, 0},
      {"bshd 8 heads x16 rows s2 1/SM split", 8, 16, 2, false, true, 0},
      {"bshd 8 heads x16 rows s3 1/SM 4/SM-split", 8, 16, 3, false, true, -4},
      {"bhsd 1 head x64 rows s3 1/SM", 1, 64, 3, true, true, 1},
      {"bhsd 1 head x64 rows s3 2/SM", 1, 64, 3, true, false, 1},
  };
  const int seqlens[] = {4096, 16384, 32768, 131072};
  for (int round = 0; round < 2; ++round)
  for (int batch : batches)
  for (int seqlen_k : seqlens) {
    if (int64_t(batch) * seqlen_k > kMaxKeys) continue;
    const double bytes = 2.0 * batch * seqlen_k * nheads_k * kRowBytes;
    for (const Pattern& p : patterns) {
      const int items = batch * nheads_k / p.heads_per_block;
      // splits 0 / -n: as many splits as fit one / n blocks on every SM.
      const int per_sm = p.splits < 0 ? -p.splits : 1;
      const int splits = p.splits > 0 ? p.splits : std::max(1, per_sm * sms / items);
      const dim3 blocks(items, splits);
      const int smem = 2 * p.stages * p.heads_per_block * p.rows_per_head * kRowBytes;
      const int launch_smem = p.one_per_sm ? (smem > smem_per_sm / 2 ? smem : smem_per_sm / 2 + 1024)
                                           : smem;
      if (launch_smem > smem_optin) continue;
      auto launch = [&] {
        if (p.stages == 3) {
          stream_kv<3><<<blocks, kThreads, launch_smem>>>(k, v, seqlen_k, nheads_k,
                                                          p.heads_per_block, p.rows_per_head,
                                                          p.head_major, sink);
        } else {
          stream_kv<2><<<blocks, kThreads, launch_smem>>>(k, v, seqlen_k, nheads_k,
                                                          p.heads_per_block, p.rows_per_head,
                                                          p.head_major, sink);
        }
      };
      const float median = median_ms(
          15, [&](int rep) { CHECK(cudaMemsetAsync(flush, rep, kFlushBytes)); }, launch);
      std::printf("b %2d sk %6d  %-40s %4d blocks %8.1f us  %.3f TB/s\n", batch, seqlen_k,
                  p.name, items * splits, median * 1e3, bytes / (median * 1e-3) / 1e12);
    }
  }
  return 0;
}
