// The epilogue of the Hopper forward (fwd_kernel_sm90.h): each MMA warpgroup
// stages its own 64 rows of O in shared memory and stores them, with each
// row's lse.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "cuda/core/params.h"
#include "cuda/core/softmax.h"
#include "cuda/core/tile_ops_sm90.h"
#include "cuda/fwd/fwd_block_io.h"
#include "cuda/fwd/sm90/fwd_kernel_traits_sm90.h"
#include "cuda/fwd/sm90/fwd_pipeline_sm90.h"

namespace flash {

using namespace cute;

template <typename Traits>
struct FwdSm90Epilogue {
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kHeadDimV = Traits::kHeadDimV;  // O's width
  using Storage = FwdSm90SharedStorage<Traits>;
  using NamedBarrier = cutlass::arch::NamedBarrier;

  const FwdParams& params;
  const int mma_tidx;
  const int warp_group;
  const uint32_t my_epilogue;

  __forceinline__ __device__ FwdSm90Epilogue(const FwdParams& params_, int mma_tidx_)
      : params(params_),
        mma_tidx(mma_tidx_),
        warp_group(mma_tidx_ / 128),
        my_epilogue(uint32_t(FwdSm90NamedBarrier::kEpilogue0) + warp_group) {}

  // O and lse of a query block (its rows_left rows of gO, (M,Dv); the
  // columns below head_dim_v, O's width). Each
  // warpgroup stages its rows over its own rows of Q, which only its own
  // finished wgmmas read, unless O has a tile of its own; the barrier before:
  // every thread of the warpgroup is done reading the last query block's O.
  // Without a tile for O, Q is handed back after.
  template <typename FragmentO, typename TiledMmaO, typename ThrMmaO, typename TensorGO, int kNRows>
  __forceinline__ __device__ void store(const FragmentO& acc_o, const TiledMmaO& tiled_mma_o,
                                        const ThrMmaO& thr_mma_o, const float (&lse)[kNRows],
                                        float* lse_rows, const TensorGO& gO, int rows_left) const {
    Tensor sO = Storage::o();  // (M,Dv)
    CUTE_STATIC_ASSERT_V(size<0>(sO) == Int<kBlockM>{} && size<1>(sO) == Int<kHeadDimV>{});
    NamedBarrier::arrive_and_wait(128, my_epilogue);
    stage_output<Traits>(
        acc_o, tiled_mma_o, thr_mma_o, sO,
        [](auto layout) { return wgmma_acc_layout_as_rowcol(layout); }, lse, lse_rows, rows_left,
        mma_tidx);
    NamedBarrier::arrive_and_wait(128, my_epilogue);
    Tensor sO_warp_group = rows_of_warp_group(sO);  // (64,Dv): this warpgroup's rows
    Tensor gO_warp_group = rows_of_warp_group(gO);  // (64,Dv)
    store_output<typename Traits::GmemTiledCopyOWarpGroup>(sO_warp_group, gO_warp_group,
                                                           rows_left - 64 * warp_group,
                                                           params.head_dim_v, mma_tidx % 128);
    if (!Traits::kSeparateO) empty_barrier(Storage::barriers().q_empty).arrive();
  }

  // A query block that sees no key: zeros, and +inf (or the head's sink) as
  // its rows' lse (fwd_block_io.h).
  template <typename TensorGO>
  __forceinline__ __device__ void store_empty(const TensorGO& gO, float* lse_rows, int head,
                                              int rows_left) const {
    Tensor cO = make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDimV>>{});  // (M,Dv) -> (row,col)
    write_empty_rows<Traits>(gO, cO, lse_rows, empty_row_lse(row_sink(params, head)), rows_left,
                             params.head_dim_v, mma_tidx);
  }

 private:
  template <typename TensorT>
  __forceinline__ __device__ auto rows_of_warp_group(TensorT& tile) const {
    return local_tile(tile, Shape<_64, Int<kHeadDimV>>{}, make_coord(warp_group, 0));
  }
};

}  // namespace flash
