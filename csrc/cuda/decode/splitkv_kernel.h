// The split-KV (flash-decoding) forward kernel of fwd_kvcache. Its work items
// are (batch, kv head, query block, split) (splitkv_work_item.h): the query
// rows of all query heads that share the kv head are packed into the M
// dimension of the tile (packed row r = query i * group + g), so each K/V tile
// read from the cache serves the whole group. Split s walks its share of the
// key blocks and writes either the final output (one split) or an fp32
// partial output and its lse, merged afterwards by splitkv_combine_kernel.
//
// A thread block runs item blockIdx.x, then every gridDim.x-th item after it.
// Launched with one block per item, that is one item. Launched persistently
// (fewer blocks than items, one per SM) a block streams the K/V tiles of its
// items back to back: the copies of the next item's first tiles are in
// flight while the current item's last tiles are computed, and the item's
// output is merged and stored while the next item's tiles stream, so no SM
// waits out a block's start (Q, the first tile's latency) or a merge once
// per item.
//
// Differences from fwd_kernel_sm80.h: per-batch key counts (cache_seqlens,
// leftpad), K/V rows addressed one by one (a paged cache maps each row through
// the block table), the GQA packing of rows, which makes the row -> (query,
// head) mapping and hence the mask and ALiBi slope per row, and the warps:
// with few rows they split each K/V tile by keys, each running its own online
// softmax, and their rows are merged once at the end (SplitKvKernelTraits).
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "common/mask_rule.h"
#include "cuda/core/params.h"
#include "cuda/core/score_mods.h"
#include "cuda/core/softmax.h"
#include "cuda/core/tile_ops.h"
#include "cuda/decode/rotary.h"
#include "cuda/decode/splitkv_tile_config.h"
#include "cuda/decode/splitkv_work_item.h"
#include "cuda/fwd/sm80/fwd_kernel_traits_sm80.h"
#include "cuda/launch/dependent_launch.h"

