// The driver's cuTensorMapEncodeTiled, looked up once. Every TMA descriptor of
// the Hopper kernels (cute's make_tma_copy and make_paged_tma_descriptor in
// core/tma_loads_sm90.h) is encoded through cutlass::call_cuTensorMapEncodeTiled,
// which in CUTLASS 4.2 asks the runtime for the driver's entry point by name on
// every call: a cudaGetDriverEntryPointByVersion per descriptor, three per Hopper
// forward launch, four per backward, two more over a paged cache, on the host
// path of each call (PERF_LOG 2026-11-29, per-call host cost). setup.py builds the
// CUDA sources with CUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL, under which that
// wrapper calls cuTensorMapEncodeTiled by name, and renames the name to this
// function (-DcuTensorMapEncodeTiled=flash_attn_cuTensorMapEncodeTiled), so that
// the extension needs no link to the driver library and still resolves the
// entry point once.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <atomic>

// Only under setup.py's rename: without it this definition would take the
// driver's own name.
#if defined(cuTensorMapEncodeTiled)

namespace {

PFN_cuTensorMapEncodeTiled_v12000 resolve_encode() {
  void* entry = nullptr;
  cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t error = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &entry,
                                                             12000, cudaEnableDefault, &status);
  if (error != cudaSuccess || status != cudaDriverEntryPointSuccess) return nullptr;
  return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(entry);
}

}  // namespace

// The name is flash_attn_cuTensorMapEncodeTiled here (the rename), with the C
// linkage of the driver header's declaration. A failed lookup is retried on the
// next call.
CUresult CUDAAPI cuTensorMapEncodeTiled(
    CUtensorMap* tensorMap, CUtensorMapDataType tensorDataType, cuuint32_t tensorRank,
    void* globalAddress, const cuuint64_t* globalDim, const cuuint64_t* globalStrides,
    const cuuint32_t* boxDim, const cuuint32_t* elementStrides, CUtensorMapInterleave interleave,
    CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2Promotion,
    CUtensorMapFloatOOBfill oobFill) {
  static std::atomic<PFN_cuTensorMapEncodeTiled_v12000> cached{nullptr};
  PFN_cuTensorMapEncodeTiled_v12000 encode = cached.load(std::memory_order_acquire);
  if (encode == nullptr) {
    encode = resolve_encode();
    if (encode == nullptr) return CUDA_ERROR_NOT_FOUND;
    cached.store(encode, std::memory_order_release);
  }
  return encode(tensorMap, tensorDataType, tensorRank, globalAddress, globalDim, globalStrides,
                boxDim, elementStrides, interleave, swizzle, l2Promotion, oobFill);
}

#endif  // defined(cuTensorMapEncodeTiled)
