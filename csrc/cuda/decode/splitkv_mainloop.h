// The main loop's pieces of the split-KV kernel (splitkv_kernel.h): the
// cp.async helpers of its copies from a contiguous or paged cache, the cache
// layouts an instance serves, the views of its shared-memory tiles, and the
// MMAs of a key tile (SplitKvMma).
#pragma once

#include <cstdint>
#include <utility>

#include <cute/tensor.hpp>

#include "cuda/core/paged_rows.h"
#include "cuda/core/tile_ops.h"
#include "cuda/decode/splitkv_tile_config.h"

namespace flash {

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

// The MMAs of one key tile for one warp: S = Q K^T of its 16 query rows and
// its slab of the tile's keys, then (once the kernel has applied the score
// extras and the mask to S) the online softmax and O += P V. The fragments,
// the shared-memory copies and acc_o are the kernel's, which the role refers
// to, as the loop body it replaces used them. The score extras and the mask
// stay in the kernel's loop body: moved into a function (a role method, a
// free __forceinline__ one or a lambda), or with the role holding the score
// coordinates or the extras' flags, they changed the kernel's machine code.
template <typename Traits, bool kSeveralItems>
struct SplitKvMma {
  using Element = typename Traits::Element;
  static constexpr int kHeadDim = Traits::kHeadDim;
  using Smem = SplitKvSmem<Traits, kSeveralItems>;

  using WarpMma = typename Traits::WarpMma;
  using ThrMma = decltype(WarpMma{}.get_thread_slice(0));
  using SmemTiledCopyQ = decltype(make_tiled_copy_A(typename Traits::SmemCopyAtom{}, WarpMma{}));
  using SmemTiledCopyK = decltype(make_tiled_copy_B(typename Traits::SmemCopyAtom{}, WarpMma{}));
  using SmemTiledCopyV =
      decltype(make_tiled_copy_B(typename Traits::SmemCopyAtomTransposed{}, WarpMma{}));
  template <typename TiledCopy>
  using ThrCopyOf = decltype(TiledCopy{}.get_thread_slice(0));
  // The types of the warp's operand fragments over a shared-memory view of
  // type T.
  template <typename T>
  using FragmentA = decltype(std::declval<const ThrMma&>().partition_fragment_A(std::declval<T>()));
  template <typename T>
  using FragmentB = decltype(std::declval<const ThrMma&>().partition_fragment_B(std::declval<T>()));
  using SlabQ = decltype(std::declval<const Smem&>().slab_q(0));
  using SlabK = decltype(std::declval<const Smem&>().slab_k(0));
  using SlabVtNoSwizzle = decltype(make_tensor(make_smem_ptr(static_cast<Element*>(nullptr)),
                                               typename Traits::SmemLayoutVtSlabNoSwizzle{}));
  using AccO = decltype(partition_fragment_C(WarpMma{}, Shape<_16, Int<kHeadDim>>{}));
  using AccORowcol =
      decltype(make_tensor(std::declval<AccO&>().data(), acc_layout_as_rowcol(AccO{}.layout())));

  const Smem& smem_tiles;
  WarpMma& warp_mma;
  FragmentA<SlabQ>& tSrQ;             // (MMA,MMA_M,MMA_K)
  FragmentB<SlabK>& tSrK;             // (MMA,MMA_N,MMA_K)
  FragmentB<SlabVtNoSwizzle>& tOrVt;  // (MMA,MMA_D,MMA_K)
  AccO& acc_o;                        // (MMA,MMA_M,MMA_D)
  SmemTiledCopyQ& smem_tiled_copy_Q;
  ThrCopyOf<SmemTiledCopyQ>& smem_thr_copy_Q;
  SmemTiledCopyK& smem_tiled_copy_K;
  ThrCopyOf<SmemTiledCopyK>& smem_thr_copy_K;
  SmemTiledCopyV& smem_tiled_copy_V;
  ThrCopyOf<SmemTiledCopyV>& smem_thr_copy_V;
  AccORowcol& acc_o_rowcol;  // (ROW,COL)

  // acc_s (MMA,MMA_M,MMA_N) = Q K^T of the warp's rows of its Q slot (tSsQ)
  // and its slab of the K tile in `stage`.
  template <typename TensorAccS, typename TensorSsQ>
  __forceinline__ __device__ void qk(TensorAccS& acc_s, const TensorSsQ& tSsQ, int stage) const {
    clear(acc_s);
    Tensor tSsK = smem_thr_copy_K.partition_S(smem_tiles.slab_k(stage));  // (CPY,CPY_N,CPY_K)
    gemm_smem_smem(acc_s, tSrQ, tSrK, tSsQ, tSsK, warp_mma, smem_tiled_copy_Q, smem_tiled_copy_K,
                   smem_thr_copy_Q, smem_thr_copy_K);
  }

  // The online softmax of the scores (acc_s seen as (ROW,COL)), then
  // acc_o += P V with the warp's slab of the V tile in `stage`.
  template <typename TensorAccS, typename TensorScores, typename Softmax>
  __forceinline__ __device__ void softmax_pv(TensorAccS& acc_s, TensorScores& scores,
                                             Softmax& softmax, float exp_scale_log2,
                                             int stage) const {
    softmax.update(scores, acc_o_rowcol, exp_scale_log2);

    Tensor rP = convert_type<Element>(acc_s);  // (MMA,MMA_M,MMA_N)
    // (MMA,MMA_M,MMA_K), K = the slab's keys
    Tensor tOrP = make_tensor(rP.data(), acc_layout_as_operand_a(rP.layout()));
    Tensor tOsVt = smem_thr_copy_V.partition_S(smem_tiles.slab_vt(stage));  // (CPY,CPY_D,CPY_K)
    gemm_reg_smem(acc_o, tOrP, tOrVt, tOsVt, warp_mma, smem_tiled_copy_V, smem_thr_copy_V);
  }
};

}  // namespace flash
