// The TMA loads of the Hopper forward (fwd_kernel_sm90.h) and backward
// (bwd_kernel_sm90.h): how q / k / v (and dO) are described to TMA,
// which inputs can be, and the descriptors one launch passes to a kernel.
#pragma once

#include <cstdint>
#include <utility>

#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/tensor.hpp>

#include "cuda/core/block_info.h"
#include "cuda/core/params.h"

namespace flash {

using namespace cute;

// The TMA view of q / k / v: (rows, head dim, heads, batch), head dim
// contiguous; a varlen tensor is one batch entry of all its rows. Dims of
// extent 1 get a placeholder stride (TMA wants every stride a multiple of 16
// bytes, even where it is never used).
template <typename Element>
auto tma_gmem_tensor(const void* ptr, int rows, int head_dim, int heads, int batch,
                     const QKVStrides& strides) {
  auto usable = [](int64_t extent, int64_t stride) { return extent > 1 ? stride : int64_t(8); };
  return make_tensor(
      make_gmem_ptr(static_cast<const Element*>(ptr)), make_shape(rows, head_dim, heads, batch),
      make_stride(usable(rows, strides.row_stride), _1{}, usable(heads, strides.head_stride),
                  usable(batch, strides.batch_stride)));
}

// Whether q / k / v can be read by TMA as tma_gmem_tensor describes them:
// cuTensorMapEncodeTiled takes no empty dim, and strides that are positive
// multiples of 16 bytes below 2^40 bytes. (An encoding that fails would
// leave a descriptor the kernel cannot use, so the launcher asks first.)
inline bool tma_can_load(const void* ptr, int rows, int head_dim, int heads, int batch,
                         const QKVStrides& strides) {
  auto ok = [](int64_t extent, int64_t stride) {
    return extent == 1 || (stride > 0 && stride % 8 == 0 && stride < (int64_t(1) << 38));
  };
  return reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && rows > 0 && head_dim % 8 == 0 && heads > 0 &&
         batch > 0 && ok(rows, strides.row_stride) && ok(heads, strides.head_stride) &&
         ok(batch, strides.batch_stride);
}

// (rows, batch entries) of the TMA view of q (and dO, dQ), and of k / v.
__host__ __device__ inline int tma_q_rows(const FwdParams& p) {
  return p.cu_seqlens_q ? p.total_q : p.seqlen_q;
}
__host__ __device__ inline int tma_k_rows(const FwdParams& p) {
  return p.cu_seqlens_q ? p.total_k : p.seqlen_k;
}
__host__ __device__ inline int tma_batches(const FwdParams& p) {
  return p.cu_seqlens_q ? 1 : p.batch;
}

// The (rows, head dim) of one head of one sequence as TMA coordinates: its
// (head, batch) slice, moved to the sequence's first row when varlen; of a
// tensor shaped like q (tma_q_of) or like k and v (tma_kv_of).
template <typename Copy>
__device__ auto tma_q_of(const Copy& copy, const FwdParams& p, const BlockInfo& binfo, int head,
                         int batch) {
  // (rows, head_dim, head, batch)
  Tensor m = copy.get_tma_tensor(make_shape(tma_q_rows(p), p.head_dim, p.nheads, tma_batches(p)));
  return domain_offset(make_coord(int(binfo.q_row_begin), _0{}),
                       m(_, _, head, binfo.varlen ? 0 : batch));
}
template <typename Copy>
__device__ auto tma_kv_of(const Copy& copy, const FwdParams& p, const BlockInfo& binfo, int head_kv,
                          int batch) {
  // (rows, head_dim, head, batch)
  Tensor m = copy.get_tma_tensor(make_shape(tma_k_rows(p), p.head_dim, p.nheads_k, tma_batches(p)));
  return domain_offset(make_coord(int(binfo.k_row_begin), _0{}),
                       m(_, _, head_kv, binfo.varlen ? 0 : batch));
}

// One input's TMA load: (kRows, head dim) tiles of the TMA view of a tensor
// (tma_gmem_tensor) into SmemLayout. Copy is the descriptor's type; make()
// builds it on the host.
template <typename Element, typename SmemLayout, int kRows, int kHeadDim>
struct TmaTileLoad {
  using GmemTensor = decltype(tma_gmem_tensor<Element>(nullptr, 1, 1, 1, 1, QKVStrides{}));
  using Tile = Shape<Int<kRows>, Int<kHeadDim>>;
  using Copy = decltype(make_tma_copy(SM90_TMA_LOAD{}, std::declval<GmemTensor>(), SmemLayout{},
                                      Tile{}, _1{}));
  static Copy make(const void* ptr, int rows, int head_dim, int heads, int batches,
                   const QKVStrides& strides) {
    return make_tma_copy(SM90_TMA_LOAD{},
                         tma_gmem_tensor<Element>(ptr, rows, head_dim, heads, batches, strides),
                         SmemLayout{}, Tile{}, _1{});
  }
};

// The TMA descriptors of one launch, built on the host. A kernel parameter
// (__grid_constant__): TMA reads a descriptor from parameter memory.
template <typename Traits>
struct FwdSm90Tma {
  using LoadQ = TmaTileLoad<typename Traits::Element, typename Traits::SmemLayoutQ, Traits::kBlockM,
                            Traits::kHeadDim>;
  using LoadKV = TmaTileLoad<typename Traits::Element, typename Traits::SmemLayoutKVStage,
                             Traits::kBlockN, Traits::kHeadDim>;
  typename LoadQ::Copy q;
  typename LoadKV::Copy k;
  typename LoadKV::Copy v;

