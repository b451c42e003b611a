// Measurement 1 of docs/head_dims_dv_and_512.md (section 6): what the head-dim
// split of a 2-block cluster costs per key tile. Option D of section 2 runs
// the d512 forward as two d256 blocks of one cluster; each computes its half
// of S = Q K^T, sends it to the other through distributed shared memory, and
// adds the other's half before the softmax, so both hold the same S. This
// runs the Hopper forward's d256 block at N = 64 (the traits of
// fwd_kernel_traits_sm90.h: S = Q K^T from shared memory, O += P V with P
// from registers, the online softmax of core/softmax.h, the overlap of S(i)
// with P(i-1) V(i-1)) over tiles already in shared memory, with and without
// the exchange, so that the difference is the exchange alone:
//   - st.async of the thread's fp32 S fragment into the peer's buffer, the
//     bytes counted on the peer's mbarrier (complete_tx);
//   - a wait on this block's own buffer, the add, and a remote arrive on the
//     peer's "buffer read" mbarrier, which the peer waits on before its next
//     send.
// No loads from global memory in the loop: the question is the exchange
// against the products, not the copies. Section 2's kill criterion: the
// exchange adds more than 15% per tile.
//
//   nvcc -std=c++20 -O3 --use_fast_math --expt-relaxed-constexpr -I csrc -I <cutlass>/include \
//     -gencode arch=compute_90a,code=sm_90a benchmarks/microbench/dsmem_exchange.cu -o
//     dsmem_exchange
//   ./dsmem_exchange [tiles per block, default 2048] [clusters, default: as many as fit at once]
//
// It checks the exchange before timing it: with it, the two blocks of every
// cluster must hold bitwise the same S (a + b == b + a in fp32) after the
// last tile, and, without it, different ones (their halves of Q and K differ).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_runtime.h>

#include <cute/arch/cluster_sm90.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "cuda/core/cuda_check.h"
#include "resident_tiles_sm90.cuh"

using namespace cute;

using Element = cutlass::bfloat16_t;
// A cluster block of the d512 forward: 256 of Q's and K's columns, 256 of
// V's and O's, 128 query rows (two MMA warpgroups), 64-key tiles.
using Traits = flash::FwdSm90KernelTraits<256, 128, 64, Element>;
constexpr int kBlockM = Traits::kBlockM;
constexpr int kBlockN = Traits::kBlockN;
constexpr int kMmaThreads = Traits::kNMmaThreads;  // no producer warpgroup here
constexpr int kWarpGroupRows = 64;
constexpr int kPartialFloats = kWarpGroupRows * kBlockN;  // one warpgroup's S, fp32
constexpr uint32_t kPartialBytes = kPartialFloats * sizeof(float);

