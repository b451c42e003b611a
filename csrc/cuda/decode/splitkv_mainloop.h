// The main loop's pieces of the split-KV kernel (splitkv_kernel.h): the
// cache layouts an instance serves, the views of its shared-memory tiles, a
// warp's MMA state (SplitKvWarpTiling, SplitKvWarpFragments), the score
// scale, extras and mask of a key tile (SplitKvScoreScale, SplitKvScoreMod),
// and the MMAs of a key tile (SplitKvMma).
#pragma once

#include <cmath>
#include <cstdint>
#include <utility>

#include <cuda_fp16.h>

#include <cute/tensor.hpp>

#include "common/mask_rule.h"
#include "cuda/core/fp8_fragments.h"
#include "cuda/core/paged_rows.h"
#include "cuda/core/params.h"
#include "cuda/core/score_mods.h"
#include "cuda/core/tile_ops.h"
#include "cuda/decode/splitkv_tile_config.h"
#include "cuda/decode/splitkv_work_item.h"

namespace flash {

// Which caches a kernel instance serves. The decode variant's plain kernel
// is compiled once per layout, so that each streams its tiles with only its
// own address arithmetic (decode spends its issue slots on the copies); the
// other instances take either, chosen per call.
enum class CacheLayout { kContiguous, kPaged, kEither };

// Shared memory: Traits::kStages (K tile, V tile) stages (K tile alone with
// Traits::kVInK, V then read in it), so that the copies
// of the next tiles run while the current one is computed (decode does little
// math per byte; the kernel lives on the bytes it keeps in flight), then the
// Q slots, then (several items) the merge's own bytes, or (appending) the
// rotary table rows (splitkv_tile_config.h).
template <typename Traits, bool kSeveralItems>
struct SplitKvSmem {
  using Element = typename Traits::Element;
  using ElementV = typename Traits::ElementV;
  static constexpr int kTileElems = cute::cosize_v<typename Traits::SmemLayoutKV>;
  static constexpr int kQElems = cute::cosize_v<typename Traits::SmemLayoutQ>;
  static constexpr int kTilesPerStage = Traits::kTilesPerStage;
  // The Element tile set of a stage: its own, or with an e4m3 cache the one
  // set every stage is converted into.
  static __device__ __forceinline__ int tile_set(int stage) {
    return Traits::kCacheFp8 ? 0 : stage;
  }
  // Where a stage's V tile starts, in tiles past its K tile: 0 with kVInK.
  static constexpr int kVTileOffset = kTilesPerStage - 1;
  static_assert(kTileElems == Traits::kSmemSizeKV / kTilesPerStage / int(sizeof(Element)) &&
                kQElems == Traits::kSmemSizeQ / int(sizeof(Element)));
  static constexpr int kQSlots = splitkv_q_slots(Traits::kHeadDim, Traits::kWarpsN, kSeveralItems);

  Element* const kv_smem;
  Element* const q_smem;
  const int warp_n;  // which slab of keys of each tile
  const int warp_m;  // which 16 query rows
  const int warp_v;  // which Traits::kHeadDimV columns of the value dim

  __device__ SplitKvSmem(char* smem, int warp_n_, int warp_m_, int warp_v_)
      : kv_smem(reinterpret_cast<Element*>(smem)),
        q_smem(reinterpret_cast<Element*>(smem) + kTilesPerStage * Traits::kTileSets * kTileElems),
        warp_n(warp_n_),
        warp_m(warp_m_),
        warp_v(warp_v_) {}

  static __device__ int next_q_slot(int slot) { return slot + 1 == kQSlots ? 0 : slot + 1; }