namespace flash {

using namespace cute;

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
  for (int m = 0; m < size<1>(dst); ++m) {
    const int row = get<0>(coord(0, m, 0));
    const bool row_ok = row < num_rows;
    const Element* src_row = row_ok ? row_ptr(row) : any_address;
    CUTE_UNROLL
    for (int k = 0; k < size<2>(dst); ++k) {
      const int col = get<1>(coord(0, m, k));
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

// kSeveralItems: compiled for the persistent grid (a block may run several
// items); without it the block runs item blockIdx.x alone, and the grid must
// have a block per item. kAppends: compiled to do a decode step's append and
// rotary itself (params.append_in_attention); an instance of its own, so
// that the kernels of calls without them carry none of its code (with it
// compiled in and branched around, attention alone ran 0.4-1.2 us slower per
// call, though the main loop's machine code was the same; H100,
// benchmarks/results/NVIDIA_H100/decode_append_in_kernel_ab.txt).
template <typename Traits, bool kWithScoreExtras, CacheLayout kLayout, bool kSeveralItems,
          bool kAppends = false>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    flash_fwd_splitkv_kernel(const KvcacheParams params) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kWarpsN = Traits::kWarpsN;
  constexpr int kSlabN = Traits::kSlabN;
  constexpr int kStages = Traits::kStages;

  // Launched as a dependent grid (params.programmatic_launch), this block may
  // be running before the kernel ahead of it in the stream (the append /
  // rotary step, or the caller's) has finished: nothing here reads global
  // memory before the wait. The combine kernel (if any) may be scheduled as
  // soon as every block of this grid runs: it waits for this grid's results
  // itself, and its launch latency then overlaps this kernel instead of
  // following it.
  wait_for_preceding_grid();
  allow_dependent_grid_launch();

  extern __shared__ char smem[];
  const int tidx = threadIdx.x;
  const int lane = tidx % 32;
  const int warp_n = (tidx / 32) % kWarpsN;  // which slab of keys of each tile
  const int warp_m = (tidx / 32) / kWarpsN;  // which 16 query rows

  const int group = params.nheads / params.nheads_k;
  const int seqlen_q = params.seqlen_q;
  const int num_m_blocks = (seqlen_q * group + kBlockM - 1) / kBlockM;
  const int num_items = params.batch * params.nheads_k * num_m_blocks * params.num_splits;
  // The item a block runs after `item` (or `item` itself past the last one,
  // whose inputs are then loaded again, never used).
  auto next_item = [&](int item) {
    return num_items - item > int(gridDim.x) ? item + int(gridDim.x) : item;
  };
  auto item_at = [&](int item, const SplitKvItemInputs& inputs) {
    return splitkv_item<kBlockM, kBlockN>(params, item, num_m_blocks, inputs);
  };

  const Element* const q_ptr = static_cast<const Element*>(params.q_ptr);
  const Element* const k_ptr = static_cast<const Element*>(params.k_ptr);
  const Element* const v_ptr = static_cast<const Element*>(params.v_ptr);

  // The append and the rotation of a decode step, done here rather than in a
  // kernel before this one (params.append_in_attention): that kernel's run
  // and the wait for it cost a step 2.5-5 us, more than its copies. A block
  // copies its query rows and the new keys / values of its tiles (from
  // new_k / new_v: it never reads back what another block writes) into
  // shared memory with its first tile, rotates them there, and writes the
  // new rows of its item's share into the cache from there. The host leaves
  // the persistent grid, whose blocks would wait once per item, and the
  // other cases of append_in_attention_fits (flash_api_cuda.cpp) to the
  // pre-kernel.
  static_assert(!(kAppends && kSeveralItems),
                "the persistent grid leaves the append to a pre-kernel");
  const bool append_here = kAppends && params.append_in_attention;
  const bool appending = append_here && params.seqlen_new > 0;
  const bool rotating = append_here && params.rotary_dim > 0;
  using RotaryElement =
      std::conditional_t<std::is_same_v<Element, cutlass::bfloat16_t>, __nv_bfloat16, __half>;
  static_assert(sizeof(RotaryElement) == sizeof(Element));

  // Shared memory: Traits::kStages (K tile, V tile) stages, so that the
  // copies of the next tiles run while the current one is computed (decode
  // does little math per byte; the kernel lives on the bytes it keeps in
  // flight), then the Q slots, then (several items) the merge's own bytes
  // (splitkv_tile_config.h).
  constexpr int kTileElems = cosize_v<typename Traits::SmemLayoutKV>;
  constexpr int kQElems = cosize_v<typename Traits::SmemLayoutQ>;
  static_assert(kTileElems == Traits::kSmemSizeKV / 2 / int(sizeof(Element)) &&
                kQElems == Traits::kSmemSizeQ / int(sizeof(Element)));
  Element* const kv_smem = reinterpret_cast<Element*>(smem);
  Element* const q_smem = kv_smem + 2 * kStages * kTileElems;
  constexpr int q_slots = splitkv_q_slots(kWarpsN, kSeveralItems);
  auto next_q_slot = [&](int slot) { return slot + 1 == q_slots ? 0 : slot + 1; };
  auto slot_q = [&](int slot) {
    return make_tensor(make_smem_ptr(q_smem + slot * kQElems), typename Traits::SmemLayoutQ{});
  };
  auto stage_k = [&](int stage) {
    return make_tensor(make_smem_ptr(kv_smem + (2 * stage) * kTileElems),
                       typename Traits::SmemLayoutKV{});
  };
  auto stage_v = [&](int stage) {
    return make_tensor(make_smem_ptr(kv_smem + (2 * stage + 1) * kTileElems),
                       typename Traits::SmemLayoutKV{});
  };
  // This warp's slab of a stage's K tile (keys) and V tile (seen transposed),
  // and its 16 rows of a Q slot.
  auto slab_k = [&](int stage) {
    return make_tensor(
        make_smem_ptr(kv_smem + (2 * stage) * kTileElems + warp_n * Traits::kKVSlabElems),
        typename Traits::SmemLayoutKVSlab{});
  };
  auto slab_vt = [&](int stage) {
    return make_tensor(
        make_smem_ptr(kv_smem + (2 * stage + 1) * kTileElems + warp_n * Traits::kKVSlabElems),
        typename Traits::SmemLayoutVtSlab{});
  };
  auto slab_q = [&](int slot) {
    return make_tensor(make_smem_ptr(q_smem + slot * kQElems + warp_m * Traits::kQSlabElems),
                       typename Traits::SmemLayoutQSlab{});
  };

  typename Traits::GmemTiledCopyQKV gmem_tiled_copy_QKV;
  auto gmem_thr_copy_QKV = gmem_tiled_copy_QKV.get_thread_slice(tidx);
  Tensor cQ = make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{});
  Tensor cKV = make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor tQcQ = gmem_thr_copy_QKV.partition_S(cQ);
  Tensor tKVcKV = gmem_thr_copy_QKV.partition_S(cKV);
  constexpr int kCopyRows = decltype(size<1>(tKVcKV))::value;
  constexpr int kCopyCols = decltype(size<2>(tKVcKV))::value;

  auto load_q = [&](const SplitKvItem& it, int slot) {
    const Element* q_base = q_ptr + it.batch * params.q.batch_stride +
                            int64_t(it.head_kv) * group * params.q.head_stride;
    auto q_row = [&](int tile_row) {
      const PackedRow packed = unpack_row(it.row_begin + tile_row, group);
      return q_base + int64_t(packed.query) * params.q.row_stride +
             int64_t(packed.head_in_group) * params.q.head_stride;
    };
    Tensor tQsQ = gmem_thr_copy_QKV.partition_D(slot_q(slot));
    copy_rows_async(tQsQ, tQcQ, it.rows_left, params.head_dim, q_base, q_row);
  };

  // Paged cache: location of this thread's K/V copy rows of the tile being
  // located. The block table is read once per distinct page (a page of 64
  // rows or more holds all of a thread's rows of a tile); row_page[m] is left
  // stale when row m shares row m - 1's page, and the rows are resolved when
  // the copies are issued, a tile later: no instruction waits on a table read
  // in between (a copy of the loaded value from row to row would).
  int row_page[kCopyRows];
  int row_in_page[kCopyRows];
  bool row_shares_page[kCopyRows];
  auto is_paged = [&](const SplitKvItem& it) {
    return kLayout == CacheLayout::kPaged ||
           (kLayout == CacheLayout::kEither && it.cache.block_table_row != nullptr);
  };
  auto locate_tile = [&](const SplitKvItem& it, int n_block) {
    if (!is_paged(it)) return;
    const int key0 = n_block * kBlockN;
    int previous_index = -1;
    CUTE_UNROLL
    for (int m = 0; m < kCopyRows; ++m) {
      const int key = key0 + get<0>(tKVcKV(0, m, 0));
      int page_index;
      it.cache.page_size.divmod(it.cache.leftpad + key, page_index, row_in_page[m]);
      row_shares_page[m] = page_index == previous_index;
      if (!row_shares_page[m]) {
        row_page[m] =
            key < it.seqlen_k
                ? guarded_page(params.index_errors, IndexOp::kKvcache, it.batch, page_index,
                               it.cache.block_table_row[page_index], params.num_pages)
                : 0;
      }
      previous_index = page_index;
    }
  };
  // Contiguous cache: a thread's copy rows of a tile are kCopyRowStep keys
  // apart, so one address per tile and a fixed step locate them all.
  constexpr int kCopyRowStep = Traits::kNThreads / Traits::FwdTraits::kGmemThreadsPerRow;
  static_assert(kCopyRows * kCopyRowStep == kBlockN, "one copy pass covers kCopyRowStep rows");
  const int64_t k_row_step = int64_t(kCopyRowStep) * params.k.row_stride;
  const int64_t v_row_step = int64_t(kCopyRowStep) * params.v.row_stride;
  // New row `new_row` of the item's (batch, kv head) in new_k or new_v.
  auto new_row_of = [&](const void* tensor, const QKVStrides& strides, const SplitKvItem& it,
                        int new_row) {
    return static_cast<const Element*>(tensor) + it.batch * strides.batch_stride +
           int64_t(new_row) * strides.row_stride + int64_t(it.head_kv) * strides.head_stride;
  };
  // K and V of one tile into one stage. Rows past the keys and columns past
  // head_dim are zero-filled (zeros, not stale data: P V multiplies them by 0).
  // In the prologue (in_prologue), rows from the item's first new row on are
  // left to load_append_inputs when the kernel appends: nothing else may write
  // their bytes. The new rows are the last keys, so they lie in an item's
  // first tiles (the walk runs from the last key block down), all loaded by
  // the prologue; the main loop keeps the plain copy loop.
  static_assert(kAppendInAttentionMaxRows <= kBlockN && kStages >= 2,
                "new rows span at most two key blocks, both loaded by the prologue");
  auto load_tile = [&](const SplitKvItem& it, int n_block, int stage, auto in_prologue) {
    constexpr bool kMaySkipNewRows = decltype(in_prologue)::value;
    Tensor tKsK = gmem_thr_copy_QKV.partition_D(stage_k(stage));
    Tensor tVsV = gmem_thr_copy_QKV.partition_D(stage_v(stage));
    const Element* k_base = k_ptr + int64_t(it.head_kv) * params.k.head_stride;
    const Element* v_base = v_ptr + int64_t(it.head_kv) * params.v.head_stride;
    const int rows_in_tile = it.seqlen_k - n_block * kBlockN;
    const int new_rows_from =
        appending ? it.seqlen_k - params.seqlen_new - n_block * kBlockN : rows_in_tile;
    auto copy_row = [&](int m, const Element* k_row, const Element* v_row) {
      const int row = get<0>(tKVcKV(0, m, 0));
      const bool row_ok = row < rows_in_tile;
      if (kMaySkipNewRows && row_ok && row >= new_rows_from) return;
      CUTE_UNROLL
      for (int k = 0; k < kCopyCols; ++k) {
        const int col = get<1>(tKVcKV(0, m, k));
        const bool ok = row_ok && col < params.head_dim;
        cp_async_16_or_zero(&tKsK(0, m, k), k_row + col, ok);
        cp_async_16_or_zero(&tVsV(0, m, k), v_row + col, ok);
      }
    };
    if (is_paged(it)) {
      int64_t page = 0;
      CUTE_UNROLL
      for (int m = 0; m < kCopyRows; ++m) {
        page = row_shares_page[m] ? page : int64_t(row_page[m]);
        const int64_t in_page = row_in_page[m];
        copy_row(m, k_base + page * params.k.batch_stride + in_page * params.k.row_stride,
                 v_base + page * params.v.batch_stride + in_page * params.v.row_stride);
      }
    } else {
      const int64_t first_pos = it.cache.leftpad + n_block * kBlockN + get<0>(tKVcKV(0, 0, 0));
      const Element* k_row = k_base + int64_t(it.cache.entry) * params.k.batch_stride +
                             first_pos * params.k.row_stride;
      const Element* v_row = v_base + int64_t(it.cache.entry) * params.v.batch_stride +
                             first_pos * params.v.row_stride;
      CUTE_UNROLL
      for (int m = 0; m < kCopyRows; ++m) {
        copy_row(m, k_row, v_row);
        k_row += k_row_step;
        v_row += v_row_step;
      }
    }
  };

  // The appending kernel's own shared memory, past the Q slot: table row r
  // holds the cosines, then the sines, of position cache_seqlen + r
  // (splitkv_append_smem_bytes), for the query rows and the new keys.
  Element* const rotary_table_smem = q_smem + q_slots * kQElems;
  constexpr int kTableRowElems = kHeadDim;
  static_assert(!kAppends || q_slots == 1, "one Q slot before the table rows");
  // The item's new keys that lie in its tiles (none in the splits before the
  // last ones). The host sends a call here only when every new key is
  // visible to some query of the block (append_in_attention_fits), so its
  // split's share of them (append_key_begin / end) lies in there too.
  auto new_keys_in_tiles = [&](const SplitKvItem& it) {
    const int begin = max(it.seqlen_k - params.seqlen_new, it.n_block_min * kBlockN);
    return KeyRange{begin, max(begin, min(it.seqlen_k, it.n_block_max * kBlockN))};
  };
  // Where new key `key` lies in the prologue's stages (tile t of the item in
  // stage t).
  auto stage_of_key = [&](const SplitKvItem& it, int key) {
    return it.n_block_max - 1 - key / kBlockN;
  };

  // What the append and the rotation need, by cp.async before the prologue's
  // first commit, so that it arrives with the first tile: the new keys and
  // values of the item's tiles (from new_k / new_v, unrotated) in their
  // stages, and the table rows of the new keys' and query rows' positions.
  // Loaded any earlier, with plain loads, a block would start its copies a
  // memory latency later.
  auto load_append_inputs = [&](const SplitKvItem& it) {
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
        const bool ok = col < params.head_dim;
        cp_async_16_or_zero(
            &stage_k(stage)(tile_row, col),
            new_row_of(params.new_k_ptr, params.new_k, it, key - first_new_key) + col, ok);
        cp_async_16_or_zero(
            &stage_v(stage)(tile_row, col),
            new_row_of(params.new_v_ptr, params.new_v, it, key - first_new_key) + col, ok);
      }
    }
    if (rotating) {
      const int last_query = unpack_row(it.row_begin + it.rows_left - 1, group).query;
      const int table_rows = max(params.rotary_q_per_row ? last_query + 1 : 1, params.seqlen_new);
      const int chunks_per_table = params.rotary_dim / 2 / kRotaryChunkElems;
      const int64_t first_entry =
          int64_t(it.cache.leftpad + first_new_key) * (params.rotary_dim / 2);
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
  };

