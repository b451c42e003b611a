// What the CUDA op files (fwd_ops.cpp, bwd_ops.cpp, kvcache_ops.cpp) share:
// the device checks, the index-check bracket, input alignment, the score
// fields of the params, the device description the plans read, and the op
// entry points that registration_cuda.cpp hands to the dispatcher. Only the
// op layer includes torch; kernels take the plain params (params.h).
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <optional>
#include <tuple>

#include "api/checks.h"
#include "api/fp8_checks.h"
#include "api/kvcache_checks.h"
#include "cuda/core/params.h"
#include "cuda/launch/plan.h"

namespace flash {

inline constexpr at::ScalarType kCudaDtypes[] = {at::kHalf, at::kBFloat16};

// Refuses devices older than sm80.
void check_device_supported(const at::Tensor& q);

// The one place that decides which CUDA devices serve an fp8 call (call:
// fp8_attention_call / fp8_kvcache_call, api/fp8_checks.h; op: the op's
// name for the message). Both are served on sm89 and newer, by the split-KV
// kernel's e4m3 instances (their conversion, cvt.rn.f16x2.e4m3x2): an FP8
// KV cache, and FP8 attention (q, k, v in e4m3), whose q the op converts to
// bfloat16 first (exactly).
void check_fp8_served_on_cuda(const char* op, Fp8Call call, const at::Tensor& q);

// The descales the split-KV kernel reads over e4m3 keys and values
// (docs/fp8.md): k's (for FP8 attention q_descale * k_descale, the scores'
// factor) and v's, fp32 (batch, nheads_k) of any strides, or undefined: 1.
// Sets the params' pointers and strides; the caller keeps the tensors alive
// across the launch.
struct SplitKvDescales {
  at::Tensor k;
  at::Tensor v;
};
void set_descales(KvcacheParams& params, const SplitKvDescales& descales);

// FP8 attention's descales for the split-KV kernel: k_descale times
// q_descale (either may be absent), and v_descale.
SplitKvDescales attention_descales(const Fp8Descales& descales);

// Every op starts here, after its device guard: raises what a kernel of an
// earlier call on this device recorded (index_error_state.h) and returns the
// sink this call's kernels record into.
IndexErrorSink begin_index_checks(const at::Tensor& q);

// The end of a call that read index tensors (sync checks only).
void end_index_checks(const at::Tensor& q);

// cp.async moves 16-byte chunks: every row of a (.., seqlen, heads, dim) view
// must start 16-byte aligned. Packed-qkv slices satisfy this; anything else is
// copied once rather than refused.
at::Tensor aligned_for_16b_loads(const at::Tensor& t);

// The tensor a kernel writes its output into: the caller's out (already
// checked, check_out_arg) where every row starts 16-byte aligned, as the
// kernels' 16-byte stores need, else a new contiguous one of `sizes`.
at::Tensor output_buffer(const std::optional<at::Tensor>& out, at::IntArrayRef sizes,
                         const at::TensorOptions& options);
// After the launch: the caller's out, with the buffer copied into it if
// output_buffer had to make one; the buffer itself without an out.
at::Tensor finish_output(const std::optional<at::Tensor>& out, const at::Tensor& buffer);

// Fixed length: (batch, seqlen, heads, dim); varlen: (total, heads, dim).
QKVStrides strides_of(const at::Tensor& t, bool varlen);

// softmax_scale, softcap, window, ALiBi, dropout and the dtype of params, for
// every op: the score rule the plans read (score_features_of) and the
// kernels apply. rng_state_out may be undefined when dropout_p == 0
// (params.rng_state is then null; the kernels read it only with dropout).
void set_score_params(FwdParams& params, const at::Tensor& q, double softmax_scale, double softcap,
                      const Window& window, const std::optional<at::Tensor>& alibi_slopes,
                      double dropout_p, const at::Tensor& rng_state_out);

// params.learnable_sink: the checked, contiguous sinks (check_learnable_sink),
// or null. The caller keeps the tensor alive across the launch.
void set_learnable_sink(FwdParams& params, const std::optional<at::Tensor>& learnable_sink);

// The rng_state the forward returns and the kernel reads: on q's device. With
// no dropout nothing is drawn: int64 zeros, set by one cudaMemsetAsync on the
// current stream (no host round trip, no fill kernel).
at::Tensor rng_state_for(int64_t philox_seed, int64_t philox_offset,
                         const std::optional<at::Tensor>& rng_state, double dropout_p,
                         const at::Tensor& q);

std::optional<at::Tensor> contiguous_alibi(const std::optional<at::Tensor>& alibi_slopes);

// The current device as the plans see it (plan.h), described once per device.
DeviceDesc current_device_desc();

// FLASH_ATTN_FWD_KERNEL / FLASH_ATTN_BWD_KERNEL, read once per call (the
// tests switch them between calls) and handed to the plan.
KernelOverride kernel_override_from_env(const char* variable);

// The op entry points (schemas in csrc/flash_api.cpp).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fwd_cuda(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const std::optional<at::Tensor>& alibi_slopes_in, double dropout_p, double softmax_scale,
    bool causal, int64_t window_size_left, int64_t window_size_right, double softcap,
    bool return_softmax, int64_t philox_seed, int64_t philox_offset,
    const std::optional<at::Tensor>& rng_state, const std::optional<at::Tensor>& learnable_sink,
    const std::optional<at::Tensor>& q_descale, const std::optional<at::Tensor>& k_descale,
    const std::optional<at::Tensor>& v_descale);

