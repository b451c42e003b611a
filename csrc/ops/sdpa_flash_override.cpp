// aten::_scaled_dot_product_flash_attention in C++, for the SDPA provider
// (flash_attn_cuda/integrations/sdpa.py), on every device and build.
//
// The provider's override of that op is a Python function. Registered as the
// op's kernel it costs each call a trip from the dispatcher into Python and
// back (the arguments and the 9-tuple of results boxed and converted), four
// transposes, a view and an allocation dispatched from Python, and the
// flash_attn::fwd call parsed from Python: on a decode step that is most of
// the call (PERF_LOG 2026-11-29, per-call host cost). This kernel does the
// same for the calls that need nothing else: no dropout, no debug mask, 4-D
// inputs of one head dim that is a multiple of 8 with a contiguous last
// dimension, a query whose layout empty_like keeps. Every other call goes to
// flash_attn::_sdpa_flash_fallback, which the provider serves with its Python
// override: one set of checks and messages, in Python.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>

#include "common/head_dim_bounds.h"

namespace flash {
namespace {

using SdpaFlashResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, c10::SymInt,
                                   c10::SymInt, at::Tensor, at::Tensor, at::Tensor>;
using SdpaFlashSignature = SdpaFlashResult(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                           double, bool, bool, std::optional<double>);
using FwdSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
    double, double, bool, int64_t, int64_t, double, bool, int64_t, int64_t,
    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&);

// The calls this kernel serves itself; sdpa.py's override gives the same
// results for them (its _prepare and _unpad_head_dim leave such tensors as
// they are, and empty_like keeps the query's strides).
bool served_here(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                 double dropout_p, bool return_debug_mask) {
  if (dropout_p != 0.0 || return_debug_mask) return false;
  if (query.dim() != 4 || key.dim() != 4 || value.dim() != 4) return false;
  const int64_t head_dim = query.size(3);
  if (key.size(3) != head_dim || value.size(3) != head_dim) return false;
  if (head_dim < 8 || head_dim > kMaxHeadDimCuda || head_dim % 8 != 0) return false;
  if (query.stride(3) != 1 || key.stride(3) != 1 || value.stride(3) != 1) return false;
  return query.is_non_overlapping_and_dense();
}

SdpaFlashResult fallback(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                         double dropout_p, bool is_causal, bool return_debug_mask,
                         std::optional<double> scale) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("flash_attn::_sdpa_flash_fallback", "")
                             .typed<SdpaFlashSignature>();
  return op.call(query, key, value, dropout_p, is_causal, return_debug_mask, scale);
}

// `result` in the layout of empty_like(like), as torch's kernels return it
// (sdpa.py's _in_layout_of); `like` is non-overlapping and dense, so that
// layout is like's own strides.
at::Tensor in_layout_of(const at::Tensor& result, const at::Tensor& like) {
  if (result.strides() == like.strides()) return result;
  bool only_unit_dims_differ = true;
  for (int64_t dim = 0; dim < result.dim(); ++dim) {
    only_unit_dims_differ =
        only_unit_dims_differ && (result.size(dim) == 1 || result.stride(dim) == like.stride(dim));
  }
  if (only_unit_dims_differ) return result.as_strided(result.sizes(), like.strides());
  at::Tensor target = at::empty_like(like);
  target.copy_(result);
  return target;
}

std::atomic<int64_t>& served_calls() {
  static std::atomic<int64_t> count{0};
  return count;
}

SdpaFlashResult sdpa_flash_forward(const at::Tensor& query, const at::Tensor& key,
                                   const at::Tensor& value, double dropout_p, bool is_causal,
                                   bool return_debug_mask, std::optional<double> scale) {
  if (!served_here(query, key, value, dropout_p, return_debug_mask)) {
    return fallback(query, key, value, dropout_p, is_causal, return_debug_mask, scale);
  }
  served_calls().fetch_add(1, std::memory_order_relaxed);
  static const auto fwd =
      c10::Dispatcher::singleton().findSchemaOrThrow("flash_attn::fwd", "").typed<FwdSignature>();
  // (batch, nheads, seqlen, head_dim) -> (batch, seqlen, nheads, head_dim): views.
  // The default scale as sdpa.py computes it (head_dim ** -0.5).
  const double softmax_scale =
      scale.has_value() ? *scale : std::pow(static_cast<double>(query.size(3)), -0.5);
  auto [out, lse, debug_mask, rng_state] =
      fwd.call(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), std::nullopt, 0.0,
               softmax_scale, is_causal, -1, -1, 0.0, false, 0, 0, std::nullopt, std::nullopt,
               std::nullopt, std::nullopt, std::nullopt);
  // torch's dropout state: uint64 [seed, offset] and a scalar nothing reads
  // (sdpa.py's _to_torch_rng_state).
  at::Tensor seed_offset = rng_state.view(at::kUInt64);
  at::Tensor unused = at::empty({}, rng_state.options().dtype(at::kUInt64));
  return {in_layout_of(out.transpose(1, 2), query),
          lse,
          at::Tensor(),
          at::Tensor(),
          c10::SymInt(query.size(2)),
          c10::SymInt(key.size(2)),
          seed_offset,
          unused,
          debug_mask};
}

struct Installed {
  std::mutex mutex;
  std::map<std::string, std::unique_ptr<torch::Library>> libraries;  // by dispatch key
};

Installed& installed() {
  static Installed state;
  return state;
}

// Installs the kernel for `dispatch_key` (true when it is in place), or
// removes it (true when there was one). A torch whose schema of the aten op
// differs from this kernel's signature refuses it: false, and the provider
// registers its Python override instead.
bool sdpa_flash_override(c10::string_view dispatch_key, bool install) {
  const std::string key(dispatch_key.data(), dispatch_key.size());
  Installed& state = installed();
  const std::lock_guard<std::mutex> lock(state.mutex);
  if (!install) return state.libraries.erase(key) > 0;
  if (state.libraries.count(key) > 0) return true;
  auto library = std::make_unique<torch::Library>(torch::Library::IMPL, "aten",
                                                  c10::parseDispatchKey(key), __FILE__, __LINE__);
  try {
    library->impl("_scaled_dot_product_flash_attention", TORCH_FN(sdpa_flash_forward));
  } catch (const c10::Error&) {
    return false;
  }
  state.libraries.emplace(key, std::move(library));
  return true;
}

}  // namespace
}  // namespace flash

TORCH_LIBRARY_IMPL(flash_attn, CompositeImplicitAutograd, m) {
  m.impl("_sdpa_flash_override", &flash::sdpa_flash_override);
  m.impl("_sdpa_flash_served_calls",
         [] { return flash::served_calls().load(std::memory_order_relaxed); });
}
