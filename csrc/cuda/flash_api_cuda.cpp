// CUDA implementations of the flash_attn ops: argument checks (shared with the
// CPU path), output allocation, one FwdParams, dispatch on (dtype, head dim) to
// a compiled launcher. Kernels live in the .cu files; this file is the only
// CUDA translation unit that sees torch.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <tuple>

#include "api/checks.h"
#include "common/philox.h"
#include "cuda/launcher_registry.h"
#include "cuda/params.h"
#include "cuda/tile_config.h"

namespace flash {
namespace {

constexpr at::ScalarType kCudaDtypes[] = {at::kHalf, at::kBFloat16};

void check_device_supported(const at::Tensor& q) {
  const cudaDeviceProp* props = at::cuda::getDeviceProperties(q.get_device());
  TORCH_CHECK(props->major >= 8, "flash_attn_cuda needs an sm80 or newer GPU; ", props->name,
              " is sm", props->major, props->minor);
}

// cp.async moves 16-byte chunks: every row of a (.., seqlen, heads, dim) view
// must start 16-byte aligned. Packed-qkv slices satisfy this; anything else is
// copied once rather than refused.
at::Tensor aligned_for_16b_loads(const at::Tensor& t) {
  constexpr int64_t kElemsPer16B = 8;  // fp16 / bf16
  bool aligned = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int64_t dim = 0; dim + 1 < t.dim(); ++dim) {
    aligned = aligned && (t.size(dim) <= 1 || t.stride(dim) % kElemsPer16B == 0);
  }
  return aligned ? t : t.contiguous();
}

QKVStrides strides_of(const at::Tensor& t, bool varlen) {
  // Fixed length: (batch, seqlen, heads, dim); varlen: (total, heads, dim).
  if (varlen) return {0, t.stride(0), t.stride(1)};
  return {t.stride(0), t.stride(1), t.stride(2)};
}

FwdLauncher launcher_for(int head_dim, at::ScalarType dtype) {
  const int compiled = round_up_head_dim(head_dim);
  const bool is_bf16 = dtype == at::kBFloat16;
  FwdLauncher launcher = find_fwd_launcher(compiled, is_bf16);
  TORCH_CHECK(launcher != nullptr, "flash_attn_cuda: head_dim ", head_dim, " in ",
              is_bf16 ? "bf16" : "fp16", " needs the compiled head dim ", compiled,
              ", which this build left out; rebuild with FLASH_ATTN_CUDA_HDIMS and "
              "FLASH_ATTN_CUDA_DTYPES including it");
  return launcher;
}

void set_score_params(FwdParams& params, const at::Tensor& q, double softmax_scale,
                      double softcap, const Window& window,
                      const std::optional<at::Tensor>& alibi_slopes, double dropout_p,
                      const at::Tensor& rng_state_out) {
  params.softmax_scale = static_cast<float>(softmax_scale);
  params.softmax_scale_log2 = static_cast<float>(softmax_scale * M_LOG2E);
  params.softcap = static_cast<float>(softcap);
  params.window_left = window.left;
  params.window_right = window.right;
  params.alibi_slopes = nullptr;
  params.alibi_batch_stride = 0;
  if (alibi_slopes.has_value()) {
    params.alibi_slopes = alibi_slopes->data_ptr<float>();
    params.alibi_batch_stride = alibi_slopes->dim() == 2 ? alibi_slopes->stride(0) : 0;
  }
  params.dropout_p = static_cast<float>(dropout_p);
  params.dropout_threshold = dropout_threshold(static_cast<float>(dropout_p));
  params.dropout_rescale = dropout_p > 0 ? static_cast<float>(1.0 / (1.0 - dropout_p)) : 1.f;
  params.rng_state = rng_state_out.data_ptr<int64_t>();
  params.is_bf16 = q.scalar_type() == at::kBFloat16;
}

// The rng_state the forward returns and the kernel reads: on q's device. With
// no dropout nothing is drawn, and a device fill avoids a host round trip.
at::Tensor rng_state_for(int64_t philox_seed, int64_t philox_offset,
                         const std::optional<at::Tensor>& rng_state, double dropout_p,
                         const at::Tensor& q) {
  if (dropout_p > 0) return output_rng_state(philox_seed, philox_offset, rng_state, q.device());
  return at::zeros({2}, q.options().dtype(at::kLong));
}

std::optional<at::Tensor> contiguous_alibi(const std::optional<at::Tensor>& alibi_slopes) {
  if (!alibi_slopes.has_value()) return std::nullopt;
  return alibi_slopes->contiguous();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fwd_cuda(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const std::optional<at::Tensor>& alibi_slopes_in, double dropout_p, double softmax_scale,
    bool causal, int64_t window_size_left, int64_t window_size_right, double softcap,
    bool return_softmax, int64_t philox_seed, int64_t philox_offset,
    const std::optional<at::Tensor>& rng_state) {
  const FwdShape shape =
      check_fwd_args(q_in, k_in, v_in, alibi_slopes_in, dropout_p, softmax_scale,
                     window_size_left, window_size_right, softcap, rng_state, kCudaDtypes);
  const c10::cuda::CUDAGuard device_guard(q_in.device());
  check_device_supported(q_in);
  const FwdLauncher launcher = launcher_for(shape.head_dim, q_in.scalar_type());
  const at::Tensor q = aligned_for_16b_loads(q_in);
  const at::Tensor k = aligned_for_16b_loads(k_in);
  const at::Tensor v = aligned_for_16b_loads(v_in);
  const std::optional<at::Tensor> alibi_slopes = contiguous_alibi(alibi_slopes_in);
  const Window window =
      normalize_window(causal, window_size_left, window_size_right, shape.seqlen_k);

  at::Tensor out = at::empty({shape.batch, shape.seqlen_q, shape.nheads, shape.head_dim},
                             q.options());
  at::Tensor softmax_lse =
      at::empty({shape.batch, shape.nheads, shape.seqlen_q}, q.options().dtype(at::kFloat));
  at::Tensor s_dmask =
      return_softmax
          ? at::zeros({shape.batch, shape.nheads, shape.seqlen_q, shape.seqlen_k}, q.options())
          : at::empty({0}, q.options());
  at::Tensor rng_state_out = rng_state_for(philox_seed, philox_offset, rng_state, dropout_p, q);

  FwdParams params{};
  params.q_ptr = q.data_ptr();
  params.k_ptr = k.data_ptr();
  params.v_ptr = v.data_ptr();
  params.o_ptr = out.data_ptr();
  params.softmax_lse_ptr = softmax_lse.data_ptr<float>();
  params.p_ptr = return_softmax ? s_dmask.data_ptr() : nullptr;
  params.q = strides_of(q, false);
  params.k = strides_of(k, false);
  params.v = strides_of(v, false);
  params.o = strides_of(out, false);
  params.batch = shape.batch;
  params.nheads = shape.nheads;
  params.nheads_k = shape.nheads_k;
  params.seqlen_q = shape.seqlen_q;
  params.seqlen_k = shape.seqlen_k;
  params.head_dim = shape.head_dim;
  params.cu_seqlens_q = nullptr;
  params.cu_seqlens_k = nullptr;
  params.total_q = 0;
  set_score_params(params, q, softmax_scale, softcap, window, alibi_slopes, dropout_p,
                   rng_state_out);
  launcher(params, at::cuda::getCurrentCUDAStream().stream());
  return {out, softmax_lse, s_dmask, rng_state_out};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> varlen_fwd_cuda(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
    const std::optional<at::Tensor>& block_table,
    const std::optional<at::Tensor>& alibi_slopes_in, int64_t max_seqlen_q,
    int64_t max_seqlen_k, double dropout_p, double softmax_scale, bool causal,
    int64_t window_size_left, int64_t window_size_right, double softcap, bool return_softmax,
    int64_t philox_seed, int64_t philox_offset, const std::optional<at::Tensor>& rng_state) {
  const VarlenShape shape = check_varlen_fwd_args(
      q_in, k_in, v_in, cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes_in, max_seqlen_q,
      max_seqlen_k, dropout_p, softmax_scale, window_size_left, window_size_right, softcap,
      rng_state, kCudaDtypes);
  TORCH_CHECK(!shape.paged,
              "flash_attn_cuda: block_table (paged K/V) is not supported by the CUDA varlen "
              "forward yet; use flash_attn_with_kvcache or contiguous k/v");
  const c10::cuda::CUDAGuard device_guard(q_in.device());
  check_device_supported(q_in);
  const FwdLauncher launcher = launcher_for(shape.head_dim, q_in.scalar_type());
  const at::Tensor q = aligned_for_16b_loads(q_in);
  const at::Tensor k = aligned_for_16b_loads(k_in);
  const at::Tensor v = aligned_for_16b_loads(v_in);
  const at::Tensor cu_q = cu_seqlens_q.contiguous();
  const at::Tensor cu_k = cu_seqlens_k.contiguous();
  const std::optional<at::Tensor> alibi_slopes = contiguous_alibi(alibi_slopes_in);
  const Window window =
      normalize_window(causal, window_size_left, window_size_right, shape.max_seqlen_k);

  at::Tensor out = at::empty({shape.total_q, shape.nheads, shape.head_dim}, q.options());
  at::Tensor softmax_lse =
      at::empty({shape.nheads, shape.total_q}, q.options().dtype(at::kFloat));
  at::Tensor s_dmask = return_softmax ? at::zeros({shape.batch, shape.nheads, shape.max_seqlen_q,
                                                   shape.max_seqlen_k},
                                                  q.options())
                                      : at::empty({0}, q.options());
  at::Tensor rng_state_out = rng_state_for(philox_seed, philox_offset, rng_state, dropout_p, q);

  FwdParams params{};
  params.q_ptr = q.data_ptr();
  params.k_ptr = k.data_ptr();
  params.v_ptr = v.data_ptr();
  params.o_ptr = out.data_ptr();
  params.softmax_lse_ptr = softmax_lse.data_ptr<float>();
  params.p_ptr = return_softmax ? s_dmask.data_ptr() : nullptr;
  params.q = strides_of(q, true);
  params.k = strides_of(k, true);
  params.v = strides_of(v, true);
  params.o = strides_of(out, true);
  params.batch = shape.batch;
  params.nheads = shape.nheads;
  params.nheads_k = shape.nheads_k;
  params.seqlen_q = shape.max_seqlen_q;
  params.seqlen_k = shape.max_seqlen_k;
  params.head_dim = shape.head_dim;
  params.cu_seqlens_q = cu_q.data_ptr<int>();
  params.cu_seqlens_k = cu_k.data_ptr<int>();
  params.total_q = shape.total_q;
  set_score_params(params, q, softmax_scale, softcap, window, alibi_slopes, dropout_p,
                   rng_state_out);
  launcher(params, at::cuda::getCurrentCUDAStream().stream());
  return {out, softmax_lse, s_dmask, rng_state_out};
}

[[noreturn]] void not_on_cuda_yet(const char* op) {
  TORCH_CHECK(false, "flash_attn_cuda: ", op,
              " has no CUDA kernel in this version yet; run it on CPU tensors");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_cuda(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, double, double,
    bool, int64_t, int64_t, double, bool, const std::optional<at::Tensor>&) {
  not_on_cuda_yet("bwd");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_bwd_cuda(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const std::optional<at::Tensor>&, int64_t, int64_t, double, double, bool, int64_t, int64_t,
    double, bool, const std::optional<at::Tensor>&) {
  not_on_cuda_yet("varlen_bwd");
}

std::tuple<at::Tensor, at::Tensor> fwd_kvcache_cuda(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, double, bool, int64_t,
    int64_t, double, bool, int64_t) {
  not_on_cuda_yet("fwd_kvcache");
}

}  // namespace
}  // namespace flash

TORCH_LIBRARY_IMPL(flash_attn, CUDA, m) {
  m.impl("fwd", &flash::fwd_cuda);
  m.impl("varlen_fwd", &flash::varlen_fwd_cuda);
  m.impl("bwd", &flash::bwd_cuda);
  m.impl("varlen_bwd", &flash::varlen_bwd_cuda);
  m.impl("fwd_kvcache", &flash::fwd_kvcache_cuda);
}
