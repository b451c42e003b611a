// What nvcc was told about the build that the host compiler was not: setup.py
// passes -DFLASH_ATTN_HAS_SM90A to nvcc alone, and the op layer (plain C++)
// asks here before it plans a call.
#include "cuda/launch/launcher_registry.h"

namespace flash {

bool built_with_sm90a() {
#if defined(FLASH_ATTN_HAS_SM90A)
  return true;
#else
  return false;
#endif
}

}  // namespace flash
