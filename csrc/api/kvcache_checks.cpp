#include "api/kvcache_checks.h"

#include "api/checks.h"
#include "api/index_error_message.h"
#include "common/head_dim_bounds.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>
#include <sstream>
#include <string>
#include <utility>

namespace flash {
namespace {

std::string dtype_list(c10::ArrayRef<at::ScalarType> dtypes) {
  std::ostringstream text;
  for (size_t i = 0; i < dtypes.size(); ++i) {
    text << (i ? ", " : "") << c10::toString(dtypes[i]);
  }
  return text.str();
}

void check_on_device_of_q(const at::Tensor& t, const at::Tensor& q, const char* name) {
  TORCH_CHECK(t.device() == q.device(), "fwd_kvcache: ", name, " must be on the same device as q (",
              q.device(), "), got ", t.device());
}

void check_last_dim_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.stride(-1) == 1, "fwd_kvcache: ", name,
              " must have a contiguous last dimension (stride 1), got stride ", t.stride(-1));
}

void check_shape(const at::Tensor& t, c10::IntArrayRef expected, const char* name,
                 const char* layout) {
  TORCH_CHECK(t.sizes() == expected, "fwd_kvcache: ", name, " must have shape ", layout, " = ",
              expected, ", got ", t.sizes());
}

// v_cache / v: the shape of k_cache / k but for the last dim, d_v: a multiple
// of 8 in [8, d_qk] (the op contract's "Head dims").
void check_v_like_k(const at::Tensor& v, const at::Tensor& k, const char* v_name,
                    const char* k_name, int64_t head_dim) {
  TORCH_CHECK(
      v.dim() == k.dim() && v.sizes().slice(0, v.dim() - 1) == k.sizes().slice(0, k.dim() - 1),
      "fwd_kvcache: ", v_name, " must have shape (the shape of ", k_name,
      " but for its last dim, d_v) = (", k.sizes().slice(0, k.dim() - 1), ", d_v), got ",
      v.sizes());
  const int64_t head_dim_v = v.size(-1);
  TORCH_CHECK(head_dim_v <= head_dim, "fwd_kvcache: ", v_name, " must have shape (the shape of ",
              k_name, " but for its last dim, d_v): the head dim of ", v_name,
              " (d_v = ", head_dim_v, ") must not exceed the head dim of q and ", k_name,
              " (d_qk = ", head_dim, ")");
  TORCH_CHECK(head_dim_v >= 8 && head_dim_v % 8 == 0, "fwd_kvcache: the head dim of ", v_name,
              " (d_v = ", head_dim_v, ") must be a multiple of 8 in [8, d_qk = ", head_dim, "]");
}

// A per-batch int32 vector: cache_seqlens, cache_leftpad, cache_batch_idx.
void check_batch_vector(const std::optional<at::Tensor>& t, const at::Tensor& q, int batch,
                        const char* name) {
  if (!t.has_value()) return;
  TORCH_CHECK(t->scalar_type() == at::kInt, "fwd_kvcache: ", name,
              " must have dtype torch.int32, got ", t->scalar_type());
  check_on_device_of_q(*t, q, name);
  TORCH_CHECK(t->dim() == 1 && t->size(0) == batch, "fwd_kvcache: ", name,
              " must have shape (batch,) = (", batch, ",), got ", t->sizes());
}

// cu_seqlens_q / cu_seqlens_k_new: int32 (batch + 1,), contiguous, on q's device.
void check_cu_seqlens_arg(const at::Tensor& cu, const at::Tensor& q, const char* name,
                          const char* layout) {
  TORCH_CHECK(cu.scalar_type() == at::kInt, "fwd_kvcache: ", name,
              " must have dtype torch.int32, got ", cu.scalar_type());
  check_on_device_of_q(cu, q, name);
  TORCH_CHECK(cu.dim() == 1 && cu.size(0) >= 2, "fwd_kvcache: ", name, " must have shape ", layout,
              " with batch >= 1, got ", cu.sizes());
  TORCH_CHECK(cu.is_contiguous(), "fwd_kvcache: ", name, " must be contiguous, got strides ",
              cu.strides());
}

