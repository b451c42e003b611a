// The host side of the CUDA path's index checks (docs/memory_safety.md): one
// IndexErrorRecord per device that the kernels record the first bad index
// value into (index_guards.h), and when it is raised.
//
// By default nothing waits: a call raises what an earlier call recorded on its
// device when it starts (deferred), and check_index_errors() raises at once
// after waiting for the device. With sync checks on (the environment variable
// FLASH_ATTN_CUDA_SYNC_INDEX_CHECKS=1, or set_sync_index_checks(true)) each
// call that reads index tensors waits for its stream after its launches and
// raises its own error. Inside CUDA graph capture nothing is raised or waited
// for: the kernels clamp and record, and a later call outside capture raises.
#pragma once

#include <cuda_runtime.h>

#include "common/index_error.h"

namespace flash {

// At the start of every CUDA op: raises a record left by an earlier call on
// `device` (and clears it), and returns the sink this call's kernels record
// into. While `stream` is capturing it raises nothing; the sink is null
// (clamp only) until the device's record exists, which the first call
// outside graph capture creates.
IndexErrorSink begin_index_checks(int device, cudaStream_t stream);

// At the end of a call that read index tensors: with sync checks on (and
// outside capture) waits for `stream` and raises what the call recorded.
void finish_index_checks(int device, cudaStream_t stream);

// Waits for every stream of `device` and raises what any call recorded.
void check_index_errors_now(int device);

bool sync_index_checks();
bool set_sync_index_checks(bool enabled);  // returns the previous setting

}  // namespace flash
