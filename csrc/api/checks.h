// Argument validation at the torch boundary, shared by the CPU and CUDA
// implementations of fwd / bwd / varlen_fwd / varlen_bwd, plus the two small
// normalisations every implementation applies the same way (attention window,
// Philox seed/offset). Every failure is a TORCH_CHECK whose message names the
// argument and says what was expected.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <initializer_list>
#include <optional>

#include "common/index_error.h"

namespace flash {

// Shapes of a fixed-length problem: q / k (batch, seqlen_q / seqlen_k,
// nheads / nheads_k, head_dim), v (batch, seqlen_k, nheads_k, head_dim_v) with
// head_dim_v <= head_dim (FwdParams::head_dim_v; api/head_dims.h on the CPU).
struct FwdShape {
  int batch;
  int seqlen_q;
  int seqlen_k;
  int nheads;
  int nheads_k;
  int head_dim;
  int head_dim_v;
};

// Shapes of a varlen problem: q (total_q, nheads, head_dim); k / v either
// (total_k, nheads_k, head_dim), or paged (num_blocks, page_size, nheads_k,
// head_dim) with a block_table (batch, max_blocks_per_seq); v's last dim is
// head_dim_v <= head_dim.
struct VarlenShape {
  int batch;  // cu_seqlens_q.numel() - 1
  int total_q;
  int total_k;  // rows of k when not paged; num_blocks * page_size when paged
  int nheads;
  int nheads_k;
  int head_dim;
  int head_dim_v;
  int max_seqlen_q;
  int max_seqlen_k;
  bool paged;
  int num_blocks;          // paged only
  int page_size;           // paged only
  int max_blocks_per_seq;  // paged only
};

// Fixed-length forward. allowed_dtypes is the set the calling device accepts
// (fp16/bf16 on CUDA; fp32/fp16/bf16 on CPU).
FwdShape check_fwd_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const std::optional<at::Tensor>& alibi_slopes, double dropout_p,
                        double softmax_scale, int64_t window_size_left, int64_t window_size_right,
                        double softcap, const std::optional<at::Tensor>& rng_state,
                        c10::ArrayRef<at::ScalarType> allowed_dtypes);

// Fixed-length backward: the forward's checks plus dout / out (q's dtype, and
// q's shape with head_dim_v) and softmax_lse (fp32, (batch, nheads, seqlen_q)). rng_state is
// required when dropout_p > 0 (the backward has no seed arguments).
FwdShape check_bwd_args(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v, const at::Tensor& out, const at::Tensor& softmax_lse,
                        const std::optional<at::Tensor>& alibi_slopes, double dropout_p,
                        double softmax_scale, int64_t window_size_left, int64_t window_size_right,
                        double softcap, const std::optional<at::Tensor>& rng_state,
                        c10::ArrayRef<at::ScalarType> allowed_dtypes);

// Varlen forward; block_table selects paged K/V; seqused_k (int32 (batch,))
// limits each sequence to its first seqused_k[b] keys, seqused_q (int32
// (batch,)) to its first seqused_q[b] query rows. Only shapes, dtypes and
// devices are checked here: the contents of cu_seqlens / seqused_k /
// seqused_q / block_table live on the device (see check_cu_seqlens_host,
// check_seqused_k_host, check_seqused_q_host and check_block_table_host for
// host data).
VarlenShape check_varlen_fwd_args(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, const std::optional<at::Tensor>& block_table,
    const std::optional<at::Tensor>& seqused_k, const std::optional<at::Tensor>& seqused_q,
    const std::optional<at::Tensor>& alibi_slopes, int64_t max_seqlen_q, int64_t max_seqlen_k,
    double dropout_p, double softmax_scale, int64_t window_size_left, int64_t window_size_right,
    double softcap, const std::optional<at::Tensor>& rng_state,
    c10::ArrayRef<at::ScalarType> allowed_dtypes);

// Varlen backward (never paged): softmax_lse is fp32 (nheads, total_q).
VarlenShape check_varlen_bwd_args(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& softmax_lse, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, const std::optional<at::Tensor>& seqused_k,
    const std::optional<at::Tensor>& seqused_q, const std::optional<at::Tensor>& alibi_slopes,
    int64_t max_seqlen_q, int64_t max_seqlen_k, double dropout_p, double softmax_scale,
    int64_t window_size_left, int64_t window_size_right, double softcap,
    const std::optional<at::Tensor>& rng_state, c10::ArrayRef<at::ScalarType> allowed_dtypes);

// Host-side content checks of a CPU cu_seqlens tensor (already shape-checked):
// first entry >= 0, non-decreasing, last entry <= total_rows (skipped when
// total_rows < 0, e.g. for paged keys), and every sequence no longer than
// max_seqlen. The messages are index_error_message's, which the CUDA path
// raises from what its kernels record (docs/memory_safety.md).
// num_splits of the varlen forward (FA3's): 0 (the plan chooses), 1 (no
// split) or more, at most kMaxVarlenSplits.
constexpr int64_t kMaxVarlenSplits = 128;
void check_num_splits(int64_t num_splits);

