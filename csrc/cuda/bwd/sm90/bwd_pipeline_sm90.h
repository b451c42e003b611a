// What the roles of the Hopper backward (bwd_kernel_sm90.h) share: the views
// of the block's shared memory, the mbarrier rounds of the Q / dO stages, the
// named barriers of the MMA warpgroups, and the walk over key blocks (the
// tile scheduler). The roles themselves are in bwd_mainloop_sm90.h (the
// producer's loads, the MMA warpgroups' products) and bwd_epilogue_sm90.h
// (dQ's accumulation, the dK / dV stores).
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "cuda/bwd/sm90/bwd_kernel_traits_sm90.h"

namespace flash {

using namespace cute;

// Named barriers (ids after those CUTLASS reserves). Of the MMA warpgroups:
// both warpgroups' dS is in shared memory; the epilogue's staging of dK / dV;
// a varlen block's rows of another sequence are zeroed. Of the MMA
// warpgroups and the dQ order warp (deterministic mode, BwdSm90DQOrder):
// this key block's turn to add a query block's dQ has come; its dQ is added.
// Of the MMA warpgroups and the dQ writer warp (BwdSm90DQWriter): dQ's
// staging buffer is free; it holds a query block's dQ.
enum class BwdSm90NamedBarrier : uint32_t {
  kDSWritten = 0,
  kEpilogue = 1,
  kZeroTails = 2,
  kDQTurn = 3,
  kDQAdded = 4,
  kDQStagingFree = 5,
  kDQStaged = 6,
};

// The block's dynamic shared memory: Q and dO (kStages buffers each; dO at
// d_v columns), K, V (d_v columns),
// dS and (split design) P^T (two buffers each), the row statistics of each
// Q / dO stage, dQ's staging buffer (Traits::kDQThroughSmem), then the
// mbarriers. Stateless: every view is an offset from
// the block's one dynamic shared array, a constant address wherever a role
// builds it (a base pointer kept in the roles moved the mbarrier address
// arithmetic in the SASS).
template <typename Traits>
struct BwdSm90SharedStorage {
  using Element = typename Traits::Element;
  static constexpr int kBlockM = Traits::kBlockM;
  static_assert(Traits::kSmemSizeTiles % 8 == 0, "the mbarriers follow the tiles");
  static_assert(Traits::kSmemSizeTiles == Traits::kSmemSizeQdO + Traits::kSmemSizedO +
                                              Traits::kSmemSizeKV + Traits::kSmemSizeV +
                                              Traits::kSmemSizedS + Traits::kSmemSizeP +
                                              Traits::kSmemSizeRowStats + Traits::kSmemSizeDQ,
                "the views below tile the block's shared memory in this order");

  static __forceinline__ __device__ char* base() {
    extern __shared__ char smem[];
    return smem;
  }
  static __forceinline__ __device__ auto q() {
    return make_tensor(make_smem_ptr(reinterpret_cast<Element*>(base())),
                       typename Traits::SmemLayoutQdO{});  // (M,D,PIPE)
  }
  static __forceinline__ __device__ auto qt() {
    return make_tensor(q().data(), typename Traits::SmemLayoutQdOt{});  // (D,M,PIPE)
  }
  static __forceinline__ __device__ auto dout() {
    return make_tensor(q().data() + size(q()), typename Traits::SmemLayoutdO{});  // (M,Dv,PIPE)
  }
  static __forceinline__ __device__ auto doutt() {
    return make_tensor(dout().data(), typename Traits::SmemLayoutdOt{});  // (Dv,M,PIPE)
  }
  static __forceinline__ __device__ auto k() {
    return make_tensor(dout().data() + size(dout()), typename Traits::SmemLayoutKV{});  // (N,D)
  }
  static __forceinline__ __device__ auto kt() {
    return make_tensor(k().data(), typename Traits::SmemLayoutKt{});  // (D,N)
  }
  static __forceinline__ __device__ auto v() {
    return make_tensor(k().data() + size(k()), typename Traits::SmemLayoutV{});  // (N,Dv)
  }
  static __forceinline__ __device__ auto ds() {
    return make_tensor(v().data() + size(v()), typename Traits::SmemLayoutdS{});  // (M,N,BUF)
  }
  static __forceinline__ __device__ auto dst() {
    return make_tensor(ds().data(), typename Traits::SmemLayoutdSt{});  // (N,M,BUF)
  }
  // P^T, in shared memory in the split design only (Traits::kSmemSizeP).
  static __forceinline__ __device__ auto pt() {
    return make_tensor(ds().data() + size(ds()), typename Traits::SmemLayoutdSt{});  // (N,M,BUF)
  }
  // The lse (kBlockM floats) then D (kBlockM floats) of a Q / dO stage.
  static __forceinline__ __device__ float* row_stats(int stage) {
    float* all = reinterpret_cast<float*>(base() + Traits::kSmemSizeQdO + Traits::kSmemSizedO +
                                          Traits::kSmemSizeKV + Traits::kSmemSizeV +
                                          Traits::kSmemSizedS + Traits::kSmemSizeP);
    return all + stage * 2 * kBlockM;
  }
  // dQ's staging buffer: one query block in the accumulator's order
  // (bwd_accum_layout.h); 16-byte aligned, as every view before it is a
  // multiple of 512 bytes.
  static __forceinline__ __device__ float* dq_staging() {
    return row_stats(0) + Traits::kSmemSizeRowStats / int(sizeof(float));
  }
  static __forceinline__ __device__ typename Traits::Barriers& barriers() {
    return *reinterpret_cast<typename Traits::Barriers*>(base() + Traits::kSmemSizeTiles);
  }
};

// The block's query-block loads, counted across its key blocks, on each side
// of the Q / dO stages (the producer's and every MMA thread's count agree):
// the j-th uses stage j % kStages, in that stage's (j / kStages)-th round,
// whose parity its full / empty mbarriers wait on.
template <int kStages>
struct BwdSm90QStages {
  static_assert(kStages >= 1, "at least one Q / dO buffer");
  int count = 0;

