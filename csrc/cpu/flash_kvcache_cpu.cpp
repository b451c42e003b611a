// CPU implementation of flash_attn::fwd_kvcache (and fwd_kvcache_out, which
// writes into the caller's out): append the new keys / values
// into the cache in place (rotating the keys when rotary tables are given),
// rotate q the same way, then run the shared attention core over the cache
// rows each batch entry owns.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "api/checks.h"
#include "api/fp8_checks.h"
#include "api/head_dims.h"
#include "api/kvcache_checks.h"
#include "cpu/attention_cpu.h"

namespace flash::cpu {
namespace {

// Per-batch placement of the cache rows, resolved on the host.
struct CacheLayout {
  const KvcacheShape& shape;
  const int32_t* cache_seqlens;    // null: every sequence fills the cache
  const int32_t* cache_leftpad;    // null: no left padding
  const int32_t* cache_batch_idx;  // null: batch entry b uses cache row (or table row) b
  const int32_t* block_table;      // null: contiguous cache
  int64_t block_table_stride;
  const int32_t* rotary_seqlens;  // null: rotary positions start at end(b)
  // Varlen q / new keys (FA3): sequence b's query rows are q rows
  // [cu_seqlens_q[b], cu_seqlens_q[b + 1]), its new keys k / v rows
  // [cu_seqlens_k_new[b], cu_seqlens_k_new[b + 1]). Null: fixed lengths.
  const int32_t* cu_seqlens_q;
  const int32_t* cu_seqlens_k_new;

  int64_t seqlen_new(int b) const {
    return cu_seqlens_k_new ? cu_seqlens_k_new[b + 1] - cu_seqlens_k_new[b] : shape.seqlen_new;
  }
  int64_t seqlen_q(int b) const {
    return cu_seqlens_q ? cu_seqlens_q[b + 1] - cu_seqlens_q[b] : shape.seqlen_q;
  }

  // One past the last filled position of batch b before the append; the new
  // tokens go to [end, end + seqlen_new).
  int64_t end(int b) const { return cache_seqlens ? cache_seqlens[b] : shape.cache_capacity; }
  int64_t leftpad(int b) const { return cache_leftpad ? cache_leftpad[b] : 0; }
  // The cache entry of batch b: its row of a contiguous cache, or of the
  // block table (FA3 indexes the page table with cache_batch_idx too).
  int64_t cache_row(int b) const { return cache_batch_idx ? cache_batch_idx[b] : b; }
  // Rotary position of the first new key (and of query row 0).
  int64_t rotary_start(int b) const { return rotary_seqlens ? rotary_seqlens[b] : end(b); }
  const int32_t* table_row(int b) const {
    return block_table ? block_table + cache_row(b) * block_table_stride : nullptr;
  }