int checked_rows(int64_t rows, const char* what) {
  TORCH_CHECK(rows <= std::numeric_limits<int32_t>::max(), "fwd_kvcache: ", what, " (", rows,
              ") must be at most 2^31 - 1");
  return static_cast<int>(rows);
}

}  // namespace

std::vector<int64_t> kvcache_q_shape(const KvcacheShape& shape, int64_t head_dim) {
  if (shape.varlen_q) return {shape.total_q, shape.nheads, head_dim};
  return {shape.batch, shape.seqlen_q, shape.nheads, head_dim};
}

const char* kvcache_q_layout(const KvcacheShape& shape) {
  return shape.varlen_q ? "(total_q, nheads, head_dim_v)" : "(batch, seqlen_q, nheads, head_dim_v)";
}

std::vector<int64_t> kvcache_lse_shape(const KvcacheShape& shape) {
  if (shape.varlen_q) return {shape.nheads, shape.total_q};
  return {shape.batch, shape.nheads, shape.seqlen_q};
}

KvcacheShape check_fwd_kvcache_args(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v,
    const std::optional<at::Tensor>& cache_seqlens, const std::optional<at::Tensor>& rotary_cos,
    const std::optional<at::Tensor>& rotary_sin, const std::optional<at::Tensor>& cache_batch_idx,
    const std::optional<at::Tensor>& cache_leftpad, const std::optional<at::Tensor>& block_table,
    const std::optional<at::Tensor>& rotary_seqlens, const std::optional<at::Tensor>& alibi_slopes,
    double softmax_scale, double softcap, c10::ArrayRef<at::ScalarType> allowed_dtypes,
    const KvcacheVarlenArgs& varlen) {
  KvcacheShape shape{};

  // dtypes
  const auto dtype = q.scalar_type();
  TORCH_CHECK(
      std::find(allowed_dtypes.begin(), allowed_dtypes.end(), dtype) != allowed_dtypes.end(),
      "fwd_kvcache: q must have dtype one of ", dtype_list(allowed_dtypes), " on ",
      q.device().type(), ", got ", dtype);
  // An FP8 KV cache (float8_e4m3fn) is the other choice; fp8_kvcache_call
  // (api/fp8_checks.h) has checked its form before.
  for (const auto& [cache, name] :
       {std::pair{&k_cache, "k_cache"}, std::pair{&v_cache, "v_cache"}}) {
    TORCH_CHECK(cache->scalar_type() == dtype || cache->scalar_type() == at::kFloat8_e4m3fn,
                "fwd_kvcache: ", name, " must have the dtype of q (", dtype,
                ") or float8_e4m3fn (an FP8 KV cache), got ", cache->scalar_type());
  }
  check_on_device_of_q(k_cache, q, "k_cache");
  check_on_device_of_q(v_cache, q, "v_cache");

  // q, fixed-length or varlen (cu_seqlens_q + max_seqlen_q)
  shape.varlen_q = varlen.cu_seqlens_q.has_value();
  if (shape.varlen_q) {
    check_cu_seqlens_arg(*varlen.cu_seqlens_q, q, "cu_seqlens_q", "(batch + 1,)");
    TORCH_CHECK(varlen.max_seqlen_q.has_value(),
                "fwd_kvcache: max_seqlen_q must be given with cu_seqlens_q (the most query rows "
                "of any sequence)");
    TORCH_CHECK(q.dim() == 3,
                "fwd_kvcache: with cu_seqlens_q, q must be 3-D (total_q, nheads, head_dim), got ",
                q.dim(), "-D with shape ", q.sizes());
    shape.batch = checked_rows(varlen.cu_seqlens_q->size(0) - 1, "the batch of cu_seqlens_q");
    shape.total_q = checked_rows(q.size(0), "total_q (rows of q)");
    // A bound, not a count: an engine may pass the largest step it captured.
    TORCH_CHECK(*varlen.max_seqlen_q >= 0 && *varlen.max_seqlen_q <= (1 << 30),
                "fwd_kvcache: max_seqlen_q must be in [0, 2^30], got ", *varlen.max_seqlen_q);
    shape.seqlen_q = static_cast<int>(*varlen.max_seqlen_q);
    shape.nheads = static_cast<int>(q.size(1));
    shape.head_dim = static_cast<int>(q.size(2));
  } else {
    TORCH_CHECK(!varlen.max_seqlen_q.has_value(),
                "fwd_kvcache: max_seqlen_q needs cu_seqlens_q (it bounds the varlen query rows)");
    TORCH_CHECK(q.dim() == 4,
                "fwd_kvcache: q must be 4-D (batch, seqlen_q, nheads, head_dim), got ", q.dim(),
                "-D with shape ", q.sizes());
    shape.batch = static_cast<int>(q.size(0));
    shape.seqlen_q = static_cast<int>(q.size(1));
    shape.nheads = static_cast<int>(q.size(2));
    shape.head_dim = static_cast<int>(q.size(3));
  }
  TORCH_CHECK(shape.batch > 0, "fwd_kvcache: q must have batch > 0, got shape ", q.sizes());
  TORCH_CHECK(shape.nheads > 0, "fwd_kvcache: q must have nheads > 0, got shape ", q.sizes());
  const int max_dim = max_kvcache_head_dim(q.is_cuda());
  TORCH_CHECK(shape.head_dim % 8 == 0 && shape.head_dim > 0 && shape.head_dim <= max_dim,
              "fwd_kvcache: head_dim (last dim of q) must be a positive multiple of 8 and at most ",
              max_dim, " on ",
              q.is_cuda() ? "CUDA (larger head dims run on the CPU path only)" : "the CPU",
              ", got ", shape.head_dim);
  check_last_dim_contiguous(q, "q");

  // cache, contiguous or paged
  TORCH_CHECK(k_cache.dim() == 4, "fwd_kvcache: k_cache must be 4-D, got ", k_cache.dim(),
              "-D with shape ", k_cache.sizes());
  shape.nheads_k = static_cast<int>(k_cache.size(2));
  TORCH_CHECK(shape.nheads_k > 0 && shape.nheads % shape.nheads_k == 0,
              "fwd_kvcache: nheads of q (", shape.nheads,
              ") must be a multiple of nheads_k of k_cache (", shape.nheads_k, ")");
  shape.paged = block_table.has_value();
  if (shape.paged) {
    TORCH_CHECK(block_table->scalar_type() == at::kInt,
                "fwd_kvcache: block_table must have dtype torch.int32, got ",
                block_table->scalar_type());
    check_on_device_of_q(*block_table, q, "block_table");
    // With cache_batch_idx, batch entry b uses block_table row
    // cache_batch_idx[b] (FA3's kv_batch_idx indexes the page table), so the
    // table may hold any number of sequences; without it, row b.
    if (cache_batch_idx.has_value()) {
      TORCH_CHECK(block_table->dim() == 2 && block_table->size(0) >= 1,
                  "fwd_kvcache: block_table must have shape (table_rows, max_blocks_per_seq) with "
                  "table_rows >= 1 (cache_batch_idx selects its rows), got ",
                  block_table->sizes());
    } else {
      TORCH_CHECK(
          block_table->dim() == 2 && block_table->size(0) == shape.batch,
          "fwd_kvcache: block_table must have shape (batch, max_blocks_per_seq) with batch = ",
          shape.batch, ", got ", block_table->sizes());
    }
    shape.num_blocks = static_cast<int>(k_cache.size(0));
    shape.page_size = static_cast<int>(k_cache.size(1));
    shape.max_blocks_per_seq = static_cast<int>(block_table->size(1));
    TORCH_CHECK(shape.page_size > 0,
                "fwd_kvcache: with block_table, k_cache must be paged (num_blocks, page_size, "
                "nheads_k, head_dim) with page_size >= 1, got ",
                k_cache.sizes());
    TORCH_CHECK(shape.num_blocks > 0,
                "fwd_kvcache: with block_table, k_cache must hold at least one page, got ",
                k_cache.sizes());
    check_shape(k_cache, {shape.num_blocks, shape.page_size, shape.nheads_k, shape.head_dim},
                "k_cache", "(num_blocks, page_size, nheads_k, head_dim of q)");
    check_v_like_k(v_cache, k_cache, "v_cache", "k_cache", shape.head_dim);
    shape.cache_capacity = shape.max_blocks_per_seq * shape.page_size;
    shape.batch_cache = static_cast<int>(block_table->size(0));
  } else {
    shape.batch_cache = static_cast<int>(k_cache.size(0));
    shape.cache_capacity = static_cast<int>(k_cache.size(1));
    check_shape(k_cache, {shape.batch_cache, shape.cache_capacity, shape.nheads_k, shape.head_dim},
                "k_cache", "(batch_cache, seqlen_cache, nheads_k, head_dim of q)");
    check_v_like_k(v_cache, k_cache, "v_cache", "k_cache", shape.head_dim);
    if (!cache_batch_idx.has_value()) {
      TORCH_CHECK(shape.batch_cache >= shape.batch,
                  "fwd_kvcache: k_cache must hold at least "
                  "batch = ",
                  shape.batch, " sequences when cache_batch_idx is not given, got ",
                  shape.batch_cache);
    }
  }
  check_last_dim_contiguous(k_cache, "k_cache");
  check_last_dim_contiguous(v_cache, "v_cache");
  // The caches agree on every dim but the last (above), so the same address
  // and strides make v_cache a column slice of k_cache.
  shape.v_in_k = v_cache.data_ptr() == k_cache.data_ptr() && v_cache.strides() == k_cache.strides();

  // per-batch index vectors
  check_batch_vector(cache_seqlens, q, shape.batch, "cache_seqlens");
  check_batch_vector(cache_leftpad, q, shape.batch, "cache_leftpad");
  check_batch_vector(cache_batch_idx, q, shape.batch, "cache_batch_idx");
  check_batch_vector(rotary_seqlens, q, shape.batch, "rotary_seqlens");

  // new keys / values
  TORCH_CHECK(k.has_value() == v.has_value(),
              "fwd_kvcache: k and v (the new tokens to append) must be given together, got ",
              k.has_value() ? "k without v" : "v without k");
  shape.seqlen_new = 0;
  shape.varlen_new = varlen.cu_seqlens_k_new.has_value();
  TORCH_CHECK(!shape.varlen_new || k.has_value(),
              "fwd_kvcache: cu_seqlens_k_new needs k / v (it gives each sequence's rows of them), "
              "got k = None");
  if (k.has_value()) {
    TORCH_CHECK(cache_seqlens.has_value(),
                "fwd_kvcache: cache_seqlens must be given with k / v (it says where to append)");
    TORCH_CHECK(k->scalar_type() == dtype, "fwd_kvcache: k must have the dtype of q (", dtype,
                "), got ", k->scalar_type());
    TORCH_CHECK(v->scalar_type() == dtype, "fwd_kvcache: v must have the dtype of q (", dtype,
                "), got ", v->scalar_type());
    check_on_device_of_q(*k, q, "k");
    check_on_device_of_q(*v, q, "v");
    if (shape.varlen_new) {
      check_cu_seqlens_arg(*varlen.cu_seqlens_k_new, q, "cu_seqlens_k_new", "(batch + 1,)");
      TORCH_CHECK(varlen.cu_seqlens_k_new->size(0) == shape.batch + 1,
                  "fwd_kvcache: cu_seqlens_k_new must have shape (batch + 1,) = (", shape.batch + 1,
                  ",), got ", varlen.cu_seqlens_k_new->sizes());
      TORCH_CHECK(k->dim() == 3,
                  "fwd_kvcache: with cu_seqlens_k_new, k must be 3-D (total_k_new, nheads_k, "
                  "head_dim), got shape ",
                  k->sizes());
      shape.seqlen_new = checked_rows(k->size(0), "total_k_new (rows of k)");
      check_shape(*k, {shape.seqlen_new, shape.nheads_k, shape.head_dim}, "k",
                  "(total_k_new, nheads_k, head_dim)");
    } else {
      TORCH_CHECK(k->dim() == 4,
                  "fwd_kvcache: k must be 4-D (batch, seqlen_new, nheads_k, "
                  "head_dim), got shape ",
                  k->sizes(),
                  " (a varlen k of (total_k_new, nheads_k, head_dim) needs "
                  "cu_seqlens_k_new)");
      shape.seqlen_new = static_cast<int>(k->size(1));
      check_shape(*k, {shape.batch, shape.seqlen_new, shape.nheads_k, shape.head_dim}, "k",
                  "(batch, seqlen_new, nheads_k, head_dim)");
    }
    check_v_like_k(*v, *k, "v", "k", shape.head_dim);
    TORCH_CHECK(v->size(-1) == v_cache.size(-1),
                "fwd_kvcache: v must have the head dim of v_cache (", v_cache.size(-1), "), got ",
                v->size(-1));
    check_last_dim_contiguous(*k, "k");
    check_last_dim_contiguous(*v, "v");
    // Absorbed MLA's cache: v_cache is k_cache's first d_v columns (same
    // memory, same strides). An append writes k's rows and v's into the
    // same bytes, so v must be k's first d_v columns too, and k's rotation
    // (of its first rotary_dim columns) would leave v's copy unrotated.
    if (shape.v_in_k && shape.seqlen_new > 0) {
      TORCH_CHECK(v->data_ptr() == k->data_ptr() && v->strides() == k->strides(),
                  "fwd_kvcache: v_cache is k_cache's first ", v_cache.size(-1),
                  " columns (the same memory), so an append writes k and v into the same "
                  "bytes: v must be k[..., :",
                  v_cache.size(-1), "] (the same memory), got another tensor");
      TORCH_CHECK(!rotary_cos.has_value(), "fwd_kvcache: v_cache is k_cache's first ",
                  v_cache.size(-1),
                  " columns (the same memory): rotary_cos / rotary_sin would rotate the appended "
                  "keys but not the same columns of v; rotate k before the call instead");
    }
    TORCH_CHECK(shape.seqlen_q <= shape.cache_capacity, "fwd_kvcache: with k / v, seqlen_q (",
                shape.seqlen_q, ") must be at most the cache length (", shape.cache_capacity, ")");
    // Varlen new keys: each sequence's count is checked with its values.
    TORCH_CHECK(shape.varlen_new || shape.seqlen_new <= shape.cache_capacity, "fwd_kvcache: k has ",
                shape.seqlen_new, " new tokens, more than the cache holds (", shape.cache_capacity,
                ")");
  }

  // rotary embedding of the new keys and of q
  shape.rotary_dim = 0;
  shape.seqlen_rotary = 0;
  TORCH_CHECK(rotary_cos.has_value() == rotary_sin.has_value(),
              "fwd_kvcache: rotary_cos and rotary_sin must be given together");
  TORCH_CHECK(!rotary_seqlens.has_value() || rotary_cos.has_value(),
              "fwd_kvcache: rotary_seqlens needs rotary_cos / rotary_sin (it gives the positions "
              "at which they rotate q and the new keys)");
  if (rotary_cos.has_value()) {
    TORCH_CHECK(k.has_value(),
                "fwd_kvcache: rotary_cos / rotary_sin need k / v (the rotary "
                "embedding is applied to the appended keys and to q)");
    const at::Tensor& cos = *rotary_cos;
    const at::Tensor& sin = *rotary_sin;
    TORCH_CHECK(cos.dim() == 2,
                "fwd_kvcache: rotary_cos must be 2-D (seqlen_ro, rotary_dim / 2), "
                "got shape ",
                cos.sizes());
    check_shape(sin, cos.sizes(), "rotary_sin", "(the shape of rotary_cos)");
    TORCH_CHECK(cos.scalar_type() == dtype, "fwd_kvcache: rotary_cos must have the dtype of q (",
                dtype, "), got ", cos.scalar_type());
    TORCH_CHECK(sin.scalar_type() == dtype, "fwd_kvcache: rotary_sin must have the dtype of q (",
                dtype, "), got ", sin.scalar_type());
    check_on_device_of_q(cos, q, "rotary_cos");
    check_on_device_of_q(sin, q, "rotary_sin");
    shape.seqlen_rotary = static_cast<int>(cos.size(0));
    shape.rotary_dim = static_cast<int>(cos.size(1)) * 2;
    TORCH_CHECK(shape.rotary_dim > 0 && shape.rotary_dim <= shape.head_dim,
                "fwd_kvcache: rotary_dim (2 * rotary_cos.size(1) = ", shape.rotary_dim,
                ") must be in [2, head_dim = ", shape.head_dim, "]");
    TORCH_CHECK(shape.seqlen_rotary >= shape.cache_capacity,
                "fwd_kvcache: rotary_cos / rotary_sin must have at least as many rows as the cache "
                "length (",
                shape.cache_capacity, "), got ", shape.seqlen_rotary);
  }

  // ALiBi
  if (alibi_slopes.has_value()) {
    const at::Tensor& slopes = *alibi_slopes;
    TORCH_CHECK(slopes.scalar_type() == at::kFloat,
                "fwd_kvcache: alibi_slopes must have dtype torch.float32, got ",
                slopes.scalar_type());
    check_on_device_of_q(slopes, q, "alibi_slopes");
    const bool per_head = slopes.dim() == 1 && slopes.size(0) == shape.nheads;
    const bool per_batch_head =
        slopes.dim() == 2 && slopes.size(0) == shape.batch && slopes.size(1) == shape.nheads;
    TORCH_CHECK(per_head || per_batch_head,
                "fwd_kvcache: alibi_slopes must have shape (nheads,) = (", shape.nheads,
                ",) or (batch, nheads) = (", shape.batch, ", ", shape.nheads, "), got ",
                slopes.sizes());
    check_last_dim_contiguous(slopes, "alibi_slopes");
  }

  TORCH_CHECK(softmax_scale == softmax_scale, "fwd_kvcache: softmax_scale must not be NaN");
  TORCH_CHECK(softcap == softcap, "fwd_kvcache: softcap must not be NaN");
  shape.head_dim_v = static_cast<int>(v_cache.size(-1));
  return shape;
}

