// Division by a divisor known only at run time but fixed for a whole launch
// (the page size of a paged KV cache), as a multiply-high and a shift: the
// split-KV copy loop maps every K/V row to its page, and a hardware integer
// division there costs about twenty instructions per row in a loop that has
// few to spare. Every kernel that maps a key position to (page, row in page)
// goes through divmod.
#pragma once

#include <cstdint>

namespace flash {

struct IntDivisor {
  int divisor = 1;
  uint32_t multiplier = 0;  // ceil(2^(32 + shift) / divisor)
  uint32_t shift = 0;

  IntDivisor() = default;

  // Host side, once per launch. Exact for dividends in [0, 2^31).
  explicit IntDivisor(int d) : divisor(d) {
    if (d <= 1) return;
    uint32_t log2_ceil = 0;
    while ((uint64_t(1) << log2_ceil) < uint64_t(d)) ++log2_ceil;
    shift = log2_ceil - 1;
    multiplier = static_cast<uint32_t>(((uint64_t(1) << (32 + shift)) + d - 1) / d);
  }

#if defined(__CUDACC__)
  __forceinline__ __device__ int quotient(int n) const {
    return divisor == 1 ? n
                        : static_cast<int>(__umulhi(static_cast<uint32_t>(n), multiplier) >> shift);
  }

  __forceinline__ __device__ void divmod(int n, int& quot, int& rem) const {
    quot = quotient(n);
    rem = n - quot * divisor;
  }
#endif
};

}  // namespace flash
