// Measurement 1b of docs/head_dims_dv_and_512.md (section 6): what option E's
// head-dim split costs per key tile. E runs the d512 forward in one block of
// 64 query rows whose two MMA warpgroups split the head dim: warpgroup h
// computes S_h = Q[:, h] K[:, h]^T over its 256 columns, writes its fp32
// fragment into the block's shared memory, meets the other warpgroup at a
// named barrier, and adds the other's fragment, so both hold S = S_0 + S_1
// (bitwise the same: fp32 addition commutes); then each runs the softmax and
// O_h += P V[:, h] over its 256 columns of V. The DSMEM exchange of option D
// (dsmem_exchange.cu) cost 1.71-1.76x per tile; this one stays inside the
// block.
//
// Four loops over tiles already in shared memory, N = 32 keys a tile (E's
// shared-memory budget: two stages of K and V at 512 columns), each warpgroup
// reading its own half of every K / V tile:
//   - plain: the Hopper forward's order (S(i) issued with P(i-1) V(i-1)
//     behind it, the softmax of S(i) while P V runs), no exchange;
//   - exchanged: the same with the exchange after S(i) lands;
//   - plain / exchanged with lookahead: S(i) landed in the iteration
//     before; S(i + 1) and P(i-1) V(i-1) are issued, then S(i)'s exchange
//     and softmax run under both products of the same warpgroup (two S
//     accumulators).
// No loads from global memory: the question is the exchange against the
// products. Kill criterion (section 2): the better exchanged loop takes more
// than 1.15x the better plain one.
//
//   nvcc -std=c++20 -O3 --use_fast_math --expt-relaxed-constexpr -I csrc -I <cutlass>/include \
//     -gencode arch=compute_90a,code=sm_90a benchmarks/microbench/headsplit_exchange.cu -o
//     headsplit_exchange
//   ./headsplit_exchange [tiles per block, default 4096, even] [blocks, default: one per SM]
//
// It checks the exchange before timing it: with it, the two warpgroups of
// every block must hold bitwise the same S after the last tile, and,
// without it, different ones (their halves of Q and K differ).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_runtime.h>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "cuda/core/cuda_check.h"
#include "resident_tiles_sm90.cuh"

using namespace cute;

using Element = cutlass::bfloat16_t;
// The traits' two 64-row MMA warpgroups and 256 columns of Q / K / V / O
// stand for E's two warpgroups, which share 64 query rows and split 512
// columns: warpgroup h reads "rows" [64h, 64h + 64) of sQ (its 256 columns
// of Q) and K / V "stage" h (its 256 columns of the key tile). 32-key tiles.
using Traits = flash::FwdSm90KernelTraits<256, 128, 32, Element>;
constexpr int kBlockM = Traits::kBlockM;
constexpr int kBlockN = Traits::kBlockN;
constexpr int kMmaThreads = Traits::kNMmaThreads;  // no producer warpgroup here
constexpr int kWarpGroupRows = 64;
constexpr int kPartialFloats = kWarpGroupRows * kBlockN;  // one warpgroup's S, fp32
static_assert(Traits::kStages == 2, "a stage per warpgroup: its half of the key tile");
// The named barrier the two warpgroups meet at (0 is __syncthreads).
constexpr uint32_t kExchangeBarrier = 1;

struct SharedStorage {
  ResidentTiles<Traits> tiles;
  // [tile parity][warpgroup]: the warpgroup's S partial, thread t's j-th
  // float4 at (j * 128 + t). Two buffers, so that one barrier per tile
  // suffices: a warpgroup writes a buffer again only after the barrier of
  // the tile between, which the other passes after reading it.
  array_aligned<float, 2 * 2 * kPartialFloats, 16> partial;
};
static_assert(sizeof(SharedStorage) <= 227 * 1024, "fits a Hopper block's shared memory");

// One warpgroup's side: its S partial of tile i becomes the sum over both.
// acc_s: (MMA,MMA_M,MMA_N), kPartialFloats / 128 floats a thread.
template <typename TensorAcc>
__device__ __forceinline__ void add_other_half(SharedStorage& smem, TensorAcc& acc_s,
                                               int warp_group, int t, int i) {
  constexpr int kVecs = decltype(size(acc_s))::value / 4;
  static_assert(kVecs * 4 * 128 == kPartialFloats, "a warpgroup's fragments fill a buffer");
  float* mine = smem.partial.data() + ((i & 1) * 2 + warp_group) * kPartialFloats;
  const float* other = smem.partial.data() + ((i & 1) * 2 + (warp_group ^ 1)) * kPartialFloats;
  CUTE_UNROLL
  for (int j = 0; j < kVecs; ++j) {
    reinterpret_cast<float4*>(mine)[j * 128 + t] =
        make_float4(acc_s(4 * j), acc_s(4 * j + 1), acc_s(4 * j + 2), acc_s(4 * j + 3));
  }
  cutlass::arch::NamedBarrier::sync(kMmaThreads, kExchangeBarrier);
  add_partial(acc_s, other, t);
}

