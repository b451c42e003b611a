// The in-kernel append role of the split-KV kernel (splitkv_kernel.h,
// params.append_in_attention): the append and the rotation of a decode step,
// done in the attention kernel rather than in a kernel before it. A block
// copies its query rows and the new keys / values of its tiles (from new_k /
// new_v: it never reads back what another block writes) into shared memory
// with its first tile, rotates them there, and writes the new rows of its
// item's share into the cache from there.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>

#include "cuda/core/params.h"
#include "cuda/decode/rotary.h"
#include "cuda/decode/splitkv_mainloop.h"
#include "cuda/decode/splitkv_work_item.h"

namespace flash {

template <typename Traits, bool kSeveralItems>
struct SplitKvAppend {
  using Element = typename Traits::Element;
  using Smem = SplitKvSmem<Traits, kSeveralItems>;
  using RotaryElement =
      std::conditional_t<std::is_same_v<Element, cutlass::bfloat16_t>, __nv_bfloat16, __half>;
  static_assert(sizeof(RotaryElement) == sizeof(Element));
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kTableRowElems = kHeadDim;

  const KvcacheParams& params;
  const Smem smem;
  const int tidx;
  const int group;
  const bool appending;
  const bool rotating;
  // Past the Q slot: table row r holds the cosines, then the sines, of
  // position rotary_start + r (splitkv_append_smem_bytes), for the query rows
  // and the new keys.
  Element* const rotary_table_smem;

  // New row `new_row` of the item's (batch, kv head) in new_k or new_v.
  __device__ auto new_row_of(const void* tensor, const QKVStrides& strides, const SplitKvItem& it,
                             int new_row) const {
    return static_cast<const Element*>(tensor) + it.batch * strides.batch_stride +
           int64_t(new_row) * strides.row_stride + int64_t(it.head_kv) * strides.head_stride;
  }
  // The appending kernel's own shared memory, past the Q slot: table row r
  // holds the cosines, then the sines, of position rotary_start + r
  // (splitkv_append_smem_bytes), for the query rows and the new keys.
  // The item's new keys that lie in its tiles (none in the splits before the
  // last ones). The host sends a call here only when every new key is
  // visible to some query of the block (append_in_attention_fits), so its
  // split's share of them (append_key_begin / end) lies in there too.
  __device__ auto new_keys_in_tiles(const SplitKvItem& it) const {
    const int begin = max(it.seqlen_k - params.seqlen_new, it.n_block_min * kBlockN);
    return KeyRange{begin, max(begin, min(it.seqlen_k, it.n_block_max * kBlockN))};
  }
  // Where new key `key` lies in the prologue's stages (tile t of the item in
  // stage t).
  __device__ auto stage_of_key(const SplitKvItem& it, int key) const {
    return it.n_block_max - 1 - key / kBlockN;
  }

  // What the append and the rotation need, by cp.async before the prologue's
  // first commit, so that it arrives with the first tile: the new keys and
  // values of the item's tiles (from new_k / new_v, unrotated) in their
  // stages, and the table rows of the new keys' and query rows' positions.
  // Loaded any earlier, with plain loads, a block would start its copies a
  // memory latency later.
  __device__ void load_inputs(const SplitKvItem& it) const {
    const int first_new_key = it.seqlen_k - params.seqlen_new;
    if (appending) {
      constexpr int kChunksPerRow = kHeadDim / kRotaryChunkElems;
      const KeyRange keys = new_keys_in_tiles(it);
      for (int index = tidx; index < (keys.end - keys.begin) * kChunksPerRow;
           index += Traits::kNThreads) {
        const int key = keys.begin + index / kChunksPerRow;
        const int col = index % kChunksPerRow * kRotaryChunkElems;
        const int stage = stage_of_key(it, key);
        const int tile_row = key % kBlockN;
        // new_v has head_dim_v columns; the stage's columns past it are zeros,
        // as the producer leaves them for the cache's rows.
        cp_async_16_or_zero(
            &smem.stage_k(stage)(tile_row, col),
            new_row_of(params.new_k_ptr, params.new_k, it, key - first_new_key) + col,
            col < params.head_dim);
        cp_async_16_or_zero(
            &smem.stage_v(stage)(tile_row, col),
            new_row_of(params.new_v_ptr, params.new_v, it, key - first_new_key) + col,
            col < params.head_dim_v);
      }
    }
    if (rotating) {
      const int last_query = unpack_row(it.row_begin + it.rows_left - 1, group).query;
      const int table_rows = max(params.rotary_q_per_row ? last_query + 1 : 1, params.seqlen_new);
      const int chunks_per_table = params.rotary_dim / 2 / kRotaryChunkElems;
      const int64_t first_entry = int64_t(it.rotary_start) * (params.rotary_dim / 2);
      for (int index = tidx; index < table_rows * 2 * chunks_per_table;
           index += Traits::kNThreads) {
        const int row = index / (2 * chunks_per_table);
        const bool sines = index / chunks_per_table % 2 == 1;
        const int entry = index % chunks_per_table * kRotaryChunkElems;
        const Element* table =
            static_cast<const Element*>(sines ? params.rotary_sin_ptr : params.rotary_cos_ptr);
        cp_async_16_or_zero(
            rotary_table_smem + row * kTableRowElems + (sines ? kHeadDim / 2 : 0) + entry,
            table + first_entry + int64_t(row) * (params.rotary_dim / 2) + entry, true);
      }
    }
  }

