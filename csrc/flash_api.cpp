// The op surface of flash_attn_cuda: schemas only. Device implementations are
// registered beside their kernels (csrc/cpu/, csrc/cuda/), the fake (meta)
// kernels in flash_attn_cuda/ops.py.
//
// Conventions shared by every op (see DESIGN.md, "The op contract"):
//   * q/k/v are (batch, seqlen, nheads, headdim), or (total, nheads, headdim)
//     for varlen, last dim contiguous; headdim a multiple of 8, at most 256.
//   * window_size_left / right < 0 mean "unbounded on that side"; causal is
//     (left=-1, right=0), bottom-right aligned. The Python layer normalises
//     causal into the window, but the ops accept both.
//   * Dropout randomness never comes from a torch.Generator inside the op: the
//     caller passes philox_seed / philox_offset as values, or rng_state, an
//     int64 tensor [seed, offset] on any device that overrides the values. The
//     forward returns the rng_state it used (on q's device) so the backward
//     regenerates the same mask.
#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(flash_attn, m) {
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, Tensor? alibi_slopes, float dropout_p, "
      "float softmax_scale, bool causal, int window_size_left, int window_size_right, "
      "float softcap, bool return_softmax, int philox_seed, int philox_offset, "
      "Tensor? rng_state) -> (Tensor out, Tensor softmax_lse, Tensor S_dmask, Tensor rng_state)");
  m.def(
      "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, "
      "Tensor? alibi_slopes, float dropout_p, float softmax_scale, bool causal, "
      "int window_size_left, int window_size_right, float softcap, bool deterministic, "
      "Tensor? rng_state) -> (Tensor dq, Tensor dk, Tensor dv)");
  m.def(
      "varlen_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "Tensor? block_table, Tensor? alibi_slopes, int max_seqlen_q, int max_seqlen_k, "
      "float dropout_p, float softmax_scale, bool causal, int window_size_left, "
      "int window_size_right, float softcap, bool return_softmax, int philox_seed, "
      "int philox_offset, Tensor? rng_state) "
      "-> (Tensor out, Tensor softmax_lse, Tensor S_dmask, Tensor rng_state)");
  m.def(
      "varlen_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, "
      "Tensor cu_seqlens_q, Tensor cu_seqlens_k, Tensor? alibi_slopes, int max_seqlen_q, "
      "int max_seqlen_k, float dropout_p, float softmax_scale, bool causal, "
      "int window_size_left, int window_size_right, float softcap, bool deterministic, "
      "Tensor? rng_state) -> (Tensor dq, Tensor dk, Tensor dv)");
  m.def(
      "fwd_kvcache(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k, Tensor? v, "
      "Tensor? cache_seqlens, Tensor? rotary_cos, Tensor? rotary_sin, Tensor? cache_batch_idx, "
      "Tensor? cache_leftpad, Tensor? block_table, Tensor? alibi_slopes, float softmax_scale, "
      "bool causal, int window_size_left, int window_size_right, float softcap, "
      "bool rotary_interleaved, int num_splits) -> (Tensor out, Tensor softmax_lse)");
  // The CUDA path's index checks (docs/memory_safety.md): raise what a kernel
  // recorded on `device`, after waiting for it; switch each call to waiting
  // for its own check (returns the previous setting).
  m.def("check_index_errors(int device) -> ()");
  m.def("set_sync_index_checks(bool enabled) -> bool");
}
