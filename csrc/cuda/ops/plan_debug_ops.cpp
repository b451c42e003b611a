// torch.ops.flash_attn._plan_fwd / _plan_bwd / _plan_decode: which kernel,
// tile, grid and split count the CUDA path would run a call of this shape on
// a described device, and why (plan.h), as one line of text. No tensor is
// read and nothing is launched: every build registers them, the CPU-only one
// included (setup.py compiles this file and plan.cpp into it), so that the
// plans are tested without a GPU (tests/test_plan.py).
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <string>

#include "api/checks.h"
#include "common/head_dim_bounds.h"
#include "cuda/launch/plan.h"

namespace flash {
namespace {

// Stand-ins for the pointers whose presence (not contents) the plans read:
// varlen (cu_seqlens), ALiBi slopes, returned probabilities.
const int kSomeSeqlens[1] = {0};
const float kSomeSlopes[1] = {0.f};
float kSomeProbs[1] = {0.f};

DeviceDesc device_of(int64_t cc_major, int64_t cc_minor, int64_t num_sms,
                     int64_t smem_per_block_optin, int64_t smem_per_sm,
                     int64_t reserved_smem_per_block, bool sm90a_built) {
  DeviceDesc device;
  device.cc_major = static_cast<int>(cc_major);
  device.cc_minor = static_cast<int>(cc_minor);
  device.num_sms = static_cast<int>(num_sms);
  device.smem_per_block_optin = static_cast<int>(smem_per_block_optin);
  device.smem_per_sm = static_cast<int>(smem_per_sm);
  device.reserved_smem_per_block = static_cast<int>(reserved_smem_per_block);
  device.sm90a_built = sm90a_built;
  return device;
}

KernelOverride override_of(const std::string& kernel_override) {
  TORCH_CHECK(kernel_override.empty() || kernel_override == "sm80" || kernel_override == "sm90",
              "_plan: kernel_override must be '', 'sm80' or 'sm90', got '", kernel_override, "'");
  return parse_kernel_override(kernel_override.c_str());
}

// The shape and score fields of a call, as the ops fill them.
void fill_call(FwdParams& params, int64_t batch, int64_t seqlen_q, int64_t seqlen_k, int64_t nheads,
               int64_t nheads_k, int64_t head_dim, bool causal, int64_t window_size_left,
               int64_t window_size_right, double softcap, bool alibi, double dropout_p,
               std::optional<double> softmax_scale, bool varlen, int max_head_dim) {
  TORCH_CHECK(head_dim > 0 && head_dim <= max_head_dim, "_plan: head_dim must be in [1, ",
              max_head_dim, "], got ", head_dim);
  TORCH_CHECK(nheads_k > 0 && nheads % nheads_k == 0,
              "_plan: nheads must be a multiple of nheads_k");
  params.batch = static_cast<int>(batch);
  params.seqlen_q = static_cast<int>(seqlen_q);
  params.seqlen_k = static_cast<int>(seqlen_k);
  params.nheads = static_cast<int>(nheads);
  params.nheads_k = static_cast<int>(nheads_k);
  params.head_dim = static_cast<int>(head_dim);
  params.head_dim_v = static_cast<int>(head_dim);  // _plan_fwd may set a smaller d_v
  const Window window = normalize_window(causal, window_size_left, window_size_right, seqlen_k);
  params.window_left = window.left;
  params.window_right = window.right;
  const double scale = softmax_scale.value_or(1.0 / std::sqrt(double(head_dim)));
  params.softmax_scale = static_cast<float>(scale);
  params.softmax_scale_log2 = static_cast<float>(scale * M_LOG2E);
  params.softcap = static_cast<float>(softcap);
  params.alibi_slopes = alibi ? kSomeSlopes : nullptr;
  params.dropout_p = static_cast<float>(dropout_p);
  params.cu_seqlens_q = varlen ? kSomeSeqlens : nullptr;
  params.cu_seqlens_k = varlen ? kSomeSeqlens : nullptr;
  params.total_q = varlen ? params.batch * params.seqlen_q : 0;
  params.total_k = varlen ? params.batch * params.seqlen_k : 0;
}

std::string plan_fwd_op(int64_t batch, int64_t seqlen_q, int64_t seqlen_k, int64_t nheads,
                        int64_t nheads_k, int64_t head_dim, bool causal, int64_t window_size_left,
                        int64_t window_size_right, double softcap, bool alibi, double dropout_p,
                        std::optional<double> softmax_scale, bool varlen, bool return_softmax,
                        int64_t cc_major, int64_t cc_minor, int64_t num_sms,
                        int64_t smem_per_block_optin, int64_t smem_per_sm,
                        int64_t reserved_smem_per_block, bool sm90a_built,
                        std::string kernel_override, bool tma_aligned, int64_t page_size,
                        int64_t head_dim_v, bool fp8, int64_t num_splits) {
  FwdParams params{};
  fill_call(params, batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, causal, window_size_left,
            window_size_right, softcap, alibi, dropout_p, softmax_scale, varlen,
            kMaxHeadDimCudaFwd);
  // head_dim_v < 0: d_v = d_qk. A smaller d_v may pick a specialised pair's
  // Hopper kernel (plan_fwd).
  TORCH_CHECK(head_dim_v < 0 || (head_dim_v > 0 && head_dim_v <= head_dim),
              "_plan_fwd: head_dim_v must be in [1, head_dim] (or -1: head_dim), got ", head_dim_v);
  if (head_dim_v > 0) params.head_dim_v = static_cast<int>(head_dim_v);
  params.p_ptr = return_softmax ? kSomeProbs : nullptr;
  // page_size > 0: paged keys of a varlen call (its table's contents do not
  // enter the plan; tma_aligned says whether the pool's layout is TMA's).
  TORCH_CHECK(page_size >= 0 && (page_size == 0 || varlen),
              "_plan_fwd: page_size needs varlen=True and must be >= 0, got ", page_size);
  if (page_size > 0) {
    params.block_table = kSomeSeqlens;
    params.page_size = IntDivisor(static_cast<int>(page_size));
    params.paged_max_seqlen_k = params.seqlen_k;
  }
  // fp8: FP8 attention (e4m3 k and v, q converted to bfloat16 by the op).
  params.kv_fp8 = fp8;
  const DeviceDesc device = device_of(cc_major, cc_minor, num_sms, smem_per_block_optin,
                                      smem_per_sm, reserved_smem_per_block, sm90a_built);
  // num_splits (varlen_fwd's; a fixed-length call has none): the split-KV
  // run where it takes the call, as the op plans it.
  TORCH_CHECK(num_splits >= 0, "_plan_fwd: num_splits must be >= 0 (0 chooses), got ", num_splits);
  if (varlen) {
    const DecodePlan split =
        plan_varlen_split(params, num_splits, override_of(kernel_override), device);
    if (split.num_splits > 0) return describe(split);
  }
  return describe(plan_fwd(params, device, override_of(kernel_override), tma_aligned));
}

std::string plan_bwd_op(int64_t batch, int64_t seqlen_q, int64_t seqlen_k, int64_t nheads,
                        int64_t nheads_k, int64_t head_dim, bool causal, int64_t window_size_left,
                        int64_t window_size_right, double softcap, bool alibi, double dropout_p,
                        std::optional<double> softmax_scale, bool varlen, bool deterministic,
                        int64_t cc_major, int64_t cc_minor, int64_t num_sms,
                        int64_t smem_per_block_optin, int64_t smem_per_sm,
                        int64_t reserved_smem_per_block, bool sm90a_built,
                        std::string kernel_override, bool tma_aligned, int64_t head_dim_v) {
  BwdParams params{};
  fill_call(params, batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, causal, window_size_left,
            window_size_right, softcap, alibi, dropout_p, softmax_scale, varlen,
            kMaxHeadDimCudaBwd);
  params.deterministic = deterministic;
  // head_dim_v < 0: d_v = d_qk. A smaller d_v may pick a specialised pair's
  // Hopper kernel (plan_bwd), as in _plan_fwd.
  TORCH_CHECK(head_dim_v < 0 || (head_dim_v > 0 && head_dim_v <= head_dim),
              "_plan_bwd: head_dim_v must be in [1, head_dim] (or -1: head_dim), got ", head_dim_v);
  if (head_dim_v > 0) params.head_dim_v = static_cast<int>(head_dim_v);
  const DeviceDesc device = device_of(cc_major, cc_minor, num_sms, smem_per_block_optin,
                                      smem_per_sm, reserved_smem_per_block, sm90a_built);
  return describe(plan_bwd(params, device, override_of(kernel_override), tma_aligned));
}

std::string plan_decode_op(int64_t batch, int64_t seqlen_q, int64_t cache_capacity, int64_t nheads,
                           int64_t nheads_k, int64_t head_dim, bool paged, int64_t num_splits,
                           bool causal, int64_t window_size_left, int64_t window_size_right,
                           double softcap, bool alibi, std::optional<double> softmax_scale,
                           int64_t seqlen_new, int64_t rotary_dim, bool rotary_aligned,
                           int64_t cc_major, int64_t cc_minor, int64_t num_sms,
                           int64_t smem_per_block_optin, int64_t smem_per_sm,
                           int64_t reserved_smem_per_block, bool v_in_k, bool fp8_cache,
                           int64_t min_splits) {
  TORCH_CHECK(head_dim > 0 && head_dim <= kMaxHeadDimCudaKvcache,
              "_plan_decode: head_dim must be in [1, ", kMaxHeadDimCudaKvcache, "], got ",
              head_dim);
  TORCH_CHECK(nheads_k > 0 && nheads % nheads_k == 0,
              "_plan_decode: nheads must be a multiple of nheads_k");
  TORCH_CHECK(num_splits >= 0, "_plan_decode: num_splits must be >= 0 (0 chooses)");
  TORCH_CHECK(min_splits >= 1, "_plan_decode: min_splits must be >= 1, got ", min_splits);
  const double scale = softmax_scale.value_or(1.0 / std::sqrt(double(head_dim)));
  const Window window =
      normalize_window(causal, window_size_left, window_size_right, cache_capacity);
  DecodeShape shape;
  shape.batch = static_cast<int>(batch);
  shape.nheads = static_cast<int>(nheads);
  shape.nheads_k = static_cast<int>(nheads_k);
  shape.seqlen_q = static_cast<int>(seqlen_q);
  shape.cache_capacity = static_cast<int>(cache_capacity);
  shape.head_dim = static_cast<int>(head_dim);
  shape.paged = paged;
  shape.requested_splits = num_splits;
  shape.score_extras = score_features(static_cast<float>(softcap), alibi, /*dropout_p=*/0.f,
                                      static_cast<float>(scale * M_LOG2E))
                           .has_extras();
  shape.appending = seqlen_new > 0;
  shape.seqlen_new = static_cast<int>(seqlen_new);
  shape.rotary_dim = static_cast<int>(rotary_dim);
  shape.rotary_tables_aligned = rotary_dim > 0 && rotary_aligned;
  shape.window_left = window.left;
  shape.v_in_k = v_in_k;
  shape.fp8_cache = fp8_cache;
  shape.min_splits = static_cast<int>(min_splits);
  const DeviceDesc device = device_of(cc_major, cc_minor, num_sms, smem_per_block_optin,
                                      smem_per_sm, reserved_smem_per_block, /*sm90a_built=*/true);
  return describe(plan_decode(shape, device));
}

}  // namespace
}  // namespace flash

// No tensor arguments: one kernel serves every dispatch key.
TORCH_LIBRARY_IMPL(flash_attn, CompositeImplicitAutograd, m) {
  m.impl("_plan_fwd", &flash::plan_fwd_op);
  m.impl("_plan_bwd", &flash::plan_bwd_op);
  m.impl("_plan_decode", &flash::plan_decode_op);
}
