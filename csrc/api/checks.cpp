#include "api/checks.h"

#include "api/index_error_message.h"
#include "common/head_dim_bounds.h"

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>

#include <limits>
#include <sstream>
#include <string>
#include <vector>

namespace flash {
namespace {

std::string dtype_list(c10::ArrayRef<at::ScalarType> allowed) {
  std::ostringstream os;
  for (size_t i = 0; i < allowed.size(); ++i) {
    if (i > 0) os << (i + 1 == allowed.size() ? " or " : ", ");
    os << allowed[i];
  }
  return os.str();
}

void check_dtype_allowed(const at::Tensor& t, const char* name,
                         c10::ArrayRef<at::ScalarType> allowed) {
  for (auto dtype : allowed) {
    if (t.scalar_type() == dtype) return;
  }
  TORCH_CHECK(false, "flash_attn: ", name, " must have dtype ", dtype_list(allowed), " on ",
              t.device().type(), ", got ", t.scalar_type());
}

void check_same_dtype(const at::Tensor& t, const char* name, const at::Tensor& q) {
  TORCH_CHECK(t.scalar_type() == q.scalar_type(), "flash_attn: ", name,
              " must have the same dtype as q (", q.scalar_type(), "), got ", t.scalar_type());
}

// k or v: q's dtype, or float8_e4m3fn under a float16 / bfloat16 q (an FP8
// KV cache, which fp8_attention_call has classified before the shape checks).
void check_kv_dtype(const at::Tensor& t, const char* name, const at::Tensor& q) {
  const bool fp8_cache = t.scalar_type() == at::kFloat8_e4m3fn &&
                         (q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16);
  if (!fp8_cache) check_same_dtype(t, name, q);
}

void check_same_device(const at::Tensor& t, const char* name, const at::Tensor& q) {
  TORCH_CHECK(t.device() == q.device(), "flash_attn: ", name, " must be on the same device as q (",
              q.device(), "), got ", t.device());
}

void check_last_dim_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.numel() == 0 || t.stride(-1) == 1, "flash_attn: ", name,
              " must have a contiguous last dimension (stride 1), got stride ", t.stride(-1));
}

void check_dim(const at::Tensor& t, const char* name, int64_t dim, const char* layout) {
  TORCH_CHECK(t.dim() == dim, "flash_attn: ", name, " must be a ", dim, "-D tensor ", layout,
              ", got shape ", t.sizes());
}

int checked_int(int64_t value, const char* what) {
  TORCH_CHECK(value <= std::numeric_limits<int>::max(), "flash_attn: ", what, " = ", value,
              " is too large (must fit in int32)");
  return static_cast<int>(value);
}

// The backward's bound (common/head_dim_bounds.h): the forward's on CUDA.
void check_bwd_head_dim(int64_t head_dim, const at::Tensor& q) {
  const int bound = max_bwd_head_dim(q.is_cuda());
  TORCH_CHECK(head_dim <= bound, "flash_attn: the backward of head dimension ", head_dim,
              " is not built on ", q.is_cuda() ? "CUDA" : "the CPU",
              ": the head dimension (last dim of q) must be at most ", bound,
              " for the backward, got ", head_dim);
}

// The forward's bound of q's device (common/head_dim_bounds.h).
void check_head_dim(int64_t head_dim, const at::Tensor& q) {
  const int bound = max_head_dim(q.is_cuda());
  TORCH_CHECK(head_dim >= 8 && head_dim <= bound && head_dim % 8 == 0,
              "flash_attn: head dimension (last dim of q) must be a multiple of 8 in [8, ", bound,
              "] on ", q.is_cuda() ? "CUDA (larger head dims run on the CPU path only)" : "the CPU",
              ", got ", head_dim);
}

// v has k's shape but for its last dim, d_v: a multiple of 8 in [8, d_qk]
// (the op contract's "Head dims").
int64_t check_v_shape(const at::Tensor& v, const at::Tensor& k, int64_t head_dim) {
  const int64_t head_dim_v = v.size(-1);
  TORCH_CHECK(head_dim_v <= head_dim, "flash_attn: the head dim of v (d_v = ", head_dim_v,
              ") must not exceed the head dim of q and k (d_qk = ", head_dim, ")");
  TORCH_CHECK(head_dim_v >= 8 && head_dim_v % 8 == 0,
              "flash_attn: the head dim of v (d_v = ", head_dim_v,
              ") must be a multiple of 8 in [8, d_qk = ", head_dim, "]");
  TORCH_CHECK(v.sizes().slice(0, v.dim() - 1) == k.sizes().slice(0, k.dim() - 1),
              "flash_attn: v must have the shape of k (", k.sizes(),
              ") but for its last dim (d_v), got ", v.sizes());
  return head_dim_v;
}

