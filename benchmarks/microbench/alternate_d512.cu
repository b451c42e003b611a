// Measurement 1d of docs/head_dims_dv_and_512.md (section 6): what option B of
// section 2 costs per key tile at head dim 512. One block of 64 query rows and
// two MMA warpgroups that take alternate key tiles (FlashMLA's arrangement):
// in pair step p, warpgroup w makes S = Q K^T of key tile 2p + w over all 512
// columns, and each warpgroup owns 256 columns of V and O. The two exchange
// their tile's row maxima through shared memory, so that both take the same
// running max, make P of their own tile with it, and store it (bf16) for the
// other; then each makes P V of both tiles on its own columns, its own P from
// registers (RS), the other's from shared memory (SS). Per pair step a
// warpgroup issues one S and two half P V products: the work is balanced and
// nothing is computed twice, at two barriers per pair step.
//
// Per block and pair step: two S (64 x 32 x 512) and two P V (64 x 512 x 32),
// the same products per tile as measurement 1b's plain loop
// (headsplit_exchange.cu, 1,459 cycles per 32-key tile on an H200) and 1c's
// (pshare_d512.cu). Loops, over tiles resident in shared memory (no loads):
//   - products: the same products, no exchange: each warpgroup keeps its own
//     max, and its second P V reads a buffer nobody writes;
//   - alternate: the exchange, as above.
// Kill criterion (section 6): alternate costs more than 1.25x measurement 1b's
// plain loop per tile (1,824 cycles).
//
//   nvcc -std=c++20 -O3 --use_fast_math --expt-relaxed-constexpr -I csrc -I <cutlass>/include \
//     -gencode arch=compute_90a,code=sm_90a benchmarks/microbench/alternate_d512.cu \
//     -o alternate_d512
//   ./alternate_d512 [tiles per block, default 4096, even] [blocks, default: one per SM]
//
// It checks the exchange before timing it: V's two halves hold the same values,
// and both warpgroups add the two tiles of a pair step in tile order, so with
// the exchange their O halves must agree bitwise (the same P, maxima and V
// through RS and SS products), and without it they must not.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_runtime.h>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "cuda/core/cuda_check.h"
#include "cuda/core/softmax.h"
#include "cuda/core/tile_ops.h"
#include "cuda/core/tile_ops_sm90.h"
#include "d512_block_sm90.cuh"
#include "microbench_util.cuh"

using namespace cute;

using namespace d512;

// P (M, N) bf16, K-major for P V's A operand: buffer 2 (p & 1) + w holds the
// P that warpgroup w made in pair step p.
using SmemLayoutP =
    decltype(tile_to_shape(GMMA::Layout_K_SW64_Atom<Element>{}, Shape<Int<kM>, Int<kN>, _4>{}));

constexpr int kNRows = 2;  // rows r and r + 8 of a warp's 16, per thread

struct SharedStorage {
  array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> q;
  array_aligned<Element, cosize_v<SmemLayoutK>, 1024> k;
  array_aligned<Element, cosize_v<SmemLayoutVHalf>, 1024> v[2];
  array_aligned<Element, cosize_v<SmemLayoutP>, 1024> p;
  // [p & 1][warpgroup][thread][row of its fragment]: a tile's row maxima, in
  // score units. Thread t of either warpgroup holds the same rows.
  float row_max[2][2][128][kNRows];
};
static_assert(sizeof(SharedStorage) <= 227 * 1024, "fits a Hopper block's shared memory");

// Named barriers (0 is __syncthreads), all 256 threads, by p & 1: the pair
// step's row maxima written, and its two P written.
__device__ __forceinline__ uint32_t max_ready(int p) { return 1 + (p & 1); }
__device__ __forceinline__ uint32_t p_ready(int p) { return 3 + (p & 1); }

