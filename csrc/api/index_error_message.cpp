#include "api/index_error_message.h"

#include <c10/util/Exception.h>

#include <sstream>

namespace flash {
namespace {

const char* arg_name(IndexArg arg) {
  switch (arg) {
    case IndexArg::kCuSeqlensQ: return "cu_seqlens_q";
    case IndexArg::kCuSeqlensK: return "cu_seqlens_k";
    case IndexArg::kCacheSeqlens: return "cache_seqlens";
    case IndexArg::kCacheLeftpad: return "cache_leftpad";
    case IndexArg::kCacheBatchIdx: return "cache_batch_idx";
    case IndexArg::kBlockTable: return "block_table";
    case IndexArg::kRotaryTables: return "rotary_cos / rotary_sin";
    case IndexArg::kSequsedK: return "seqused_k";
    case IndexArg::kSequsedQ: return "seqused_q";
    case IndexArg::kRotarySeqlens: return "rotary_seqlens";
    case IndexArg::kCuSeqlensKNew: return "cu_seqlens_k_new";
    case IndexArg::kNone: break;
  }
  return "an index tensor";
}

// The cache length of a paged cache is what its block table addresses: say
// so, since the fix is usually a wider block_table.
const char* cache_length_words(int64_t paged) {
  return paged ? "the cache length: the rows block_table addresses, max_blocks_per_seq * "
                 "page_size"
               : "the cache length";
}

}  // namespace

IndexErrorRecord index_error(IndexRule rule, IndexArg arg, IndexOp op, int64_t seq, int64_t col,
                             int64_t value, int64_t bound, int64_t extra) {
  IndexErrorRecord record{};
  record.rule = static_cast<int32_t>(rule);
  record.arg = static_cast<int32_t>(arg);
  record.op = static_cast<int32_t>(op);
  record.seq = static_cast<int32_t>(seq);
  record.col = col;
  record.value = value;
  record.bound = bound;
  record.extra = extra;
  return record;
}

std::string index_error_message(const IndexErrorRecord& r) {
  std::ostringstream os;
  os << (static_cast<IndexOp>(r.op) == IndexOp::kKvcache ? "fwd_kvcache: " : "flash_attn: ");
  const char* name = arg_name(static_cast<IndexArg>(r.arg));
  switch (static_cast<IndexRule>(r.rule)) {
    case IndexRule::kNegativeOffset:
      os << name << "[" << r.seq << "] must be >= 0, got " << r.value;
      break;
    case IndexRule::kDecreasing:
      os << name << " must be non-decreasing, got " << name << "[" << r.seq << "] = " << r.value
         << " > " << name << "[" << r.seq + 1 << "] = " << r.bound;
      break;
    case IndexRule::kLongerThanMax:
      os << "sequence " << r.seq << " has length " << r.value << " according to " << name
         << ", more than the max_seqlen given for it (" << r.bound << ")";
      break;
    case IndexRule::kPastRows:
      os << name << "[" << r.seq << "] = " << r.value
         << " exceeds the number of rows of its tensor (" << r.bound << ")";
      break;
    case IndexRule::kPagesPastTable:
      os << "sequence " << r.seq << " has " << r.value << " keys, which need "
         << (r.value + r.extra - 1) / (r.extra > 0 ? r.extra : 1) << " blocks of page_size "
         << r.extra << ", but block_table has only " << r.bound << " columns";
      break;
    case IndexRule::kPageOutOfPool:
      os << "block_table[" << r.seq << ", " << r.col << "] = " << r.value
         << " is not a valid block index in [0, " << r.bound
         << ") (the number of pages of k_cache)";
      break;
    case IndexRule::kCacheSeqlen:
      os << "cache_seqlens[" << r.seq << "] = " << r.value << " must be in [0, " << r.bound << "] ("
         << cache_length_words(r.col) << ")";
      break;
    case IndexRule::kAppendPastCache:
      os << "cache_seqlens[" << r.seq << "] + seqlen_new = " << r.value << " + " << r.extra
         << " must fit in the cache (" << cache_length_words(r.col) << " = " << r.bound << ")";
      break;
    case IndexRule::kLeftpad:
      os << "cache_leftpad[" << r.seq << "] = " << r.value << " must be in [0, cache_seqlens["
         << r.seq << "] = " << r.bound << "]";
      break;
    case IndexRule::kCacheBatchIdx:
      os << "cache_batch_idx[" << r.seq << "] = " << r.value << " must be in [0, " << r.bound
         << ") ("
         << (r.col ? "the rows of block_table, which it selects with a paged cache"
                   : "the batch size of k_cache")
         << ")";
      break;
    case IndexRule::kRotaryPosition:
      os << "rotary_cos / rotary_sin have " << r.bound << " rows, but batch " << r.seq
         << " needs position " << r.value;
      if (r.col)
        os << " (its positions start at rotary_seqlens[" << r.seq << "] = " << r.extra << ")";
      break;
    case IndexRule::kRotarySeqlen:
      os << name << "[" << r.seq << "] = " << r.value << " must be >= 0";
      break;
    case IndexRule::kSeqused:
      os << name << "[" << r.seq << "] = " << r.value << " must be in [0, " << r.bound << "] (";
      if (r.col) {
        os << "with block_table: the smaller of max_seqlen_k and the rows a block_table row "
              "addresses, max_blocks_per_seq * page_size";
      } else if (static_cast<IndexArg>(r.arg) == IndexArg::kSequsedQ) {
        os << "the query rows cu_seqlens_q gives sequence " << r.seq;
      } else {
        os << "the keys cu_seqlens_k gives sequence " << r.seq;
      }
      os << ")";
      break;
    case IndexRule::kNone: os << "no index error"; break;
  }
  return os.str();
}

void raise_index_error(const IndexErrorRecord& record) {
  TORCH_CHECK(false, index_error_message(record));
}

}  // namespace flash
