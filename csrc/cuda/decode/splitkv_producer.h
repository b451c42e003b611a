// The producer roles of the split-KV kernel (splitkv_kernel.h): the cp.async
// copies of Q and of the K/V tiles from the cache, contiguous or paged, into
// the shared-memory stages, and the stream that orders them.
//
// SplitKvTileLoader copies one tile (and locates the rows of a paged one),
// SplitKvItemAdvance moves the stream to the block's next item with keys, and
// SplitKvProducer issues the stream's next tile. The stream's position, the
// copy partitions and the paged rows stay the kernel's locals, which the roles
// refer to: held in the roles (or with the three roles one type), they change
// the kernel's machine code.
#pragma once

#include <cstdint>
#include <utility>

#include <cute/tensor.hpp>

#include "cuda/core/fp8_convert.h"
#include "cuda/core/fp8_fragments.h"
#include "cuda/core/index_guards.h"
#include "cuda/core/params.h"
#include "cuda/decode/splitkv_mainloop.h"
#include "cuda/decode/splitkv_scheduler.h"
#include "cuda/decode/splitkv_tile_config.h"
#include "cuda/decode/splitkv_work_item.h"

namespace flash {

// This thread's slice of the global -> shared copies of Q and the K/V tiles,
// and the (row, col) of its copy elements in a Q or K/V tile.
template <typename Traits>
struct SplitKvGmemPartition {
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  using GmemTiledCopyQKV = typename Traits::GmemTiledCopyQKV;
  using GmemThrCopyQKV = decltype(GmemTiledCopyQKV{}.get_thread_slice(0));
  // (M,D) and (N,D) -> (row,col)
  using IdentityQ = decltype(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using IdentityKV = decltype(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  template <typename T>
  using PartitionS =
      decltype(std::declval<const GmemThrCopyQKV&>().partition_S(std::declval<T&>()));

  GmemTiledCopyQKV gmem_tiled_copy_QKV;
  GmemThrCopyQKV gmem_thr_copy_QKV;
  PartitionS<IdentityQ> tQcQ;     // (CPY,CPY_M,CPY_D) -> (row,col)
  PartitionS<IdentityKV> tKVcKV;  // (CPY,CPY_N,CPY_D) -> (row,col)

  __forceinline__ __device__ explicit SplitKvGmemPartition(int tidx)
      : gmem_thr_copy_QKV(gmem_tiled_copy_QKV.get_thread_slice(tidx)),
        tQcQ(gmem_thr_copy_QKV.partition_S(
            make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}))),
        tKVcKV(gmem_thr_copy_QKV.partition_S(
            make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}))) {}
};

template <typename Traits, CacheLayout kLayout, bool kSeveralItems, bool kAppends>
struct SplitKvTileLoader {
  using Element = typename Traits::Element;
  using CacheElement = typename Traits::CacheElement;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kStages = Traits::kStages;
  using Smem = SplitKvSmem<Traits, kSeveralItems>;