void check_kvcache_contents_host(
    const KvcacheShape& shape, const std::optional<at::Tensor>& cache_seqlens,
    const std::optional<at::Tensor>& cache_batch_idx,
    const std::optional<at::Tensor>& cache_leftpad, const std::optional<at::Tensor>& block_table,
    const std::optional<at::Tensor>& rotary_seqlens, const std::optional<at::Tensor>& cu_seqlens_q,
    const std::optional<at::Tensor>& cu_seqlens_k_new, bool rotary_q_per_row) {
  auto host_ints = [](const std::optional<at::Tensor>& t) -> at::Tensor {
    if (!t.has_value()) return at::Tensor();
    TORCH_CHECK(t->device().is_cpu(), "check_kvcache_contents_host needs CPU tensors");
    return t->contiguous();
  };
  const at::Tensor seqlens = host_ints(cache_seqlens);
  const at::Tensor batch_idx = host_ints(cache_batch_idx);
  const at::Tensor leftpad = host_ints(cache_leftpad);
  const at::Tensor table = host_ints(block_table);
  const at::Tensor rotary_starts = host_ints(rotary_seqlens);
  const at::Tensor cu_q = host_ints(cu_seqlens_q);
  const at::Tensor cu_new = host_ints(cu_seqlens_k_new);

  const IndexOp op = IndexOp::kKvcache;
  if (cu_q.defined()) {
    check_cu_seqlens_host(cu_q, shape.total_q, shape.seqlen_q, IndexArg::kCuSeqlensQ, op);
  }
  if (cu_new.defined()) {
    check_cu_seqlens_host(cu_new, shape.seqlen_new, std::numeric_limits<int32_t>::max(),
                          IndexArg::kCuSeqlensKNew, op);
  }
  // Rows sequence b appends / attends with: varlen from the offsets (checked above).
  auto rows_of = [](const at::Tensor& cu, int b, int fixed) -> int64_t {
    return cu.defined() ? int64_t(cu.data_ptr<int32_t>()[b + 1]) - cu.data_ptr<int32_t>()[b]
                        : fixed;
  };
  const int64_t paged = shape.paged ? 1 : 0;
  for (int b = 0; b < shape.batch; ++b) {
    const int64_t seqlen_new = rows_of(cu_new, b, shape.seqlen_new);
    const int64_t seqlen_q = rows_of(cu_q, b, shape.seqlen_q);
    const int64_t end = seqlens.defined() ? seqlens.data_ptr<int32_t>()[b] : shape.cache_capacity;
    if (end < 0 || end > shape.cache_capacity) {
      raise_index_error(index_error(IndexRule::kCacheSeqlen, IndexArg::kCacheSeqlens, op, b, paged,
                                    end, shape.cache_capacity));
    }
    if (end + seqlen_new > shape.cache_capacity) {
      raise_index_error(index_error(IndexRule::kAppendPastCache, IndexArg::kCacheSeqlens, op, b,
                                    paged, end, shape.cache_capacity, seqlen_new));
    }
    const int64_t pad = leftpad.defined() ? leftpad.data_ptr<int32_t>()[b] : 0;
    if (pad < 0 || pad > end) {
      raise_index_error(
          index_error(IndexRule::kLeftpad, IndexArg::kCacheLeftpad, op, b, 0, pad, end));
    }
    const int64_t entry = batch_idx.defined() ? batch_idx.data_ptr<int32_t>()[b] : b;
    if (entry < 0 || entry >= shape.batch_cache) {
      raise_index_error(index_error(IndexRule::kCacheBatchIdx, IndexArg::kCacheBatchIdx, op, b,
                                    paged, entry, shape.batch_cache));
    }
    if (table.defined()) {
      // Only the pages of rows [leftpad, end + seqlen_new) are read or
      // written: the pages before the left padding may hold anything.
      const int64_t first_page = pad / shape.page_size;
      const int64_t used_pages = (end + seqlen_new + shape.page_size - 1) / shape.page_size;
      const int32_t* pages = table.data_ptr<int32_t>() + entry * table.stride(0);
      for (int64_t p = first_page; p < used_pages; ++p) {
        if (pages[p] < 0 || pages[p] >= shape.num_blocks) {
          raise_index_error(index_error(IndexRule::kPageOutOfPool, IndexArg::kBlockTable, op, entry,
                                        p, pages[p], shape.num_blocks));
        }
      }
    }
    if (shape.rotary_dim > 0) {
      const int64_t start = rotary_starts.defined() ? rotary_starts.data_ptr<int32_t>()[b] : end;
      if (start < 0) {
        raise_index_error(
            index_error(IndexRule::kRotarySeqlen, IndexArg::kRotarySeqlens, op, b, 0, start, 0));
      }
      const int64_t last_key = start + seqlen_new - 1;
      const int64_t last_query = rotary_q_per_row ? start + seqlen_q - 1 : start;
      const int64_t last_position = std::max(last_key, last_query);
      if (last_position >= shape.seqlen_rotary) {
        raise_index_error(index_error(IndexRule::kRotaryPosition, IndexArg::kRotaryTables, op, b,
                                      rotary_starts.defined() ? 1 : 0, last_position,
                                      shape.seqlen_rotary, start));
      }
    }
  }
}

}  // namespace flash
