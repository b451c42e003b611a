// The CPU attention core: the tiled online-softmax algorithm of the GPU
// kernels, in fp32, over raw pointers and element strides so that one core
// serves fixed-length, varlen, paged and KV-cache problems. The torch-facing
// ops (register_cpu.cpp, flash_kvcache_cpu.cpp) validate arguments, allocate
// outputs and describe the problem here; nothing in this header allocates.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <vector>

#include "common/fp8_rule.h"

namespace flash::cpu {

// Element strides of a tensor viewed as (batch, row, head, dim) with dim
// contiguous. A varlen tensor (total, heads, dim) has batch = 0; a paged
// K/V tensor (num_blocks, page_size, heads, dim) uses batch for the block.
struct RowStrides {
  int64_t batch;
  int64_t row;
  int64_t head;
};

// Where one batch entry's rows live.
//
// Query i in [0, seqlen_q) is row (q_batch, q_first_row + i) of q, out, dout
// and dq, and its lse sits at q_batch * lse.batch + h * lse.head +
// (q_first_row + i) * lse.row.
//
// Key j in [0, seqlen_k) has the logical position p = kv_first_row + j:
//   block_table_row == nullptr: row (kv_batch, p) of k, v, dk, dv;
//   otherwise (paged):         row (block_table_row[p / page_size], p % page_size).
// Fixed length: q_batch = kv_batch = b, first rows 0. Varlen: batches 0,
// first rows cu_seqlens[b]. KV cache: kv_batch = cache_batch_idx[b],
// kv_first_row = cache_leftpad[b].
struct SequenceSpan {
  int seqlen_q;
  int seqlen_k;
  int64_t q_batch;
  int64_t q_first_row;
  int64_t kv_batch;
  int64_t kv_first_row;
  const int32_t* block_table_row;
};

// Everything the forward and backward read. Dropout, ALiBi and the
// probabilities output address batch entries by their index b in
// `sequences`, never by q_batch / kv_batch, and heads by the query head.
struct AttentionProblem {
  c10::ScalarType dtype;  // of q, k, v and every output but lse: Float, Half or BFloat16
  // FP8 (docs/fp8.md): the dtype of k and v and that of out / probs where
  // they differ from `dtype` (Undefined: `dtype`). Served: q, k, v
  // Float8_e4m3fn with out BFloat16 (fp8 attention); q Half / BFloat16 with
  // k, v Float8_e4m3fn and out q's dtype (fp8 KV cache). Forward only.
  c10::ScalarType kv_dtype = c10::ScalarType::Undefined;
  c10::ScalarType out_dtype = c10::ScalarType::Undefined;
  // Dequantisation of the fp8 operands (common/fp8_rule.h), by batch entry b
  // of `sequences` and kv head; read only for an fp8 operand.
  Fp8Descale q_descale;
  Fp8Descale k_descale;
  Fp8Descale v_descale;
  int nheads;
  int nheads_k;  // nheads % nheads_k == 0; query head h reads kv head h / (nheads / nheads_k)
  int head_dim;  // a multiple of 8, at most kMaxHeadDimCpu (common/head_dim_bounds.h)
  std::vector<SequenceSpan> sequences;  // one per batch entry

  const void* q;
  RowStrides q_strides;
  const void* k;
  RowStrides k_strides;
  const void* v;
  RowStrides v_strides;
  int page_size;  // > 0 when any SequenceSpan has a block_table_row

  float softmax_scale;
  float softcap;               // 0 disables; else s = softcap * tanh(s / softcap), after scaling
  const float* alibi_slopes;   // null, or slope of (b, h) at b * alibi_batch_stride + h
  int64_t alibi_batch_stride;  // 0 for slopes of shape (nheads)
  int window_left;             // already normalised (checks.h normalize_window); < 0: unbounded
  int window_right;
  // null, or fp32 (nheads): attention sinks. Row i of head h adds
  // exp(sink[h] - m_i) to its softmax denominator (no value row) and its lse
  // includes it. The backward needs nothing: P = exp(s - lse) already has
  // the sink's share taken out.
  const float* learnable_sink;

  float dropout_p;  // 0 disables
  uint64_t philox_seed;
  uint64_t philox_offset;
};

// Key-block width of the returned S_dmask (return_softmax): the numerators of
// key block j = col / kProbsBlockN are relative to the row's max over blocks
// j, j + 1, ... (flash-attn 2.x's convention). It must equal
// flash_attn_cuda._get_block_size_n(...) and the CUDA kernel's
// kReturnProbsBlockN (csrc/cuda/fwd/return_probs.h), whatever the device or
// head dim.
constexpr int kProbsBlockN = 64;

struct ForwardOutputs {
  void* out;  // dtype; every query row is written (rows that see no key: 0)
  RowStrides out_strides;
  float* lse;              // natural log; rows that see no key: +inf, or the sink
  RowStrides lse_strides;  // batch / row / head, see SequenceSpan
  // Optional (null to skip): S_dmask of batch b, head h, at
  // b * probs_batch_stride + h * probs_head_stride + i * probs_row_stride + j,
  // in dtype: for a visible (i, j), exp(s_ij - m) with m the max of row i's
  // scores over key blocks (of kProbsBlockN keys, from key 0) j / kProbsBlockN
  // and after, negated where dropout dropped it. Only visible entries with
  // i < seqlen_q and j < seqlen_k of that batch are written: the caller
  // zero-fills the rest.
  void* probs;
  int64_t probs_batch_stride;
  int64_t probs_head_stride;
  int64_t probs_row_stride;
};

// Parallel over (batch, head, query block). Deterministic.
void attention_forward(const AttentionProblem& problem, const ForwardOutputs& outputs);

struct BackwardTensors {
  const void* dout;
  RowStrides dout_strides;
  const void* out;
  RowStrides out_strides;
  const float* lse;
  RowStrides lse_strides;
  void* dq;  // dtype, same row addressing as q
  RowStrides dq_strides;
  void* dk;  // dtype, same row addressing as k (not paged): (kv_batch, kv_first_row + j)
  RowStrides dk_strides;
  void* dv;
  RowStrides dv_strides;
  // Null, or where D = rowsum(dO * O) of every query row goes, addressed like
  // the lse (the backward ops' softmax_d, which sink_grad reads).
  float* delta_out = nullptr;
  RowStrides delta_out_strides{};
};

// Recomputes P from q, k and lse; dS = P * (dP - rowsum(dO * O)). Every row of
// dq and every key row of dk / dv named by `sequences` is written (zeros where
// nothing contributes). Requires page_size == 0. Always deterministic: the
// reduction order does not depend on the thread count.
void attention_backward(const AttentionProblem& problem, const BackwardTensors& tensors);

// SequenceSpans of the common layouts.
std::vector<SequenceSpan> fixed_length_sequences(int batch, int seqlen_q, int seqlen_k);
// cu_seqlens_q / cu_seqlens_k: host int32 arrays of batch + 1 entries.
// seqused_k: null, or host int32 (batch): sequence b's keys are its first
// seqused_k[b] (the rest of its rows are never read).
// seqused_q: null, or host int32 (batch): sequence b's query rows are its
// first seqused_q[b] (the rest are neither read nor written: the caller gives
// them their values).
// block_table: null, or host int32 (batch, block_table_batch_stride) rows.
std::vector<SequenceSpan> varlen_sequences(int batch, const int32_t* cu_seqlens_q,
                                           const int32_t* cu_seqlens_k, const int32_t* seqused_k,
                                           const int32_t* seqused_q, const int32_t* block_table,
                                           int64_t block_table_batch_stride);

}  // namespace flash::cpu