void check_heads(int64_t nheads, int64_t nheads_k) {
  TORCH_CHECK(nheads_k >= 1, "flash_attn: k and v must have at least one head, got ", nheads_k);
  TORCH_CHECK(nheads % nheads_k == 0, "flash_attn: the number of heads of q (", nheads,
              ") must be divisible by the number of heads of k and v (", nheads_k, ")");
}

void check_scalars(double dropout_p, double softcap) {
  // The kernels hold dropout_p as float32: it must stay below 1 after rounding.
  TORCH_CHECK(dropout_p >= 0.0 && static_cast<float>(dropout_p) < 1.0f,
              "flash_attn: dropout_p must be in [0, 1), got ", dropout_p);
  TORCH_CHECK(softcap >= 0.0, "flash_attn: softcap must be >= 0 (0 disables it), got ", softcap);
}

void check_window_arg(int64_t window, const char* name) {
  // Any negative value means unbounded; only guard against values that cannot
  // be represented once normalised.
  TORCH_CHECK(window >= std::numeric_limits<int>::min(), "flash_attn: ", name, " = ", window,
              " is out of range");
}

void check_alibi(const std::optional<at::Tensor>& alibi_slopes, const at::Tensor& q, int64_t batch,
                 int64_t nheads) {
  if (!alibi_slopes.has_value()) return;
  const at::Tensor& slopes = *alibi_slopes;
  TORCH_CHECK(slopes.scalar_type() == at::kFloat,
              "flash_attn: alibi_slopes must have dtype float32, got ", slopes.scalar_type());
  check_same_device(slopes, "alibi_slopes", q);
  const bool per_head = slopes.dim() == 1 && slopes.size(0) == nheads;
  const bool per_batch_head =
      slopes.dim() == 2 && slopes.size(0) == batch && slopes.size(1) == nheads;
  TORCH_CHECK(per_head || per_batch_head, "flash_attn: alibi_slopes must have shape (nheads) = (",
              nheads, ") or (batch, nheads) = (", batch, ", ", nheads, "), got ", slopes.sizes());
  TORCH_CHECK(slopes.numel() == 0 || slopes.stride(-1) == 1,
              "flash_attn: alibi_slopes must have a contiguous last dimension");
}

void check_rng_state(const std::optional<at::Tensor>& rng_state) {
  if (!rng_state.has_value()) return;
  TORCH_CHECK(rng_state->scalar_type() == at::kLong,
              "flash_attn: rng_state must have dtype int64, got ", rng_state->scalar_type());
  TORCH_CHECK(rng_state->numel() == 2,
              "flash_attn: rng_state must hold 2 elements [seed, offset], got shape ",
              rng_state->sizes());
}

void check_cu_seqlens(const at::Tensor& cu, const char* name, const at::Tensor& q) {
  TORCH_CHECK(cu.scalar_type() == at::kInt, "flash_attn: ", name, " must have dtype int32, got ",
              cu.scalar_type());
  check_same_device(cu, name, q);
  TORCH_CHECK(cu.dim() == 1, "flash_attn: ", name, " must be 1-D (batch + 1), got shape ",
              cu.sizes());
  TORCH_CHECK(cu.numel() >= 1, "flash_attn: ", name,
              " must hold batch + 1 >= 1 entries, got an empty tensor");
  TORCH_CHECK(cu.is_contiguous(), "flash_attn: ", name, " must be contiguous");
}

void check_max_seqlen(int64_t max_seqlen, const char* name) {
  // 0 is legal: every sequence of the batch may be empty.
  TORCH_CHECK(max_seqlen >= 0, "flash_attn: ", name, " must be >= 0, got ", max_seqlen);
  checked_int(max_seqlen, name);
}

