// CPU implementations of fwd, bwd, varlen_fwd, varlen_bwd and the *_out forms
// of the forwards: argument checks (api/checks.h), output allocation (or the
// caller's out), and a problem description handed to the CPU attention core
// (attention_cpu.h).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "api/checks.h"
#include "api/fp8_checks.h"
#include "api/head_dims.h"
#include "cpu/attention_cpu.h"

namespace flash::cpu {
namespace {

constexpr at::ScalarType kCpuDtypes[] = {at::kFloat, at::kHalf, at::kBFloat16};
constexpr at::ScalarType kFp8Dtypes[] = {at::kFloat8_e4m3fn};

// The dtypes check_*_args accepts for a call of this fp8 form.
c10::ArrayRef<at::ScalarType> dtypes_for(Fp8Call fp8) {
  if (fp8 == Fp8Call::kAttention) return kFp8Dtypes;
  return kCpuDtypes;
}

// The fp8 checks that need the call's shapes, then the problem's fp8 fields
// (docs/fp8.md). Nothing for a call without fp8.
void set_fp8(AttentionProblem& problem, Fp8Call fp8, const Fp8Descales& descales,
             const at::Tensor& q, int batch, int nheads_k, double dropout_p, bool return_softmax,
             const std::optional<at::Tensor>& alibi_slopes) {
  if (fp8 == Fp8Call::kNone) return;
  check_fp8_descales("flash_attn", descales, q, batch, nheads_k);
  check_fp8_features("flash_attn", dropout_p, return_softmax, alibi_slopes);
  problem.kv_dtype = at::kFloat8_e4m3fn;
  problem.out_dtype = fp8_out_dtype(fp8, q.scalar_type());
  problem.q_descale = fp8_descale_view(descales.q);
  problem.k_descale = fp8_descale_view(descales.k);
  problem.v_descale = fp8_descale_view(descales.v);
}

// (batch, seqlen, heads, dim) and varlen / paged views of it.
RowStrides fixed_strides(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }
RowStrides varlen_strides(const at::Tensor& t) { return {0, t.stride(0), t.stride(1)}; }

AttentionProblem make_problem(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              bool varlen_kv, int nheads, int nheads_k, int head_dim,
                              const std::optional<at::Tensor>& alibi_slopes, double softmax_scale,
                              const Window& window, double softcap, double dropout_p,
                              const PhiloxSeed& philox,
                              const std::optional<at::Tensor>& learnable_sink = std::nullopt) {
  AttentionProblem p;
  p.dtype = q.scalar_type();
  p.nheads = nheads;
  p.nheads_k = nheads_k;
  p.head_dim = head_dim;
  p.q = q.data_ptr();
  p.q_strides = q.dim() == 4 ? fixed_strides(q) : varlen_strides(q);
  p.k = k.data_ptr();
  p.k_strides = varlen_kv ? varlen_strides(k) : fixed_strides(k);
  p.v = v.data_ptr();
  p.v_strides = varlen_kv ? varlen_strides(v) : fixed_strides(v);
  p.page_size = 0;
  p.softmax_scale = static_cast<float>(softmax_scale);
  p.softcap = static_cast<float>(softcap);
  p.alibi_slopes = nullptr;
  p.alibi_batch_stride = 0;
  if (alibi_slopes.has_value()) {
    p.alibi_slopes = alibi_slopes->data_ptr<float>();
    p.alibi_batch_stride = alibi_slopes->dim() == 2 ? alibi_slopes->stride(0) : 0;
  }
  p.window_left = window.left;
  p.window_right = window.right;
  p.dropout_p = static_cast<float>(dropout_p);
  p.philox_seed = philox.seed;
  p.philox_offset = philox.offset;
  p.learnable_sink = learnable_sink.has_value() ? learnable_sink->data_ptr<float>() : nullptr;
  return p;
}

at::Tensor make_probs(bool return_softmax, const at::Tensor& q, int batch, int nheads, int seqlen_q,
                      int seqlen_k) {
  if (!return_softmax) return at::empty({0}, q.options());
  // Entries a row does not see stay 0.
  return at::zeros({batch, nheads, seqlen_q, seqlen_k}, q.options());
}

void set_probs(ForwardOutputs& o, const at::Tensor& probs, bool return_softmax) {
  o.probs = return_softmax ? probs.data_ptr() : nullptr;
  o.probs_batch_stride = return_softmax ? probs.stride(0) : 0;
  o.probs_head_stride = return_softmax ? probs.stride(1) : 0;
  o.probs_row_stride = return_softmax ? probs.stride(2) : 0;
}

// The first head_dim_v columns of a padded problem's out, written into the
// caller's out when there is one.
at::Tensor take_head_dim_v(const at::Tensor& out, int64_t head_dim_v,
                           const std::optional<at::Tensor>& out_given) {
  const at::Tensor cropped = crop_head_dim(out, head_dim_v);
  if (!out_given.has_value()) return cropped;
  out_given->copy_(cropped);
  return *out_given;
}

// True when the sequences of cu_seqlens cover every one of total_rows rows;
// otherwise rows outside them must be given a defined value.
bool covers_all_rows(const at::Tensor& cu_seqlens, int64_t total_rows) {
  const int32_t* cu = cu_seqlens.data_ptr<int32_t>();
  return cu[0] == 0 && cu[cu_seqlens.numel() - 1] == total_rows;
}

// Zeros the rows of a (total, ...) tensor before cu_seqlens[0] and from
// cu_seqlens[batch] on: the rows outside every sequence (checked offsets).
void zero_rows_outside_sequences(const at::Tensor& t, const at::Tensor& cu_seqlens) {
  const int32_t* cu = cu_seqlens.data_ptr<int32_t>();
  const int64_t first = cu[0], last = cu[cu_seqlens.numel() - 1];
  t.narrow(0, 0, first).zero_();
  t.narrow(0, last, t.size(0) - last).zero_();
}

// The forward of fwd and fwd_out: into out_given when there is one, else into
// a new tensor.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fwd_cpu_into(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& alibi_slopes, double dropout_p, double softmax_scale,
    bool causal, int64_t window_size_left, int64_t window_size_right, double softcap,
    bool return_softmax, int64_t philox_seed, int64_t philox_offset,
    const std::optional<at::Tensor>& rng_state, const std::optional<at::Tensor>& out_given,
    const std::optional<at::Tensor>& learnable_sink_in, const Fp8Descales& descales) {
  const Fp8Call fp8 = fp8_attention_call(q, k, v, descales);
  const FwdShape shape =
      check_fwd_args(q, k, v, alibi_slopes, dropout_p, softmax_scale, window_size_left,
                     window_size_right, softcap, rng_state, dtypes_for(fp8));
  const at::TensorOptions out_options = q.options().dtype(fp8_out_dtype(fp8, q.scalar_type()));
  const std::vector<int64_t> out_shape{shape.batch, shape.seqlen_q, shape.nheads, shape.head_dim_v};
  if (out_given.has_value()) {
    check_out_arg("flash_attn", *out_given, q, out_shape, "(batch, seqlen_q, nheads, head_dim_v)",
                  {&q, &k, &v}, out_options.dtype().toScalarType());
  }
  // d_v < d_qk: the d_qk problem on a zero-padded v (api/head_dims.h).
  const bool pad_v = shape.head_dim_v != shape.head_dim;
  const at::Tensor v_run = pad_head_dim(v, shape.head_dim);
  const std::optional<at::Tensor> learnable_sink =
      check_learnable_sink("flash_attn", learnable_sink_in, q, shape.nheads);
  const Window window =
      normalize_window(causal, window_size_left, window_size_right, shape.seqlen_k);
  const PhiloxSeed philox = resolve_philox_seed(philox_seed, philox_offset, rng_state);

  at::Tensor out =
      pad_v ? at::empty({shape.batch, shape.seqlen_q, shape.nheads, shape.head_dim}, out_options)
            : (out_given.has_value() ? *out_given : at::empty(out_shape, out_options));
  at::Tensor lse =
      at::empty({shape.batch, shape.nheads, shape.seqlen_q}, q.options().dtype(at::kFloat));
  at::Tensor probs =
      make_probs(return_softmax, q, shape.batch, shape.nheads, shape.seqlen_q, shape.seqlen_k);

  AttentionProblem problem =
      make_problem(q, k, v_run, /*varlen_kv=*/false, shape.nheads, shape.nheads_k, shape.head_dim,
                   alibi_slopes, softmax_scale, window, softcap, dropout_p, philox, learnable_sink);
  set_fp8(problem, fp8, descales, q, shape.batch, shape.nheads_k, dropout_p, return_softmax,
          alibi_slopes);
  problem.sequences = fixed_length_sequences(shape.batch, shape.seqlen_q, shape.seqlen_k);
  ForwardOutputs outputs;
  outputs.out = out.data_ptr();
  outputs.out_strides = fixed_strides(out);
  outputs.lse = lse.data_ptr<float>();
  outputs.lse_strides = {lse.stride(0), lse.stride(2), lse.stride(1)};
  set_probs(outputs, probs, return_softmax);
  attention_forward(problem, outputs);
  if (pad_v) out = take_head_dim_v(out, shape.head_dim_v, out_given);
  return {out, lse, probs, make_rng_state(philox, q.device())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fwd_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& alibi_slopes, double dropout_p, double softmax_scale,
    bool causal, int64_t window_size_left, int64_t window_size_right, double softcap,
    bool return_softmax, int64_t philox_seed, int64_t philox_offset,
    const std::optional<at::Tensor>& rng_state, const std::optional<at::Tensor>& learnable_sink,
    const std::optional<at::Tensor>& q_descale, const std::optional<at::Tensor>& k_descale,
    const std::optional<at::Tensor>& v_descale) {
  return fwd_cpu_into(q, k, v, alibi_slopes, dropout_p, softmax_scale, causal, window_size_left,
                      window_size_right, softcap, return_softmax, philox_seed, philox_offset,
                      rng_state, std::nullopt, learnable_sink, {q_descale, k_descale, v_descale});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fwd_out_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& alibi_slopes, double dropout_p, double softmax_scale,
    bool causal, int64_t window_size_left, int64_t window_size_right, double softcap,
    bool return_softmax, int64_t philox_seed, int64_t philox_offset,
    const std::optional<at::Tensor>& rng_state, const at::Tensor& out,
    const std::optional<at::Tensor>& learnable_sink, const std::optional<at::Tensor>& q_descale,
    const std::optional<at::Tensor>& k_descale, const std::optional<at::Tensor>& v_descale) {
  auto [written, lse, probs, rng] =
      fwd_cpu_into(q, k, v, alibi_slopes, dropout_p, softmax_scale, causal, window_size_left,
                   window_size_right, softcap, return_softmax, philox_seed, philox_offset,
                   rng_state, out, learnable_sink, {q_descale, k_descale, v_descale});
  return {lse, probs, rng};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_cpu(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& softmax_lse,
    const std::optional<at::Tensor>& alibi_slopes, double dropout_p, double softmax_scale,
    bool causal, int64_t window_size_left, int64_t window_size_right, double softcap,
    bool deterministic, const std::optional<at::Tensor>& rng_state,
    const std::optional<at::Tensor>& softmax_d) {
  (void)deterministic;  // the CPU backward is always deterministic
  refuse_fp8_backward("flash_attn", q, k, v);
  const FwdShape shape =
      check_bwd_args(dout, q, k, v, out, softmax_lse, alibi_slopes, dropout_p, softmax_scale,
                     window_size_left, window_size_right, softcap, rng_state, kCpuDtypes);
  check_softmax_d_out("flash_attn", softmax_d, softmax_lse);
  const Window window =
      normalize_window(causal, window_size_left, window_size_right, shape.seqlen_k);
  const PhiloxSeed philox = resolve_philox_seed(0, 0, rng_state);

  // d_v < d_qk: the d_qk problem on zero-padded v, dout and out (api/head_dims.h).
  const at::Tensor v_run = pad_head_dim(v, shape.head_dim);
  const at::Tensor dout_run = pad_head_dim(dout, shape.head_dim);
  const at::Tensor out_run = pad_head_dim(out, shape.head_dim);
  at::Tensor dq = at::empty(q.sizes(), q.options());
  at::Tensor dk = at::empty(k.sizes(), k.options());
  at::Tensor dv = at::empty(v_run.sizes(), v.options());

  AttentionProblem problem =
      make_problem(q, k, v_run, /*varlen_kv=*/false, shape.nheads, shape.nheads_k, shape.head_dim,
                   alibi_slopes, softmax_scale, window, softcap, dropout_p, philox);
  problem.sequences = fixed_length_sequences(shape.batch, shape.seqlen_q, shape.seqlen_k);
  BackwardTensors tensors;
  tensors.dout = dout_run.data_ptr();
  tensors.dout_strides = fixed_strides(dout_run);
  tensors.out = out_run.data_ptr();
  tensors.out_strides = fixed_strides(out_run);
  tensors.lse = softmax_lse.data_ptr<float>();
  tensors.lse_strides = {softmax_lse.stride(0), softmax_lse.stride(2), softmax_lse.stride(1)};
  if (softmax_d.has_value()) {
    tensors.delta_out = softmax_d->data_ptr<float>();
    tensors.delta_out_strides = {softmax_d->stride(0), softmax_d->stride(2), softmax_d->stride(1)};
  }
  tensors.dq = dq.data_ptr();
  tensors.dq_strides = fixed_strides(dq);
  tensors.dk = dk.data_ptr();
  tensors.dk_strides = fixed_strides(dk);
  tensors.dv = dv.data_ptr();
  tensors.dv_strides = fixed_strides(dv);
  attention_backward(problem, tensors);
  return {dq, dk, crop_head_dim(dv, shape.head_dim_v)};
}

// The forward of varlen_fwd and varlen_fwd_out: into out_given when there is
// one, else into a new tensor.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> varlen_fwd_cpu_into(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, const std::optional<at::Tensor>& block_table,
    const std::optional<at::Tensor>& alibi_slopes, int64_t max_seqlen_q, int64_t max_seqlen_k,
    double dropout_p, double softmax_scale, bool causal, int64_t window_size_left,
    int64_t window_size_right, double softcap, bool return_softmax, int64_t philox_seed,
    int64_t philox_offset, const std::optional<at::Tensor>& rng_state,
    const std::optional<at::Tensor>& seqused_k, const std::optional<at::Tensor>& out_given,
    const std::optional<at::Tensor>& learnable_sink_in, const std::optional<at::Tensor>& seqused_q,
    const Fp8Descales& descales) {
  const Fp8Call fp8 = fp8_attention_call(q, k, v, descales);
  const VarlenShape shape = check_varlen_fwd_args(
      q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k, seqused_q, alibi_slopes,
      max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, window_size_left, window_size_right,
      softcap, rng_state, dtypes_for(fp8));
  const at::TensorOptions out_options = q.options().dtype(fp8_out_dtype(fp8, q.scalar_type()));
  const std::vector<int64_t> out_shape{shape.total_q, shape.nheads, shape.head_dim_v};
  if (out_given.has_value()) {
    check_out_arg("flash_attn", *out_given, q, out_shape, "(total_q, nheads, head_dim_v)",
                  {&q, &k, &v}, out_options.dtype().toScalarType());
  }
  // d_v < d_qk: the d_qk problem on a zero-padded v (api/head_dims.h).
  const bool pad_v = shape.head_dim_v != shape.head_dim;
  const at::Tensor v_run = pad_head_dim(v, shape.head_dim);
  const std::optional<at::Tensor> learnable_sink =
      check_learnable_sink("flash_attn", learnable_sink_in, q, shape.nheads);
  check_cu_seqlens_host(cu_seqlens_q, shape.total_q, shape.max_seqlen_q, IndexArg::kCuSeqlensQ);
  check_cu_seqlens_host(cu_seqlens_k, shape.paged ? -1 : shape.total_k, shape.max_seqlen_k,
                        IndexArg::kCuSeqlensK);
  const at::Tensor used = seqused_k.has_value() ? seqused_k->contiguous() : at::Tensor();
  if (used.defined()) {
    const int64_t paged_bound =
        shape.paged ? std::min<int64_t>(shape.max_seqlen_k,
                                        int64_t(shape.max_blocks_per_seq) * shape.page_size)
                    : 0;
    check_seqused_k_host(used, cu_seqlens_k, shape.paged, paged_bound);
  }
  const at::Tensor used_q = seqused_q.has_value() ? seqused_q->contiguous() : at::Tensor();
  if (used_q.defined()) check_seqused_q_host(used_q, cu_seqlens_q);
  if (shape.paged) {
    check_block_table_host(*block_table, cu_seqlens_k, seqused_k, shape.num_blocks,
                           shape.page_size);
  }
  const Window window =
      normalize_window(causal, window_size_left, window_size_right, shape.max_seqlen_k);
  const PhiloxSeed philox = resolve_philox_seed(philox_seed, philox_offset, rng_state);

  at::Tensor out = pad_v ? at::empty({shape.total_q, shape.nheads, shape.head_dim}, out_options)
                         : (out_given.has_value() ? *out_given : at::empty(out_shape, out_options));
  at::Tensor lse = at::empty({shape.nheads, shape.total_q}, q.options().dtype(at::kFloat));
  // The kernel writes the used rows of each sequence only. Rows outside
  // every sequence, and rows past seqused_q[b], get out 0 and lse +inf (as a
  // row that sees no key, so that exp(s - lse) and the sink's share
  // exp(sink - lse) are 0 for any reader) -- except that the rows past
  // seqused_q of a caller's `out` are left as they are, as FA3 does: a serving
  // engine passes out= to avoid every write it does not need (padded query
  // slots of a captured batch), and reads only the used rows.
  const bool covers = covers_all_rows(cu_seqlens_q, shape.total_q);
  if (!covers || used_q.defined()) lse.fill_(std::numeric_limits<float>::infinity());
  if (!out_given.has_value()) {
    if (!covers || used_q.defined()) out.zero_();
  } else {
    // A padded scratch buffer is copied back whole: start it from the
    // caller's values so that the rows past seqused_q come back unchanged.
    if (pad_v && used_q.defined()) out.narrow(-1, 0, shape.head_dim_v).copy_(*out_given);
    if (!covers) zero_rows_outside_sequences(out, cu_seqlens_q);
  }
  at::Tensor probs = make_probs(return_softmax, q, shape.batch, shape.nheads, shape.max_seqlen_q,
                                shape.max_seqlen_k);

  AttentionProblem problem = make_problem(
      q, k, v_run, /*varlen_kv=*/!shape.paged, shape.nheads, shape.nheads_k, shape.head_dim,
      alibi_slopes, softmax_scale, window, softcap, dropout_p, philox, learnable_sink);
  set_fp8(problem, fp8, descales, q, shape.batch, shape.nheads_k, dropout_p, return_softmax,
          alibi_slopes);
  problem.sequences = varlen_sequences(shape.batch, cu_seqlens_q.data_ptr<int32_t>(),
                                       cu_seqlens_k.data_ptr<int32_t>(),
                                       used.defined() ? used.data_ptr<int32_t>() : nullptr,
                                       used_q.defined() ? used_q.data_ptr<int32_t>() : nullptr,
                                       shape.paged ? block_table->data_ptr<int32_t>() : nullptr,
                                       shape.paged ? block_table->stride(0) : 0);
  if (shape.paged) problem.page_size = shape.page_size;
  ForwardOutputs outputs;
  outputs.out = out.data_ptr();
  outputs.out_strides = varlen_strides(out);
  outputs.lse = lse.data_ptr<float>();
  outputs.lse_strides = {0, lse.stride(1), lse.stride(0)};
  set_probs(outputs, probs, return_softmax);
  attention_forward(problem, outputs);
  if (pad_v) out = take_head_dim_v(out, shape.head_dim_v, out_given);
  return {out, lse, probs, make_rng_state(philox, q.device())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> varlen_fwd_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, const std::optional<at::Tensor>& block_table,
    const std::optional<at::Tensor>& alibi_slopes, int64_t max_seqlen_q, int64_t max_seqlen_k,
    double dropout_p, double softmax_scale, bool causal, int64_t window_size_left,
    int64_t window_size_right, double softcap, bool return_softmax, int64_t philox_seed,
    int64_t philox_offset, const std::optional<at::Tensor>& rng_state,
    const std::optional<at::Tensor>& seqused_k, const std::optional<at::Tensor>& learnable_sink,
    const std::optional<at::Tensor>& seqused_q, int64_t num_splits,
    const std::optional<at::Tensor>& q_descale, const std::optional<at::Tensor>& k_descale,
    const std::optional<at::Tensor>& v_descale) {
  check_num_splits(num_splits);  // a GPU work-partitioning knob: the CPU result never depends on it
  return varlen_fwd_cpu_into(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes,
                             max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                             window_size_left, window_size_right, softcap, return_softmax,
                             philox_seed, philox_offset, rng_state, seqused_k, std::nullopt,
                             learnable_sink, seqused_q, {q_descale, k_descale, v_descale});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_fwd_out_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, const std::optional<at::Tensor>& block_table,
    const std::optional<at::Tensor>& alibi_slopes, int64_t max_seqlen_q, int64_t max_seqlen_k,
    double dropout_p, double softmax_scale, bool causal, int64_t window_size_left,
    int64_t window_size_right, double softcap, bool return_softmax, int64_t philox_seed,
    int64_t philox_offset, const std::optional<at::Tensor>& rng_state,
    const std::optional<at::Tensor>& seqused_k, const at::Tensor& out,
    const std::optional<at::Tensor>& learnable_sink, const std::optional<at::Tensor>& seqused_q,
    int64_t num_splits, const std::optional<at::Tensor>& q_descale,
    const std::optional<at::Tensor>& k_descale, const std::optional<at::Tensor>& v_descale) {
  check_num_splits(num_splits);
  auto [written, lse, probs, rng] = varlen_fwd_cpu_into(
      q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes, max_seqlen_q, max_seqlen_k,
      dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
      return_softmax, philox_seed, philox_offset, rng_state, seqused_k, out, learnable_sink,
      seqused_q, {q_descale, k_descale, v_descale});
  return {lse, probs, rng};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_bwd_cpu(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& softmax_lse, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, const std::optional<at::Tensor>& alibi_slopes,
    int64_t max_seqlen_q, int64_t max_seqlen_k, double dropout_p, double softmax_scale, bool causal,
    int64_t window_size_left, int64_t window_size_right, double softcap, bool deterministic,
    const std::optional<at::Tensor>& rng_state, const std::optional<at::Tensor>& seqused_k,
    const std::optional<at::Tensor>& softmax_d, const std::optional<at::Tensor>& seqused_q) {
  (void)deterministic;  // the CPU backward is always deterministic
  refuse_fp8_backward("flash_attn", q, k, v);
  const VarlenShape shape = check_varlen_bwd_args(
      dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, seqused_k, seqused_q,
      alibi_slopes, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, window_size_left,
      window_size_right, softcap, rng_state, kCpuDtypes);
  check_softmax_d_out("flash_attn", softmax_d, softmax_lse);
  check_cu_seqlens_host(cu_seqlens_q, shape.total_q, shape.max_seqlen_q, IndexArg::kCuSeqlensQ);
  check_cu_seqlens_host(cu_seqlens_k, shape.total_k, shape.max_seqlen_k, IndexArg::kCuSeqlensK);
  const at::Tensor used = seqused_k.has_value() ? seqused_k->contiguous() : at::Tensor();
  if (used.defined()) check_seqused_k_host(used, cu_seqlens_k, /*paged=*/false, 0);
  const at::Tensor used_q = seqused_q.has_value() ? seqused_q->contiguous() : at::Tensor();
  if (used_q.defined()) check_seqused_q_host(used_q, cu_seqlens_q);
  const Window window =
      normalize_window(causal, window_size_left, window_size_right, shape.max_seqlen_k);
  const PhiloxSeed philox = resolve_philox_seed(0, 0, rng_state);

  // d_v < d_qk: the d_qk problem on zero-padded v, dout and out (api/head_dims.h).
  const at::Tensor v_run = pad_head_dim(v, shape.head_dim);
  const at::Tensor dout_run = pad_head_dim(dout, shape.head_dim);
  const at::Tensor out_run = pad_head_dim(out, shape.head_dim);
  at::Tensor dq = at::empty(q.sizes(), q.options());
  at::Tensor dk = at::empty(k.sizes(), k.options());
  at::Tensor dv = at::empty(v_run.sizes(), v.options());
  // Query rows outside every sequence, or past seqused_q[b], get no gradient;
  // their D is 0 (sink_grad then takes nothing from them, whatever out held).
  if (used_q.defined() || !covers_all_rows(cu_seqlens_q, shape.total_q)) dq.zero_();
  if (used_q.defined() && softmax_d.has_value()) softmax_d->zero_();
  // Key rows outside every sequence's used keys get no gradient.
  if (used.defined() || !covers_all_rows(cu_seqlens_k, shape.total_k)) {
    dk.zero_();
    dv.zero_();
  }

  AttentionProblem problem =
      make_problem(q, k, v_run, /*varlen_kv=*/true, shape.nheads, shape.nheads_k, shape.head_dim,
                   alibi_slopes, softmax_scale, window, softcap, dropout_p, philox);
  problem.sequences = varlen_sequences(
      shape.batch, cu_seqlens_q.data_ptr<int32_t>(), cu_seqlens_k.data_ptr<int32_t>(),
      used.defined() ? used.data_ptr<int32_t>() : nullptr,
      used_q.defined() ? used_q.data_ptr<int32_t>() : nullptr, nullptr, 0);
  BackwardTensors tensors;
  tensors.dout = dout_run.data_ptr();
  tensors.dout_strides = varlen_strides(dout_run);
  tensors.out = out_run.data_ptr();
  tensors.out_strides = varlen_strides(out_run);
  tensors.lse = softmax_lse.data_ptr<float>();
  tensors.lse_strides = {0, softmax_lse.stride(1), softmax_lse.stride(0)};
  if (softmax_d.has_value()) {
    tensors.delta_out = softmax_d->data_ptr<float>();
    tensors.delta_out_strides = {0, softmax_d->stride(1), softmax_d->stride(0)};
  }
  tensors.dq = dq.data_ptr();
  tensors.dq_strides = varlen_strides(dq);
  tensors.dk = dk.data_ptr();
  tensors.dk_strides = varlen_strides(dk);
  tensors.dv = dv.data_ptr();
  tensors.dv_strides = varlen_strides(dv);
  attention_backward(problem, tensors);
  return {dq, dk, crop_head_dim(dv, shape.head_dim_v)};
}

}  // namespace
}  // namespace flash::cpu

TORCH_LIBRARY_IMPL(flash_attn, CPU, m) {
  m.impl("fwd", &flash::cpu::fwd_cpu);
  m.impl("bwd", &flash::cpu::bwd_cpu);
  m.impl("varlen_fwd", &flash::cpu::varlen_fwd_cpu);
  m.impl("varlen_bwd", &flash::cpu::varlen_bwd_cpu);
  m.impl("fwd_out", &flash::cpu::fwd_out_cpu);
  m.impl("varlen_fwd_out", &flash::cpu::varlen_fwd_out_cpu);
}
