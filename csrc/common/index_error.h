// A bad value inside an index tensor (cu_seqlens, cu_seqlens_k_new, seqused_q / seqused_k,
// cache_seqlens, block_table, cache_batch_idx, cache_leftpad, rotary_seqlens), described as plain
// data so that the CPU checks and the CUDA kernels report it the same way (docs/memory_safety.md).
//
// The CPU path reads the values on the host and raises at once. The CUDA
// kernels cannot raise: each one that derives an index from such a value
// clamps it into the extent the host knows (csrc/cuda/core/index_guards.h) and
// records the first bad value it met in an IndexErrorRecord that the host
// turns into the same message (csrc/api/index_error_message.h).
#pragma once

#include <cstdint>

namespace flash {

// What was wrong. The fields of IndexErrorRecord each rule uses are listed
// beside it; `seq` is the batch entry (sequence) and `col` a second index.
enum class IndexRule : int32_t {
  kNone = 0,
  kNegativeOffset,   // name[seq] = value < 0                       (cu_seqlens)
  kDecreasing,       // name[seq] = value > name[seq + 1] = bound   (cu_seqlens)
  kLongerThanMax,    // sequence seq has value rows > bound = max_seqlen
  kPastRows,         // name[seq] = value > bound = rows of the packed tensor
  kPagesPastTable,   // sequence seq: value keys need more than bound pages of extra rows each
  kPageOutOfPool,    // block_table[seq, col] = value outside [0, bound = pages in the pool)
  kCacheSeqlen,      // cache_seqlens[seq] = value outside [0, bound = cache length]
  kAppendPastCache,  // cache_seqlens[seq] + extra (new keys) = value + extra > bound
  kLeftpad,          // cache_leftpad[seq] = value outside [0, bound = cache_seqlens[seq]]
  kCacheBatchIdx,    // cache_batch_idx[seq] = value outside [0, bound = batch of the cache);
                     // col: 1 when paged (bound = rows of block_table)
  kRotaryPosition,   // sequence seq needs rotary position value >= bound = rows of the tables;
                     // col: 1 when its positions start at rotary_seqlens[seq] = extra
  kSeqused,          // seqused_k / seqused_q[seq] = value outside [0, bound]; col: 1 when paged
  kRotarySeqlen,     // rotary_seqlens[seq] = value < 0
};

// Which argument held the value (the message names it).
enum class IndexArg : int32_t {
  kNone = 0,
  kCuSeqlensQ,
  kCuSeqlensK,
  kCacheSeqlens,
  kCacheLeftpad,
  kCacheBatchIdx,
  kBlockTable,
  kRotaryTables,
  kSequsedK,
  kSequsedQ,
  kRotarySeqlens,
  kCuSeqlensKNew,
};

// Which op family: the message starts with its prefix ("flash_attn" for the
// fixed-length and varlen ops, "fwd_kvcache" for the KV-cache op).
enum class IndexOp : int32_t {
  kVarlen = 0,
  kKvcache = 1,
};

// `rule` is written last; a reader that sees it non-zero waits for the device
// before it reads the rest.
struct IndexErrorRecord {
  int32_t rule;  // IndexRule
  int32_t arg;   // IndexArg
  int32_t op;    // IndexOp
  int32_t seq;
  int64_t col;
  int64_t value;
  int64_t bound;
  int64_t extra;
};

// Where a kernel records: `claim` (device memory, zero while nothing is
// recorded) elects the one writer of `record` (host memory the device can
// write, so that the host reads it without a synchronisation). Both null: the
// kernel only clamps.
struct IndexErrorSink {
  unsigned int* claim;
  IndexErrorRecord* record;
};

#if defined(__CUDACC__)
// The cold path of every guard. No memory fence here: a system-scope fence
// anywhere in a kernel makes ptxas turn its fire-and-forget reductions
// (the backward's dQ red.global.add) into returning atomics, which cost the
// backward dearly (PERF_LOG 2026-11-26 be63e09). The host reads the record
// only after waiting for the device (index_error_state.cpp), when every field
// has landed.
__device__ __forceinline__ void report_index_error(const IndexErrorSink& sink, IndexRule rule,
                                                   IndexArg arg, IndexOp op, int seq, int64_t col,
                                                   int64_t value, int64_t bound, int64_t extra) {
  if (sink.claim == nullptr || atomicCAS(sink.claim, 0u, 1u) != 0u) return;
  volatile IndexErrorRecord* record = sink.record;
  record->arg = static_cast<int32_t>(arg);
  record->op = static_cast<int32_t>(op);
  record->seq = seq;
  record->col = col;
  record->value = value;
  record->bound = bound;
  record->extra = extra;
  record->rule = static_cast<int32_t>(rule);
}
#endif

}  // namespace flash