std::tuple<at::Tensor, at::Tensor, at::Tensor> fwd_out_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& alibi_slopes, double dropout_p, double softmax_scale,
    bool causal, int64_t window_size_left, int64_t window_size_right, double softcap,
    bool return_softmax, int64_t philox_seed, int64_t philox_offset,
    const std::optional<at::Tensor>& rng_state, const at::Tensor& out,
    const std::optional<at::Tensor>& learnable_sink, const std::optional<at::Tensor>& q_descale,
    const std::optional<at::Tensor>& k_descale, const std::optional<at::Tensor>& v_descale);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> varlen_fwd_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, const std::optional<at::Tensor>& block_table,
    const std::optional<at::Tensor>& alibi_slopes, int64_t max_seqlen_q, int64_t max_seqlen_k,
    double dropout_p, double softmax_scale, bool causal, int64_t window_size_left,
    int64_t window_size_right, double softcap, bool return_softmax, int64_t philox_seed,
    int64_t philox_offset, const std::optional<at::Tensor>& rng_state,
    const std::optional<at::Tensor>& seqused_k, const std::optional<at::Tensor>& learnable_sink,
    const std::optional<at::Tensor>& seqused_q, int64_t num_splits,
    const std::optional<at::Tensor>& q_descale, const std::optional<at::Tensor>& k_descale,
    const std::optional<at::Tensor>& v_descale);

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_fwd_out_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, const std::optional<at::Tensor>& block_table,
    const std::optional<at::Tensor>& alibi_slopes, int64_t max_seqlen_q, int64_t max_seqlen_k,
    double dropout_p, double softmax_scale, bool causal, int64_t window_size_left,
    int64_t window_size_right, double softcap, bool return_softmax, int64_t philox_seed,
    int64_t philox_offset, const std::optional<at::Tensor>& rng_state,
    const std::optional<at::Tensor>& seqused_k, const at::Tensor& out,
    const std::optional<at::Tensor>& learnable_sink, const std::optional<at::Tensor>& seqused_q,
    int64_t num_splits, const std::optional<at::Tensor>& q_descale,
    const std::optional<at::Tensor>& k_descale, const std::optional<at::Tensor>& v_descale);

