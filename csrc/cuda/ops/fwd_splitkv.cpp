// The forward's run on the split-KV kernel of fwd_kvcache (plan_fwd_split in
// launch/plan.cpp): varlen_fwd with num_splits (FA3's), over its packed or
// paged keys, and a fixed-length fwd whose query rows of a kv head fit one
// split-KV query block (a decode step through flash_attn_func or SDPA), over
// its (batch, seqlen_k, nheads_k, d) keys as over a full cache. A varlen work
// item reads its sequence as BlockInfo does (the varlen forward's guards and
// messages; splitkv_item in decode/splitkv_work_item.h). With num_splits > 1
// each item's keys are cut num_splits ways and the combine kernel merges the
// partial results by their lse; with one split the kernel writes out and lse
// itself. e4m3 keys and values (params.kv_fp8: FP8 attention, with q made
// bf16, or an FP8 KV cache under an fp16 / bf16 q) run here whatever their
// shape, on the instances over e4m3 keys and values of q's dtype, with the
// scores' and V's descales.
#include <ATen/ATen.h>

#include <cstdint>
#include <limits>

#include "cuda/decode/splitkv_tile_config.h"
#include "cuda/fwd/fwd_tile_config.h"
#include "cuda/launch/launcher_registry.h"
#include "cuda/ops/op_common.h"

namespace flash {

bool run_fwd_splitkv(const FwdParams& params, const DecodePlan& plan, const at::Tensor& q,
                     cudaStream_t stream, const SplitKvDescales& descales) {
  const bool varlen = params.cu_seqlens_k != nullptr;
  TORCH_CHECK(plan.num_splits >= 1 && (plan.num_splits > 1 || !varlen) &&
                  params.seqused_q == nullptr && params.p_ptr == nullptr,
              "flash_attn (CUDA): the forward's split-KV run needs a plan from plan_fwd_split");
  const char* op = varlen ? "varlen_fwd with num_splits" : "fwd";
  const int compiled = plan.compiled_head_dim;
  const SplitKvLauncher launcher = find_splitkv_launcher(compiled, params.is_bf16, params.kv_fp8);
  TORCH_CHECK(launcher != nullptr, "flash_attn (CUDA): ", op, ": head_dim ", params.head_dim,
              params.is_bf16 ? " in bf16" : " in fp16",
              " needs the split-KV kernel of the compiled head dim ", compiled,
              params.kv_fp8 ? " over e4m3 keys" : "",
              ", which this build left out; rebuild with FLASH_ATTN_CUDA_HDIMS",
              params.kv_fp8 ? " and FLASH_ATTN_CUDA_DTYPES (q's dtype and fp8)" : "",
              " including it");

  TORCH_CHECK(plan.num_items <= std::numeric_limits<int>::max(), "flash_attn (CUDA): ", op,
              ": batch * nheads_k * query blocks * num_splits = ", plan.num_items,
              " exceeds 2^31 - 1 thread blocks");

  KvcacheParams kv{};
  static_cast<FwdParams&>(kv) = params;
  // The split-KV kernel reads paged keys through its own table fields; the
  // packed keys are (total_k, nheads_k, d) with batch stride 0, each
  // sequence's from its row k_row_begin on. Fixed length: a contiguous cache
  // without cache_seqlens, every entry full (seqlen_k keys).
  kv.block_table = params.block_table;
  kv.block_table_batch_stride = params.block_table_batch_stride;
  kv.page_size = params.block_table != nullptr ? params.page_size : IntDivisor(1);
  kv.num_pages = params.block_table != nullptr ? params.num_pages : 0;
  kv.batch_cache = params.batch;
  kv.num_splits = plan.num_splits;
  kv.append_in_attention = false;
  kv.programmatic_launch = plan.programmatic_launch;
  // The index check of paged keys runs in the combine's grid where there is
  // a combine (a varlen run of num_splits > 1 with rows to merge and a
  // whole grid), else the op launches it after this run.
  kv.table_checked_after = params.block_table != nullptr;
  const int64_t combine_rows = int64_t(params.nheads) * params.total_q;
  kv.combine_checks_paged_keys = kv.table_checked_after && varlen && plan.num_splits > 1 &&
                                 plan.num_items > 0 && combine_rows > 0 &&
                                 combine_rows + params.batch <= std::numeric_limits<int32_t>::max();
  set_descales(kv, descales);

  at::Tensor accum;
  kv.out_accum_ptr = nullptr;
  kv.lse_accum_ptr = nullptr;
  if (plan.num_splits > 1) {
    // Partial outputs (num_splits, rows, compiled), then their lse
    // (num_splits, rows), in one allocation: rows (nheads, total_q) for a
    // varlen q, else (batch, nheads, seqlen_q) (splitkv_rows_per_split).
    const int64_t rows_per_split = varlen ? int64_t(params.nheads) * params.total_q
                                          : int64_t(params.batch) * params.nheads * params.seqlen_q;
    TORCH_CHECK(rows_per_split <= std::numeric_limits<int32_t>::max(), "flash_attn (CUDA): ", op,
                ": the query rows of all heads, ", rows_per_split, ", exceed 2^31 - 1");
    const int64_t partial_rows = int64_t(kv.num_splits) * rows_per_split;
    // The partial rows are as wide as the kernel's value dim (splitkv_head_dim_v).
    const int64_t accum_cols = splitkv_head_dim_v(compiled);
    accum = at::empty({partial_rows * (accum_cols + 1)}, q.options().dtype(at::kFloat));
    kv.out_accum_ptr = accum.data_ptr<float>();
    kv.lse_accum_ptr = kv.out_accum_ptr + partial_rows * accum_cols;
    // A row no split writes (outside every sequence) is the combine's to
    // fill (splitkv_combine.h): out 0, lse +inf.
  }
  if (plan.num_items > 0) launcher(kv, plan, stream);
  return kv.combine_checks_paged_keys;
}

}  // namespace flash
