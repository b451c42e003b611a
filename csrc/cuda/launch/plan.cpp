// The plans of plan.h. Plain C++: compiled into every build, CPU-only ones
// included, so that the debug ops can describe a plan for any device.
#include "cuda/launch/plan.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>

#include "common/head_dim_bounds.h"
#include "cuda/bwd/bwd_tile_config.h"
#include "cuda/core/paged_box_rows.h"
#include "cuda/decode/splitkv_tile_config.h"
#include "cuda/fwd/fwd_tile_config.h"
#include "cuda/fwd/fwd_tile_schedule.h"

namespace flash {

KernelOverride parse_kernel_override(const char* value) {
  if (value != nullptr && std::strcmp(value, "sm80") == 0) return KernelOverride::kSm80;
  if (value != nullptr && std::strcmp(value, "sm90") == 0) return KernelOverride::kSm90;
  return KernelOverride::kNone;
}

const char* kernel_override_name(KernelOverride value) {
  switch (value) {
    case KernelOverride::kSm80: return "sm80";
    case KernelOverride::kSm90: return "sm90";
    default: return "none";
  }
}

KernelChoice kernel_choice(const DeviceDesc& device, KernelOverride override_kernel) {
  if (device.cc_major != 9 || device.cc_minor != 0) return KernelChoice::kSm80;
  if (override_kernel == KernelOverride::kSm80) return KernelChoice::kSm80;
  if (override_kernel == KernelOverride::kSm90) return KernelChoice::kSm90;
  return KernelChoice::kAuto;
}

namespace {

bool tma_can_describe(const void* ptr, int rows, int head_dim, int heads, int batch,
                      const QKVStrides& strides) {
  auto ok = [](int64_t extent, int64_t stride) {
    return extent == 1 || (stride > 0 && stride % 8 == 0 && stride < (int64_t(1) << 38));
  };
  return reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && rows > 0 && head_dim % 8 == 0 && heads > 0 &&
         batch > 0 && ok(rows, strides.row_stride) && ok(heads, strides.head_stride) &&
         ok(batch, strides.batch_stride);
}

int tma_q_rows(const FwdParams& p) { return p.cu_seqlens_q ? p.total_q : p.seqlen_q; }
int tma_k_rows(const FwdParams& p) { return p.cu_seqlens_q ? p.total_k : p.seqlen_k; }
int tma_batches(const FwdParams& p) { return p.cu_seqlens_q ? 1 : p.batch; }

}  // namespace

bool fwd_tma_can_load(const FwdParams& p) {
  if (!tma_can_describe(p.q_ptr, tma_q_rows(p), p.head_dim, p.nheads, tma_batches(p), p.q)) {
    return false;
  }
  if (p.block_table != nullptr) {
    // Paged keys: TMA boxes of at least 8 rows inside a page, or (other page
    // sizes) 16-byte cp.async chunks of the same view, which its alignment
    // rules cover too: FwdSm90Tma::can_load.
    const int page_size = p.page_size.divisor;
    return tma_can_describe(p.k_ptr, page_size, p.head_dim, p.nheads_k, p.num_pages, p.k) &&
           tma_can_describe(p.v_ptr, page_size, p.head_dim_v, p.nheads_k, p.num_pages, p.v);
  }
  return tma_can_describe(p.k_ptr, tma_k_rows(p), p.head_dim, p.nheads_k, tma_batches(p), p.k) &&
         tma_can_describe(p.v_ptr, tma_k_rows(p), p.head_dim_v, p.nheads_k, tma_batches(p), p.v);
}

bool bwd_tma_can_load(const BwdParams& p) {
  return fwd_tma_can_load(p) &&
         tma_can_describe(p.do_ptr, tma_q_rows(p), p.head_dim_v, p.nheads, tma_batches(p), p.dout);
}

// ---------------------------------------------------------------- forward

namespace {

// A row of FwdTileConfig, read at run time.
struct FwdTileRow {
  int block_m, block_n, num_warps, block_n_extras, num_warps_extras;
  int block_m_sm90, block_n_sm90, min_seqlen_k_sm90, min_blocks_per_sm_sm90;
  // FwdTileConfigLargeSmem's SM80 tile (block_m 0: none).
  int large_block_m = 0, large_block_n = 0, large_num_warps = 0;
  int large_block_n_extras = 0, large_num_warps_extras = 0;
};

template <int kHeadDim, int kHeadDimV = kHeadDim>
constexpr FwdTileRow fwd_tile_row_of() {
  using C = FwdTileConfig<kHeadDim, kHeadDimV>;
  using L = FwdTileConfigLargeSmem<kHeadDim>;
  const bool large = L::kExists && kHeadDimV == kHeadDim;
  return {C::kBlockM,
          C::kBlockN,
          C::kNWarps,
          C::kBlockNExtras,
          C::kNWarpsExtras,
          C::kBlockMSm90,
          C::kBlockNSm90,
          C::kMinSeqlenKSm90,
          C::kMinBlocksPerSmSm90,
          large ? L::kBlockM : 0,
          large ? L::kBlockN : 0,
          large ? L::kNWarps : 0,
          large ? L::kBlockNExtras : 0,
          large ? L::kNWarpsExtras : 0};
}

FwdTileRow fwd_tile_row(int compiled_head_dim) {
  switch (compiled_head_dim) {
    case 32: return fwd_tile_row_of<32>();
    case 64: return fwd_tile_row_of<64>();
    case 96: return fwd_tile_row_of<96>();
    case 128: return fwd_tile_row_of<128>();
    case 160: return fwd_tile_row_of<160>();
    case 192: return fwd_tile_row_of<192>();
    case 224: return fwd_tile_row_of<224>();
    case 256: return fwd_tile_row_of<256>();
    case 512: return fwd_tile_row_of<512>();
    default: return {};
  }
}

// The row of the compiled (d_qk, d_v): d_qk's row, or a specialised pair's
// (fwd_sm90_pair_head_dim_v).
FwdTileRow fwd_tile_row(int compiled_head_dim, int compiled_head_dim_v) {
  if (compiled_head_dim_v == compiled_head_dim) return fwd_tile_row(compiled_head_dim);
  if (compiled_head_dim == 192 && compiled_head_dim_v == 128) return fwd_tile_row_of<192, 128>();
  return {};
}

// The compiled d_v of the Hopper forward for a call of this compiled d_qk
// (round_up_head_dim) and requested d_v: the (192, 128) pair's kernel for
// d_qk in (160, 192] and d_v <= 128 (DeepSeek MLA training: 192 / 128), whose
// P V is d_v wide instead of 192 (the counted work of 192 / 128 instead of
// 1.2 times it, docs/head_dims_dv_and_512.md section 1); the compiled d_qk
// (level 1) for every other pair. The pair's kernel is built wherever d_qk's
// is (setup.py selects instantiation files by their d_qk).
int fwd_sm90_pair_head_dim_v(int compiled_head_dim, int head_dim_v) {
  return compiled_head_dim == 192 && head_dim_v <= 128 ? 128 : compiled_head_dim;
}

// The reason of a plan on the (192, 128) pair's Hopper kernel, by its grid.
const char* fwd_sm90_pair_reason(FwdGrid grid) {
  switch (grid) {
    case FwdGrid::kTileCounter:
      return "Hopper (192, 128) kernel (d_qk in (160, 192], d_v <= 128: P V at 128 columns); "
             "short tiles of differing work, more than SMs: persistent grid taking tiles from a "
             "counter (fwd_sm90_takes_tiles_from_counter)";
    case FwdGrid::kFixedShares:
      return "Hopper (192, 128) kernel (d_qk in (160, 192], d_v <= 128: P V at 128 columns); "
             "tiles of equal work, more than SMs: persistent grid of fixed shares";
    default:
      return "Hopper (192, 128) kernel (d_qk in (160, 192], d_v <= 128: P V at 128 columns); "
             "one block per tile";
  }
}

int64_t ceil_div(int64_t a, int64_t b) { return b > 0 ? (a + b - 1) / b : 0; }

// Whether a call the Hopper kernel can take runs it rather than the SM80
// kernel: from the tile table's key count on (kMinSeqlenKSm90), and below it
// when there are many query blocks to spread, at least the table's
// kMinBlocksPerSmSm90 of 128 rows per SM (the reasons beside the table).
// Short calls of many query blocks ran faster on the Hopper kernel, short
// calls of few slower (PERF_LOG 2026-11-25 76288cf).
bool fwd_sm90_by_shape(const FwdParams& params, int num_sms, int min_seqlen_k,
                       int min_blocks_per_sm) {
  return params.seqlen_k >= min_seqlen_k ||
         (num_sms > 0 && fwd_sm90_num_tiles(params) >= int64_t(min_blocks_per_sm) * num_sms);
}

// The most keys one query block sees: with both window sides bounded, the
// window plus the block's own rows; else up to every key.
int64_t fwd_sm90_most_keys_per_tile(const FwdParams& params) {
  if (params.window_left >= 0 && params.window_right >= 0) {
    const int64_t window = int64_t(params.window_left) + params.window_right + kFwdSm90BlockM;
    return window < params.seqlen_k ? window : params.seqlen_k;
  }
  return params.seqlen_k;
}

// Whether a forward that the Hopper kernel takes runs the grid that takes its
// tiles past the first wave from params.tile_counter (fwd_kernel_sm90.h):
// more tiles than SMs, of different work, each short enough that a tile's
// prologue and epilogue are a large share of it, on the plain score rule
// (softcap, ALiBi and dropout run the Hopper kernel's other grids; one kernel
// instantiation fewer per head dim). Against one block per tile the counter
// wins at short key counts and fades by 4096 keys, hence the cap of 2048
// keys per tile (PERF_LOG 2026-11-24 30a90ef); past it, on varlen
// batches too, one block per query block is faster (PERF_LOG 2026-11-24
// 9f57c38).
constexpr int64_t kFwdSm90MostKeysPerTileFromCounter = 2048;
bool fwd_sm90_takes_tiles_from_counter(const FwdParams& params, int num_sms) {
  const ScoreFeatures rule = score_features_of(params);
  return !rule.has_sm90_mods() && fwd_tiles_differ_in_work(params) && num_sms > 0 &&
         fwd_sm90_num_tiles(params) > num_sms &&
         fwd_sm90_most_keys_per_tile(params) <= kFwdSm90MostKeysPerTileFromCounter;
}

// How the Hopper producer reads paged keys: TMA boxes where a box of at
// least kPagedBoxesMinRows (64) rows fits both a page and the key tile
// (paged_box_rows.h, which says what the H200 measured); else the row
// gather, which also replaced the SM80 kernel's row-by-row reads for small
// pages (2.2-3.1x the contiguous time with 1- and 5-row pages, PERF_LOG
// 2026-11-27 52aa232; 1-row pages 2.24-2.92x, 6531fcc).
FwdKeys fwd_sm90_keys(const FwdParams& params, int block_n) {
  if (params.block_table == nullptr) return FwdKeys::kContiguous;
  return paged_tma_box_rows(params.page_size.divisor, block_n) >= kPagedBoxesMinRows
             ? FwdKeys::kPagedBoxes
             : FwdKeys::kPagedGather;
}

// The tile of the Hopper forward's fixed-share and one-per-tile grids: the
// table's, or for dropout fwd_sm90_dropout_tile's (plan.h), which leaves the
// table's where none draws (then fwd_sm90_refusal refuses the call).
FwdSm90TileShape fwd_sm90_grid_tile(const ScoreFeatures& rule, int compiled_head_dim_v,
                                    const FwdTileRow& row) {
  const FwdSm90TileShape table{row.block_m_sm90, row.block_n_sm90};
  if (!rule.dropout) return table;
  const FwdSm90TileShape dropout =
      fwd_sm90_dropout_tile(compiled_head_dim_v, row.block_m_sm90, row.block_n_sm90);
  return dropout.block_m > 0 ? dropout : table;
}

// Why the Hopper forward does not take a call that its build and tile table
// would allow, or null if it does; tile is the grid's (fwd_sm90_grid_tile).
const char* fwd_sm90_refusal(const FwdParams& params, KernelChoice choice, const DeviceDesc& device,
                             int compiled_head_dim_v, const FwdTileRow& row,
                             const FwdSm90TileShape& tile, bool grid_fits, bool tma_ok) {
  const ScoreFeatures rule = score_features_of(params);
  if (choice == KernelChoice::kSm80) {
    return device.cc_major == 9 && device.cc_minor == 0
               ? "FLASH_ATTN_FWD_KERNEL=sm80 forces the SM80 kernel"
               : "not an sm90 device: the SM80 kernel";
  }
  if (choice == KernelChoice::kAuto &&
      !fwd_sm90_by_shape(params, device.num_sms, row.min_seqlen_k_sm90,
                         row.min_blocks_per_sm_sm90)) {
    return "fewer keys than the table's kMinSeqlenKSm90 and fewer 128-row query blocks than "
           "kMinBlocksPerSmSm90 per SM (fwd_sm90_by_shape): the SM80 kernel";
  }
  if (!grid_fits) return "more tiles than a grid x holds: the SM80 kernel's 3-D grid";
  if (rule.dropout && !fwd_sm90_draws_dropout(compiled_head_dim_v, tile.block_m, tile.block_n)) {
    return "dropout on a Hopper tile without registers to spare for its draws "
           "(fwd_sm90_dropout_tile): the SM80 kernel";
  }
  if (!rule.sm90_scale()) {
    return "softmax scale zero, subnormal or not finite: the SM80 kernel's general variant";
  }
  if (!tma_ok) return "TMA cannot describe q / k / v (alignment or strides): the SM80 kernel";
  return nullptr;
}

}  // namespace

FwdPlan plan_fwd(const FwdParams& params, const DeviceDesc& device, KernelOverride override_kernel,
                 bool tma_ok) {
  FwdPlan plan;
  plan.choice = kernel_choice(device, override_kernel);
  if (params.seqlen_q == 0 || params.batch == 0 || params.nheads == 0) {
    plan.reason = "no query row, head or batch entry: nothing to launch";
    return plan;
  }
  plan.return_probs = params.p_ptr != nullptr;
  // A kernel override picks between the forward kernels, which head dims
  // above 256 and FP8 attention do not have: those run on the split-KV
  // kernel whatever it says.
  const bool only_splitkv = splitkv_only_head_dim(params.head_dim) || params.kv_fp8;
  if (params.cu_seqlens_q == nullptr &&
      (override_kernel == KernelOverride::kNone || only_splitkv)) {
    FwdSplitShape split;
    split.batch = params.batch;
    split.nheads = params.nheads;
    split.nheads_k = params.nheads_k;
    split.max_seqlen_q = params.seqlen_q;
    split.max_seqlen_k = params.seqlen_k;
    split.head_dim = params.head_dim;
    split.head_dim_v = params.head_dim_v;
    split.requested_splits = 0;
    split.score_extras = score_features_of(params).has_extras();
    split.dropout = params.dropout_p > 0.f;
    split.return_softmax = plan.return_probs;
    split.fp8 = params.kv_fp8;
    const DecodePlan splitkv = plan_fwd_split(split, device);
    if (splitkv.num_splits > 0) {
      plan.kernel = FwdKernel::kSplitKv;
      plan.head_dim = plan.head_dim_v = splitkv.compiled_head_dim;
      plan.block_m = splitkv.block_m;
      plan.splitkv = splitkv;
      plan.reason = params.kv_fp8 ? "e4m3 keys and values: the split-KV kernel's e4m3 "
                                    "instances, their only kernel (plan_fwd_split)"
                    : only_splitkv
                        ? "head dim above 256: the split-KV kernel, its only kernel "
                          "(plan_fwd_split)"
                        : "seqlen_q x (nheads / nheads_k) fits one split-KV query block: the "
                          "split-KV kernel (plan_fwd_split)";
      return plan;
    }
  }
  if (only_splitkv) {
    plan.reason =
        "head dim above 256 or FP8 attention and no split-KV plan (dropout, S_dmask, "
        "seqused_q or the device's shared memory): no kernel";
    return plan;  // kNone: the op refuses the call first
  }
  const int compiled = round_up_head_dim(params.head_dim);
  const FwdTileRow row = fwd_tile_row(compiled);
  // The Hopper kernel's (d_qk, d_v) and row: a specialised pair's or d_qk's.
  const int compiled_v = fwd_sm90_pair_head_dim_v(compiled, params.head_dim_v);
  const FwdTileRow sm90_row = fwd_tile_row(compiled, compiled_v);
  const ScoreFeatures rule = score_features_of(params);
  // Softcap, ALiBi or dropout: the Hopper kernel's kWithScoreMods variant.
  const bool score_mods = rule.has_sm90_mods();
  const bool score_extras = rule.has_extras();

  const char* sm80_reason = nullptr;
  if (!device.sm90a_built) {
    sm80_reason = "no sm_90a code in this build: the SM80 kernel";
  } else if (sm90_row.block_n_sm90 <= 0) {
    sm80_reason = "no Hopper tile at this head dim (FwdTileConfig block N 0): the SM80 kernel";
  } else {
    const FwdSm90TileShape tile = fwd_sm90_grid_tile(rule, compiled_v, sm90_row);
    const FwdKeys keys = fwd_sm90_keys(params, tile.block_n);
    // The row gather's third K / V stage leaves d128 no separate O tile.
    const int stages = fwd_sm90_kv_stages(keys, compiled, compiled_v, tile.block_m, tile.block_n);
    const bool persistent =
        fwd_sm90_persistent(compiled, compiled_v, tile.block_m, tile.block_n, stages);
    const int64_t num_tiles = fwd_sm90_num_tiles(params, tile.block_m);
    // Only the persistent grids walk more tiles than grid x holds.
    const bool grid_fits = persistent || num_tiles <= kFwdSm90MaxGridTiles;
    sm80_reason = fwd_sm90_refusal(params, plan.choice, device, compiled_v, sm90_row, tile,
                                   grid_fits, tma_ok);
    if (sm80_reason == nullptr) {
      plan.kernel = FwdKernel::kSm90;
      plan.variant = score_mods ? FwdVariant::kScoreMods : FwdVariant::kPlain;
      plan.head_dim = compiled;
      plan.head_dim_v = compiled_v;
      plan.block_n = tile.block_n;
      plan.keys = keys;
      // The counter grid runs 128-row tiles and the plain rule only (one
      // instantiation fewer per head dim).
      if (fwd_sm90_persistent(compiled, compiled_v, kFwdSm90BlockM, sm90_row.block_n_sm90,
                              fwd_sm90_kv_stages(keys, compiled, compiled_v, kFwdSm90BlockM,
                                                 sm90_row.block_n_sm90)) &&
          !score_mods && fwd_sm90_takes_tiles_from_counter(params, device.num_sms)) {
        plan.grid = FwdGrid::kTileCounter;
        plan.block_m = kFwdSm90BlockM;
        plan.grid_x = device.num_sms;
        plan.reason =
            "Hopper kernel; short tiles of differing work, more than SMs: persistent grid taking "
            "tiles from a counter (fwd_sm90_takes_tiles_from_counter)";
      } else {
        plan.block_m = tile.block_m;
        const bool more_tiles_than_sms = device.num_sms > 0 && num_tiles > device.num_sms;
        // Fixed shares also where one block per tile would not fit grid x.
        if (persistent && more_tiles_than_sms &&
            (!fwd_tiles_differ_in_work(params) || num_tiles > kFwdSm90MaxGridTiles)) {
          plan.grid = FwdGrid::kFixedShares;
          plan.grid_x = device.num_sms;
          plan.reason =
              "Hopper kernel; tiles of equal work, more than SMs: persistent grid of fixed shares";
        } else {
          plan.grid = FwdGrid::kOnePerTile;
          plan.grid_x = num_tiles;
          plan.reason = !persistent && stages == 3
                            ? "Hopper kernel; the row gather's three K / V stages leave no "
                              "separate O tile: one block per tile"
                        : !persistent ? "Hopper kernel; no separate O tile at this head dim: one "
                                        "block per tile"
                        : !more_tiles_than_sms
                            ? "Hopper kernel; no more tiles than SMs: one block per tile"
                            : "Hopper kernel; tiles of differing work: one block per tile, handed "
                              "out by the hardware";
        }
      }
      if (compiled_v != compiled) plan.reason = fwd_sm90_pair_reason(plan.grid);
      plan.num_warps = 4 * (plan.block_m / 64) + 4;  // MMA warpgroups and the producer's
      return plan;
    }
  }
  // The large-shared-memory tile where the device holds it, else the table's.
  const int large_block_n = score_extras ? row.large_block_n_extras : row.large_block_n;
  plan.sm80_large_smem =
      row.large_block_m > 0 && device.smem_per_block_optin >=
                                   fwd_sm80_smem_bytes(compiled, row.large_block_m, large_block_n);
  const int sm80_block_m = plan.sm80_large_smem ? row.large_block_m : row.block_m;
  const int sm80_block_n = plan.sm80_large_smem ? large_block_n
                           : score_extras       ? row.block_n_extras
                                                : row.block_n;
  if (device.smem_per_block_optin < fwd_sm80_smem_bytes(compiled, sm80_block_m, sm80_block_n)) {
    // d512 on a device of 99 KiB blocks (sm86 / sm89); the op refuses it.
    plan.reason =
        "the SM80 kernel's tile needs more shared memory per block than the device's "
        "blocks hold: no kernel";
    return plan;
  }
  plan.kernel = FwdKernel::kSm80;
  plan.variant = score_extras ? FwdVariant::kScoreExtras : FwdVariant::kPlain;
  plan.head_dim = compiled;
  plan.head_dim_v = compiled;
  plan.grid = FwdGrid::kHeadsBatch;
  plan.block_m = sm80_block_m;
  plan.block_n = sm80_block_n;
  plan.num_warps = plan.sm80_large_smem
                       ? (score_extras ? row.large_num_warps_extras : row.large_num_warps)
                   : score_extras ? row.num_warps_extras
                                  : row.num_warps;
  plan.grid_x = ceil_div(params.seqlen_q, plan.block_m);
  plan.grid_y = params.nheads;
  plan.grid_z = params.batch;
  plan.reason = sm80_reason;
  return plan;
}

// --------------------------------------------------------------- backward

namespace {

struct BwdTileRow {
  int block_m = 0, block_n = 0, block_m_sm90 = 0;
  bool double_buffer = false;
  // BwdTileConfigLargeSmem's tile, where it exists.
  bool large_smem_exists = false, large_smem_double_buffer = false;
  bool large_smem_serves_score_extras = false;
  int large_smem_block_m = 0, large_smem_block_n = 0;
};

template <int kHeadDim>
constexpr BwdTileRow bwd_tile_row_of() {
  using C = BwdTileConfig<kHeadDim>;
  using L = BwdTileConfigLargeSmem<kHeadDim>;
  BwdTileRow row{C::kBlockM, C::kBlockN, C::kBlockMSm90, C::kDoubleBufferQdO};
  if constexpr (L::kExists) {
    row.large_smem_exists = true;
    row.large_smem_double_buffer = L::kDoubleBufferQdO;
    row.large_smem_serves_score_extras = L::kServesScoreExtras;
    row.large_smem_block_m = L::kBlockM;
    row.large_smem_block_n = L::kBlockN;
  }
  return row;
}

BwdTileRow bwd_tile_row(int compiled_head_dim) {
  switch (compiled_head_dim) {
    case 32: return bwd_tile_row_of<32>();
    case 64: return bwd_tile_row_of<64>();
    case 96: return bwd_tile_row_of<96>();
    case 128: return bwd_tile_row_of<128>();
    case 160: return bwd_tile_row_of<160>();
    case 192: return bwd_tile_row_of<192>();
    case 224: return bwd_tile_row_of<224>();
    case 256: return bwd_tile_row_of<256>();
    case 512: return bwd_tile_row_of<512>();
    default: return {};
  }
}

// Deterministic dQ on the SM80 kernel (and on the Hopper one under a left
// window bound): each of num_splits thread blocks per (batch, head) owns one
// fp32 slice and walks its key blocks in order, so every element's additions
// happen in a fixed order; the slices are summed in order afterwards. Enough
// splits to keep about two blocks per SM, never more than there are key blocks.
int deterministic_dq_splits(int batch, int nheads, int max_seqlen_k, int block_n, int sm_count) {
  const int num_n_blocks = (max_seqlen_k + block_n - 1) / block_n;
  const int64_t heads_total = std::max<int64_t>(int64_t(batch) * nheads, 1);
  const int64_t wanted = (2 * int64_t(sm_count) + heads_total - 1) / heads_total;
  return static_cast<int>(std::clamp<int64_t>(wanted, 1, std::max(num_n_blocks, 1)));
}

// The compiled d_v of the Hopper backward for a call of this compiled d_qk
// (round_up_head_dim) and requested d_v, as the forward's
// (fwd_sm90_pair_head_dim_v): the (192, 128) pair's kernel for d_qk in
// (160, 192] and d_v <= 128, whose dP^T and dV run 128 columns of dO and V
// instead of 192; the compiled d_qk (level 1) for every other pair. Its tile
// row is d192's (BwdTileConfig<192, 128>), so the accumulators and grid are
// d_qk's; its shared memory and dropout rule are the pair's.
int bwd_sm90_pair_head_dim_v(int compiled_head_dim, int head_dim_v) {
  return compiled_head_dim == 192 && head_dim_v <= 128 ? 128 : compiled_head_dim;
}

void use_dq_splits(BwdPlan& plan, const BwdParams& params, const DeviceDesc& device) {
  plan.num_splits = deterministic_dq_splits(params.batch, params.nheads, params.seqlen_k,
                                            plan.block_n, device.num_sms);
  plan.grid_x = plan.num_splits;
}

}  // namespace

BwdPlan plan_bwd(const BwdParams& params, const DeviceDesc& device, KernelOverride override_kernel,
                 bool tma_ok) {
  BwdPlan plan;
  plan.choice = kernel_choice(device, override_kernel);
  if (params.batch == 0 || params.nheads == 0 || params.seqlen_q == 0 || params.seqlen_k == 0) {
    plan.reason = "no query, key, head or batch entry: every gradient is zero";
    return plan;
  }
  const int compiled = round_up_head_dim(params.head_dim);
  const BwdTileRow row = bwd_tile_row(compiled);
  // The Hopper kernel's (d_qk, d_v): a specialised pair's or d_qk's.
  const int compiled_v = bwd_sm90_pair_head_dim_v(compiled, params.head_dim_v);
  plan.block_m = row.block_m;
  plan.block_n = row.block_n;
  plan.grid_x = ceil_div(params.seqlen_k, row.block_n);
  plan.grid_y = params.nheads;
  plan.grid_z = params.batch;

  const ScoreFeatures rule = score_features_of(params);
  // Softcap, ALiBi or dropout: the Hopper kernel's kWithScoreMods variant.
  const bool score_mods = rule.has_sm90_mods();
  const bool dropout = rule.dropout;
  const bool scale_ok = rule.sm90_scale();
  const bool score_extras = rule.has_extras();
  // The Hopper kernel's query block: the table's, or for dropout the tile
  // that draws it (d64: 64 rows), 0 if none does.
  const int sm90_block_m =
      dropout ? bwd_sm90_dropout_block_m(compiled, compiled_v, row.block_m_sm90, row.block_n)
              : row.block_m_sm90;

  const char* sm80_reason = nullptr;
  if (!device.sm90a_built) {
    sm80_reason = "no sm_90a code in this build";
  } else if (row.block_m_sm90 <= 0) {
    sm80_reason = "no Hopper tile at this head dim (BwdTileConfig kBlockMSm90 0)";
  } else if (plan.choice == KernelChoice::kSm80) {
    sm80_reason = device.cc_major == 9 && device.cc_minor == 0
                      ? "FLASH_ATTN_BWD_KERNEL=sm80 forces the SM80 kernel"
                      : "not an sm90 device";
  } else if (sm90_block_m == 0) {
    sm80_reason =
        "dropout on a Hopper tile that does not draw it (bwd_sm90_dropout_block_m): the SM80 "
        "backward replays its keep mask";
  } else if (!scale_ok) {
    sm80_reason = "softmax scale zero, subnormal or not finite";
  } else if (device.smem_per_block_optin < bwd_sm90_smem_bytes(compiled, compiled_v, sm90_block_m,
                                                               row.block_n, kBwdSm90QdOStages)) {
    sm80_reason = "the device's blocks cannot hold the Hopper kernel's shared memory";
  } else if (!tma_ok) {
    sm80_reason = "TMA cannot describe q / dO / k / v (alignment or strides)";
  } else {
    plan.kernel = BwdKernel::kSm90;
    plan.variant = score_mods ? FwdVariant::kScoreMods : FwdVariant::kPlain;
    plan.block_m = sm90_block_m;
    plan.head_dim = compiled;
    plan.head_dim_v = compiled_v;
    plan.reason = compiled_v == compiled
                      ? "Hopper kernel"
                      : "Hopper (192, 128) kernel (d_qk in (160, 192], d_v <= 128: dO, V and dV "
                        "at 128 columns)";
    // Deterministic: key blocks add their dQ in a fixed order, the last key
    // block first, one block per key block as in the default mode
    // (bwd_sm90_dq_turn; PERF_LOG 2026-11-28, ordered dQ). A query block's
    // turns count its contributors only when they are key blocks 0 ..
    // n - 1, that is with no left window bound; the ordered kernel is a
    // variant of the plain one. Otherwise dQ splits.
    if (params.deterministic) {
      plan.ordered_dq = params.window_left < 0 && !score_mods;
      if (!plan.ordered_dq) use_dq_splits(plan, params, device);
    }
    return plan;
  }
  plan.variant = score_extras ? FwdVariant::kScoreExtras : FwdVariant::kPlain;
  plan.kernel = BwdKernel::kSm80;
  plan.head_dim = compiled;
  plan.head_dim_v = compiled;
  plan.pad_v = params.head_dim_v < params.head_dim;
  plan.reason = sm80_reason;
  plan.sm80_smem_bytes = bwd_sm80_smem_bytes(compiled, row.block_m, row.block_n, row.double_buffer);
  // The large-shared-memory tile where the device has room: the plain
  // variant, and the score extras where the tile serves them. Its key blocks
  // are the grid's.
  const int large_smem_bytes =
      row.large_smem_exists
          ? bwd_sm80_smem_bytes(compiled, row.large_smem_block_m, row.large_smem_block_n,
                                row.large_smem_double_buffer)
          : 0;
  if (row.large_smem_exists && (!score_extras || row.large_smem_serves_score_extras) &&
      device.smem_per_block_optin >= large_smem_bytes) {
    plan.kernel = BwdKernel::kSm80LargeSmem;
    plan.sm80_smem_bytes = large_smem_bytes;
    plan.block_m = row.large_smem_block_m;
    plan.block_n = row.large_smem_block_n;
    plan.grid_x = ceil_div(params.seqlen_k, plan.block_n);
  }
  if (params.deterministic) use_dq_splits(plan, params, device);
  plan.smem_exceeds_device = plan.sm80_smem_bytes > device.smem_per_block_optin;
  return plan;
}

// ----------------------------------------------------------------- decode

namespace {

// Split-KV blocks of smem_bytes of dynamic shared memory that one SM holds at
// once: as many as the registers allow (max_blocks, splitkv_max_blocks_per_sm:
// two, or three for the e4m3 decode variant's plain kernels), shared memory
// may allow fewer.
int64_t splitkv_blocks_per_sm(int64_t smem_bytes, const DeviceDesc& device, int max_blocks = 2) {
  return std::clamp<int64_t>(
      int64_t(device.smem_per_sm) / (smem_bytes + int64_t(device.reserved_smem_per_block)), 1,
      max_blocks);
}

// Splits of the key range for num_splits = 0. Decode reads the cache once, so
// what matters is keeping every SM busy until the end: the grid is cut into
// waves of (SMs x resident blocks per SM), and a last wave that is mostly
// empty leaves most of the memory system idle. Among the split counts whose
// fill of the waves is at least 95% of the best one's, the smallest wins
// (fewer partial results to write and merge; a looser tolerance left paged
// caches an emptier last wave: PERF_LOG 2026-11-22 5987c63). So small batches
// are split until they fill about one wave too (batch 1 x 8 kv heads: 16
// splits, 128 blocks on 132 SMs), and no further: the 4 SMs left idle cost the
// stream nothing, since 128 blocks of three 32 KiB stages keep more bytes in
// flight than the memory's latency needs, and 33 splits (every SM) ran slower
// at batch 4 and 16. Batch 1's distance from the copy bandwidth is per-call
// latency (the combine, the first and last tiles) and the write-back of a
// dirty L2, not the split count (PERF_LOG 2026-11-29, batch-1 decode counted;
// docs/serving.md). No more splits than key blocks of the cache capacity (the
// per-batch lengths live on the device), at most kMaxKvSplits. An explicit
// count is honoured up to the same caps.
int choose_kv_splits(int64_t requested, int64_t blocks_without_split, int cache_capacity,
                     int compiled_head_dim, int warps_n, bool paged, bool v_in_k, bool fp8_cache,
                     bool score_extras, const DeviceDesc& device, const char** reason) {
  const int block_n = splitkv_block_n(compiled_head_dim);
  const int num_n_blocks = std::max(1, (cache_capacity + block_n - 1) / block_n);
  const int cap = std::min(kMaxKvSplits, num_n_blocks);
  if (requested > 0) {
    *reason = "num_splits as requested, capped at the key blocks and kMaxKvSplits";
    return static_cast<int>(std::min<int64_t>(requested, cap));
  }
  // The decode variant over a contiguous cache is meant to run one block per
  // SM (splitkv_stages); over a paged one its page lookups lengthen each
  // tile's copy, which a second block per SM hides (PERF_LOG 2026-11-22
  // 0296a76). V read in the K tile (v_in_k) is compute-bound and runs as many
  // blocks per SM as fit (splitkv_reads_v_in_k); so does an e4m3 cache, whose
  // tile conversion after each wait a second block's copies overlap (one
  // block an SM left the stream at 20% of DRAM: PERF_LOG 2026-11-30 "FP8 KV
  // cache, measured").
  const int64_t blocks_per_sm =
      warps_n > 1 && !paged && !v_in_k && !fp8_cache
          ? 1
          : splitkv_blocks_per_sm(
                splitkv_smem_bytes(compiled_head_dim, warps_n, false, v_in_k, fp8_cache), device,
                splitkv_max_blocks_per_sm(compiled_head_dim, warps_n, v_in_k, fp8_cache,
                                          score_extras));
  const int64_t slots = std::max<int64_t>(1, blocks_per_sm * device.num_sms);
  const int64_t base = std::max<int64_t>(blocks_without_split, 1);
  // An e4m3 cache runs three blocks an SM, so filling the waves at batch 1
  // cut 4k-8k keys into 48 splits of two or three key tiles each, where each
  // block's fixed costs (Q, the first tile's wait and conversion, the partial
  // row's store and the wider merge) outweigh its stream: 16 and 32 splits
  // ran 13-14% faster there (PERF_LOG 2026-11-30 "e4m3 splits of four key
  // tiles"). So no split of an e4m3 cache gets fewer than four key tiles.
  constexpr int kFp8MinKeyBlocksPerSplit = 4;
  const int auto_cap =
      fp8_cache ? std::max(1, std::min(cap, num_n_blocks / kFp8MinKeyBlocksPerSplit)) : cap;
  auto wave_efficiency = [&](int splits) {
    const double waves = double(base * splits) / double(slots);
    return waves / std::ceil(waves);
  };
  constexpr double kFillTolerance = 0.95;
  if (wave_efficiency(1) >= kFillTolerance) {  // no split count can beat it by more
    *reason = "no split: the grid already fills its waves to 95%";
    return 1;
  }
  double best = 0.0;
  for (int splits = 1; splits <= auto_cap; ++splits) best = std::max(best, wave_efficiency(splits));
  for (int splits = 1; splits <= auto_cap; ++splits) {
    if (wave_efficiency(splits) >= kFillTolerance * best) {
      *reason = "the fewest splits whose waves fill within 95% of the best count's";
      return splits;
    }
  }
  *reason = "no split";
  return 1;
}

// Key tiles per block below which the decode variant over a contiguous cache
// runs two blocks per SM, whatever the grid (splitkv_launch_smem_bytes,
// splitkv_grid_blocks).
constexpr int kShortRunKeyBlocks = 16;

// Key tiles of the cache capacity that one split-KV work item streams.
int splitkv_key_blocks_per_item(int compiled_head_dim, int cache_capacity, int num_splits) {
  return cache_capacity / std::max(num_splits, 1) / splitkv_block_n(compiled_head_dim);
}

// Shared memory to launch the split-KV kernel with. The decode variant over a
// contiguous cache streams best one block per SM once each block has a long
// run of keys (kLongRunKeyBlocks; PERF_LOG 2026-11-22 980a53e). Short runs
// prefer the second block, which hides each block's start, as long as two per
// SM hold the whole grid at once; a grid that needs more waves than that also
// streams best one block per SM (PERF_LOG 2026-11-23 a44e49e), unless its
// blocks run very few key tiles: such a block spends most of its time in its
// fixed latency (Q, the first tile, the merge and the stores), which a second
// block per SM overlaps (kShortRunKeyBlocks; PERF_LOG 2026-11-23 d04c754).
// With 128 threads, shared memory is what bounds the blocks per SM, so a block
// meant to run alone asks for just over half of the SM's. Paged caches, V
// read in the K tile and e4m3 caches keep as many as fit (choose_kv_splits).
int splitkv_launch_smem_bytes(int compiled_head_dim, int warps_n, bool paged, bool v_in_k,
                              bool fp8_cache, int cache_capacity, int num_splits,
                              int64_t grid_blocks, const DeviceDesc& device) {
  const int tiles_smem = splitkv_smem_bytes(compiled_head_dim, warps_n, false, v_in_k, fp8_cache);
  if (warps_n == 1 || paged || v_in_k || fp8_cache) return tiles_smem;
  constexpr int kLongRunKeyBlocks = 128;
  const int key_blocks_per_block =
      splitkv_key_blocks_per_item(compiled_head_dim, cache_capacity, num_splits);
  const bool long_runs = key_blocks_per_block >= kLongRunKeyBlocks;
  const bool short_runs = key_blocks_per_block < kShortRunKeyBlocks;
  const bool one_wave_of_two = grid_blocks <= 2 * int64_t(device.num_sms);
  if (!long_runs && (one_wave_of_two || short_runs)) return tiles_smem;
  const int one_per_sm = device.smem_per_sm / 2 - device.reserved_smem_per_block + 16;
  return std::clamp(one_per_sm, tiles_smem, std::max(tiles_smem, device.smem_per_block_optin));
}

// Thread blocks to launch the split-KV kernel with. The decode variant over a
// contiguous cache runs one block per SM when two blocks per SM cannot hold
// all its work items at once and each item streams kShortRunKeyBlocks to
// kShortItemKeyBlocks - 1 key tiles (1k-4k keys at d128), the grids that
// otherwise run one block per SM of one item each (splitkv_launch_smem_bytes):
// each block streams the K/V tiles of several items back to back, the next
// item's first tiles in flight while the current one is finished
// (splitkv_kernel.h), instead of every item waiting out the start of a block
// of its own (PERF_LOG 2026-11-23 f3875b4). Left to one block per item:
// shorter items, which run two blocks per SM (two blocks per SM overlap each
// other's merge and stores, one block's items wait for its own); items of 4k
// keys and more, where the hardware, handing out blocks as SMs free up,
// balances the SMs as well as a fixed share of items each; grids that two
// blocks per SM hold at once. Once a persistent block merged each item while
// the next one streamed, the range was measured again and kept (PERF_LOG
// 2026-11-23 cccce8e). Nor does a grid whose SMs would each stream more than
// kPersistentMaxKeyBlocksPerSm key tiles (4 MB of K/V at d128): with that
// much work per SM, the hardware's hand-out again beats the fixed shares,
// even at 16-63 tiles per item (PERF_LOG 2026-11-23 cb520b2). Paged caches
// run two blocks per SM (choose_kv_splits); softcap / ALiBi, the 64-row
// variant, or a device whose blocks cannot hold the persistent block's shared
// memory keep one block per item (the persistent kernel is compiled for the
// plain decode path only).
int64_t splitkv_grid_blocks(int compiled_head_dim, int warps_n, bool paged, bool score_extras,
                            int cache_capacity, int num_splits, int64_t num_items,
                            const DeviceDesc& device) {
  const int64_t sms = device.num_sms;
  constexpr int kShortItemKeyBlocks = 64;
  constexpr int64_t kPersistentMaxKeyBlocksPerSm = 128;
  const int key_blocks_per_item =
      splitkv_key_blocks_per_item(compiled_head_dim, cache_capacity, num_splits);
  const bool persistent =
      warps_n > 1 && !paged && !score_extras && num_items > 2 * sms &&
      key_blocks_per_item >= kShortRunKeyBlocks && key_blocks_per_item < kShortItemKeyBlocks &&
      num_items * key_blocks_per_item <= kPersistentMaxKeyBlocksPerSm * sms &&
      splitkv_smem_bytes(compiled_head_dim, warps_n, true) <= device.smem_per_block_optin;
  return persistent ? sms : num_items;
}

// Thread blocks per cluster for the split-KV kernel, along grid x: the
// blocks of neighbouring kv heads of one batch entry, which on flash-attn's
// (b, s, hk, d) cache read neighbouring 256-byte pieces of each key's span.
// Launched as clusters of 2, such pairs run at the same time on one GPC, and
// the decode variant over a contiguous cache runs faster so; the kernel uses
// nothing else of the cluster, and we have not pinned down why the placement
// helps (PERF_LOG 2026-11-23 7648e81). Clusters of 4 or 8 leave fewer SMs
// usable at one block per SM (a cluster runs within one GPC).
// Paged caches, which launch two blocks per SM, were not measured with
// clusters and keep none. A persistent grid (splitkv_grid_blocks) keeps none:
// its blocks run items of a stride apart.
int splitkv_cluster_x(int warps_n, bool paged, int64_t batch_heads, bool persistent,
                      const DeviceDesc& device) {
  constexpr int kCluster = 2;
  const bool clusters_exist = device.cc_major >= 9;
  return clusters_exist && warps_n > 1 && !paged && !persistent && batch_heads % kCluster == 0
             ? kCluster
             : 1;
}

// Whether the split-KV kernel does a call's append / rotary itself
// (params.append_in_attention) instead of a kernel before it. Each of its
// blocks copies its query rows, new keys / values and rotary table rows into
// shared memory with its first tile and rotates them there, and the step
// saves the pre-kernel's run and the wait for it (PERF_LOG 2026-11-23
// b82fd11, 2026-11-24 13ddd85). The pre-kernel stays for the variants
// compiled without the append (the persistent grid, softcap / ALiBi, the
// 64-row variant), for appends longer than kAppendInAttentionMaxRows, rotary
// dims that are not a multiple of 16 or tables not 16-byte aligned (the
// kernel rotates 16-element units from 16-byte copies), local windows that
// hide a new key from every query (a block loads only new keys of tiles it
// attends to), where the table rows' shared memory would cost the grid
// resident blocks, and for grids of more than kAppendInAttentionMaxWaves
// waves: each block adds its rotation to its wave (PERF_LOG 2026-11-24
// b4049f2).
constexpr int64_t kAppendInAttentionMaxWaves = 4;
bool append_in_attention_fits(const DecodeShape& shape, const DecodePlan& plan,
                              const DeviceDesc& device) {
  const int warps_n = plan.warps_n;
  // The varlen form appends in the pre-kernel: the in-kernel append assumes
  // every sequence's rows from row 0 on, seqlen_new of them.
  if (warps_n == 1 || shape.score_extras || shape.varlen || plan.num_m_blocks != 1 ||
      plan.grid_blocks != plan.num_items || shape.seqlen_new > kAppendInAttentionMaxRows) {
    return false;
  }
  if (shape.rotary_dim > 0 && (shape.rotary_dim % 16 != 0 || !shape.rotary_tables_aligned)) {
    return false;
  }
  // The queries' keys reach down to key_diagonal(0) - window_left =
  // seqlen_k - seqlen_q - window_left, and up to the last key.
  if (shape.window_left >= 0 && shape.seqlen_new > shape.seqlen_q + shape.window_left) {
    return false;
  }
  const int launch_smem =
      std::max(plan.launch_smem, splitkv_append_smem_bytes(plan.compiled_head_dim, warps_n));
  const int64_t blocks_per_sm = splitkv_blocks_per_sm(plan.launch_smem, device);
  return launch_smem <= device.smem_per_block_optin &&
         splitkv_blocks_per_sm(launch_smem, device) == blocks_per_sm &&
         plan.num_items <= kAppendInAttentionMaxWaves * blocks_per_sm * device.num_sms;
}

}  // namespace

DecodePlan plan_decode(const DecodeShape& shape, const DeviceDesc& device) {
  DecodePlan plan;
  plan.compiled_head_dim = round_up_head_dim(shape.head_dim);
  plan.programmatic_launch = device.cc_major >= 9;
  const int compiled = plan.compiled_head_dim;
  const int group = shape.nheads_k > 0 ? shape.nheads / shape.nheads_k : 0;
  const int64_t rows_per_kv_head = int64_t(shape.seqlen_q) * group;
  plan.warps_n = splitkv_warps_n_for(compiled, rows_per_kv_head, device.smem_per_block_optin);
  if (plan.warps_n == 0) {  // d512 on a device of 99 KB blocks (sm86 / sm89)
    plan.num_splits = 0;
    plan.reason = "no split-KV variant of this head dim fits the device's shared memory per block";
    return plan;
  }
  plan.block_m = splitkv_block_m(compiled, plan.warps_n);
  plan.num_m_blocks = ceil_div(rows_per_kv_head, plan.block_m);
  const int64_t blocks_without_split = int64_t(shape.batch) * shape.nheads_k * plan.num_m_blocks;
  // V read in the K tile: the plain kernel of one block per item, so no
  // score extras and no append (whose pre-kernel then runs first).
  plan.v_in_k = shape.v_in_k && splitkv_reads_v_in_k(compiled) && plan.warps_n > 1 &&
                !shape.score_extras && !shape.appending && shape.rotary_dim == 0;
  plan.num_splits = choose_kv_splits(
      shape.requested_splits, blocks_without_split, shape.cache_capacity, compiled, plan.warps_n,
      shape.paged, plan.v_in_k, shape.fp8_cache, shape.score_extras, device, &plan.reason);
  // A split past the last key block has no keys: its item writes an empty
  // partial (lse -inf), which the combine weighs 0 (splitkv_work_item.h).
  if (plan.num_splits < shape.min_splits) {
    plan.num_splits = std::min(shape.min_splits, kMaxKvSplits);
    plan.reason = "the fewest splits the call needs (DecodeShape::min_splits)";
  }
  plan.num_items = blocks_without_split * plan.num_splits;
  plan.launch_smem =
      splitkv_launch_smem_bytes(compiled, plan.warps_n, shape.paged, plan.v_in_k, shape.fp8_cache,
                                shape.cache_capacity, plan.num_splits, plan.num_items, device);
  plan.grid_blocks =
      splitkv_grid_blocks(compiled, plan.warps_n, shape.paged, shape.score_extras,
                          shape.cache_capacity, plan.num_splits, plan.num_items, device);
  // The persistent kernel is compiled for fixed-length calls over a 16-bit
  // cache only (splitkv_item's kVarlen), and without V read in the K tile:
  // the others get a block per item.
  if (shape.varlen || plan.v_in_k || shape.fp8_cache) plan.grid_blocks = plan.num_items;
  plan.cluster_x =
      splitkv_cluster_x(plan.warps_n, shape.paged, int64_t(shape.batch) * shape.nheads_k,
                        plan.grid_blocks < plan.num_items, device);
  // An e4m3 cache has no appending kernel (its append quantises, docs/fp8.md).
  plan.append_in_attention = (shape.appending || shape.rotary_dim > 0) && !shape.fp8_cache &&
                             append_in_attention_fits(shape, plan, device);
  return plan;
}

DecodePlan plan_fwd_split(const FwdSplitShape& shape, const DeviceDesc& device) {
  DecodePlan none;
  none.num_splits = 0;
  // Head dims above 256 and FP8 attention have the split-KV kernel only: it
  // serves every call it can, whatever the split count or row count (the op
  // refuses the others).
  const bool only_splitkv = splitkv_only_head_dim(shape.head_dim) || shape.fp8;
  if (shape.requested_splits == 1 && !only_splitkv) {
    none.reason = "num_splits=1: the forward kernels, no split";
    return none;
  }
  if (shape.dropout || shape.return_softmax || shape.seqused_q) {
    none.reason = "dropout, return_softmax or seqused_q: only the forward kernels have them";
    return none;
  }
  if (shape.head_dim_v != shape.head_dim && !only_splitkv) {
    none.reason = "d_v below d_qk: the forward kernels read V at its own width";
    return none;
  }
  DecodeShape decode;
  decode.batch = shape.batch;
  decode.nheads = shape.nheads;
  decode.nheads_k = shape.nheads_k;
  decode.seqlen_q = shape.max_seqlen_q;
  decode.cache_capacity = shape.max_seqlen_k;
  decode.head_dim = shape.head_dim;
  decode.paged = shape.paged;
  decode.requested_splits = shape.requested_splits;
  decode.score_extras = shape.score_extras;
  decode.varlen = shape.varlen;
  decode.fp8_cache = shape.fp8;
  // A varlen run needs two splits or more, even over keys that fill one
  // block: the combine writes the rows of q outside every sequence (out 0,
  // lse +inf), which no work item covers. So does a chosen split of a
  // decode-like varlen call (plan_varlen_split), where the plan would leave
  // one split to a batch that fills the SMs.
  if (shape.varlen && (only_splitkv || shape.requested_splits == 0)) decode.min_splits = 2;
  DecodePlan plan = plan_decode(decode, device);
  if (shape.varlen && plan.num_splits <= 1) {
    none.reason = plan.reason;
    return none;
  }
  if (shape.requested_splits == 0 && plan.num_m_blocks > 1 && !only_splitkv) {
    none.reason =
        "num_splits=0: more query rows than one split-KV query block, the forward kernels";
    return none;
  }
  return plan;
}

DecodePlan plan_varlen_split(const FwdParams& params, int64_t requested_splits,
                             KernelOverride override_kernel, const DeviceDesc& device) {
  FwdSplitShape shape;
  shape.batch = params.batch;
  shape.nheads = params.nheads;
  shape.nheads_k = params.nheads_k;
  shape.max_seqlen_q = params.seqlen_q;
  shape.max_seqlen_k = params.block_table != nullptr ? params.paged_max_seqlen_k : params.seqlen_k;
  shape.head_dim = params.head_dim;
  shape.head_dim_v = params.head_dim_v;
  shape.varlen = true;
  shape.paged = params.block_table != nullptr;
  shape.requested_splits =
      requested_splits == 0 && override_kernel != KernelOverride::kNone ? 1 : requested_splits;
  const ScoreFeatures rule = score_features_of(params);
  shape.score_extras = rule.has_extras();
  shape.dropout = params.dropout_p > 0.f;
  shape.return_softmax = params.p_ptr != nullptr;
  shape.seqused_q = params.seqused_q != nullptr;
  shape.fp8 = params.kv_fp8;
  return plan_fwd_split(shape, device);
}

// ------------------------------------------------------------- description

namespace {

const char* choice_name(KernelChoice choice) {
  switch (choice) {
    case KernelChoice::kSm80: return "sm80";
    case KernelChoice::kAuto: return "auto";
    case KernelChoice::kSm90: return "sm90";
  }
  return "?";
}

const char* variant_name(FwdVariant variant) {
  switch (variant) {
    case FwdVariant::kPlain: return "plain";
    case FwdVariant::kScoreExtras: return "score_extras";
    case FwdVariant::kScoreMods: return "score_mods";
  }
  return "?";
}

}  // namespace

std::string describe(const FwdPlan& plan) {
  static const char* const kKernels[] = {"none", "sm80", "sm90", "splitkv"};
  static const char* const kGrids[] = {"heads_batch", "one_per_tile", "fixed_shares",
                                       "tile_counter"};
  static const char* const kKeys[] = {"contiguous", "paged_boxes", "paged_gather"};
  std::ostringstream out;
  if (plan.kernel == FwdKernel::kSplitKv) {
    out << "kernel=splitkv choice=" << choice_name(plan.choice) << " hdim=" << plan.head_dim
        << " block_m=" << plan.block_m << " splits=" << plan.splitkv.num_splits
        << " warps_n=" << plan.splitkv.warps_n << " items=" << plan.splitkv.num_items
        << " return_probs=0 reason: " << plan.reason << "; " << plan.splitkv.reason;
    return out.str();
  }
  out << "kernel=" << kKernels[int(plan.kernel)] << " variant=" << variant_name(plan.variant)
      << " choice=" << choice_name(plan.choice) << " hdim=" << plan.head_dim
      << " hdim_v=" << plan.head_dim_v << " block_m=" << plan.block_m << " block_n=" << plan.block_n
      << " warps=" << plan.num_warps << " large_smem=" << int(plan.sm80_large_smem)
      << " grid_kind=" << kGrids[int(plan.grid)] << " keys=" << kKeys[int(plan.keys)]
      << " grid=" << plan.grid_x << "x" << plan.grid_y << "x" << plan.grid_z
      << " return_probs=" << int(plan.return_probs) << " reason: " << plan.reason;
  return out.str();
}

std::string describe(const BwdPlan& plan) {
  static const char* const kKernels[] = {"none", "sm80", "sm80_large_smem", "sm90"};
  std::ostringstream out;
  out << "kernel=" << kKernels[int(plan.kernel)] << " variant=" << variant_name(plan.variant)
      << " choice=" << choice_name(plan.choice) << " hdim=" << plan.head_dim
      << " hdim_v=" << plan.head_dim_v << " block_m=" << plan.block_m << " block_n=" << plan.block_n
      << " splits=" << plan.num_splits << " ordered_dq=" << int(plan.ordered_dq)
      << " grid=" << plan.grid_x << "x" << plan.grid_y << "x" << plan.grid_z
      << " sm80_smem=" << plan.sm80_smem_bytes << " smem_fits=" << int(!plan.smem_exceeds_device)
      << " reason: " << plan.reason;
  return out.str();
}

std::string describe(const DecodePlan& plan) {
  std::ostringstream out;
  out << "kernel=splitkv head_dim=" << plan.compiled_head_dim << " warps_n=" << plan.warps_n
      << " block_m=" << plan.block_m << " m_blocks=" << plan.num_m_blocks
      << " splits=" << plan.num_splits << " items=" << plan.num_items
      << " smem=" << plan.launch_smem << " grid=" << plan.grid_blocks
      << " persistent=" << int(plan.grid_blocks < plan.num_items) << " cluster=" << plan.cluster_x
      << " append_in_attention=" << int(plan.append_in_attention) << " v_in_k=" << int(plan.v_in_k)
      << " programmatic=" << int(plan.programmatic_launch) << " reason: " << plan.reason;
  return out.str();
}

}  // namespace flash