  using GmemThrCopyQKV = decltype(typename Traits::GmemTiledCopyQKV{}.get_thread_slice(0));
  using IdentityQ = decltype(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using IdentityKV = decltype(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // The type of this thread's copy partition of a tile of type T.
  template <typename T>
  using GmemPartitionS =
      decltype(std::declval<const GmemThrCopyQKV&>().partition_S(std::declval<T&>()));
  static constexpr int kCopyRows = decltype(size<1>(GmemPartitionS<IdentityKV>{}))::value;
  static constexpr int kCopyCols = decltype(size<2>(GmemPartitionS<IdentityKV>{}))::value;

  // Contiguous cache: a thread's copy rows of a tile are kCopyRowStep keys
  // apart, so one address per tile and a fixed step locate them all.
  static constexpr int kCopyRowStep = Traits::kNThreads / Traits::FwdTraits::kGmemThreadsPerRow;
  static_assert(kCopyRows * kCopyRowStep == kBlockN, "one copy pass covers kCopyRowStep rows");
  // The prologue leaves the new rows to the append (load_tile).
  static_assert(kAppendInAttentionMaxRows <= kBlockN && kStages >= 2,
                "new rows span at most two key blocks, both loaded by the prologue");

  const KvcacheParams& params;
  const Smem& smem_tiles;
  const Element* const q_ptr;
  const CacheElement* const k_ptr;
  const CacheElement* const v_ptr;
  const int group;
  const bool appending;
  GmemThrCopyQKV& gmem_thr_copy_QKV;
  GmemPartitionS<IdentityQ>& tQcQ;     // (CPY,CPY_M,CPY_D) -> (row,col)
  GmemPartitionS<IdentityKV>& tKVcKV;  // (CPY,CPY_N,CPY_D) -> (row,col)
  // Paged cache: the kernel's row_page, row_in_page and row_shares_page.
  int (&row_page)[kCopyRows];
  int (&row_in_page)[kCopyRows];
  bool (&row_shares_page)[kCopyRows];
  const int64_t k_row_step;
  const int64_t v_row_step;

  __device__ SplitKvTileLoader(const KvcacheParams& params_, const Smem& smem_tiles_, int group_,
                               bool appending_, GmemThrCopyQKV& gmem_thr_copy_QKV_,
                               GmemPartitionS<IdentityQ>& tQcQ_,
                               GmemPartitionS<IdentityKV>& tKVcKV_, int (&row_page_)[kCopyRows],
                               int (&row_in_page_)[kCopyRows], bool (&row_shares_page_)[kCopyRows])
      : params(params_),
        smem_tiles(smem_tiles_),
        q_ptr(static_cast<const Element*>(params_.q_ptr)),
        k_ptr(static_cast<const CacheElement*>(params_.k_ptr)),
        v_ptr(static_cast<const CacheElement*>(params_.v_ptr)),
        group(group_),
        appending(appending_),
        gmem_thr_copy_QKV(gmem_thr_copy_QKV_),
        tQcQ(tQcQ_),
        tKVcKV(tKVcKV_),
        row_page(row_page_),
        row_in_page(row_in_page_),
        row_shares_page(row_shares_page_),
        k_row_step(int64_t(kCopyRowStep) * params_.k.row_stride),
        v_row_step(int64_t(kCopyRowStep) * params_.v.row_stride) {}

  __device__ bool is_paged(const SplitKvItem& it) const {
    return kLayout == CacheLayout::kPaged ||
           (kLayout == CacheLayout::kEither && it.cache.block_table_row != nullptr);
  }

  // The item's Q rows into Q slot `slot`.
  __device__ void load_q(const SplitKvItem& it, int slot) {
    const Element* q_base = q_ptr + it.batch * params.q.batch_stride +
                            int64_t(it.q_row0) * params.q.row_stride +
                            int64_t(it.head_kv) * group * params.q.head_stride;
    auto q_row = [&](int tile_row) {
      const PackedRow packed = unpack_row(it.row_begin + tile_row, group);
      return q_base + int64_t(packed.query) * params.q.row_stride +
             int64_t(packed.head_in_group) * params.q.head_stride;
    };
    if constexpr (Traits::kFragmentsFromStage) {
      load_q_in_e4m3_slots(smem_tiles.slot_q(slot), it.rows_left, q_base, q_row);
    } else {
      Tensor tQsQ = gmem_thr_copy_QKV.partition_D(smem_tiles.slot_q(slot));  // (CPY,CPY_M,CPY_D)
      copy_rows_async(tQsQ, tQcQ, it.rows_left, params.head_dim, q_base, q_row);
    }
  }

  // Traits::kFragmentsFromStage: Q with the column pairs of each 16-column
  // slice in the slots where the K fragments read from e4m3 bytes put theirs
  // (e4m3_column_pair_slot, core/fp8_fragments.h), 4 bytes a copy; rows at or
  // past num_rows and columns past head_dim are zero-filled.
  template <typename TensorSQ, typename RowPtr>
  __device__ void load_q_in_e4m3_slots(TensorSQ sQ, int num_rows, const Element* any_address,
                                       RowPtr row_ptr) const {
    CUTE_UNROLL
    for (int m = 0; m < size<1>(tQcQ); ++m) {
      const int row = get<0>(tQcQ(0, m, 0));
      const bool row_ok = row < num_rows;
      const Element* src_row = row_ok ? row_ptr(row) : any_address;
      CUTE_UNROLL
      for (int k = 0; k < size<2>(tQcQ); ++k) {
        const int col = get<1>(tQcQ(0, m, k));  // a multiple of 8: four column pairs
        CUTE_UNROLL
        for (int j = 0; j < 4; ++j) {
          const int pair = col % 16 / 2 + j;
          const int slot_col = col / 16 * 16 + 2 * e4m3_column_pair_slot(pair);
          const bool ok = row_ok && col + 2 * j < params.head_dim;
          cp_async_4_or_zero(&sQ(row, slot_col), ok ? src_row + col + 2 * j : any_address, ok);
        }
      }
    }
  }

  // Paged cache: location of this thread's K/V copy rows of key block
  // n_block. The block table is read once per distinct page (a page of 64
  // rows or more holds all of a thread's rows of a tile); row_page[m] is left
  // stale when row m shares row m - 1's page, and the rows are resolved, and
  // their entries checked against the pool, when the copies are issued, a
  // tile later (load_tile): no instruction waits on a table read in between
  // (a check or a copy of the loaded value from row to row would).
  __device__ void locate_tile(const SplitKvItem& it, int n_block) {
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
        row_page[m] = key < it.seqlen_k ? it.cache.block_table_row[page_index] : 0;
      }
      previous_index = page_index;
    }
  }

