// The work items of the split-KV kernel and where each one's rows and keys
// are. An item is one query block of one (batch, kv head) and one split of its
// key blocks; a thread block runs one item or, launched persistently, several
// in turn (splitkv_kernel.h).
#pragma once

#include <cstdint>

#include "common/mask_rule.h"
#include "cuda/core/block_info.h"
#include "cuda/core/index_guards.h"
#include "cuda/core/int_divisor.h"
#include "cuda/core/params.h"

namespace flash {

// Rows of each split's partial results (num_splits > 1): one per (batch,
// head, query), or per (head, row of q) for a varlen q.
__forceinline__ __device__ int64_t splitkv_rows_per_split(const KvcacheParams& params) {
  return params.cu_seqlens_q != nullptr ? int64_t(params.nheads) * params.total_q
                                        : int64_t(params.batch) * params.nheads * params.seqlen_q;
}

// Packed row r of a (batch, kv head) item: query r / group of the group's
// query head r % group.
struct PackedRow {
  int query;
  int head_in_group;
};

__forceinline__ __device__ PackedRow unpack_row(int row, int group) {
  const int query = row / group;
  return {query, row - query * group};
}

// Where one batch entry's keys are: key j is cache position leftpad + j, which
// lives in row `in_page` of cache entry `page` (the batch entry itself for a
// contiguous cache, a block-table entry for a paged one). K and V share it.
struct CacheRows {
  const int* block_table_row;  // null: contiguous cache
  // The cache entry of this batch element (cache_batch_idx[b], else b):
  // contiguous, its row of the cache; paged, its row of the block table.
  int entry;
  int leftpad;
  IntDivisor page_size;
};

// Cache position `position` (leftpad included) of a batch entry: the cache
// entry (its own or a page) and the row in it. Offset of head h in a cache
// of strides s: entry * s.batch_stride + row * s.row_stride + h *
// s.head_stride. The split-KV kernel's tile copies locate their rows with
// their own arithmetic (one table read per page per tile).
struct CacheRowAt {
  int64_t entry;
  int64_t row;
};

// `position` must be below the cache length (guarded_kvcache_entry keeps every
// position a call derives there); the page read is guarded.
__forceinline__ __device__ CacheRowAt cache_row_at(const KvcacheParams& params, int batch,
                                                   const CacheRows& cache, int position) {
  if (cache.block_table_row == nullptr) return {cache.entry, position};
  int page_index, in_page;
  cache.page_size.divmod(position, page_index, in_page);
  return {guarded_page(params.index_errors, IndexOp::kKvcache, cache.entry, page_index,
                       cache.block_table_row[page_index], params.num_pages),
          in_page};
}

__forceinline__ __device__ int64_t cache_offset(const CacheRowAt& at, int head,
                                                const QKVStrides& strides) {
  return at.entry * strides.batch_stride + at.row * strides.row_stride +
         int64_t(head) * strides.head_stride;
}

struct SplitKvItem {
  int batch;
  int head_kv;
  int split;
  int row_begin;  // first packed row of the query block
  // Packed rows from row_begin to the end of the block's rows: >= 1, or 0 for
  // a query block past a varlen sequence's rows.
  int rows_left;
  int query_first;
  int query_last;  // queries of the block's first and last packed rows
  // The batch entry's query rows: q / out rows q_row0 .. q_row0 + seqlen_q
  // (params.seqlen_q from row 0 unless q is varlen). Windows align to them.
  int seqlen_q;
  int q_row0;
  int seqlen_k;  // keys of the batch entry after the append
  CacheRows cache;
  // Rotary position of the first new key and of query 0 (rotary_seqlens[b],
  // else the cache length before the append).
  int rotary_start;
  // Key blocks [n_block_min, n_block_max): the split's share, cut to the ones
  // some row of the block can see. Empty when none is left.
  int n_block_min;
  int n_block_max;
  // Keys [append_key_begin, append_key_end) are new rows (from new_k / new_v)
  // that this item writes into the cache (params.append_in_attention): the
  // first query block of each split writes those in the split's key blocks,
  // seen by some query or not, so that each is written once.
  int append_key_begin;
  int append_key_end;

