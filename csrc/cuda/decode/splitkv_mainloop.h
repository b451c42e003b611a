// The main loop's pieces of the split-KV kernel (splitkv_kernel.h): the
// cp.async helpers of its copies from a contiguous or paged cache, the cache
// layouts an instance serves, and the views of its shared-memory tiles.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "cuda/decode/splitkv_tile_config.h"

namespace flash {

// cp.async of one 16-byte chunk; src_size 0 zero-fills the destination
// without reading the source, so masked-off rows cost no memory traffic and
// gmem_src may then point past the tensor (at the row or column it would
// have read), which spares a select per chunk.
__forceinline__ __device__ void cp_async_16_or_zero(void* smem_dst, const void* gmem_src,
                                                    bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  const int src_size = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src),
               "r"(src_size));
}

// Global -> shared copy of a tile whose rows live at unrelated addresses:
// row_ptr(tile_row) gives the first element of a row. Rows at or past
// num_rows and columns past head_dim are zero-filled.
template <typename TensorDst, typename TensorCoord, typename RowPtr, typename Element>
__forceinline__ __device__ void copy_rows_async(TensorDst& dst, const TensorCoord& coord,
                                                int num_rows, int head_dim,
                                                const Element* any_address, RowPtr row_ptr) {
  CUTE_UNROLL
  for (int m = 0; m < cute::size<1>(dst); ++m) {
    const int row = cute::get<0>(coord(0, m, 0));
    const bool row_ok = row < num_rows;
    const Element* src_row = row_ok ? row_ptr(row) : any_address;
    CUTE_UNROLL
    for (int k = 0; k < cute::size<2>(dst); ++k) {
      const int col = cute::get<1>(coord(0, m, k));
      const bool ok = row_ok && col < head_dim;
      cp_async_16_or_zero(&dst(0, m, k), ok ? src_row + col : any_address, ok);
    }
  }
}

// Which caches a kernel instance serves. The decode variant's plain kernel
// is compiled once per layout, so that each streams its tiles with only its
// own address arithmetic (decode spends its issue slots on the copies); the
// other instances take either, chosen per call.
enum class CacheLayout { kContiguous, kPaged, kEither };

// Shared memory: Traits::kStages (K tile, V tile) stages, so that the copies
// of the next tiles run while the current one is computed (decode does little
// math per byte; the kernel lives on the bytes it keeps in flight), then the
// Q slots, then (several items) the merge's own bytes, or (appending) the
// rotary table rows (splitkv_tile_config.h).
template <typename Traits, bool kSeveralItems>
struct SplitKvSmem {
  using Element = typename Traits::Element;
  static constexpr int kTileElems = cute::cosize_v<typename Traits::SmemLayoutKV>;
  static constexpr int kQElems = cute::cosize_v<typename Traits::SmemLayoutQ>;
  static_assert(kTileElems == Traits::kSmemSizeKV / 2 / int(sizeof(Element)) &&
                kQElems == Traits::kSmemSizeQ / int(sizeof(Element)));
  static constexpr int kQSlots = splitkv_q_slots(Traits::kWarpsN, kSeveralItems);

  Element* const kv_smem;
  Element* const q_smem;
  const int warp_n;  // which slab of keys of each tile
  const int warp_m;  // which 16 query rows

  __device__ SplitKvSmem(char* smem, int warp_n_, int warp_m_)
      : kv_smem(reinterpret_cast<Element*>(smem)),
        q_smem(reinterpret_cast<Element*>(smem) + 2 * Traits::kStages * kTileElems),
        warp_n(warp_n_),
        warp_m(warp_m_) {}

  static __device__ int next_q_slot(int slot) { return slot + 1 == kQSlots ? 0 : slot + 1; }
  // (M, D) of a Q slot, (N, D) of a stage's K or V tile.
  __device__ auto slot_q(int slot) const {
    return make_tensor(make_smem_ptr(q_smem + slot * kQElems), typename Traits::SmemLayoutQ{});
  }
  __device__ auto stage_k(int stage) const {
    return make_tensor(make_smem_ptr(kv_smem + (2 * stage) * kTileElems),
                       typename Traits::SmemLayoutKV{});
  }
  __device__ auto stage_v(int stage) const {
    return make_tensor(make_smem_ptr(kv_smem + (2 * stage + 1) * kTileElems),
                       typename Traits::SmemLayoutKV{});
  }
  // This warp's slab of a stage's K tile, (kSlabN, D), and V tile seen
  // transposed, (D, kSlabN), and its 16 rows of a Q slot, (16, D).
  __device__ auto slab_k(int stage) const {
    return make_tensor(
        make_smem_ptr(kv_smem + (2 * stage) * kTileElems + warp_n * Traits::kKVSlabElems),
        typename Traits::SmemLayoutKVSlab{});
  }
  __device__ auto slab_vt(int stage) const {
    return make_tensor(
        make_smem_ptr(kv_smem + (2 * stage + 1) * kTileElems + warp_n * Traits::kKVSlabElems),
        typename Traits::SmemLayoutVtSlab{});
  }
  __device__ auto slab_q(int slot) const {
    return make_tensor(make_smem_ptr(q_smem + slot * kQElems + warp_m * Traits::kQSlabElems),
                       typename Traits::SmemLayoutQSlab{});
  }
  // The first byte past the Q slots (the appending kernel's table rows).
  __device__ Element* past_q_slots() const { return q_smem + kQSlots * kQElems; }
};

}  // namespace flash