// seqused_k or seqused_q: int32 (batch,) on q's device.
void check_seqused(const std::optional<at::Tensor>& seqused, const char* name, const at::Tensor& q,
                   int64_t batch) {
  if (!seqused.has_value()) return;
  const at::Tensor& used = *seqused;
  TORCH_CHECK(used.scalar_type() == at::kInt, "flash_attn: ", name, " must have dtype int32, got ",
              used.scalar_type());
  check_same_device(used, name, q);
  TORCH_CHECK(used.dim() == 1 && used.size(0) == batch, "flash_attn: ", name,
              " must have shape (batch,) = (", batch, ",), got ", used.sizes());
}

// q (…, nheads, head_dim) against k and v; returns nothing, shapes are read by the callers.
void check_qkv_common(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      c10::ArrayRef<at::ScalarType> allowed_dtypes) {
  check_dtype_allowed(q, "q", allowed_dtypes);
  check_kv_dtype(k, "k", q);
  check_kv_dtype(v, "v", q);
  check_same_device(k, "k", q);
  check_same_device(v, "v", q);
  check_last_dim_contiguous(q, "q");
  check_last_dim_contiguous(k, "k");
  check_last_dim_contiguous(v, "v");
}

// dout and out: q's shape with the head dim of v.
void check_grad_io(const at::Tensor& dout, const at::Tensor& out, const at::Tensor& q,
                   int64_t head_dim_v) {
  check_same_dtype(dout, "dout", q);
  check_same_dtype(out, "out", q);
  check_same_device(dout, "dout", q);
  check_same_device(out, "out", q);
  std::vector<int64_t> expected(q.sizes().begin(), q.sizes().end());
  expected.back() = head_dim_v;
  TORCH_CHECK(dout.sizes() == at::IntArrayRef(expected),
              "flash_attn: dout must have the shape of q with the head dim of v (", expected,
              "), got ", dout.sizes());
  TORCH_CHECK(out.sizes() == at::IntArrayRef(expected),
              "flash_attn: out must have the shape of q with the head dim of v (", expected,
              "), got ", out.sizes());
  check_last_dim_contiguous(dout, "dout");
  check_last_dim_contiguous(out, "out");
}

void check_lse(const at::Tensor& lse, const at::Tensor& q, at::IntArrayRef expected,
               const char* layout) {
  TORCH_CHECK(lse.scalar_type() == at::kFloat,
              "flash_attn: softmax_lse must have dtype float32, got ", lse.scalar_type());
  check_same_device(lse, "softmax_lse", q);
  TORCH_CHECK(lse.sizes() == expected, "flash_attn: softmax_lse must have shape ", layout, " = ",
              expected, ", got ", lse.sizes());
}

void check_backward_dropout(double dropout_p, const std::optional<at::Tensor>& rng_state) {
  TORCH_CHECK(dropout_p == 0.0 || rng_state.has_value(),
              "flash_attn: rng_state (the one returned by the forward) is required when "
              "dropout_p > 0");
}

}  // namespace

FwdShape check_fwd_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const std::optional<at::Tensor>& alibi_slopes, double dropout_p,
                        double softmax_scale, int64_t window_size_left, int64_t window_size_right,
                        double softcap, const std::optional<at::Tensor>& rng_state,
                        c10::ArrayRef<at::ScalarType> allowed_dtypes) {
  (void)softmax_scale;  // any value is meaningful, including negative ones
  constexpr const char* kLayout = "(batch, seqlen, nheads, head_dim)";
  check_dim(q, "q", 4, kLayout);
  check_dim(k, "k", 4, kLayout);
  check_dim(v, "v", 4, kLayout);
  check_qkv_common(q, k, v, allowed_dtypes);

  const int64_t batch = q.size(0), seqlen_q = q.size(1), nheads = q.size(2), head_dim = q.size(3);
  const int64_t seqlen_k = k.size(1), nheads_k = k.size(2);
  check_head_dim(head_dim, q);
  TORCH_CHECK(k.size(0) == batch && k.size(3) == head_dim,
              "flash_attn: k must have shape (batch, seqlen_k, nheads_k, head_dim) with batch = ",
              batch, " and head_dim = ", head_dim, " as in q, got ", k.sizes());
  const int64_t head_dim_v = check_v_shape(v, k, head_dim);
  check_heads(nheads, nheads_k);
  check_scalars(dropout_p, softcap);
  check_window_arg(window_size_left, "window_size_left");
  check_window_arg(window_size_right, "window_size_right");
  check_alibi(alibi_slopes, q, batch, nheads);
  check_rng_state(rng_state);

  return {checked_int(batch, "batch"),       checked_int(seqlen_q, "seqlen_q"),
          checked_int(seqlen_k, "seqlen_k"), checked_int(nheads, "nheads"),
          checked_int(nheads_k, "nheads_k"), static_cast<int>(head_dim),
          static_cast<int>(head_dim_v)};
}

