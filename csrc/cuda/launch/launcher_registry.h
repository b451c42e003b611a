// Runtime table of the compiled kernel instantiations. Each generated
// instantiation file registers its launcher at load time, so a build that
// compiles a subset of head dims or dtypes links, and asking for a missing one
// is a clear error instead of a link failure.
#pragma once

#include <cuda_runtime.h>

#include "cuda/core/params.h"

namespace flash {

using FwdLauncher = void (*)(const FwdParams&, cudaStream_t);

// Null when (head_dim, dtype) was not compiled into this build.
FwdLauncher find_fwd_launcher(int compiled_head_dim, bool is_bf16);

struct FwdLauncherRegistration {
  FwdLauncherRegistration(int compiled_head_dim, bool is_bf16, FwdLauncher launcher);
};

using BwdLauncher = void (*)(const BwdParams&, cudaStream_t);

// Null when the backward of (head_dim, dtype) was not compiled into this build.
BwdLauncher find_bwd_launcher(int compiled_head_dim, bool is_bf16);

struct BwdLauncherRegistration {
  BwdLauncherRegistration(int compiled_head_dim, bool is_bf16, BwdLauncher launcher);
};

using SplitKvLauncher = void (*)(const KvcacheParams&, cudaStream_t);

// Null when fwd_kvcache's attention for (head_dim, dtype) was not compiled in.
SplitKvLauncher find_splitkv_launcher(int compiled_head_dim, bool is_bf16);

struct SplitKvLauncherRegistration {
  SplitKvLauncherRegistration(int compiled_head_dim, bool is_bf16, SplitKvLauncher launcher);
};

}  // namespace flash