  // Traits::kQInHalf: Q slot `slot`, bfloat16 as copied, rewritten in place
  // as float16 times 2^-e, where e puts the largest finite |q| of the slot in
  // [2^14, 2^15) (clamped to [-100, 100]); returns 2^e, which the scores'
  // scale takes. bfloat16's 8 significant bits fit float16's 11, so a value
  // changes only where it lands below float16's normal range, 2^-28 of the
  // largest and less. Infinities and NaNs stay what they are and set no
  // scale. Every thread of the block calls it after its wait for Q's copies;
  // the caller's next __syncthreads publishes the slot.
  __device__ float q_slot_to_half(int slot, int tidx) const {
    static_assert(Traits::kQInHalf && kQElems % (8 * 32) == 0);
    constexpr int kChunks = kQElems / 8;  // of 16 bytes
    uint4* const chunks = reinterpret_cast<uint4*>(q_smem + slot * kQElems);
    __syncthreads();  // every thread's copies of Q have landed
    // Each warp finds the same largest magnitude over the whole slot; the
    // bits of a finite non-negative bfloat16 order as its value.
    uint32_t max_bits = 0;
    for (int c = tidx % 32; c < kChunks; c += 32) {
      const uint4 chunk = chunks[c];
      const uint32_t words[4] = {chunk.x, chunk.y, chunk.z, chunk.w};
      CUTE_UNROLL
      for (int i = 0; i < 8; ++i) {
        const uint32_t bits = (words[i / 2] >> (16 * (i % 2))) & 0x7fffu;
        if (bits < 0x7f80u && bits > max_bits) max_bits = bits;
      }
    }
    max_bits = __reduce_max_sync(0xffffffffu, max_bits);
    __syncthreads();                                // every warp has read the bfloat16 slot
    const int exponent = int(max_bits >> 7) - 127;  // of the largest, -127 for subnormals
    const int e = max_bits == 0 ? 0 : min(max(exponent - 14, -100), 100);
    const float down = __int_as_float((127 - e) << 23);  // 2^-e
    for (int c = tidx; c < kChunks; c += Traits::kNThreads) {
      uint32_t words[4];
      *reinterpret_cast<uint4*>(words) = chunks[c];
      CUTE_UNROLL
      for (int i = 0; i < 4; ++i) {
        const __half2 h = __floats2half2_rn(__uint_as_float(words[i] << 16) * down,
                                            __uint_as_float(words[i] & 0xffff0000u) * down);
        words[i] = reinterpret_cast<const uint32_t&>(h);
      }
      chunks[c] = *reinterpret_cast<const uint4*>(words);
    }
    return __int_as_float((127 + e) << 23);  // 2^e
  }
  // (M, D) of a Q slot, (N, D) of a stage's K or V tile.
  __device__ auto slot_q(int slot) const {
    return make_tensor(make_smem_ptr(q_smem + slot * kQElems), typename Traits::SmemLayoutQ{});
  }
  __device__ auto stage_k(int stage) const {
    return make_tensor(make_smem_ptr(kv_smem + (kTilesPerStage * tile_set(stage)) * kTileElems),
                       typename Traits::SmemLayoutKV{});
  }
  __device__ auto stage_v(int stage) const {
    return make_tensor(
        make_smem_ptr(reinterpret_cast<ElementV*>(
            kv_smem + (kTilesPerStage * tile_set(stage) + kVTileOffset) * kTileElems)),
        typename Traits::SmemLayoutKV{});
  }
  // This warp's slab of a stage's K tile, (kSlabN, D), and its part of the V
  // tile's slab seen transposed, (kHeadDimV, kSlabN), and its 16 rows of a Q
  // slot, (16, D).
  __device__ auto slab_k(int stage) const {
    return make_tensor(make_smem_ptr(kv_smem + (kTilesPerStage * tile_set(stage)) * kTileElems +
                                     warp_n * Traits::kKVSlabElems),
                       typename Traits::SmemLayoutKVSlab{});
  }
  __device__ auto slab_vt(int stage) const {
    return make_tensor(
        make_smem_ptr(reinterpret_cast<ElementV*>(
            kv_smem + (kTilesPerStage * tile_set(stage) + kVTileOffset) * kTileElems +
            warp_n * Traits::kKVSlabElems + warp_v * Traits::kHeadDimV * Traits::kSlabN)),
        typename Traits::SmemLayoutVtSlab{});
  }
  __device__ auto slab_q(int slot) const {
    return make_tensor(make_smem_ptr(q_smem + slot * kQElems + warp_m * Traits::kQSlabElems),
                       typename Traits::SmemLayoutQSlab{});
  }
  // The score exchange (Traits::kSplitScores), past the Q slots: per pair of
  // warps that share a key slab, each warp's partial scores, element-major
  // (16 x kSlabN / 32 floats a lane, lane-minor).
  __device__ float* score_exchange() const {
    return reinterpret_cast<float*>(q_smem + kQSlots * kQElems);
  }
  // The first byte past the Q slots and the score exchange (the appending
  // kernel's table rows; an e4m3 cache's staging stages).
  __device__ Element* past_q_slots() const {
    return q_smem + kQSlots * kQElems +
           Traits::kSmemSizeScoreExchange / static_cast<int>(sizeof(Element));
  }
  // An e4m3 cache's bytes of stage `stage`'s K tile (v = 0) or V tile (v =
  // 1), past the score exchange. Element (row, col) of a tile is the byte at
  // the Element offset it has in the converted tile (stage_k / stage_v): the
  // 8 elements of a copy, which the swizzle moves whole, are 8 contiguous bytes.
  __device__ uint8_t* staging(int stage, int v) const {
    return reinterpret_cast<uint8_t*>(past_q_slots()) +
           (kTilesPerStage * stage + v * kVTileOffset) * kTileElems;
  }
  // Traits::kFragmentsFromStage: this warp's slab of a stage's staged K (v =
  // 0) or V (v = 1) bytes, (kSlabN, D), in Traits::SmemLayoutStagingSlab.
  __device__ auto staging_slab(int stage, int v) const {
    return make_tensor(make_smem_ptr(staging(stage, v) + warp_n * Traits::kKVSlabElems),
                       typename Traits::SmemLayoutStagingSlab{});
  }
};

// One warp's MMA state, built once per block, in two parts: its register
// fragments (SplitKvWarpFragments) and the rest (SplitKvWarpTiling: the
// MMA, the shared-memory copies that feed the fragments, and where its
// accumulator elements lie in the tile). Kept as one object, or with the
// fragments made from partitions of shared-memory views in a constructor,
// they changed the kernel's machine code (registers held across the loop).
template <typename Traits, bool kSeveralItems>
struct SplitKvWarpTiling {
  using Element = typename Traits::Element;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kSlabN = Traits::kSlabN;
  static constexpr int kHeadDimV = Traits::kHeadDimV;
  using Smem = SplitKvSmem<Traits, kSeveralItems>;

