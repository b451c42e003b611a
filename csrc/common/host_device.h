// Lets the rule headers in this folder compile as plain C++ (CPU path) and as
// CUDA device code (kernels) from one definition.
#pragma once

#if defined(__CUDACC__)
#define FA_HOST_DEVICE __host__ __device__ __forceinline__
#define FA_UNROLL _Pragma("unroll")
#else
#define FA_HOST_DEVICE inline
#define FA_UNROLL
#endif
