// Copies of K / V rows that live at unrelated addresses, and where the rows
// of a paged sequence live: the split-KV kernel's cache reads
// (splitkv_producer.h) and the varlen forward's paged keys, which the
// SM80-design kernel (fwd_kernel_sm80.h) and the Hopper producer
// (fwd_mainloop_sm90.h) read in place, without a gathered copy.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "cuda/core/params.h"

namespace flash {

// cp.async of one 16-byte chunk (to a shared-memory address or pointer);
// src_size 0 zero-fills the destination
// without reading the source, so masked-off rows cost no memory traffic and
// gmem_src may then point past the tensor (at the row or column it would
// have read), which spares a select per chunk.
__forceinline__ __device__ void cp_async_16_or_zero(uint32_t smem_dst, const void* gmem_src,
                                                    bool valid) {
  const int src_size = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_dst), "l"(gmem_src),
               "r"(src_size));
}
__forceinline__ __device__ void cp_async_16_or_zero(void* smem_dst, const void* gmem_src,
                                                    bool valid) {
  cp_async_16_or_zero(static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst)), gmem_src, valid);
}

// The same for 8 bytes (an e4m3 cache's 8 elements). cp.async of 8 bytes
// has no .cg form: it goes through L1 (.ca).
__forceinline__ __device__ void cp_async_8_or_zero(void* smem_dst, const void* gmem_src,
                                                   bool valid) {
  const int src_size = valid ? 8 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst))),
               "l"(gmem_src), "r"(src_size));
}

// The same for 4 bytes (a pair of Q's 16-bit columns put in its e4m3-fragment
// slot, SplitKvTileLoader::load_q).
__forceinline__ __device__ void cp_async_4_or_zero(void* smem_dst, const void* gmem_src,
                                                   bool valid) {
  const int src_size = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst))),
               "l"(gmem_src), "r"(src_size));
}

// Global -> shared copy of a tile whose rows live at unrelated addresses:
// row_ptr(tile_row) gives the first element of a row. Rows at or past
// num_rows and columns past head_dim are zero-filled.
template <typename TensorDst, typename TensorCoord, typename RowPtr, typename Element>
__forceinline__ __device__ void copy_rows_async(TensorDst& dst, const TensorCoord& coord,
                                                int num_rows, int head_dim,
                                                const Element* any_address, RowPtr row_ptr) {
  CUTE_UNROLL
  for (int m = 0; m < cute::size<1>(dst); ++m) {
    const int row = cute::get<0>(coord(0, m, 0));
    const bool row_ok = row < num_rows;
    const Element* src_row = row_ok ? row_ptr(row) : any_address;
    CUTE_UNROLL
    for (int k = 0; k < cute::size<2>(dst); ++k) {
      const int col = cute::get<1>(coord(0, m, k));
      const bool ok = row_ok && col < head_dim;
      cp_async_16_or_zero(&dst(0, m, k), ok ? src_row + col : any_address, ok);
    }
  }
}

// Where the table entry of page page_index of sequence batch lives, and
// that entry clamped into the pool. Apart so that a caller can prefetch the
// entry (the Hopper producer, fwd_mainloop_sm90.h) and clamp it only where
// it issues the copy: a thread waits on a load's result at its first use.
__forceinline__ __device__ const int* paged_table_address(const FwdParams& params, int batch,
                                                          int page_index) {
  return params.block_table + int64_t(batch) * params.block_table_batch_stride + page_index;
}
__forceinline__ __device__ int clamp_paged_entry(const FwdParams& params, int page) {
  if (static_cast<unsigned>(page) >= static_cast<unsigned>(params.num_pages)) {
    page = page < 0 ? 0 : params.num_pages - 1;
  }
  return page;
}

// Paged keys of a varlen forward (FwdParams::block_table): sequence `batch`'s
// key j is row j % page_size of page block_table[batch][j / page_size].
// Callers only locate keys below the sequence's seqlen_k (BlockInfo). A page
// entry outside the pool is clamped into it, without a report here:
// check_paged_keys (fwd/paged_keys_check.h) reports it before the kernel
// runs. Everything is read from the params at each use, not held: kernel
// parameters are operands in place, and the Hopper producer that calls this
// runs on 24 registers.
__forceinline__ __device__ void locate_paged_key(const FwdParams& params, int batch, int key,
                                                 int& page, int& row_in_page) {
  int page_index;
  params.page_size.divmod(key, page_index, row_in_page);
  // Read-only path: neighbouring keys' lookups hit the same cached line.
  page = clamp_paged_entry(params, __ldg(paged_table_address(params, batch, page_index)));
}

// Element offset of that key from its head's first element (strides of the
// cache: batch_stride is the page stride).
__forceinline__ __device__ int64_t paged_key_offset(const FwdParams& params, int batch, int key,
                                                    const QKVStrides& strides) {
  int page, row_in_page;
  locate_paged_key(params, batch, key, page, row_in_page);
  return int64_t(page) * strides.batch_stride + int64_t(row_in_page) * strides.row_stride;
}

}  // namespace flash