  using WarpMma = typename Traits::WarpMma;      // S = Q K^T
  using WarpMmaPV = typename Traits::WarpMmaPV;  // O += P V (Traits::ElementV)
  using ThrMma = decltype(WarpMma{}.get_thread_slice(0));
  using ThrMmaPV = decltype(WarpMmaPV{}.get_thread_slice(0));
  using SmemTiledCopyQ = decltype(make_tiled_copy_A(typename Traits::SmemCopyAtom{}, WarpMma{}));
  using SmemTiledCopyK = decltype(make_tiled_copy_B(typename Traits::SmemCopyAtom{}, WarpMma{}));
  using SmemTiledCopyV =
      decltype(make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, WarpMmaPV{}));
  template <typename TiledCopy>
  using ThrCopyOf = decltype(TiledCopy{}.get_thread_slice(0));
  // The types of the warp's operand fragments over a shared-memory view of
  // type T, and of a tensor's (ROW,COL) view.
  template <typename T>
  using FragmentA = decltype(std::declval<const ThrMma&>().partition_fragment_A(std::declval<T>()));
  template <typename T>
  using FragmentB = decltype(std::declval<const ThrMma&>().partition_fragment_B(std::declval<T>()));
  template <typename T>
  using FragmentBPV =
      decltype(std::declval<const ThrMmaPV&>().partition_fragment_B(std::declval<T>()));
  template <typename T>
  using RowcolOf = decltype(make_tensor(std::declval<T&>().data(),
                                        acc_layout_as_rowcol(std::declval<T&>().layout())));
  using SlabQ = decltype(std::declval<const Smem&>().slab_q(0));
  using SlabK = decltype(std::declval<const Smem&>().slab_k(0));
  using SlabVtNoSwizzle =
      decltype(make_tensor(make_smem_ptr(static_cast<typename Traits::ElementV*>(nullptr)),
                           typename Traits::SmemLayoutVtSlabNoSwizzle{}));
  using AccO = decltype(partition_fragment_C(WarpMmaPV{}, Shape<_16, Int<kHeadDimV>>{}));
  // (MMA,MMA_M,MMA_N) -> (row,col) of a warp's 16 x kCols accumulator
  template <int kCols>
  using IdentityC = decltype(std::declval<const ThrMma&>().partition_C(
      make_identity_tensor(Shape<_16, Int<kCols>>{})));
  template <int kCols>
  using IdentityCPV = decltype(std::declval<const ThrMmaPV&>().partition_C(
      make_identity_tensor(Shape<_16, Int<kCols>>{})));