  __device__ bool has_keys() const { return n_block_max > n_block_min; }
};

// What an item reads from global memory besides the tensors: its batch
// entry's key count, left padding and cache entry. A block that runs several
// items loads these one item ahead (splitkv_kernel.h): read when
// the item starts, they would stall the block's stream of copies once per
// item for a load's latency, which under a full memory system is long
// (PERF_LOG 2026-11-23 f3875b4).
struct SplitKvItemInputs {
  int cache_seqlen;  // cache_seqlens[batch] (0 without cache_seqlens)
  int leftpad;
  int entry;         // the batch entry's cache entry (or block-table row)
  int rotary_start;  // rotary_seqlens[batch] (0 without rotary_seqlens)
};

// Items are numbered (batch, kv head) fastest, then the query block, then the
// split: blocks launched side by side read the neighbouring kv heads of one
// batch entry, whose keys share each cache row's span on flash-attn's
// (batch, seqlen, kv head, head dim) layout. Any item number maps to a valid
// batch entry, so a block may load the inputs of the item after its last.
__forceinline__ __device__ int splitkv_item_batch(const KvcacheParams& params, int item) {
  return (item % (params.batch * params.nheads_k)) / params.nheads_k;
}

// The loads only: the values are first used when the item starts, so that
// the loads stay in flight until then.
__forceinline__ __device__ SplitKvItemInputs splitkv_item_inputs(const KvcacheParams& params,
                                                                 int item) {
  const int batch = splitkv_item_batch(params, item);
  SplitKvItemInputs inputs{0, 0, batch, 0};
  if (params.cache_seqlens) inputs.cache_seqlen = params.cache_seqlens[batch];
  if (params.cache_leftpad) inputs.leftpad = params.cache_leftpad[batch];
  if (params.cache_batch_idx) inputs.entry = params.cache_batch_idx[batch];
  if (params.rotary_seqlens) inputs.rotary_start = params.rotary_seqlens[batch];
  return inputs;
}

// Split s gets key blocks [s * n / splits, (s + 1) * n / splits): shares
// differ by at most one block, and any split count is honoured as given.
// kVarlen false: compiled for fixed-length calls only (the persistent grid,
// which plan_decode never gives a varlen call: its items' rows would stay
// in registers across items, and at head dim 256 they spilled).
template <int kBlockM, int kBlockN, bool kVarlen = true>
__forceinline__ __device__ SplitKvItem splitkv_item(const KvcacheParams& params, int item,
                                                    int num_m_blocks,
                                                    const SplitKvItemInputs& inputs) {
  SplitKvItem it;
  const int batch_heads = params.batch * params.nheads_k;
  const int batch_head = item % batch_heads;
  const int m_and_split = item / batch_heads;
  const int m_block = m_and_split % num_m_blocks;
  it.split = m_and_split / num_m_blocks;
  it.batch = batch_head / params.nheads_k;
  it.head_kv = batch_head - it.batch * params.nheads_k;

  // Guarded (index_guards.h): every row, page and rotary position below
  // stays inside its tensor whatever the index tensors hold. The varlen
  // offsets are read here, not one item ahead: the fixed-length calls, which
  // decode runs, keep their item inputs as they are.
  KvcacheEntryIndices entry;
  int new_keys;
  if constexpr (!kVarlen) {
    it.seqlen_q = params.seqlen_q;
    it.q_row0 = 0;
    entry = guarded_kvcache_entry(
        params, it.batch, {inputs.cache_seqlen, inputs.leftpad, inputs.entry, inputs.rotary_start});
    new_keys = params.seqlen_new;
  } else if (params.cu_seqlens_k != nullptr) {
    // varlen_fwd's split run (ops/fwd_splitkv.cpp): the varlen forward's
    // sequences as BlockInfo reads them (its guards and messages), keys at
    // positions k_row_begin + j of the packed keys (batch stride 0), or of
    // the sequence's row of pages; nothing to append.
    const BlockInfo info(params, it.batch);
    it.seqlen_q = info.seqlen_q;
    it.q_row0 = static_cast<int>(info.q_row_begin);
    const int key0 = static_cast<int>(info.k_row_begin);
    entry = {key0 + info.seqlen_k, key0, it.batch, 0};
    new_keys = 0;
  } else {
    const KvcacheSequence rows = guarded_kvcache_sequence(params, it.batch);
    it.seqlen_q = rows.q.length;
    it.q_row0 = rows.q.begin;
    entry = guarded_kvcache_entry(
        params, it.batch, {inputs.cache_seqlen, inputs.leftpad, inputs.entry, inputs.rotary_start},
        {rows.new_keys.length, it.seqlen_q});
    new_keys = rows.new_keys.length;
  }

  const int group = params.nheads / params.nheads_k;
  const int rows_total = it.seqlen_q * group;
  it.row_begin = m_block * kBlockM;
  // A varlen sequence may have fewer query blocks than the grid's
  // (max_seqlen_q): an item past its rows has none, and no keys below.
  it.rows_left = max(rows_total - it.row_begin, 0);
  const int row_end = it.row_begin + (it.rows_left < kBlockM ? it.rows_left : kBlockM);
  it.query_first = it.row_begin / group;
  it.query_last = max(row_end - 1, it.row_begin) / group;

  const int cache_end = entry.cache_seqlen + new_keys;
  it.seqlen_k = cache_end - entry.leftpad;
  it.cache = {params.block_table
                  ? params.block_table + int64_t(entry.entry) * params.block_table_batch_stride
                  : nullptr,
              entry.entry, entry.leftpad, params.page_size};
  it.rotary_start = entry.rotary_start;

  const KeyRange key_range =
      visible_key_range(it.query_first, it.query_last + 1, it.seqlen_q, it.seqlen_k,
                        params.window_left, params.window_right);
  const int num_n_blocks = (it.seqlen_k + kBlockN - 1) / kBlockN;
  const int split_begin = int(int64_t(it.split) * num_n_blocks / params.num_splits);
  const int split_end = int(int64_t(it.split + 1) * num_n_blocks / params.num_splits);
  it.n_block_min = max(key_range.begin / kBlockN, split_begin);
  it.n_block_max =
      it.rows_left > 0 ? min((key_range.end + kBlockN - 1) / kBlockN, split_end) : it.n_block_min;
  const bool writes_new_rows = params.append_in_attention && m_block == 0;
  it.append_key_begin =
      writes_new_rows ? max(it.seqlen_k - params.seqlen_new, split_begin * kBlockN) : 0;
  it.append_key_end = writes_new_rows ? min(it.seqlen_k, split_end * kBlockN) : 0;
  return it;
}

// An e4m3 cache's descale of an item's (batch entry, kv head)
// (KvcacheParams::k_descale_ptr / v_descale_ptr; null: 1).
__forceinline__ __device__ float kvcache_descale(const float* descale, DescaleStrides strides,
                                                 const SplitKvItem& it) {
  return descale == nullptr
             ? 1.f
             : descale[it.batch * strides.batch_stride + it.head_kv * strides.head_stride];
}

}  // namespace flash
