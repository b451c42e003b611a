// Paged K/V for the varlen forward: the rows a varlen batch reaches through a
// block table, gathered into packed (rows, nheads_k, head_dim) tensors laid
// out like unpaged varlen keys, which the varlen forward kernel then reads.
// The split-KV kernel reads pages in place; the prefill-shaped varlen kernel
// does not, so this costs one extra read and write of the keys and values
// used (and their memory) per call.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "common/index_error.h"
#include "cuda/core/int_divisor.h"

namespace flash {

struct PagedGatherParams {
  const void* k_cache;  // (num_blocks, page_size, nheads_k, head_dim), 16-bit elements
  const void* v_cache;
  int64_t k_block_stride, k_row_stride, k_head_stride;  // in elements
  int64_t v_block_stride, v_row_stride, v_head_stride;
  void* k_packed;  // (rows, nheads_k, head_dim), contiguous
  void* v_packed;
  // Packed row offsets (batch + 1, from 0) of the sequences, already cut to
  // max_seqlen_k; sequence b's key j is page block_table[b][j / page_size].
  // Only these rows are copied: with seqused_k, each sequence's used keys.
  const int* cu_seqlens_packed;
  const int* block_table;
  int64_t block_table_batch_stride;
  IntDivisor page_size;
  int batch, max_seqlen_k, num_blocks, nheads_k, head_dim;
  // The caller's cu_seqlens_k, max_seqlen_k and block-table width, checked
  // here (check_cu_seqlens_host's and check_block_table_host's rules) since
  // the forward kernel only sees the packed offsets.
  const int* cu_seqlens_k;
  int max_seqlen_k_given;
  int max_blocks_per_seq;
  // Null, or int32 (batch): the keys of each sequence (then cu_seqlens_k
  // only has its own rules checked), in [0, min(max_seqlen_k_given,
  // max_blocks_per_seq * page_size)].
  const int* seqused_k;
  IndexErrorSink index_errors;
};

// Launch-only: no host synchronisation. A bad cu_seqlens_k value or table
// entry is recorded in index_errors and clamped (index_guards.h): a wrong
// answer for that sequence and a reported error, never an out-of-bounds read.
void launch_gather_paged_rows(const PagedGatherParams& params, cudaStream_t stream);

}  // namespace flash
