// Grids of (blocks along a sequence, heads, batch entries), the shape of every
// kernel that gives each (head, batch) pair its own blocks: the SM80 forward,
// the backward kernels, the returned probabilities.
//
// CUDA caps grid y and z at 65535 each. A varlen batch of packed short
// sequences can hold more sequences than that (a million tokens of 8-token
// sequences), so y and z carry the pairs as one index, head fastest:
// pair = blockIdx.y + gridDim.y * blockIdx.z, head = pair mod nheads. When
// both counts fit, y = nheads and z = batch, which is that same index, and
// the kernel reads blockIdx.y / blockIdx.z without a division. Either way the
// hardware hands out the pairs in the same order (x fastest, then y, then z),
// so the block orders built on it (fwd_block_order.h) stay as they are.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include <cuda_runtime.h>

namespace flash {

constexpr int64_t kMaxGridYZ = 65535;

// Host: the grid for x blocks per pair. Past y = 65535 the last z slice may
// hold fewer pairs than y; its extra blocks find no pair and exit.
inline dim3 grid_over_heads_batch(int64_t x, int nheads, int batch) {
  if (nheads <= kMaxGridYZ && batch <= kMaxGridYZ) {
    return dim3(unsigned(x), unsigned(nheads), unsigned(batch));
  }
  const int64_t pairs = int64_t(nheads) * batch;
  const int64_t z = (pairs + kMaxGridYZ - 1) / kMaxGridYZ;
  if (z > kMaxGridYZ) {
    throw std::runtime_error("flash_attn_cuda: nheads * batch = " + std::to_string(pairs) +
                             " (head, sequence) pairs; a CUDA grid holds at most 65535 * 65535");
  }
  return dim3(unsigned(x), unsigned(kMaxGridYZ), unsigned(z));
}

struct HeadBatch {
  int head;
  int batch;
};

// Device: this block's pair of a grid from grid_over_heads_batch(x, nheads,
// batch); false for the blocks past the last pair, which must exit before
// reading anything of a sequence.
__device__ __forceinline__ bool block_head_batch(int nheads, int batch, HeadBatch& pair_out) {
  if (gridDim.y == unsigned(nheads)) {
    pair_out = {int(blockIdx.y), int(blockIdx.z)};
    return true;
  }
  // At most 65535 * 65535 pairs: the index fits 32 unsigned bits.
  const unsigned pair = blockIdx.y + gridDim.y * blockIdx.z;
  const unsigned pair_batch = pair / unsigned(nheads);
  pair_out = {int(pair - pair_batch * unsigned(nheads)), int(pair_batch)};
  return pair_batch < unsigned(batch);
}

}  // namespace flash