  // Element offset of (batch b, logical position pos, kv head h) in a cache
  // tensor with the given strides.
  int64_t offset(int b, int64_t pos, int h, const RowStrides& strides) const {
    if (block_table) {
      const int64_t page = table_row(b)[pos / shape.page_size];
      return page * strides.batch + (pos % shape.page_size) * strides.row + h * strides.head;
    }
    return cache_row(b) * strides.batch + pos * strides.row + h * strides.head;
  }
};

// A 4-D (batch, row, head, dim) tensor, or a varlen 3-D (total, head, dim) one
// (batch stride 0).
RowStrides strides_of(const at::Tensor& t) {
  if (t.dim() == 3) return {0, t.stride(0), t.stride(1)};
  return {t.stride(0), t.stride(1), t.stride(2)};
}

// Row `row` of a fixed-length (batch, rows_per_batch) tensor, or of a varlen
// one (cu_seqlens non-null): the sequence b it belongs to, its index i in the
// sequence and where it lives (batch, row) in the tensor. batch -1: the
// varlen row lies outside every sequence (before cu_seqlens[0] or from
// cu_seqlens[batch] on).
struct SequenceRow {
  int batch;
  int64_t i;
  int64_t tensor_batch;
  int64_t tensor_row;
};

SequenceRow sequence_row(int64_t row, int64_t rows_per_batch, const int32_t* cu_seqlens,
                         int batch) {
  if (cu_seqlens == nullptr) {
    const int b = static_cast<int>(row / rows_per_batch);
    return {b, row - b * rows_per_batch, b, row - b * rows_per_batch};
  }
  // The last sequence whose first row is at or before `row` (the offsets are
  // checked non-decreasing).
  const int32_t* after = std::upper_bound(cu_seqlens, cu_seqlens + batch + 1, row);
  const int b = static_cast<int>(after - cu_seqlens) - 1;
  if (b < 0 || b >= batch) return {-1, 0, 0, row};
  return {b, row - cu_seqlens[b], 0, row};
}

// Rotates the first rotary_dim entries of one head vector: pairs (2m, 2m+1)
// when interleaved (GPT-J), else (m, m + rotary_dim / 2) (GPT-NeoX). The math
// runs in fp32 and rounds once to T, as the GPU kernels do.
template <typename T>
void copy_rotated(const T* src, T* dst, int head_dim, const T* cos, const T* sin, int rotary_dim,
                  bool interleaved) {
  const int half = rotary_dim / 2;
  for (int m = 0; m < half; ++m) {
    const int first = interleaved ? 2 * m : m;
    const int second = interleaved ? 2 * m + 1 : m + half;
    const float x0 = static_cast<float>(src[first]);
    const float x1 = static_cast<float>(src[second]);
    const float c = static_cast<float>(cos[m]);
    const float s = static_cast<float>(sin[m]);
    dst[first] = static_cast<T>(x0 * c - x1 * s);
    dst[second] = static_cast<T>(x0 * s + x1 * c);
  }
  for (int d = rotary_dim; d < head_dim; ++d) dst[d] = src[d];
}

// One appended row into the cache: as is into a cache of its own dtype, or
// quantised into an fp8 cache (common/fp8_rule.h).
template <typename T, typename TC>
void store_cache_row(const T* src, TC* dst, int n, float descale) {
  for (int d = 0; d < n; ++d) {
    if constexpr (std::is_same_v<TC, c10::Float8_e4m3fn>) {
      dst[d] = TC(fp8_scaled_for_store(static_cast<float>(src[d]), descale));
    } else {
      dst[d] = src[d];
    }
  }
}

struct Rotary {
  const void* cos;  // (seqlen_ro, rotary_dim / 2), contiguous, dtype of q
  const void* sin;
  int rotary_dim;  // 0: no rotation
  bool interleaved;
};

// T: the dtype of q and the new k / v; TC: the caches' (T, or an fp8 cache
// into which the rows are quantised with the descales of their batch entry
// and kv head, after rotary).
template <typename T, typename TC>
void append_new_tokens(const CacheLayout& layout, const at::Tensor& k_new, const at::Tensor& v_new,
                       const at::Tensor& k_cache, const at::Tensor& v_cache, const Rotary& rotary,
                       const Fp8Descale& k_descale, const Fp8Descale& v_descale) {
  const KvcacheShape& shape = layout.shape;
  const RowStrides k_new_strides = strides_of(k_new);
  const RowStrides v_new_strides = strides_of(v_new);
  const RowStrides k_cache_strides = strides_of(k_cache);
  const RowStrides v_cache_strides = strides_of(v_cache);
  const T* k_src = k_new.const_data_ptr<T>();
  const T* v_src = v_new.const_data_ptr<T>();
  TC* k_dst = k_cache.data_ptr<TC>();
  TC* v_dst = v_cache.data_ptr<TC>();
  const T* cos = static_cast<const T*>(rotary.cos);
  const T* sin = static_cast<const T*>(rotary.sin);
  const int64_t half = rotary.rotary_dim / 2;

  // Fixed length: (batch, seqlen_new) rows; varlen: total_k_new rows, each
  // of the sequence whose offsets hold it.
  const int64_t rows_per_batch = layout.cu_seqlens_k_new ? 0 : shape.seqlen_new;
  const int64_t rows =
      (layout.cu_seqlens_k_new ? shape.seqlen_new : int64_t(shape.batch) * shape.seqlen_new) *
      shape.nheads_k;
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    std::vector<T> rotated(shape.head_dim);
    for (int64_t index = begin; index < end; ++index) {
      const int h = static_cast<int>(index % shape.nheads_k);
      const SequenceRow row = sequence_row(index / shape.nheads_k, rows_per_batch,
                                           layout.cu_seqlens_k_new, shape.batch);
      if (row.batch < 0) continue;  // a row of k / v outside every sequence
      const int b = row.batch;
      const int64_t i = row.i;
      const int64_t pos = layout.end(b) + i;
      const T* k_row = k_src + row.tensor_batch * k_new_strides.batch +
                       row.tensor_row * k_new_strides.row + h * k_new_strides.head;
      const T* v_row = v_src + row.tensor_batch * v_new_strides.batch +
                       row.tensor_row * v_new_strides.row + h * v_new_strides.head;
      TC* k_out = k_dst + layout.offset(b, pos, h, k_cache_strides);
      TC* v_out = v_dst + layout.offset(b, pos, h, v_cache_strides);
      if (rotary.rotary_dim > 0) {
        // Rotary positions are absolute cache positions (left padding
        // included), or start at rotary_seqlens[b] when given (FA3). The
        // rotated key is rounded to T, what a cache of T would hold, before
        // an fp8 cache quantises it.
        const int64_t rotary_pos = layout.rotary_start(b) + i;
        copy_rotated(k_row, rotated.data(), shape.head_dim, cos + rotary_pos * half,
                     sin + rotary_pos * half, rotary.rotary_dim, rotary.interleaved);
        k_row = rotated.data();
      }
      store_cache_row(k_row, k_out, shape.head_dim, k_descale.at(b, h));
      store_cache_row(v_row, v_out, shape.head_dim, v_descale.at(b, h));
    }
  });
}