struct SharedStorage {
  ResidentTiles<Traits> tiles;
  // [warpgroup]: the peer's S partial of this warpgroup's rows, thread t's
  // j-th float4 at (j * 128 + t) (a warp's 32 stores are 512 contiguous bytes).
  array_aligned<float, 2 * kPartialFloats, 16> partial;
  uint64_t partial_full[2];  // the peer's partial has landed (1 arrival + bytes)
  uint64_t partial_read[2];  // the peer has read what this block sent (128 arrivals)
};
static_assert(sizeof(SharedStorage) <= 227 * 1024, "fits a Hopper block's shared memory");

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// This block's shared address seen in block `rank` of the cluster.
__device__ __forceinline__ uint32_t peer_addr(uint32_t addr, uint32_t rank) {
  uint32_t out;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(out) : "r"(addr), "r"(rank));
  return out;
}
__device__ __forceinline__ void st_async_f32x4(uint32_t remote, float4 v, uint32_t remote_mbar) {
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, "
      "[%5];\n" ::"r"(remote),
      "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(remote_mbar)
      : "memory");
}
__device__ __forceinline__ void arrive_remote(uint32_t remote_mbar) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(remote_mbar)
               : "memory");
}
__device__ __forceinline__ void arrive_expect_bytes(uint32_t mbar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(mbar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void wait_cluster_phase(uint32_t mbar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(mbar),
      "r"(parity)
      : "memory");
}

// One warpgroup's side of the exchange: S of its 64 rows, partial over this
// block's columns of the head dim, becomes the sum over both blocks'.
struct SPartialExchange {
  uint32_t peer_partial;  // the peer's buffer for this warpgroup, cluster address
  uint32_t peer_full;     // the peer's partial_full[warpgroup]
  uint32_t peer_read;     // the peer's partial_read[warpgroup]
  uint32_t my_full;
  uint32_t my_read;
  const float* my_partial;
  int t;  // thread within the warpgroup

  __device__ SPartialExchange(SharedStorage& smem, uint32_t peer, int warp_group, int t_) : t(t_) {
    my_partial = smem.partial.data() + warp_group * kPartialFloats;
    my_full = smem_addr(&smem.partial_full[warp_group]);
    my_read = smem_addr(&smem.partial_read[warp_group]);
    peer_partial = peer_addr(smem_addr(my_partial), peer);
    peer_full = peer_addr(my_full, peer);
    peer_read = peer_addr(my_read, peer);
  }

  // acc_s: (MMA,MMA_M,MMA_N) of tile i, 32 floats a thread.
  template <typename TensorAcc>
  __device__ __forceinline__ void add_peer(TensorAcc& acc_s, int i) const {
    constexpr int kVecs = decltype(size(acc_s))::value / 4;
    static_assert(kVecs * 4 * 128 == kPartialFloats, "a warpgroup's fragments fill the buffer");
    // The peer has read tile i - 1's partial out of its buffer.
    if (i > 0) wait_cluster_phase(my_read, (i - 1) & 1);
    CUTE_UNROLL
    for (int j = 0; j < kVecs; ++j) {
      st_async_f32x4(
          peer_partial + uint32_t((j * 128 + t) * 16),
          make_float4(acc_s(4 * j), acc_s(4 * j + 1), acc_s(4 * j + 2), acc_s(4 * j + 3)),
          peer_full);
    }
    if (t == 0) arrive_expect_bytes(my_full, kPartialBytes);
    wait_cluster_phase(my_full, i & 1);
    add_partial(acc_s, my_partial, t);
    arrive_remote(peer_read);
  }
};

// Each block: 128 query rows against n_tiles key tiles of 64 (the two K / V
// stages in turn). s_dump: the S of the last tile after the exchange, per
// block and thread (the check).
template <bool kExchange>
__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(kMmaThreads, 1)
    cluster_tile_loop(int n_tiles, float exp_scale_log2, float* s_dump, float* o_sink) {
  extern __shared__ char smem_raw[];
  SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw);
  const int tidx = threadIdx.x;
  const uint32_t rank = cute::block_rank_in_cluster();
  const int warp_group = tidx / 128;

  // Tiles in [-1, 1), different in each block of the cluster (its own half
  // of the head dim).
  smem.tiles.fill(977u * (blockIdx.x / 2) + 131u * rank, kMmaThreads);
  if (tidx == 0) {
    for (int w = 0; w < 2; ++w) {
      cutlass::arch::ClusterBarrier::init(&smem.partial_full[w], 1);
      cutlass::arch::ClusterBarrier::init(&smem.partial_read[w], 128);
    }
    cutlass::arch::fence_barrier_init();
  }
  // The peer's barriers are initialised before anything is sent to them.
  cute::cluster_sync();

  typename Traits::TiledMmaS tiled_mma_s;
  typename Traits::TiledMmaO tiled_mma_o;
  auto [tSrQ, tSrK, tOrVt] = smem.tiles.operands(tidx);
  // (MMA,MMA_M,MMA_N)
  Tensor acc_s = partition_fragment_C(tiled_mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});
  Tensor acc_o = partition_fragment_C(tiled_mma_o, Shape<Int<kBlockM>, Int<Traits::kHeadDimV>>{});
  // (MMA,MMA_M,MMA_K): P as the A operand of O += P V
  Tensor tOrP = make_tensor<Element>(flash::wgmma_acc_layout_as_operand_a(acc_s.layout()));
  // (ROW,COL) views of S and O
  Tensor scores = make_tensor(acc_s.data(), flash::wgmma_acc_layout_as_rowcol(acc_s.layout()));
  Tensor acc_o_rowcol =
      make_tensor(acc_o.data(), flash::wgmma_acc_layout_as_rowcol(acc_o.layout()));
  constexpr int kNRows = decltype(size<0>(scores))::value;
  flash::OnlineSoftmax<kNRows> softmax;
  const SPartialExchange exchange(smem, rank ^ 1, warp_group, tidx % 128);
  clear(acc_o);

  // Iteration i: S(i) issued, then P(i-1) V(i-1) behind it; the exchange
  // and the softmax of S(i) while P V runs, as in FwdSm90MainloopMma::mma.
  auto iteration = [&](int i, auto has_pending_pv) {
    constexpr bool kHasPendingPv = decltype(has_pending_pv)::value;
    const int stage = i & 1;
    warpgroup_fence_operand(acc_s);
    warpgroup_arrive();
    flash::wgmma_issue</*kZeroInit=*/true>(tiled_mma_s, tSrQ, tSrK(_, _, _, stage), acc_s);
    warpgroup_commit_batch();
    if constexpr (kHasPendingPv) {
      warpgroup_fence_operand(tOrP);
      warpgroup_fence_operand(acc_o);
      warpgroup_arrive();
      flash::wgmma_issue</*kZeroInit=*/false>(tiled_mma_o, tOrP, tOrVt(_, _, _, stage ^ 1), acc_o);
      warpgroup_commit_batch();
    }
    warpgroup_wait<kHasPendingPv ? 1 : 0>();  // S(i) has landed
    warpgroup_fence_operand(acc_s);
    if constexpr (kExchange) exchange.add_peer(acc_s, i);
    if (i == n_tiles - 1) {
      CUTE_UNROLL
      for (int j = 0; j < size(acc_s); ++j) {
        s_dump[(int64_t(blockIdx.x) * kMmaThreads + tidx) * size(acc_s) + j] = acc_s(j);
      }
    }
    typename flash::OnlineSoftmax<kNRows>::TileCorrection correction;
    softmax.update_scores(scores, exp_scale_log2, correction);
    if constexpr (kHasPendingPv) {
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_o);
      warpgroup_fence_operand(tOrP);
    }
    softmax.template rescale_output</*kSkipUnmovedRescale=*/true>(acc_o_rowcol, correction);
    flash::convert_type_into(acc_s, tOrP);
  };
  iteration(0, cute::false_type{});
  for (int i = 1; i < n_tiles; ++i) iteration(i, cute::true_type{});
  warpgroup_fence_operand(tOrP);
  warpgroup_fence_operand(acc_o);
  warpgroup_arrive();
  flash::wgmma_issue</*kZeroInit=*/false>(tiled_mma_o, tOrP, tOrVt(_, _, _, (n_tiles - 1) & 1),
                                          acc_o);
  warpgroup_commit_batch();
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc_o);

  sink_output(acc_o, softmax.row_sum[0], &o_sink[blockIdx.x * kMmaThreads + tidx]);
  // No block leaves while its peer may still write into it or arrive on it.
  cute::cluster_sync();
}