  __forceinline__ __device__ int stage() const { return count % kStages; }
  __forceinline__ __device__ uint32_t phase() const { return uint32_t((count / kStages) & 1); }
  __forceinline__ __device__ void advance() { ++count; }
};

// A role's place in the walk: the key block it is at, how many it walked
// before (the round of the K / V mbarriers, which wait on its parity), and
// its count of query-block loads, which runs on across key blocks. One
// struct, in this field order, so that the three loop counters come out of
// register promotion in the order the earlier single-function kernel had
// (other layouts gave the same instructions in other registers).
template <int kStages>
struct BwdSm90WalkState {
  BwdSm90QStages<kStages> q_stages;
  int round;
  int n_block;
};

// The tile scheduler: a block walks key blocks blockIdx.x, blockIdx.x +
// gridDim.x, ... (more than one only in deterministic mode, where the grid's
// x is the number of dQ splits), and within each the query blocks that see
// it (bwd_sm90_walk_query_blocks). The producer and the MMA warpgroups walk
// the same sequence, each with a BwdSm90WalkState of its own.
//
// kOrderedDQ (one key block per thread block): the last key block first,
// block x taking key block gridDim.x - 1 - x, since with ordered dQ a key
// block waits for the higher ones (bwd_sm90_dq_turn), which must therefore
// start no later: blocks are launched in the order of their index.
template <int kBlockN, int kStages, bool kOrderedDQ = false>
struct BwdSm90TileScheduler {
  using WalkState = BwdSm90WalkState<kStages>;
  int num_n_blocks;

  __forceinline__ __device__ explicit BwdSm90TileScheduler(int seqlen_k)
      : num_n_blocks((seqlen_k + kBlockN - 1) / kBlockN) {}

  static __forceinline__ __device__ WalkState first() {
    return {{}, 0, kOrderedDQ ? int(gridDim.x - 1 - blockIdx.x) : int(blockIdx.x)};
  }
  __forceinline__ __device__ bool valid(const WalkState& walk) const {
    return walk.n_block < num_n_blocks;
  }
  static __forceinline__ __device__ void advance(WalkState& walk) {
    walk.n_block += gridDim.x;  // ordered: past every key block, gridDim.x covering them
    ++walk.round;
  }
};

// Calls visit(m_block, first) for the query blocks of a key block that see
// it, first whether it is the walk's first: from the last down, or with
// kAscending (ordered dQ) from the first up, so that under a causal mask a
// key block starts on its own diagonal, where it is the first to add dQ
// (bwd_sm90_dq_turn). Every role of the kernel walks the same order.
template <bool kAscending, typename Visit>
__forceinline__ __device__ void bwd_sm90_walk_query_blocks(int m_block_min, int m_block_max,
                                                           Visit&& visit) {
  if constexpr (kAscending) {
    for (int m_block = m_block_min; m_block < m_block_max; ++m_block) {
      visit(m_block, m_block == m_block_min);
    }
  } else {
    for (int m_block = m_block_max - 1; m_block >= m_block_min; --m_block) {
      visit(m_block, m_block == m_block_max - 1);
    }
  }
}

}  // namespace flash
