// The message of a bad index value (csrc/common/index_error.h): one text per
// rule, shared by the CPU checks, which raise it at once, and the CUDA path,
// which raises it from what a kernel recorded.
#pragma once

#include <string>

#include "common/index_error.h"

namespace flash {

// The message, starting with the op family's prefix ("flash_attn: " or
// "fwd_kvcache: "). It names the argument, the index, the value and the bound.
std::string index_error_message(const IndexErrorRecord& record);

// Throws (TORCH_CHECK) with index_error_message(record).
[[noreturn]] void raise_index_error(const IndexErrorRecord& record);

// Shorthand for the record of one rule.
IndexErrorRecord index_error(IndexRule rule, IndexArg arg, IndexOp op, int64_t seq, int64_t col,
                             int64_t value, int64_t bound, int64_t extra = 0);

}  // namespace flash