FwdShape check_bwd_args(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v, const at::Tensor& out, const at::Tensor& softmax_lse,
                        const std::optional<at::Tensor>& alibi_slopes, double dropout_p,
                        double softmax_scale, int64_t window_size_left, int64_t window_size_right,
                        double softcap, const std::optional<at::Tensor>& rng_state,
                        c10::ArrayRef<at::ScalarType> allowed_dtypes) {
  const FwdShape shape =
      check_fwd_args(q, k, v, alibi_slopes, dropout_p, softmax_scale, window_size_left,
                     window_size_right, softcap, rng_state, allowed_dtypes);
  check_bwd_head_dim(shape.head_dim, q);
  check_grad_io(dout, out, q, shape.head_dim_v);
  check_lse(softmax_lse, q, {shape.batch, shape.nheads, shape.seqlen_q},
            "(batch, nheads, seqlen_q)");
  check_backward_dropout(dropout_p, rng_state);
  return shape;
}

VarlenShape check_varlen_fwd_args(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, const std::optional<at::Tensor>& block_table,
    const std::optional<at::Tensor>& seqused_k, const std::optional<at::Tensor>& seqused_q,
    const std::optional<at::Tensor>& alibi_slopes, int64_t max_seqlen_q, int64_t max_seqlen_k,
    double dropout_p, double softmax_scale, int64_t window_size_left, int64_t window_size_right,
    double softcap, const std::optional<at::Tensor>& rng_state,
    c10::ArrayRef<at::ScalarType> allowed_dtypes) {
  (void)softmax_scale;
  const bool paged = block_table.has_value();
  check_dim(q, "q", 3, "(total_q, nheads, head_dim)");
  if (paged) {
    constexpr const char* kPaged = "(num_blocks, page_size, nheads_k, head_dim) with block_table";
    check_dim(k, "k", 4, kPaged);
    check_dim(v, "v", 4, kPaged);
  } else {
    check_dim(k, "k", 3, "(total_k, nheads_k, head_dim)");
    check_dim(v, "v", 3, "(total_k, nheads_k, head_dim)");
  }
  check_qkv_common(q, k, v, allowed_dtypes);

  const int64_t total_q = q.size(0), nheads = q.size(1), head_dim = q.size(2);
  const int64_t nheads_k = k.size(-2);
  check_head_dim(head_dim, q);
  TORCH_CHECK(k.size(-1) == head_dim, "flash_attn: k must have the head_dim of q (", head_dim,
              "), got shape ", k.sizes());
  const int64_t head_dim_v = check_v_shape(v, k, head_dim);
  check_heads(nheads, nheads_k);

  check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q);
  check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", q);
  const int64_t batch = cu_seqlens_q.numel() - 1;
  TORCH_CHECK(cu_seqlens_k.numel() == batch + 1,
              "flash_attn: cu_seqlens_k must have as many entries as cu_seqlens_q (", batch + 1,
              "), got ", cu_seqlens_k.numel());
  check_max_seqlen(max_seqlen_q, "max_seqlen_q");
  check_max_seqlen(max_seqlen_k, "max_seqlen_k");
  check_seqused(seqused_k, "seqused_k", q, batch);
  check_seqused(seqused_q, "seqused_q", q, batch);

  VarlenShape shape{};
  shape.batch = checked_int(batch, "batch");
  shape.total_q = checked_int(total_q, "total_q");
  shape.nheads = checked_int(nheads, "nheads");
  shape.nheads_k = checked_int(nheads_k, "nheads_k");
  shape.head_dim = static_cast<int>(head_dim);
  shape.head_dim_v = static_cast<int>(head_dim_v);
  shape.max_seqlen_q = static_cast<int>(max_seqlen_q);
  shape.max_seqlen_k = static_cast<int>(max_seqlen_k);
  shape.paged = paged;
  if (paged) {
    const at::Tensor& table = *block_table;
    TORCH_CHECK(table.scalar_type() == at::kInt,
                "flash_attn: block_table must have dtype int32, got ", table.scalar_type());
    check_same_device(table, "block_table", q);
    TORCH_CHECK(table.dim() == 2 && table.size(0) == batch,
                "flash_attn: block_table must have shape (batch, max_blocks_per_seq) with batch = ",
                batch, ", got ", table.sizes());
    TORCH_CHECK(table.numel() == 0 || table.stride(1) == 1,
                "flash_attn: block_table must have a contiguous last dimension");
    TORCH_CHECK(k.size(1) >= 1, "flash_attn: paged k must have page_size >= 1, got shape ",
                k.sizes());
    shape.num_blocks = checked_int(k.size(0), "num_blocks");
    shape.page_size = checked_int(k.size(1), "page_size");
    shape.max_blocks_per_seq = checked_int(table.size(1), "max_blocks_per_seq");
    shape.total_k = checked_int(k.size(0) * k.size(1), "num_blocks * page_size");
  } else {
    shape.total_k = checked_int(k.size(0), "total_k");
  }

  check_scalars(dropout_p, softcap);
  check_window_arg(window_size_left, "window_size_left");
  check_window_arg(window_size_right, "window_size_right");
  check_alibi(alibi_slopes, q, batch, nheads);
  check_rng_state(rng_state);
  return shape;
}

