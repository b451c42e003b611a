// Dropout randomness: Philox4x32-10, and the one definition of which element of
// P is dropped. The mask is a pure function of (seed, offset, batch, head, row,
// col), so the backward pass regenerates the forward's mask, and the CPU and
// CUDA paths drop the same elements.
#pragma once

#include <cstdint>

#include "common/host_device.h"

namespace flash {

struct PhiloxOut {
  uint32_t x[4];
};

FA_HOST_DEVICE uint32_t mulhi_u32(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
#endif
}

FA_HOST_DEVICE PhiloxOut philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                                       uint32_t k0, uint32_t k1) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  FA_UNROLL
  for (int round = 0; round < 10; ++round) {
    const uint32_t hi0 = mulhi_u32(kMul0, c0), lo0 = kMul0 * c0;
    const uint32_t hi1 = mulhi_u32(kMul1, c2), lo1 = kMul1 * c2;
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return {{c0, c1, c2, c3}};
}

// One Philox call covers four consecutive key columns (col & ~3 .. col | 3) of
// one query row of one (batch, head).
//   key     = (seed low 32 bits, seed high 32 bits)
//   counter = (col / 4, row, batch * nheads + head, offset low 32 bits)
FA_HOST_DEVICE PhiloxOut dropout_random_bits(uint64_t seed, uint64_t offset, int batch, int head,
                                             int nheads, int row, int col) {
  const uint32_t bh =
      static_cast<uint32_t>(batch) * static_cast<uint32_t>(nheads) + static_cast<uint32_t>(head);
  return philox4x32_10(static_cast<uint32_t>(col) >> 2, static_cast<uint32_t>(row), bh,
                       static_cast<uint32_t>(offset), static_cast<uint32_t>(seed),
                       static_cast<uint32_t>(seed >> 32));
}

// Elements whose 32-bit draw is below this threshold are dropped.
FA_HOST_DEVICE uint32_t dropout_threshold(float dropout_p) {
  const double scaled = static_cast<double>(dropout_p) * 4294967296.0;
  return scaled >= 4294967295.0 ? 0xFFFFFFFFu : static_cast<uint32_t>(scaled);
}

FA_HOST_DEVICE bool dropout_keep(const PhiloxOut& bits, int col, uint32_t threshold) {
  return bits.x[col & 3] >= threshold;
}

}  // namespace flash
