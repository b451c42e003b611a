// Plain parameter structs handed from the API layer to the CUDA launchers.
// No torch types here: the kernel translation units never include torch
// headers (they would cost minutes of compile time each).
#pragma once

#include <cstdint>

namespace flash {

// Strides are in elements. Fixed-length tensors are (batch, seqlen, heads, dim);
// varlen tensors are (total, heads, dim) with batch_stride unused and the
// sequence of batch b starting at row cu_seqlens[b].
struct QKVStrides {
  int64_t batch_stride;
  int64_t row_stride;
  int64_t head_stride;
};

struct FwdParams {
  const void* q_ptr;
  const void* k_ptr;
  const void* v_ptr;
  void* o_ptr;
  float* softmax_lse_ptr;  // (batch, nheads, seqlen_q), or (nheads, total_q) for varlen
  void* p_ptr;  // optional, q's dtype: (batch, nheads, seqlen_q, seqlen_k) probabilities

  QKVStrides q, k, v, o;

  int batch;
  int nheads;
  int nheads_k;
  int seqlen_q;  // max over the batch for varlen
  int seqlen_k;
  int head_dim;  // actual; the kernel's compiled head dim is >= this

  // Varlen: int32 prefix sums of length batch + 1; null for fixed length.
  const int* cu_seqlens_q;
  const int* cu_seqlens_k;
  int total_q;  // varlen: rows of q; the lse is (nheads, total_q)

  float softmax_scale;
  float softmax_scale_log2;  // softmax_scale * log2(e): the kernel works in exp2
  float softcap;             // 0 disables; else s = softcap * tanh(s / softcap)

  const float* alibi_slopes;  // null, or (nheads) / (batch, nheads) fp32
  int64_t alibi_batch_stride;

  int window_left;   // < 0: unbounded
  int window_right;  // < 0: unbounded

  float dropout_p;
  uint32_t dropout_threshold;
  float dropout_rescale;      // 1 / (1 - dropout_p)
  const int64_t* rng_state;   // device pointer to [seed, offset]

  bool is_bf16;
};

}  // namespace flash