// q rotated at position start(b) + i when every row has its own position
// (causal or local), else at start(b) for all rows: without a window the rows
// of one step are treated as one position. start(b) is rotary_seqlens[b], or
// end(b) without it.
template <typename T>
at::Tensor rotate_q(const CacheLayout& layout, const at::Tensor& q, const Rotary& rotary,
                    bool per_row) {
  const KvcacheShape& shape = layout.shape;
  at::Tensor q_rotated = at::empty(q.sizes(), q.options());
  const RowStrides src_strides = strides_of(q);
  const RowStrides dst_strides = strides_of(q_rotated);
  const T* src = q.const_data_ptr<T>();
  T* dst = q_rotated.data_ptr<T>();
  const T* cos = static_cast<const T*>(rotary.cos);
  const T* sin = static_cast<const T*>(rotary.sin);
  const int64_t half = rotary.rotary_dim / 2;

  const int64_t rows_per_batch = layout.cu_seqlens_q ? 0 : shape.seqlen_q;
  const int64_t rows =
      (layout.cu_seqlens_q ? shape.total_q : int64_t(shape.batch) * shape.seqlen_q) * shape.nheads;
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index) {
      const int h = static_cast<int>(index % shape.nheads);
      const SequenceRow row =
          sequence_row(index / shape.nheads, rows_per_batch, layout.cu_seqlens_q, shape.batch);
      const int64_t src_offset = row.tensor_batch * src_strides.batch +
                                 row.tensor_row * src_strides.row + h * src_strides.head;
      const int64_t dst_offset = row.tensor_batch * dst_strides.batch +
                                 row.tensor_row * dst_strides.row + h * dst_strides.head;
      if (row.batch < 0) {
        // A row of q outside every sequence is never attended; copy it as is.
        for (int d = 0; d < shape.head_dim; ++d) dst[dst_offset + d] = src[src_offset + d];
        continue;
      }
      const int64_t pos = layout.rotary_start(row.batch) + (per_row ? row.i : 0);
      copy_rotated(src + src_offset, dst + dst_offset, shape.head_dim, cos + pos * half,
                   sin + pos * half, rotary.rotary_dim, rotary.interleaved);
    }
  });
  return q_rotated;
}

std::optional<at::Tensor> contiguous_or_none(const std::optional<at::Tensor>& t) {
  if (!t.has_value()) return std::nullopt;
  return t->contiguous();
}