  // Cold path of load_tile: reports the first of this thread's block-table
  // entries of key block n_block that lies outside the pool.
  __device__ void report_page_out_of_pool(const SplitKvItem& it, int n_block) const {
    int row = 0, page = 0;
    CUTE_UNROLL
    for (int m = kCopyRows - 1; m >= 0; --m) {  // the first bad row wins
      if (!row_shares_page[m] &&
          static_cast<unsigned>(row_page[m]) >= static_cast<unsigned>(params.num_pages)) {
        row = get<0>(tKVcKV(0, m, 0));
        page = row_page[m];
      }
    }
    int page_index, in_page;
    it.cache.page_size.divmod(it.cache.leftpad + n_block * kBlockN + row, page_index, in_page);
    report_and_clamp_page(params.index_errors, IndexOp::kKvcache, it.cache.entry, page_index, page,
                          params.num_pages);
  }

  // An e4m3 cache: this thread's pieces of stage `stage`, which its own
  // copies brought (the caller waited for them), converted into the Element
  // tile set at the same offsets. Only this thread's pieces are read and
  // written, so the kernel's __syncthreads before the products publishes
  // the tiles and the one after them frees the set for the next stage.
  // e4m3 values are all float16 and bfloat16 values: the conversion is exact.
  __device__ void convert_stage(int stage) const {
    static_assert(Traits::kCacheFp8 && !Traits::kFragmentsFromStage);
    Tensor tKsK = gmem_thr_copy_QKV.partition_D(smem_tiles.stage_k(stage));  // (CPY,CPY_N,CPY_D)
    Tensor tVsV = gmem_thr_copy_QKV.partition_D(smem_tiles.stage_v(stage));  // (CPY,CPY_N,CPY_D)
    const Element* const k_tile = raw_pointer_cast(smem_tiles.stage_k(stage).data());
    const uint8_t* const k_staging = smem_tiles.staging(stage, 0);
    const uint8_t* const v_staging = smem_tiles.staging(stage, 1);
    CUTE_UNROLL
    for (int m = 0; m < kCopyRows; ++m) {
      CUTE_UNROLL
      for (int k = 0; k < kCopyCols; ++k) {
        const int64_t at = &tKsK(0, m, k) - k_tile;
        convert_e4m3x8(k_staging + at, &tKsK(0, m, k));
        if constexpr (!Traits::kVInK) convert_e4m3x8(v_staging + at, &tVsV(0, m, k));
      }
    }
  }