template <bool kExchange>
double run(int n_tiles, int clusters, float* s_dump, float* o_sink) {
  const int smem_bytes = int(sizeof(SharedStorage));
  FA_CUDA_CHECK(cudaFuncSetAttribute(cluster_tile_loop<kExchange>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  const float exp_scale_log2 = 1.44269504f / 16.f;  // 1 / sqrt(256) in log2 units
  auto launch = [&] {
    cluster_tile_loop<kExchange>
        <<<2 * clusters, kMmaThreads, smem_bytes>>>(n_tiles, exp_scale_log2, s_dump, o_sink);
  };
  launch();
  FA_CUDA_CHECK(cudaDeviceSynchronize());
  return median_ms(launch, 20, 3);
}

// Whether the two blocks of every cluster hold bitwise the same last S.
bool blocks_agree(const float* s_dump, int clusters) {
  const int per_block = kMmaThreads * 32;
  std::vector<float> host(size_t(2) * clusters * per_block);
  FA_CUDA_CHECK(
      cudaMemcpy(host.data(), s_dump, host.size() * sizeof(float), cudaMemcpyDeviceToHost));
  for (int c = 0; c < clusters; ++c) {
    const float* a = host.data() + size_t(2 * c) * per_block;
    const float* b = a + per_block;
    for (int i = 0; i < per_block; ++i) {
      if (a[i] != b[i]) return false;
    }
  }
  return true;
}

// How many clusters of two fit on the device at once (a GPC with an odd
// number of free SMs leaves one idle), so that every cluster runs in one wave.
int resident_clusters() {
  const int smem_bytes = int(sizeof(SharedStorage));
  FA_CUDA_CHECK(cudaFuncSetAttribute(cluster_tile_loop<true>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(2, 1, 1);
  config.blockDim = dim3(kMmaThreads, 1, 1);
  config.dynamicSmemBytes = smem_bytes;
  cudaLaunchAttribute cluster;
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = 2;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  config.attrs = &cluster;
  config.numAttrs = 1;
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, cluster_tile_loop<true>, &config) != cudaSuccess ||
      clusters <= 0) {
    (void)cudaGetLastError();  // fall back to half the SMs
    int sms = 0;
    FA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    clusters = sms / 2;
  }
  return clusters;
}

int main(int argc, char** argv) {
  int clock_khz = 0;
  FA_CUDA_CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  const int n_tiles = argc > 1 ? std::atoi(argv[1]) : 2048;
  const int clusters = argc > 2 ? std::atoi(argv[2]) : resident_clusters();
  float *s_dump, *o_sink;
  FA_CUDA_CHECK(cudaMalloc(&s_dump, size_t(2) * clusters * kMmaThreads * 32 * sizeof(float)));
  FA_CUDA_CHECK(cudaMalloc(&o_sink, size_t(2) * clusters * kMmaThreads * sizeof(float)));

  const double ms_plain = run<false>(n_tiles, clusters, s_dump, o_sink);
  const bool plain_agree = blocks_agree(s_dump, clusters);
  const double ms_exchange = run<true>(n_tiles, clusters, s_dump, o_sink);
  const bool exchange_agree = blocks_agree(s_dump, clusters);

  // Per block and tile: S (128 x 64 x 256) and P V (128 x 256 x 64).
  const double flop = 2.0 * 2 * kBlockM * kBlockN * 256 * double(n_tiles) * 2 * clusters;
  auto cycles_per_tile = [&](double ms) { return ms * clock_khz / n_tiles; };
  std::printf("blocks %d (%d clusters of 2), %d key tiles each, smem %zu B\n", 2 * clusters,
              clusters, n_tiles, sizeof(SharedStorage));
  std::printf(
      "check: without exchange the blocks' S %s (expected: differ); with it %s "
      "(expected: agree)\n",
      plain_agree ? "AGREE" : "differ", exchange_agree ? "agree" : "DIFFER");
  std::printf("no exchange:   %8.3f ms  %6.1f TFLOP/s  %7.0f cycles per tile\n", ms_plain,
              flop / ms_plain * 1e-9, cycles_per_tile(ms_plain));
  std::printf("S exchanged:   %8.3f ms  %6.1f TFLOP/s  %7.0f cycles per tile\n", ms_exchange,
              flop / ms_exchange * 1e-9, cycles_per_tile(ms_exchange));
  std::printf("exchange / no exchange: %.3f (kill criterion: > 1.15)\n", ms_exchange / ms_plain);
  const bool ok = !plain_agree && exchange_agree;
  if (!ok) std::printf("FAILED: the exchange check\n");
  return ok ? 0 : 1;
}