// One block: 64 query rows split by head dim over two warpgroups, against
// n_tiles key tiles of 32. s_dump: the S of the last tile, per block and
// thread (the check).
template <bool kExchange, bool kLookahead>
__global__ void __launch_bounds__(kMmaThreads, 1)
    headsplit_tile_loop(int n_tiles, float exp_scale_log2, float* s_dump, float* o_sink) {
  extern __shared__ char smem_raw[];
  SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw);
  const int tidx = threadIdx.x;
  const int warp_group = tidx / 128;
  const int t = tidx % 128;

  smem.tiles.fill(977u * blockIdx.x, kMmaThreads);
  __syncthreads();

  typename Traits::TiledMmaS tiled_mma_s;
  typename Traits::TiledMmaO tiled_mma_o;
  auto [tSrQ, tSrK, tOrVt] = smem.tiles.operands(tidx);
  // This warpgroup's half of every key tile.
  Tensor tSrK_half = tSrK(_, _, _, warp_group);    // (MMA,MMA_N,MMA_K)
  Tensor tOrVt_half = tOrVt(_, _, _, warp_group);  // (MMA,MMA_Dv,MMA_K)
  // (MMA,MMA_M,MMA_N): S of the tile in hand, and of the next (lookahead)
  Tensor acc_s = partition_fragment_C(tiled_mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});
  Tensor acc_s_next = partition_fragment_C(tiled_mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});
  Tensor acc_o = partition_fragment_C(tiled_mma_o, Shape<Int<kBlockM>, Int<Traits::kHeadDimV>>{});
  // (MMA,MMA_M,MMA_K): P as the A operand of O += P V
  Tensor tOrP = make_tensor<Element>(flash::wgmma_acc_layout_as_operand_a(acc_s.layout()));
  // (ROW,COL) view of O
  Tensor acc_o_rowcol =
      make_tensor(acc_o.data(), flash::wgmma_acc_layout_as_rowcol(acc_o.layout()));
  constexpr int kNRows = decltype(size<0>(acc_o_rowcol))::value;
  flash::OnlineSoftmax<kNRows> softmax;
  clear(acc_o);

  auto issue_s = [&](auto& acc) {
    warpgroup_fence_operand(acc);
    warpgroup_arrive();
    flash::wgmma_issue</*kZeroInit=*/true>(tiled_mma_s, tSrQ, tSrK_half, acc);
    warpgroup_commit_batch();
  };
  auto issue_pv = [&] {
    warpgroup_fence_operand(tOrP);
    warpgroup_fence_operand(acc_o);
    warpgroup_arrive();
    flash::wgmma_issue</*kZeroInit=*/false>(tiled_mma_o, tOrP, tOrVt_half, acc_o);
    warpgroup_commit_batch();
  };
  // S(i) has landed: the exchange, the softmax and P. pv_pending: products
  // are still out (P(i-1) V(i-1), and with the lookahead S(i + 1)), and O is
  // rescaled once they land.
  auto softmax_of = [&](auto& acc, int i, auto pv_pending) {
    warpgroup_fence_operand(acc);
    if constexpr (kExchange) add_other_half(smem, acc, warp_group, t, i);
    if (i == n_tiles - 1) {
      CUTE_UNROLL
      for (int j = 0; j < size(acc); ++j) {
        s_dump[(int64_t(blockIdx.x) * kMmaThreads + tidx) * size(acc) + j] = acc(j);
      }
    }
    Tensor scores = make_tensor(acc.data(), flash::wgmma_acc_layout_as_rowcol(acc.layout()));
    typename flash::OnlineSoftmax<kNRows>::TileCorrection correction;
    softmax.update_scores(scores, exp_scale_log2, correction);
    if constexpr (decltype(pv_pending)::value) {
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_o);
      warpgroup_fence_operand(tOrP);
    }
    softmax.template rescale_output</*kSkipUnmovedRescale=*/true>(acc_o_rowcol, correction);
    flash::convert_type_into(acc, tOrP);
  };

  if constexpr (!kLookahead) {
    // The Hopper forward's order (FwdSm90MainloopMma::mma).
    issue_s(acc_s);
    warpgroup_wait<0>();
    softmax_of(acc_s, 0, cute::false_type{});
    for (int i = 1; i < n_tiles; ++i) {
      issue_s(acc_s);
      issue_pv();
      warpgroup_wait<1>();  // S(i) has landed
      softmax_of(acc_s, i, cute::true_type{});
    }
  } else {
    // Iteration i, S(i) in hand: S(i + 1) and P(i-1) V(i-1) issued, the
    // exchange and softmax of S(i) under them, then the wait for both (no
    // product in flight across the loop's back edge: ptxas serializes the
    // wgmmas otherwise). The last iteration issues one S past the end
    // (wasted, not branched around). Two iterations per trip, so that the
    // two accumulators stay static registers.
    auto iteration = [&](auto& cur, auto& next, int i, auto pv_pending) {
      issue_s(next);
      if constexpr (decltype(pv_pending)::value) issue_pv();
      softmax_of(cur, i, cute::true_type{});  // waits for both products
    };
    issue_s(acc_s);
    warpgroup_wait<0>();
    iteration(acc_s, acc_s_next, 0, cute::false_type{});
    for (int i = 1; i + 1 < n_tiles; i += 2) {
      iteration(acc_s_next, acc_s, i, cute::true_type{});
      iteration(acc_s, acc_s_next, i + 1, cute::true_type{});
    }
    iteration(acc_s_next, acc_s, n_tiles - 1, cute::true_type{});  // n_tiles is even
  }
  issue_pv();  // the last tile's P V
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc_o);

  sink_output(acc_o, softmax.row_sum[0], &o_sink[blockIdx.x * kMmaThreads + tidx]);
}