  // K and V of one tile into one stage (K alone with Traits::kVInK: its
  // columns up to head_dim_v are V's). Rows past the keys, K's columns past
  // head_dim and V's past head_dim_v are zero-filled (zeros, not stale data:
  // P V multiplies them by 0, and O's columns past head_dim_v are not stored).
  // In the prologue (in_prologue), rows from the item's first new row on are
  // left to SplitKvAppend::load_inputs when the kernel appends: nothing else
  // may write their bytes. The new rows are the last keys, so they lie in an
  // item's first tiles (the walk runs from the last key block down), all
  // loaded by the prologue; the main loop keeps the plain copy loop.
  template <typename InPrologue>
  __device__ void load_tile(const SplitKvItem& it, int n_block, int stage, InPrologue) {
    constexpr bool kMaySkipNewRows = InPrologue::value;
    Tensor tKsK = gmem_thr_copy_QKV.partition_D(smem_tiles.stage_k(stage));  // (CPY,CPY_N,CPY_D)
    Tensor tVsV = gmem_thr_copy_QKV.partition_D(smem_tiles.stage_v(stage));  // (CPY,CPY_N,CPY_D)
    // Rows are copied by the coordinates of the same partition.
    CUTE_STATIC_ASSERT_V(size<1>(tKsK) == size<1>(tKVcKV) && size<2>(tKsK) == size<2>(tKVcKV));
    const CacheElement* k_base = k_ptr + int64_t(it.head_kv) * params.k.head_stride;
    const CacheElement* v_base = v_ptr + int64_t(it.head_kv) * params.v.head_stride;
    const int rows_in_tile = it.seqlen_k - n_block * kBlockN;
    // kAppends &&: a constant false without the append, as the kernel's
    // `appending` is there.
    const int new_rows_from =
        kAppends && appending ? it.seqlen_k - params.seqlen_new - n_block * kBlockN : rows_in_tile;
    // copy_row reads tKVcKV and params through these local references, not
    // through `this`: through `this`, the kernel compiles differently.
    auto& tKVcKV_ = tKVcKV;
    const KvcacheParams& params_ = params;
    // An e4m3 cache's pieces go to the stage's staging bytes at their
    // converted tile offsets (SplitKvSmem::staging), 8 bytes each.
    const Element* const k_tile = raw_pointer_cast(smem_tiles.stage_k(stage).data());
    uint8_t* const k_staging = smem_tiles.staging(stage, 0);
    uint8_t* const v_staging = smem_tiles.staging(stage, 1);
    auto copy_row = [&](int m, const CacheElement* k_row, const CacheElement* v_row) {
      const int row = get<0>(tKVcKV_(0, m, 0));
      const bool row_ok = row < rows_in_tile;
      if (kMaySkipNewRows && row_ok && row >= new_rows_from) return;
      CUTE_UNROLL
      for (int k = 0; k < kCopyCols; ++k) {
        const int col = get<1>(tKVcKV_(0, m, k));
        const bool k_ok = row_ok && col < params_.head_dim;
        const bool v_ok = row_ok && col < params_.head_dim_v;
        if constexpr (Traits::kCacheFp8) {
          // The staged layout's byte, or the converted tile's element offset.
          int64_t at;
          if constexpr (Traits::kFragmentsFromStage) {
            at = typename Traits::SmemLayoutStaging{}(row, col);
          } else {
            at = &tKsK(0, m, k) - k_tile;
          }
          cp_async_8_or_zero(k_staging + at, k_row + col, k_ok);
          if constexpr (!Traits::kVInK) cp_async_8_or_zero(v_staging + at, v_row + col, v_ok);
        } else {
          cp_async_16_or_zero(&tKsK(0, m, k), k_row + col, k_ok);
          if constexpr (!Traits::kVInK) cp_async_16_or_zero(&tVsV(0, m, k), v_row + col, v_ok);
        }
      }
    };
    if (is_paged(it)) {
      // locate_tile left page 0 for the rows past the keys. An entry outside
      // the pool reads page 0 too, and is reported after the copies.
      bool out_of_pool = false;
      int64_t page = 0;
      CUTE_UNROLL
      for (int m = 0; m < kCopyRows; ++m) {
        if (!row_shares_page[m]) {
          page = page_in_pool_or_zero(row_page[m], params.num_pages, out_of_pool);
        }
        const int64_t in_page = row_in_page[m];
        copy_row(m, k_base + page * params.k.batch_stride + in_page * params.k.row_stride,
                 v_base + page * params.v.batch_stride + in_page * params.v.row_stride);
      }
      if (out_of_pool && !params.table_checked_after) report_page_out_of_pool(it, n_block);
    } else {
      const int64_t first_pos = it.cache.leftpad + n_block * kBlockN + get<0>(tKVcKV(0, 0, 0));
      const CacheElement* k_row = k_base + int64_t(it.cache.entry) * params.k.batch_stride +
                                  first_pos * params.k.row_stride;
      const CacheElement* v_row = v_base + int64_t(it.cache.entry) * params.v.batch_stride +
                                  first_pos * params.v.row_stride;
      CUTE_UNROLL
      for (int m = 0; m < kCopyRows; ++m) {
        copy_row(m, k_row, v_row);
        k_row += k_row_step;
        v_row += v_row_step;
      }
    }
  }
};

// The stream to the next item with keys, or past the last item. Fields are
// the kernel's stream position, by reference; keep their order, since the
// order of a role's references can change the machine code (SplitKvProducer).
template <typename Traits, CacheLayout kLayout, bool kSeveralItems, bool kAppends>
struct SplitKvItemAdvance {
  using Smem = SplitKvSmem<Traits, kSeveralItems>;
  using Scheduler = SplitKvScheduler<Traits::kBlockM, Traits::kBlockN, !kSeveralItems>;
  using TileLoader = SplitKvTileLoader<Traits, kLayout, kSeveralItems, kAppends>;