VarlenShape check_varlen_bwd_args(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& softmax_lse, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, const std::optional<at::Tensor>& seqused_k,
    const std::optional<at::Tensor>& seqused_q, const std::optional<at::Tensor>& alibi_slopes,
    int64_t max_seqlen_q, int64_t max_seqlen_k, double dropout_p, double softmax_scale,
    int64_t window_size_left, int64_t window_size_right, double softcap,
    const std::optional<at::Tensor>& rng_state, c10::ArrayRef<at::ScalarType> allowed_dtypes) {
  const VarlenShape shape = check_varlen_fwd_args(
      q, k, v, cu_seqlens_q, cu_seqlens_k, std::nullopt, seqused_k, seqused_q, alibi_slopes,
      max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, window_size_left, window_size_right,
      softcap, rng_state, allowed_dtypes);
  check_bwd_head_dim(shape.head_dim, q);
  check_grad_io(dout, out, q, shape.head_dim_v);
  check_lse(softmax_lse, q, {shape.nheads, shape.total_q}, "(nheads, total_q)");
  check_backward_dropout(dropout_p, rng_state);
  return shape;
}

void check_num_splits(int64_t num_splits) {
  TORCH_CHECK(num_splits >= 0 && num_splits <= kMaxVarlenSplits,
              "flash_attn: num_splits must be in [0, ", kMaxVarlenSplits,
              "] (0 chooses, 1 does not split), got ", num_splits);
}

void check_cu_seqlens_host(const at::Tensor& cu_seqlens, int64_t total_rows, int64_t max_seqlen,
                           IndexArg arg, IndexOp op) {
  TORCH_CHECK(cu_seqlens.device().is_cpu(),
              "flash_attn: cu_seqlens must be on the CPU for a "
              "host-side check");
  const int32_t* cu = cu_seqlens.data_ptr<int32_t>();
  const int64_t batch = cu_seqlens.numel() - 1;
  if (cu[0] < 0)
    raise_index_error(index_error(IndexRule::kNegativeOffset, arg, op, 0, 0, cu[0], 0));
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t seqlen = static_cast<int64_t>(cu[b + 1]) - cu[b];
    if (seqlen < 0) {
      raise_index_error(index_error(IndexRule::kDecreasing, arg, op, b, 0, cu[b], cu[b + 1]));
    }
    if (seqlen > max_seqlen) {
      raise_index_error(index_error(IndexRule::kLongerThanMax, arg, op, b, 0, seqlen, max_seqlen));
    }
  }
  if (total_rows >= 0 && cu[batch] > total_rows) {
    raise_index_error(index_error(IndexRule::kPastRows, arg, op, batch, 0, cu[batch], total_rows));
  }
}

