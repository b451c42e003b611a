// Runtime table of the compiled kernel instantiations. Each generated
// instantiation file registers its launcher at load time, so a build that
// compiles a subset of head dims or dtypes links, and asking for a missing one
// is a clear error instead of a link failure.
#pragma once

#include <cuda_runtime.h>

#include "cuda/core/params.h"
#include "cuda/launch/plan.h"

namespace flash {

// Each launcher runs the kernels its pass's plan (plan.h) names.
using FwdLauncher = void (*)(const FwdParams&, const FwdPlan&, cudaStream_t);

// Keyed on the compiled (d_qk, d_v): d_v = d_qk for a head dim's launcher,
// smaller for a specialised pair's (FwdPlan::head_dim_v). Null when it was not
// compiled into this build.
FwdLauncher find_fwd_launcher(int compiled_head_dim, int compiled_head_dim_v, bool is_bf16);
inline FwdLauncher find_fwd_launcher(int compiled_head_dim, bool is_bf16) {
  return find_fwd_launcher(compiled_head_dim, compiled_head_dim, is_bf16);
}

struct FwdLauncherRegistration {
  FwdLauncherRegistration(int compiled_head_dim, int compiled_head_dim_v, bool is_bf16,
                          FwdLauncher launcher);
  FwdLauncherRegistration(int compiled_head_dim, bool is_bf16, FwdLauncher launcher)
      : FwdLauncherRegistration(compiled_head_dim, compiled_head_dim, is_bf16, launcher) {}
};

using BwdLauncher = void (*)(const BwdParams&, const BwdPlan&, cudaStream_t);

// Keyed on the compiled (d_qk, d_v), as the forward's (BwdPlan::head_dim_v).
// Null when the backward of (head_dim, head_dim_v, dtype) was not compiled
// into this build.
BwdLauncher find_bwd_launcher(int compiled_head_dim, int compiled_head_dim_v, bool is_bf16);
inline BwdLauncher find_bwd_launcher(int compiled_head_dim, bool is_bf16) {
  return find_bwd_launcher(compiled_head_dim, compiled_head_dim, is_bf16);
}

struct BwdLauncherRegistration {
  BwdLauncherRegistration(int compiled_head_dim, int compiled_head_dim_v, bool is_bf16,
                          BwdLauncher launcher);
  BwdLauncherRegistration(int compiled_head_dim, bool is_bf16, BwdLauncher launcher)
      : BwdLauncherRegistration(compiled_head_dim, compiled_head_dim, is_bf16, launcher) {}
};

using SplitKvLauncher = void (*)(const KvcacheParams&, const DecodePlan&, cudaStream_t);

// Null when fwd_kvcache's attention for (head_dim, q's dtype, cache dtype:
// q's or e4m3, fp8_cache) was not compiled in.
SplitKvLauncher find_splitkv_launcher(int compiled_head_dim, bool is_bf16, bool fp8_cache = false);

struct SplitKvLauncherRegistration {
  SplitKvLauncherRegistration(int compiled_head_dim, bool is_bf16, SplitKvLauncher launcher,
                              bool fp8_cache = false);
};

// Whether the build has sm_90a machine code (FLASH_ATTN_HAS_SM90A, which
// setup.py gives nvcc only): the plans' DeviceDesc::sm90a_built.
bool built_with_sm90a();

}  // namespace flash