  template <typename T>
  static __forceinline__ __device__ auto as_rowcol(T&& t) {
    return make_tensor(t.data(), acc_layout_as_rowcol(t.layout()));
  }

  WarpMma warp_mma;
  WarpMmaPV warp_mma_pv;
  SmemTiledCopyQ smem_tiled_copy_Q;
  ThrCopyOf<SmemTiledCopyQ> smem_thr_copy_Q;
  SmemTiledCopyK smem_tiled_copy_K;
  ThrCopyOf<SmemTiledCopyK> smem_thr_copy_K;
  SmemTiledCopyV smem_tiled_copy_V;
  ThrCopyOf<SmemTiledCopyV> smem_thr_copy_V;
  // (row, col) of each accumulator element within the warp's 16 x kSlabN
  // scores and its 16 x kHeadDimV output; the warp's rows start at warp_row0
  // of the tile, its keys at warp_col0 of each key tile, its output columns
  // at warp_vcol0.
  RowcolOf<IdentityC<kSlabN>> tScS_rowcol;       // (ROW,COL) = ((2,MMA_M),(2,MMA_N)) -> (row,col)
  RowcolOf<IdentityCPV<kHeadDimV>> tOcO_rowcol;  // (ROW,COL) -> (row,col)
  const int warp_row0;
  const int warp_col0;
  const int warp_vcol0;
  static constexpr int kNRows = decltype(size<0>(std::declval<RowcolOf<AccO>&>()))::value;
  static_assert(kNRows == 2, "a thread holds two rows of the warp's 16");

  __forceinline__ __device__ SplitKvWarpTiling(int lane, int warp_n, int warp_m, int warp_v)
      : smem_tiled_copy_Q(make_tiled_copy_A(typename Traits::SmemCopyAtom{}, warp_mma)),
        smem_thr_copy_Q(smem_tiled_copy_Q.get_thread_slice(lane)),
        smem_tiled_copy_K(make_tiled_copy_B(typename Traits::SmemCopyAtom{}, warp_mma)),
        smem_thr_copy_K(smem_tiled_copy_K.get_thread_slice(lane)),
        smem_tiled_copy_V(
            make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, warp_mma_pv)),
        smem_thr_copy_V(smem_tiled_copy_V.get_thread_slice(lane)),
        tScS_rowcol(as_rowcol(warp_mma.get_thread_slice(lane).partition_C(
            make_identity_tensor(Shape<_16, Int<kSlabN>>{})))),
        tOcO_rowcol(as_rowcol(warp_mma_pv.get_thread_slice(lane).partition_C(
            make_identity_tensor(Shape<_16, Int<kHeadDimV>>{})))),
        warp_row0(16 * warp_m),
        warp_col0(kSlabN * warp_n),
        warp_vcol0(kHeadDimV * warp_v) {}
};