void check_seqused_k_host(const at::Tensor& seqused_k, const at::Tensor& cu_seqlens_k, bool paged,
                          int64_t paged_bound) {
  TORCH_CHECK(seqused_k.device().is_cpu() && cu_seqlens_k.device().is_cpu(),
              "flash_attn: seqused_k and cu_seqlens_k must be on the CPU for a host-side check");
  const at::Tensor used = seqused_k.contiguous();
  const int32_t* values = used.data_ptr<int32_t>();
  const int32_t* cu = cu_seqlens_k.data_ptr<int32_t>();
  for (int64_t b = 0; b < used.numel(); ++b) {
    const int64_t bound = paged ? paged_bound : static_cast<int64_t>(cu[b + 1]) - cu[b];
    if (values[b] < 0 || values[b] > bound) {
      raise_index_error(index_error(IndexRule::kSeqused, IndexArg::kSequsedK, IndexOp::kVarlen, b,
                                    paged ? 1 : 0, values[b], bound));
    }
  }
}

void check_seqused_q_host(const at::Tensor& seqused_q, const at::Tensor& cu_seqlens_q) {
  TORCH_CHECK(seqused_q.device().is_cpu() && cu_seqlens_q.device().is_cpu(),
              "flash_attn: seqused_q and cu_seqlens_q must be on the CPU for a host-side check");
  const at::Tensor used = seqused_q.contiguous();
  const int32_t* values = used.data_ptr<int32_t>();
  const int32_t* cu = cu_seqlens_q.data_ptr<int32_t>();
  for (int64_t b = 0; b < used.numel(); ++b) {
    const int64_t bound = static_cast<int64_t>(cu[b + 1]) - cu[b];
    if (values[b] < 0 || values[b] > bound) {
      raise_index_error(index_error(IndexRule::kSeqused, IndexArg::kSequsedQ, IndexOp::kVarlen, b,
                                    0, values[b], bound));
    }
  }
}

void check_block_table_host(const at::Tensor& block_table, const at::Tensor& cu_seqlens_k,
                            const std::optional<at::Tensor>& seqused_k, int64_t num_blocks,
                            int64_t page_size) {
  TORCH_CHECK(block_table.device().is_cpu() && cu_seqlens_k.device().is_cpu(),
              "flash_attn: block_table and cu_seqlens_k must be on the CPU for a host-side check");
  const int32_t* cu = cu_seqlens_k.data_ptr<int32_t>();
  const at::Tensor used = seqused_k.has_value() ? seqused_k->contiguous() : at::Tensor();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t batch = block_table.size(0), max_blocks = block_table.size(1);
  const int64_t row_stride = block_table.stride(0);
  const IndexOp op = IndexOp::kVarlen;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t seqlen_k = used.defined() ? static_cast<int64_t>(used.data_ptr<int32_t>()[b])
                                            : static_cast<int64_t>(cu[b + 1]) - cu[b];
    const int64_t blocks_needed = (seqlen_k + page_size - 1) / page_size;
    if (blocks_needed > max_blocks) {
      raise_index_error(index_error(IndexRule::kPagesPastTable, IndexArg::kBlockTable, op, b, 0,
                                    seqlen_k, max_blocks, page_size));
    }
    for (int64_t i = 0; i < blocks_needed; ++i) {
      const int32_t block = table[b * row_stride + i];
      if (block < 0 || block >= num_blocks) {
        raise_index_error(index_error(IndexRule::kPageOutOfPool, IndexArg::kBlockTable, op, b, i,
                                      block, num_blocks));
      }
    }
  }
}

void check_out_arg(const char* prefix, const at::Tensor& out, const at::Tensor& q,
                   at::IntArrayRef expected, const char* layout,
                   std::initializer_list<const at::Tensor*> inputs, at::ScalarType dtype) {
  TORCH_CHECK(out.device() == q.device(), prefix, ": out must be on the device of q (", q.device(),
              "), got ", out.device());
  if (dtype == at::ScalarType::Undefined || dtype == q.scalar_type()) {
    TORCH_CHECK(out.scalar_type() == q.scalar_type(), prefix, ": out must have the dtype of q (",
                q.scalar_type(), "), got ", out.scalar_type());
  } else {
    TORCH_CHECK(out.scalar_type() == dtype, prefix, ": out must have dtype ", dtype,
                " (the output dtype of a ", q.scalar_type(), " q), got ", out.scalar_type());
  }
  TORCH_CHECK(out.sizes() == expected, prefix, ": out must have shape ", layout, " = ", expected,
              ", got ", out.sizes());
  TORCH_CHECK(out.numel() == 0 || out.stride(-1) == 1, prefix,
              ": out must have a contiguous last dimension (stride 1), got strides ",
              out.strides());
  TORCH_CHECK(at::has_internal_overlap(out) != at::MemOverlap::Yes, prefix,
              ": out must not have elements that share memory (e.g. an expanded tensor), got "
              "strides ",
              out.strides());
  for (const at::Tensor* input : inputs) {
    if (input == nullptr || !input->defined() || input->numel() == 0 || out.numel() == 0) continue;
    const at::MemOverlapStatus overlap = at::get_overlap_status(out, *input);
    TORCH_CHECK(overlap != at::MemOverlapStatus::Full && overlap != at::MemOverlapStatus::Partial,
                prefix,
                ": out must not share memory with an input of the call (q, k, v or the "
                "caches), which the kernels still read while they write out");
  }
}