  // The query rows (Q slot 0) and the item's new keys (in their stages)
  // rotated in place, once the first tile's group has brought them and the
  // table rows. A thread takes one 16-element rotation unit at a time, which
  // holds both halves of each pair it rotates (rotate_unit), so no thread
  // reads what another writes.
  __device__ void rotate_in_smem(const SplitKvItem& it) const {
    const int units_per_row = params.rotary_dim / 16;
    auto rotate = [&](auto&& tile, int tile_row, int unit, int table_row) {
      const int col_a = params.rotary_interleaved ? 16 * unit : 8 * unit;
      const int col_b = params.rotary_interleaved ? col_a + 8 : col_a + params.rotary_dim / 2;
      uint4* const a = reinterpret_cast<uint4*>(&tile(tile_row, col_a));
      uint4* const b = reinterpret_cast<uint4*>(&tile(tile_row, col_b));
      const Element* const cos_row = rotary_table_smem + table_row * kTableRowElems + 8 * unit;
      uint4 xa = *a, xb = *b;
      rotate_unit<RotaryElement>(xa, xb, *reinterpret_cast<const uint4*>(cos_row),
                                 *reinterpret_cast<const uint4*>(cos_row + kHeadDim / 2),
                                 params.rotary_interleaved);
      *a = xa;
      *b = xb;
    };
    // Query rows first, then new keys, in one loop: one inlined rotation.
    const int first_new_key = it.seqlen_k - params.seqlen_new;
    const KeyRange keys = new_keys_in_tiles(it);
    const int q_units = it.rows_left * units_per_row;
    const int units = q_units + (keys.end - keys.begin) * units_per_row;
    for (int index = tidx; index < units; index += Traits::kNThreads) {
      const bool is_query = index < q_units;
      const int row = (is_query ? index : index - q_units) / units_per_row;
      const int unit = index % units_per_row;
      if (is_query) {
        const int query = unpack_row(it.row_begin + row, group).query;
        rotate(smem.slot_q(0), row, unit, params.rotary_q_per_row ? query : 0);
      } else {
        const int key = keys.begin + row;
        rotate(smem.stage_k(stage_of_key(it, key)), key % kBlockN, unit, key - first_new_key);
      }
    }
  }

  // The new rows of the item's share into the cache (appending), from the
  // stages they were loaded (and rotated) into. Fire and forget: no block of
  // this grid reads them back.
  __device__ void append_to_cache(const SplitKvItem& it) const {
    constexpr int kChunksPerRow = kHeadDim / kRotaryChunkElems;
    const int chunks = (it.append_key_end - it.append_key_begin) * kChunksPerRow;
    Element* const k_cache = static_cast<Element*>(const_cast<void*>(params.k_ptr));
    Element* const v_cache = static_cast<Element*>(const_cast<void*>(params.v_ptr));
    for (int index = tidx; index < chunks; index += Traits::kNThreads) {
      const int key = it.append_key_begin + index / kChunksPerRow;
      const int col = index % kChunksPerRow * kRotaryChunkElems;
      if (col >= params.head_dim) continue;
      const int stage = stage_of_key(it, key);
      const int tile_row = key % kBlockN;
      const CacheRowAt at = cache_row_at(params, it.batch, it.cache, it.cache.leftpad + key);
      *reinterpret_cast<uint4*>(k_cache + cache_offset(at, it.head_kv, params.k) + col) =
          *reinterpret_cast<const uint4*>(&smem.stage_k(stage)(tile_row, col));
      // v_cache has head_dim_v columns (and may be a column slice of k_cache).
      if (col >= params.head_dim_v) continue;
      *reinterpret_cast<uint4*>(v_cache + cache_offset(at, it.head_kv, params.v) + col) =
          *reinterpret_cast<const uint4*>(&smem.stage_v(stage)(tile_row, col));
    }
  }
};

}  // namespace flash
