// The Hopper forward's shared memory and its synchronisation (fwd_kernel_sm90.h):
// the tiles and mbarriers of one block, the named barriers of the MMA
// warpgroups, and the count that maps a K / V load to its stage and round.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "cuda/core/tile_ops_sm90.h"
#include "cuda/fwd/sm90/fwd_kernel_traits_sm90.h"

namespace flash {

using namespace cute;

// Named barriers of the kernel (ids after those CUTLASS reserves): the MMA
// warpgroups' turns at issuing products (one per warpgroup, at most three),
// each warpgroup's own epilogue barrier, and the MMA warpgroups' meeting
// after a varlen tile's tail is zeroed.
enum class FwdSm90NamedBarrier : uint32_t { kTurnOfWarpGroup0 = 0, kEpilogue0 = 3, kZeroVTail = 6 };

// The block's dynamic shared memory: Q and K (d_qk wide), V (d_v wide; K and
// V kStages buffers each), O (d_v wide)
// when it has a tile of its own (Traits::kSeparateO; else it is staged over
// Q), then the mbarriers. Stateless, as BwdSm90SharedStorage: every view is an
// offset from the block's one dynamic shared array.
template <typename Traits>
struct FwdSm90SharedStorage {
  using Element = typename Traits::Element;
  static_assert(Traits::kSmemSizeTiles % 8 == 0, "the mbarriers follow the tiles");

  static __forceinline__ __device__ char* base() {
    extern __shared__ char smem[];
    return smem;
  }
  static __forceinline__ __device__ auto q() {
    return make_tensor(make_smem_ptr(reinterpret_cast<Element*>(base())),
                       typename Traits::SmemLayoutQ{});  // (M,D)
  }
  static __forceinline__ __device__ auto k() {
    return make_tensor(q().data() + size(q()), typename Traits::SmemLayoutK{});  // (N,D,stage)
  }
  static __forceinline__ __device__ auto v() {
    return make_tensor(k().data() + size(k()), typename Traits::SmemLayoutV{});  // (N,Dv,stage)
  }
  static __forceinline__ __device__ auto vt() {
    return make_tensor(v().data(), typename Traits::SmemLayoutVt{});  // (Dv,N,stage)
  }
  static __forceinline__ __device__ auto o() {
    return make_tensor(Traits::kSeparateO ? v().data() + size(v()) : q().data(),
                       typename Traits::SmemLayoutO{});  // (M,Dv)
  }
  static __forceinline__ __device__ typename Traits::Barriers& barriers() {
    return *reinterpret_cast<typename Traits::Barriers*>(base() + Traits::kSmemSizeTiles);
  }

  // One thread sets up the mbarriers before the block's first barrier.
  // kv_full_arrivals: the arrivals that fill a K / V stage, one TMA-arming
  // thread's or every gathering thread's (FwdSm90Tma::kv_full_arrivals);
  // producer_threads: the producer threads that read a published tile.
  template <bool kTilesFromCounter>
  static __forceinline__ __device__ void init_barriers(int kv_full_arrivals, int producer_threads) {
    auto& b = barriers();
    full_barrier(b.q_full).init(1);
    empty_barrier(b.q_empty).init(Traits::kNMmaThreads);
    CUTE_UNROLL
    for (int s = 0; s < Traits::kStages; ++s) {
      full_barrier(b.k_full[s]).init(kv_full_arrivals);
      full_barrier(b.v_full[s]).init(kv_full_arrivals);
      // Every MMA thread hands a stage back once its wgmmas have read it.
      empty_barrier(b.k_empty[s]).init(Traits::kNMmaThreads);
      empty_barrier(b.v_empty[s]).init(Traits::kNMmaThreads);
    }
    if constexpr (kTilesFromCounter) {
      empty_barrier(b.tile_full).init(1);
      // Read by every MMA thread and by each producer thread.
      empty_barrier(b.tile_empty).init(Traits::kNMmaThreads + producer_threads);
    }
    cutlass::arch::fence_barrier_init();
  }
};

// Key tiles are counted across the block's query blocks, on each side of the
// K / V stages (the producer's and every MMA thread's counts agree): the
// walk's i-th K / V tile uses stage i % kStages, in that stage's
// (i / kStages)-th round, whose parity its mbarriers wait on. Q's j-th load
// is round j of its one buffer.
template <int kStages>
struct FwdSm90Stages {
  static_assert(kStages >= 1, "at least one K / V buffer");
  int kv_loads = 0;
  int q_loads = 0;

  // Of the current query block's i-th key tile.
  __forceinline__ __device__ int stage(int i) const { return (kv_loads + i) % kStages; }
  __forceinline__ __device__ uint32_t phase(int i) const {
    return uint32_t(((kv_loads + i) / kStages) & 1);
  }
  __forceinline__ __device__ uint32_t q_phase() const { return uint32_t(q_loads & 1); }
  // Past a query block of n_key_tiles key tiles.
  __forceinline__ __device__ void advance(int n_key_tiles) {
    kv_loads += n_key_tiles;
    ++q_loads;
  }
};

}  // namespace flash
