// The CUDA kernels of the flash_attn ops (schemas in csrc/flash_api.cpp) and
// the index checks' controls. A CPU-only build registers
// flash_api_nocuda.cpp's stubs instead.
#include <torch/library.h>

#include "cuda/ops/index_error_state.h"
#include "cuda/ops/op_common.h"

TORCH_LIBRARY_IMPL(flash_attn, CUDA, m) {
  m.impl("fwd", &flash::fwd_cuda);
  m.impl("varlen_fwd", &flash::varlen_fwd_cuda);
  m.impl("bwd", &flash::bwd_cuda);
  m.impl("varlen_bwd", &flash::varlen_bwd_cuda);
  m.impl("fwd_kvcache", &flash::fwd_kvcache_cuda);
  m.impl("fwd_out", &flash::fwd_out_cuda);
  m.impl("varlen_fwd_out", &flash::varlen_fwd_out_cuda);
  m.impl("fwd_kvcache_out", &flash::fwd_kvcache_out_cuda);
  m.impl("combine", &flash::combine_cuda);
  m.impl("combine_out", &flash::combine_out_cuda);
}

// The index checks' controls (index_error_state.h); the CPU path raises at
// once and needs neither.
TORCH_LIBRARY_IMPL(flash_attn, CompositeImplicitAutograd, m) {
  m.impl("check_index_errors",
         [](int64_t device) { flash::check_index_errors_now(static_cast<int>(device)); });
  m.impl("set_sync_index_checks",
         [](bool enabled) { return flash::set_sync_index_checks(enabled); });
}