// op: the op family the message names (fwd_kvcache's varlen form passes kKvcache).
void check_cu_seqlens_host(const at::Tensor& cu_seqlens, int64_t total_rows, int64_t max_seqlen,
                           IndexArg arg, IndexOp op = IndexOp::kVarlen);

// Host-side content check of a CPU seqused_k (already shape-checked): every
// seqused_k[b] in [0, cu_seqlens_k[b + 1] - cu_seqlens_k[b]], or with paged
// keys in [0, paged_bound] (min(max_seqlen_k, max_blocks_per_seq * page_size):
// cu_seqlens_k then says nothing about the keys). Run after
// check_cu_seqlens_host(cu_seqlens_k, ...).
void check_seqused_k_host(const at::Tensor& seqused_k, const at::Tensor& cu_seqlens_k, bool paged,
                          int64_t paged_bound);

// Host-side content check of a CPU seqused_q (already shape-checked): every
// seqused_q[b] in [0, cu_seqlens_q[b + 1] - cu_seqlens_q[b]]. Run after
// check_cu_seqlens_host(cu_seqlens_q, ...).
void check_seqused_q_host(const at::Tensor& seqused_q, const at::Tensor& cu_seqlens_q);

// Host-side content check of a CPU block_table: every entry a key of batch b
// can reach (the first ceil(seqlen_k[b] / page_size) of its row) is in
// [0, num_blocks), and the row is long enough for seqlen_k[b]. seqlen_k[b] is
// seqused_k[b] when given (already checked), else cu_seqlens_k's length.
void check_block_table_host(const at::Tensor& block_table, const at::Tensor& cu_seqlens_k,
                            const std::optional<at::Tensor>& seqused_k, int64_t num_blocks,
                            int64_t page_size);

// The caller's output buffer of an *_out op (`prefix` starts the message,
// "flash_attn" or "fwd_kvcache"): on q's device, of dtype `dtype` (Undefined:
// q's; fp8 attention writes bfloat16), of shape
// `expected` (`layout` names it), last dim contiguous, no two elements at
// one address, and sharing no memory with any of `inputs` (the kernels read
// those while they write out).
void check_out_arg(const char* prefix, const at::Tensor& out, const at::Tensor& q,
                   at::IntArrayRef expected, const char* layout,
                   std::initializer_list<const at::Tensor*> inputs,
                   at::ScalarType dtype = at::ScalarType::Undefined);

// softmax_d of the backward ops: where the caller wants D = rowsum(dO * O),
// the backward's by-product that sink_grad needs; fp32, contiguous, in the
// layout of softmax_lse. Absent: the op keeps D to itself.
void check_softmax_d_out(const char* prefix, const std::optional<at::Tensor>& softmax_d,
                         const at::Tensor& softmax_lse);

// learnable_sink (attention sinks, docs/architecture.md "The op contract") of
// any forward op (`prefix` starts the message, "flash_attn" or "fwd_kvcache"):
// fp32, 1-D of nheads (the query heads) elements, on q's device. Returns it
// contiguous, or nullopt when absent.
std::optional<at::Tensor> check_learnable_sink(const char* prefix,
                                               const std::optional<at::Tensor>& learnable_sink,
                                               const at::Tensor& q, int64_t nheads);

// The attention window the kernels use. causal forces right = 0 (left kept:
// causal with a left window is local attention). A side that reaches past
// seqlen_k (>= seqlen_k) becomes unbounded (-1), as flash-attn 2.x does, and
// any negative side is -1. For varlen pass max_seqlen_k.
struct Window {
  int left;
  int right;
};
Window normalize_window(bool causal, int64_t window_size_left, int64_t window_size_right,
                        int64_t seqlen_k);

// Philox seed and offset on the host: rng_state (int64 [seed, offset], any
// device; reading a device tensor synchronises) overrides the values.
struct PhiloxSeed {
  uint64_t seed;
  uint64_t offset;
};
PhiloxSeed resolve_philox_seed(int64_t philox_seed, int64_t philox_offset,
                               const std::optional<at::Tensor>& rng_state);

// The rng_state a forward returns: int64 [seed, offset] on `device`.
at::Tensor make_rng_state(const PhiloxSeed& seed, c10::Device device);

// Same, without a host round trip when rng_state is given: a copy of it moved
// to `device` (useful where a device pointer to the seed is all the kernel needs).
at::Tensor output_rng_state(int64_t philox_seed, int64_t philox_offset,
                            const std::optional<at::Tensor>& rng_state, c10::Device device);

}  // namespace flash