  static bool can_load(const FwdParams& p) {
    return tma_can_load(p.q_ptr, tma_q_rows(p), p.head_dim, p.nheads, tma_batches(p), p.q) &&
           tma_can_load(p.k_ptr, tma_k_rows(p), p.head_dim, p.nheads_k, tma_batches(p), p.k) &&
           tma_can_load(p.v_ptr, tma_k_rows(p), p.head_dim, p.nheads_k, tma_batches(p), p.v);
  }
  static FwdSm90Tma make(const FwdParams& p) {
    return {LoadQ::make(p.q_ptr, tma_q_rows(p), p.head_dim, p.nheads, tma_batches(p), p.q),
            LoadKV::make(p.k_ptr, tma_k_rows(p), p.head_dim, p.nheads_k, tma_batches(p), p.k),
            LoadKV::make(p.v_ptr, tma_k_rows(p), p.head_dim, p.nheads_k, tma_batches(p), p.v)};
  }
};

// The backward's descriptors: Q and dO tiles of (kBlockM, head dim) into one
// buffer of their stages, K and V of the block's (kBlockN, head dim).
template <typename Traits>
struct BwdSm90Tma {
  using LoadQ = TmaTileLoad<typename Traits::Element, typename Traits::SmemLayoutQdOBuffer,
                            Traits::kBlockM, Traits::kHeadDim>;
  using LoadKV = TmaTileLoad<typename Traits::Element, typename Traits::SmemLayoutKV,
                             Traits::kBlockN, Traits::kHeadDim>;
  typename LoadQ::Copy q;
  typename LoadQ::Copy dout;
  typename LoadKV::Copy k;
  typename LoadKV::Copy v;

  static bool can_load(const BwdParams& p) {
    return tma_can_load(p.q_ptr, tma_q_rows(p), p.head_dim, p.nheads, tma_batches(p), p.q) &&
           tma_can_load(p.do_ptr, tma_q_rows(p), p.head_dim, p.nheads, tma_batches(p), p.dout) &&
           tma_can_load(p.k_ptr, tma_k_rows(p), p.head_dim, p.nheads_k, tma_batches(p), p.k) &&
           tma_can_load(p.v_ptr, tma_k_rows(p), p.head_dim, p.nheads_k, tma_batches(p), p.v);
  }
  static BwdSm90Tma make(const BwdParams& p) {
    return {LoadQ::make(p.q_ptr, tma_q_rows(p), p.head_dim, p.nheads, tma_batches(p), p.q),
            LoadQ::make(p.do_ptr, tma_q_rows(p), p.head_dim, p.nheads, tma_batches(p), p.dout),
            LoadKV::make(p.k_ptr, tma_k_rows(p), p.head_dim, p.nheads_k, tma_batches(p), p.k),
            LoadKV::make(p.v_ptr, tma_k_rows(p), p.head_dim, p.nheads_k, tma_batches(p), p.v)};
  }
};

}  // namespace flash