// Warpgroup W's loop (W: its key tile slot and its half of V / O), a
// template so that each warpgroup's wgmma sequence is straight-line code.
template <int W, bool kExchange>
__device__ __forceinline__ void warpgroup_loop(SharedStorage& smem, int n_pairs,
                                               float exp_scale_log2, float* o_dump) {
  constexpr int w = W;
  const int t = threadIdx.x % 128;
  using NamedBarrier = cutlass::arch::NamedBarrier;

  Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), SmemLayoutQ{});           // (M,D)
  Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), SmemLayoutK{});           // (N,D,slot)
  Tensor sVt = make_tensor(make_smem_ptr(smem.v[w].data()), SmemLayoutVtHalf{});  // (Dv/2,N,slot)
  Tensor sP = make_tensor(make_smem_ptr(smem.p.data()), SmemLayoutP{});           // (M,N,buffer)

  TiledMmaS tiled_mma_s;
  auto thr_mma_s = tiled_mma_s.get_thread_slice(t);
  TiledMmaORs tiled_mma_o_rs;
  auto thr_mma_o_rs = tiled_mma_o_rs.get_thread_slice(t);
  TiledMmaOSs tiled_mma_o_ss;
  auto thr_mma_o_ss = tiled_mma_o_ss.get_thread_slice(t);

  Tensor tSrQ = thr_mma_s.partition_fragment_A(sQ);          // (MMA,MMA_M,MMA_K)
  Tensor tSrK = thr_mma_s.partition_fragment_B(sK);          // (MMA,MMA_N,MMA_K,slot)
  Tensor tPsP = thr_mma_s.partition_C(sP);                   // (MMA,MMA_M,MMA_N,buffer)
  Tensor tOrVt_rs = thr_mma_o_rs.partition_fragment_B(sVt);  // (MMA,MMA_Dv,MMA_K,slot)
  Tensor tOsP = thr_mma_o_ss.partition_fragment_A(sP);       // (MMA,MMA_M,MMA_K,buffer)
  Tensor tOrVt_ss = thr_mma_o_ss.partition_fragment_B(sVt);  // (MMA,MMA_Dv,MMA_K,slot)

  // (MMA,MMA_M,MMA_N): O of this warpgroup's 256 columns; the C layouts of
  // the RS and SS products are the same.
  Tensor acc_o = partition_fragment_C(tiled_mma_o_rs, Shape<Int<kM>, Int<kDHalf>>{});
  Tensor acc_o_rowcol =
      make_tensor(acc_o.data(), flash::wgmma_acc_layout_as_rowcol(acc_o.layout()));
  static_assert(decltype(size<0>(acc_o_rowcol))::value == kNRows);
  clear(acc_o);
  // (MMA,MMA_M,MMA_N): S of this warpgroup's tile
  Tensor acc_s = partition_fragment_C(tiled_mma_s, Shape<Int<kM>, Int<kN>>{});
  // (MMA,MMA_M,MMA_K): this warpgroup's P as the A operand of its RS P V
  Tensor tOrP = make_tensor<Element>(flash::wgmma_acc_layout_as_operand_a(acc_s.layout()));
  flash::OnlineSoftmax<kNRows> softmax;

  // K's slot turns with p, as a kernel's stages do: with a fixed slot the
  // compiler keeps all 64 operand descriptors of the 32 k-steps live across
  // the loop (and spilled at 255 registers).
  auto issue_s = [&](int p) {
    warpgroup_fence_operand(acc_s);
    warpgroup_arrive();
    flash::wgmma_issue</*kZeroInit=*/true>(tiled_mma_s, tSrQ, tSrK(_, _, _, (p + w) & 1), acc_s);
    warpgroup_commit_batch();
  };
  // P(p) V of both tiles on this warpgroup's columns, in tile order (slot 0
  // first), one batch: its own P from registers, the other's from buffer
  // 2 (p & 1) + (1 - w).
  auto issue_pv = [&](int p) {
    warpgroup_fence_operand(tOrP);
    warpgroup_fence_operand(acc_o);
    warpgroup_arrive();
    auto own = [&] {
      flash::wgmma_issue</*kZeroInit=*/false>(tiled_mma_o_rs, tOrP, tOrVt_rs(_, _, _, w), acc_o);
    };
    auto other = [&] {
      flash::wgmma_issue</*kZeroInit=*/false>(tiled_mma_o_ss, tOsP(_, _, _, 2 * (p & 1) + 1 - w),
                                              tOrVt_ss(_, _, _, 1 - w), acc_o);
    };
    if constexpr (w == 0) {
      own();
      other();
    } else {
      other();
      own();
    }
    warpgroup_commit_batch();
  };
  // S(p) has landed: the pair's row max, P, its copy for the other; then the
  // wait for P(p - 1) V, O's rescale, and P into registers.
  auto softmax_of = [&](int p, bool pv_pending) {
    warpgroup_fence_operand(acc_s);
    Tensor scores = make_tensor(acc_s.data(), flash::wgmma_acc_layout_as_rowcol(acc_s.layout()));
    // (rows, 1): the row max the pair step takes in
    Tensor pair_max = make_tensor<float>(Shape<Int<kNRows>, _1>{});
    CUTE_UNROLL
    for (int mi = 0; mi < kNRows; ++mi) {
      pair_max(mi, 0) = flash::quad_allreduce_max(softmax.thread_row_max(scores, mi, -INFINITY));
    }
    if constexpr (kExchange) {
      CUTE_UNROLL
      for (int mi = 0; mi < kNRows; ++mi) smem.row_max[p & 1][w][t][mi] = pair_max(mi, 0);
      NamedBarrier::sync(kThreads, max_ready(p));
      CUTE_UNROLL
      for (int mi = 0; mi < kNRows; ++mi) {
        pair_max(mi, 0) = fmaxf(pair_max(mi, 0), smem.row_max[p & 1][1 - w][t][mi]);
      }
    }
    typename flash::OnlineSoftmax<kNRows>::TileCorrection correction;
    float max_scaled[kNRows];
    softmax.move_row_max(pair_max, exp_scale_log2, correction, max_scaled);
    softmax.exponentiate(scores, exp_scale_log2, max_scaled);
    if constexpr (kExchange) {
      // Buffer 2 (p & 1) + w was last read by the other's P(p - 2) V, which it
      // waited for before it met this step's max_ready.
      Tensor tPsP_b = tPsP(_, _, _, 2 * (p & 1) + w);  // (MMA,MMA_M,MMA_N)
      CUTE_UNROLL
      for (int j = 0; j < size(acc_s); ++j) tPsP_b(j) = static_cast<Element>(acc_s(j));
      cutlass::arch::fence_view_async_shared();  // the other's wgmma reads P
      NamedBarrier::sync(kThreads, p_ready(p));
    }
    if (pv_pending) {
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_o);
      warpgroup_fence_operand(tOrP);
    }
    softmax.rescale_output(acc_o_rowcol, correction);
    flash::convert_type_into(acc_s, tOrP);
  };

  issue_s(0);
  warpgroup_wait<0>();
  softmax_of(0, false);
  for (int p = 1; p < n_pairs; ++p) {
    issue_s(p);
    issue_pv(p - 1);
    warpgroup_wait<1>();  // S(p)
    softmax_of(p, true);
  }
  issue_pv(n_pairs - 1);
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc_o);

  float* out = o_dump + (int64_t(blockIdx.x) * kThreads + threadIdx.x) * size(acc_o);
  CUTE_UNROLL
  for (int j = 0; j < size(acc_o); ++j) out[j] = acc_o(j);
}