template <typename F>
void dispatch_dtype(at::ScalarType dtype, F&& run) {
  switch (dtype) {
    case at::kFloat: run(float{}); break;
    case at::kHalf: run(c10::Half{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    default: TORCH_CHECK(false, "fwd_kvcache: unsupported dtype ", dtype);
  }
}

// fwd_kvcache and fwd_kvcache_out: the output goes into out_given when there
// is one, else into a new tensor.
std::tuple<at::Tensor, at::Tensor> fwd_kvcache_cpu_into(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v,
    const std::optional<at::Tensor>& cache_seqlens, const std::optional<at::Tensor>& rotary_cos,
    const std::optional<at::Tensor>& rotary_sin, const std::optional<at::Tensor>& cache_batch_idx,
    const std::optional<at::Tensor>& cache_leftpad, const std::optional<at::Tensor>& block_table,
    const std::optional<at::Tensor>& alibi_slopes, double softmax_scale, bool causal,
    int64_t window_size_left, int64_t window_size_right, double softcap, bool rotary_interleaved,
    int64_t num_splits, const std::optional<at::Tensor>& out_given,
    const std::optional<at::Tensor>& learnable_sink_in,
    const std::optional<at::Tensor>& rotary_seqlens, const KvcacheVarlenArgs& varlen,
    const Fp8Descales& descales) {
  (void)num_splits;  // a GPU work-partitioning knob; the CPU result never depends on it
  const Fp8Call fp8 = fp8_kvcache_call(q, k_cache, v_cache, descales);
  const KvcacheShape shape = check_fwd_kvcache_args(
      q, k_cache, v_cache, k, v, cache_seqlens, rotary_cos, rotary_sin, cache_batch_idx,
      cache_leftpad, block_table, rotary_seqlens, alibi_slopes, softmax_scale, softcap,
      {at::kFloat, at::kHalf, at::kBFloat16}, varlen);
  TORCH_CHECK(q.device().is_cpu(), "fwd_kvcache (CPU): q must be a CPU tensor, got ", q.device());
  if (fp8 != Fp8Call::kNone) {
    check_fp8_descales("fwd_kvcache", descales, q, shape.batch, shape.nheads_k);
    check_fp8_features("fwd_kvcache", 0.0, false, alibi_slopes);
  }
  const Fp8Descale k_descale = fp8_descale_view(descales.k);
  const Fp8Descale v_descale = fp8_descale_view(descales.v);
  const std::optional<at::Tensor> learnable_sink =
      check_learnable_sink("fwd_kvcache", learnable_sink_in, q, shape.nheads);
  const std::vector<int64_t> out_shape = kvcache_q_shape(shape, shape.head_dim_v);
  if (out_given.has_value()) {
    check_out_arg("fwd_kvcache", *out_given, q, out_shape, kvcache_q_layout(shape),
                  {&q, &k_cache, &v_cache, k ? &*k : nullptr, v ? &*v : nullptr});
  }
  // d_v < d_qk: the append and the attention use a zero-padded copy of
  // v_cache, whose new rows go back into v_cache after the append
  // (api/head_dims.h).
  const bool pad_v = shape.head_dim_v != shape.head_dim;
  const at::Tensor v_cache_attn = pad_head_dim(v_cache, shape.head_dim);
  const std::optional<at::Tensor> v_new =
      v.has_value() ? std::optional<at::Tensor>(pad_head_dim(*v, shape.head_dim)) : std::nullopt;

  // The window rule uses the cache capacity, as flash-attn does: a side that
  // reaches past the whole cache is unbounded.
  const Window window =
      normalize_window(causal, window_size_left, window_size_right, shape.cache_capacity);
  const bool rotary_q_per_row = window.left >= 0 || window.right >= 0;

  const std::optional<at::Tensor> seqlens_host = contiguous_or_none(cache_seqlens);
  const std::optional<at::Tensor> leftpad_host = contiguous_or_none(cache_leftpad);
  const std::optional<at::Tensor> batch_idx_host = contiguous_or_none(cache_batch_idx);
  const std::optional<at::Tensor> table_host = contiguous_or_none(block_table);
  const std::optional<at::Tensor> rotary_seqlens_host = contiguous_or_none(rotary_seqlens);
  const std::optional<at::Tensor> cu_q_host = contiguous_or_none(varlen.cu_seqlens_q);
  const std::optional<at::Tensor> cu_new_host = contiguous_or_none(varlen.cu_seqlens_k_new);
  check_kvcache_contents_host(shape, seqlens_host, batch_idx_host, leftpad_host, table_host,
                              rotary_seqlens_host, cu_q_host, cu_new_host, rotary_q_per_row);

  const CacheLayout layout{
      shape,
      seqlens_host ? seqlens_host->const_data_ptr<int32_t>() : nullptr,
      leftpad_host ? leftpad_host->const_data_ptr<int32_t>() : nullptr,
      batch_idx_host ? batch_idx_host->const_data_ptr<int32_t>() : nullptr,
      table_host ? table_host->const_data_ptr<int32_t>() : nullptr,
      table_host ? table_host->stride(0) : 0,
      rotary_seqlens_host ? rotary_seqlens_host->const_data_ptr<int32_t>() : nullptr,
      cu_q_host ? cu_q_host->const_data_ptr<int32_t>() : nullptr,
      cu_new_host ? cu_new_host->const_data_ptr<int32_t>() : nullptr};

  const std::optional<at::Tensor> cos_host = contiguous_or_none(rotary_cos);
  const std::optional<at::Tensor> sin_host = contiguous_or_none(rotary_sin);
  const Rotary rotary{cos_host ? cos_host->const_data_ptr() : nullptr,
                      sin_host ? sin_host->const_data_ptr() : nullptr, shape.rotary_dim,
                      rotary_interleaved};

  at::Tensor q_attended = q;
  dispatch_dtype(q.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    if (k.has_value() && shape.seqlen_new > 0) {
      if (fp8 == Fp8Call::kKvCache) {
        if constexpr (!std::is_same_v<T, float>) {  // fp8_kvcache_call: q is fp16 / bf16
          append_new_tokens<T, c10::Float8_e4m3fn>(layout, *k, *v_new, k_cache, v_cache_attn,
                                                   rotary, k_descale, v_descale);
        }
      } else {
        append_new_tokens<T, T>(layout, *k, *v_new, k_cache, v_cache_attn, rotary, k_descale,
                                v_descale);
      }
    }
    if (rotary.rotary_dim > 0 && shape.seqlen_q > 0) {
      q_attended = rotate_q<T>(layout, q, rotary, rotary_q_per_row);
    }
  });

  if (pad_v && k.has_value() && shape.seqlen_new > 0) {
    copy_appended_v_rows(v_cache, v_cache_attn, shape, *cache_seqlens, cache_batch_idx, block_table,
                         varlen.cu_seqlens_k_new);
  }

  at::Tensor out = pad_v ? at::empty(kvcache_q_shape(shape, shape.head_dim), q.options())
                         : (out_given.has_value() ? *out_given : at::empty(out_shape, q.options()));
  at::Tensor softmax_lse = at::empty(kvcache_lse_shape(shape), q.options().dtype(at::kFloat));
  // The first d_v columns of a padded problem's out, in the caller's out when given.
  auto result = [&]() -> at::Tensor {
    if (!pad_v) return out;
    const at::Tensor cropped = crop_head_dim(out, shape.head_dim_v);
    if (!out_given.has_value()) return cropped;
    out_given->copy_(cropped);
    return *out_given;
  };
  if (shape.varlen_q) {
    // The kernel writes each sequence's rows; rows of q outside every
    // sequence get out 0 and lse +inf, as varlen_fwd gives them.
    const int32_t* cu = layout.cu_seqlens_q;
    const int64_t first = cu[0], last = cu[shape.batch];
    if (first > 0 || last < shape.total_q) {
      softmax_lse.fill_(std::numeric_limits<float>::infinity());
      out.narrow(0, 0, first).zero_();
      out.narrow(0, last, shape.total_q - last).zero_();
    }
  }
  if (shape.seqlen_q == 0) return {result(), softmax_lse};

  const std::optional<at::Tensor> slopes = contiguous_or_none(alibi_slopes);

  AttentionProblem problem{};
  problem.dtype = q.scalar_type();
  problem.kv_dtype = k_cache.scalar_type();
  problem.k_descale = k_descale;
  problem.v_descale = v_descale;
  problem.nheads = shape.nheads;
  problem.nheads_k = shape.nheads_k;
  problem.head_dim = shape.head_dim;
  problem.sequences.reserve(shape.batch);
  for (int b = 0; b < shape.batch; ++b) {
    SequenceSpan span{};
    span.seqlen_q = static_cast<int>(layout.seqlen_q(b));
    // Keys are the filled rows from the left padding on, new tokens included.
    span.seqlen_k = static_cast<int>(layout.end(b) - layout.leftpad(b) + layout.seqlen_new(b));
    span.q_batch = shape.varlen_q ? 0 : b;
    span.q_first_row = shape.varlen_q ? layout.cu_seqlens_q[b] : 0;
    span.kv_batch = layout.cache_row(b);
    span.kv_first_row = layout.leftpad(b);
    span.block_table_row = layout.table_row(b);
    problem.sequences.push_back(span);
  }
  problem.q = q_attended.const_data_ptr();
  problem.q_strides = strides_of(q_attended);
  problem.k = k_cache.const_data_ptr();
  problem.k_strides = strides_of(k_cache);
  problem.v = v_cache_attn.const_data_ptr();
  problem.v_strides = strides_of(v_cache_attn);
  problem.page_size = shape.paged ? shape.page_size : 0;
  problem.softmax_scale = static_cast<float>(softmax_scale);
  problem.softcap = static_cast<float>(softcap);  // softcap_on decides
  problem.alibi_slopes = slopes ? slopes->const_data_ptr<float>() : nullptr;
  problem.alibi_batch_stride = slopes && slopes->dim() == 2 ? slopes->stride(0) : 0;
  problem.window_left = window.left;
  problem.window_right = window.right;
  problem.dropout_p = 0.f;
  problem.learnable_sink = learnable_sink ? learnable_sink->const_data_ptr<float>() : nullptr;

  ForwardOutputs outputs{};
  outputs.out = out.data_ptr();
  outputs.out_strides = strides_of(out);
  outputs.lse = softmax_lse.data_ptr<float>();
  outputs.lse_strides = shape.varlen_q ? RowStrides{0, softmax_lse.stride(1), softmax_lse.stride(0)}
                                       : RowStrides{softmax_lse.stride(0), softmax_lse.stride(2),
                                                    softmax_lse.stride(1)};
  outputs.probs = nullptr;

  attention_forward(problem, outputs);
  return {result(), softmax_lse};
}

std::tuple<at::Tensor, at::Tensor> fwd_kvcache_cpu(
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
  return fwd_kvcache_cpu_into(q, k_cache, v_cache, k, v, cache_seqlens, rotary_cos, rotary_sin,
                              cache_batch_idx, cache_leftpad, block_table, alibi_slopes,
                              softmax_scale, causal, window_size_left, window_size_right, softcap,
                              rotary_interleaved, num_splits, std::nullopt, learnable_sink,
                              rotary_seqlens, {cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q},
                              {q_descale, k_descale, v_descale});
}

at::Tensor fwd_kvcache_out_cpu(
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
  return std::get<1>(fwd_kvcache_cpu_into(
      q, k_cache, v_cache, k, v, cache_seqlens, rotary_cos, rotary_sin, cache_batch_idx,
      cache_leftpad, block_table, alibi_slopes, softmax_scale, causal, window_size_left,
      window_size_right, softcap, rotary_interleaved, num_splits, out, learnable_sink,
      rotary_seqlens, {cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q},
      {q_descale, k_descale, v_descale}));
}

}  // namespace
}  // namespace flash::cpu

TORCH_LIBRARY_IMPL(flash_attn, CPU, m) {
  m.impl("fwd_kvcache", &flash::cpu::fwd_kvcache_cpu);
  m.impl("fwd_kvcache_out", &flash::cpu::fwd_kvcache_out_cpu);
}
