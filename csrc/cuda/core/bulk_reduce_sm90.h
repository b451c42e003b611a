// A contiguous fp32 buffer in shared memory added into global memory by the
// TMA unit (cp.reduce.async.bulk, sm90): one instruction of one thread in
// place of a reduction per value from every thread that holds the values.
// The Hopper backward adds each query block's dQ this way (BwdSm90DQWriter,
// bwd_epilogue_sm90.h; PERF_LOG issue-53 hypothesis 1).
//
// Protocol: the threads that wrote the buffer fence their writes into the
// async proxy (cutlass::arch::fence_view_async_shared) before the issuing
// thread reads it; the issuing thread commits the reduction and waits until
// the buffer has been read (bulk_reduce_wait_read) before the buffer is
// written again. Kernel completion makes the global additions visible to the
// next kernel, as for a TMA store.
#pragma once

#include <cstdint>

#include <cute/arch/util.hpp>

namespace flash {

// gmem[i] += smem[i] for bytes / 4 floats; both 16-byte aligned, bytes a
// multiple of 16.
__forceinline__ __device__ void bulk_reduce_add_f32(float* gmem, const float* smem, int bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const uint32_t smem_addr = cute::cast_smem_ptr_to_uint(smem);
  asm volatile(
      "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(gmem),
      "r"(smem_addr), "r"(bytes)
      : "memory");
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}

// Until every committed bulk reduction of this thread has read its buffer.
__forceinline__ __device__ void bulk_reduce_wait_read() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
#endif
}

// Until every committed bulk reduction of this thread is complete, its
// additions performed: what a release that publishes them must follow
// (gpu_semaphore.h).
__forceinline__ __device__ void bulk_reduce_wait_done() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
#endif
}

}  // namespace flash
