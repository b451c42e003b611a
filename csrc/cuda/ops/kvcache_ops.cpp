// fwd_kvcache on CUDA: argument checks
// (shared with the CPU path), the plan (plan_decode), the append / rotary
// pre-kernel where the plan leaves it out of the attention kernel, and the
// split-KV launcher of the compiled (dtype, head dim).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "cuda/decode/splitkv_tile_config.h"
#include "cuda/fwd/fwd_tile_config.h"
#include "cuda/launch/append_rotary_launch.h"
#include "cuda/launch/launcher_registry.h"
#include "cuda/launch/plan.h"
#include "cuda/ops/op_common.h"

namespace flash {

namespace {

// The cache is written in place, so it cannot be copied into an aligned
// layout: every row must already start on the boundary of the kernel's
// copies of 8 elements (16 bytes; 8 for an e4m3 cache).
void check_cache_aligned(const at::Tensor& cache, const char* name) {
  const int64_t bytes = 8 * cache.element_size();
  bool aligned = reinterpret_cast<uintptr_t>(cache.data_ptr()) % bytes == 0;
  for (int64_t dim = 0; dim + 1 < cache.dim(); ++dim) {
    aligned = aligned && (cache.size(dim) <= 1 || cache.stride(dim) % 8 == 0);
  }
  TORCH_CHECK(aligned, "fwd_kvcache (CUDA): ", name, " must start on a ", bytes,
              "-byte boundary and have strides that are multiples of 8 elements on every dim "
              "but the last, got strides ",
              cache.strides());
}

QKVStrides strides_or_zero(const std::optional<at::Tensor>& t, bool varlen) {
  if (!t.has_value()) return {0, 0, 0};
  return strides_of(*t, varlen);
}

std::optional<at::Tensor> contiguous_or_none(const std::optional<at::Tensor>& t) {
  if (!t.has_value()) return std::nullopt;
  return t->contiguous();
}

template <typename T>
const T* data_or_null(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr<T>() : nullptr;
}

// Append (+ rotary), in a kernel of its own or in the split-KV attention
// kernel over the cache (params.append_in_attention), then the attention. The
// contents of cache_seqlens / cache_leftpad / cache_batch_idx / block_table
// are not read here (that would synchronise with the device and break CUDA
// graph capture): the kernels guard every index derived from them and record
// a bad value, which index_error_state.h raises (docs/memory_safety.md).
// fwd_kvcache and fwd_kvcache_out: the output goes into out_given when there
// is one.
std::tuple<at::Tensor, at::Tensor> fwd_kvcache_cuda_into(
    const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const std::optional<at::Tensor>& k_in, const std::optional<at::Tensor>& v_in,
    const std::optional<at::Tensor>& cache_seqlens_in,
    const std::optional<at::Tensor>& rotary_cos_in, const std::optional<at::Tensor>& rotary_sin_in,
    const std::optional<at::Tensor>& cache_batch_idx_in,
    const std::optional<at::Tensor>& cache_leftpad_in,
    const std::optional<at::Tensor>& block_table_in,
    const std::optional<at::Tensor>& alibi_slopes_in, double softmax_scale, bool causal,
    int64_t window_size_left, int64_t window_size_right, double softcap, bool rotary_interleaved,
    int64_t num_splits, const std::optional<at::Tensor>& out_given,
    const std::optional<at::Tensor>& learnable_sink_in,
    const std::optional<at::Tensor>& rotary_seqlens_in, const KvcacheVarlenArgs& varlen,
    const Fp8Descales& descales) {
  const KvcacheShape shape = check_fwd_kvcache_args(
      q_in, k_cache, v_cache, k_in, v_in, cache_seqlens_in, rotary_cos_in, rotary_sin_in,
      cache_batch_idx_in, cache_leftpad_in, block_table_in, rotary_seqlens_in, alibi_slopes_in,
      softmax_scale, softcap, kCudaDtypes, varlen);
  TORCH_CHECK(q_in.is_cuda(), "fwd_kvcache (CUDA): q must be a CUDA tensor, got ", q_in.device());
  const std::vector<int64_t> q_shape = kvcache_q_shape(shape, shape.head_dim);
  const std::vector<int64_t> out_shape = kvcache_q_shape(shape, shape.head_dim_v);
  if (out_given.has_value()) {
    check_out_arg("fwd_kvcache", *out_given, q_in, out_shape, kvcache_q_layout(shape),
                  {&q_in, &k_cache, &v_cache, k_in ? &*k_in : nullptr, v_in ? &*v_in : nullptr});
  }
  // d_v < d_qk: the kernels of d_qk read v_cache in place and append v's
  // rows to it at their own width (FwdParams::head_dim_v), so a v_cache that
  // is a column slice of a wider buffer (k_cache[..., :d_v]) is used as it is.
  TORCH_CHECK(num_splits >= 0, "fwd_kvcache: num_splits must be >= 0 (0 chooses), got ",
              num_splits);
  const std::optional<at::Tensor> learnable_sink =
      check_learnable_sink("fwd_kvcache", learnable_sink_in, q_in, shape.nheads);
  const c10::cuda::CUDAGuard device_guard(q_in.device());
  check_device_supported(q_in);
  const IndexErrorSink index_errors = begin_index_checks(q_in);
  const int compiled = round_up_head_dim(shape.head_dim);
  const bool is_bf16 = q_in.scalar_type() == at::kBFloat16;
  // An e4m3 cache (fp8_kvcache_call and check_fp8_served_on_cuda let it
  // through): its descales and features as on the CPU.
  const bool fp8_cache = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  if (fp8_cache) {
    check_fp8_descales("fwd_kvcache", descales, q_in, shape.batch, shape.nheads_k);
    check_fp8_features("fwd_kvcache", 0.0, false, alibi_slopes_in);
  }
  const SplitKvLauncher launcher = find_splitkv_launcher(compiled, is_bf16, fp8_cache);
  TORCH_CHECK(launcher != nullptr, "fwd_kvcache (CUDA): head_dim ", shape.head_dim, " in ",
              is_bf16 ? "bf16" : "fp16", fp8_cache ? " over a float8_e4m3fn cache" : "",
              " needs the compiled head dim ", compiled,
              ", which this build left out; rebuild with FLASH_ATTN_CUDA_HDIMS and "
              "FLASH_ATTN_CUDA_DTYPES including it",
              fp8_cache ? " (and fp8)" : "");
  TORCH_CHECK(shape.head_dim_v <= splitkv_head_dim_v(compiled), "fwd_kvcache (CUDA): head_dim ",
              shape.head_dim,
              " (above 512) is served for absorbed MLA's latent cache, whose values are at most "
              "512 columns: d_v (the head dim of v_cache) must be at most ",
              splitkv_head_dim_v(compiled), ", got ", shape.head_dim_v);
  check_cache_aligned(k_cache, "k_cache");
  check_cache_aligned(v_cache, "v_cache");
  const Window window =
      normalize_window(causal, window_size_left, window_size_right, shape.cache_capacity);
  const bool rotary_q_per_row = window.left >= 0 || window.right >= 0;
  const bool appending = k_in.has_value() && shape.seqlen_new > 0;
  const bool rotating = shape.rotary_dim > 0;
  const std::optional<at::Tensor> rotary_cos = contiguous_or_none(rotary_cos_in);
  const std::optional<at::Tensor> rotary_sin = contiguous_or_none(rotary_sin_in);

  const at::Tensor q = aligned_for_16b_loads(q_in);
  const std::optional<at::Tensor> k_new =
      appending ? std::optional<at::Tensor>(aligned_for_16b_loads(*k_in)) : std::nullopt;
  const std::optional<at::Tensor> v_new =
      appending ? std::optional<at::Tensor>(aligned_for_16b_loads(*v_in)) : std::nullopt;
  const std::optional<at::Tensor> cache_seqlens = contiguous_or_none(cache_seqlens_in);
  const std::optional<at::Tensor> cache_leftpad = contiguous_or_none(cache_leftpad_in);
  const std::optional<at::Tensor> cache_batch_idx = contiguous_or_none(cache_batch_idx_in);
  const std::optional<at::Tensor> block_table = contiguous_or_none(block_table_in);
  const std::optional<at::Tensor> rotary_seqlens = contiguous_or_none(rotary_seqlens_in);
  const std::optional<at::Tensor> alibi_slopes = contiguous_alibi(alibi_slopes_in);

  at::Tensor out = output_buffer(out_given, out_shape, q.options());
  // After the launches: the caller's out.
  auto finish = [&]() -> at::Tensor { return finish_output(out_given, out); };
  at::Tensor softmax_lse = at::empty(kvcache_lse_shape(shape), q.options().dtype(at::kFloat));

  KvcacheParams params{};
  params.q_ptr = q.data_ptr();
  params.k_ptr = k_cache.data_ptr();
  params.v_ptr = v_cache.data_ptr();
  params.o_ptr = out.data_ptr();
  params.softmax_lse_ptr = softmax_lse.data_ptr<float>();
  params.p_ptr = nullptr;
  params.q = strides_of(q, shape.varlen_q);
  params.k = strides_of(k_cache, false);
  params.v = strides_of(v_cache, false);
  params.o = strides_of(out, shape.varlen_q);
  params.batch = shape.batch;
  params.nheads = shape.nheads;
  params.nheads_k = shape.nheads_k;
  params.seqlen_q = shape.seqlen_q;
  params.seqlen_k = shape.cache_capacity;
  params.head_dim = shape.head_dim;
  params.head_dim_v = shape.head_dim_v;
  // The varlen form's offsets are read by the kernels, guarded
  // (index_guards.h guarded_kvcache_sequence).
  params.cu_seqlens_q = shape.varlen_q ? varlen.cu_seqlens_q->data_ptr<int>() : nullptr;
  params.cu_seqlens_k = nullptr;
  params.total_q = shape.varlen_q ? shape.total_q : 0;
  // No dropout: no rng_state.
  set_score_params(params, q, softmax_scale, softcap, window, alibi_slopes, /*dropout_p=*/0.0,
                   at::Tensor());
  // The split-KV kernel leaves the sink to the final normalisation: the
  // combine kernel's when num_splits > 1.
  set_learnable_sink(params, learnable_sink);

  params.cache_seqlens = data_or_null<int>(cache_seqlens);
  params.cache_leftpad = data_or_null<int>(cache_leftpad);
  params.cache_batch_idx = data_or_null<int>(cache_batch_idx);
  params.block_table = data_or_null<int>(block_table);
  params.block_table_batch_stride = block_table.has_value() ? block_table->stride(0) : 0;
  params.rotary_seqlens = data_or_null<int>(rotary_seqlens);
  params.page_size = IntDivisor(shape.paged ? shape.page_size : 1);
  params.batch_cache = shape.batch_cache;
  params.num_pages = shape.paged ? shape.num_blocks : 0;
  params.seqlen_rotary = shape.seqlen_rotary;
  params.index_errors = index_errors;
  params.seqlen_new = appending ? shape.seqlen_new : 0;
  params.new_k_ptr = appending ? k_new->data_ptr() : nullptr;
  params.new_v_ptr = appending ? v_new->data_ptr() : nullptr;
  params.new_k = strides_or_zero(k_new, shape.varlen_new);
  params.new_v = strides_or_zero(v_new, shape.varlen_new);
  params.cu_seqlens_k_new =
      appending && shape.varlen_new ? varlen.cu_seqlens_k_new->data_ptr<int>() : nullptr;
  params.rotary_cos_ptr = rotating ? rotary_cos->data_ptr() : nullptr;
  params.rotary_sin_ptr = rotating ? rotary_sin->data_ptr() : nullptr;
  params.rotary_dim = rotating ? shape.rotary_dim : 0;
  params.rotary_interleaved = rotary_interleaved;
  params.rotary_q_per_row = rotary_q_per_row;
  params.q_unrotated_ptr = q.data_ptr();
  params.q_unrotated = strides_of(q, shape.varlen_q);

  params.append_in_attention = false;
  set_descales(params, fp8_cache ? SplitKvDescales{descales.k.value_or(at::Tensor()),
                                                   descales.v.value_or(at::Tensor())}
                                 : SplitKvDescales{});
  params.cache_fp8 = fp8_cache;  // the append pre-kernel quantises into the cache

  // The plan (plan_decode): variant, splits, grid, clusters, shared memory
  // and where the append / rotary runs.
  DecodeShape decode{};
  decode.batch = shape.batch;
  decode.nheads = shape.nheads;
  decode.nheads_k = shape.nheads_k;
  decode.seqlen_q = shape.seqlen_q;
  decode.cache_capacity = shape.cache_capacity;
  decode.head_dim = shape.head_dim;
  decode.paged = block_table_in.has_value();
  decode.requested_splits = num_splits;
  decode.score_extras = score_features_of(params).has_extras();
  decode.appending = appending;
  decode.seqlen_new = appending ? shape.seqlen_new : 0;
  decode.rotary_dim = rotating ? shape.rotary_dim : 0;
  decode.rotary_tables_aligned = rotating &&
                                 reinterpret_cast<uintptr_t>(rotary_cos->data_ptr()) % 16 == 0 &&
                                 reinterpret_cast<uintptr_t>(rotary_sin->data_ptr()) % 16 == 0;
  decode.window_left = window.left;
  decode.varlen = shape.varlen_q || shape.varlen_new;
  decode.v_in_k = shape.v_in_k;
  decode.fp8_cache = fp8_cache;
  const DeviceDesc device = current_device_desc();
  const DecodePlan plan = plan_decode(decode, device);
  TORCH_CHECK(plan.warps_n > 0, "fwd_kvcache (CUDA): head_dim ", shape.head_dim,
              " needs a split-KV block of ",
              splitkv_smem_bytes(compiled, splitkv_decode_warps_n(compiled)),
              " bytes of shared memory, and this device's blocks hold at most ",
              device.smem_per_block_optin, " (an sm80 or sm90 GPU serves it)");
  TORCH_CHECK(plan.num_m_blocks <= 65535, "fwd_kvcache (CUDA): seqlen_q * (nheads / nheads_k) = ",
              int64_t(shape.seqlen_q) * (shape.nheads / shape.nheads_k),
              " is more than the kernel's grid holds (", 65535 * plan.block_m, ")");
  TORCH_CHECK(int64_t(shape.batch) * shape.nheads_k <= std::numeric_limits<int>::max(),
              "fwd_kvcache (CUDA): batch * nheads_k is too large");

  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  params.programmatic_launch = plan.programmatic_launch;
  if (shape.seqlen_q == 0) {
    launch_kvcache_append_rotary(params, stream);  // the append alone (no q to rotate)
    end_index_checks(q);
    return {finish(), softmax_lse};
  }

  TORCH_CHECK(plan.num_items <= std::numeric_limits<int>::max(),
              "fwd_kvcache (CUDA): batch * nheads_k * query blocks * num_splits = ", plan.num_items,
              " exceeds 2^31 - 1 thread blocks");
  params.num_splits = plan.num_splits;
  // The append and the rotation in the attention kernel itself where that
  // pays (plan_decode); otherwise the pre-kernel writes the cache and a
  // rotated copy of q first.
  params.append_in_attention = plan.append_in_attention;
  at::Tensor q_rotated;
  if (!params.append_in_attention) {
    if (rotating) {
      q_rotated = at::empty(q_shape, q.options());
      params.q_ptr = q_rotated.data_ptr();
      params.q = strides_of(q_rotated, shape.varlen_q);
    }
    launch_kvcache_append_rotary(params, stream);
  }
  at::Tensor split_accum;
  params.out_accum_ptr = nullptr;
  params.lse_accum_ptr = nullptr;
  if (params.num_splits > 1) {
    // One allocation (decode calls are short; each allocator call shows):
    // partial outputs (num_splits, batch, nheads, seqlen_q, accum_cols), then
    // their lse (num_splits, batch, nheads, seqlen_q); a varlen q's rows are
    // (nheads, total_q) (splitkv_rows_per_split). accum_cols, the kernel's
    // value dim (the compiled head dim; 512 at 576, splitkv_head_dim_v), is a
    // multiple of 32, so every partial row stays 16-byte aligned.
    const int64_t accum_cols = splitkv_head_dim_v(compiled);
    const int64_t rows_per_split = shape.varlen_q
                                       ? int64_t(shape.nheads) * shape.total_q
                                       : int64_t(shape.batch) * shape.nheads * shape.seqlen_q;
    const int64_t partial_rows = int64_t(params.num_splits) * rows_per_split;
    split_accum = at::empty({partial_rows * (accum_cols + 1)}, q.options().dtype(at::kFloat));
    params.out_accum_ptr = split_accum.data_ptr<float>();
    params.lse_accum_ptr = params.out_accum_ptr + partial_rows * accum_cols;
    if (shape.varlen_q) {
      // Rows of q outside every sequence have no work item: a partial lse of
      // -inf merges them to out 0, lse +inf, as the CPU path gives them.
      split_accum.narrow(0, partial_rows * accum_cols, partial_rows)
          .fill_(-std::numeric_limits<float>::infinity());
    }
  }
  launcher(params, plan, stream);
  end_index_checks(q);
  return {finish(), softmax_lse};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> fwd_kvcache_cuda(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v,
    const std::optional<at::Tensor>& cache_seqlens, const std::optional<at::Tensor>& rotary_cos,
    const std::optional<at::Tensor>& rotary_sin, const std::optional<at::Tensor>& cache_batch_idx,
    const std::optional<at::Tensor>& cache_leftpad, const std::optional<at::Tensor>& block_table,
    const std::optional<at::Tensor>& alibi_slopes, double softmax_scale, bool causal,
    int64_t window_size_left, int64_t window_size_right, double softcap, bool rotary_interleaved,
    int64_t num_splits, const std::optional<at::Tensor>& learnable_sink,
    const std::optional<at::Tensor>& rotary_seqlens, const std::optional<at::Tensor>& cu_seqlens_q,
    const std::optional<at::Tensor>& cu_seqlens_k_new, std::optional<int64_t> max_seqlen_q,
    const std::optional<at::Tensor>& q_descale, const std::optional<at::Tensor>& k_descale,
    const std::optional<at::Tensor>& v_descale) {
  const Fp8Descales descales{q_descale, k_descale, v_descale};
  check_fp8_served_on_cuda("fwd_kvcache", fp8_kvcache_call(q, k_cache, v_cache, descales), q);
  return fwd_kvcache_cuda_into(
      q, k_cache, v_cache, k, v, cache_seqlens, rotary_cos, rotary_sin, cache_batch_idx,
      cache_leftpad, block_table, alibi_slopes, softmax_scale, causal, window_size_left,
      window_size_right, softcap, rotary_interleaved, num_splits, std::nullopt, learnable_sink,
      rotary_seqlens, {cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q}, descales);
}

at::Tensor fwd_kvcache_out_cuda(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v,
    const std::optional<at::Tensor>& cache_seqlens, const std::optional<at::Tensor>& rotary_cos,
    const std::optional<at::Tensor>& rotary_sin, const std::optional<at::Tensor>& cache_batch_idx,
    const std::optional<at::Tensor>& cache_leftpad, const std::optional<at::Tensor>& block_table,
    const std::optional<at::Tensor>& alibi_slopes, double softmax_scale, bool causal,
    int64_t window_size_left, int64_t window_size_right, double softcap, bool rotary_interleaved,
    int64_t num_splits, const at::Tensor& out, const std::optional<at::Tensor>& learnable_sink,
    const std::optional<at::Tensor>& rotary_seqlens, const std::optional<at::Tensor>& cu_seqlens_q,
    const std::optional<at::Tensor>& cu_seqlens_k_new, std::optional<int64_t> max_seqlen_q,
    const std::optional<at::Tensor>& q_descale, const std::optional<at::Tensor>& k_descale,
    const std::optional<at::Tensor>& v_descale) {
  const Fp8Descales descales{q_descale, k_descale, v_descale};
  check_fp8_served_on_cuda("fwd_kvcache_out", fp8_kvcache_call(q, k_cache, v_cache, descales), q);
  return std::get<1>(fwd_kvcache_cuda_into(
      q, k_cache, v_cache, k, v, cache_seqlens, rotary_cos, rotary_sin, cache_batch_idx,
      cache_leftpad, block_table, alibi_slopes, softmax_scale, causal, window_size_left,
      window_size_right, softcap, rotary_interleaved, num_splits, out, learnable_sink,
      rotary_seqlens, {cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q}, descales));
}

}  // namespace flash
