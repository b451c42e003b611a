// The backward ops, bwd and varlen_bwd: argument checks (shared with the CPU
// path), the gradients and fp32 work buffers, one BwdParams, the plan
// (plan_bwd) and the launcher of the compiled (dtype, head dim).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <optional>
#include <tuple>
#include <vector>

#include "api/head_dims.h"
#include "cuda/bwd/bwd_accum_layout.h"
#include "cuda/bwd/bwd_tile_config.h"
#include "cuda/fwd/fwd_tile_config.h"
#include "cuda/launch/launcher_registry.h"
#include "cuda/launch/plan.h"
#include "cuda/ops/op_common.h"

namespace flash {
namespace {

BwdLauncher bwd_launcher_for(int head_dim, at::ScalarType dtype) {
  const int compiled = round_up_head_dim(head_dim);
  const bool is_bf16 = dtype == at::kBFloat16;
  BwdLauncher launcher = find_bwd_launcher(compiled, is_bf16);
  TORCH_CHECK(launcher != nullptr, "flash_attn_cuda: the backward of head_dim ", head_dim, " in ",
              is_bf16 ? "bf16" : "fp16", " needs the compiled head dim ", compiled,
              ", which this build left out; rebuild with FLASH_ATTN_CUDA_HDIMS and "
              "FLASH_ATTN_CUDA_DTYPES including it");
  return launcher;
}

// The launcher of the plan's compiled (d_qk, d_v): bwd_launcher_for's, found
// before any allocation, or a specialised pair's (BwdPlan::head_dim_v below
// the compiled head dim), which the build has wherever it has d_qk's
// (setup.py selects instantiation files by d_qk).
BwdLauncher bwd_launcher_of_plan(const BwdPlan& plan, BwdLauncher launcher, at::ScalarType dtype) {
  if (plan.head_dim_v == plan.head_dim) return launcher;
  const BwdLauncher pair_launcher =
      find_bwd_launcher(plan.head_dim, plan.head_dim_v, dtype == at::kBFloat16);
  TORCH_CHECK(pair_launcher != nullptr, "flash_attn_cuda: the backward of the head dims (",
              plan.head_dim, ", ", plan.head_dim_v, ") is missing from this build");
  return pair_launcher;
}

// Everything bwd and varlen_bwd fill the same way. q/k/v/out/dout are already
// 16-byte aligned views; dq/dk/dv are fresh contiguous tensors.
void set_bwd_tensors(BwdParams& params, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& v, const at::Tensor& out, const at::Tensor& dout,
                     const at::Tensor& softmax_lse, const at::Tensor& dq, const at::Tensor& dk,
                     const at::Tensor& dv, bool varlen) {
  params.q_ptr = q.data_ptr();
  params.k_ptr = k.data_ptr();
  params.v_ptr = v.data_ptr();
  params.o_ptr = out.data_ptr();
  params.do_ptr = dout.data_ptr();
  params.dq_ptr = dq.data_ptr();
  params.dk_ptr = dk.data_ptr();
  params.dv_ptr = dv.data_ptr();
  params.softmax_lse_ptr = softmax_lse.data_ptr<float>();
  params.p_ptr = nullptr;
  params.q = strides_of(q, varlen);
  params.k = strides_of(k, varlen);
  params.v = strides_of(v, varlen);
  params.o = strides_of(out, varlen);
  params.dout = strides_of(dout, varlen);
  params.dq = strides_of(dq, varlen);
  params.dk = strides_of(dk, varlen);
  params.dv = strides_of(dv, varlen);
}

// The plan of a params whose shape, score rule and deterministic flag are
// set, on the current device; records the dQ accumulator's slices, which
// the workspace and the kernels read, in the params.
BwdPlan plan_for(BwdParams& params) {
  const DeviceDesc device = current_device_desc();
  const BwdPlan plan = plan_bwd(params, device, kernel_override_from_env("FLASH_ATTN_BWD_KERNEL"),
                                bwd_tma_can_load(params));
  TORCH_CHECK(!plan.smem_exceeds_device, "flash_attn: the backward of head dimension ",
              params.head_dim, " needs ", plan.sm80_smem_bytes,
              " bytes of shared memory per thread block (its SM80 kernel's tile at head dim ",
              plan.head_dim, "), more than this device's blocks may hold (",
              device.smem_per_block_optin, " bytes, compute capability ", device.cc_major, ".",
              device.cc_minor, ")");
  params.num_splits = plan.num_splits;
  return plan;
}

// The fp32 work buffers of the backward: D (the caller's softmax_d when it
// asked for it), the dQ accumulator (zeroed) and, under GQA, the kv heads'
// dK/dV sums (zeroed; dV's rows of the plan's compiled d_v,
// BwdPlan::head_dim_v, where a specialised pair's kernel runs), with their
// turn counters in deterministic mode. Reads the shape fields of params and
// params.num_splits, which must be set.
struct BwdWorkspace {
  at::Tensor softmax_d;
  at::Tensor dq_accum;
  at::Tensor dk_accum;  // GQA/MQA: the kv heads' sums
  at::Tensor dv_accum;
  at::Tensor dq_semaphore;   // plan.ordered_dq only
  at::Tensor dkv_semaphore;  // deterministic GQA/MQA only
};

BwdWorkspace make_bwd_workspace(BwdParams& params, const BwdPlan& plan,
                                const at::Tensor& softmax_lse, int compiled_head_dim,
                                const std::optional<at::Tensor>& softmax_d_out) {
  const auto f32 = softmax_lse.options().dtype(at::kFloat);
  // dV's sums: the pair kernel's own width, else d_qk's.
  const int accum_head_dim_v = plan.kernel == BwdKernel::kSm90 && plan.head_dim_v < plan.head_dim
                                   ? plan.head_dim_v
                                   : compiled_head_dim;
  BwdWorkspace ws;
  ws.softmax_d = softmax_d_out.has_value() ? *softmax_d_out : at::empty_like(softmax_lse, f32);
  // dQ accumulator: every sequence padded to whole query blocks
  // (bwd_accum_layout.h).
  const bool varlen = params.cu_seqlens_q != nullptr;
  params.dq_accum_rows_per_head =
      accum_rows_per_head(varlen, varlen ? params.total_q : params.seqlen_q, params.batch,
                          bwd_block_shape(compiled_head_dim).block_m);
  const int64_t heads_total = varlen ? params.nheads : int64_t(params.batch) * params.nheads;
  ws.dq_accum = at::zeros(
      {params.num_splits, heads_total, params.dq_accum_rows_per_head, compiled_head_dim}, f32);
  params.softmax_d_ptr = ws.softmax_d.data_ptr<float>();
  params.dq_accum_ptr = ws.dq_accum.data_ptr<float>();
  params.dq_accum_split_stride = ws.dq_accum.stride(0);
  params.dq_semaphore = nullptr;
  params.dq_semaphore_m_blocks = 0;
  if (plan.ordered_dq) {
    // One counter per (batch, head, query block of the plan's tile); varlen
    // sequences are at most seqlen_q (max_seqlen_q) long.
    params.dq_semaphore_m_blocks = (params.seqlen_q + plan.block_m - 1) / plan.block_m;
    ws.dq_semaphore =
        at::zeros({int64_t(params.batch) * params.nheads * params.dq_semaphore_m_blocks},
                  softmax_lse.options().dtype(at::kInt));
    params.dq_semaphore = ws.dq_semaphore.data_ptr<int>();
  }
  params.dk_sum_ptr = nullptr;
  params.dv_sum_ptr = nullptr;
  params.dkv_semaphore = nullptr;
  params.dkv_semaphore_n_blocks = 0;
  if (params.nheads != params.nheads_k) {
    // The kv heads' sums, padded to whole key blocks (bwd_accum_layout.h).
    const int block_n = bwd_block_shape(compiled_head_dim).block_n;
    params.dkv_sum_rows_per_head = accum_rows_per_head(
        varlen, varlen ? params.total_k : params.seqlen_k, params.batch, block_n);
    const int64_t kv_heads_total =
        varlen ? params.nheads_k : int64_t(params.batch) * params.nheads_k;
    ws.dk_accum = at::zeros({kv_heads_total, params.dkv_sum_rows_per_head, compiled_head_dim}, f32);
    ws.dv_accum = at::zeros({kv_heads_total, params.dkv_sum_rows_per_head, accum_head_dim_v}, f32);
    params.dk_sum_ptr = ws.dk_accum.data_ptr<float>();
    params.dv_sum_ptr = ws.dv_accum.data_ptr<float>();
    if (params.deterministic) {
      // One turn counter per (batch, kv head, key block of the plan's kernel,
      // head-dim slab of the SM80 kernel): the query heads add in head order
      // (bwd_block_io.h BwdDkvTurn); varlen sequences are at most seqlen_k
      // (max_seqlen_k) long.
      params.dkv_semaphore_n_blocks = (params.seqlen_k + plan.block_n - 1) / plan.block_n *
                                      bwd_block_shape(compiled_head_dim).slabs;
      ws.dkv_semaphore =
          at::zeros({int64_t(params.batch) * params.nheads_k * params.dkv_semaphore_n_blocks},
                    softmax_lse.options().dtype(at::kInt));
      params.dkv_semaphore = ws.dkv_semaphore.data_ptr<int>();
    }
  }
  return ws;
}

// BwdPlan::pad_v: the kernel the plan chose reads dO and V at d_qk columns,
// so it runs on v, out and dout zero-padded to d_qk (api/head_dims.h) and
// writes a d_qk-wide dv, which the op crops into the caller's dv (returned,
// with the padded tensors, to keep them alive across the launch). Without
// pad_v, nothing: the params keep the inputs at their own width.
struct PaddedValues {
  at::Tensor v, out, dout, dv;
};
PaddedValues pad_values_for_plan(BwdParams& params, const BwdPlan& plan, const at::Tensor& v,
                                 const at::Tensor& out, const at::Tensor& dout,
                                 const at::Tensor& dk, bool varlen) {
  if (!plan.pad_v) return {};
  PaddedValues padded{pad_head_dim(v, params.head_dim), pad_head_dim(out, params.head_dim),
                      pad_head_dim(dout, params.head_dim), at::zeros_like(dk)};
  params.v_ptr = padded.v.data_ptr();
  params.o_ptr = padded.out.data_ptr();
  params.do_ptr = padded.dout.data_ptr();
  params.dv_ptr = padded.dv.data_ptr();
  params.v = strides_of(padded.v, varlen);
  params.o = strides_of(padded.out, varlen);
  params.dout = strides_of(padded.dout, varlen);
  params.dv = strides_of(padded.dv, varlen);
  params.head_dim_v = params.head_dim;
  return padded;
}

// The caller's dv: the kernel's own, or the first d_v columns of the padded one.
at::Tensor finish_dv(const at::Tensor& dv, const PaddedValues& padded) {
  if (!padded.dv.defined()) return dv;
  dv.copy_(padded.dv.narrow(-1, 0, dv.size(-1)));
  return dv;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_cuda(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in,
    const at::Tensor& v_in, const at::Tensor& out_in, const at::Tensor& softmax_lse_in,
    const std::optional<at::Tensor>& alibi_slopes_in, double dropout_p, double softmax_scale,
    bool causal, int64_t window_size_left, int64_t window_size_right, double softcap,
    bool deterministic, const std::optional<at::Tensor>& rng_state,
    const std::optional<at::Tensor>& softmax_d) {
  refuse_fp8_backward("flash_attn", q_in, k_in, v_in);
  const FwdShape shape = check_bwd_args(dout_in, q_in, k_in, v_in, out_in, softmax_lse_in,
                                        alibi_slopes_in, dropout_p, softmax_scale, window_size_left,
                                        window_size_right, softcap, rng_state, kCudaDtypes);
  check_softmax_d_out("flash_attn", softmax_d, softmax_lse_in);
  const c10::cuda::CUDAGuard device_guard(q_in.device());
  check_device_supported(q_in);
  const IndexErrorSink index_errors = begin_index_checks(q_in);
  const BwdLauncher launcher = bwd_launcher_for(shape.head_dim, q_in.scalar_type());

  at::Tensor dq =
      at::empty({shape.batch, shape.seqlen_q, shape.nheads, shape.head_dim}, q_in.options());
  at::Tensor dk =
      at::empty({shape.batch, shape.seqlen_k, shape.nheads_k, shape.head_dim}, q_in.options());
  at::Tensor dv =
      at::empty({shape.batch, shape.seqlen_k, shape.nheads_k, shape.head_dim_v}, q_in.options());
  if (shape.batch == 0 || shape.nheads == 0 || shape.seqlen_q == 0 || shape.seqlen_k == 0) {
    // No query sees a key: every gradient is zero, and so is every output row.
    dq.zero_();
    dk.zero_();
    dv.zero_();
    if (softmax_d.has_value()) softmax_d->zero_();
    return {dq, dk, dv};
  }

  const at::Tensor q = aligned_for_16b_loads(q_in);
  const at::Tensor k = aligned_for_16b_loads(k_in);
  // d_v < d_qk: the kernels of d_qk read v, out and dout and write dv at
  // their own width (FwdParams::head_dim_v).
  const at::Tensor v = aligned_for_16b_loads(v_in);
  const at::Tensor out = aligned_for_16b_loads(out_in);
  const at::Tensor dout = aligned_for_16b_loads(dout_in);
  const at::Tensor softmax_lse = softmax_lse_in.contiguous();
  const std::optional<at::Tensor> alibi_slopes = contiguous_alibi(alibi_slopes_in);
  const Window window =
      normalize_window(causal, window_size_left, window_size_right, shape.seqlen_k);
  // Without dropout no kernel reads it (set_score_params takes undefined).
  const at::Tensor rng =
      dropout_p > 0 ? rng_state_for(0, 0, rng_state, dropout_p, q) : at::Tensor();

  BwdParams params{};
  set_bwd_tensors(params, q, k, v, out, dout, softmax_lse, dq, dk, dv, false);
  params.batch = shape.batch;
  params.nheads = shape.nheads;
  params.nheads_k = shape.nheads_k;
  params.seqlen_q = shape.seqlen_q;
  params.seqlen_k = shape.seqlen_k;
  params.head_dim = shape.head_dim;
  params.head_dim_v = shape.head_dim_v;
  params.cu_seqlens_q = nullptr;
  params.cu_seqlens_k = nullptr;
  params.total_q = 0;
  params.total_k = 0;
  set_score_params(params, q, softmax_scale, softcap, window, alibi_slopes, dropout_p, rng);
  params.index_errors = index_errors;
  params.deterministic = deterministic;

  const int compiled = round_up_head_dim(shape.head_dim);
  const BwdPlan plan = plan_for(params);
  const BwdWorkspace workspace = make_bwd_workspace(params, plan, softmax_lse, compiled, softmax_d);
  const PaddedValues padded = pad_values_for_plan(params, plan, v, out, dout, dk, false);
  bwd_launcher_of_plan(plan, launcher, q_in.scalar_type())(
      params, plan, at::cuda::getCurrentCUDAStream().stream());
  return {dq, dk, finish_dv(dv, padded)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_bwd_cuda(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in,
    const at::Tensor& v_in, const at::Tensor& out_in, const at::Tensor& softmax_lse_in,
    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
    const std::optional<at::Tensor>& alibi_slopes_in, int64_t max_seqlen_q, int64_t max_seqlen_k,
    double dropout_p, double softmax_scale, bool causal, int64_t window_size_left,
    int64_t window_size_right, double softcap, bool deterministic,
    const std::optional<at::Tensor>& rng_state, const std::optional<at::Tensor>& seqused_k,
    const std::optional<at::Tensor>& softmax_d, const std::optional<at::Tensor>& seqused_q) {
  refuse_fp8_backward("flash_attn", q_in, k_in, v_in);
  const VarlenShape shape = check_varlen_bwd_args(
      dout_in, q_in, k_in, v_in, out_in, softmax_lse_in, cu_seqlens_q, cu_seqlens_k, seqused_k,
      seqused_q, alibi_slopes_in, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
      window_size_left, window_size_right, softcap, rng_state, kCudaDtypes);
  check_softmax_d_out("flash_attn", softmax_d, softmax_lse_in);
  const c10::cuda::CUDAGuard device_guard(q_in.device());
  check_device_supported(q_in);
  const IndexErrorSink index_errors = begin_index_checks(q_in);
  const BwdLauncher launcher = bwd_launcher_for(shape.head_dim, q_in.scalar_type());

  // Zero-filled: rows outside every sequence, a sequence's keys past
  // seqused_k and its query rows past seqused_q get no gradient from the
  // kernels (BlockInfo bounds every loop and the dQ conversion by them).
  at::Tensor dq = at::zeros({shape.total_q, shape.nheads, shape.head_dim}, q_in.options());
  at::Tensor dk = at::zeros({shape.total_k, shape.nheads_k, shape.head_dim}, q_in.options());
  at::Tensor dv = at::zeros({shape.total_k, shape.nheads_k, shape.head_dim_v}, q_in.options());
  if (shape.batch == 0 || shape.nheads == 0 || shape.total_q == 0 || shape.total_k == 0 ||
      shape.max_seqlen_q == 0 || shape.max_seqlen_k == 0) {
    if (softmax_d.has_value()) softmax_d->zero_();
    return {dq, dk, dv};
  }

  const at::Tensor q = aligned_for_16b_loads(q_in);
  const at::Tensor k = aligned_for_16b_loads(k_in);
  // d_v < d_qk: v, out, dout and dv at their own width, as in bwd_cuda.
  const at::Tensor v = aligned_for_16b_loads(v_in);
  const at::Tensor out = aligned_for_16b_loads(out_in);
  const at::Tensor dout = aligned_for_16b_loads(dout_in);
  const at::Tensor softmax_lse = softmax_lse_in.contiguous();
  const at::Tensor cu_q = cu_seqlens_q.contiguous();
  const at::Tensor cu_k = cu_seqlens_k.contiguous();
  const at::Tensor used_k = seqused_k.has_value() ? seqused_k->contiguous() : at::Tensor();
  const at::Tensor used_q = seqused_q.has_value() ? seqused_q->contiguous() : at::Tensor();
  const std::optional<at::Tensor> alibi_slopes = contiguous_alibi(alibi_slopes_in);
  const Window window =
      normalize_window(causal, window_size_left, window_size_right, shape.max_seqlen_k);
  // Without dropout no kernel reads it (set_score_params takes undefined).
  const at::Tensor rng =
      dropout_p > 0 ? rng_state_for(0, 0, rng_state, dropout_p, q) : at::Tensor();

  BwdParams params{};
  set_bwd_tensors(params, q, k, v, out, dout, softmax_lse, dq, dk, dv, true);
  params.batch = shape.batch;
  params.nheads = shape.nheads;
  params.nheads_k = shape.nheads_k;
  params.seqlen_q = shape.max_seqlen_q;
  params.seqlen_k = shape.max_seqlen_k;
  params.head_dim = shape.head_dim;
  params.head_dim_v = shape.head_dim_v;
  params.cu_seqlens_q = cu_q.data_ptr<int>();
  params.cu_seqlens_k = cu_k.data_ptr<int>();
  params.seqused_k = used_k.defined() ? used_k.data_ptr<int>() : nullptr;
  params.seqused_q = used_q.defined() ? used_q.data_ptr<int>() : nullptr;
  params.total_q = shape.total_q;
  params.total_k = shape.total_k;
  set_score_params(params, q, softmax_scale, softcap, window, alibi_slopes, dropout_p, rng);
  params.index_errors = index_errors;
  params.deterministic = deterministic;

  const int compiled = round_up_head_dim(shape.head_dim);
  const BwdPlan plan = plan_for(params);
  const BwdWorkspace workspace = make_bwd_workspace(params, plan, softmax_lse, compiled, softmax_d);
  // The D kernel writes the used rows only; the caller's softmax_d gets 0 in
  // the rest, so that sink_grad takes nothing from them whatever out holds
  // there. One fill of an (nheads, total_q) fp32 tensor.
  if (used_q.defined() && softmax_d.has_value()) softmax_d->zero_();
  const PaddedValues padded = pad_values_for_plan(params, plan, v, out, dout, dk, true);
  bwd_launcher_of_plan(plan, launcher, q_in.scalar_type())(
      params, plan, at::cuda::getCurrentCUDAStream().stream());
  end_index_checks(q);
  return {dq, dk, finish_dv(dv, padded)};
}

}  // namespace flash
