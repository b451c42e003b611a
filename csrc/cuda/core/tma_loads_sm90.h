// The TMA loads of the Hopper forward (fwd_kernel_sm90.h) and backward
// (bwd_kernel_sm90.h): how q / k / v (and dO) are described to TMA,
// which inputs can be, and the descriptors one launch passes to a kernel.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/cuda_host_adapter.hpp>

#include "cuda/core/block_info.h"
#include "cuda/core/paged_box_rows.h"
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

// The (rows, cols) of one head of one sequence as TMA coordinates: its
// (head, batch) slice, moved to the sequence's first row when varlen; of a
// tensor shaped like q (tma_q_of) or like k and v (tma_kv_of). cols is the
// tensor's own width, as its descriptor was made: head_dim for q and k,
// head_dim_v for v and dO.
template <typename Copy>
__device__ auto tma_q_of(const Copy& copy, const FwdParams& p, const BlockInfo& binfo, int head,
                         int batch, int cols) {
  // (rows, cols, head, batch)
  Tensor m = copy.get_tma_tensor(make_shape(tma_q_rows(p), cols, p.nheads, tma_batches(p)));
  return domain_offset(make_coord(int(binfo.q_row_begin), _0{}),
                       m(_, _, head, binfo.varlen ? 0 : batch));
}
template <typename Copy>
__device__ auto tma_kv_of(const Copy& copy, const FwdParams& p, const BlockInfo& binfo, int head_kv,
                          int batch, int cols) {
  // (rows, cols, head, batch)
  Tensor m = copy.get_tma_tensor(make_shape(tma_k_rows(p), cols, p.nheads_k, tma_batches(p)));
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

// Paged K / V of a varlen forward (FwdParams::block_table), read in place:
// the cache (num_pages, page_size, heads, head dim) as a 4-D TMA tensor
// (head dim, row in page, head, page), loaded in boxes of box_rows rows by
// kAtomCols columns, one swizzle atom wide, so that a box lands on whole
// swizzle atoms of a stage wherever its rows start (the producer thread,
// fwd_mainloop_sm90.h, issues one box per page piece of a key tile, at most
// kBlockN / kPagedBoxesMinRows of them). The box height is a runtime value of
// the descriptor (paged_box_rows.h).
// Pages of other sizes are gathered row by row by cp.async instead
// (FwdSm90Tma::gather_keys).

// Whether the paged cache can be read as above: the rules of tma_can_load
// for the 4-D view (which the row gather's 16-byte chunks need as well), and,
// by boxes, boxes of at least kPagedBoxesMinRows rows (plan_fwd's rule).
inline bool paged_tma_can_load(const void* ptr, int page_size, int head_dim, int heads,
                               int num_pages, const QKVStrides& strides, int block_n,
                               bool gather_keys) {
  static_assert(kPagedBoxesMinRows % kPagedTmaMinBoxRows == 0, "boxes of whole swizzle atoms");
  return (gather_keys || paged_tma_box_rows(page_size, block_n) >= kPagedBoxesMinRows) &&
         tma_can_load(ptr, page_size, head_dim, heads, num_pages, strides);
}

template <typename Element, int kAtomCols>
TmaDescriptor make_paged_tma_descriptor(const void* ptr, int page_size, int head_dim, int heads,
                                        int num_pages, const QKVStrides& strides, int box_rows) {
  static_assert(kAtomCols * sizeof(Element) == 128 || kAtomCols * sizeof(Element) == 64,
                "one 128- or 64-byte swizzle atom wide");
  auto usable = [](int64_t extent, int64_t stride) { return extent > 1 ? stride : int64_t(8); };
  constexpr cuuint64_t kBytes = sizeof(Element);
  cuuint64_t dims[4] = {cuuint64_t(head_dim), cuuint64_t(page_size), cuuint64_t(heads),
                        cuuint64_t(num_pages)};
  cuuint64_t byte_strides[3] = {cuuint64_t(usable(page_size, strides.row_stride)) * kBytes,
                                cuuint64_t(usable(heads, strides.head_stride)) * kBytes,
                                cuuint64_t(usable(num_pages, strides.batch_stride)) * kBytes};
  cuuint32_t box[4] = {cuuint32_t(kAtomCols), cuuint32_t(box_rows), 1, 1};
  cuuint32_t element_strides[4] = {1, 1, 1, 1};
  TmaDescriptor desc{};
  const CUresult result = cutlass::call_cuTensorMapEncodeTiled(
      &desc, TMA::to_CUtensorMapDataType<Element>(), 4, const_cast<void*>(ptr), dims, byte_strides,
      box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      kAtomCols * sizeof(Element) == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (result != CUDA_SUCCESS) {
    throw std::runtime_error(
        "flash_attn_cuda: cuTensorMapEncodeTiled failed for the paged cache (" +
        std::to_string(int(result)) + ")");
  }
  return desc;
}

// The TMA descriptors of one launch, built on the host. A kernel parameter
// (__grid_constant__): TMA reads a descriptor from parameter memory.
template <typename Traits>
struct FwdSm90Tma {
  using LoadQ = TmaTileLoad<typename Traits::Element, typename Traits::SmemLayoutQ, Traits::kBlockM,
                            Traits::kHeadDim>;
  using LoadK = TmaTileLoad<typename Traits::Element, typename Traits::SmemLayoutKStage,
                            Traits::kBlockN, Traits::kHeadDim>;
  using LoadV = TmaTileLoad<typename Traits::Element, typename Traits::SmemLayoutVStage,
                            Traits::kBlockN, Traits::kHeadDimV>;
  // The columns of one swizzle atom of the K / V tiles (Traits::SmemLayoutAtom).
  static constexpr int kAtomCols = decltype(size<1>(typename Traits::SmemLayoutAtom{}))::value;
  typename LoadQ::Copy q;
  typename LoadK::Copy k;
  typename LoadV::Copy v;
  // Paged keys only (else unused): the boxes' descriptors and height.
  TmaDescriptor k_paged;
  TmaDescriptor v_paged;
  int paged_box_rows;
  // Paged keys gathered row by row by Traits::kNGatherThreads threads of the
  // producer warpgroup (cp.async) instead of by boxes: plan_fwd's choice
  // (FwdPlan::keys), for pages that give boxes below kPagedBoxesMinRows.
  bool gather_keys;

  static bool can_load(const FwdParams& p, bool gather_keys) {
    if (!tma_can_load(p.q_ptr, tma_q_rows(p), p.head_dim, p.nheads, tma_batches(p), p.q)) {
      return false;
    }
    if (p.block_table != nullptr) {
      const int page_size = p.page_size.divisor;
      return paged_tma_can_load(p.k_ptr, page_size, p.head_dim, p.nheads_k, p.num_pages, p.k,
                                Traits::kBlockN, gather_keys) &&
             paged_tma_can_load(p.v_ptr, page_size, p.head_dim_v, p.nheads_k, p.num_pages, p.v,
                                Traits::kBlockN, gather_keys);
    }
    return tma_can_load(p.k_ptr, tma_k_rows(p), p.head_dim, p.nheads_k, tma_batches(p), p.k) &&
           tma_can_load(p.v_ptr, tma_k_rows(p), p.head_dim_v, p.nheads_k, tma_batches(p), p.v);
  }
  // v's descriptors have head_dim_v columns: V's tiles are kHeadDimV wide
  // (kHeadDim but for a specialised (d_qk, d_v) pair; paged, the producer
  // issues kHeadDimV / kAtomCols boxes per piece of rows), and TMA fills the
  // columns past the tensor's end with zeros (and counts their bytes), so
  // P V sees zero columns there.
  static FwdSm90Tma make(const FwdParams& p, bool gather_keys) {
    using Element = typename Traits::Element;
    const bool paged = p.block_table != nullptr;
    // Paged, the tile descriptors of k / v go unused: one page's view keeps
    // them valid.
    const int kv_rows = paged ? p.page_size.divisor : tma_k_rows(p);
    const int kv_batches = paged ? 1 : tma_batches(p);
    FwdSm90Tma tma{LoadQ::make(p.q_ptr, tma_q_rows(p), p.head_dim, p.nheads, tma_batches(p), p.q),
                   LoadK::make(p.k_ptr, kv_rows, p.head_dim, p.nheads_k, kv_batches, p.k),
                   LoadV::make(p.v_ptr, kv_rows, p.head_dim_v, p.nheads_k, kv_batches, p.v),
                   {},
                   {},
                   0,
                   paged && gather_keys};
    if (paged && !gather_keys) {
      const int page_size = p.page_size.divisor;
      tma.paged_box_rows = paged_tma_box_rows(page_size, Traits::kBlockN);
      tma.k_paged = make_paged_tma_descriptor<Element, kAtomCols>(
          p.k_ptr, page_size, p.head_dim, p.nheads_k, p.num_pages, p.k, tma.paged_box_rows);
      tma.v_paged = make_paged_tma_descriptor<Element, kAtomCols>(
          p.v_ptr, page_size, p.head_dim_v, p.nheads_k, p.num_pages, p.v, tma.paged_box_rows);
    }
    return tma;
  }
};

// The backward's descriptors: Q and dO tiles of (kBlockM, head dim) into one
// buffer of their stages, K and V of the block's (kBlockN, head dim); dO's
// and V's boxes are Traits::kHeadDimV wide (kHeadDim but for a specialised
// (d_qk, d_v) pair; then the same types as Q's and K's). dO and V have
// head_dim_v columns; TMA zero-fills the rest of their boxes, so
// dP = dO V^T sums zeros there.
template <typename Traits>
struct BwdSm90Tma {
  using LoadQ = TmaTileLoad<typename Traits::Element, typename Traits::SmemLayoutQdOBuffer,
                            Traits::kBlockM, Traits::kHeadDim>;
  using LoaddO = TmaTileLoad<typename Traits::Element, typename Traits::SmemLayoutdOBuffer,
                             Traits::kBlockM, Traits::kHeadDimV>;
  using LoadKV = TmaTileLoad<typename Traits::Element, typename Traits::SmemLayoutKV,
                             Traits::kBlockN, Traits::kHeadDim>;
  using LoadV = TmaTileLoad<typename Traits::Element, typename Traits::SmemLayoutV, Traits::kBlockN,
                            Traits::kHeadDimV>;
  typename LoadQ::Copy q;
  typename LoaddO::Copy dout;
  typename LoadKV::Copy k;
  typename LoadV::Copy v;

  static bool can_load(const BwdParams& p) {
    return tma_can_load(p.q_ptr, tma_q_rows(p), p.head_dim, p.nheads, tma_batches(p), p.q) &&
           tma_can_load(p.do_ptr, tma_q_rows(p), p.head_dim_v, p.nheads, tma_batches(p), p.dout) &&
           tma_can_load(p.k_ptr, tma_k_rows(p), p.head_dim, p.nheads_k, tma_batches(p), p.k) &&
           tma_can_load(p.v_ptr, tma_k_rows(p), p.head_dim_v, p.nheads_k, tma_batches(p), p.v);
  }
  static BwdSm90Tma make(const BwdParams& p) {
    return {LoadQ::make(p.q_ptr, tma_q_rows(p), p.head_dim, p.nheads, tma_batches(p), p.q),
            LoaddO::make(p.do_ptr, tma_q_rows(p), p.head_dim_v, p.nheads, tma_batches(p), p.dout),
            LoadKV::make(p.k_ptr, tma_k_rows(p), p.head_dim, p.nheads_k, tma_batches(p), p.k),
            LoadV::make(p.v_ptr, tma_k_rows(p), p.head_dim_v, p.nheads_k, tma_batches(p), p.v)};
  }
};

}  // namespace flash