// The forward's split-KV run (fwd_splitkv.cpp): params as the forward
// kernels would take them, plan from plan_fwd_split (num_splits >= 1; > 1
// for varlen_fwd); with params.kv_fp8 the e4m3 instances and descales.
// Returns whether its combine ran the index check of paged keys
// (KvcacheParams::combine_checks_paged_keys); if not, the caller launches it.
bool run_fwd_splitkv(const FwdParams& params, const DecodePlan& plan, const at::Tensor& q,
                     cudaStream_t stream, const SplitKvDescales& descales = {});

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_cuda(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in,
    const at::Tensor& v_in, const at::Tensor& out_in, const at::Tensor& softmax_lse_in,
    const std::optional<at::Tensor>& alibi_slopes_in, double dropout_p, double softmax_scale,
    bool causal, int64_t window_size_left, int64_t window_size_right, double softcap,
    bool deterministic, const std::optional<at::Tensor>& rng_state,
    const std::optional<at::Tensor>& softmax_d);

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_bwd_cuda(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in,
    const at::Tensor& v_in, const at::Tensor& out_in, const at::Tensor& softmax_lse_in,
    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
    const std::optional<at::Tensor>& alibi_slopes_in, int64_t max_seqlen_q, int64_t max_seqlen_k,
    double dropout_p, double softmax_scale, bool causal, int64_t window_size_left,
    int64_t window_size_right, double softcap, bool deterministic,
    const std::optional<at::Tensor>& rng_state, const std::optional<at::Tensor>& seqused_k,
    const std::optional<at::Tensor>& softmax_d, const std::optional<at::Tensor>& seqused_q);

std::tuple<at::Tensor, at::Tensor> fwd_kvcache_cuda(
    const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const std::optional<at::Tensor>& k_in, const std::optional<at::Tensor>& v_in,
    const std::optional<at::Tensor>& cache_seqlens_in,
    const std::optional<at::Tensor>& rotary_cos_in, const std::optional<at::Tensor>& rotary_sin_in,
    const std::optional<at::Tensor>& cache_batch_idx_in,
    const std::optional<at::Tensor>& cache_leftpad_in,
    const std::optional<at::Tensor>& block_table_in,
    const std::optional<at::Tensor>& alibi_slopes_in, double softmax_scale, bool causal,
    int64_t window_size_left, int64_t window_size_right, double softcap, bool rotary_interleaved,
    int64_t num_splits, const std::optional<at::Tensor>& learnable_sink,
    const std::optional<at::Tensor>& rotary_seqlens, const std::optional<at::Tensor>& cu_seqlens_q,
    const std::optional<at::Tensor>& cu_seqlens_k_new, std::optional<int64_t> max_seqlen_q,
    const std::optional<at::Tensor>& q_descale, const std::optional<at::Tensor>& k_descale,
    const std::optional<at::Tensor>& v_descale);

at::Tensor fwd_kvcache_out_cuda(
    const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const std::optional<at::Tensor>& k_in, const std::optional<at::Tensor>& v_in,
    const std::optional<at::Tensor>& cache_seqlens_in,
    const std::optional<at::Tensor>& rotary_cos_in, const std::optional<at::Tensor>& rotary_sin_in,
    const std::optional<at::Tensor>& cache_batch_idx_in,
    const std::optional<at::Tensor>& cache_leftpad_in,
    const std::optional<at::Tensor>& block_table_in,
    const std::optional<at::Tensor>& alibi_slopes_in, double softmax_scale, bool causal,
    int64_t window_size_left, int64_t window_size_right, double softcap, bool rotary_interleaved,
    int64_t num_splits, const at::Tensor& out, const std::optional<at::Tensor>& learnable_sink,
    const std::optional<at::Tensor>& rotary_seqlens, const std::optional<at::Tensor>& cu_seqlens_q,
    const std::optional<at::Tensor>& cu_seqlens_k_new, std::optional<int64_t> max_seqlen_q,
    const std::optional<at::Tensor>& q_descale, const std::optional<at::Tensor>& k_descale,
    const std::optional<at::Tensor>& v_descale);

// flash_attn_combine (combine_ops.cpp).
std::tuple<at::Tensor, at::Tensor> combine_cuda(const at::Tensor& out_partial,
                                                const at::Tensor& lse_partial,
                                                std::optional<at::ScalarType> out_dtype);

at::Tensor combine_out_cuda(const at::Tensor& out_partial, const at::Tensor& lse_partial,
                            const at::Tensor& out);

}  // namespace flash
