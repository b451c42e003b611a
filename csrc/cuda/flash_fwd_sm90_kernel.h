// The forward kernel on Hopper's warpgroup MMAs (wgmma, sm90a): the same
// FlashAttention-2 schedule as flash_fwd_kernel.h (one thread block per query
// block, K/V tiles streamed by cp.async from the last visible key block down,
// online softmax with P kept in registers), but each 64-row warpgroup issues
// Q K^T with both operands read from shared memory and P V with P from its
// registers, at about twice the tensor-core rate of the SM80 mma.sync path.
// It runs the plain score rule (causal / local / bounds masking); the
// softcap / ALiBi / dropout variant stays on flash_fwd_kernel.h.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>

#include "../common/mask_rule.h"
#include "block_info.h"
#include "fwd_block_io.h"
#include "fwd_block_order.h"
#include "kernel_traits_sm90.h"
#include "params.h"
#include "score_mods.h"
#include "softmax.h"
#include "tile_ops.h"
#include "tile_ops_sm90.h"

namespace flash {

using namespace cute;

template <typename Traits>
__global__ void __launch_bounds__(Traits::kNThreads, 1) flash_fwd_sm90_kernel(const FwdParams params) {
#if defined(CUTE_ARCH_MMA_SM90A_ENABLED)
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kStages = Traits::kStages;

  extern __shared__ char smem[];
  const FwdBlockCoord coord = fwd_block_coord(/*causal=*/params.window_right >= 0);
  const BlockInfo binfo(params, coord.batch);
  const FwdBlock block = fwd_block<kBlockM, kBlockN>(params, coord, binfo);
  if (block.rows_left <= 0) return;  // varlen: this sequence is shorter than the longest
  const int tidx = threadIdx.x;
  const int seqlen_q = binfo.seqlen_q;
  const int seqlen_k = binfo.seqlen_k;
  const int row_begin = block.row_begin;
  const int rows_left = block.rows_left;
  const int n_block_min = block.n_block_min;
  const int n_block_max = block.n_block_max;
  float* lse_rows = fwd_lse_rows(params, binfo, block);
  const auto global_tiles =
      fwd_global_tiles<Element, kBlockM, kBlockN, kHeadDim>(params, binfo, block);
  Tensor gQ = get<0>(global_tiles);  // (M, D)
  Tensor gK = get<1>(global_tiles);  // (N, D, n)
  Tensor gV = get<2>(global_tiles);  // (N, D, n)
  Tensor gO = get<3>(global_tiles);  // (M, D)

  Tensor cQ = make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{});
  Tensor cKV = make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{});

  if (n_block_max <= n_block_min) {
    write_empty_rows<Traits>(gO, cQ, lse_rows, rows_left, params.head_dim, tidx);
    return;
  }

  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)),
                          typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(sQ.data() + size(sQ), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(sK.data() + size(sK), typename Traits::SmemLayoutKV{});
  Tensor sVt = make_tensor(sV.data(), typename Traits::SmemLayoutVt{});

  typename Traits::GmemTiledCopyQKV gmem_tiled_copy_QKV;
  auto gmem_thr_copy_QKV = gmem_tiled_copy_QKV.get_thread_slice(tidx);
  Tensor tQgQ = gmem_thr_copy_QKV.partition_S(gQ);
  Tensor tQsQ = gmem_thr_copy_QKV.partition_D(sQ);
  Tensor tKgK = gmem_thr_copy_QKV.partition_S(gK);  // (CPY, CPY_N, CPY_D, n)
  Tensor tKsK = gmem_thr_copy_QKV.partition_D(sK);
  Tensor tVgV = gmem_thr_copy_QKV.partition_S(gV);
  Tensor tVsV = gmem_thr_copy_QKV.partition_D(sV);
  Tensor tQcQ = gmem_thr_copy_QKV.partition_S(cQ);
  Tensor tKVcKV = gmem_thr_copy_QKV.partition_S(cKV);
  Tensor tQpQ = make_tensor<bool>(make_shape(size<2>(tQsQ)));
  Tensor tKVpKV = make_tensor<bool>(make_shape(size<2>(tKsK)));
  make_col_predicate(tQpQ, tQcQ, params.head_dim);
  make_col_predicate(tKVpKV, tKVcKV, params.head_dim);
  const bool full_head_dim = params.head_dim == kHeadDim;
  auto kv_tile_in_bounds = [&](int n) { return full_head_dim && (n + 1) * kBlockN <= seqlen_k; };

  // Each warpgroup's slice of the two MMAs: its 64 query rows of S and O.
  // The operands in shared memory are wgmma descriptors, not registers.
  typename Traits::TiledMmaS tiled_mma_s;
  typename Traits::TiledMmaO tiled_mma_o;
  auto thr_mma_s = tiled_mma_s.get_thread_slice(tidx);
  auto thr_mma_o = tiled_mma_o.get_thread_slice(tidx);
  Tensor tSrQ = thr_mma_s.partition_fragment_A(sQ);
  Tensor tSrK = thr_mma_s.partition_fragment_B(sK);    // (MMA, MMA_N, MMA_K, stage)
  Tensor tOrVt = thr_mma_o.partition_fragment_B(sVt);  // (MMA, MMA_D, MMA_K, stage)
  Tensor acc_o = partition_fragment_C(tiled_mma_o, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  clear(acc_o);
  Tensor acc_s = partition_fragment_C(tiled_mma_s, Shape<Int<kBlockM>, Int<kBlockN>>{});
  // P of the previous tile, in the register layout of P V's A operand.
  Tensor tOrP = make_tensor<Element>(wgmma_acc_layout_as_operand_a(acc_s.layout()));

  Tensor cS = make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{});
  Tensor tScS = thr_mma_s.partition_C(cS);
  Tensor tScS_rowcol = make_tensor(tScS.data(), wgmma_acc_layout_as_rowcol(tScS.layout()));
  Tensor scores = make_tensor(acc_s.data(), wgmma_acc_layout_as_rowcol(acc_s.layout()));
  Tensor acc_o_rowcol = make_tensor(acc_o.data(), wgmma_acc_layout_as_rowcol(acc_o.layout()));
  constexpr int kNRows = decltype(size<0>(acc_o_rowcol))::value;

  auto load_k = [&](int n) {
    Tensor tKsK_stage = tKsK(_, _, _, n % kStages);
    copy_tile_predicated(gmem_tiled_copy_QKV, tKgK(_, _, _, n), tKsK_stage, tKVcKV, tKVpKV,
                         seqlen_k - n * kBlockN, kv_tile_in_bounds(n));
  };
  auto load_v = [&](int n) {
    Tensor tVsV_stage = tVsV(_, _, _, n % kStages);
    copy_tile_predicated(gmem_tiled_copy_QKV, tVgV(_, _, _, n), tVsV_stage, tKVcKV, tKVpKV,
                         seqlen_k - n * kBlockN, kv_tile_in_bounds(n));
  };
  // Every thread's copies have landed, and wgmma (which reads shared memory
  // through the async proxy, while cp.async writes through the generic one)
  // sees them; the barrier also means every warpgroup is done with the
  // buffers the next copies overwrite.
  auto wait_for_copies = [&]() {
    cute::cp_async_wait<0>();
    cutlass::arch::fence_view_async_shared();
    __syncthreads();
  };

  // Prologue: Q and the last visible K block in flight together; key blocks
  // run from high to low so a causal diagonal block comes first.
  copy_tile_predicated(gmem_tiled_copy_QKV, tQgQ, tQsQ, tQcQ, tQpQ, rows_left,
                       full_head_dim && rows_left >= kBlockM);
  load_k(n_block_max - 1);
  cute::cp_async_fence();

  OnlineSoftmax<kNRows> softmax;

  // Iteration n computes S(n) = Q K(n)^T and, on the tensor cores at the same
  // time, O += P(n+1) V(n+1) of the tile before; the softmax of S(n) runs
  // while that product is in flight, and acc_o is rescaled once it lands.
  // K(n-1) and V(n) are copied meanwhile, into the buffers that K(n+1) and
  // V(n+2) held. The first iteration has no P V yet; it is peeled off at
  // compile time, since a branch around a wgmma inside a batch makes ptxas
  // serialize the batch.
  auto iteration = [&](int n_block, auto has_pending_pv) {
    constexpr bool kHasPendingPv = decltype(has_pending_pv)::value;
    wait_for_copies();  // K(n) and V(n+1)
    if (n_block > n_block_min) load_k(n_block - 1);
    load_v(n_block);
    cute::cp_async_fence();

    const int stage = n_block % kStages;
    // Every register a wgmma reads is settled before the arrive: an
    // instruction defining one inside the batch would serialize the wgmmas.
    warpgroup_fence_operand(acc_s);
    if constexpr (kHasPendingPv) {
      warpgroup_fence_operand(tOrP);
      warpgroup_fence_operand(acc_o);
    }
    warpgroup_arrive();
    wgmma_issue</*kZeroInit=*/true>(tiled_mma_s, tSrQ, tSrK(_, _, _, stage), acc_s);
    warpgroup_commit_batch();
    if constexpr (kHasPendingPv) {
      wgmma_issue</*kZeroInit=*/false>(tiled_mma_o, tOrP, tOrVt(_, _, _, stage ^ 1), acc_o);
      warpgroup_commit_batch();
      warpgroup_wait<1>();  // S(n) has landed; P(n+1) V(n+1) may still run
    } else {
      warpgroup_wait<0>();
    }
    warpgroup_fence_operand(acc_s);

    const int col_base = n_block * kBlockN;
    if (!key_tile_fully_visible(row_begin, row_begin + kBlockM, col_base, col_base + kBlockN,
                                seqlen_q, seqlen_k, params.window_left, params.window_right)) {
      apply_mask(scores, tScS_rowcol, row_begin, col_base, seqlen_q, seqlen_k, params.window_left,
                 params.window_right);
    }
    typename OnlineSoftmax<kNRows>::TileCorrection correction;
    softmax.update_scores(scores, params.softmax_scale_log2, correction);

    if constexpr (kHasPendingPv) {
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_o);
      warpgroup_fence_operand(tOrP);
    }
    softmax.template rescale_output</*kSkipUnmovedRescale=*/true>(acc_o_rowcol, correction);
    convert_type_into(acc_s, tOrP);
  };

  iteration(n_block_max - 1, cute::false_type{});
  for (int n_block = n_block_max - 2; n_block >= n_block_min; --n_block) {
    iteration(n_block, cute::true_type{});
  }

  // The last tile's P V: V(n_block_min) was copied in the last iteration.
  wait_for_copies();
  warpgroup_fence_operand(tOrP);
  warpgroup_fence_operand(acc_o);
  warpgroup_arrive();
  wgmma_issue</*kZeroInit=*/false>(tiled_mma_o, tOrP, tOrVt(_, _, _, n_block_min % kStages), acc_o);
  warpgroup_commit_batch();
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc_o);

  float lse[kNRows];
  softmax.finalize(acc_o_rowcol, params.softmax_scale, 1.f, lse);

  Tensor sO = make_tensor(sQ.data(), typename Traits::SmemLayoutO{});
  write_output<Traits>(acc_o, tiled_mma_o, thr_mma_o, sO, gO,
                       [](auto layout) { return wgmma_acc_layout_as_rowcol(layout); }, lse,
                       lse_rows, rows_left, params.head_dim, tidx);
#endif
}

}  // namespace flash
