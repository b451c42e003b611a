#include "cuda/ops/index_error_state.h"

#include <c10/util/Exception.h>

#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "api/index_error_message.h"
#include "cuda/core/cuda_check.h"

namespace flash {
namespace {

constexpr int kMaxDevices = 64;

struct DeviceRecord {
  IndexErrorSink sink{};  // device pointers the kernels write
  // The same record, as the host reads it; null until create_record, which
  // publishes it (release) after `sink`, so that a reader without the lock
  // that sees it (acquire) sees the sink too.
  std::atomic<IndexErrorRecord*> host_record{nullptr};
};

std::mutex& state_mutex() {
  static std::mutex mutex;
  return mutex;
}

std::array<DeviceRecord, kMaxDevices>& records() {
  static std::array<DeviceRecord, kMaxDevices> all{};
  return all;
}

std::atomic<bool>& sync_flag() {
  static std::atomic<bool> flag{[] {
    const char* value = std::getenv("FLASH_ATTN_CUDA_SYNC_INDEX_CHECKS");
    return value != nullptr && value[0] != '\0' && std::strcmp(value, "0") != 0;
  }()};
  return flag;
}

bool is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  FA_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  return status != cudaStreamCaptureStatusNone;
}

// Creates the device's record: the claim word in device memory, the record in
// host memory mapped into the device's address space (the kernels write it,
// the host reads it without a copy). Called outside capture only.
void create_record(int device, DeviceRecord& entry) {
  int previous = 0;
  FA_CUDA_CHECK(cudaGetDevice(&previous));
  FA_CUDA_CHECK(cudaSetDevice(device));
  unsigned int* claim = nullptr;
  void* host = nullptr;
  void* mapped = nullptr;
  FA_CUDA_CHECK(cudaMalloc(&claim, sizeof(unsigned int)));
  FA_CUDA_CHECK(cudaMemset(claim, 0, sizeof(unsigned int)));
  FA_CUDA_CHECK(
      cudaHostAlloc(&host, sizeof(IndexErrorRecord), cudaHostAllocMapped | cudaHostAllocPortable));
  std::memset(host, 0, sizeof(IndexErrorRecord));
  FA_CUDA_CHECK(cudaHostGetDevicePointer(&mapped, host, 0));
  FA_CUDA_CHECK(cudaDeviceSynchronize());  // the claim's zero lands before any kernel reads it
  FA_CUDA_CHECK(cudaSetDevice(previous));
  entry.sink = {claim, static_cast<IndexErrorRecord*>(mapped)};
  entry.host_record.store(static_cast<IndexErrorRecord*>(host), std::memory_order_release);
}

// Whether a kernel has written the device's record (one word of host memory).
bool has_record(const DeviceRecord& entry) {
  const IndexErrorRecord* host = entry.host_record.load(std::memory_order_acquire);
  return host != nullptr && static_cast<const volatile IndexErrorRecord*>(host)->rule != 0;
}

void wait_for_device(int device) {
  int previous = 0;
  FA_CUDA_CHECK(cudaGetDevice(&previous));
  FA_CUDA_CHECK(cudaSetDevice(device));
  FA_CUDA_CHECK(cudaDeviceSynchronize());
  FA_CUDA_CHECK(cudaSetDevice(previous));
}

// Takes the record (clearing it) if a kernel wrote one; caller holds the mutex.
bool take_record(DeviceRecord& entry, cudaStream_t stream, IndexErrorRecord& out) {
  if (!has_record(entry)) return false;
  volatile IndexErrorRecord* record = entry.host_record.load(std::memory_order_acquire);
  out.rule = record->rule;
  out.arg = record->arg;
  out.op = record->op;
  out.seq = record->seq;
  out.col = record->col;
  out.value = record->value;
  out.bound = record->bound;
  out.extra = record->extra;
  record->rule = 0;
  // Reopen the claim for the next error, behind the work already queued.
  FA_CUDA_CHECK(cudaMemsetAsync(entry.sink.claim, 0, sizeof(unsigned int), stream));
  return true;
}

DeviceRecord& record_of(int device) {
  TORCH_CHECK(device >= 0 && device < kMaxDevices, "flash_attn_cuda: device index ", device,
              " is out of range [0, ", kMaxDevices, ")");
  return records()[device];
}

}  // namespace

IndexErrorSink begin_index_checks(int device, cudaStream_t stream) {
  DeviceRecord& entry = record_of(device);
  // The common case: the record exists and is empty; no lock, no wait.
  if (entry.host_record.load(std::memory_order_acquire) != nullptr && !has_record(entry)) {
    return entry.sink;
  }
  if (is_capturing(stream)) return entry.sink;  // null before the record exists: clamp only
  IndexErrorRecord record{};
  {
    std::lock_guard<std::mutex> lock(state_mutex());
    if (entry.host_record.load(std::memory_order_acquire) == nullptr) {
      create_record(device, entry);
      return entry.sink;
    }
    // The kernels write the record with no fence (index_error.h): wait for
    // the device, so that every field has landed. Only a call after a bad
    // value pays this.
    wait_for_device(device);
    if (!take_record(entry, stream, record)) return entry.sink;
  }
  TORCH_CHECK(false, index_error_message(record), "\n(flash_attn_cuda: found by a kernel of an ",
              "earlier call on cuda:", device, " and reported at this call; that call's result ",
              "is undefined for that sequence. Set FLASH_ATTN_CUDA_SYNC_INDEX_CHECKS=1 or call ",
              "flash_attn_cuda.check_index_errors() to have it raised by the call itself.)");
}

void finish_index_checks(int device, cudaStream_t stream) {
  if (!sync_flag().load(std::memory_order_relaxed) || is_capturing(stream)) return;
  FA_CUDA_CHECK(cudaStreamSynchronize(stream));
  DeviceRecord& entry = record_of(device);
  if (!has_record(entry)) return;
  IndexErrorRecord record{};
  {
    std::lock_guard<std::mutex> lock(state_mutex());
    wait_for_device(device);  // a kernel of another stream may still be writing it
    if (!take_record(entry, stream, record)) return;
  }
  raise_index_error(record);
}

void check_index_errors_now(int device) {
  DeviceRecord& entry = record_of(device);
  if (entry.host_record.load(std::memory_order_acquire) == nullptr) return;  // no call ran here
  wait_for_device(device);
  IndexErrorRecord record{};
  bool found = false;
  {
    std::lock_guard<std::mutex> lock(state_mutex());
    found = take_record(entry, nullptr, record);
  }
  wait_for_device(device);  // the claim's reset lands before the next kernel
  if (found) raise_index_error(record);
}

bool sync_index_checks() { return sync_flag().load(); }

bool set_sync_index_checks(bool enabled) { return sync_flag().exchange(enabled); }

}  // namespace flash