template <bool kExchange, bool kLookahead>
double run(int n_tiles, int blocks, float* s_dump, float* o_sink) {
  const int smem_bytes = int(sizeof(SharedStorage));
  auto kernel = headsplit_tile_loop<kExchange, kLookahead>;
  FA_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  const float exp_scale_log2 = 1.44269504f / 22.6274f;  // 1 / sqrt(512) in log2 units
  auto launch = [&] {
    kernel<<<blocks, kMmaThreads, smem_bytes>>>(n_tiles, exp_scale_log2, s_dump, o_sink);
  };
  launch();
  FA_CUDA_CHECK(cudaDeviceSynchronize());
  return median_ms(launch, 20, 3);
}

// Whether the two warpgroups of every block hold bitwise the same last S.
bool warp_groups_agree(const float* s_dump, int blocks) {
  const int per_warp_group = kPartialFloats;  // 128 threads x kPartialFloats / 128
  std::vector<float> host(size_t(blocks) * 2 * per_warp_group);
  FA_CUDA_CHECK(
      cudaMemcpy(host.data(), s_dump, host.size() * sizeof(float), cudaMemcpyDeviceToHost));
  for (int b = 0; b < blocks; ++b) {
    const float* a = host.data() + size_t(2 * b) * per_warp_group;
    const float* c = a + per_warp_group;
    for (int i = 0; i < per_warp_group; ++i) {
      if (a[i] != c[i]) return false;
    }
  }
  return true;
}

int main(int argc, char** argv) {
  TileLoopArgs args;
  if (!parse_tile_loop_args(argc, argv, "headsplit_exchange", args)) return 2;
  const int clock_khz = args.clock_khz, n_tiles = args.n_tiles, blocks = args.blocks;
  float *s_dump, *o_sink;
  FA_CUDA_CHECK(
      cudaMalloc(&s_dump, size_t(blocks) * kMmaThreads * kPartialFloats / 128 * sizeof(float)));
  FA_CUDA_CHECK(cudaMalloc(&o_sink, size_t(blocks) * kMmaThreads * sizeof(float)));

  struct Loop {
    const char* name;
    bool exchanged;
    double ms;
    bool agree;
  };
  std::vector<Loop> loops;
  auto measure = [&](const char* name, auto exchange, auto lookahead) {
    constexpr bool kExchange = decltype(exchange)::value;
    const double ms = run<kExchange, decltype(lookahead)::value>(n_tiles, blocks, s_dump, o_sink);
    loops.push_back({name, kExchange, ms, warp_groups_agree(s_dump, blocks)});
  };
  measure("plain", cute::false_type{}, cute::false_type{});
  measure("exchanged", cute::true_type{}, cute::false_type{});
  measure("plain, lookahead", cute::false_type{}, cute::true_type{});
  measure("exchanged, lookahead", cute::true_type{}, cute::true_type{});

  // Per block and tile: S (64 x 32 x 512) and P V (64 x 512 x 32).
  const double flop = 2.0 * 2 * kWarpGroupRows * kBlockN * 512 * double(n_tiles) * blocks;
  std::printf("blocks %d, %d key tiles of %d each, smem %zu B\n", blocks, n_tiles, kBlockN,
              sizeof(SharedStorage));
  bool ok = true;
  for (const Loop& loop : loops) {
    std::printf("%-22s %8.3f ms  %6.1f TFLOP/s  %7.0f cycles per tile  warpgroups' S %s\n",
                loop.name, loop.ms, flop / loop.ms * 1e-9, loop.ms * clock_khz / n_tiles,
                loop.agree ? "agree" : "differ");
    ok = ok && loop.agree == loop.exchanged;
  }
  const double plain = std::min(loops[0].ms, loops[2].ms);
  const double exchanged = std::min(loops[1].ms, loops[3].ms);
  std::printf("best exchanged / best plain: %.3f (kill criterion: > 1.15)\n", exchanged / plain);
  if (!ok) std::printf("FAILED: the exchange check (exchanged loops agree, plain ones differ)\n");
  return ok ? 0 : 1;
}
