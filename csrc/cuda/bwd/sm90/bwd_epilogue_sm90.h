// The outputs of the Hopper backward's MMA warpgroups (bwd_kernel_sm90.h):
//   - BwdSm90DQAccumulator: each query block's dQ added into the fp32 dQ
//     accumulator (bwd_accum_layout.h): staged in shared memory for
//     BwdSm90DQWriter's bulk reduction (head dims up to 128), which in
//     deterministic mode with ordered dQ waits for this key block's turn; or
//     by each thread's reductions, as soon as dQ lands or, ordered, once
//     BwdSm90DQOrder says it is this key block's turn;
//   - BwdSm90Epilogue: a key block's dK and dV, once its walk over the query
//     blocks is done, stored through shared memory (over K and V), then K / V
//     handed back to the producer.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "cuda/bwd/bwd_accum_layout.h"
#include "cuda/bwd/bwd_block_io.h"
#include "cuda/bwd/sm90/bwd_kernel_traits_sm90.h"
#include "cuda/bwd/sm90/bwd_pipeline_sm90.h"
#include "cuda/core/block_info.h"
#include "cuda/core/bulk_reduce_sm90.h"
#include "cuda/core/gpu_semaphore.h"
#include "cuda/core/params.h"
#include "cuda/core/tile_ops_sm90.h"

namespace flash {

using namespace cute;

// The epilogue's barrier (store_dk_dv): the 256 MMA threads only.
struct BwdSm90EpilogueBarrier {
  __device__ void operator()() const {
    cutlass::arch::NamedBarrier::arrive_and_wait(256, uint32_t(BwdSm90NamedBarrier::kEpilogue));
  }
};

// The threads that meet on kDQTurn / kDQAdded: both MMA warpgroups and the
// dQ order warp.
constexpr uint32_t kBwdSm90DQOrderThreads = 256 + 32;

// The threads that meet on kDQStagingFree / kDQStaged: both MMA warpgroups
// and the dQ writer warp.
constexpr uint32_t kBwdSm90DQWriterThreads = 256 + 32;

// This thread's chunk of the dQ accumulator for one key block: every key
// block adds into the same dQ rows. In deterministic mode the order is fixed
// either by a split slice of its own (the block is its only writer) or, with
// kOrdered, by the turns of BwdSm90DQOrder or BwdSm90DQWriter: the block adds
// only on its turn. Staged (Traits::kDQThroughSmem), the thread stores its
// fragment at the same offsets in the staging buffer and BwdSm90DQWriter
// adds the whole block, on its turn where ordered.
template <typename Traits, bool kOrdered = false>
struct BwdSm90DQAccumulator {
  using Storage = BwdSm90SharedStorage<Traits>;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr bool kStaged = Traits::kDQThroughSmem;
  static_assert(Traits::kDQChunks == 1 && Traits::kDQChunkCols == kHeadDim,
                "dQ is one chunk of the whole head dim");
  static_assert(Traits::kNThreads == 256,
                "kBwdSm90DQOrderThreads and kBwdSm90DQWriterThreads count two MMA warpgroups");

  float* const dq_accum_thread;
  const int mma_tidx;

  __forceinline__ __device__ BwdSm90DQAccumulator(const BwdParams& params, const BlockInfo& binfo,
                                                  const BwdKeyBlock& block, int split,
                                                  int mma_tidx_)
      : dq_accum_thread(
            dq_accum_thread_ptr<kBlockM, kHeadDim>(params, binfo, block, split, mma_tidx_)),
        mma_tidx(mma_tidx_) {}

  // acc_dq: (MMA,MMA_M,MMA_N) of the dQ MMA, query block m_block.
  template <typename TensorAcc>
  __forceinline__ __device__ void add(const TensorAcc& acc_dq, int m_block) const {
    if constexpr (kStaged) {
      stage(acc_dq);
      return;
    }
    if constexpr (kOrdered) {
      cutlass::arch::NamedBarrier::arrive_and_wait(kBwdSm90DQOrderThreads,
                                                   uint32_t(BwdSm90NamedBarrier::kDQTurn));
    }
    atomic_add_fragment<Traits::kNThreads>(
        acc_dq, dq_accum_thread + accum_tile_offset<kBlockM, kHeadDim, kHeadDim>(m_block, 0));
    if constexpr (kOrdered) {
      cutlass::arch::NamedBarrier::arrive(kBwdSm90DQOrderThreads,
                                          uint32_t(BwdSm90NamedBarrier::kDQAdded));
    }
  }