std::optional<at::Tensor> check_learnable_sink(const char* prefix,
                                               const std::optional<at::Tensor>& learnable_sink,
                                               const at::Tensor& q, int64_t nheads) {
  if (!learnable_sink.has_value()) return std::nullopt;
  const at::Tensor& sink = *learnable_sink;
  TORCH_CHECK(sink.scalar_type() == at::kFloat, prefix,
              ": learnable_sink must have dtype float32, got ", sink.scalar_type());
  TORCH_CHECK(sink.device() == q.device(), prefix,
              ": learnable_sink must be on the same device as q (", q.device(), "), got ",
              sink.device());
  TORCH_CHECK(sink.dim() == 1 && sink.size(0) == nheads, prefix,
              ": learnable_sink must have shape (nheads,) = (", nheads,
              ",) (one sink per query head), got ", sink.sizes());
  return sink.contiguous();
}

void check_softmax_d_out(const char* prefix, const std::optional<at::Tensor>& softmax_d,
                         const at::Tensor& softmax_lse) {
  if (!softmax_d.has_value()) return;
  const at::Tensor& d = *softmax_d;
  TORCH_CHECK(d.scalar_type() == at::kFloat, prefix, ": softmax_d must have dtype float32, got ",
              d.scalar_type());
  TORCH_CHECK(d.device() == softmax_lse.device(), prefix,
              ": softmax_d must be on the device of softmax_lse (", softmax_lse.device(), "), got ",
              d.device());
  TORCH_CHECK(d.sizes() == softmax_lse.sizes(), prefix,
              ": softmax_d must have the shape of softmax_lse (", softmax_lse.sizes(), "), got ",
              d.sizes());
  TORCH_CHECK(d.is_contiguous(), prefix, ": softmax_d must be contiguous");
}

Window normalize_window(bool causal, int64_t window_size_left, int64_t window_size_right,
                        int64_t seqlen_k) {
  auto side = [seqlen_k](int64_t w) -> int {
    return (w < 0 || w >= seqlen_k) ? -1 : static_cast<int>(w);
  };
  Window window{side(window_size_left), side(window_size_right)};
  if (causal) window.right = 0;
  return window;
}

PhiloxSeed resolve_philox_seed(int64_t philox_seed, int64_t philox_offset,
                               const std::optional<at::Tensor>& rng_state) {
  if (!rng_state.has_value()) {
    return {static_cast<uint64_t>(philox_seed), static_cast<uint64_t>(philox_offset)};
  }
  check_rng_state(rng_state);
  const at::Tensor host = rng_state->reshape({2}).to(at::kCPU);
  const int64_t* values = host.data_ptr<int64_t>();
  return {static_cast<uint64_t>(values[0]), static_cast<uint64_t>(values[1])};
}

at::Tensor make_rng_state(const PhiloxSeed& seed, c10::Device device) {
  at::Tensor state = at::empty({2}, at::TensorOptions().dtype(at::kLong).device(at::kCPU));
  state.data_ptr<int64_t>()[0] = static_cast<int64_t>(seed.seed);
  state.data_ptr<int64_t>()[1] = static_cast<int64_t>(seed.offset);
  return device.is_cpu() ? state : state.to(device);
}

at::Tensor output_rng_state(int64_t philox_seed, int64_t philox_offset,
                            const std::optional<at::Tensor>& rng_state, c10::Device device) {
  if (!rng_state.has_value()) {
    return make_rng_state(
        {static_cast<uint64_t>(philox_seed), static_cast<uint64_t>(philox_offset)}, device);
  }
  check_rng_state(rng_state);
  return rng_state->reshape({2}).to(device, /*non_blocking=*/false, /*copy=*/true);
}

}  // namespace flash
