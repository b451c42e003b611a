// The helpers of op_common.h.
#include "cuda/ops/op_common.h"

#include <ATen/cuda/CUDAContext.h>

#include <array>
#include <cmath>
#include <cstdlib>
#include <mutex>

#include "common/philox.h"
#include "cuda/launch/launcher_registry.h"
#include "cuda/ops/index_error_state.h"

namespace flash {

namespace {

constexpr int kMaxDevices = 64;

DeviceDesc describe_device(int device) {
  const cudaDeviceProp* props = at::cuda::getDeviceProperties(device);
  DeviceDesc desc;
  desc.cc_major = props->major;
  desc.cc_minor = props->minor;
  desc.num_sms = props->multiProcessorCount;
  desc.smem_per_block_optin = int(props->sharedMemPerBlockOptin);
  desc.smem_per_sm = int(props->sharedMemPerMultiprocessor);
  desc.reserved_smem_per_block = int(props->reservedSharedMemPerBlock);
  desc.sm90a_built = built_with_sm90a();
  return desc;
}

// The plans' description of `device`, made on its first call: the properties
// do not change while the process runs, and every op reads them (a decode
// step's host time is the call's cost: PERF_LOG 2026-11-29 host cost).
const DeviceDesc& device_desc(int device) {
  TORCH_CHECK(device >= 0 && device < kMaxDevices, "flash_attn_cuda: device index ", device,
              " is out of range [0, ", kMaxDevices, ")");
  static std::array<std::once_flag, kMaxDevices> once;
  static std::array<DeviceDesc, kMaxDevices> descs;
  std::call_once(once[device], [device] { descs[device] = describe_device(device); });
  return descs[device];
}

}  // namespace

void check_device_supported(const at::Tensor& q) {
  if (device_desc(q.get_device()).cc_major >= 8) return;
  const cudaDeviceProp* props = at::cuda::getDeviceProperties(q.get_device());
  TORCH_CHECK(false, "flash_attn_cuda needs an sm80 or newer GPU; ", props->name, " is sm",
              props->major, props->minor);
}

void check_fp8_served_on_cuda(const char* op, Fp8Call call, const at::Tensor& q) {
  if (call == Fp8Call::kNone) return;
  // The split-KV kernel converts the e4m3 tiles with cvt.rn.f16x2.e4m3x2.
  const cudaDeviceProp* props = at::cuda::getDeviceProperties(q.get_device());
  TORCH_CHECK(props->major * 10 + props->minor >= 89, "flash_attn: ", op, ": ",
              call == Fp8Call::kKvCache
                  ? "an FP8 KV cache (k and v, or k_cache and v_cache, of dtype "
                    "float8_e4m3fn)"
                  : "FP8 attention (q, k and v of dtype float8_e4m3fn)",
              " needs a GPU of compute capability 8.9 or newer, got ", q.device(),
              " of compute capability ", props->major, ".", props->minor,
              "; the CPU path serves it (docs/fp8.md), or pass float16 / bfloat16");
}

void set_descales(KvcacheParams& params, const SplitKvDescales& descales) {
  auto strides = [](const at::Tensor& t) -> DescaleStrides {
    return t.defined() ? DescaleStrides{t.stride(0), t.stride(1)} : DescaleStrides{0, 0};
  };
  params.k_descale_ptr = descales.k.defined() ? descales.k.data_ptr<float>() : nullptr;
  params.v_descale_ptr = descales.v.defined() ? descales.v.data_ptr<float>() : nullptr;
  params.k_descale = strides(descales.k);
  params.v_descale = strides(descales.v);
}

SplitKvDescales attention_descales(const Fp8Descales& descales) {
  // The scores of FP8 attention are (q q_descale) . (k k_descale) =
  // (q . k) q_descale k_descale: one factor per (batch, kv head), in fp32
  // (docs/fp8.md, "The dequantisation rule").
  SplitKvDescales result;
  if (descales.q.has_value() && descales.k.has_value()) {
    result.k = *descales.q * *descales.k;
  } else if (descales.q.has_value()) {
    result.k = *descales.q;
  } else if (descales.k.has_value()) {
    result.k = *descales.k;
  }
  if (descales.v.has_value()) result.v = *descales.v;
  return result;
}

IndexErrorSink begin_index_checks(const at::Tensor& q) {
  return begin_index_checks(q.get_device(), at::cuda::getCurrentCUDAStream().stream());
}

void end_index_checks(const at::Tensor& q) {
  finish_index_checks(q.get_device(), at::cuda::getCurrentCUDAStream().stream());
}

namespace {

bool rows_16b_aligned(const at::Tensor& t) {
  const int64_t elems_per_16b = 16 / static_cast<int64_t>(t.element_size());  // 8, e4m3 16
  bool aligned = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int64_t dim = 0; dim + 1 < t.dim(); ++dim) {
    aligned = aligned && (t.size(dim) <= 1 || t.stride(dim) % elems_per_16b == 0);
  }
  return aligned;
}

}  // namespace