template <bool kExchange>
__global__ void __launch_bounds__(kThreads, 1)
    alternate_tile_loop(int n_pairs, float exp_scale_log2, float* o_dump) {
  extern __shared__ char smem_raw[];
  SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw);
  fill_random_tile(smem.q.data(), int(smem.q.size()), 1 + 977u * blockIdx.x, kThreads);
  fill_random_tile(smem.k.data(), int(smem.k.size()), 2 + 977u * blockIdx.x, kThreads);
  // Both halves of V the same: the check.
  fill_random_tile(smem.v[0].data(), int(smem.v[0].size()), 3 + 977u * blockIdx.x, kThreads);
  fill_random_tile(smem.v[1].data(), int(smem.v[1].size()), 3 + 977u * blockIdx.x, kThreads);
  // Without the exchange the other's P buffer is never written: finite values.
  fill_random_tile(smem.p.data(), int(smem.p.size()), 4 + 977u * blockIdx.x, kThreads);
  cutlass::arch::fence_view_async_shared();
  __syncthreads();
  if (threadIdx.x < 128) {
    warpgroup_loop<0, kExchange>(smem, n_pairs, exp_scale_log2, o_dump);
  } else {
    warpgroup_loop<1, kExchange>(smem, n_pairs, exp_scale_log2, o_dump);
  }
}

template <bool kExchange>
double run(int n_pairs, int blocks, float* o_dump) {
  const int smem_bytes = int(sizeof(SharedStorage));
  auto kernel = alternate_tile_loop<kExchange>;
  FA_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  const float exp_scale_log2 = 1.44269504f / 22.6274f;  // 1 / sqrt(512) in log2 units
  auto launch = [&] { kernel<<<blocks, kThreads, smem_bytes>>>(n_pairs, exp_scale_log2, o_dump); };
  launch();
  FA_CUDA_CHECK(cudaDeviceSynchronize());
  return median_ms(launch, 20, 3);
}

int main(int argc, char** argv) {
  TileLoopArgs args;
  if (!parse_tile_loop_args(argc, argv, "alternate_d512", args)) return 2;
  const int clock_khz = args.clock_khz, n_tiles = args.n_tiles, blocks = args.blocks;
  const int n_pairs = n_tiles / 2;
  float* o_dump;
  FA_CUDA_CHECK(cudaMalloc(&o_dump, size_t(blocks) * kThreads * kM * kDHalf / 128 * sizeof(float)));

  const double ms_products = run<false>(n_pairs, blocks, o_dump);
  const double differ_products = halves_differ_by(o_dump, blocks);
  const double ms_alternate = run<true>(n_pairs, blocks, o_dump);
  const double differ_alternate = halves_differ_by(o_dump, blocks);

  // Per block and tile: S (64 x 32 x 512) and P V (64 x 512 x 32).
  const double flop = 2.0 * 2 * kM * kN * kD * double(n_tiles) * blocks;
  std::printf("blocks %d, %d key tiles of %d each, smem %zu B\n", blocks, n_tiles, kN,
              sizeof(SharedStorage));
  auto report = [&](const char* name, double ms, double differ) {
    std::printf("%-12s %8.3f ms  %6.1f TFLOP/s  %7.0f cycles per tile  O halves differ by %.2e\n",
                name, ms, flop / ms * 1e-9, ms * clock_khz / n_tiles, differ);
  };
  report("products", ms_products, differ_products);
  report("alternate", ms_alternate, differ_alternate);
  std::printf(
      "alternate: %.0f cycles per tile (kill criterion: > 1.25 x measurement 1b's plain loop, "
      "1,459 on the H200 of 2026-11-30)\n",
      ms_alternate * clock_khz / n_tiles);
  // With the exchange the halves agree bitwise; without it they do not.
  const bool ok = differ_alternate == 0.0 && differ_products > 1e-2;
  if (!ok) std::printf("FAILED: the exchange check (O halves equal with it, not without)\n");
  return ok ? 0 : 1;
}