  int& load_item;
  const int& num_items;
  SplitKvItem& load_item_work;
  const Scheduler& scheduler;
  SplitKvItemInputs& load_next_inputs;
  const KvcacheParams& params;
  int& load_n_block;
  int& load_q_slot;
  TileLoader& loader;

  __device__ void operator()() const {
    do {
      load_item += gridDim.x;
      if (load_item >= num_items) return;
      load_item_work = scheduler.item_at(load_item, load_next_inputs);
      load_next_inputs = splitkv_item_inputs(params, scheduler.next_item(load_item));
    } while (!load_item_work.has_keys());
    load_n_block = load_item_work.n_block_max - 1;
    load_q_slot = Smem::next_q_slot(load_q_slot);
    loader.locate_tile(load_item_work, load_n_block);
  }
};

// A block of one item has no next item. It refers to nothing else: referring
// to the stream's other locals, which it never uses, makes the kernels of one
// item compile differently.
template <typename Traits, CacheLayout kLayout, bool kAppends>
struct SplitKvItemAdvance<Traits, kLayout, false, kAppends> {
  using Scheduler = SplitKvScheduler<Traits::kBlockM, Traits::kBlockN>;
  using TileLoader = SplitKvTileLoader<Traits, kLayout, false, kAppends>;

  int& load_item;
  const int& num_items;

  __device__ SplitKvItemAdvance(int& load_item_, const int& num_items_, SplitKvItem&,
                                const Scheduler&, SplitKvItemInputs&, const KvcacheParams&, int&,
                                int&, TileLoader&)
      : load_item(load_item_), num_items(num_items_) {}

  __device__ void operator()() const { load_item = num_items; }
};

// The stream of copies: the key tiles of the block's items, item after item,
// each from its last key block down (so that the block on a causal diagonal
// comes first), an item's Q with its first tile. Items without keys are
// skipped: they only write their empty output. Tile t of the stream lives in
// stage t % kStages and is commit group t; every step commits one group,
// empty or not, so "all but the newest kStages - 1 groups done" always means
// "the tile about to be computed is here". With several items, the inputs of
// the stream's next item are loaded one item ahead.
//
// load_next_tile: the stream's next tile into `stage` (with its item's Q if
// it is the item's first), and the table reads of the tile after it; one
// commit group, empty past the stream's end.
template <typename Traits, CacheLayout kLayout, bool kSeveralItems, bool kAppends>
struct SplitKvProducer {
  using TileLoader = SplitKvTileLoader<Traits, kLayout, kSeveralItems, kAppends>;
  using ItemAdvance = SplitKvItemAdvance<Traits, kLayout, kSeveralItems, kAppends>;

  // load_n_block first: with load_item first, the kernels of one item compile
  // differently.
  int& load_n_block;
  int& load_item;
  const int& num_items;
  SplitKvItem& load_item_work;
  TileLoader& loader;
  int& load_q_slot;
  const ItemAdvance& advance_item;

  template <typename InPrologue>
  __device__ void load_next_tile(int stage, InPrologue in_prologue) const {
    if (load_item < num_items) {
      if (load_n_block == load_item_work.n_block_max - 1)
        loader.load_q(load_item_work, load_q_slot);
      loader.load_tile(load_item_work, load_n_block, stage, in_prologue);
      if (--load_n_block >= load_item_work.n_block_min) {
        loader.locate_tile(load_item_work, load_n_block);
      } else {
        advance_item();
      }
    }
    cute::cp_async_fence();
  }
};

// A decode step's append (SplitKvAppend) after the stream's prologue has
// issued its first kStages tiles: its work waits for the first tile's group,
// which the first tile step waits for anyway; the other stages stay in
// flight meanwhile.
template <int kStages, typename Append>
__forceinline__ __device__ void splitkv_append_after_prologue(const Append& append,
                                                              const SplitKvItem& first_item,
                                                              bool appending, bool rotating) {
  cute::cp_async_wait<kStages - 1>();
  __syncthreads();
  if (rotating) {
    append.rotate_in_smem(first_item);
    __syncthreads();
  }
  if (appending) append.append_to_cache(first_item);
}

}  // namespace flash
