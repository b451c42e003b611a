// The kernel of fwd_kvcache's append / rotary step, which runs before the
// attention when the attention kernel does not do it itself
// (params.append_in_attention): the new keys / values are written into the
// cache at positions cache_seqlens[b] + i (through the block table row
// cache_batch_idx[b], else b, when paged), the keys rotated when rotary tables
// are given (at rotary_seqlens[b] + i, else cache_seqlens[b] + i), and q
// rotated into params.q_ptr. Rotation happens in fp32 with one rounding and no fused
// multiply-add (rotary.h), so the cache holds the same bits as the CPU path.
// Its launcher is launch/append_rotary_launch.cu.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/core/dependent_grid.h"
#include "cuda/core/fp8_convert.h"
#include "cuda/core/params.h"
#include "cuda/decode/rotary.h"
#include "cuda/decode/splitkv_work_item.h"

namespace flash {

constexpr int kAppendRotaryThreads = 256;

// The kernel's helpers, which nothing else calls.
namespace append_rotary {

constexpr int kElemsPerThread = kRotaryChunkElems;

// Copies (rotating when rotary_dim > 0) 8 consecutive elements of one head
// vector.
template <typename T>
__device__ void copy_chunk(const T* src, T* dst, int d0, const RotaryRows<T>& rotary,
                           int rotary_dim, bool interleaved) {
  *reinterpret_cast<uint4*>(dst + d0) =
      rotary_chunk(src, d0, rotary.cos_row, rotary.sin_row, rotary_dim, interleaved);
}

// Batch entry b's cache length, left padding, cache entry and rotary start,
// guarded (index_guards.h) for its rows: the positions written and read
// below stay in the cache and the rotary tables.
inline __device__ KvcacheEntryIndices entry_of(const KvcacheParams& p, int b,
                                               const KvcacheSequence& rows) {
  return guarded_kvcache_entry(
      p, b,
      {p.cache_seqlens ? p.cache_seqlens[b] : p.seqlen_k, p.cache_leftpad ? p.cache_leftpad[b] : 0,
       p.cache_batch_idx ? p.cache_batch_idx[b] : b, p.rotary_seqlens ? p.rotary_seqlens[b] : 0},
      {rows.new_keys.length, rows.q.length});
}

// Row `row` of a (batch, rows_per_batch) tensor, or of a varlen one (its
// offsets `cu_seqlens` non-null): the batch entry b, the row's index i in it
// (valid false: a varlen row outside every sequence), and b's guarded rows.
struct RowOfSequence {
  int b;
  int i;
  bool valid;
  KvcacheSequence rows;
};

inline __device__ RowOfSequence row_of_sequence(const KvcacheParams& p, const int* cu_seqlens,
                                                int rows_per_batch, int64_t row, bool of_q) {
  RowOfSequence r;
  if (cu_seqlens == nullptr) {
    r.b = static_cast<int>(row / rows_per_batch);
    r.i = static_cast<int>(row - int64_t(r.b) * rows_per_batch);
    r.valid = true;
    r.rows = guarded_kvcache_sequence(p, r.b);
    return r;
  }
  r.b = sequence_of_row(cu_seqlens, p.batch, static_cast<int>(row));
  r.valid = r.b >= 0;
  r.b = max(r.b, 0);
  r.rows = guarded_kvcache_sequence(p, r.b);
  const SequenceRows& mine = of_q ? r.rows.q : r.rows.new_keys;
  r.i = static_cast<int>(row) - mine.begin;
  r.valid = r.valid && r.i >= 0 && r.i < mine.length;
  return r;
}

// Chunk `index` of the appended (row, kv head) vectors of k and v: rows of
// (batch, seqlen_new), or of the varlen (total_k_new) new keys. An e4m3
// cache (kFp8Cache) stores each chunk quantised with the batch entry's and
// kv head's descale (quantize_e4m3x8), after the rotation in q's dtype.
template <typename T, bool kFp8Cache>
__device__ void append_chunk(const KvcacheParams& p, int64_t index) {
  const int chunks = p.head_dim / kElemsPerThread;
  const int chunk = static_cast<int>(index % chunks);
  const int h = static_cast<int>((index / chunks) % p.nheads_k);
  const int64_t row = index / (int64_t(chunks) * p.nheads_k);
  const RowOfSequence seq = row_of_sequence(p, p.cu_seqlens_k_new, p.seqlen_new, row, false);
  if (!seq.valid) return;  // a row of k / v outside every sequence is not appended
  const int b = seq.b, i = seq.i;
  const int64_t src_batch = p.cu_seqlens_k_new != nullptr ? 0 : b;
  const int64_t src_row = p.cu_seqlens_k_new != nullptr ? row : i;
  const KvcacheEntryIndices entry = entry_of(p, b, seq.rows);
  const int pos = entry.cache_seqlen + i;

  const CacheRows cache{
      p.block_table ? p.block_table + entry.entry * p.block_table_batch_stride : nullptr,
      entry.entry, 0, p.page_size};
  const CacheRowAt at = cache_row_at(p, b, cache, pos);
  const int64_t k_dst = cache_offset(at, h, p.k);
  const int64_t v_dst = cache_offset(at, h, p.v);
  const T* k_src = static_cast<const T*>(p.new_k_ptr) + src_batch * p.new_k.batch_stride +
                   src_row * p.new_k.row_stride + h * p.new_k.head_stride;
  const T* v_src = static_cast<const T*>(p.new_v_ptr) + src_batch * p.new_v.batch_stride +
                   src_row * p.new_v.row_stride + h * p.new_v.head_stride;
  const RotaryRows<T> rotary =
      rotary_rows<T>(p.rotary_cos_ptr, p.rotary_sin_ptr, p.rotary_dim, entry.rotary_start + i);
  const int d0 = chunk * kElemsPerThread;
  if constexpr (kFp8Cache) {
    uint8_t* k_cache = const_cast<uint8_t*>(static_cast<const uint8_t*>(p.k_ptr)) + k_dst;
    uint8_t* v_cache = const_cast<uint8_t*>(static_cast<const uint8_t*>(p.v_ptr)) + v_dst;
    const float k_descale =
        p.k_descale_ptr
            ? p.k_descale_ptr[b * p.k_descale.batch_stride + h * p.k_descale.head_stride]
            : 1.f;
    const float v_descale =
        p.v_descale_ptr
            ? p.v_descale_ptr[b * p.v_descale.batch_stride + h * p.v_descale.head_stride]
            : 1.f;
    const uint4 k_chunk =
        rotary_chunk(k_src, d0, rotary.cos_row, rotary.sin_row, p.rotary_dim, p.rotary_interleaved);
    *reinterpret_cast<uint2*>(k_cache + d0) = quantize_e4m3x8<T>(k_chunk, k_descale);
    if (d0 < p.head_dim_v) {
      const uint4 v_chunk = rotary_chunk(v_src, d0, rotary.cos_row, rotary.sin_row, 0, false);
      *reinterpret_cast<uint2*>(v_cache + d0) = quantize_e4m3x8<T>(v_chunk, v_descale);
    }
  } else {
    T* k_cache = const_cast<T*>(static_cast<const T*>(p.k_ptr)) + k_dst;
    T* v_cache = const_cast<T*>(static_cast<const T*>(p.v_ptr)) + v_dst;
    copy_chunk(k_src, k_cache, d0, rotary, p.rotary_dim, p.rotary_interleaved);
    // v has head_dim_v columns of the head_dim the chunks walk.
    if (d0 < p.head_dim_v) copy_chunk(v_src, v_cache, d0, rotary, 0, false);
  }
}

// Chunk `index` of the (query row, head) vectors of q: rows of (batch,
// seqlen_q), or of the varlen (total_q) q. A varlen row outside every
// sequence is never attended: it is left unwritten.
template <typename T>
__device__ void rotate_q_chunk(const KvcacheParams& p, int64_t index) {
  const int chunks = p.head_dim / kElemsPerThread;
  const int chunk = static_cast<int>(index % chunks);
  const int h = static_cast<int>((index / chunks) % p.nheads);
  const int64_t row = index / (int64_t(chunks) * p.nheads);
  const RowOfSequence seq = row_of_sequence(p, p.cu_seqlens_q, p.seqlen_q, row, true);
  if (!seq.valid) return;
  const int b = seq.b, i = seq.i;
  const int64_t q_batch = p.cu_seqlens_q != nullptr ? 0 : b;
  const int64_t q_row = p.cu_seqlens_q != nullptr ? row : i;
  const int pos = entry_of(p, b, seq.rows).rotary_start + (p.rotary_q_per_row ? i : 0);
  const T* src = static_cast<const T*>(p.q_unrotated_ptr) + q_batch * p.q_unrotated.batch_stride +
                 q_row * p.q_unrotated.row_stride + h * p.q_unrotated.head_stride;
  T* dst = const_cast<T*>(static_cast<const T*>(p.q_ptr)) + q_batch * p.q.batch_stride +
           q_row * p.q.row_stride + h * p.q.head_stride;
  copy_chunk(src, dst, chunk * kElemsPerThread,
             rotary_rows<T>(p.rotary_cos_ptr, p.rotary_sin_ptr, p.rotary_dim, pos), p.rotary_dim,
             p.rotary_interleaved);
}

// One thread per 8-element chunk: the appended k / v chunks first, then the
// chunks of q to rotate. Both jobs share one launch because in a decode step
// each kernel costs a few microseconds of launch and dependent loads, more
// than its copies (PERF_LOG 2026-11-23 ae57aaa).
}  // namespace append_rotary

template <typename T, bool kFp8Cache = false>
__global__ void __launch_bounds__(kAppendRotaryThreads)
    append_rotary_kernel(const KvcacheParams p, int64_t append_chunks, int64_t all_chunks) {
  // Launched as a dependent grid (params.programmatic_launch): q and the new
  // k / v may come from the kernel just before this one. The attention kernel
  // after it is a dependent grid too, scheduled when this grid's blocks exit.
  // Letting it in earlier (griddepcontrol.launch_dependents at the start
  // here) made some steps slower, for reasons not pinned down (PERF_LOG
  // 2026-11-23 ae57aaa).
  wait_for_preceding_grid();
  const int64_t index = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index < append_chunks) {
    append_rotary::append_chunk<T, kFp8Cache>(p, index);
  } else if (index < all_chunks) {
    append_rotary::rotate_q_chunk<T>(p, index - append_chunks);
  }
}

}  // namespace flash
