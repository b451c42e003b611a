// The device half of programmatic dependent launch (sm90 and newer; the
// host half, launch_ex with LaunchOptions::programmatic, is
// launch/dependent_launch.h). A kernel launched so may start while the
// kernel before it in the stream still runs: it calls
// wait_for_preceding_grid() before reading what that grid wrote. Before sm90
// both functions are no-ops, and the launch is an ordinary one.
#pragma once

namespace flash {

// Called by the dependent kernel before it reads what the preceding grid wrote.
__forceinline__ __device__ void wait_for_preceding_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Called by the preceding kernel: once every block has called it (or exited),
// the dependent grid may be scheduled on free SM resources. Correctness does
// not depend on where it is called; the dependent kernel still waits.
__forceinline__ __device__ void allow_dependent_grid_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

}  // namespace flash