  // The query rows (Q slot 0) and the item's new keys (in their stages)
  // rotated in place, once the first tile's group has brought them and the
  // table rows. A thread takes one 16-element rotation unit at a time, which
  // holds both halves of each pair it rotates (rotate_unit), so no thread
  // reads what another writes.
  auto rotate_in_smem = [&](const SplitKvItem& it) {
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
        rotate(slot_q(0), row, unit, params.rotary_q_per_row ? query : 0);
      } else {
        const int key = keys.begin + row;
        rotate(stage_k(stage_of_key(it, key)), key % kBlockN, unit, key - first_new_key);
      }
    }
  };

  // The new rows of the item's share into the cache (appending), from the
  // stages they were loaded (and rotated) into. Fire and forget: no block of
  // this grid reads them back.
  auto append_to_cache = [&](const SplitKvItem& it) {
    constexpr int kChunksPerRow = kHeadDim / kRotaryChunkElems;
    const int chunks = (it.append_key_end - it.append_key_begin) * kChunksPerRow;
    Element* const k_cache = const_cast<Element*>(k_ptr);
    Element* const v_cache = const_cast<Element*>(v_ptr);
    for (int index = tidx; index < chunks; index += Traits::kNThreads) {
      const int key = it.append_key_begin + index / kChunksPerRow;
      const int col = index % kChunksPerRow * kRotaryChunkElems;
      if (col >= params.head_dim) continue;
      const int stage = stage_of_key(it, key);
      const int tile_row = key % kBlockN;
      const CacheRowAt at = cache_row_at(params, it.batch, it.cache, it.cache.leftpad + key);
      *reinterpret_cast<uint4*>(k_cache + cache_offset(at, it.head_kv, params.k) + col) =
          *reinterpret_cast<const uint4*>(&stage_k(stage)(tile_row, col));
      *reinterpret_cast<uint4*>(v_cache + cache_offset(at, it.head_kv, params.v) + col) =
          *reinterpret_cast<const uint4*>(&stage_v(stage)(tile_row, col));
    }
  };

  // The stream of copies: the key tiles of this block's items, item after
  // item, each from its last key block down (so that the block on a causal
  // diagonal comes first), an item's Q with its first tile. Items without
  // keys are skipped: they only write their empty output. Tile t of the
  // stream lives in stage t % kStages and is commit group t; every step
  // commits one group, empty or not, so "all but the newest kStages - 1
  // groups done" always means "the tile about to be computed is here".
  // With several items, the inputs of the stream's next item are loaded one
  // item ahead.
  const SplitKvItem first_item = item_at(blockIdx.x, splitkv_item_inputs(params, blockIdx.x));
  SplitKvItem load_item_work = first_item;
  int load_item = blockIdx.x;
  int load_n_block = first_item.n_block_max - 1;
  int load_q_slot = first_item.has_keys() ? 0 : q_slots - 1;
  SplitKvItemInputs load_next_inputs{};
  if constexpr (kSeveralItems) {
    load_next_inputs = splitkv_item_inputs(params, next_item(load_item));
  }
  // To the next item with keys, or past the last item.
  auto advance_load_item = [&] {
    if constexpr (kSeveralItems) {
      do {
        load_item += gridDim.x;
        if (load_item >= num_items) return;
        load_item_work = item_at(load_item, load_next_inputs);
        load_next_inputs = splitkv_item_inputs(params, next_item(load_item));
      } while (!load_item_work.has_keys());
      load_n_block = load_item_work.n_block_max - 1;
      load_q_slot = next_q_slot(load_q_slot);
      locate_tile(load_item_work, load_n_block);
    } else {
      load_item = num_items;
    }
  };
  auto load_next_tile = [&](int stage, auto in_prologue) {
    if (load_item < num_items) {
      if (load_n_block == load_item_work.n_block_max - 1) load_q(load_item_work, load_q_slot);
      load_tile(load_item_work, load_n_block, stage, in_prologue);
      if (--load_n_block >= load_item_work.n_block_min) {
        locate_tile(load_item_work, load_n_block);
      } else {
        advance_load_item();
      }
    }
    cute::cp_async_fence();
  };

  if (first_item.has_keys()) {
    locate_tile(first_item, load_n_block);
    if (append_here) load_append_inputs(first_item);
  } else {
    advance_load_item();
  }
  CUTE_UNROLL
  for (int stage = 0; stage < kStages; ++stage) load_next_tile(stage, std::true_type{});
  // The append's work waits for the first tile's group, which the first tile
  // step waits for anyway; the other stages stay in flight meanwhile.
  if (append_here && first_item.has_keys()) {
    cute::cp_async_wait<kStages - 1>();
    __syncthreads();
    if (rotating) {
      rotate_in_smem(first_item);
      __syncthreads();
    }
    if (appending) append_to_cache(first_item);
  }

  // Each warp multiplies its 16 query rows by its slab of keys on its own.
  typename Traits::WarpMma warp_mma;
  auto thr_mma = warp_mma.get_thread_slice(lane);
  Tensor tSrQ = thr_mma.partition_fragment_A(slab_q(0));
  Tensor tSrK = thr_mma.partition_fragment_B(slab_k(0));
  Tensor tOrVt = thr_mma.partition_fragment_B(
      make_tensor(make_smem_ptr(kv_smem), typename Traits::SmemLayoutVtSlabNoSwizzle{}));
  Tensor acc_o = partition_fragment_C(warp_mma, Shape<_16, Int<kHeadDim>>{});

  auto smem_tiled_copy_Q = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, warp_mma);
  auto smem_thr_copy_Q = smem_tiled_copy_Q.get_thread_slice(lane);
  auto smem_tiled_copy_K = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, warp_mma);
  auto smem_thr_copy_K = smem_tiled_copy_K.get_thread_slice(lane);
  auto smem_tiled_copy_V = make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, warp_mma);
  auto smem_thr_copy_V = smem_tiled_copy_V.get_thread_slice(lane);

  // (row, col) of each accumulator element within the warp's 16 x kSlabN
  // scores; the warp's rows start at warp_row0 of the tile, its keys at
  // warp_n * kSlabN of each key tile.
  Tensor cS = make_identity_tensor(Shape<_16, Int<kSlabN>>{});
  Tensor tScS = thr_mma.partition_C(cS);
  Tensor tScS_rowcol = make_tensor(tScS.data(), acc_layout_as_rowcol(tScS.layout()));
  Tensor acc_o_rowcol = make_tensor(acc_o.data(), acc_layout_as_rowcol(acc_o.layout()));
  Tensor tOcO = thr_mma.partition_C(make_identity_tensor(Shape<_16, Int<kHeadDim>>{}));
  Tensor tOcO_rowcol = make_tensor(tOcO.data(), acc_layout_as_rowcol(tOcO.layout()));
  constexpr int kNRows = decltype(size<0>(acc_o_rowcol))::value;
  static_assert(kNRows == 2, "a thread holds two rows of the warp's 16");
  const int warp_row0 = 16 * warp_m;
  const int warp_col0 = kSlabN * warp_n;

  // The merge of the warps that share rows (one per key slab), in two steps
  // through shared memory. First each warp leaves, for each of its real rows,
  // its output row as it stands (not yet normalised) in o_parts and its
  // (row max, row sum) in row_stats; no barrier is needed for that. Then,
  // once a barrier has made them visible, every thread weighs and sums the
  // slabs' parts of a few output chunks and stores them with wide, coalesced
  // writes. A block of one item merges in the tiles' bytes. A block of
  // several merges in bytes of its own and puts the second step of an item
  // into its next item's first tile step, after that step's copies are
  // issued: until then no copy would be issued, and a stream that pauses once
  // per item loses its bandwidth for that long (H200, 1024 items of 1k keys:
  // 5% of the time with the whole merge between two items).
  constexpr int kPartStride = splitkv_merge_row_floats(kHeadDim);
  static_assert(splitkv_merge_bytes(kHeadDim, kWarpsN) <=
                    Traits::kSmemSizeQ + Traits::kStages * Traits::kSmemSizeKV,
                "a block of one item merges in its tiles' shared memory");
  float* const o_parts =
      reinterpret_cast<float*>(kSeveralItems ? smem + splitkv_smem_bytes(kHeadDim, kWarpsN, true) -
                                                   splitkv_merge_bytes(kHeadDim, kWarpsN)
                                             : smem);
  float2* const row_stats = reinterpret_cast<float2*>(o_parts + kWarpsN * kBlockM * kPartStride);

  const bool has_alibi = kWithScoreExtras && params.alibi_slopes != nullptr;
  const bool prescale_scores =
      kWithScoreExtras &&
      (params.softcap > 0.f || has_alibi || !scale_is_positive_normal(params.softmax_scale_log2));
  const float exp_scale_log2 = prescale_scores ? float(M_LOG2E) : params.softmax_scale_log2;
  const float lse_scale = prescale_scores ? 1.f : params.softmax_scale;
  // A row that saw no key in this block's range gets output 0 and lse +inf
  // (final) or -inf (a partial result that must weigh nothing in the merge).
  const bool final_output = params.num_splits == 1;
  const int64_t rows_per_split = int64_t(params.batch) * params.nheads * seqlen_q;

  // Where an item's results go: what the second step of its merge needs,
  // kept while the block goes on to its next item.
  struct MergeTarget {
    int batch, head_kv, split, row_begin, rows_left;
  };
  // Step 2, by every thread: output chunks of 4 columns, each the slabs'
  // parts weighted by their share of the row's softmax over all slabs, to
  // the final output (16-bit) or to this split's fp32 partial output; the
  // thread of a row's first chunk also writes its lse.
  auto combine_parts = [&](const MergeTarget& target) {
    constexpr int kChunksPerRow = kHeadDim / 4;
    CUTE_UNROLL
    for (int chunk = tidx; chunk < kBlockM * kChunksPerRow; chunk += Traits::kNThreads) {
      const int tile_row = chunk / kChunksPerRow;
      const int col = (chunk % kChunksPerRow) * 4;
      if (tile_row >= target.rows_left) break;  // the rows run in order
      if (col >= params.head_dim) continue;
      float2 stats[kWarpsN];
      float max_all = -INFINITY;
      CUTE_UNROLL
      for (int w = 0; w < kWarpsN; ++w) {
        stats[w] = row_stats[tile_row * kWarpsN + w];
        max_all = fmaxf(max_all, stats[w].x);
      }
      const float max_scaled = scaled_row_max(max_all, exp_scale_log2);
      float sum_all = 0.f;
      CUTE_UNROLL
      for (int w = 0; w < kWarpsN; ++w) {
        stats[w].x = exp2f(stats[w].x * exp_scale_log2 - max_scaled);  // the slab's rescale
        sum_all += stats[w].x * stats[w].y;
      }
      const bool empty = row_is_empty(max_all, sum_all);
      const float inv_sum = empty ? 0.f : 1.f / sum_all;
      float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
      CUTE_UNROLL
      for (int w = 0; w < kWarpsN; ++w) {
        const float weight = stats[w].x * inv_sum;
        const float4 part = *reinterpret_cast<const float4*>(
            o_parts + (w * kBlockM + tile_row) * kPartStride + col);
        sum.x += weight * part.x;
        sum.y += weight * part.y;
        sum.z += weight * part.z;
        sum.w += weight * part.w;
      }
      const PackedRow packed = unpack_row(target.row_begin + tile_row, group);
      const int head = target.head_kv * group + packed.head_in_group;
      const int64_t lse_index =
          (int64_t(target.batch) * params.nheads + head) * seqlen_q + packed.query;
      if (final_output) {
        Element* out_row =
            static_cast<Element*>(params.o_ptr) + target.batch * params.o.batch_stride +
            int64_t(packed.query) * params.o.row_stride + int64_t(head) * params.o.head_stride;
        cutlass::Array<Element, 4> quad;
        quad[0] = static_cast<Element>(sum.x);
        quad[1] = static_cast<Element>(sum.y);
        quad[2] = static_cast<Element>(sum.z);
        quad[3] = static_cast<Element>(sum.w);
        *reinterpret_cast<cutlass::Array<Element, 4>*>(out_row + col) = quad;
      } else {
        const int64_t partial_row = target.split * rows_per_split + lse_index;
        *reinterpret_cast<float4*>(params.out_accum_ptr + partial_row * kHeadDim + col) = sum;
      }
      if (col == 0) {
        const float lse = row_lse(max_all, sum_all, lse_scale);
        if (final_output) {
          params.softmax_lse_ptr[lse_index] = lse;
        } else {
          params.lse_accum_ptr[target.split * rows_per_split + lse_index] =
              lse == INFINITY ? -INFINITY : lse;
        }
      }
    }
  };
  // The item whose merge waits for its second step (several items).
  MergeTarget pending_merge{};
  bool merge_pending = false;

  int stage = 0;
  int q_slot = q_slots - 1;
  SplitKvItemInputs next_inputs{};
  if constexpr (kSeveralItems) next_inputs = splitkv_item_inputs(params, next_item(blockIdx.x));
  for (int item = blockIdx.x; item < num_items; item += gridDim.x) {
    SplitKvItem it = first_item;
    if constexpr (kSeveralItems) {
      if (item != int(blockIdx.x)) {
        it = item_at(item, next_inputs);
        next_inputs = splitkv_item_inputs(params, next_item(item));  // in flight while `it` runs
      }
    }
    const int seqlen_k = it.seqlen_k;
    // Decode packs only seqlen_q x group rows (often 4-8): a warp whose rows
    // are all padding skips the MMAs and their shared-memory reads. No
    // barrier sits inside the skipped part, and its rows are never written.
    const bool warp_has_rows = warp_row0 < it.rows_left;

    // Per-row query index and (ALiBi) slope: packed rows of one tile belong
    // to different query heads.
    int row_query[kNRows];
    float row_slope[kNRows];
    CUTE_UNROLL
    for (int mi = 0; mi < kNRows; ++mi) {
      const int row = it.row_begin + warp_row0 + get<0>(tScS_rowcol(mi, 0));
      const PackedRow packed = unpack_row(row, group);
      row_query[mi] = packed.query;
      row_slope[mi] = has_alibi && row < it.row_begin + it.rows_left
                          ? params.alibi_slopes[it.batch * params.alibi_batch_stride +
                                                it.head_kv * group + packed.head_in_group]
                          : 0.f;
    }

    OnlineSoftmax<kNRows> softmax;
    clear(acc_o);
    if (it.has_keys()) q_slot = next_q_slot(q_slot);
    Tensor tSsQ = smem_thr_copy_Q.partition_S(slab_q(q_slot));

    for (int n_block = it.n_block_max - 1; n_block >= it.n_block_min; --n_block) {
      cute::cp_async_wait<kStages - 1>();
      __syncthreads();

      if (warp_has_rows) {
        Tensor acc_s = partition_fragment_C(warp_mma, Shape<_16, Int<kSlabN>>{});
        clear(acc_s);
        Tensor tSsK = smem_thr_copy_K.partition_S(slab_k(stage));
        gemm_smem_smem(acc_s, tSrQ, tSrK, tSsQ, tSsK, warp_mma, smem_tiled_copy_Q,
                       smem_tiled_copy_K, smem_thr_copy_Q, smem_thr_copy_K);

        Tensor scores = make_tensor(acc_s.data(), acc_layout_as_rowcol(acc_s.layout()));
        const int col_base = n_block * kBlockN + warp_col0;
        if (prescale_scores) {
          apply_scale_and_softcap(scores, params.softmax_scale, params.softcap);
          if (has_alibi) {
            CUTE_UNROLL
            for (int mi = 0; mi < kNRows; ++mi) {
              CUTE_UNROLL
              for (int ni = 0; ni < size<1>(scores); ++ni) {
                const int col = col_base + get<1>(tScS_rowcol(0, ni));
                scores(mi, ni) += alibi_bias(row_slope[mi], row_query[mi], col, seqlen_q, seqlen_k);
              }
            }
          }
        }
        if (!key_tile_fully_visible(it.query_first, it.query_last + 1, n_block * kBlockN,
                                    (n_block + 1) * kBlockN, seqlen_q, seqlen_k, params.window_left,
                                    params.window_right)) {
          CUTE_UNROLL
          for (int mi = 0; mi < kNRows; ++mi) {
            const KeyRange visible =
                visible_key_range(row_query[mi], row_query[mi] + 1, seqlen_q, seqlen_k,
                                  params.window_left, params.window_right);
            const int col_lo = visible.begin - col_base;
            const int col_hi = visible.end - col_base;
            CUTE_UNROLL
            for (int ni = 0; ni < size<1>(scores); ++ni) {
              const int col = get<1>(tScS_rowcol(0, ni));
              if (col < col_lo || col >= col_hi) scores(mi, ni) = -INFINITY;
            }
          }
        }

        softmax.update(scores, acc_o_rowcol, exp_scale_log2);

        Tensor rP = convert_type<Element>(acc_s);
        Tensor tOrP = make_tensor(rP.data(), acc_layout_as_operand_a(rP.layout()));
        Tensor tOsVt = smem_thr_copy_V.partition_S(slab_vt(stage));
        gemm_reg_smem(acc_o, tOrP, tOrVt, tOsVt, warp_mma, smem_tiled_copy_V, smem_thr_copy_V);
      }

      // Every warp is done with this stage before it is refilled.
      __syncthreads();
      load_next_tile(stage, std::false_type{});
      stage = stage == kStages - 1 ? 0 : stage + 1;
      if (kSeveralItems && merge_pending) {
        combine_parts(pending_merge);  // the parts were written before this step's barriers
        merge_pending = false;
      }
    }

    // Step 1 of the merge. A block of one item writes over its tiles, which
    // every warp is done with after the loop's last barrier. A block of
    // several makes sure that no thread still reads the previous item's
    // parts: its second step ran in this item's first tile step, and the
    // barriers of a second step (if any) separate the two.
    const int tile_steps = it.n_block_max - it.n_block_min;
    if constexpr (kSeveralItems) {
      if (merge_pending) {  // this item had no tile step to run it in
        __syncthreads();
        combine_parts(pending_merge);
        merge_pending = false;
      }
      if (tile_steps < 2) __syncthreads();
    }
    if (warp_has_rows) {
      CUTE_UNROLL
      for (int mi = 0; mi < kNRows; ++mi) {
        const float row_sum = quad_allreduce_sum(softmax.row_sum[mi]);
        const int tile_row = warp_row0 + get<0>(tScS_rowcol(mi, 0));
        if (tile_row >= it.rows_left) continue;
        if (lane % 4 == 0) {
          row_stats[tile_row * kWarpsN + warp_n] = make_float2(softmax.row_max[mi], row_sum);
        }
        float* part_row = o_parts + (warp_n * kBlockM + tile_row) * kPartStride;
        CUTE_UNROLL
        for (int ni = 0; ni < size<1>(acc_o_rowcol); ni += 2) {
          const int col = get<1>(tOcO_rowcol(0, ni));
          *reinterpret_cast<float2*>(part_row + col) =
              make_float2(acc_o_rowcol(mi, ni), acc_o_rowcol(mi, ni + 1));
        }
      }
    }
    const MergeTarget target{it.batch, it.head_kv, it.split, it.row_begin, it.rows_left};
    if constexpr (kSeveralItems) {
      pending_merge = target;
      merge_pending = true;
    } else {
      __syncthreads();
      combine_parts(target);
    }
    if constexpr (!kSeveralItems) break;
  }
  if (kSeveralItems && merge_pending) {
    __syncthreads();
    combine_parts(pending_merge);
  }
}

}  // namespace flash
