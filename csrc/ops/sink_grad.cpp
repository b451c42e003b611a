// flash_attn::sink_grad: the gradient of the attention sinks
// (learnable_sink), one implementation in ATen ops for every device.
//
// Row i of head h gives its sink the probability p_sink(i) = exp(sink_h - lse_i)
// (lse_i includes the sink), and d sink_h = -sum_i p_sink(i) * D_i with
// D_i = rowsum(dO_i * O_i): the sink has no value row, so only the
// normaliser's share of the row's gradient reaches it. The forward's lse is
// all the backward ops need for dq / dk / dv, so they stay as they are and
// this op runs beside them. Its reductions are ATen sums over fixed shapes,
// reproducible run to run on both devices (deterministic mode included).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>

namespace flash {
namespace {

void check_row_stats(const at::Tensor& t, const char* name, const at::Tensor& lse) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, "sink_grad: ", name, " must have dtype float32, got ",
              t.scalar_type());
  TORCH_CHECK(t.device() == lse.device(), "sink_grad: ", name,
              " must be on the device of softmax_lse (", lse.device(), "), got ", t.device());
}

// softmax_lse / softmax_d: (batch, nheads, seqlen_q), or with cu_seqlens_q
// (varlen) (nheads, total_q). Varlen rows outside [cu_seqlens_q[0],
// cu_seqlens_q[batch]) belong to no sequence: their lse and D may hold
// anything and contribute 0.
at::Tensor sink_grad(const at::Tensor& softmax_lse, const at::Tensor& softmax_d,
                     const at::Tensor& learnable_sink,
                     const std::optional<at::Tensor>& cu_seqlens_q) {
  check_row_stats(softmax_lse, "softmax_lse", softmax_lse);
  check_row_stats(softmax_d, "softmax_d", softmax_lse);
  check_row_stats(learnable_sink, "learnable_sink", softmax_lse);
  TORCH_CHECK(softmax_d.sizes() == softmax_lse.sizes(),
              "sink_grad: softmax_d must have the shape of softmax_lse (", softmax_lse.sizes(),
              "), got ", softmax_d.sizes());
  const bool varlen = cu_seqlens_q.has_value();
  const int64_t heads_dim = varlen ? 0 : 1;
  TORCH_CHECK(softmax_lse.dim() == (varlen ? 2 : 3), "sink_grad: softmax_lse must be ",
              varlen ? "2-D (nheads, total_q) with cu_seqlens_q"
                     : "3-D (batch, nheads, seqlen_q) without cu_seqlens_q",
              ", got shape ", softmax_lse.sizes());
  const int64_t nheads = softmax_lse.size(heads_dim);
  TORCH_CHECK(learnable_sink.dim() == 1 && learnable_sink.size(0) == nheads,
              "sink_grad: learnable_sink must have shape (nheads,) = (", nheads, ",), got ",
              learnable_sink.sizes());

  if (!varlen) {
    const at::Tensor p_sink = at::exp(learnable_sink.view({1, nheads, 1}) - softmax_lse);
    return -(p_sink * softmax_d).sum(at::IntArrayRef{0, 2});
  }
  const at::Tensor& cu = *cu_seqlens_q;
  TORCH_CHECK(cu.scalar_type() == at::kInt, "sink_grad: cu_seqlens_q must have dtype int32, got ",
              cu.scalar_type());
  TORCH_CHECK(cu.device() == softmax_lse.device(),
              "sink_grad: cu_seqlens_q must be on the device of softmax_lse (",
              softmax_lse.device(), "), got ", cu.device());
  TORCH_CHECK(cu.dim() == 1 && cu.numel() >= 1,
              "sink_grad: cu_seqlens_q must be 1-D (batch + 1), got shape ", cu.sizes());
  const at::Tensor p_sink = at::exp(learnable_sink.view({nheads, 1}) - softmax_lse);
  // Read on the device (no host copy of cu_seqlens_q): a where, not a
  // product, so that a NaN of an unused row cannot leak in.
  const at::Tensor rows = at::arange(softmax_lse.size(1), cu.options());
  const at::Tensor used = rows.ge(cu.select(0, 0)).logical_and(rows.lt(cu.select(0, -1)));
  const at::Tensor terms =
      at::where(used.view({1, -1}), p_sink * softmax_d, at::zeros({}, softmax_lse.options()));
  return -terms.sum(at::IntArrayRef{1});
}

}  // namespace
}  // namespace flash

TORCH_LIBRARY_IMPL(flash_attn, CompositeExplicitAutograd, m) {
  m.impl("sink_grad", &flash::sink_grad);
}