 private:
  // The fragment into the staging buffer once the writer has read the last
  // block's (16-byte stores: a warp's 32 are one contiguous 512-byte span, no
  // bank conflict), then handed to the writer.
  template <typename TensorAcc>
  __forceinline__ __device__ void stage(const TensorAcc& acc_dq) const {
    static_assert(decltype(size(acc_dq))::value % kAccumVec == 0);
    float* thread_staging = Storage::dq_staging() + accum_thread_offset(mma_tidx);
    cutlass::arch::NamedBarrier::arrive_and_wait(kBwdSm90DQWriterThreads,
                                                 uint32_t(BwdSm90NamedBarrier::kDQStagingFree));
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dq); i += kAccumVec) {
      *reinterpret_cast<float4*>(thread_staging + accum_value_offset<Traits::kNThreads>(i)) =
          make_float4(acc_dq(i), acc_dq(i + 1), acc_dq(i + 2), acc_dq(i + 3));
    }
    cutlass::arch::fence_view_async_shared();  // the bulk reduction reads through the async proxy
    cutlass::arch::NamedBarrier::arrive(kBwdSm90DQWriterThreads,
                                        uint32_t(BwdSm90NamedBarrier::kDQStaged));
  }
};

// Ordered dQ (deterministic mode, plan.ordered_dq): the turn of a key block
// at query block m_block, the number of key blocks that add into the query
// block before it. The query block's contributors are key blocks 0 ..
// n_block_max - 1 (with no left window bound, plan.cpp), and they add from
// the last down: walking its query blocks from the first up
// (bwd_sm90_walk_query_blocks), a key block under a causal mask starts on
// the query block where it is the last contributor, so its first addition
// waits for nobody and each later one for key blocks that started no later
// (BwdSm90TileScheduler launches the last key block first). FA4's
// deterministic backward orders its additions the same way (PERF_LOG
// issue-53 hypothesis 3).
template <int kBlockM, int kBlockN>
__forceinline__ __device__ int bwd_sm90_dq_turn(const BwdParams& params, const BlockInfo& binfo,
                                                const BwdKeyBlock& block, int m_block) {
  const int row_begin = m_block * kBlockM;
  const int row_end = min(row_begin + kBlockM, binfo.seqlen_q);
  const KeyRange keys = visible_key_range(row_begin, row_end, binfo.seqlen_q, binfo.seqlen_k,
                                          params.window_left, params.window_right);
  const int n_block_max = (keys.end + kBlockN - 1) / kBlockN;
  return n_block_max - 1 - block.n_block;
}

// The counters of ordered dQ: one per query block of a (batch, head), each
// counting the key blocks that have added into it.
__forceinline__ __device__ int* bwd_sm90_dq_counters(const BwdParams& params, int batch, int head) {
  return params.dq_semaphore +
         (int64_t(batch) * params.nheads + head) * params.dq_semaphore_m_blocks;
}

// The dQ writer: one warp of the producer warpgroup (Traits::kDQThroughSmem)
// walks the block's key blocks and their query blocks as the MMA warpgroups
// do; for each query block it frees the staging buffer, waits until both
// warpgroups have staged their dQ, and adds the block into the accumulator
// with one bulk reduction (lane 0), which it lets finish reading before
// freeing the buffer again. The MMA warps so never wait on the memory pipe
// for dQ; they wait only if the last block's reduction has not yet been read
// when their next dQ lands.
//
// kOrdered: before the bulk reduction the writer waits until the query
// block's counter reaches this key block's turn (bwd_sm90_dq_turn), and once
// the additions are done (not only read) it increments the counter. The MMA
// warps never wait for a turn, only for the buffer (FA4 splits the roles the
// same way).
template <typename Traits, bool kOrdered = false>
struct BwdSm90DQWriter {
  using Storage = BwdSm90SharedStorage<Traits>;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kBlockBytes = kBlockM * kHeadDim * int(sizeof(float));
  static_assert(kBlockBytes == Traits::kSmemSizeDQ, "the staging buffer holds one query block");
  static_assert(kBlockBytes % 16 == 0, "a bulk reduction moves whole 16-byte units");

  const BwdParams& params;
  const BlockInfo& binfo;
  float* const dq_accum_head;  // the (batch, head)'s rows of this block's slice
  int* const counters;         // kOrdered: bwd_sm90_dq_counters

  __forceinline__ __device__ BwdSm90DQWriter(const BwdParams& params_, const BlockInfo& binfo_,
                                             int batch, int head, int split)
      : params(params_),
        binfo(binfo_),
        dq_accum_head(params.dq_accum_ptr + split * params.dq_accum_split_stride +
                      dq_accum_offset<kBlockM, kHeadDim>(params, binfo, batch, head)),
        counters(kOrdered ? bwd_sm90_dq_counters(params, batch, head) : nullptr) {}

