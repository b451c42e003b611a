// CUDA runtime errors become C++ exceptions with the failing call named; the
// op dispatcher turns them into Python RuntimeErrors.
#pragma once

#include <stdexcept>
#include <string>

#include <cuda_runtime.h>

#define FA_CUDA_CHECK(call)                                                   \
  do {                                                                        \
    const cudaError_t fa_status_ = (call);                                    \
    if (fa_status_ != cudaSuccess) {                                          \
      throw std::runtime_error(std::string("flash_attn_cuda: ") + #call +     \
                               " failed: " + cudaGetErrorString(fa_status_)); \
    }                                                                         \
  } while (0)
