// CUDA kernels of a build made without a CUDA toolkit.
//
// Without them a CUDA tensor would reach no CUDA kernel and the dispatcher would
// report a generic "could not run ... with arguments from the 'CUDA' backend",
// or, worse, some future fallback could pick a slower path silently. Each op
// gets a CUDA kernel that says what happened and how to fix it.
//
// setup.py compiles this file instead of csrc/cuda/**/*.cpp when it builds
// CPU-only (the plain C++ of the plans, launch/plan.cpp and
// ops/plan_debug_ops.cpp, is compiled in both). Keep the op list in step with
// the schemas in csrc/flash_api.cpp.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace {

[[noreturn]] void raise_built_without_cuda(const c10::OperatorHandle& op,
                                           torch::jit::Stack* /*stack*/) {
  TORCH_CHECK(false, op.schema().name(),
              ": flash_attn_cuda was built without CUDA kernels (no nvcc found at build time, or "
              "FLASH_ATTN_SKIP_CUDA_BUILD=1); reinstall with a CUDA toolkit. "
              "flash_attn_cuda._C.build_info says why this build is CPU-only.");
}

}  // namespace

TORCH_LIBRARY_IMPL(flash_attn, CUDA, m) {
  // Boxed: the stub never looks at its arguments, so it takes them in any schema.
  for (const char* op_name : {"fwd", "bwd", "varlen_fwd", "varlen_bwd", "fwd_kvcache", "fwd_out",
                              "varlen_fwd_out", "fwd_kvcache_out", "combine", "combine_out"}) {
    m.impl(op_name, torch::CppFunction::makeFromBoxedFunction<&raise_built_without_cuda>());
  }
}

// The index checks' controls have nothing to check without CUDA kernels.
TORCH_LIBRARY_IMPL(flash_attn, CompositeImplicitAutograd, m) {
  m.impl("check_index_errors", [](int64_t /*device*/) {});
  m.impl("set_sync_index_checks", [](bool /*enabled*/) { return false; });
}