template <typename Traits, bool kSeveralItems>
struct SplitKvWarpFragments {
  using Tiling = SplitKvWarpTiling<Traits, kSeveralItems>;
  typename Tiling::template FragmentA<typename Tiling::SlabQ> tSrQ;  // (MMA,MMA_M,MMA_K)
  typename Tiling::template FragmentB<typename Tiling::SlabK> tSrK;  // (MMA,MMA_N,MMA_K)
  typename Tiling::template FragmentBPV<typename Tiling::SlabVtNoSwizzle>
      tOrVt;                    // (MMA,MMA_D,MMA_K)
  typename Tiling::AccO acc_o;  // (MMA,MMA_M,MMA_D)

  // acc_o seen as (ROW,COL). Made where it is used rather than held: a view
  // held here would point into the object itself, which then could not live
  // in registers.
  __forceinline__ __device__ auto acc_o_rowcol() { return Tiling::as_rowcol(acc_o); }
  __forceinline__ __device__ auto acc_o_rowcol() const { return Tiling::as_rowcol(acc_o); }
};

// How the scores of an instance with score extras are scaled: when softcap,
// ALiBi or a scale that scale_is_positive_normal turns away is on, the
// scores are scaled (and capped, and biased) before the softmax, which then
// exponentiates in log2 units; otherwise the softmax folds the scale into
// its exponent.
template <bool kWithScoreExtras, bool kDescaled = false>
struct SplitKvScoreScale {
  const bool has_alibi;
  const bool prescale_scores;
  const float exp_scale_log2;
  const float lse_scale;

  __forceinline__ __device__ explicit SplitKvScoreScale(const KvcacheParams& params)
      : has_alibi(kWithScoreExtras && params.alibi_slopes != nullptr),
        prescale_scores(kWithScoreExtras && (softcap_on(params.softcap) || has_alibi ||
                                             !scale_is_positive_normal(params.softmax_scale_log2))),
        exp_scale_log2(prescale_scores ? float(M_LOG2E) : params.softmax_scale_log2),
        lse_scale(prescale_scores ? 1.f : params.softmax_scale) {}

  // The scale of the scores (before softcap): the call's.
  __forceinline__ __device__ float softmax_scale(const KvcacheParams& params) const {
    return params.softmax_scale;
  }
};

// An e4m3 cache: the block's item's k_descale multiplies the call's scale, so
// the scores are scale * k_descale * (q k) (docs/fp8.md, "Descales"); a block
// of such a kernel runs one item.
template <bool kWithScoreExtras>
struct SplitKvScoreScale<kWithScoreExtras, true> {
  const float scale;  // the call's softmax_scale * k_descale
  const bool has_alibi;
  const bool prescale_scores;
  const float exp_scale_log2;
  const float lse_scale;

  __forceinline__ __device__ SplitKvScoreScale(const KvcacheParams& params, float k_descale)
      : scale(params.softmax_scale * k_descale),
        has_alibi(kWithScoreExtras && params.alibi_slopes != nullptr),
        prescale_scores(kWithScoreExtras && (softcap_on(params.softcap) || has_alibi ||
                                             !scale_is_positive_normal(scale * float(M_LOG2E)))),
        exp_scale_log2(prescale_scores ? float(M_LOG2E) : scale * float(M_LOG2E)),
        lse_scale(prescale_scores ? 1.f : scale) {}

  __forceinline__ __device__ float softmax_scale(const KvcacheParams&) const { return scale; }
};

// The score extras and the mask of one warp's scores of a key tile, for one
// item: prescale and softcap, the ALiBi bias per row (packed rows of one
// tile belong to different query heads, hence a query index and a slope per
// row), and -inf outside each row's visible keys (applied in the kernel's
// loop from row_query). Built per item.
template <typename Traits, typename TScSRowcol, int kNRows>
struct SplitKvScoreMod {
  static constexpr int kBlockN = Traits::kBlockN;

  int row_query[kNRows];
  float row_slope[kNRows];