at::Tensor aligned_for_16b_loads(const at::Tensor& t) {
  return rows_16b_aligned(t) ? t : t.contiguous();
}

at::Tensor output_buffer(const std::optional<at::Tensor>& out, at::IntArrayRef sizes,
                         const at::TensorOptions& options) {
  if (out.has_value() && rows_16b_aligned(*out)) return *out;
  return at::empty(sizes, options);
}

at::Tensor finish_output(const std::optional<at::Tensor>& out, const at::Tensor& buffer) {
  if (!out.has_value()) return buffer;
  if (!buffer.is_same(*out)) out->copy_(buffer);
  return *out;
}

QKVStrides strides_of(const at::Tensor& t, bool varlen) {
  if (varlen) return {0, t.stride(0), t.stride(1)};
  return {t.stride(0), t.stride(1), t.stride(2)};
}

void set_score_params(FwdParams& params, const at::Tensor& q, double softmax_scale, double softcap,
                      const Window& window, const std::optional<at::Tensor>& alibi_slopes,
                      double dropout_p, const at::Tensor& rng_state_out) {
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
  // Without dropout no kernel reads it: an undefined tensor is accepted then.
  params.rng_state = rng_state_out.defined() ? rng_state_out.data_ptr<int64_t>() : nullptr;
  params.is_bf16 = q.scalar_type() == at::kBFloat16;
}

at::Tensor rng_state_for(int64_t philox_seed, int64_t philox_offset,
                         const std::optional<at::Tensor>& rng_state, double dropout_p,
                         const at::Tensor& q) {
  if (dropout_p > 0) return output_rng_state(philox_seed, philox_offset, rng_state, q.device());
  // No dropout: nothing is drawn and no kernel reads it, but the forward
  // returns it, and zeros keep that result deterministic (opcheck compares
  // results). One async memset on the current stream, where at::zeros went
  // through the dispatcher (empty, zero_, fill_) and launched a fill kernel.
  at::Tensor state = at::empty({2}, q.options().dtype(at::kLong));
  C10_CUDA_CHECK(cudaMemsetAsync(state.data_ptr(), 0, 2 * sizeof(int64_t),
                                 at::cuda::getCurrentCUDAStream(q.get_device()).stream()));
  return state;
}

void set_learnable_sink(FwdParams& params, const std::optional<at::Tensor>& learnable_sink) {
  params.learnable_sink =
      learnable_sink.has_value() ? learnable_sink->const_data_ptr<float>() : nullptr;
}

std::optional<at::Tensor> contiguous_alibi(const std::optional<at::Tensor>& alibi_slopes) {
  if (!alibi_slopes.has_value()) return std::nullopt;
  return alibi_slopes->contiguous();
}

DeviceDesc current_device_desc() { return device_desc(c10::cuda::current_device()); }

KernelOverride kernel_override_from_env(const char* variable) {
  return parse_kernel_override(std::getenv(variable));
}

}  // namespace flash
