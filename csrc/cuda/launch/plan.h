// Which kernel runs a call, and why: one plan function per pass.
//
//   plan_fwd    fwd / varlen_fwd: the SM80 or the Hopper forward, its
//               variant, tile and grid (one block per tile, fixed shares of
//               a persistent grid, or tiles from a counter).
//   plan_bwd    bwd / varlen_bwd: the SM80 backward (the table's tile or the
//               large-shared-memory one) or the Hopper one, its variant, the
//               deterministic dQ splits and the main kernel's grid.
//   plan_decode fwd_kvcache: the split-KV variant (rows per block), the
//               split count, the launch's shared memory, the grid (one block
//               per work item or persistent), clusters, and whether the
//               attention kernel does the append / rotary itself.
//
// Each is a pure function of the call's shape and score rule, of a
// description of the device (DeviceDesc), of the kernel override the op read
// from the environment, and of the facts about the call's tensors that only
// the op can see (whether TMA can describe them, whether the rotary tables
// are aligned). The op layer (csrc/cuda/ops/) makes the plan once per call
// and sizes its buffers from it; the launchers (fwd_launch.h, bwd_launch.h,
// splitkv_launch.h) switch on it and decide nothing else. No CUDA header is
// included here: the CPU-only build compiles plan.cpp too, and the debug ops
// torch.ops.flash_attn._plan_fwd / _plan_bwd / _plan_decode
// (csrc/cuda/ops/plan_debug_ops.cpp) describe a plan for any device.
#pragma once

#include <cstdint>
#include <string>

#include "cuda/core/head_dim_slabs.h"
#include "cuda/core/params.h"
#include "cuda/fwd/fwd_tile_schedule.h"

