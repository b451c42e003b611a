// How the decode stream is issued, and how fast each way reads a KV cache.
// The split-KV kernel moves each K/V tile as 16-byte cp.async chunks, 16 per
// key row per tensor, K and V chunk by chunk, issued by all 128 threads of a
// block, and walks the key tiles from the last to the first (so that a causal
// diagonal tile comes first). Variants, each a pure stream with no math (as
// decode_read_pattern.cu): one block per (batch, kv head) over flash-attn's
// (b, s, hk, d) cache, one block per SM, `x N` = N tiles in flight:
//   - walk order: ascending against descending;
//   - issue order: a thread's K chunks of a tile before its V chunks;
//   - tile shape and depth: 64 or 128 keys, 2-4 stages;
//   - cp.async.bulk: a whole 256-byte key row per instruction, completing on
//     an mbarrier (a 64-key tile is 128 instructions instead of 2048);
//   - TMA: one tensor copy per K or V tile, issued by one thread, with and
//     without the 128-byte swizzle an ldmatrix reader needs, and with each
//     L2 promotion;
//   - the head-major (b, hk, s, d) cache SDPA is given, for cp.async and TMA.
//   nvcc -std=c++20 -O3 -gencode arch=compute_90a,code=sm_90a decode_stream_variants.cu -o dsv
//   ./dsv [batch ...] (default 16 64)
#include <cuda.h>

#include "decode_stream.cuh"

__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes,
                                          uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

// kKThenV: a thread issues all its K chunks of a tile, then all its V chunks
// (instead of K and V chunk by chunk, interleaved). kHeadMajor: the cache is
// (b, hk, s, d).
template <int kStages, int kRows, bool kDescending = false, bool kKThenV = false,
          bool kHeadMajor = false>
__global__ void stream_cp_async(const char* k, const char* v, int seqlen_k, int nheads_k,
                                float* sink) {
  extern __shared__ char smem[];
  const int batch = blockIdx.x / nheads_k;
  const int head = blockIdx.x % nheads_k;
  constexpr int kTileBytes = kRows * kRowBytes;
  const int num_tiles = seqlen_k / kRows;
  auto load = [&](int step, int stage) {
    const int tile = kDescending ? num_tiles - 1 - step : step;
    char* sk = smem + (2 * stage) * kTileBytes;
    char* sv = sk + kTileBytes;
    auto offset_of = [&](int c) {
      const int64_t key = int64_t(tile) * kRows + c / (kRowBytes / 16);
      const int64_t row = kHeadMajor ? (int64_t(batch) * nheads_k + head) * seqlen_k + key
                                     : (int64_t(batch) * seqlen_k + key) * nheads_k + head;
      return row * kRowBytes + (c % (kRowBytes / 16)) * 16;
    };
    if constexpr (kKThenV) {
      for (int c = threadIdx.x; c < kTileBytes / 16; c += kThreads) {
        cp_async_16(sk + c * 16, k + offset_of(c));
      }
      for (int c = threadIdx.x; c < kTileBytes / 16; c += kThreads) {
        cp_async_16(sv + c * 16, v + offset_of(c));
      }
    } else {
      for (int c = threadIdx.x; c < kTileBytes / 16; c += kThreads) {
        cp_async_16(sk + c * 16, k + offset_of(c));
        cp_async_16(sv + c * 16, v + offset_of(c));
      }
    }
  };
  const float acc = stream_tiles_cp_async<kStages>(smem, kTileBytes, num_tiles, load);
  if (acc == 12345.f) sink[blockIdx.x] = acc;
}

