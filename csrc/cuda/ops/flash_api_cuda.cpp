// CUDA implementations of the flash_attn ops: argument checks (shared with the
// CPU path), output allocation, one FwdParams, dispatch on (dtype, head dim) to
// a compiled launcher. Kernels live in the .cu files; this file is the only
// CUDA translation unit that sees torch.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "api/checks.h"
#include "api/kvcache_checks.h"
#include "common/philox.h"
#include "cuda/bwd/bwd_accum_layout.h"
#include "cuda/bwd/bwd_tile_config.h"
#include "cuda/core/params.h"
#include "cuda/decode/kvcache_append_rotary.h"
#include "cuda/decode/paged_gather.h"
#include "cuda/decode/splitkv_tile_config.h"
#include "cuda/fwd/fwd_tile_config.h"
#include "cuda/fwd/fwd_tile_schedule.h"
#include "cuda/launch/launcher_registry.h"
#include "cuda/ops/index_error_state.h"

namespace flash {
namespace {

constexpr at::ScalarType kCudaDtypes[] = {at::kHalf, at::kBFloat16};

void check_device_supported(const at::Tensor& q) {
  const cudaDeviceProp* props = at::cuda::getDeviceProperties(q.get_device());
  TORCH_CHECK(props->major >= 8, "flash_attn_cuda needs an sm80 or newer GPU; ", props->name,
              " is sm", props->major, props->minor);
}

// Every op starts here, after its device guard: raises what a kernel of an
// earlier call on this device recorded (index_error_state.h) and returns the
// sink this call's kernels record into.
IndexErrorSink begin_index_checks(const at::Tensor& q) {
  return flash::begin_index_checks(q.get_device(), at::cuda::getCurrentCUDAStream().stream());
}

// The end of a call that read index tensors (sync checks only).
void end_index_checks(const at::Tensor& q) {
  finish_index_checks(q.get_device(), at::cuda::getCurrentCUDAStream().stream());
}

// cp.async moves 16-byte chunks: every row of a (.., seqlen, heads, dim) view
// must start 16-byte aligned. Packed-qkv slices satisfy this; anything else is
// copied once rather than refused.
at::Tensor aligned_for_16b_loads(const at::Tensor& t) {
  constexpr int64_t kElemsPer16B = 8;  // fp16 / bf16
  bool aligned = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int64_t dim = 0; dim + 1 < t.dim(); ++dim) {
    aligned = aligned && (t.size(dim) <= 1 || t.stride(dim) % kElemsPer16B == 0);
  }
  return aligned ? t : t.contiguous();
}

QKVStrides strides_of(const at::Tensor& t, bool varlen) {
  // Fixed length: (batch, seqlen, heads, dim); varlen: (total, heads, dim).
  if (varlen) return {0, t.stride(0), t.stride(1)};
  return {t.stride(0), t.stride(1), t.stride(2)};
}

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
  params.rng_state = rng_state_out.data_ptr<int64_t>();
  params.is_bf16 = q.scalar_type() == at::kBFloat16;
}

// Room for the tile counter a causal / local forward on the Hopper kernel may
// take its tiles from (fwd_tile_schedule.h); undefined where no grid could.
// The launcher zeroes it on the stream only if the grid it picks takes tiles
// from it (fwd_launch.h: not every head dim has that grid, and short
// keys run the SM80 kernel). The caller keeps it alive across the launch.
at::Tensor tile_counter_for(FwdParams& params, const at::Tensor& q) {
  params.tile_counter = nullptr;
  if (!fwd_sm90_takes_tiles_from_counter(params)) return at::Tensor();
  at::Tensor counter = at::empty({1}, q.options().dtype(at::kLong));
  params.tile_counter = reinterpret_cast<unsigned long long*>(counter.data_ptr<int64_t>());
  return counter;
}

// The rng_state the forward returns and the kernel reads: on q's device. With
// no dropout nothing is drawn, and a device fill avoids a host round trip.
at::Tensor rng_state_for(int64_t philox_seed, int64_t philox_offset,
                         const std::optional<at::Tensor>& rng_state, double dropout_p,
                         const at::Tensor& q) {
  if (dropout_p > 0) return output_rng_state(philox_seed, philox_offset, rng_state, q.device());
  return at::zeros({2}, q.options().dtype(at::kLong));
}

std::optional<at::Tensor> contiguous_alibi(const std::optional<at::Tensor>& alibi_slopes) {
  if (!alibi_slopes.has_value()) return std::nullopt;
  return alibi_slopes->contiguous();
}

// Pointers and strides common to the fixed-length and varlen forward.
// The kernel design for one pass's plain score rule on this GPU. On sm90 the
// environment variable `forcing_variable` = sm80 / sm90 forces one of the two
// (read per call: the tests switch it between calls); anything else lets the
// launcher pick.
KernelChoice kernel_choice(const char* forcing_variable) {
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  if (props->major != 9 || props->minor != 0) return KernelChoice::kSm80;
  const char* forced = std::getenv(forcing_variable);
  if (forced != nullptr && std::strcmp(forced, "sm80") == 0) return KernelChoice::kSm80;
  if (forced != nullptr && std::strcmp(forced, "sm90") == 0) return KernelChoice::kSm90;
  return KernelChoice::kAuto;
}

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
  params.fwd_kernel = kernel_choice("FLASH_ATTN_FWD_KERNEL");
  params.num_sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fwd_cuda(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const std::optional<at::Tensor>& alibi_slopes_in, double dropout_p, double softmax_scale,
    bool causal, int64_t window_size_left, int64_t window_size_right, double softcap,
    bool return_softmax, int64_t philox_seed, int64_t philox_offset,
    const std::optional<at::Tensor>& rng_state) {
  const FwdShape shape =
      check_fwd_args(q_in, k_in, v_in, alibi_slopes_in, dropout_p, softmax_scale, window_size_left,
                     window_size_right, softcap, rng_state, kCudaDtypes);
  const c10::cuda::CUDAGuard device_guard(q_in.device());
  check_device_supported(q_in);
  const IndexErrorSink index_errors = begin_index_checks(q_in);
  const FwdLauncher launcher = launcher_for(shape.head_dim, q_in.scalar_type());
  const at::Tensor q = aligned_for_16b_loads(q_in);
  const at::Tensor k = aligned_for_16b_loads(k_in);
  const at::Tensor v = aligned_for_16b_loads(v_in);
  const std::optional<at::Tensor> alibi_slopes = contiguous_alibi(alibi_slopes_in);
  const Window window =
      normalize_window(causal, window_size_left, window_size_right, shape.seqlen_k);

  at::Tensor out =
      at::empty({shape.batch, shape.seqlen_q, shape.nheads, shape.head_dim}, q.options());
  at::Tensor softmax_lse =
      at::empty({shape.batch, shape.nheads, shape.seqlen_q}, q.options().dtype(at::kFloat));
  at::Tensor s_dmask =
      return_softmax
          ? at::zeros({shape.batch, shape.nheads, shape.seqlen_q, shape.seqlen_k}, q.options())
          : at::empty({0}, q.options());
  at::Tensor rng_state_out = rng_state_for(philox_seed, philox_offset, rng_state, dropout_p, q);

  FwdParams params{};
  set_fwd_tensors(params, q, k, v, out, softmax_lse, s_dmask, return_softmax, /*varlen=*/false);
  params.batch = shape.batch;
  params.nheads = shape.nheads;
  params.nheads_k = shape.nheads_k;
  params.seqlen_q = shape.seqlen_q;
  params.seqlen_k = shape.seqlen_k;
  params.head_dim = shape.head_dim;
  params.cu_seqlens_q = nullptr;
  params.cu_seqlens_k = nullptr;
  params.total_q = 0;
  set_score_params(params, q, softmax_scale, softcap, window, alibi_slopes, dropout_p,
                   rng_state_out);
  params.index_errors = index_errors;
  const at::Tensor tile_counter = tile_counter_for(params, q);
  launcher(params, at::cuda::getCurrentCUDAStream().stream());
  return {out, softmax_lse, s_dmask, rng_state_out};
}