namespace flash {

// What the plans need to know about the device. The op fills it from
// cudaDeviceProp; the debug ops take it as arguments.
struct DeviceDesc {
  int cc_major = 0;
  int cc_minor = 0;
  int num_sms = 0;
  int smem_per_block_optin = 0;     // sharedMemPerBlockOptin
  int smem_per_sm = 0;              // sharedMemPerMultiprocessor
  int reserved_smem_per_block = 0;  // reservedSharedMemPerBlock
  bool sm90a_built = false;         // the build has sm_90a machine code (FLASH_ATTN_HAS_SM90A)
};

// FLASH_ATTN_FWD_KERNEL / FLASH_ATTN_BWD_KERNEL = sm80 / sm90, which the op
// reads from the environment on each call (the tests switch it between calls)
// and hands to the plan. Only an sm90 device honours it.
enum class KernelOverride : uint8_t { kNone, kSm80, kSm90 };
KernelOverride parse_kernel_override(const char* value);  // null or anything else: kNone
const char* kernel_override_name(KernelOverride value);

// The kernel design a pass may use on this device before the call's shape is
// looked at: kSm80 on every device but sm90 (9.0); there, kAuto or what the
// override forces (the tests run both designs on every shape). A zero,
// subnormal or non-finite scale (ScoreFeatures::sm90_scale) runs the SM80
// design whatever the choice; softcap, ALiBi, dropout and a negative scale
// run on both (dropout where the Hopper kernel draws it:
// fwd_sm90_draws_dropout, bwd_sm90_draws_dropout).
enum class KernelChoice : uint8_t {
  kSm80,  // fwd_kernel_sm80.h / bwd_kernel_sm80.h
  kAuto,  // the Hopper kernel where its tile table has an entry and (forward)
          // the call is long enough (fwd_sm90_by_shape), else kSm80
  kSm90,  // the Hopper kernel wherever its tile table has an entry
};
KernelChoice kernel_choice(const DeviceDesc& device, KernelOverride override_kernel);

// Whether TMA can describe the tensors of a call (16-byte aligned base,
// strides multiples of 8 elements and below 2^38 on every dim of more than
// one element): the Hopper kernels load through TMA, the op checks this
// before planning. Kept in step with tma_can_load (core/tma_loads_sm90.h),
// which the launchers also check against the plan.
bool fwd_tma_can_load(const FwdParams& params);
bool bwd_tma_can_load(const BwdParams& params);

// ---------------------------------------------- decode (split-KV kernel)

// What plan_decode reads of a fwd_kvcache call.
struct DecodeShape {
  int batch = 0;
  int nheads = 0;
  int nheads_k = 0;
  int seqlen_q = 0;
  int cache_capacity = 0;  // keys per cache row (paged: pages per row x page size)
  int head_dim = 0;        // as given; the plan rounds it up to the compiled one
  bool paged = false;
  int64_t requested_splits = 0;        // num_splits: 0 chooses
  bool score_extras = false;           // ScoreFeatures::has_extras
  bool appending = false;              // new keys / values to write into the cache
  int seqlen_new = 0;                  // their rows (0 unless appending)
  int rotary_dim = 0;                  // 0: no rotary
  bool rotary_tables_aligned = false;  // cos and sin start on 16-byte boundaries
  int window_left = -1;                // normalised window
  // FA3's varlen form (cu_seqlens_q / cu_seqlens_k_new): seqlen_q is
  // max_seqlen_q and each sequence has rows of its own.
  bool varlen = false;
  bool v_in_k = false;     // v_cache is k_cache's first head_dim_v columns (KvcacheShape::v_in_k)
  bool fp8_cache = false;  // k_cache / v_cache are float8_e4m3fn (docs/fp8.md)
  // The fewest splits the run needs, even where the keys fill one block: a
  // varlen forward on the split-KV kernel alone takes 2 (plan_fwd_split).
  int min_splits = 1;
};

struct DecodePlan {
  int compiled_head_dim = 0;
  // 1: the 64-row variant; more: the decode variant; 0: none fits the device
  // (num_splits 0, reason says why)
  int warps_n = 1;
  int block_m = 0;
  int64_t num_m_blocks = 0;  // query blocks per (batch, kv head)
  int num_splits = 1;
  int64_t num_items = 0;    // work items: batch x kv heads x query blocks x splits
  int launch_smem = 0;      // the split-KV launch's dynamic shared memory
  int64_t grid_blocks = 0;  // num_items, or SMs for the persistent grid
  int cluster_x = 1;
  bool append_in_attention = false;
  // The kernel reads V in the K tile and loads none (splitkv_reads_v_in_k):
  // the plain kernel of one block per item, without an append.
  bool v_in_k = false;
  bool programmatic_launch = false;  // sm90 and later: dependent launches
  const char* reason = "";           // why this split count
};

DecodePlan plan_decode(const DecodeShape& shape, const DeviceDesc& device);

// ---------------------------------------------------------------- forward

enum class FwdKernel : uint8_t {
  kNone,  // nothing to compute (no query row, head or batch entry)
  kSm80,  // fwd_kernel_sm80.h
  kSm90,  // fwd_kernel_sm90.h
  // The split-KV kernel (splitkv_kernel.h) of plan_decode, on a fixed-length
  // call whose query rows fit one of its query blocks (FwdPlan::splitkv).
  kSplitKv,
};

// kSm80: the plain rule or the variant with softcap / ALiBi / dropout / a
// scale that is not positive and normal (the score extras). kSm90: the plain
// rule or the variant with softcap / ALiBi / dropout / a negative scale (the
// score mods; ScoreFeatures::has_sm90_mods).
enum class FwdVariant : uint8_t { kPlain, kScoreExtras, kScoreMods };

enum class FwdGrid : uint8_t {
  kHeadsBatch,   // SM80: (query blocks, heads, batch), grid_heads_batch.h
  kOnePerTile,   // Hopper: one block per (query block, head, batch)
  kFixedShares,  // Hopper, persistent: one block per SM, each a fixed share of the tiles
  kTileCounter,  // Hopper, persistent: one block per SM, tiles past the first wave from a counter
};

// How the Hopper kernel's producer reads K / V (fwd_mainloop_sm90.h): one
// TMA copy per key tile, or paged keys (FwdParams::block_table) by TMA boxes
// that each stay inside a page (boxes of at least kPagedBoxesMinRows rows,
// paged_box_rows.h) or gathered row by row by cp.async (any other page
// size). The SM80 kernel reads paged
// keys row by row whatever this says (kContiguous there).
enum class FwdKeys : uint8_t { kContiguous, kPagedBoxes, kPagedGather };

struct FwdPlan {
  FwdKernel kernel = FwdKernel::kNone;
  FwdVariant variant = FwdVariant::kPlain;
  FwdGrid grid = FwdGrid::kHeadsBatch;
  FwdKeys keys = FwdKeys::kContiguous;
  KernelChoice choice = KernelChoice::kSm80;  // what the device and override allowed
  // The compiled (d_qk, d_v) whose launcher runs the call (launcher_registry.h):
  // head_dim_v = head_dim (level 1, V's columns past d_v zero) but for a
  // specialised pair's Hopper kernel (plan_fwd, fwd_sm90_pair_head_dim_v).
  int head_dim = 0;
  int head_dim_v = 0;
  int block_m = 0;
  int block_n = 0;
  int num_warps = 0;             // SM80 kernel; the Hopper kernel has one MMA warpgroup per 64 rows
  bool sm80_large_smem = false;  // the SM80 kernel's FwdTileConfigLargeSmem tile
  int64_t grid_x = 0;            // query blocks (kHeadsBatch, kOnePerTile: tiles), or SMs
  int grid_y = 1;                // kHeadsBatch: heads, else 1
  int grid_z = 1;                // kHeadsBatch: batch, else 1
  bool return_probs = false;     // then return_probs.h writes the probabilities afterwards
  DecodePlan splitkv;            // kSplitKv: its plan (plan_fwd_split), splits >= 1
  const char* reason = "";
};

// params: the shape, score rule and varlen-ness of the call (its pointers
// are not read). tma_ok: fwd_tma_can_load of the call's tensors. A
// fixed-length call without a kernel override may get kSplitKv
// (plan_fwd_split); an override names the forward kernel to run.
FwdPlan plan_fwd(const FwdParams& params, const DeviceDesc& device, KernelOverride override_kernel,
                 bool tma_ok);

// sizeof(FwdSm90Barriers<stages>): Q's two, four per stage, the tile
// counter's two and its slot.
constexpr int fwd_sm90_barrier_bytes(int stages) { return 8 * (2 + 4 * stages + 2 + 1); }
constexpr int kSm90SmemPerBlock = 227 * 1024;

// Whether the Hopper forward of this compiled (d_qk, d_v) and query block
// has a separate O tile and so walks several query blocks per block (its
// kPersistent; fwd_launch.h checks the two agree): Q, the stages of K and
// V, and O, 16-bit elements.
constexpr bool fwd_sm90_persistent(int head_dim, int head_dim_v, int block_m, int block_n,
                                   int stages = 2) {
  return block_m * (head_dim + head_dim_v) * 2 + stages * block_n * (head_dim + head_dim_v) * 2 +
             fwd_sm90_barrier_bytes(stages) <=
         kSm90SmemPerBlock;
}

// The K / V stages of the Hopper forward for these keys (the traits'
// kStages, or kGatherStages for the row gather; fwd_launch.h checks the two
// agree): three for the row gather where its register split applies (two
// MMA warpgroups, d_qk <= 128) and Q with three stages fits a block, else
// two.
constexpr int fwd_sm90_kv_stages(FwdKeys keys, int head_dim, int head_dim_v, int block_m,
                                 int block_n) {
  const bool three = keys == FwdKeys::kPagedGather && block_m == 128 && head_dim <= 128 &&
                     block_m * head_dim * 2 + 3 * block_n * (head_dim + head_dim_v) * 2 +
                             fwd_sm90_barrier_bytes(3) <=
                         kSm90SmemPerBlock;
  return three ? 3 : 2;
}

// Whether the Hopper forward of this compiled d_v (O's width) and tile draws
// dropout: where a thread has at least 64 registers to spare beside S, O and
// P in flight under S = Q K^T (FwdSm90KernelTraits::kDrawsDropout, which
// fwd_launch.h checks this against): d96-d224 but not d64's 192-row tile
// (three MMA warpgroups of 160 registers) or d256's 128 x 80, whose draws
// spilled in the loop.
constexpr bool fwd_sm90_draws_dropout(int head_dim_v, int block_m, int block_n) {
  const int mma_registers = block_m / 64 == 2 ? 240 : 160;
  return mma_registers - (block_n / 2 + head_dim_v / 2 + block_n / 4) >= 64;
}

// The Hopper forward's tile for a call with dropout: the table's (block_m,
// block_n) where it draws; else 128 rows of the table's keys (d64, whose
// 192-row tile runs three MMA warpgroups of 160 registers); else 128 rows of
// kFwdSm90DropoutBlockN keys (d256, whose 80-key tile leaves 52 registers);
// else {0, 0}: no Hopper tile draws it. plan_fwd and fwd_launch.h both ask
// this. The other tiles ran 1.5-1.7x faster than the SM80 forward at d64
// (PERF_LOG 2026-11-30, "d64 dropout on the 128-row tile").
struct FwdSm90TileShape {
  int block_m = 0, block_n = 0;
};
constexpr int kFwdSm90DropoutBlockN = 64;
constexpr FwdSm90TileShape fwd_sm90_dropout_tile(int head_dim_v, int block_m, int block_n) {
  if (fwd_sm90_draws_dropout(head_dim_v, block_m, block_n)) return {block_m, block_n};
  if (fwd_sm90_draws_dropout(head_dim_v, kFwdSm90BlockM, block_n)) {
    return {kFwdSm90BlockM, block_n};
  }
  if (block_n > kFwdSm90DropoutBlockN &&
      fwd_sm90_draws_dropout(head_dim_v, kFwdSm90BlockM, kFwdSm90DropoutBlockN)) {
    return {kFwdSm90BlockM, kFwdSm90DropoutBlockN};
  }
  return {};
}

// Whether the tiles do different work (a causal or local bound, or the
// sequences of a varlen batch, whose lengths differ and whose longest sets
// the grid), so that a persistent grid hands them out from a counter instead
// of in fixed shares. On varlen batches fixed shares were slower than the
// counter (up to 2048 keys) or one block per query block (PERF_LOG
// 2026-11-24 9f57c38).
inline bool fwd_tiles_differ_in_work(const FwdParams& params) {
  return params.window_left >= 0 || params.window_right >= 0 || params.cu_seqlens_q != nullptr;
}

// --------------------------------------------------------------- backward

enum class BwdKernel : uint8_t {
  kNone,           // nothing to compute (the op returns zeros)
  kSm80,           // bwd_kernel_sm80.h, the tile table's tile
  kSm80LargeSmem,  // bwd_kernel_sm80.h, BwdTileConfigLargeSmem's tile
  kSm90,           // bwd_kernel_sm90.h
};

// kSm80*: plain or kScoreExtras; kSm90: plain or kScoreMods (softcap, ALiBi,
// dropout: as the forward).
struct BwdPlan {
  BwdKernel kernel = BwdKernel::kNone;
  FwdVariant variant = FwdVariant::kPlain;
  KernelChoice choice = KernelChoice::kSm80;
  // The compiled (d_qk, d_v) whose launcher runs the call (launcher_registry.h):
  // head_dim_v = head_dim (level 1, dO's and V's columns past d_v zero) but
  // for a specialised pair's Hopper kernel (plan_bwd, bwd_sm90_pair_head_dim_v).
  int head_dim = 0;
  int head_dim_v = 0;
  int block_m = 0;     // the main kernel's query block
  int block_n = 0;     // its key block: one thread block per key block (or per dQ split)
  int num_splits = 1;  // deterministic, not ordered_dq: slices of the dQ accumulator, each a
                       // grid column
  // deterministic on the Hopper kernel: key blocks add their dQ in key-block
  // order, kept by a semaphore per query block (params.dq_semaphore).
  bool ordered_dq = false;
  int64_t grid_x = 0;  // key blocks, or num_splits when deterministic with splits
  int grid_y = 1;      // heads
  int grid_z = 1;      // batch
  // d_v < d_qk on the SM80 kernel, which reads dO and V at d_qk columns (at
  // its register limit, column predicates of their own spilled it, ptxas
  // sm_90a d128 / d192): the op hands it v, out and dout zero-padded to d_qk
  // and crops dv (the Hopper kernel reads them at d_v columns).
  bool pad_v = false;
  // The SM80 main kernel's dynamic shared memory; a device whose blocks hold
  // less is not served (the op raises, naming both: d512's 132.25 KiB on
  // sm86 / sm89 blocks of 99 KiB).
  int sm80_smem_bytes = 0;
  bool smem_exceeds_device = false;
  const char* reason = "";
};

// Whether the Hopper backward of this compiled (d_qk, d_v) and tile draws
// dropout in its score-mods variant (BwdSm90KernelTraits::kDrawsDropout,
// which bwd_launch.h checks against this; docs/dropout_sm90.md section 6):
// the 64-row query blocks (d32, d96-d256, and (192, 128)), where a thread
// holds S^T, dP^T, dK and dV (block_n (2 block_m + d_qk + d_v) / 256
// registers) and at least 48 of its 240 spare, and whose pass zeroes P^T
// and dP^T in fp32. Not the 128-row d64 tile: its pass makes P^T straight
// in 16-bit registers (kConvertInPointwise) to stay unspilled, and has no
// room for the mask.
constexpr bool bwd_sm90_draws_dropout(int head_dim, int head_dim_v, int block_m, int block_n) {
  const int accumulators = block_n * (2 * block_m + head_dim + head_dim_v) / 256;
  return block_m == 64 && 240 - accumulators >= 48;
}

// The Hopper backward's query block for a call with dropout: the table's
// where its tile draws it; else kBwdSm90DropoutBlockM rows (d64, whose
// 128-row tile does not: its 64-row tile, the design it ran before 128 rows
// won on the plain rule, PERF_LOG 2026-11-24 ee3e75a); else 0, no Hopper
// tile draws it. plan_bwd and bwd_launch.h both ask this.
constexpr int kBwdSm90DropoutBlockM = 64;
constexpr int bwd_sm90_dropout_block_m(int head_dim, int head_dim_v, int block_m, int block_n) {
  if (bwd_sm90_draws_dropout(head_dim, head_dim_v, block_m, block_n)) return block_m;
  if (block_m > kBwdSm90DropoutBlockM &&
      bwd_sm90_draws_dropout(head_dim, head_dim_v, kBwdSm90DropoutBlockM, block_n)) {
    return kBwdSm90DropoutBlockM;
  }
  return 0;
}

// params: shape, score rule, varlen-ness and params.deterministic (pointers
// not read). tma_ok: bwd_tma_can_load of the call's tensors.
BwdPlan plan_bwd(const BwdParams& params, const DeviceDesc& device, KernelOverride override_kernel,
                 bool tma_ok);

// Shared memory of the Hopper backward block (its largest variant: with the
// dQ staging buffer where the design has one, as the ordered variant always
// does) and of the SM80 one with (double_buffer) or without two Q / dO
// buffers, for 16-bit elements (bwd_launch.h checks them against the
// kernels' traits).
constexpr int kBwdSm90BarrierBytes = 48;  // sizeof(BwdSm90Barriers<2>)
// Q and K have head_dim columns, dO and V head_dim_v.
constexpr int bwd_sm90_smem_bytes(int head_dim, int head_dim_v, int block_m, int block_n,
                                  int stages) {
  const int ds = 2 * block_m * block_n * 2;
  const int p = block_n == 128 ? 0 : ds;  // the split design keeps P^T in shared memory
  const int dq = block_n == 128 ? block_m * head_dim * 4 : 0;  // and dQ in registers
  return stages * block_m * (head_dim + head_dim_v) * 2 + block_n * (head_dim + head_dim_v) * 2 +
         ds + p + stages * 2 * block_m * 4 + dq + kBwdSm90BarrierBytes;
}
// The SM80 forward's shared memory: Q and K whole, V a slab of its columns
// (FwdKernelTraits::kSmemSize).
constexpr int fwd_sm80_smem_bytes(int head_dim, int block_m, int block_n) {
  return (block_m * head_dim + block_n * (head_dim + slab_cols(head_dim))) * 2;
}
constexpr int bwd_sm80_smem_bytes(int head_dim, int block_m, int block_n, bool double_buffer) {
  const int buffers = double_buffer ? 2 : 1;
  return 2 * buffers * block_m * head_dim * 2 + 2 * block_n * head_dim * 2 +
         2 * block_m * block_n * 2 + buffers * 2 * block_m * 4;
}

// ------------------------------------------ forward on the split-KV kernel

// What plan_fwd_split reads of a forward call: a varlen_fwd call with
// num_splits (FA3's), or a fixed-length fwd call (num_splits 0).
struct FwdSplitShape {
  int batch = 0;
  int nheads = 0;
  int nheads_k = 0;
  int max_seqlen_q = 0;
  int max_seqlen_k = 0;  // paged: cut to the rows a table row addresses
  int head_dim = 0;
  int head_dim_v = 0;
  bool varlen = false;
  bool paged = false;
  int64_t requested_splits = 1;  // num_splits: 1 no split, 0 chooses
  bool score_extras = false;
  // Features only the forward kernels have: such a call is not split.
  bool dropout = false;
  bool return_softmax = false;
  bool seqused_q = false;
  // FP8 attention: k and v in e4m3, which only the split-KV kernel reads
  // (its e4m3-cache instances), like a head dim above 256.
  bool fp8 = false;
};

// The forward's run on the split-KV kernel, or not (num_splits 0 in the
// result: the forward kernels). The split-KV kernel reads the keys (packed,
// paged or of a fixed-length call) as the decode does, each sequence's keys
// cut num_splits ways and merged by their lse. Varlen: an explicit count > 1
// splits (capped as plan_decode caps it); 0 splits only where every
// sequence's query rows of a kv head fit one query block and plan_decode
// would split (decode-like calls, whose grid leaves SMs idle). Fixed length
// (requested 0): wherever the query rows of a kv head fit one query block,
// with plan_decode's split count, one included: such a call (seqlen_q 1 from
// SDPA or flash_attn_func in a decode loop) fills a 128-row Hopper tile with
// one row per head and reads K and V once per query head, where the
// split-KV kernel packs a kv head's query rows into one block and splits its
// keys over the SMs, as flash-attn's own forward does.
DecodePlan plan_fwd_split(const FwdSplitShape& shape, const DeviceDesc& device);

// The split plan of a varlen_fwd call (params filled as the op fills them,
// paged_max_seqlen_k included), requested_splits its num_splits: 1 the
// forward kernels, > 1 that many splits, 0 the plan's choice. A
// FLASH_ATTN_FWD_KERNEL override keeps num_splits=0 on the forward kernel it
// names, as plan_fwd keeps a fixed-length call. Chosen, a decode-like call
// (each sequence's query rows of a kv head fit one split-KV query block)
// runs on the split-KV kernel with at least two splits, one more than a
// batch that fills the SMs needs: a varlen split run's combine writes the
// rows of q outside every sequence. flash-attn 2.x splits such calls the
// same way (its varlen forward with one query row per sequence), and on the
// forward kernels each query head's one row took a 128-row tile and read
// its keys alone: 3.2-10.8x the split-KV time at 1-64 sequences of 4k-32k
// paged keys on an H200 (PERF_LOG 2026-12-01 "varlen decode").
DecodePlan plan_varlen_split(const FwdParams& params, int64_t requested_splits,
                             KernelOverride override_kernel, const DeviceDesc& device);

// ------------------------------------------------------------- description

// One line per plan, "key=value ... reason: text", for the debug ops and
// error messages.
std::string describe(const FwdPlan& plan);
std::string describe(const BwdPlan& plan);
std::string describe(const DecodePlan& plan);

}  // namespace flash
