// The guards on every index a kernel derives from a value inside an index
// tensor (cu_seqlens, seqused_k, seqused_q, cache_seqlens, cache_leftpad,
// cache_batch_idx, block_table, rotary_seqlens). Each one checks the value against an extent
// the host knows (rows of the packed tensors, a sequence's keys, the cache
// length, the batch of the cache, the pages in the pool, the rows of the
// rotary tables), and where the value is bad records it
// (csrc/common/index_error.h) and clamps it into that extent:
// a bad value gives an undefined result for its own sequence and a reported
// error, never an access outside the tensors. The rules and their order are
// those of the CPU checks (csrc/api/checks.cpp, kvcache_checks.cpp).
// docs/memory_safety.md states the contract.
//
// The common case costs a few integer compares per sequence (per page for the
// block table); the reporting and clamping are out of line.
#pragma once

#include <cstdint>

#include "common/index_error.h"
#include "cuda/core/params.h"

namespace flash {

// Rows [begin, begin + length) of one sequence in a packed (rows, ...) tensor.
struct SequenceRows {
  int begin;
  int length;
};

__device__ __forceinline__ SequenceRows report_and_clamp_sequence(const IndexErrorSink& sink,
                                                                  IndexArg arg, int seq, int begin,
                                                                  int end, int rows, int max_seqlen,
                                                                  IndexOp op) {
  // The CPU check's order: the first offset's sign, then each sequence's
  // order and length, then the last offset against the rows.
  if (begin < 0) {
    report_index_error(sink, IndexRule::kNegativeOffset, arg, op, seq, 0, begin, 0, 0);
  } else if (end < begin) {
    report_index_error(sink, IndexRule::kDecreasing, arg, op, seq, 0, begin, end, 0);
  } else if (end - begin > max_seqlen) {
    report_index_error(sink, IndexRule::kLongerThanMax, arg, op, seq, 0, end - begin, max_seqlen,
                       0);
  } else {
    report_index_error(sink, IndexRule::kPastRows, arg, op, seq + 1, 0, end, rows, 0);
  }
  const int first = min(max(begin, 0), rows);
  const int last = min(max(end, first), first + min(rows - first, max_seqlen));
  return {first, last - first};
}

// Sequence `seq` of a varlen batch from its cu_seqlens: within the packed
// tensor's rows and no longer than max_seqlen (the grid covers that many).
// op: the op family the message names.
__forceinline__ __device__ SequenceRows guarded_sequence_rows(const int* cu_seqlens, int seq,
                                                              int rows, int max_seqlen,
                                                              IndexArg arg,
                                                              const IndexErrorSink& sink,
                                                              IndexOp op = IndexOp::kVarlen) {
  const int begin = cu_seqlens[seq];
  const int end = cu_seqlens[seq + 1];
  // Short-circuit order keeps end - begin from overflowing.
  if (begin >= 0 && end >= begin && end - begin <= max_seqlen && end <= rows) {
    return {begin, end - begin};
  }
  return report_and_clamp_sequence(sink, arg, seq, begin, end, rows, max_seqlen, op);
}

// The sequence whose rows hold packed row `row` of a varlen tensor: the last
// seq in [0, batch) with cu_seqlens[seq] <= row, or -1 (before the first
// sequence). Bad offsets give some seq; the caller checks `row` against that
// sequence's guarded rows.
__forceinline__ __device__ int sequence_of_row(const int* cu_seqlens, int batch, int row) {
  int lo = 0, hi = batch - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (cu_seqlens[mid] <= row) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return cu_seqlens[lo] <= row ? lo : -1;
}

// Batch entry `seq`'s rows of a fwd_kvcache call: its query rows (all
// seqlen_q of its own, or its share of a varlen q) and its new keys (the
// seqlen_new each, or its share of varlen new keys), guarded. Varlen new
// keys have no length bound of their own: the cache's is checked with
// cache_seqlens (guarded_kvcache_entry).
struct KvcacheSequence {
  SequenceRows q;
  SequenceRows new_keys;
};

__forceinline__ __device__ KvcacheSequence guarded_kvcache_sequence(const KvcacheParams& params,
                                                                    int seq) {
  KvcacheSequence rows{{0, params.seqlen_q}, {0, params.seqlen_new}};
  if (params.cu_seqlens_q != nullptr) {
    rows.q = guarded_sequence_rows(params.cu_seqlens_q, seq, params.total_q, params.seqlen_q,
                                   IndexArg::kCuSeqlensQ, params.index_errors, IndexOp::kKvcache);
  }
  if (params.cu_seqlens_k_new != nullptr) {
    rows.new_keys =
        guarded_sequence_rows(params.cu_seqlens_k_new, seq, params.seqlen_new, 0x7fffffff,
                              IndexArg::kCuSeqlensKNew, params.index_errors, IndexOp::kKvcache);
  }
  return rows;
}

__device__ __forceinline__ int report_and_clamp_seqused(const IndexErrorSink& sink, IndexArg arg,
                                                        int seq, int used, int bound, bool paged) {
  report_index_error(sink, IndexRule::kSeqused, arg, IndexOp::kVarlen, seq, paged ? 1 : 0, used,
                     bound, 0);
  return min(max(used, 0), bound);
}

// seqused_k[seq]: the keys sequence `seq` uses, in [0, bound] (the keys its
// cu_seqlens_k rows hold, already guarded; with paged keys the rows its
// block_table row addresses, cut to max_seqlen_k).
__forceinline__ __device__ int guarded_seqused_k(const int* seqused_k, int seq, int bound,
                                                 bool paged, const IndexErrorSink& sink) {
  const int used = seqused_k[seq];
  if (used >= 0 && used <= bound) return used;
  return report_and_clamp_seqused(sink, IndexArg::kSequsedK, seq, used, bound, paged);
}

// seqused_q[seq]: the query rows sequence `seq` uses, in [0, bound] (the rows
// its cu_seqlens_q entries give it, already guarded).
__forceinline__ __device__ int guarded_seqused_q(const int* seqused_q, int seq, int bound,
                                                 const IndexErrorSink& sink) {
  const int used = seqused_q[seq];
  if (used >= 0 && used <= bound) return used;
  return report_and_clamp_seqused(sink, IndexArg::kSequsedQ, seq, used, bound, /*paged=*/false);
}

// One batch entry's values of a fwd_kvcache call: the cache length before
// the append, the left padding, the cache entry (its row of a contiguous
// cache, or of the block table when paged) and the rotary position of its
// first new key (rotary_seqlens[b], else the cache length).
struct KvcacheEntryIndices {
  int cache_seqlen;
  int leftpad;
  int entry;
  int rotary_start;
};

// The rows one batch entry appends and attends with: params.seqlen_new and
// params.seqlen_q, or its own with the varlen form (guarded_kvcache_sequence).
struct KvcacheRowCounts {
  int seqlen_new;
  int seqlen_q;
};

// The largest rotary start whose new keys' and query rows' positions all
// fit the rotary tables.
__forceinline__ __device__ int kvcache_max_rotary_start(const KvcacheParams& params,
                                                        KvcacheRowCounts counts) {
  const int query_rows = params.rotary_q_per_row ? counts.seqlen_q : 1;
  return max(params.seqlen_rotary - max(counts.seqlen_new, query_rows), 0);
}

// The largest cache_seqlens value whose rows and appended keys fit, and,
// when it is the rotary start too (no rotary_seqlens), whose rotary positions
// fit (check_kvcache_contents_host's rules).
__forceinline__ __device__ int kvcache_max_cache_seqlen(const KvcacheParams& params,
                                                        KvcacheRowCounts counts) {
  int max_end = max(params.seqlen_k - counts.seqlen_new, 0);
  if (params.rotary_dim > 0 && params.rotary_seqlens == nullptr) {
    max_end = min(max_end, kvcache_max_rotary_start(params, counts));
  }
  return max_end;
}

__device__ __forceinline__ KvcacheEntryIndices report_and_clamp_kvcache(const KvcacheParams& params,
                                                                        int seq,
                                                                        KvcacheEntryIndices raw,
                                                                        KvcacheRowCounts counts) {
  const IndexErrorSink& sink = params.index_errors;
  const IndexOp op = IndexOp::kKvcache;
  const int64_t paged = params.block_table != nullptr ? 1 : 0;
  const int64_t from_rotary_seqlens = params.rotary_seqlens != nullptr ? 1 : 0;
  const int capacity = params.seqlen_k;
  const int64_t end = raw.cache_seqlen;
  if (end < 0 || end > capacity) {
    report_index_error(sink, IndexRule::kCacheSeqlen, IndexArg::kCacheSeqlens, op, seq, paged, end,
                       capacity, 0);
  } else if (end + counts.seqlen_new > capacity) {
    report_index_error(sink, IndexRule::kAppendPastCache, IndexArg::kCacheSeqlens, op, seq, paged,
                       end, capacity, counts.seqlen_new);
  } else if (raw.leftpad < 0 || raw.leftpad > end) {
    report_index_error(sink, IndexRule::kLeftpad, IndexArg::kCacheLeftpad, op, seq, 0, raw.leftpad,
                       end, 0);
  } else if (raw.entry < 0 || raw.entry >= params.batch_cache) {
    report_index_error(sink, IndexRule::kCacheBatchIdx, IndexArg::kCacheBatchIdx, op, seq, paged,
                       raw.entry, params.batch_cache, 0);
  } else if (raw.rotary_start < 0) {
    report_index_error(sink, IndexRule::kRotarySeqlen, IndexArg::kRotarySeqlens, op, seq, 0,
                       raw.rotary_start, 0, 0);
  } else {
    const int64_t start = raw.rotary_start;
    const int64_t last_key = start + counts.seqlen_new - 1;
    const int64_t last_query = params.rotary_q_per_row ? start + counts.seqlen_q - 1 : start;
    report_index_error(sink, IndexRule::kRotaryPosition, IndexArg::kRotaryTables, op, seq,
                       from_rotary_seqlens, last_key > last_query ? last_key : last_query,
                       params.seqlen_rotary, start);
  }
  KvcacheEntryIndices fixed;
  fixed.cache_seqlen = min(max(raw.cache_seqlen, 0), kvcache_max_cache_seqlen(params, counts));
  fixed.leftpad = min(max(raw.leftpad, 0), fixed.cache_seqlen);
  fixed.entry = min(max(raw.entry, 0), params.batch_cache - 1);
  fixed.rotary_start = params.rotary_seqlens != nullptr
                           ? min(max(raw.rotary_start, 0), kvcache_max_rotary_start(params, counts))
                           : fixed.cache_seqlen;
  return fixed;
}

// Batch entry `seq`'s values as read from the index tensors (absent ones as
// splitkv_item_inputs fills them: cache_seqlen unused without cache_seqlens,
// leftpad 0, entry seq, rotary_start unused without rotary_seqlens), guarded
// for the rows it appends and attends with (counts; the fixed-length call's
// by default).
__forceinline__ __device__ KvcacheEntryIndices guarded_kvcache_entry(const KvcacheParams& params,
                                                                     int seq,
                                                                     KvcacheEntryIndices raw,
                                                                     KvcacheRowCounts counts) {
  if (params.cache_seqlens == nullptr) raw.cache_seqlen = params.seqlen_k;
  if (params.rotary_seqlens == nullptr) raw.rotary_start = raw.cache_seqlen;
  const bool rotary_ok =
      params.rotary_dim == 0 ||
      (raw.rotary_start >= 0 && raw.rotary_start <= kvcache_max_rotary_start(params, counts));
  const bool ok = raw.cache_seqlen >= 0 &&
                  raw.cache_seqlen <= kvcache_max_cache_seqlen(params, counts) &&
                  raw.leftpad >= 0 && raw.leftpad <= raw.cache_seqlen && raw.entry >= 0 &&
                  raw.entry < params.batch_cache && rotary_ok;
  if (ok) return raw;
  return report_and_clamp_kvcache(params, seq, raw, counts);
}

__forceinline__ __device__ KvcacheEntryIndices guarded_kvcache_entry(const KvcacheParams& params,
                                                                     int seq,
                                                                     KvcacheEntryIndices raw) {
  return guarded_kvcache_entry(params, seq, raw, {params.seqlen_new, params.seqlen_q});
}

__device__ __forceinline__ int report_and_clamp_page(const IndexErrorSink& sink, IndexOp op,
                                                     int seq, int page_index, int page,
                                                     int num_pages) {
  report_index_error(sink, IndexRule::kPageOutOfPool, IndexArg::kBlockTable, op, seq, page_index,
                     page, num_pages, 0);
  return page < 0 ? 0 : num_pages - 1;
}

// A block_table entry: a page of the pool.
__forceinline__ __device__ int guarded_page(const IndexErrorSink& sink, IndexOp op, int seq,
                                            int page_index, int page, int num_pages) {
  if (static_cast<unsigned>(page) < static_cast<unsigned>(num_pages)) return page;
  return report_and_clamp_page(sink, op, seq, page_index, page, num_pages);
}

// The same check without a branch, for a loop of copies: an entry outside the
// pool sets `out_of_pool` and reads page 0, and the caller reports the first
// such entry once, after the loop, on a cold path (report_and_clamp_page). The
// split-KV kernel loads a tile's entries a tile ahead of its copies (a check
// at the load would wait there on the table read), and a branch per entry
// cost its copy loop a reconvergence each (PERF_LOG 2026-11-30 "page entries
// checked per tile").
__forceinline__ __device__ int page_in_pool_or_zero(int page, int num_pages, bool& out_of_pool) {
  const bool in_pool = static_cast<unsigned>(page) < static_cast<unsigned>(num_pages);
  out_of_pool = out_of_pool || !in_pool;
  return in_pool ? page : 0;
}

}  // namespace flash