// kIssuers threads issue the row copies of a tile (kRows / kIssuers rows each,
// K and V); thread 0 posts the byte count on the stage's barrier first.
template <int kStages, int kRows, int kIssuers>
__global__ void stream_bulk(const char* k, const char* v, int seqlen_k, int nheads_k,
                            float* sink) {
  extern __shared__ __align__(128) char smem[];
  constexpr int kTileBytes = kRows * kRowBytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + 2 * kStages * kTileBytes);
  const int batch = blockIdx.x / nheads_k;
  const int head = blockIdx.x % nheads_k;
  const int num_tiles = seqlen_k / kRows;
  init_stage_barriers<kStages>(full);
  auto load = [&](int tile, int stage) {
    if (threadIdx.x >= kIssuers) return;
    if (threadIdx.x == 0) mbar_expect_tx(&full[stage], 2 * kTileBytes);
    __syncwarp();
    char* sk = smem + (2 * stage) * kTileBytes;
    char* sv = sk + kTileBytes;
    for (int r = threadIdx.x; r < kRows; r += kIssuers) {
      const int64_t key = int64_t(tile) * kRows + r;
      const int64_t offset = ((int64_t(batch) * seqlen_k + key) * nheads_k + head) * kRowBytes;
      bulk_copy(sk + r * kRowBytes, k + offset, kRowBytes, &full[stage]);
      bulk_copy(sv + r * kRowBytes, v + offset, kRowBytes, &full[stage]);
    }
  };
  const float acc = stream_tiles_mbarrier<kStages>(smem, kTileBytes, num_tiles, full, load);
  if (acc == 12345.f) sink[blockIdx.x] = acc;
}

// TMA: thread 0 copies a whole K tile and a whole V tile with one tensor copy
// each. kMap selects the tensor map: 0 = (b, s, hk, d) cache, box (d, 1 head,
// kRows keys), no swizzle; 1 = the same with d split into two 64-element
// halves, 128-byte swizzle (what a kernel reading the tile with ldmatrix would
// use); 2 = head-major (b, hk, s, d) cache, box (d, kRows keys).
template <int kStages, int kRows, int kMap>
__global__ void stream_tma(const __grid_constant__ CUtensorMap k_map,
                           const __grid_constant__ CUtensorMap v_map, int seqlen_k, int nheads_k,
                           float* sink) {
  extern __shared__ char smem_raw[];
  // 128-byte swizzled destinations must be 1024-byte aligned.
  char* smem = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  constexpr int kTileBytes = kRows * kRowBytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + 2 * kStages * kTileBytes);
  const int batch = blockIdx.x / nheads_k;
  const int head = blockIdx.x % nheads_k;
  const int num_tiles = seqlen_k / kRows;
  init_stage_barriers<kStages>(full);
  auto copy = [&](const CUtensorMap* map, char* dst, int key0, uint64_t* bar) {
    const uint64_t desc = reinterpret_cast<uint64_t>(map);
    if constexpr (kMap == 0) {
      asm volatile(
          "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
          " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(smem_addr(dst)),
          "l"(desc), "r"(0), "r"(head), "r"(batch * seqlen_k + key0), "r"(smem_addr(bar))
          : "memory");
    } else if constexpr (kMap == 1) {
      asm volatile(
          "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
          " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(smem_addr(dst)),
          "l"(desc), "r"(0), "r"(0), "r"(head), "r"(batch * seqlen_k + key0),
          "r"(smem_addr(bar))
          : "memory");
    } else {
      asm volatile(
          "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
          " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(smem_addr(dst)),
          "l"(desc), "r"(0), "r"((batch * nheads_k + head) * seqlen_k + key0),
          "r"(smem_addr(bar))
          : "memory");
    }
  };
  auto load = [&](int tile, int stage) {
    if (threadIdx.x != 0) return;
    mbar_expect_tx(&full[stage], 2 * kTileBytes);
    char* sk = smem + (2 * stage) * kTileBytes;
    copy(&k_map, sk, tile * kRows, &full[stage]);
    copy(&v_map, sk + kTileBytes, tile * kRows, &full[stage]);
  };
  const float acc = stream_tiles_mbarrier<kStages>(smem, kTileBytes, num_tiles, full, load);
  if (acc == 12345.f) sink[blockIdx.x] = acc;
}

