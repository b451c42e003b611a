// Tile shape of the split-KV (decode) kernel per compiled head dim. Decode has
// few query rows (seqlen_q x the GQA group), so the query tile is at most 64
// rows; host code reads the tiles and the shared-memory footprint to choose
// the kernel variant and the number of splits.
#pragma once

namespace flash {

constexpr int kSplitKvWarps = 4;
constexpr int kMaxKvSplits = 128;

// Key tile: 16-32 KB of K+V per stage. Above d128 the tile narrows to 32 keys
// so that two stages (and two blocks per SM on sm90) still fit, and the block
// stays under the 99 KB per block of sm86/sm89. At d512 a stage is 64 KB.
constexpr int splitkv_block_n(int compiled_head_dim) {
  return compiled_head_dim <= 64 ? 128 : (compiled_head_dim <= 128 ? 64 : 32);
}

// The warps that split a warp's output columns (the value dim). Up to d256 a
// warp holds its 16 rows of O whole (128 fp32 registers a thread at d256). At
// d512 that would be 256: the four warps become 2 key slabs x 2 halves of the
// value dim; the two warps of a slab compute the same scores and softmax
// (bit for bit: same operands, same instructions) and each multiplies P by
// its half of V, so nothing is exchanged (docs/head_dims_dv_and_512.md,
// "Head dim 512, decode").
constexpr int splitkv_warps_v(int compiled_head_dim) { return compiled_head_dim > 256 ? 2 : 1; }

// The value dim a compiled head dim's kernel computes: its own, but 512 for
// 576, absorbed MLA's latent cache (d_qk = 576, d_v = 512: V is the first 512
// columns of the cache rows, docs/head_dims_dv_and_512.md section 4). O, the
// merge's rows and the partial results are this wide.
constexpr int splitkv_head_dim_v(int compiled_head_dim) {
  return compiled_head_dim == 576 ? 512 : compiled_head_dim;
}

// The four warps of a block split each K/V tile into warps_n slabs of keys and
// the query rows into 4 / warps_n slabs of 16 rows. warps_n = 1 (64 query
// rows, every warp reads the whole tile) suits many rows. Decode has a few
// rows: with warps_n = 1 one warp would do all the MMAs of a block while the
// others only copy, and that warp then paces the stream of tiles; the decode
// variant spreads the keys over the warps instead. A slab feeds P V, so it
// holds at least 16 keys; a Q tile is at least as tall as one pass of the
// 128-thread global copy (16 rows for head dims that are multiples of 64, 32
// rows for the others).
constexpr int splitkv_decode_warps_n(int compiled_head_dim) {
  const int warps = kSplitKvWarps / splitkv_warps_v(compiled_head_dim);
  const int by_keys = splitkv_block_n(compiled_head_dim) / 16;
  const int by_rows = compiled_head_dim % 64 == 0 ? warps : warps / 2;
  const int warps_n = by_keys < by_rows ? by_keys : by_rows;
  return warps_n < warps ? warps_n : warps;
}

constexpr int splitkv_block_m(int compiled_head_dim, int warps_n) {
  return 16 * (kSplitKvWarps / (warps_n * splitkv_warps_v(compiled_head_dim)));
}

// Absorbed MLA's shared cache (KvcacheShape::v_in_k: v_cache is k_cache's
// first 512 columns) at 576: the kernel reads V from the K tile, its first
// 512 columns seen transposed, and loads no V tile. A stage is then one tile,
// and two blocks share an SM: at 128 query heads over one latent head the call
// does 242 FLOP per cache byte, compute-bound on mma.sync at four warps an SM
// with half of the L2 reads spent on V (PERF_LOG 2026-11-30 "MLA decode on
// split-KV, measured", and "V read in the K tile").
constexpr bool splitkv_reads_v_in_k(int compiled_head_dim) { return compiled_head_dim == 576; }

// Whether the two warps of a key slab (its two value halves, kWarpsV = 2)
// split the score product's k-slices between them and add their partial
// scores through shared memory, instead of each computing all of S: the
// product of Q K^T over 512 or 576 columns is most of their MMAs and
// shared-memory reads, and these calls (the d512 forward, absorbed MLA's 128
// heads) are bound by them (PERF_LOG 2026-11-30 "scores split between the
// value halves"). Not the 576 kernel that loads V, whose block would outgrow
// an sm80 SM's shared memory by the exchange's bytes.
constexpr bool splitkv_splits_scores(int compiled_head_dim, bool v_in_k) {
  return splitkv_warps_v(compiled_head_dim) == 2 && (compiled_head_dim == 512 || v_in_k);
}

// Over an e4m3 cache, whether the warps read their MMA fragments straight from
// the staged bytes (ldmatrix over byte pairs, converted in registers) instead
// of from a 16-bit tile the block converts each stage into: the conversion's
// trip through shared memory held the stream at half the bf16 kernel's
// (docs/fp8.md, "Fragments straight from the e4m3 stage"). Head dims
// 64 and 128 (rows of whole 64-byte swizzle atoms, a V tile of their own)
// in the decode variant. The 64-row variant, whose warps each hold a whole
// tile's fragments, spilled 60-80 bytes at 255 registers (ptxas, d128 bf16),
// and d192 / d256, whose warps hold 16 rows of O at 96 / 128 fp32 registers,
// 16-94 bytes: those keep the converted tile.
constexpr bool splitkv_fragments_from_stage(int compiled_head_dim, int warps_n, bool v_in_k,
                                            bool fp8_cache) {
  return fp8_cache && !v_in_k && warps_n > 1 &&
         (compiled_head_dim == 64 || compiled_head_dim == 128);
}

// The split-KV blocks of 128 threads an SM holds at most by their registers:
// two at up to 255 registers a thread, or three at up to 168 for the e4m3
// decode variant at d128 that reads its fragments from the stage, without
// score extras. Its plain kernels fit 168 registers without a spill (ptxas
// bf16 and fp16: 183 / 200 registers at two blocks), where the score-extras
// kernel spilled 118 bytes and d64's paged kernel 44; and at two blocks an SM
// its stream over pages was bound by latency with two warps a scheduler
// (docs/fp8.md, "Three blocks an SM").
constexpr int splitkv_max_blocks_per_sm(int compiled_head_dim, int warps_n, bool v_in_k,
                                        bool fp8_cache, bool score_extras) {
  return compiled_head_dim == 128 &&
                 splitkv_fragments_from_stage(compiled_head_dim, warps_n, v_in_k, fp8_cache) &&
                 !score_extras
             ? 3
             : 2;
}
// The kernel's __launch_bounds__ minimum: three blocks where it must fit
// them, else none (up to 255 registers a thread).
constexpr int splitkv_launch_min_blocks(int compiled_head_dim, int warps_n, bool v_in_k,
                                        bool fp8_cache, bool score_extras) {
  return splitkv_max_blocks_per_sm(compiled_head_dim, warps_n, v_in_k, fp8_cache, score_extras) == 3
             ? 3
             : 1;
}

// (K tile, V tile) buffers: the next tiles' copies overlap this tile's math.
// The decode variant keeps three tiles in flight and is meant to run one
// block per SM: 128 blocks of three stages streamed the cache faster than 256
// blocks of two or three stages, or than 128-key tiles (PERF_LOG 2026-11-22
// 0296a76). The 64-row variant keeps two, so that it
// fits the 99 KB per block of sm86/sm89 at every head dim.
// At d512 the decode variant keeps two (64 KB each, 147 KB with Q: an sm80
// block holds it; three would need 213 KB, sm90 only). Two 64 KB stages are
// still far more bytes in flight per SM than the memory's latency needs.
constexpr int splitkv_stages(int compiled_head_dim, int warps_n) {
  return warps_n > 1 && splitkv_warps_v(compiled_head_dim) == 1 ? 3 : 2;
}

// A block that runs several work items in turn (the persistent grid that
// plan_decode picks, launch/plan.cpp) loads an item's Q tile with its first
// K/V tile, while it still computes earlier items: it keeps a Q tile for the
// item being computed and for each of the kStages items whose first tile may
// be in flight (one tile each at least). A block of one item keeps one.
constexpr int splitkv_q_slots(int compiled_head_dim, int warps_n, bool several_items) {
  return several_items ? splitkv_stages(compiled_head_dim, warps_n) + 1 : 1;
}

// The merge of the warps that share rows (one per key slab) goes through
// shared memory: per warp and row, the output row in fp32, padded by 8 floats
// so that the float2 writes of the 8 rows of a warp's accumulator land on
// distinct banks, and a (row max, row sum) pair.
constexpr int splitkv_merge_row_floats(int compiled_head_dim) {
  return splitkv_head_dim_v(compiled_head_dim) + 8;
}
constexpr int splitkv_merge_bytes(int compiled_head_dim, int warps_n) {
  return 4 * warps_n * splitkv_block_m(compiled_head_dim, warps_n) *
         (splitkv_merge_row_floats(compiled_head_dim) + 2);
}

// The partial scores the warps exchange (splitkv_splits_scores): each
// warp's 16 x slab fp32 scores.
constexpr int splitkv_score_exchange_bytes(int compiled_head_dim, int warps_n, bool v_in_k) {
  return splitkv_splits_scores(compiled_head_dim, v_in_k)
             ? 4 * kSplitKvWarps * 16 * (splitkv_block_n(compiled_head_dim) / warps_n)
             : 0;
}

// Dynamic shared memory of one thread block: the stages of K and V tiles (K
// alone with v_in_k, splitkv_reads_v_in_k) and the Q tile(s), 16-bit, and the
// score exchange (splitkv_splits_scores). An e4m3 cache (fp8_cache) keeps its
// stages in bytes of their own past those, and one 16-bit K / V tile set that
// each tile is converted into before the products (docs/fp8.md, "The
// split-KV kernel over an e4m3 cache"). A block of one item merges in the
// tiles' bytes once its last tile is done; a block of several has the next
// item's tiles in flight by then, so its merge has bytes of its own.
constexpr int splitkv_smem_bytes(int compiled_head_dim, int warps_n, bool several_items = false,
                                 bool v_in_k = false, bool fp8_cache = false) {
  const int tiles_per_stage = v_in_k ? 1 : 2;
  const int stages = splitkv_stages(compiled_head_dim, warps_n);
  const int tile_elems = splitkv_block_n(compiled_head_dim) * compiled_head_dim;
  const int staging_bytes = fp8_cache ? tiles_per_stage * stages * tile_elems : 0;
  // 16-bit tile sets: one per stage, or over an e4m3 cache the one every stage
  // converts into, or none where the warps read the staged bytes.
  const int tile_sets =
      !fp8_cache
          ? stages
          : (splitkv_fragments_from_stage(compiled_head_dim, warps_n, v_in_k, fp8_cache) ? 0 : 1);
  const int tiles = staging_bytes +
                    2 * compiled_head_dim *
                        (tiles_per_stage * tile_sets * splitkv_block_n(compiled_head_dim) +
                         splitkv_q_slots(compiled_head_dim, warps_n, several_items) *
                             splitkv_block_m(compiled_head_dim, warps_n)) +
                    splitkv_score_exchange_bytes(compiled_head_dim, warps_n, v_in_k);
  // A block of one item merges in its tiles' bytes, which with the e4m3
  // fragments read from the stage can be fewer than the merge's (d256).
  const int merge = splitkv_merge_bytes(compiled_head_dim, warps_n);
  return several_items ? tiles + merge : (tiles < merge ? merge : tiles);
}
// Longest append the split-KV kernel does itself (params.append_in_attention:
// a decode step, or a few speculative tokens). Its new rows are the last
// keys, so they lie in the first key tiles an item streams, which its
// prologue loads.
constexpr int kAppendInAttentionMaxRows = 16;

// Rotary table rows that the appending kernel keeps in shared memory, for
// positions rotary_start + [0, rows) (rotary_start: rotary_seqlens[b], else cache_seqlens[b]): the
// query rows of its block (one position per query under a causal / local mask) and the new keys.
constexpr int splitkv_rotary_table_rows(int compiled_head_dim, int warps_n) {
  return splitkv_block_m(compiled_head_dim, warps_n) > kAppendInAttentionMaxRows
             ? splitkv_block_m(compiled_head_dim, warps_n)
             : kAppendInAttentionMaxRows;
}

// Dynamic shared memory of the appending kernel: the tiles, then per table
// row compiled_head_dim / 2 cosines and as many sines (16-bit).
constexpr int splitkv_append_smem_bytes(int compiled_head_dim, int warps_n) {
  return splitkv_smem_bytes(compiled_head_dim, warps_n) +
         2 * splitkv_rotary_table_rows(compiled_head_dim, warps_n) * compiled_head_dim;
}

static_assert(splitkv_smem_bytes(256, 1) <= 99 * 1024 && splitkv_smem_bytes(128, 1) <= 99 * 1024,
              "the 64-row variant fits sm86/sm89 (99 KB per block)");
static_assert(splitkv_decode_warps_n(512) == 2 && splitkv_block_m(512, 2) == 16 &&
                  splitkv_smem_bytes(512, 2) == 147456 + 4096 &&
                  splitkv_smem_bytes(512, 2) <= 163 * 1024,
              "d512: 2 key slabs x 2 value halves of 16 rows, two 64 KB stages and the score "
              "exchange, an sm80 block");
static_assert(splitkv_decode_warps_n(576) == 2 && splitkv_smem_bytes(576, 2) <= 163 * 1024,
              "absorbed MLA's 576: the same split, an sm80 block");
static_assert(splitkv_smem_bytes(128, 4, false, false, true) == 3 * 16384 + 4096 &&
                  splitkv_smem_bytes(96, 4, false, false, true) == 6 * 6144 + 4 * 6144 + 3072,
              "over an e4m3 cache: d128 three 16 KB staging stages and Q; d96 (rows not whole "
              "64-byte atoms) also the 16-bit tile set its stages convert into");
static_assert(splitkv_smem_bytes(576, 2, false, true) == 92160 + 4096 &&
                  2 * (splitkv_smem_bytes(576, 2, false, true) + 1024) <= 228 * 1024,
              "576 with V read in the K tile and the score exchange: two blocks an sm90 SM");

// The variant for rows_total = seqlen_q x (nheads / nheads_k) packed rows on
// a device with max_smem_per_block bytes of shared memory per block: the
// decode variant when the rows fit one block and its stages fit the device.
// At d512 there is no 64-row variant (a warp cannot hold 16 rows of O whole):
// the decode variant serves every call, many rows as several query blocks,
// and 0 says that the device's blocks cannot hold it (sm86 / sm89).
inline int splitkv_warps_n_for(int compiled_head_dim, long long rows_total,
                               long long max_smem_per_block) {
  const int decode = splitkv_decode_warps_n(compiled_head_dim);
  const bool decode_fits = splitkv_smem_bytes(compiled_head_dim, decode) <= max_smem_per_block;
  if (splitkv_warps_v(compiled_head_dim) > 1) return decode_fits ? decode : 0;
  return rows_total <= splitkv_block_m(compiled_head_dim, decode) && decode_fits ? decode : 1;
}

}  // namespace flash