// Paged K/V for the varlen forward: the keys each sequence reaches, gathered
// into packed tensors (see paged_gather.h) with their own row offsets. The
// sequence lengths stay on the device (no synchronisation): they are cut to
// max_rows_per_seq, so the packed tensors (batch x max_rows_per_seq rows) hold
// every row the forward kernel reads whatever cu_seqlens_k holds.
std::tuple<at::Tensor, at::Tensor, at::Tensor> gather_paged_kv(
    const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cu_seqlens_k,
    const at::Tensor& block_table_in, const VarlenShape& shape, IndexErrorSink index_errors) {
  const at::Tensor cu_k = cu_seqlens_k.contiguous();
  const at::Tensor block_table = block_table_in.contiguous();
  // No sequence is longer than max_seqlen_k or than its block-table row can
  // address (the gather kernel reports longer ones, paged_gather.h).
  const int64_t max_rows_per_seq =
      shape.num_blocks == 0
          ? 0
          : std::min<int64_t>(shape.max_seqlen_k,
                              int64_t(shape.max_blocks_per_seq) * shape.page_size);
  const at::Tensor lengths =
      (cu_k.slice(0, 1) - cu_k.slice(0, 0, shape.batch)).clamp(0, max_rows_per_seq);
  at::Tensor cu_packed = at::zeros({shape.batch + 1}, cu_k.options());
  cu_packed.slice(0, 1).copy_(lengths.cumsum(0));
  const int64_t rows = int64_t(shape.batch) * max_rows_per_seq;
  at::Tensor k_packed = at::empty({rows, shape.nheads_k, shape.head_dim}, k_cache.options());
  at::Tensor v_packed = at::empty({rows, shape.nheads_k, shape.head_dim}, v_cache.options());

  PagedGatherParams params{};
  params.k_cache = k_cache.data_ptr();
  params.v_cache = v_cache.data_ptr();
  params.k_block_stride = k_cache.stride(0);
  params.k_row_stride = k_cache.stride(1);
  params.k_head_stride = k_cache.stride(2);
  params.v_block_stride = v_cache.stride(0);
  params.v_row_stride = v_cache.stride(1);
  params.v_head_stride = v_cache.stride(2);
  params.k_packed = k_packed.data_ptr();
  params.v_packed = v_packed.data_ptr();
  params.cu_seqlens_packed = cu_packed.data_ptr<int>();
  params.block_table = block_table.data_ptr<int>();
  params.block_table_batch_stride = block_table.stride(0);
  params.batch = shape.batch;
  params.max_seqlen_k = static_cast<int>(max_rows_per_seq);
  params.page_size = IntDivisor(shape.page_size);
  params.num_blocks = shape.num_blocks;
  params.nheads_k = shape.nheads_k;
  params.head_dim = shape.head_dim;
  params.cu_seqlens_k = cu_k.data_ptr<int>();
  params.max_seqlen_k_given = shape.max_seqlen_k;
  params.max_blocks_per_seq = shape.max_blocks_per_seq;
  params.index_errors = index_errors;
  launch_gather_paged_rows(params, at::cuda::getCurrentCUDAStream().stream());
  return {k_packed, v_packed, cu_packed};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> varlen_fwd_cuda(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
    const std::optional<at::Tensor>& block_table, const std::optional<at::Tensor>& alibi_slopes_in,
    int64_t max_seqlen_q, int64_t max_seqlen_k, double dropout_p, double softmax_scale, bool causal,
    int64_t window_size_left, int64_t window_size_right, double softcap, bool return_softmax,
    int64_t philox_seed, int64_t philox_offset, const std::optional<at::Tensor>& rng_state) {
  const VarlenShape shape =
      check_varlen_fwd_args(q_in, k_in, v_in, cu_seqlens_q, cu_seqlens_k, block_table,
                            alibi_slopes_in, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                            window_size_left, window_size_right, softcap, rng_state, kCudaDtypes);
  const c10::cuda::CUDAGuard device_guard(q_in.device());
  check_device_supported(q_in);
  const IndexErrorSink index_errors = begin_index_checks(q_in);
  const FwdLauncher launcher = launcher_for(shape.head_dim, q_in.scalar_type());
  const at::Tensor q = aligned_for_16b_loads(q_in);
  const at::Tensor cu_q = cu_seqlens_q.contiguous();
  at::Tensor k, v, cu_k;
  if (shape.paged) {
    std::tie(k, v, cu_k) =
        gather_paged_kv(k_in, v_in, cu_seqlens_k, *block_table, shape, index_errors);
  } else {
    k = aligned_for_16b_loads(k_in);
    v = aligned_for_16b_loads(v_in);
    cu_k = cu_seqlens_k.contiguous();
  }
  const std::optional<at::Tensor> alibi_slopes = contiguous_alibi(alibi_slopes_in);
  const Window window =
      normalize_window(causal, window_size_left, window_size_right, shape.max_seqlen_k);

  at::Tensor out = at::empty({shape.total_q, shape.nheads, shape.head_dim}, q.options());
  at::Tensor softmax_lse = at::empty({shape.nheads, shape.total_q}, q.options().dtype(at::kFloat));
  at::Tensor s_dmask =
      return_softmax
          ? at::zeros({shape.batch, shape.nheads, shape.max_seqlen_q, shape.max_seqlen_k},
                      q.options())
          : at::empty({0}, q.options());
  at::Tensor rng_state_out = rng_state_for(philox_seed, philox_offset, rng_state, dropout_p, q);

  FwdParams params{};
  set_fwd_tensors(params, q, k, v, out, softmax_lse, s_dmask, return_softmax, /*varlen=*/true);
  params.batch = shape.batch;
  params.nheads = shape.nheads;
  params.nheads_k = shape.nheads_k;
  params.seqlen_q = shape.max_seqlen_q;
  params.seqlen_k = shape.max_seqlen_k;
  params.head_dim = shape.head_dim;
  params.cu_seqlens_q = cu_q.data_ptr<int>();
  params.cu_seqlens_k = cu_k.data_ptr<int>();
  params.total_q = shape.total_q;
  params.total_k = static_cast<int>(k.size(0));
  set_score_params(params, q, softmax_scale, softcap, window, alibi_slopes, dropout_p,
                   rng_state_out);
  params.index_errors = index_errors;
  const at::Tensor tile_counter = tile_counter_for(params, q);
  launcher(params, at::cuda::getCurrentCUDAStream().stream());
  end_index_checks(q);
  return {out, softmax_lse, s_dmask, rng_state_out};
}

[[noreturn]] void not_on_cuda_yet(const char* op) {
  TORCH_CHECK(false, "flash_attn_cuda: ", op,
              " has no CUDA kernel in this version yet; run it on CPU tensors");
}

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

// Deterministic dQ: each of num_splits thread blocks per (batch, head) owns one
// fp32 slice and walks its key blocks in order, so every element's additions
// happen in a fixed order; the slices are summed in order afterwards. Enough
// splits to keep about two blocks per SM, never more than there are key blocks.
int deterministic_dq_splits(int batch, int nheads, int max_seqlen_k, int compiled_head_dim) {
  const int block_n = bwd_block_shape(compiled_head_dim).block_n;
  const int num_n_blocks = (max_seqlen_k + block_n - 1) / block_n;
  const int sm_count = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t heads_total = std::max<int64_t>(int64_t(batch) * nheads, 1);
  const int64_t wanted = (2 * int64_t(sm_count) + heads_total - 1) / heads_total;
  return static_cast<int>(std::clamp<int64_t>(wanted, 1, std::max(num_n_blocks, 1)));
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

// The fp32 work buffers of the backward: D, the dQ accumulator (zeroed) and,
// under GQA, the kv heads' dK/dV sums (zeroed) or, deterministic, the
// per-query-head dK/dV shares, of dkv_accum_shape: (batch, nheads, seqlen_k)
// or (nheads, total_k), then the compiled head dim. Reads the shape fields of
// params, which must be set.
struct BwdWorkspace {
  at::Tensor softmax_d;
  at::Tensor dq_accum;
  at::Tensor dk_accum;  // the kv heads' sums or the per-head shares (see below)
  at::Tensor dv_accum;
};

BwdWorkspace make_bwd_workspace(BwdParams& params, const at::Tensor& softmax_lse,
                                at::IntArrayRef dkv_accum_shape, int compiled_head_dim,
                                int num_splits, bool deterministic) {
  const auto f32 = softmax_lse.options().dtype(at::kFloat);
  BwdWorkspace ws;
  ws.softmax_d = at::empty_like(softmax_lse, f32);
  // dQ accumulator: every sequence padded to whole query blocks
  // (bwd_accum_layout.h).
  const bool varlen = params.cu_seqlens_q != nullptr;
  params.dq_accum_rows_per_head =
      accum_rows_per_head(varlen, varlen ? params.total_q : params.seqlen_q, params.batch,
                          bwd_block_shape(compiled_head_dim).block_m);
  const int64_t heads_total = varlen ? params.nheads : int64_t(params.batch) * params.nheads;
  ws.dq_accum =
      at::zeros({num_splits, heads_total, params.dq_accum_rows_per_head, compiled_head_dim}, f32);
  params.softmax_d_ptr = ws.softmax_d.data_ptr<float>();
  params.dq_accum_ptr = ws.dq_accum.data_ptr<float>();
  params.dq_accum_split_stride = ws.dq_accum.stride(0);
  params.num_splits = num_splits;
  params.deterministic = deterministic;
  params.smem_per_block_optin = int(at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin);
  params.bwd_kernel = kernel_choice("FLASH_ATTN_BWD_KERNEL");
  params.dk_accum_ptr = nullptr;
  params.dv_accum_ptr = nullptr;
  params.dk_sum_ptr = nullptr;
  params.dv_sum_ptr = nullptr;
  if (params.nheads != params.nheads_k && deterministic) {
    // Every row the reduction reads is written by the main kernel: no zeroing.
    ws.dk_accum = at::empty(dkv_accum_shape, f32);
    ws.dv_accum = at::empty(dkv_accum_shape, f32);
    params.dk_accum_ptr = ws.dk_accum.data_ptr<float>();
    params.dv_accum_ptr = ws.dv_accum.data_ptr<float>();
  } else if (params.nheads != params.nheads_k) {
    // The kv heads' sums, padded to whole key blocks (bwd_accum_layout.h).
    params.dkv_sum_rows_per_head =
        accum_rows_per_head(varlen, varlen ? params.total_k : params.seqlen_k, params.batch,
                            bwd_block_shape(compiled_head_dim).block_n);
    const int64_t kv_heads_total =
        varlen ? params.nheads_k : int64_t(params.batch) * params.nheads_k;
    ws.dk_accum = at::zeros({kv_heads_total, params.dkv_sum_rows_per_head, compiled_head_dim}, f32);
    ws.dv_accum = at::zeros_like(ws.dk_accum);
    params.dk_sum_ptr = ws.dk_accum.data_ptr<float>();
    params.dv_sum_ptr = ws.dv_accum.data_ptr<float>();
  }
  return ws;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_cuda(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in,
    const at::Tensor& v_in, const at::Tensor& out_in, const at::Tensor& softmax_lse_in,
    const std::optional<at::Tensor>& alibi_slopes_in, double dropout_p, double softmax_scale,
    bool causal, int64_t window_size_left, int64_t window_size_right, double softcap,
    bool deterministic, const std::optional<at::Tensor>& rng_state) {
  const FwdShape shape = check_bwd_args(dout_in, q_in, k_in, v_in, out_in, softmax_lse_in,
                                        alibi_slopes_in, dropout_p, softmax_scale, window_size_left,
                                        window_size_right, softcap, rng_state, kCudaDtypes);
  const c10::cuda::CUDAGuard device_guard(q_in.device());
  check_device_supported(q_in);
  const IndexErrorSink index_errors = begin_index_checks(q_in);
  const BwdLauncher launcher = bwd_launcher_for(shape.head_dim, q_in.scalar_type());

  at::Tensor dq =
      at::empty({shape.batch, shape.seqlen_q, shape.nheads, shape.head_dim}, q_in.options());
  at::Tensor dk =
      at::empty({shape.batch, shape.seqlen_k, shape.nheads_k, shape.head_dim}, q_in.options());
  at::Tensor dv = at::empty_like(dk);
  if (shape.batch == 0 || shape.nheads == 0 || shape.seqlen_q == 0 || shape.seqlen_k == 0) {
    // No query sees a key: every gradient is zero.
    dq.zero_();
    dk.zero_();
    dv.zero_();
    return {dq, dk, dv};
  }

  const at::Tensor q = aligned_for_16b_loads(q_in);
  const at::Tensor k = aligned_for_16b_loads(k_in);
  const at::Tensor v = aligned_for_16b_loads(v_in);
  const at::Tensor out = aligned_for_16b_loads(out_in);
  const at::Tensor dout = aligned_for_16b_loads(dout_in);
  const at::Tensor softmax_lse = softmax_lse_in.contiguous();
  const std::optional<at::Tensor> alibi_slopes = contiguous_alibi(alibi_slopes_in);
  const Window window =
      normalize_window(causal, window_size_left, window_size_right, shape.seqlen_k);
  const at::Tensor rng = rng_state_for(0, 0, rng_state, dropout_p, q);

  BwdParams params{};
  set_bwd_tensors(params, q, k, v, out, dout, softmax_lse, dq, dk, dv, false);
  params.batch = shape.batch;
  params.nheads = shape.nheads;
  params.nheads_k = shape.nheads_k;
  params.seqlen_q = shape.seqlen_q;
  params.seqlen_k = shape.seqlen_k;
  params.head_dim = shape.head_dim;
  params.cu_seqlens_q = nullptr;
  params.cu_seqlens_k = nullptr;
  params.total_q = 0;
  params.total_k = 0;
  set_score_params(params, q, softmax_scale, softcap, window, alibi_slopes, dropout_p, rng);
  params.index_errors = index_errors;

  const int compiled = round_up_head_dim(shape.head_dim);
  const int num_splits =
      deterministic ? deterministic_dq_splits(shape.batch, shape.nheads, shape.seqlen_k, compiled)
                    : 1;
  const BwdWorkspace workspace =
      make_bwd_workspace(params, softmax_lse, {shape.batch, shape.nheads, shape.seqlen_k, compiled},
                         compiled, num_splits, deterministic);
  launcher(params, at::cuda::getCurrentCUDAStream().stream());
  return {dq, dk, dv};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_bwd_cuda(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in,
    const at::Tensor& v_in, const at::Tensor& out_in, const at::Tensor& softmax_lse_in,
    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
    const std::optional<at::Tensor>& alibi_slopes_in, int64_t max_seqlen_q, int64_t max_seqlen_k,
    double dropout_p, double softmax_scale, bool causal, int64_t window_size_left,
    int64_t window_size_right, double softcap, bool deterministic,
    const std::optional<at::Tensor>& rng_state) {
  const VarlenShape shape = check_varlen_bwd_args(
      dout_in, q_in, k_in, v_in, out_in, softmax_lse_in, cu_seqlens_q, cu_seqlens_k,
      alibi_slopes_in, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, window_size_left,
      window_size_right, softcap, rng_state, kCudaDtypes);
  const c10::cuda::CUDAGuard device_guard(q_in.device());
  check_device_supported(q_in);
  const IndexErrorSink index_errors = begin_index_checks(q_in);
  const BwdLauncher launcher = bwd_launcher_for(shape.head_dim, q_in.scalar_type());

  // Zero-filled: rows outside every sequence get no gradient from the kernels.
  at::Tensor dq = at::zeros({shape.total_q, shape.nheads, shape.head_dim}, q_in.options());
  at::Tensor dk = at::zeros({shape.total_k, shape.nheads_k, shape.head_dim}, q_in.options());
  at::Tensor dv = at::zeros_like(dk);
  if (shape.batch == 0 || shape.nheads == 0 || shape.total_q == 0 || shape.total_k == 0 ||
      shape.max_seqlen_q == 0 || shape.max_seqlen_k == 0) {
    return {dq, dk, dv};
  }

  const at::Tensor q = aligned_for_16b_loads(q_in);
  const at::Tensor k = aligned_for_16b_loads(k_in);
  const at::Tensor v = aligned_for_16b_loads(v_in);
  const at::Tensor out = aligned_for_16b_loads(out_in);
  const at::Tensor dout = aligned_for_16b_loads(dout_in);
  const at::Tensor softmax_lse = softmax_lse_in.contiguous();
  const at::Tensor cu_q = cu_seqlens_q.contiguous();
  const at::Tensor cu_k = cu_seqlens_k.contiguous();
  const std::optional<at::Tensor> alibi_slopes = contiguous_alibi(alibi_slopes_in);
  const Window window =
      normalize_window(causal, window_size_left, window_size_right, shape.max_seqlen_k);
  const at::Tensor rng = rng_state_for(0, 0, rng_state, dropout_p, q);

  BwdParams params{};
  set_bwd_tensors(params, q, k, v, out, dout, softmax_lse, dq, dk, dv, true);
  params.batch = shape.batch;
  params.nheads = shape.nheads;
  params.nheads_k = shape.nheads_k;
  params.seqlen_q = shape.max_seqlen_q;
  params.seqlen_k = shape.max_seqlen_k;
  params.head_dim = shape.head_dim;
  params.cu_seqlens_q = cu_q.data_ptr<int>();
  params.cu_seqlens_k = cu_k.data_ptr<int>();
  params.total_q = shape.total_q;
  params.total_k = shape.total_k;
  set_score_params(params, q, softmax_scale, softcap, window, alibi_slopes, dropout_p, rng);
  params.index_errors = index_errors;

  const int compiled = round_up_head_dim(shape.head_dim);
  const int num_splits = deterministic ? deterministic_dq_splits(shape.batch, shape.nheads,
                                                                 shape.max_seqlen_k, compiled)
                                       : 1;
  const BwdWorkspace workspace =
      make_bwd_workspace(params, softmax_lse, {shape.nheads, shape.total_k, compiled}, compiled,
                         num_splits, deterministic);
  launcher(params, at::cuda::getCurrentCUDAStream().stream());
  end_index_checks(q);
  return {dq, dk, dv};
}

// The cache is written in place, so it cannot be copied into an aligned
// layout: every row must already start on a 16-byte boundary.
void check_cache_aligned(const at::Tensor& cache, const char* name) {
  bool aligned = reinterpret_cast<uintptr_t>(cache.data_ptr()) % 16 == 0;
  for (int64_t dim = 0; dim + 1 < cache.dim(); ++dim) {
    aligned = aligned && (cache.size(dim) <= 1 || cache.stride(dim) % 8 == 0);
  }
  TORCH_CHECK(aligned, "fwd_kvcache (CUDA): ", name,
              " must start on a 16-byte boundary and have strides that are multiples of 8 "
              "elements on every dim but the last, got strides ",
              cache.strides());
}

// Split-KV blocks of smem_bytes of dynamic shared memory that one SM holds at
// once: 128 threads of at most 255 registers, so two always fit the register
// file; shared memory may allow fewer.
int64_t splitkv_blocks_per_sm(int64_t smem_bytes) {
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  return std::clamp<int64_t>(int64_t(props->sharedMemPerMultiprocessor) /
                                 (smem_bytes + int64_t(props->reservedSharedMemPerBlock)),
                             1, 2);
}

// Splits of the key range for num_splits = 0. Decode reads the cache once, so
// what matters is keeping every SM busy until the end: the grid is cut into
// waves of (SMs x resident blocks per SM), and a last wave that is mostly
// empty leaves most of the memory system idle. Among the split counts whose
// fill of the waves is at least 95% of the best one's, the smallest wins
// (fewer partial results to write and merge). (85% picked 28 splits for one
// sequence where 32 fill the waves and 7 for four where 8 do: a contiguous
// cache did not mind, a paged one ran 5-10% slower on the emptier wave; H200.)
// No more splits than key blocks of the cache capacity (the per-batch lengths
// live on the device), at most kMaxKvSplits. An explicit count is honoured up
// to the same caps.
int choose_kv_splits(int64_t requested, int64_t blocks_without_split, int cache_capacity,
                     int compiled_head_dim, int warps_n, bool paged) {
  const int block_n = splitkv_block_n(compiled_head_dim);
  const int num_n_blocks = std::max(1, (cache_capacity + block_n - 1) / block_n);
  const int cap = std::min(kMaxKvSplits, num_n_blocks);
  if (requested > 0) return static_cast<int>(std::min<int64_t>(requested, cap));
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  // The decode variant over a contiguous
  // cache is meant to run one block per SM (splitkv_stages); over a paged one
  // its page lookups lengthen each tile's copy, which a second block per SM
  // hides (H200, GQA 32:8 d128, 16-row pages: 1.22-1.45x the contiguous time
  // with one block per SM, 1.04-1.07x with two).
  const int64_t blocks_per_sm =
      warps_n > 1 && !paged ? 1
                            : splitkv_blocks_per_sm(splitkv_smem_bytes(compiled_head_dim, warps_n));
  const int64_t slots = std::max<int64_t>(1, blocks_per_sm * props->multiProcessorCount);
  const int64_t base = std::max<int64_t>(blocks_without_split, 1);
  auto wave_efficiency = [&](int splits) {
    const double waves = double(base * splits) / double(slots);
    return waves / std::ceil(waves);
  };
  constexpr double kFillTolerance = 0.95;
  if (wave_efficiency(1) >= kFillTolerance) return 1;  // no split count can beat it by more
  double best = 0.0;
  for (int splits = 1; splits <= cap; ++splits) best = std::max(best, wave_efficiency(splits));
  for (int splits = 1; splits <= cap; ++splits) {
    if (wave_efficiency(splits) >= kFillTolerance * best) return splits;
  }
  return 1;
}

// Key tiles per block below which the decode variant over a contiguous cache
// runs two blocks per SM, whatever the grid (splitkv_launch_smem_bytes,
// splitkv_grid_blocks).
constexpr int kShortRunKeyBlocks = 16;

// Key tiles of the cache capacity that one split-KV work item streams.
int splitkv_key_blocks_per_item(int compiled_head_dim, int cache_capacity, int num_splits) {
  return cache_capacity / std::max(num_splits, 1) / splitkv_block_n(compiled_head_dim);
}

// Shared memory to launch the split-KV kernel with. The decode variant over
// a contiguous cache streams best one block per SM once each block has a
// long run of keys: on the H200 (bf16, d128, GQA 32:8) batch 64 ran 1.2-1.5%
// faster at 32k-128k keys and batch 32 x 16k 2.4% faster than with two
// blocks per SM. Short runs prefer the second block, which hides each
// block's start, as long as two per SM hold the whole grid at once (batch
// 32 x 4k keys: 1% slower with one on the H200); a grid that needs more
// waves than that also streams best one block per SM (batch 64 x 4k keys:
// 1.1% faster on the H100, 0.5% on the H200), unless its blocks run very few
// key tiles: such a block spends most of its time in its fixed latency (Q,
// the first tile, the merge and the stores), which a second block per SM
// overlaps (batch 64-256 x 64-512 keys: 8-21% faster with two on the H200,
// 7-17% on the H100; from 16 tiles on, two were level or up to 2% slower).
// With 128 threads, shared memory is what bounds the blocks per SM, so a
// block meant to run alone asks for just over half of the SM's. Paged caches
// keep two (choose_kv_splits).
int splitkv_launch_smem_bytes(int compiled_head_dim, int warps_n, bool paged, int cache_capacity,
                              int num_splits, int64_t grid_blocks) {
  const int tiles_smem = splitkv_smem_bytes(compiled_head_dim, warps_n);
  if (warps_n == 1 || paged) return tiles_smem;
  constexpr int kLongRunKeyBlocks = 128;
  const int key_blocks_per_block =
      splitkv_key_blocks_per_item(compiled_head_dim, cache_capacity, num_splits);
  const bool long_runs = key_blocks_per_block >= kLongRunKeyBlocks;
  const bool short_runs = key_blocks_per_block < kShortRunKeyBlocks;
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  const bool one_wave_of_two = grid_blocks <= 2 * int64_t(props->multiProcessorCount);
  if (!long_runs && (one_wave_of_two || short_runs)) return tiles_smem;
  const int one_per_sm =
      int(props->sharedMemPerMultiprocessor) / 2 - int(props->reservedSharedMemPerBlock) + 16;
  return std::clamp(one_per_sm, tiles_smem,
                    std::max(tiles_smem, int(props->sharedMemPerBlockOptin)));
}

// Thread blocks to launch the split-KV kernel with. The decode variant over a
// contiguous cache runs one block per SM when two blocks per SM cannot hold
// all its work items at once and each item streams kShortRunKeyBlocks to
// kShortItemKeyBlocks - 1 key tiles (1k-4k keys at d128), the grids that
// otherwise run one block per SM of one item each (splitkv_launch_smem_bytes):
// each block streams the K/V tiles of several items back to back, the next
// item's first tiles in flight while the current one is finished
// (splitkv_kernel.h), instead of every item waiting out the start
// of a block of its own. GQA 32:8 d128 bf16, against one block per item:
// b64 x 1k keys 2.2% faster on the H100, 3-5% on the H200; b128 x 1k 1.5% on
// the H100, level to 4.3% on H200s. Left to one block per item: shorter
// items, which run two blocks per SM (b128 x 256 / 512 keys ran about 10% /
// 8% slower persistent on the H200: two blocks per SM overlap each other's
// merge and stores, one block's items wait for its own); items of 4k keys
// and more (b64 x 4k: 0.3% slower on the H100, 0.7% faster on the H200; b64
// x 32k 1% slower on the H200, where the hardware, handing out blocks as SMs
// free up, balances the SMs better than a fixed share of items each); grids
// that two blocks per SM hold at once (b32 x 4k ran 2% slower persistent on
// the H200, with half the copies in flight per SM). benchmarks/results/NVIDIA_H100 and NVIDIA_H200,
// decode_persistent_ab.txt. Once a persistent block merged each item while
// the next one streamed (splitkv_kernel.h), the range was measured
// again on the H200 and kept: 64-128 tiles or any length, and under 16
// tiles, still ran slower persistent (decode_merge_ab.txt). Nor does a grid
// whose SMs would each stream more than kPersistentMaxKeyBlocksPerSm key
// tiles (4 MB of K/V at d128): with that much work per SM, the hardware's
// hand-out again beats the fixed shares, even at 16-63 tiles per item (one
// block per item, against persistent: b256 x 1k keys 1.3% faster on the
// H100, 1.9% on the H200; b128 x 2k 0.3% / 1.4%; b256 x 2k 1.1% / 1.7%;
// b192 x 1k 1.1% / 1%; b80 x 2k and b160 x 1k within 0.4% either way; at
// 128 tiles per SM, b128 x 1k, persistent still 0.3% / 1% ahead;
// decode_persistent_range_ab.txt). Paged caches run two blocks per SM
// (choose_kv_splits); softcap / ALiBi, the 64-row variant, or a device whose
// blocks cannot hold the persistent block's shared memory keep one block per
// item (the persistent kernel is compiled for the plain decode path only).
int64_t splitkv_grid_blocks(int compiled_head_dim, int warps_n, bool paged, bool score_extras,
                            int cache_capacity, int num_splits, int64_t num_items) {
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  const int64_t sms = props->multiProcessorCount;
  constexpr int kShortItemKeyBlocks = 64;
  constexpr int64_t kPersistentMaxKeyBlocksPerSm = 128;
  const int key_blocks_per_item =
      splitkv_key_blocks_per_item(compiled_head_dim, cache_capacity, num_splits);
  const bool persistent =
      warps_n > 1 && !paged && !score_extras && num_items > 2 * sms &&
      key_blocks_per_item >= kShortRunKeyBlocks && key_blocks_per_item < kShortItemKeyBlocks &&
      num_items * key_blocks_per_item <= kPersistentMaxKeyBlocksPerSm * sms &&
      splitkv_smem_bytes(compiled_head_dim, warps_n, true) <= int(props->sharedMemPerBlockOptin);
  return persistent ? sms : num_items;
}

// Thread blocks per cluster for the split-KV kernel, along grid x: the
// blocks of neighbouring kv heads of one batch entry, which on flash-attn's
// (b, s, hk, d) cache read neighbouring 256-byte pieces of each key's span.
// Launched as clusters of 2, such pairs run at the same time on one GPC, and
// the decode variant over a contiguous cache runs faster so; the kernel uses
// nothing else of the cluster, and we have not pinned down why the placement
// helps. A/B in alternating processes (GQA 32:8 d128 bf16, 3 rounds): H100
// b16 x 4k-128k 0.4-1.5% faster, b4 x 64k 0.45%, b64 0.1-0.2%; H200 b16 x
// 16k-128k 0.3-0.6% faster on one machine, b16 x 128k 0.4% slower on another,
// the other cells level (benchmarks/results/NVIDIA_H100 and NVIDIA_H200,
// decode_cluster_ab.txt). Clusters of 4 or 8 leave only 120 of 132 SMs
// usable at one block per SM (two waves at batch 16). Paged caches, which
// launch two blocks per SM, were not measured with clusters and keep none.
// A persistent grid (splitkv_grid_blocks) keeps none: its blocks run items
// of a stride apart.
int splitkv_cluster_x(int warps_n, bool paged, int64_t batch_heads, bool persistent) {
  constexpr int kCluster = 2;
  const bool clusters_exist = at::cuda::getCurrentDeviceProperties()->major >= 9;
  return clusters_exist && warps_n > 1 && !paged && !persistent && batch_heads % kCluster == 0
             ? kCluster
             : 1;
}

// Whether the split-KV kernel does a call's append / rotary itself
// (params.append_in_attention) instead of a kernel before it. Each of its
// blocks copies its query rows, new keys / values and rotary table rows into
// shared memory with its first tile and rotates them there, and the step
// saves the pre-kernel's run and the wait for it. The pre-kernel stays for
// the variants compiled without the append (the persistent grid, softcap /
// ALiBi, the 64-row variant), for appends longer than
// kAppendInAttentionMaxRows, rotary dims that are not a multiple of 16 or
// tables not 16-byte aligned (the kernel rotates 16-element units from
// 16-byte copies), local windows that hide a new key from every query (a
// block loads only new keys of tiles it attends to), where the table rows'
// shared memory would cost the grid resident blocks, and for grids of more
// than kAppendInAttentionMaxWaves waves: each block adds its rotation to
// its wave. At up to 4 waves of one block per SM the step was 0.8-4 us
// faster than with the pre-kernel (b32 x 16k, b64 x 4k-16k, H100 and H200);
// at 8 (b128 x 4k) 0.5 us faster on the H100 but 5-6 us slower on an H200.
// benchmarks/results/NVIDIA_H100/decode_append_in_kernel_ab.txt,
// decode_append_smem_rotation_ab.txt and decode_append_waves_ab.txt.
constexpr int64_t kAppendInAttentionMaxWaves = 4;
bool append_in_attention_fits(const KvcacheParams& params, bool score_extras, int64_t num_m_blocks,
                              int64_t num_items, int64_t grid_blocks, int compiled_head_dim) {
  const int warps_n = params.splitkv_warps_n;
  if (warps_n == 1 || score_extras || num_m_blocks != 1 || grid_blocks != num_items ||
      params.seqlen_new > kAppendInAttentionMaxRows) {
    return false;
  }
  if (params.rotary_dim > 0) {
    const bool tables_aligned = reinterpret_cast<uintptr_t>(params.rotary_cos_ptr) % 16 == 0 &&
                                reinterpret_cast<uintptr_t>(params.rotary_sin_ptr) % 16 == 0;
    if (params.rotary_dim % 16 != 0 || !tables_aligned) return false;
  }
  // The queries' keys reach down to key_diagonal(0) - window_left =
  // seqlen_k - seqlen_q - window_left, and up to the last key.
  if (params.window_left >= 0 && params.seqlen_new > params.seqlen_q + params.window_left) {
    return false;
  }
  const cudaDeviceProp* props = at::cuda::getCurrentDeviceProperties();
  const int launch_smem =
      std::max(params.splitkv_launch_smem, splitkv_append_smem_bytes(compiled_head_dim, warps_n));
  const int64_t blocks_per_sm = splitkv_blocks_per_sm(params.splitkv_launch_smem);
  return launch_smem <= int(props->sharedMemPerBlockOptin) &&
         splitkv_blocks_per_sm(launch_smem) == blocks_per_sm &&
         num_items <= kAppendInAttentionMaxWaves * blocks_per_sm * props->multiProcessorCount;
}

QKVStrides strides_or_zero(const std::optional<at::Tensor>& t) {
  if (!t.has_value()) return {0, 0, 0};
  return {t->stride(0), t->stride(1), t->stride(2)};
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
std::tuple<at::Tensor, at::Tensor> fwd_kvcache_cuda(
    const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const std::optional<at::Tensor>& k_in, const std::optional<at::Tensor>& v_in,
    const std::optional<at::Tensor>& cache_seqlens_in,
    const std::optional<at::Tensor>& rotary_cos_in, const std::optional<at::Tensor>& rotary_sin_in,
    const std::optional<at::Tensor>& cache_batch_idx_in,
    const std::optional<at::Tensor>& cache_leftpad_in,
    const std::optional<at::Tensor>& block_table_in,
    const std::optional<at::Tensor>& alibi_slopes_in, double softmax_scale, bool causal,
    int64_t window_size_left, int64_t window_size_right, double softcap, bool rotary_interleaved,
    int64_t num_splits) {
  const KvcacheShape shape =
      check_fwd_kvcache_args(q_in, k_cache, v_cache, k_in, v_in, cache_seqlens_in, rotary_cos_in,
                             rotary_sin_in, cache_batch_idx_in, cache_leftpad_in, block_table_in,
                             alibi_slopes_in, softmax_scale, softcap, kCudaDtypes);
  TORCH_CHECK(q_in.is_cuda(), "fwd_kvcache (CUDA): q must be a CUDA tensor, got ", q_in.device());
  TORCH_CHECK(num_splits >= 0, "fwd_kvcache: num_splits must be >= 0 (0 chooses), got ",
              num_splits);
  TORCH_CHECK(!shape.paged || shape.page_size % 16 == 0,
              "fwd_kvcache (CUDA): a paged cache needs page_size (k_cache.size(1)) to be a "
              "multiple of 16, got ",
              shape.page_size);
  const c10::cuda::CUDAGuard device_guard(q_in.device());
  check_device_supported(q_in);
  const IndexErrorSink index_errors = begin_index_checks(q_in);
  const int compiled = round_up_head_dim(shape.head_dim);
  const bool is_bf16 = q_in.scalar_type() == at::kBFloat16;
  const SplitKvLauncher launcher = find_splitkv_launcher(compiled, is_bf16);
  TORCH_CHECK(launcher != nullptr, "fwd_kvcache (CUDA): head_dim ", shape.head_dim, " in ",
              is_bf16 ? "bf16" : "fp16", " needs the compiled head dim ", compiled,
              ", which this build left out; rebuild with FLASH_ATTN_CUDA_HDIMS and "
              "FLASH_ATTN_CUDA_DTYPES including it");
  check_cache_aligned(k_cache, "k_cache");
  check_cache_aligned(v_cache, "v_cache");
  const int group = shape.nheads / shape.nheads_k;
  const int64_t rows_per_kv_head = int64_t(shape.seqlen_q) * group;
  const int warps_n =
      splitkv_warps_n_for(compiled, rows_per_kv_head,
                          int64_t(at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin));
  const int block_m = splitkv_block_m(warps_n);
  const int64_t num_m_blocks = (rows_per_kv_head + block_m - 1) / block_m;
  TORCH_CHECK(num_m_blocks <= 65535,
              "fwd_kvcache (CUDA): seqlen_q * (nheads / nheads_k) = ", rows_per_kv_head,
              " is more than the kernel's grid holds (", 65535 * block_m, ")");
  TORCH_CHECK(int64_t(shape.batch) * shape.nheads_k <= std::numeric_limits<int>::max(),
              "fwd_kvcache (CUDA): batch * nheads_k is too large");

  const Window window =
      normalize_window(causal, window_size_left, window_size_right, shape.cache_capacity);
  const bool rotary_q_per_row = window.left >= 0 || window.right >= 0;

  const at::Tensor q = aligned_for_16b_loads(q_in);
  const bool appending = k_in.has_value() && shape.seqlen_new > 0;
  const std::optional<at::Tensor> k_new =
      appending ? std::optional<at::Tensor>(aligned_for_16b_loads(*k_in)) : std::nullopt;
  const std::optional<at::Tensor> v_new =
      appending ? std::optional<at::Tensor>(aligned_for_16b_loads(*v_in)) : std::nullopt;
  const std::optional<at::Tensor> cache_seqlens = contiguous_or_none(cache_seqlens_in);
  const std::optional<at::Tensor> cache_leftpad = contiguous_or_none(cache_leftpad_in);
  const std::optional<at::Tensor> cache_batch_idx = contiguous_or_none(cache_batch_idx_in);
  const std::optional<at::Tensor> block_table = contiguous_or_none(block_table_in);
  const std::optional<at::Tensor> rotary_cos = contiguous_or_none(rotary_cos_in);
  const std::optional<at::Tensor> rotary_sin = contiguous_or_none(rotary_sin_in);
  const std::optional<at::Tensor> alibi_slopes = contiguous_alibi(alibi_slopes_in);
  const bool rotating = shape.rotary_dim > 0;

  at::Tensor out =
      at::empty({shape.batch, shape.seqlen_q, shape.nheads, shape.head_dim}, q.options());
  at::Tensor softmax_lse =
      at::empty({shape.batch, shape.nheads, shape.seqlen_q}, q.options().dtype(at::kFloat));

  KvcacheParams params{};
  params.q_ptr = q.data_ptr();
  params.k_ptr = k_cache.data_ptr();
  params.v_ptr = v_cache.data_ptr();
  params.o_ptr = out.data_ptr();
  params.softmax_lse_ptr = softmax_lse.data_ptr<float>();
  params.p_ptr = nullptr;
  params.q = strides_of(q, false);
  params.k = strides_of(k_cache, false);
  params.v = strides_of(v_cache, false);
  params.o = strides_of(out, false);
  params.batch = shape.batch;
  params.nheads = shape.nheads;
  params.nheads_k = shape.nheads_k;
  params.seqlen_q = shape.seqlen_q;
  params.seqlen_k = shape.cache_capacity;
  params.head_dim = shape.head_dim;
  params.cu_seqlens_q = nullptr;
  params.cu_seqlens_k = nullptr;
  params.total_q = 0;
  params.softmax_scale = static_cast<float>(softmax_scale);
  params.softmax_scale_log2 = static_cast<float>(softmax_scale * M_LOG2E);
  params.softcap = softcap > 0 ? static_cast<float>(softcap) : 0.f;
  params.alibi_slopes = data_or_null<float>(alibi_slopes);
  params.alibi_batch_stride =
      alibi_slopes.has_value() && alibi_slopes->dim() == 2 ? alibi_slopes->stride(0) : 0;
  params.window_left = window.left;
  params.window_right = window.right;
  params.dropout_p = 0.f;
  params.dropout_threshold = 0;
  params.dropout_rescale = 1.f;
  params.rng_state = nullptr;
  params.is_bf16 = is_bf16;

  params.cache_seqlens = data_or_null<int>(cache_seqlens);
  params.cache_leftpad = data_or_null<int>(cache_leftpad);
  params.cache_batch_idx = data_or_null<int>(cache_batch_idx);
  params.block_table = data_or_null<int>(block_table);
  params.block_table_batch_stride = block_table.has_value() ? block_table->stride(0) : 0;
  params.page_size = IntDivisor(shape.paged ? shape.page_size : 1);
  params.batch_cache = shape.batch_cache;
  params.num_pages = shape.paged ? shape.num_blocks : 0;
  params.seqlen_rotary = shape.seqlen_rotary;
  params.index_errors = index_errors;
  params.seqlen_new = appending ? shape.seqlen_new : 0;
  params.new_k_ptr = appending ? k_new->data_ptr() : nullptr;
  params.new_v_ptr = appending ? v_new->data_ptr() : nullptr;
  params.new_k = strides_or_zero(k_new);
  params.new_v = strides_or_zero(v_new);
  params.rotary_cos_ptr = rotating ? rotary_cos->data_ptr() : nullptr;
  params.rotary_sin_ptr = rotating ? rotary_sin->data_ptr() : nullptr;
  params.rotary_dim = rotating ? shape.rotary_dim : 0;
  params.rotary_interleaved = rotary_interleaved;
  params.rotary_q_per_row = rotary_q_per_row;
  params.q_unrotated_ptr = q.data_ptr();
  params.q_unrotated = strides_of(q, false);

  params.append_in_attention = false;

  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  params.programmatic_launch = at::cuda::getCurrentDeviceProperties()->major >= 9;
  if (shape.seqlen_q == 0) {
    launch_kvcache_append_rotary(params, stream);  // the append alone (no q to rotate)
    end_index_checks(q);
    return {out, softmax_lse};
  }

  params.splitkv_warps_n = warps_n;
  const int64_t blocks_without_split = int64_t(shape.batch) * shape.nheads_k * num_m_blocks;
  params.num_splits = choose_kv_splits(num_splits, blocks_without_split, shape.cache_capacity,
                                       compiled, warps_n, block_table.has_value());
  const int64_t num_items = blocks_without_split * params.num_splits;
  TORCH_CHECK(num_items <= std::numeric_limits<int>::max(),
              "fwd_kvcache (CUDA): batch * nheads_k * query blocks * num_splits = ", num_items,
              " exceeds 2^31 - 1 thread blocks");
  params.splitkv_launch_smem =
      splitkv_launch_smem_bytes(compiled, warps_n, block_table.has_value(), shape.cache_capacity,
                                params.num_splits, num_items);
  const bool score_extras = splitkv_has_score_extras(params);
  const int64_t grid_blocks =
      splitkv_grid_blocks(compiled, warps_n, block_table.has_value(), score_extras,
                          shape.cache_capacity, params.num_splits, num_items);
  params.splitkv_grid_blocks = static_cast<int>(grid_blocks);
  params.splitkv_cluster_x =
      splitkv_cluster_x(warps_n, block_table.has_value(), int64_t(shape.batch) * shape.nheads_k,
                        grid_blocks < num_items);
  // The append and the rotation in the attention kernel itself where that
  // pays (append_in_attention_fits); otherwise the pre-kernel writes the
  // cache and a rotated copy of q first.
  params.append_in_attention =
      (appending || rotating) && append_in_attention_fits(params, score_extras, num_m_blocks,
                                                          num_items, grid_blocks, compiled);
  at::Tensor q_rotated;
  if (!params.append_in_attention) {
    if (rotating) {
      q_rotated = at::empty_like(out);
      params.q_ptr = q_rotated.data_ptr();
      params.q = strides_of(q_rotated, false);
    }
    launch_kvcache_append_rotary(params, stream);
  }
  at::Tensor split_accum;
  params.out_accum_ptr = nullptr;
  params.lse_accum_ptr = nullptr;
  if (params.num_splits > 1) {
    // One allocation (decode calls are short; each allocator call shows):
    // partial outputs (num_splits, batch, nheads, seqlen_q, compiled), then
    // their lse (num_splits, batch, nheads, seqlen_q). compiled is a multiple
    // of 32, so every partial row stays 16-byte aligned.
    const int64_t partial_rows =
        int64_t(params.num_splits) * shape.batch * shape.nheads * shape.seqlen_q;
    split_accum = at::empty({partial_rows * (compiled + 1)}, q.options().dtype(at::kFloat));
    params.out_accum_ptr = split_accum.data_ptr<float>();
    params.lse_accum_ptr = params.out_accum_ptr + partial_rows * compiled;
  }
  launcher(params, stream);
  end_index_checks(q);
  return {out, softmax_lse};
}

}  // namespace
}  // namespace flash

TORCH_LIBRARY_IMPL(flash_attn, CUDA, m) {
  m.impl("fwd", &flash::fwd_cuda);
  m.impl("varlen_fwd", &flash::varlen_fwd_cuda);
  m.impl("bwd", &flash::bwd_cuda);
  m.impl("varlen_bwd", &flash::varlen_bwd_cuda);
  m.impl("fwd_kvcache", &flash::fwd_kvcache_cuda);
}

// The index checks' controls (index_error_state.h); the CPU path raises at
// once and needs neither.
TORCH_LIBRARY_IMPL(flash_attn, CompositeImplicitAutograd, m) {
  m.impl("check_index_errors",
         [](int64_t device) { flash::check_index_errors_now(static_cast<int>(device)); });
  m.impl("set_sync_index_checks",
         [](bool enabled) { return flash::set_sync_index_checks(enabled); });
}
