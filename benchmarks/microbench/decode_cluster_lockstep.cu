// Does keeping the blocks of one batch entry in step help the decode stream?
// On flash-attn's (b, s, hk, d) cache the 8 kv heads of a key sit side by
// side: the 8 blocks of one batch entry (one per kv head) each read a 256-byte
// piece of the same 2 KB span per key. A block that reads all 8 heads of a key
// range (2 KB per key) streamed 1.6% faster on an H200 at batch 16 x 128k
// (decode_read_pattern_b16.txt), but it needs a combine pass. Here the walk
// stays one block per (batch, kv head), and the blocks of a batch entry's
// heads form a thread block cluster (sm90), so that they run at once on one
// GPC; with a cluster barrier every `sync` tiles (split arrive / wait, so a
// block waits only for the others' previous arrival) they also stay within a
// tile or so of each other, and their pieces of a 2 KB span reach the memory
// at about the same time. No math, as decode_stream_variants.cu.
//   nvcc -std=c++20 -O3 -gencode arch=compute_90a,code=sm_90a decode_cluster_lockstep.cu -o dcl
//   ./dcl [batch ...] (default 16 64)
#include "decode_stream.cuh"

__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
}

// One block per (batch, kv head), 64-key tiles, kStages in flight. sync > 0:
// every sync tiles, wait for the cluster's previous arrival, then arrive.
template <int kStages, bool kHeadMajor>
__global__ void stream_cluster(const char* k, const char* v, int seqlen_k, int nheads_k, int sync,
                               float* sink) {
  extern __shared__ char smem[];
  constexpr int kRows = 64;
  constexpr int kTileBytes = kRows * kRowBytes;
  const int batch = blockIdx.x / nheads_k;
  const int head = blockIdx.x % nheads_k;
  const int num_tiles = seqlen_k / kRows;
  auto load = [&](int tile, int stage) {
    char* sk = smem + (2 * stage) * kTileBytes;
    char* sv = sk + kTileBytes;
    for (int c = threadIdx.x; c < kTileBytes / 16; c += kThreads) {
      const int64_t key = int64_t(tile) * kRows + c / (kRowBytes / 16);
      const int64_t row = kHeadMajor ? (int64_t(batch) * nheads_k + head) * seqlen_k + key
                                     : (int64_t(batch) * seqlen_k + key) * nheads_k + head;
      const int64_t offset = row * kRowBytes + (c % (kRowBytes / 16)) * 16;
      cp_async_16(sk + c * 16, k + offset);
      cp_async_16(sv + c * 16, v + offset);
    }
  };
  if (sync > 0) cluster_arrive();
  const float acc = stream_tiles_cp_async<kStages>(smem, kTileBytes, num_tiles, load, [&](int t) {
    if (sync > 0 && t % sync == sync - 1) {
      cluster_wait();
      cluster_arrive();
    }
  });
  if (sync > 0) cluster_wait();
  if (acc == 12345.f) sink[blockIdx.x] = acc;
}

int main(int argc, char** argv) {
  const cudaDeviceProp prop = device_properties();
  const int sms = prop.multiProcessorCount;
  const int smem_per_sm = int(prop.sharedMemPerMultiprocessor);
  const int nheads_k = kNheadsK;
  const std::vector<int> batches = batches_from_args(argc, argv, {16, 64});
  const auto [k, v, sink, flush] = alloc_stream_buffers(kCacheBytes);
  constexpr int kStages = 3;
  const int tiles_smem = 2 * kStages * 64 * kRowBytes;
  // One block per SM: ask for more than half of the SM's shared memory.
  const int launch_smem = std::max(tiles_smem, smem_per_sm / 2 + 1024);
  CHECK(cudaFuncSetAttribute(stream_cluster<kStages, false>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, launch_smem));
  CHECK(cudaFuncSetAttribute(stream_cluster<kStages, true>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, launch_smem));
  CHECK(cudaFuncSetAttribute(stream_cluster<kStages, false>,
                             cudaFuncAttributeNonPortableClusterSizeAllowed, 1));

  struct Variant {
    const char* name;
    int cluster;  // blocks per cluster along the kv heads; 1: no cluster
    int sync;     // tiles between cluster barriers; 0: none
    bool head_major;
  };
  const Variant variants[] = {
      {"no cluster", 1, 0, false},
      {"cluster 2", 2, 0, false},
      {"cluster 2 sync 1", 2, 1, false},
      {"cluster 4", 4, 0, false},
      {"cluster 4 sync 1", 4, 1, false},
      {"cluster 4 sync 4", 4, 4, false},
      {"cluster 8", 8, 0, false},
      {"cluster 8 sync 1", 8, 1, false},
      {"cluster 8 sync 4", 8, 4, false},
      {"cluster 8 sync 16", 8, 16, false},
      {"head-major, no cluster", 1, 0, true},
  };
  std::printf("%s, %d SMs; L2 flushed by a 256 MB write before each call, median of 21\n",
              prop.name, sms);
  // A launch of grid_x blocks in clusters of `cluster` along x (1: no
  // cluster); `attribute` must outlive the config.
  auto launch_config = [&](int grid_x, int cluster, cudaLaunchAttribute& attribute) {
    attribute = {};
    attribute.id = cudaLaunchAttributeClusterDimension;
    attribute.val.clusterDim.x = cluster;
    attribute.val.clusterDim.y = 1;
    attribute.val.clusterDim.z = 1;
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(grid_x);
    config.blockDim = dim3(kThreads);
    config.dynamicSmemBytes = launch_smem;
    config.attrs = cluster > 1 ? &attribute : nullptr;
    config.numAttrs = cluster > 1 ? 1 : 0;
    return config;
  };
  for (int cluster : {2, 4, 8}) {
    cudaLaunchAttribute attribute;
    const cudaLaunchConfig_t config = launch_config(16 * nheads_k, cluster, attribute);
    int clusters = 0;
    CHECK(cudaOccupancyMaxActiveClusters(&clusters, stream_cluster<kStages, false>, &config));
    std::printf("cluster %d: at most %d clusters resident (%d blocks)\n", cluster, clusters,
                clusters * cluster);
  }
  for (int round = 0; round < 2; ++round)
  for (int batch : batches)
  for (int seqlen_k : {4096, 16384, 131072}) {
    if (int64_t(batch) * seqlen_k > kMaxKeys) continue;
    const double bytes = 2.0 * batch * seqlen_k * nheads_k * kRowBytes;
    for (const Variant& var : variants) {
      auto launch = [&] {
        cudaLaunchAttribute attribute;
        const cudaLaunchConfig_t config = launch_config(batch * nheads_k, var.cluster, attribute);
        auto kernel = var.head_major ? stream_cluster<kStages, true> : stream_cluster<kStages, false>;
        CHECK(cudaLaunchKernelEx(&config, kernel, static_cast<const char*>(k),
                                 static_cast<const char*>(v), seqlen_k, nheads_k, var.sync, sink));
      };
      const float median = median_ms(
          21, [&](int rep) { CHECK(cudaMemsetAsync(flush, rep, kFlushBytes)); }, launch);
      std::printf("b %2d sk %6d  %-24s %8.1f us  %.3f TB/s\n", batch, seqlen_k, var.name,
                  median * 1e3, bytes / (median * 1e-3) / 1e12);
    }
  }
  CHECK(cudaDeviceSynchronize());
  return 0;
}
