// The split-KV run of varlen_fwd (num_splits, FA3's; plan_varlen_split in
// launch/plan.cpp): the split-KV kernel of fwd_kvcache over the varlen
// forward's packed or paged keys. Each work item reads its sequence as
// BlockInfo does (the varlen forward's guards and messages; splitkv_item in
// decode/splitkv_work_item.h), splits its keys num_splits ways and the
// combine kernel merges the partial results by their lse.
#include <ATen/ATen.h>

#include <cstdint>
#include <limits>

#include "cuda/fwd/fwd_tile_config.h"
#include "cuda/launch/launcher_registry.h"
#include "cuda/ops/op_common.h"

namespace flash {

void run_varlen_splitkv(const FwdParams& params, const DecodePlan& plan, const at::Tensor& q,
                        cudaStream_t stream) {
  TORCH_CHECK(plan.num_splits > 1 && params.cu_seqlens_k != nullptr && params.seqused_q == nullptr,
              "flash_attn (CUDA): the split-KV run of varlen_fwd needs a split plan");
  const int compiled = plan.compiled_head_dim;
  const SplitKvLauncher launcher = find_splitkv_launcher(compiled, params.is_bf16);
  TORCH_CHECK(launcher != nullptr, "flash_attn (CUDA): varlen_fwd with num_splits: head_dim ",
              params.head_dim, " in ", params.is_bf16 ? "bf16" : "fp16",
              " needs the split-KV kernel of the compiled head dim ", compiled,
              ", which this build left out; rebuild with FLASH_ATTN_CUDA_HDIMS including it");

  TORCH_CHECK(plan.num_items <= std::numeric_limits<int>::max(),
              "flash_attn (CUDA): varlen_fwd with num_splits: batch * nheads_k * query blocks * "
              "num_splits = ",
              plan.num_items, " exceeds 2^31 - 1 thread blocks");

  KvcacheParams kv{};
  static_cast<FwdParams&>(kv) = params;
  // The split-KV kernel reads paged keys through its own table fields; the
  // packed keys are (total_k, nheads_k, d) with batch stride 0, each
  // sequence's from its row k_row_begin on.
  kv.block_table = params.block_table;
  kv.block_table_batch_stride = params.block_table_batch_stride;
  kv.page_size = params.block_table != nullptr ? params.page_size : IntDivisor(1);
  kv.num_pages = params.block_table != nullptr ? params.num_pages : 0;
  kv.batch_cache = params.batch;
  kv.num_splits = plan.num_splits;
  kv.append_in_attention = false;
  kv.programmatic_launch = plan.programmatic_launch;

  // Partial outputs (num_splits, nheads, total_q, compiled), then their lse
  // (num_splits, nheads, total_q), in one allocation. The lse starts at
  // -inf: a row no split writes (outside every sequence) merges to out 0,
  // lse +inf (the sink with one), and its partial rows are never read.
  const int64_t rows_per_split = int64_t(params.nheads) * params.total_q;
  TORCH_CHECK(rows_per_split <= std::numeric_limits<int32_t>::max(),
              "flash_attn (CUDA): varlen_fwd with num_splits: nheads * total_q = ", rows_per_split,
              " exceeds 2^31 - 1 rows");
  const int64_t partial_rows = int64_t(kv.num_splits) * rows_per_split;
  at::Tensor accum = at::empty({partial_rows * (compiled + 1)}, q.options().dtype(at::kFloat));
  kv.out_accum_ptr = accum.data_ptr<float>();
  kv.lse_accum_ptr = kv.out_accum_ptr + partial_rows * compiled;
  accum.narrow(0, partial_rows * compiled, partial_rows)
      .fill_(-std::numeric_limits<float>::infinity());
  if (plan.num_items > 0) launcher(kv, plan, stream);
}

}  // namespace flash
