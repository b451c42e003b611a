// Kernel launch helpers: the dynamic shared-memory opt-in, done once per
// kernel and device, and launch_ex, which launches with the options of
// LaunchOptions.
//
// Programmatic dependent launch (sm90 and newer): a kernel launched with
// programmatic stream serialization may start while the kernel before it in
// the stream still runs, and waits in wait_for_preceding_grid()
// (core/dependent_grid.h) until that grid has finished and its writes are
// visible. The launch latency of each kernel of a decode call (append /
// rotary, split-KV attention, combine) then hides behind the kernel before
// it instead of adding to it. Before sm90 the launch is an ordinary one. The
// host enables the programmatic launch from the device's compute capability,
// so the kernel must run as sm90 machine code there (setup.py embeds no PTX
// that could be JIT-compiled from an older arch without the wait).
#pragma once

#include <map>
#include <mutex>
#include <utility>

#include <cuda_runtime.h>

#include "cuda/core/cuda_check.h"

namespace flash {

// Dynamic shared memory granted so far per (kernel, device). The attribute is
// a property of the function on a device, so it needs setting once, not on
// every launch: the driver call it saves is a fixed host cost on the small
// calls of a decode step (PERF_LOG 2026-11-27, host cost per call).
struct DynamicSmemGrants {
  std::mutex mutex;
  std::map<std::pair<const void*, int>, int> bytes;
};
inline DynamicSmemGrants& dynamic_smem_grants() {
  static DynamicSmemGrants grants;
  return grants;
}

// Lets `kernel` take smem_bytes of dynamic shared memory where that is more
// than the default 48 KB.
template <typename... KernelArgs>
void allow_dynamic_smem(void (*kernel)(KernelArgs...), int smem_bytes) {
  if (smem_bytes < 48 * 1024) return;
  int device = 0;
  FA_CUDA_CHECK(cudaGetDevice(&device));
  DynamicSmemGrants& grants = dynamic_smem_grants();
  const std::lock_guard<std::mutex> lock(grants.mutex);
  int& granted = grants.bytes[{reinterpret_cast<const void*>(kernel), device}];
  if (granted >= smem_bytes) return;
  FA_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  granted = smem_bytes;  // only once the driver took it
}

// Launches kernel<<<grid, block, smem_bytes, stream>>>(args...).
template <typename... KernelArgs, typename... Args>
void launch_with_dynamic_smem(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, int smem_bytes,
                              cudaStream_t stream, Args&&... args) {
  allow_dynamic_smem(kernel, smem_bytes);
  kernel<<<grid, block, smem_bytes, stream>>>(std::forward<Args>(args)...);
  FA_CUDA_CHECK(cudaGetLastError());
}

// How launch_ex launches (both need sm90 or newer):
//   programmatic: the kernel may overlap the preceding kernel in the stream
//                 (it must call wait_for_preceding_grid before reading that
//                 kernel's results);
//   cluster_x:    blocks grouped into clusters of cluster_x along grid x
//                 (grid.x a multiple of it), which run at the same time on
//                 one GPC; 1: no clusters.
struct LaunchOptions {
  bool programmatic = false;
  int cluster_x = 1;
};

// Launches kernel<<<grid, block, smem_bytes, stream>>>(args...) with `options`.
template <typename... KernelArgs, typename... Args>
void launch_ex(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, int smem_bytes,
               cudaStream_t stream, LaunchOptions options, Args&&... args) {
  allow_dynamic_smem(kernel, smem_bytes);
  cudaLaunchAttribute attributes[2] = {};
  unsigned num_attributes = 0;
  if (options.programmatic) {
    cudaLaunchAttribute& attribute = attributes[num_attributes++];
    attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute.val.programmaticStreamSerializationAllowed = 1;
  }
  if (options.cluster_x > 1) {
    cudaLaunchAttribute& attribute = attributes[num_attributes++];
    attribute.id = cudaLaunchAttributeClusterDimension;
    attribute.val.clusterDim.x = options.cluster_x;
    attribute.val.clusterDim.y = 1;
    attribute.val.clusterDim.z = 1;
  }
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = num_attributes > 0 ? attributes : nullptr;
  config.numAttrs = num_attributes;
  FA_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

}  // namespace flash
