// The Hopper forward's epilogue (fwd_kernel_sm90.h): each MMA warpgroup
// writes its own 64 rows of O and their lse, or, for a query block that sees
// no key, all MMA warpgroups write its empty rows together.
#pragma once

#include <cstdint>
#include <utility>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "cuda/core/params.h"
#include "cuda/core/tile_ops_sm90.h"
#include "cuda/fwd/fwd_block_io.h"
#include "cuda/fwd/sm90/fwd_kernel_traits_sm90.h"
#include "cuda/fwd/sm90/fwd_mainloop_sm90.h"

namespace flash {

using namespace cute;

template <typename Traits>
struct FwdSm90Epilogue {
  static_assert(Traits::kBlockM == 64 * Traits::kNMmaWarpGroups,
                "each MMA warpgroup stores its own 64 rows");
  using NamedBarrier = cutlass::arch::NamedBarrier;
  using TiledMmaO = typename Traits::TiledMmaO;
  using ThrMmaO = decltype(std::declval<TiledMmaO&>().get_thread_slice(0));
  using TensorSO = typename FwdSm90SmemTiles<Traits>::TensorO;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kHeadDim = Traits::kHeadDim;

  const FwdParams& params;
  TensorSO sO;  // (kBlockM, D)
  const int mma_tidx;
  const int warp_group;
  const uint32_t my_epilogue;
  // The P V product whose accumulator this thread stores (the main loop's).
  const TiledMmaO& tiled_mma_o;
  const ThrMmaO& thr_mma_o;

  __forceinline__ __device__ FwdSm90Epilogue(const FwdParams& params_, const TensorSO& sO_,
                                             int mma_tidx_, int warp_group_,
                                             const TiledMmaO& tiled_mma_o_,
                                             const ThrMmaO& thr_mma_o_)
      : params(params_),
        sO(sO_),
        mma_tidx(mma_tidx_),
        warp_group(warp_group_),
        my_epilogue(uint32_t(FwdSm90NamedBarrier::kEpilogue0) + warp_group_),
        tiled_mma_o(tiled_mma_o_),
        thr_mma_o(thr_mma_o_) {}

  // Zeros to O and +inf to the lse of a query block that sees no key, by all
  // MMA threads.
  template <typename TensorGO>
  __forceinline__ __device__ void store_empty_rows(const TensorGO& gO, float* lse_rows,
                                                   int rows_left) const {
    Tensor cO = make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{});  // (kBlockM, D)
    write_empty_rows<Traits>(gO, cO, lse_rows, rows_left, params.head_dim, mma_tidx);
  }

  // Each warpgroup stages its own 64 rows of O (over its own rows of Q,
  // which only its own finished wgmmas read, unless O has a tile of its own)
  // and stores them. The barrier before: every thread of the warpgroup is
  // done reading the last query block's O.
  template <typename TensorAccO, typename TensorGO, int kNRows>
  __forceinline__ __device__ void store(const TensorAccO& acc_o, const float (&lse)[kNRows],
                                        const TensorGO& gO, float* lse_rows, int rows_left) {
    NamedBarrier::arrive_and_wait(128, my_epilogue);
    stage_output<Traits>(
        acc_o, tiled_mma_o, thr_mma_o, sO,
        [](auto layout) { return wgmma_acc_layout_as_rowcol(layout); }, lse, lse_rows, rows_left,
        mma_tidx);
    NamedBarrier::arrive_and_wait(128, my_epilogue);
    Tensor sO_warp_group = rows_of_warp_group(sO);  // (64, D)
    Tensor gO_warp_group = rows_of_warp_group(gO);  // (64, D)
    store_output<typename Traits::GmemTiledCopyOWarpGroup>(
        sO_warp_group, gO_warp_group, rows_left - 64 * warp_group, params.head_dim, mma_tidx % 128);
  }

 private:
  template <typename TensorT>
  __forceinline__ __device__ auto rows_of_warp_group(TensorT& tile) const {
    return local_tile(tile, Shape<_64, Int<kHeadDim>>{}, make_coord(warp_group, 0));
  }
};

}  // namespace flash