typedef CUresult (*EncodeTiled)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// Tensor map kMap (see stream_tma) over a buffer of `rows` 256-byte key rows.
CUtensorMap make_map(EncodeTiled encode, void* base, int64_t rows, int map, int box_rows,
                     CUtensorMapL2promotion promotion) {
  CUtensorMap m;
  CUresult r;
  const cuuint32_t unit[4] = {1, 1, 1, 1};
  if (map == 0) {
    const cuuint64_t dims[3] = {kHeadDim, 8, cuuint64_t(rows / 8)};
    const cuuint64_t strides[2] = {kRowBytes, 8 * kRowBytes};
    const cuuint32_t box[3] = {kHeadDim, 1, cuuint32_t(box_rows)};
    r = encode(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, base, dims, strides, box, unit,
               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
               promotion, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  } else if (map == 1) {
    const cuuint64_t dims[4] = {64, 2, 8, cuuint64_t(rows / 8)};
    const cuuint64_t strides[3] = {128, kRowBytes, 8 * kRowBytes};
    const cuuint32_t box[4] = {64, 2, 1, cuuint32_t(box_rows)};
    r = encode(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, base, dims, strides, box, unit,
               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
               promotion, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  } else {
    const cuuint64_t dims[2] = {kHeadDim, cuuint64_t(rows)};
    const cuuint64_t strides[1] = {kRowBytes};
    const cuuint32_t box[2] = {kHeadDim, cuuint32_t(box_rows)};
    r = encode(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, base, dims, strides, box, unit,
               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
               promotion, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  }
  if (r != CUDA_SUCCESS) {
    std::printf("cuTensorMapEncodeTiled failed (%d), map %d\n", int(r), map);
    std::exit(1);
  }
  return m;
}

int main(int argc, char** argv) {
  const cudaDeviceProp prop = device_properties();
  const int sms = prop.multiProcessorCount;
  const int smem_per_sm = int(prop.sharedMemPerMultiprocessor);
  const int nheads_k = kNheadsK;
  const std::vector<int> batches = batches_from_args(argc, argv, {16, 64});
  const auto [k, v, sink, flush] = alloc_stream_buffers(kCacheBytes);

  EncodeTiled encode = nullptr;
  cudaDriverEntryPointQueryResult query;
  CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", reinterpret_cast<void**>(&encode),
                                         12000, cudaEnableDefault, &query));
  if (encode == nullptr) {
    std::printf("cuTensorMapEncodeTiled not found\n");
    return 1;
  }
  const int64_t rows = kMaxKeys * nheads_k;
  // L2 promotion: none, as the cp.async stream (the L2::256B hint made it slower on the H200).
  constexpr auto kNoPromotion = CU_TENSOR_MAP_L2_PROMOTION_NONE;
  const CUtensorMap k_map0 = make_map(encode, k, rows, 0, 64, kNoPromotion);
  const CUtensorMap v_map0 = make_map(encode, v, rows, 0, 64, kNoPromotion);
  const CUtensorMap k_map1 = make_map(encode, k, rows, 1, 64, kNoPromotion);
  const CUtensorMap v_map1 = make_map(encode, v, rows, 1, 64, kNoPromotion);
  const CUtensorMap k_map2 = make_map(encode, k, rows, 2, 64, kNoPromotion);
  const CUtensorMap v_map2 = make_map(encode, v, rows, 2, 64, kNoPromotion);
  const CUtensorMap k_map0_128 = make_map(encode, k, rows, 0, 128, kNoPromotion);
  const CUtensorMap v_map0_128 = make_map(encode, v, rows, 0, 128, kNoPromotion);
  const CUtensorMap k_map0_p128 = make_map(encode, k, rows, 0, 64, CU_TENSOR_MAP_L2_PROMOTION_L2_128B);
  const CUtensorMap v_map0_p128 = make_map(encode, v, rows, 0, 64, CU_TENSOR_MAP_L2_PROMOTION_L2_128B);
  const CUtensorMap k_map0_p256 = make_map(encode, k, rows, 0, 64, CU_TENSOR_MAP_L2_PROMOTION_L2_256B);
  const CUtensorMap v_map0_p256 = make_map(encode, v, rows, 0, 64, CU_TENSOR_MAP_L2_PROMOTION_L2_256B);

  using CpAsyncKernel = void (*)(const char*, const char*, int, int, float*);
  using TmaKernel = void (*)(CUtensorMap, CUtensorMap, int, int, float*);
  struct Variant {
    const char* name;
    CpAsyncKernel cp_async_kernel;
    TmaKernel tma_kernel;
    const CUtensorMap* k_map;
    const CUtensorMap* v_map;
    int smem;
  };
  constexpr int kTile64 = 64 * kRowBytes, kTile128 = 128 * kRowBytes;
  const Variant variants[] = {
      {"cp.async 64 rows x3", stream_cp_async<3, 64>, nullptr, nullptr, nullptr, 2 * 3 * kTile64},
      {"cp.async 64 rows x3 descending", stream_cp_async<3, 64, true>, nullptr, nullptr, nullptr,
       2 * 3 * kTile64},
      {"cp.async 64 rows x3 K then V", stream_cp_async<3, 64, false, true>, nullptr, nullptr,
       nullptr, 2 * 3 * kTile64},
      {"cp.async 128 rows x2 K then V", stream_cp_async<2, 128, false, true>, nullptr, nullptr,
       nullptr, 2 * 2 * kTile128},
      {"cp.async 64 rows x3 head-major", stream_cp_async<3, 64, false, false, true>, nullptr,
       nullptr, nullptr, 2 * 3 * kTile64},
      {"cp.async 128 rows x2 K then V head-major", stream_cp_async<2, 128, false, true, true>,
       nullptr, nullptr, nullptr, 2 * 2 * kTile128},
      {"cp.async 64 rows x4", stream_cp_async<4, 64>, nullptr, nullptr, nullptr, 2 * 4 * kTile64},
      {"cp.async 128 rows x2", stream_cp_async<2, 128>, nullptr, nullptr, nullptr, 2 * 2 * kTile128},
      {"bulk 64 rows x3, 64 issuers", stream_bulk<3, 64, 64>, nullptr, nullptr, nullptr,
       2 * 3 * kTile64 + 64},
      {"tma 64 rows x3", nullptr, stream_tma<3, 64, 0>, &k_map0, &v_map0, 2 * 3 * kTile64 + 1088},
      {"tma 64 rows x3 L2 promo 128B", nullptr, stream_tma<3, 64, 0>, &k_map0_p128, &v_map0_p128,
       2 * 3 * kTile64 + 1088},
      {"tma 64 rows x3 L2 promo 256B", nullptr, stream_tma<3, 64, 0>, &k_map0_p256, &v_map0_p256,
       2 * 3 * kTile64 + 1088},
      {"tma 64 rows x4", nullptr, stream_tma<4, 64, 0>, &k_map0, &v_map0, 2 * 4 * kTile64 + 1088},
      {"tma 128 rows x2", nullptr, stream_tma<2, 128, 0>, &k_map0_128, &v_map0_128,
       2 * 2 * kTile128 + 1088},
      {"tma 64 rows x3 swizzle128", nullptr, stream_tma<3, 64, 1>, &k_map1, &v_map1,
       2 * 3 * kTile64 + 1088},
      {"tma 64 rows x3 head-major", nullptr, stream_tma<3, 64, 2>, &k_map2, &v_map2,
       2 * 3 * kTile64 + 1088},
  };
  for (const Variant& var : variants) {
    if (var.cp_async_kernel) {
      CHECK(cudaFuncSetAttribute(var.cp_async_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 smem_per_sm - 1024));
    } else {
      CHECK(cudaFuncSetAttribute(var.tma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 smem_per_sm - 1024));
    }
  }
  std::printf("%s, %d SMs; L2 flushed by a 256 MB write before each call, median of 21\n",
              prop.name, sms);
  for (int round = 0; round < 2; ++round)
  for (int batch : batches)
  for (int seqlen_k : {4096, 8192, 16384, 131072}) {
    if (int64_t(batch) * seqlen_k > kMaxKeys) continue;
    const double bytes = 2.0 * batch * seqlen_k * nheads_k * kRowBytes;
    for (const Variant& var : variants) {
      // One block per SM: ask for more than half of the SM's shared memory.
      const int launch_smem = std::max(var.smem, smem_per_sm / 2 + 1024);
      auto launch = [&] {
        if (var.cp_async_kernel) {
          var.cp_async_kernel<<<batch * nheads_k, kThreads, launch_smem>>>(k, v, seqlen_k,
                                                                          nheads_k, sink);
        } else {
          var.tma_kernel<<<batch * nheads_k, kThreads, launch_smem>>>(*var.k_map, *var.v_map,
                                                                     seqlen_k, nheads_k, sink);
        }
      };
      const float median = median_ms(
          21, [&](int rep) { CHECK(cudaMemsetAsync(flush, rep, kFlushBytes)); }, launch);
      std::printf("b %2d sk %6d  %-32s %8.1f us  %.3f TB/s\n", batch, seqlen_k, var.name,
                  median * 1e3, bytes / (median * 1e-3) / 1e12);
    }
  }
  CHECK(cudaDeviceSynchronize());
  return 0;
}