  // One key block's query blocks, in the MMA warpgroups' order.
  __forceinline__ __device__ void write(const BwdKeyBlock& block, int lane) const {
    bwd_sm90_walk_query_blocks<kOrdered>(
        block.m_block_min, block.m_block_max, [&](int m_block, bool) {
          cutlass::arch::NamedBarrier::arrive(kBwdSm90DQWriterThreads,
                                              uint32_t(BwdSm90NamedBarrier::kDQStagingFree));
          // Ordered: the turn is awaited while the MMA warps still compute this
          // block's dQ (the whole warp reconverges before the aligned barrier).
          if constexpr (kOrdered) {
            if (lane == 0) {
              semaphore_wait_for(counters + m_block,
                                 bwd_sm90_dq_turn<kBlockM, kBlockN>(params, binfo, block, m_block));
            }
            __syncwarp();
          }
          cutlass::arch::NamedBarrier::arrive_and_wait(kBwdSm90DQWriterThreads,
                                                       uint32_t(BwdSm90NamedBarrier::kDQStaged));
          if (lane == 0) {
            bulk_reduce_add_f32(
                dq_accum_head + accum_tile_offset<kBlockM, kHeadDim, kHeadDim>(m_block, 0),
                Storage::dq_staging(), kBlockBytes);
            if constexpr (kOrdered) {
              bulk_reduce_wait_done();
              semaphore_release_increment(counters + m_block);
            } else {
              bulk_reduce_wait_read();
            }
          }
          __syncwarp();
        });
  }
};

// Ordered dQ above head dim 128, where each MMA thread adds its own
// fragment: one warp of the producer warpgroup keeps the turns. It walks the
// key block's query blocks as the MMA warpgroups do; for each it waits until
// the query block's counter reaches the key block's turn
// (bwd_sm90_dq_turn), opens the turn (kDQTurn), waits until the MMA
// warpgroups' reductions are issued (kDQAdded) and publishes them. Its waits
// run ahead of the MMA warpgroups, which meet kDQTurn only once their dQ
// product has landed.
template <int kBlockM, int kBlockN>
struct BwdSm90DQOrder {
  const BwdParams& params;
  const BlockInfo& binfo;
  int* const counters;  // bwd_sm90_dq_counters

  __forceinline__ __device__ BwdSm90DQOrder(const BwdParams& params_, const BlockInfo& binfo_,
                                            int batch, int head)
      : params(params_), binfo(binfo_), counters(bwd_sm90_dq_counters(params, batch, head)) {}

  __forceinline__ __device__ void order(const BwdKeyBlock& block, int lane) const {
    bwd_sm90_walk_query_blocks</*kAscending=*/true>(
        block.m_block_min, block.m_block_max, [&](int m_block, bool) {
          if (lane == 0) {
            semaphore_wait_for(counters + m_block,
                               bwd_sm90_dq_turn<kBlockM, kBlockN>(params, binfo, block, m_block));
          }
          __syncwarp();
          cutlass::arch::NamedBarrier::arrive(kBwdSm90DQOrderThreads,
                                              uint32_t(BwdSm90NamedBarrier::kDQTurn));
          cutlass::arch::NamedBarrier::arrive_and_wait(kBwdSm90DQOrderThreads,
                                                       uint32_t(BwdSm90NamedBarrier::kDQAdded));
          if (lane == 0) semaphore_release_increment(counters + m_block);
        });
  }
};

// dK (scaled) and dV of a key block to global memory (store_dk_dv: directly,
// or summed over the query heads of a kv head), staged in sK / sV, which the
// producer then refills with the next key block's K / V.
template <typename Traits>
struct BwdSm90Epilogue {
  using Storage = BwdSm90SharedStorage<Traits>;

  const BwdParams& params;
  const BlockInfo& binfo;
  const int mma_tidx;

  __forceinline__ __device__ BwdSm90Epilogue(const BwdParams& params_, const BlockInfo& binfo_,
                                             int mma_tidx_)
      : params(params_), binfo(binfo_), mma_tidx(mma_tidx_) {}

  // acc_dk: (MMA,MMA_M,MMA_N) of tiled_mma_dkv; acc_dv of tiled_mma_dv.
  template <typename TensorAccDK, typename TensorAccDV, typename TiledMmaDK, typename ThrMmaDK,
            typename TiledMmaDV, typename ThrMmaDV>
  __forceinline__ __device__ void store(TensorAccDK& acc_dk, const TensorAccDV& acc_dv,
                                        const TiledMmaDK& tiled_mma_dk, const ThrMmaDK& thr_mma_dk,
                                        const TiledMmaDV& tiled_mma_dv, const ThrMmaDV& thr_mma_dv,
                                        const BwdKeyBlock& block) const {
    if constexpr (Traits::kHeadDimV == Traits::kHeadDim) {
      store_dk_dv<Traits>(acc_dk, acc_dv, tiled_mma_dk, thr_mma_dk,
                          raw_pointer_cast(Storage::k().data()),
                          raw_pointer_cast(Storage::v().data()), params, binfo, block, mma_tidx,
                          BwdSm90EpilogueBarrier{});
    } else {
      store_dk_dv_pair<Traits>(acc_dk, acc_dv, tiled_mma_dk, thr_mma_dk, tiled_mma_dv, thr_mma_dv,
                               raw_pointer_cast(Storage::k().data()),
                               raw_pointer_cast(Storage::v().data()), params, binfo, block,
                               mma_tidx, BwdSm90EpilogueBarrier{});
    }
    // The epilogue's generic-proxy reads and writes of sK / sV come before
    // the next key block's TMA writes.
    cutlass::arch::fence_view_async_shared();
    empty_barrier(Storage::barriers().kv_empty).arrive();
  }
};

}  // namespace flash
