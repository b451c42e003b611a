// The forward ops, fwd and varlen_fwd (and their *_out forms, which write into
// the caller's out): argument checks (shared with the CPU path), output
// allocation, one FwdParams, the plan (plan_fwd) and the launcher of the
// compiled (dtype, head dim).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "common/head_dim_bounds.h"
#include "cuda/fwd/fwd_tile_config.h"
#include "cuda/fwd/paged_keys_check.h"
#include "cuda/launch/launcher_registry.h"
#include "cuda/launch/plan.h"
#include "cuda/ops/op_common.h"

namespace flash {
namespace {

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

// e4m3 keys and values (FP8 attention, or an FP8 KV cache under a 16-bit q)
// run on the split-KV kernel alone (plan_fwd_split), which has no dropout, no
// S_dmask and no seqused_q: those calls are refused by name, before anything
// is allocated (an fp8 call's dropout and S_dmask by check_fp8_features,
// first).
bool splitkv_only_call(int64_t head_dim, Fp8Call fp8) {
  return splitkv_only_head_dim(static_cast<int>(head_dim)) || fp8 != Fp8Call::kNone;
}

const char* splitkv_only_what(Fp8Call fp8) {
  switch (fp8) {
    case Fp8Call::kAttention: return "FP8 attention runs";
    case Fp8Call::kKvCache: return "an FP8 KV cache (float8_e4m3fn k and v) is read";
    case Fp8Call::kNone: break;
  }
  return "this call runs";
}

void check_splitkv_only_call(int64_t head_dim, Fp8Call fp8, double dropout_p, bool return_softmax,
                             bool seqused_q) {
  if (!splitkv_only_call(head_dim, fp8)) return;
  const char* what = dropout_p > 0.0  ? "dropout_p > 0"
                     : return_softmax ? "return_attn_probs (S_dmask)"
                     : seqused_q      ? "seqused_q"
                                      : nullptr;
  TORCH_CHECK(what == nullptr, "flash_attn (CUDA): ", splitkv_only_what(fp8),
              " on the split-KV kernel, which does not serve ", what, "; head_dim is ", head_dim,
              " (the CPU path serves it)");
}

// The launcher of the forward kernels, or none for calls that have only the
// split-KV kernel.
FwdLauncher launcher_unless_splitkv_only(int head_dim, Fp8Call fp8, at::ScalarType dtype) {
  return splitkv_only_call(head_dim, fp8) ? nullptr : launcher_for(head_dim, dtype);
}

// S_dmask (return_softmax) is written by a kernel of its own
// (return_probs.cu), which serves head dims up to 256.
void check_s_dmask_head_dim(int64_t head_dim, bool return_softmax) {
  TORCH_CHECK(!return_softmax || head_dim <= kMaxHeadDimCuda,
              "flash_attn (CUDA): return_attn_probs (S_dmask) is served up to head dim ",
              kMaxHeadDimCuda, "; head_dim is ", head_dim, " (the CPU path serves it)");
}

// A call with query rows whose plan found no kernel: FP8 attention where the
// split-KV kernel's blocks do not fit, or head dim 512 on a device of 99 KiB
// blocks (sm86 / sm89), whose shared memory holds neither of its kernels.
void check_plan_has_a_kernel(const FwdParams& params, bool has_kernel, const char* reason) {
  if (has_kernel || params.seqlen_q == 0 || params.batch == 0 || params.nheads == 0) return;
  TORCH_CHECK(!params.kv_fp8, "flash_attn (CUDA): e4m3 k and v at head_dim ", params.head_dim,
              " run on the split-KV kernel only, whose blocks this device's shared memory "
              "does not hold (an sm89 or sm90 GPU serves it)");
  TORCH_CHECK(false, "flash_attn (CUDA): no forward kernel of head_dim ", params.head_dim,
              " fits this device's shared memory per block (", reason,
              "); an sm80 or sm90 GPU serves it");
}

// FP8 attention's inputs as the split-KV kernel reads them: q converted to
// bfloat16, which holds every e4m3 value exactly (its descale goes into the
// scores' factor, attention_descales); k and v stay e4m3. Other calls: as
// given, rows 16-byte aligned.
at::Tensor q_for_kernels(const at::Tensor& q_in, Fp8Call fp8) {
  return aligned_for_16b_loads(fp8 == Fp8Call::kAttention ? q_in.to(at::kBFloat16) : q_in);
}

// The dtypes the shape checks accept for this fp8 form.
inline constexpr at::ScalarType kCudaFp8Dtypes[] = {at::kFloat8_e4m3fn};
c10::ArrayRef<at::ScalarType> cuda_dtypes_for(Fp8Call fp8) {
  if (fp8 == Fp8Call::kAttention) return kCudaFp8Dtypes;
  return kCudaDtypes;
}

// The launcher of the plan's compiled (d_qk, d_v): launcher_for's, found
// before any allocation, or a specialised pair's (FwdPlan::head_dim_v below
// the compiled head dim), which the build has wherever it has d_qk's
// (setup.py selects instantiation files by d_qk).
FwdLauncher launcher_of_plan(const FwdPlan& plan, FwdLauncher launcher, at::ScalarType dtype) {
  if (plan.head_dim_v == plan.head_dim) return launcher;
  const FwdLauncher pair_launcher =
      find_fwd_launcher(plan.head_dim, plan.head_dim_v, dtype == at::kBFloat16);
  TORCH_CHECK(pair_launcher != nullptr, "flash_attn_cuda: the forward of the head dims (",
              plan.head_dim, ", ", plan.head_dim_v, ") is missing from this build");
  return pair_launcher;
}

// Pointers and strides common to the fixed-length and varlen forward.
void set_fwd_tensors(FwdParams& params, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& v, const at::Tensor& out, const at::Tensor& softmax_lse,
                     const at::Tensor& s_dmask, bool return_softmax, bool varlen) {
  params.q_ptr = q.data_ptr();
  params.k_ptr = k.data_ptr();
  params.v_ptr = v.data_ptr();
  params.o_ptr = out.data_ptr();
  params.softmax_lse_ptr = softmax_lse.data_ptr<float>();
  params.p_ptr = return_softmax ? s_dmask.data_ptr() : nullptr;
  params.q = strides_of(q, varlen);
  params.k = strides_of(k, varlen);
  params.v = strides_of(v, varlen);
  params.o = strides_of(out, varlen);
}

// The plan of a filled params on the current device.
FwdPlan plan_for(const FwdParams& params) {
  return plan_fwd(params, current_device_desc(), kernel_override_from_env("FLASH_ATTN_FWD_KERNEL"),
                  fwd_tma_can_load(params));
}

// Room for the tile counter of the Hopper forward's counter grid
// (FwdGrid::kTileCounter), where the plan picked that grid; the launcher zeroes
// it on the stream. The caller keeps it alive across the launch.
at::Tensor tile_counter_for(FwdParams& params, const FwdPlan& plan, const at::Tensor& q) {
  params.tile_counter = nullptr;
  if (plan.grid != FwdGrid::kTileCounter) return at::Tensor();
  at::Tensor counter = at::empty({1}, q.options().dtype(at::kLong));
  params.tile_counter = reinterpret_cast<unsigned long long*>(counter.data_ptr<int64_t>());
  return counter;
}

// fwd and fwd_out: the output goes into out_given when there is one.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fwd_cuda_into(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const std::optional<at::Tensor>& alibi_slopes_in, double dropout_p, double softmax_scale,
    bool causal, int64_t window_size_left, int64_t window_size_right, double softcap,
    bool return_softmax, int64_t philox_seed, int64_t philox_offset,
    const std::optional<at::Tensor>& rng_state, const std::optional<at::Tensor>& out_given,
    const std::optional<at::Tensor>& learnable_sink_in, const char* op,
    const Fp8Descales& descales) {
  const Fp8Call fp8 = fp8_attention_call(q_in, k_in, v_in, descales);
  check_fp8_served_on_cuda(op, fp8, q_in);
  const FwdShape shape =
      check_fwd_args(q_in, k_in, v_in, alibi_slopes_in, dropout_p, softmax_scale, window_size_left,
                     window_size_right, softcap, rng_state, cuda_dtypes_for(fp8));
  const std::vector<int64_t> out_shape{shape.batch, shape.seqlen_q, shape.nheads, shape.head_dim_v};
  if (out_given.has_value()) {
    check_out_arg("flash_attn", *out_given, q_in, out_shape,
                  "(batch, seqlen_q, nheads, head_dim_v)", {&q_in, &k_in, &v_in},
                  fp8_out_dtype(fp8, q_in.scalar_type()));
  }
  if (fp8 != Fp8Call::kNone) {
    check_fp8_descales("flash_attn", descales, q_in, shape.batch, shape.nheads_k);
    check_fp8_features("flash_attn", dropout_p, return_softmax, alibi_slopes_in);
  }
  const std::optional<at::Tensor> learnable_sink =
      check_learnable_sink("flash_attn", learnable_sink_in, q_in, shape.nheads);
  const c10::cuda::CUDAGuard device_guard(q_in.device());
  check_device_supported(q_in);
  const IndexErrorSink index_errors = begin_index_checks(q_in);
  // d_v < d_qk runs on the kernel of d_qk, which reads v and writes out at
  // their own width (FwdParams::head_dim_v): no padded copy.
  check_splitkv_only_call(shape.head_dim, fp8, dropout_p, return_softmax, /*seqused_q=*/false);
  check_s_dmask_head_dim(shape.head_dim, return_softmax);
  const FwdLauncher launcher =
      launcher_unless_splitkv_only(shape.head_dim, fp8, q_in.scalar_type());
  const at::Tensor q = q_for_kernels(q_in, fp8);
  const at::Tensor k = aligned_for_16b_loads(k_in);
  const at::Tensor v = aligned_for_16b_loads(v_in);
  const std::optional<at::Tensor> alibi_slopes = contiguous_alibi(alibi_slopes_in);
  const Window window =
      normalize_window(causal, window_size_left, window_size_right, shape.seqlen_k);

  at::Tensor out = output_buffer(out_given, out_shape, q.options());
  at::Tensor softmax_lse =
      at::empty({shape.batch, shape.nheads, shape.seqlen_q}, q.options().dtype(at::kFloat));
  at::Tensor s_dmask =
      return_softmax
          ? at::zeros({shape.batch, shape.nheads, shape.seqlen_q, shape.seqlen_k}, q.options())
          : at::empty({0}, q_in.options());  // the CPU op's and the fake's dtype
  at::Tensor rng_state_out = rng_state_for(philox_seed, philox_offset, rng_state, dropout_p, q);

  FwdParams params{};
  set_fwd_tensors(params, q, k, v, out, softmax_lse, s_dmask, return_softmax, /*varlen=*/false);
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
  set_score_params(params, q, softmax_scale, softcap, window, alibi_slopes, dropout_p,
                   rng_state_out);
  set_learnable_sink(params, learnable_sink);
  params.index_errors = index_errors;
  params.kv_fp8 = fp8 != Fp8Call::kNone;
  const FwdPlan plan = plan_for(params);
  check_plan_has_a_kernel(params, plan.kernel != FwdKernel::kNone, plan.reason);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  if (plan.kernel == FwdKernel::kSplitKv) {
    const SplitKvDescales fp8_descales =
        params.kv_fp8 ? attention_descales(descales) : SplitKvDescales{};
    run_fwd_splitkv(params, plan.splitkv, q, stream, fp8_descales);
  } else {
    const at::Tensor tile_counter = tile_counter_for(params, plan, q);
    launcher_of_plan(plan, launcher, q.scalar_type())(params, plan, stream);
  }
  return {finish_output(out_given, out), softmax_lse, s_dmask, rng_state_out};
}

// varlen_fwd and varlen_fwd_out: the output goes into out_given when there is
// one.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> varlen_fwd_cuda_into(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
    const std::optional<at::Tensor>& block_table, const std::optional<at::Tensor>& alibi_slopes_in,
    int64_t max_seqlen_q, int64_t max_seqlen_k, double dropout_p, double softmax_scale, bool causal,
    int64_t window_size_left, int64_t window_size_right, double softcap, bool return_softmax,
    int64_t philox_seed, int64_t philox_offset, const std::optional<at::Tensor>& rng_state,
    const std::optional<at::Tensor>& seqused_k, const std::optional<at::Tensor>& out_given,
    const std::optional<at::Tensor>& learnable_sink_in, const std::optional<at::Tensor>& seqused_q,
    int64_t num_splits, const char* op, const Fp8Descales& descales) {
  const Fp8Call fp8 = fp8_attention_call(q_in, k_in, v_in, descales);
  check_fp8_served_on_cuda(op, fp8, q_in);
  check_num_splits(num_splits);
  const VarlenShape shape = check_varlen_fwd_args(
      q_in, k_in, v_in, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k, seqused_q,
      alibi_slopes_in, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, window_size_left,
      window_size_right, softcap, rng_state, cuda_dtypes_for(fp8));
  const std::vector<int64_t> out_shape{shape.total_q, shape.nheads, shape.head_dim_v};
  if (out_given.has_value()) {
    check_out_arg("flash_attn", *out_given, q_in, out_shape, "(total_q, nheads, head_dim_v)",
                  {&q_in, &k_in, &v_in}, fp8_out_dtype(fp8, q_in.scalar_type()));
  }
  if (fp8 != Fp8Call::kNone) {
    check_fp8_descales("flash_attn", descales, q_in, shape.batch, shape.nheads_k);
    check_fp8_features("flash_attn", dropout_p, return_softmax, alibi_slopes_in);
  }
  const std::optional<at::Tensor> learnable_sink =
      check_learnable_sink("flash_attn", learnable_sink_in, q_in, shape.nheads);
  const c10::cuda::CUDAGuard device_guard(q_in.device());
  check_device_supported(q_in);
  const IndexErrorSink index_errors = begin_index_checks(q_in);
  // d_v < d_qk: v and out at their own width, as in fwd_cuda_into.
  check_splitkv_only_call(shape.head_dim, fp8, dropout_p, return_softmax, seqused_q.has_value());
  check_s_dmask_head_dim(shape.head_dim, return_softmax);
  const FwdLauncher launcher =
      launcher_unless_splitkv_only(shape.head_dim, fp8, q_in.scalar_type());
  const at::Tensor q = q_for_kernels(q_in, fp8);
  const at::Tensor cu_q = cu_seqlens_q.contiguous();
  // Paged K/V are read in place: the kernels locate each key through the
  // block table (paged_rows.h), cu_seqlens_k then gives lengths only.
  const at::Tensor k = aligned_for_16b_loads(k_in);
  const at::Tensor v = aligned_for_16b_loads(v_in);
  const at::Tensor cu_k = cu_seqlens_k.contiguous();
  const at::Tensor used_k = seqused_k.has_value() ? seqused_k->contiguous() : at::Tensor();
  const at::Tensor used_q = seqused_q.has_value() ? seqused_q->contiguous() : at::Tensor();
  const at::Tensor table = shape.paged ? block_table->contiguous() : at::Tensor();
  const std::optional<at::Tensor> alibi_slopes = contiguous_alibi(alibi_slopes_in);
  const Window window =
      normalize_window(causal, window_size_left, window_size_right, shape.max_seqlen_k);

  at::Tensor out = output_buffer(out_given, out_shape, q.options());
  at::Tensor softmax_lse = at::empty({shape.nheads, shape.total_q}, q.options().dtype(at::kFloat));
  if (used_q.defined()) {
    // The kernels compute and write only each sequence's first seqused_q[b]
    // rows (BlockInfo). The rest get lse +inf (as a row that sees no key, so
    // that exp(s - lse) and a sink's share exp(sink - lse) are 0 for any
    // reader) and out 0, by filling before the launch: a memset runs at full
    // write bandwidth, reads nothing and needs no row mask (seqused_q is on
    // the device, and a masked fill after the kernel would read and write
    // the whole tensor again); the alternative, the empty-row path of each
    // kernel's epilogue (sm80, sm90), would put another row bound in every
    // design. lse is (nheads, total_q) fp32, small beside out.
    softmax_lse.fill_(std::numeric_limits<float>::infinity());
    if (!out_given.has_value()) {
      out.zero_();
    } else if (!out.is_same(*out_given)) {
      // A caller's out keeps its rows past seqused_q, as FA3 does: a serving
      // engine passes out= to avoid every write it does not need (the padded
      // query slots of a captured batch) and reads only the used rows. A
      // scratch buffer (an unaligned out) is copied back whole, so it starts
      // from the caller's values.
      out.copy_(*out_given);
    }
  }
  at::Tensor s_dmask =
      return_softmax
          ? at::zeros({shape.batch, shape.nheads, shape.max_seqlen_q, shape.max_seqlen_k},
                      q.options())
          : at::empty({0}, q_in.options());  // the CPU op's and the fake's dtype
  at::Tensor rng_state_out = rng_state_for(philox_seed, philox_offset, rng_state, dropout_p, q);

  FwdParams params{};
  set_fwd_tensors(params, q, k, v, out, softmax_lse, s_dmask, return_softmax, /*varlen=*/true);
  if (shape.paged) {
    // (num_pages, page_size, nheads_k, head_dim): page, row and head strides.
    params.k = strides_of(k, /*varlen=*/false);
    params.v = strides_of(v, /*varlen=*/false);
    params.block_table = table.data_ptr<int>();
    params.block_table_batch_stride = table.stride(0);
    params.page_size = IntDivisor(shape.page_size);
    params.num_pages = shape.num_blocks;
    // The rows a table row addresses, cut to max_seqlen_k (BlockInfo's bound
    // on a sequence's keys).
    params.paged_max_seqlen_k = static_cast<int>(
        std::min<int64_t>(shape.max_seqlen_k, int64_t(shape.max_blocks_per_seq) * shape.page_size));
  }
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
  set_score_params(params, q, softmax_scale, softcap, window, alibi_slopes, dropout_p,
                   rng_state_out);
  set_learnable_sink(params, learnable_sink);
  params.index_errors = index_errors;
  params.kv_fp8 = fp8 != Fp8Call::kNone;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  // num_splits (FA3's): the split-KV run where plan_varlen_split takes it.
  const DecodePlan split_plan = plan_varlen_split(
      params, num_splits, kernel_override_from_env("FLASH_ATTN_FWD_KERNEL"), current_device_desc());
  // Paged: the lengths and table entries the kernels clamp are reported by
  // one check, a kernel before the forward kernels, or blocks of a split
  // run's combine grid (a decode step's kernels are a few microseconds; the
  // check kernel before them had cost about 4, PERF_LOG 2026-12-01).
  if (split_plan.num_splits > 0) {
    const SplitKvDescales fp8_descales =
        params.kv_fp8 ? attention_descales(descales) : SplitKvDescales{};
    if (!run_fwd_splitkv(params, split_plan, q, stream, fp8_descales)) {
      launch_check_paged_keys(params, stream);
    }
  } else {
    launch_check_paged_keys(params, stream);
    check_plan_has_a_kernel(params, !params.kv_fp8, split_plan.reason);
    const FwdPlan plan = plan_for(params);
    check_plan_has_a_kernel(params, plan.kernel != FwdKernel::kNone, plan.reason);
    const at::Tensor tile_counter = tile_counter_for(params, plan, q);
    launcher_of_plan(plan, launcher, q.scalar_type())(params, plan, stream);
  }
  end_index_checks(q);
  return {finish_output(out_given, out), softmax_lse, s_dmask, rng_state_out};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fwd_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& alibi_slopes, double dropout_p, double softmax_scale,
    bool causal, int64_t window_size_left, int64_t window_size_right, double softcap,
    bool return_softmax, int64_t philox_seed, int64_t philox_offset,
    const std::optional<at::Tensor>& rng_state, const std::optional<at::Tensor>& learnable_sink,
    const std::optional<at::Tensor>& q_descale, const std::optional<at::Tensor>& k_descale,
    const std::optional<at::Tensor>& v_descale) {
  return fwd_cuda_into(q, k, v, alibi_slopes, dropout_p, softmax_scale, causal, window_size_left,
                       window_size_right, softcap, return_softmax, philox_seed, philox_offset,
                       rng_state, std::nullopt, learnable_sink, "fwd",
                       {q_descale, k_descale, v_descale});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fwd_out_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& alibi_slopes, double dropout_p, double softmax_scale,
    bool causal, int64_t window_size_left, int64_t window_size_right, double softcap,
    bool return_softmax, int64_t philox_seed, int64_t philox_offset,
    const std::optional<at::Tensor>& rng_state, const at::Tensor& out,
    const std::optional<at::Tensor>& learnable_sink, const std::optional<at::Tensor>& q_descale,
    const std::optional<at::Tensor>& k_descale, const std::optional<at::Tensor>& v_descale) {
  auto [written, softmax_lse, s_dmask, rng_state_out] =
      fwd_cuda_into(q, k, v, alibi_slopes, dropout_p, softmax_scale, causal, window_size_left,
                    window_size_right, softcap, return_softmax, philox_seed, philox_offset,
                    rng_state, out, learnable_sink, "fwd_out", {q_descale, k_descale, v_descale});
  return {softmax_lse, s_dmask, rng_state_out};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> varlen_fwd_cuda(
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
  return varlen_fwd_cuda_into(
      q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes, max_seqlen_q, max_seqlen_k,
      dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
      return_softmax, philox_seed, philox_offset, rng_state, seqused_k, std::nullopt,
      learnable_sink, seqused_q, num_splits, "varlen_fwd", {q_descale, k_descale, v_descale});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_fwd_out_cuda(
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
  auto [written, softmax_lse, s_dmask, rng_state_out] = varlen_fwd_cuda_into(
      q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes, max_seqlen_q, max_seqlen_k,
      dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
      return_softmax, philox_seed, philox_offset, rng_state, seqused_k, out, learnable_sink,
      seqused_q, num_splits, "varlen_fwd_out", {q_descale, k_descale, v_descale});
  return {softmax_lse, s_dmask, rng_state_out};
}

}  // namespace flash