  template <typename ScoreScale>
  __forceinline__ __device__ SplitKvScoreMod(const KvcacheParams& params, const SplitKvItem& it,
                                             const TScSRowcol& tScS_rowcol, const ScoreScale& scale,
                                             int group, int warp_row0) {
    CUTE_UNROLL
    for (int mi = 0; mi < kNRows; ++mi) {
      const int row = it.row_begin + warp_row0 + get<0>(tScS_rowcol(mi, 0));
      const PackedRow packed = unpack_row(row, group);
      row_query[mi] = packed.query;
      row_slope[mi] = scale.has_alibi && row < it.row_begin + it.rows_left
                          ? params.alibi_slopes[it.batch * params.alibi_batch_stride +
                                                it.head_kv * group + packed.head_in_group]
                          : 0.f;
    }
  }

  // The score extras on scores (ROW,COL), the warp's scores of a key tile
  // whose first key is col_base; tScS_rowcol gives their coordinates.
  template <typename TensorScores, typename ScoreScale>
  __forceinline__ __device__ void apply_extras(TensorScores& scores, const TScSRowcol& tScS_rowcol,
                                               const KvcacheParams& params, const ScoreScale& scale,
                                               int seqlen_q, int seqlen_k, int col_base) const {
    if (scale.prescale_scores) {
      apply_scale_and_softcap(scores, scale.softmax_scale(params), params.softcap);
      if (scale.has_alibi) {
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
  }
};

// The MMAs of one key tile for one warp: S = Q K^T of its 16 query rows and
// its slab of the tile's keys, then (once the kernel has applied its
// SplitKvScoreMod to S) the online softmax and O += P V. The warp's tiling
// and fragments are the kernel's, which the role refers to.
template <typename Traits, bool kSeveralItems>
struct SplitKvMma {
  using Element = typename Traits::Element;
  static constexpr int kSlabN = Traits::kSlabN;
  using Smem = SplitKvSmem<Traits, kSeveralItems>;
  using Tiling = SplitKvWarpTiling<Traits, kSeveralItems>;
  using Fragments = SplitKvWarpFragments<Traits, kSeveralItems>;

  const Smem& smem_tiles;
  Tiling& w;
  Fragments& f;

  // acc_s (MMA,MMA_M,MMA_N) = Q K^T of the warp's rows of its Q slot (tSsQ)
  // and its slab of the K tile in `stage`. With Traits::kSplitScores the two
  // warps of the slab (value halves 0 and 1) each make the product over half
  // of the k-slices, then add the other's half through shared memory; fp32
  // addition commutes, so both hold the same bits of S.
  template <typename TensorAccS, typename TensorSsQ>
  __forceinline__ __device__ void qk(TensorAccS& acc_s, const TensorSsQ& tSsQ, int stage) const {
    if constexpr (Traits::kFragmentsFromStage) {
      qk_from_stage(acc_s, tSsQ, stage);
      return;
    }
    clear(acc_s);
    Tensor tSsK = w.smem_thr_copy_K.partition_S(smem_tiles.slab_k(stage));  // (CPY,CPY_N,CPY_K)
    if constexpr (Traits::kSplitScores) {
      constexpr int kHalf = decltype(size<2>(f.tSrQ))::value / 2;
      const int warp_v = w.warp_vcol0 / Traits::kHeadDimV;
      if (warp_v == 0) {
        gemm_smem_smem<0, kHalf>(acc_s, f.tSrQ, f.tSrK, tSsQ, tSsK, w.warp_mma, w.smem_tiled_copy_Q,
                                 w.smem_tiled_copy_K, w.smem_thr_copy_Q, w.smem_thr_copy_K);
      } else {
        gemm_smem_smem<kHalf>(acc_s, f.tSrQ, f.tSrK, tSsQ, tSsK, w.warp_mma, w.smem_tiled_copy_Q,
                              w.smem_tiled_copy_K, w.smem_thr_copy_Q, w.smem_thr_copy_K);
      }
      add_partner_scores(acc_s, warp_v);
    } else {
      gemm_smem_smem(acc_s, f.tSrQ, f.tSrK, tSsQ, tSsK, w.warp_mma, w.smem_tiled_copy_Q,
                     w.smem_tiled_copy_K, w.smem_thr_copy_Q, w.smem_thr_copy_K);
    }
  }

  // acc_s += the partial scores of the other warp of this warp's key slab
  // (kSplitScores). The pair meets at a named barrier of its 64 threads (ids
  // 1 and up; 0 is __syncthreads); the kernel's __syncthreads at the end of
  // each key tile orders this tile's reads before the next tile's writes.
  template <typename TensorAccS>
  __forceinline__ __device__ void add_partner_scores(TensorAccS& acc_s, int warp_v) const {
    constexpr int kElems = decltype(size(acc_s))::value;
    const int lane = threadIdx.x % 32;
    const int pair = w.warp_col0 / kSlabN + Traits::kWarpsN * (w.warp_row0 / 16);
    float* const exchange = smem_tiles.score_exchange() + pair * 2 * kElems * 32;
    CUTE_UNROLL
    for (int e = 0; e < kElems; ++e) exchange[(warp_v * kElems + e) * 32 + lane] = acc_s(e);
    asm volatile("bar.sync %0, %1;" ::"r"(1 + pair), "r"(64) : "memory");
    CUTE_UNROLL
    for (int e = 0; e < kElems; ++e) acc_s(e) += exchange[((1 - warp_v) * kElems + e) * 32 + lane];
  }

  // Traits::kFragmentsFromStage: acc_s = Q K^T with K's fragments read from
  // the warp's slab of staged e4m3 bytes (ldmatrix over byte pairs, one
  // matrix an 8-key block of a 16-column slice) and converted in registers,
  // a slice at a time; Q's slots hold the column order they come in
  // (core/fp8_fragments.h).
  template <typename TensorAccS, typename TensorSsQ>
  __forceinline__ __device__ void qk_from_stage(TensorAccS& acc_s, const TensorSsQ& tSsQ,
                                                int stage) const {
    constexpr int kSlices = decltype(size<2>(f.tSrK))::value;   // MMA_K: 16 columns each
    constexpr int kNBlocks = decltype(size<1>(f.tSrK))::value;  // MMA_N: 8 keys each
    static_assert(kSlices == Traits::kHeadDim / 16 && kNBlocks == kSlabN / 8);
    constexpr int kMatrices = kNBlocks % 4 == 0 ? 4 : (kNBlocks % 2 == 0 ? 2 : 1);
    using ElementQK = typename Traits::ElementQK;
    clear(acc_s);
    const int lane = threadIdx.x % 32;
    Tensor sK = smem_tiles.staging_slab(stage, 0);               // (kSlabN,D) bytes
    Tensor tSrQ_copy_view = w.smem_thr_copy_Q.retile_D(f.tSrQ);  // (CPY,CPY_M,CPY_K)
    CUTE_UNROLL
    for (int i = 0; i < kSlices; ++i) {
      copy(w.smem_tiled_copy_Q, tSsQ(_, _, i), tSrQ_copy_view(_, _, i));
      CUTE_UNROLL
      for (int j0 = 0; j0 < kNBlocks; j0 += kMatrices) {
        // Lane l gives row l % 8 of matrix l / 8: key block j0 + l / 8.
        const int key = 8 * (j0 + lane / 8 % kMatrices) + lane % 8;
        uint32_t r[kMatrices];
        ldsm_b16<kMatrices, false>(cute::cast_smem_ptr_to_uint(&sK(key, 16 * i)), r);
        CUTE_UNROLL
        for (int q = 0; q < kMatrices; ++q) {
          Tensor b = recast<uint32_t>(f.tSrK(_, j0 + q, i));  // the two registers of B
          e4m3x4_to<ElementQK>(r[q], b(0), b(1));
        }
      }
      cute::gemm(w.warp_mma, f.tSrQ(_, _, i), f.tSrK(_, _, i), acc_s);
    }
  }

  // Traits::kFragmentsFromStage: acc_o += P V with V's fragments read from
  // the warp's slab of staged e4m3 bytes by ldmatrix.trans and converted in
  // registers to Traits::ElementV (float16), a 16-key step at a time. One
  // x4 covers two 16-column slices of a step's 16 keys; each slice feeds two
  // MMAs, the n-blocks 2h (its even columns) and 2h + 1 (its odd ones), so
  // O's accumulator holds the columns in that order (SplitKvEpilogue).
  template <typename TensorP>
  __forceinline__ __device__ void pv_from_stage(const TensorP& tOrP, int stage) const {
    constexpr int kSteps = decltype(size<2>(f.tOrVt))::value;    // MMA_K: 16 keys each
    constexpr int kNBlocks = decltype(size<1>(f.tOrVt))::value;  // MMA_N: 8 columns each
    static_assert(kSteps == kSlabN / 16 && kNBlocks == Traits::kHeadDimV / 8 && kNBlocks % 4 == 0);
    using ElementV = typename Traits::ElementV;
    const int lane = threadIdx.x % 32;
    Tensor sV = smem_tiles.staging_slab(stage, 1);  // (kSlabN,Dv) bytes
    CUTE_UNROLL
    for (int kk = 0; kk < kSteps; ++kk) {
      CUTE_UNROLL
      for (int h = 0; h < kNBlocks / 2; h += 2) {
        // Matrix q = lane / 8: keys 16 kk + 8 (q % 2) on, columns 16 (h + q / 2) on.
        const int q = lane / 8;
        const int key = 16 * kk + 8 * (q % 2) + lane % 8;
        uint32_t r[4];
        ldsm_b16<4, true>(cute::cast_smem_ptr_to_uint(&sV(key, 16 * (h + q / 2))), r);
        CUTE_UNROLL
        for (int s = 0; s < 2; ++s) {  // slice h + s: keys 0-7 in r[2s], 8-15 in r[2s + 1]
          Tensor even = recast<uint32_t>(f.tOrVt(_, 2 * (h + s), kk));
          Tensor odd = recast<uint32_t>(f.tOrVt(_, 2 * (h + s) + 1, kk));
          e4m3x4_to<ElementV>(e4m3_key_pairs(r[2 * s]), even(0), odd(0));
          e4m3x4_to<ElementV>(e4m3_key_pairs(r[2 * s + 1]), even(1), odd(1));
        }
      }
      cute::gemm(w.warp_mma_pv, tOrP(_, _, kk), f.tOrVt(_, _, kk), f.acc_o);
    }
  }

  // The online softmax of the scores (acc_s seen as (ROW,COL)), then
  // acc_o += P V with the warp's part of its slab of the V tile in `stage`.
  template <typename TensorAccS, typename TensorScores, typename Softmax>
  __forceinline__ __device__ void softmax_pv(TensorAccS& acc_s, TensorScores& scores,
                                             Softmax& softmax, float exp_scale_log2,
                                             int stage) const {
    Tensor acc_o_rowcol = f.acc_o_rowcol();  // (ROW,COL)
    softmax.update(scores, acc_o_rowcol, exp_scale_log2);

    Tensor rP = convert_type<typename Traits::ElementV>(acc_s);  // (MMA,MMA_M,MMA_N)
    // (MMA,MMA_M,MMA_K), K = the slab's keys
    Tensor tOrP = make_tensor(rP.data(), acc_layout_as_operand_a(rP.layout()));
    if constexpr (Traits::kFragmentsFromStage) {
      pv_from_stage(tOrP, stage);
      return;
    }
    Tensor tOsVt = w.smem_thr_copy_V.partition_S(smem_tiles.slab_vt(stage));  // (CPY,CPY_D,CPY_K)
    // The softmax rescales the rows of O by the rows of S; MMA_K of P V.
    CUTE_STATIC_ASSERT_V(size<0>(scores) == size<0>(acc_o_rowcol));
    CUTE_STATIC_ASSERT_V(size<2>(tOrP) == size<2>(f.tOrVt));
    gemm_reg_smem(f.acc_o, tOrP, f.tOrVt, tOsVt, w.warp_mma_pv, w.smem_tiled_copy_V,
                  w.smem_thr_copy_V);
  }
};

}  // namespace flash
