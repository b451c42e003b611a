// What the head-split exchange microbenchmarks share (dsmem_exchange.cu,
// headsplit_exchange.cu): the Hopper forward's MMA warpgroups over Q, K and
// V tiles that stay in shared memory. The block fills the tiles once, each
// thread takes its operands of S = Q K^T and O += P V from them, a
// warpgroup adds another half's S partial to its own, and O ends in a sink
// so that the products are not optimised away.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "cuda/core/softmax.h"
#include "cuda/core/tile_ops.h"
#include "cuda/core/tile_ops_sm90.h"
#include "cuda/fwd/sm90/fwd_kernel_traits_sm90.h"
#include "microbench_util.cuh"

// Q, K and V of one block, in the forward's shared-memory layouts (K and V
// with their stages).
template <typename Traits>
struct ResidentTiles {
  using Element = typename Traits::Element;
  cute::array_aligned<Element, cute::cosize_v<typename Traits::SmemLayoutQ>, 1024> q;
  cute::array_aligned<Element, cute::cosize_v<typename Traits::SmemLayoutK>, 1024> k;
  cute::array_aligned<Element, cute::cosize_v<typename Traits::SmemLayoutV>, 1024> v;

  // Values in [-1, 1), different for each salt (a block's own half of the
  // head dim), by the block's `threads` threads; visible to the wgmmas after
  // the caller's barrier.
  __device__ void fill(uint32_t salt, int threads) {
    fill_random_tile(q.data(), int(q.size()), 1 + salt, threads);
    fill_random_tile(k.data(), int(k.size()), 2 + salt, threads);
    fill_random_tile(v.data(), int(v.size()), 3 + salt, threads);
    cutlass::arch::fence_view_async_shared();  // the wgmmas read through the async proxy
  }

  // Thread tidx's operands: (tSrQ (MMA,MMA_M,MMA_K), tSrK (MMA,MMA_N,MMA_K,stage),
  // tOrVt (MMA,MMA_Dv,MMA_K,stage)).
  __device__ auto operands(int tidx) {
    using namespace cute;
    Tensor sQ = make_tensor(make_smem_ptr(q.data()), typename Traits::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(k.data()), typename Traits::SmemLayoutK{});
    Tensor sVt = make_tensor(make_smem_ptr(v.data()), typename Traits::SmemLayoutVt{});
    auto thr_mma_s = typename Traits::TiledMmaS{}.get_thread_slice(tidx);
    auto thr_mma_o = typename Traits::TiledMmaO{}.get_thread_slice(tidx);
    return make_tuple(thr_mma_s.partition_fragment_A(sQ), thr_mma_s.partition_fragment_B(sK),
                      thr_mma_o.partition_fragment_B(sVt));
  }
};

// acc_s (MMA,MMA_M,MMA_N) += another half's partial of the same fragment,
// thread t's j-th float4 at partial[j * 128 + t].
template <typename TensorAcc>
__device__ __forceinline__ void add_partial(TensorAcc& acc_s, const float* partial, int t) {
  constexpr int kVecs = decltype(cute::size(acc_s))::value / 4;
  CUTE_UNROLL
  for (int j = 0; j < kVecs; ++j) {
    const float4 x = reinterpret_cast<const float4*>(partial)[j * 128 + t];
    acc_s(4 * j) += x.x;
    acc_s(4 * j + 1) += x.y;
    acc_s(4 * j + 2) += x.z;
    acc_s(4 * j + 3) += x.w;
  }
}

// Keeps O alive: one value per thread into sink.
template <typename TensorO>
__device__ __forceinline__ void sink_output(const TensorO& acc_o, float row_sum, float* sink) {
  float o = 0.f;
  CUTE_UNROLL
  for (int j = 0; j < cute::size(acc_o); ++j) o += acc_o(j);
  *sink = o + row_sum;
}
