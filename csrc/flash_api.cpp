// The op surface of flash_attn_cuda: schemas only. Device implementations are
// registered beside their kernels (csrc/cpu/, csrc/cuda/), the fake (meta)
// kernels in flash_attn_cuda/ops.py.
//
// Conventions shared by every op (see docs/architecture.md, "The op contract"):
//   * q/k/v are (batch, seqlen, nheads, headdim), or (total, nheads, headdim)
//     for varlen, last dim contiguous; headdim a multiple of 8, at most 256.
//   * window_size_left / right < 0 mean "unbounded on that side"; causal is
//     (left=-1, right=0), bottom-right aligned. The Python layer normalises
//     causal into the window, but the ops accept both.
//   * seqused_k (varlen, optional int32 (batch,)): sequence b uses only its
//     first seqused_k[b] keys; with block_table it gives each sequence's keys
//     (cu_seqlens_k is then checked but not used for them).
//   * seqused_q (varlen, optional int32 (batch,), last so that older callers
//     keep working): sequence b uses only its first seqused_q[b] query rows;
//     causal / local windows align to the used lengths. The other rows get
//     out 0 (a caller's out= keeps them as they are), lse +inf, dq 0, D 0.
//   * fwd_kvcache's varlen form (FA3's, keyword-only): with cu_seqlens_q
//     (int32 (batch + 1,)) and max_seqlen_q, q is (total_q, nheads, headdim),
//     out likewise and softmax_lse (nheads, total_q); with cu_seqlens_k_new
//     the new k / v are (total_k_new, nheads_k, headdim) and sequence b
//     appends rows cu_seqlens_k_new[b] .. cu_seqlens_k_new[b + 1] after
//     cache_seqlens[b]. Either may come without the other.
//   * num_splits (varlen_fwd / varlen_fwd_out, FA3's): 0 (the default)
//     lets the plan choose (plan_varlen_split: decode-like calls split, as
//     flash-attn 2.x's varlen forward splits them), 1 runs the forward
//     kernels (batch invariant for a fixed kernel), > 1 splits each
//     sequence's keys that many ways (the split-KV kernel and an lse merge).
//     Speed only: the result meets the same criterion. The CPU path ignores
//     it.
//   * learnable_sink (forwards, optional fp32 (nheads,)): attention sinks.
//     Row i of head h adds exp(sink_h - m_i) to its softmax denominator (no
//     value row); softmax_lse includes it, a row that sees no key gets lse =
//     sink_h. The last (keyword-only) argument of every forward.
//   * q_descale / k_descale / v_descale (forwards, optional fp32 (batch,
//     nheads_k), keyword-only and last, so that older callers keep working):
//     FP8 (docs/fp8.md). fwd / varlen_fwd take q, k, v float8_e4m3fn, element
//     x of batch entry b and kv head g standing for x * descale[b, g] (query
//     heads read their kv head's q_descale), and return a bfloat16 out;
//     fwd_kvcache takes k_cache / v_cache float8_e4m3fn with a float16 /
//     bfloat16 q (no q_descale) and quantises appended k / v into them.
//     Forward only; no dropout, ALiBi or S_dmask with fp8.
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
      "Tensor? rng_state, *, Tensor? learnable_sink=None, "
      "Tensor? q_descale=None, Tensor? k_descale=None, Tensor? v_descale=None) "
      "-> (Tensor out, Tensor softmax_lse, Tensor S_dmask, Tensor rng_state)");
  m.def(
      "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, "
      "Tensor? alibi_slopes, float dropout_p, float softmax_scale, bool causal, "
      "int window_size_left, int window_size_right, float softcap, bool deterministic, "
      "Tensor? rng_state, *, Tensor(a!)? softmax_d=None) -> (Tensor dq, Tensor dk, Tensor dv)");
  m.def(
      "varlen_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "Tensor? block_table, Tensor? alibi_slopes, int max_seqlen_q, int max_seqlen_k, "
      "float dropout_p, float softmax_scale, bool causal, int window_size_left, "
      "int window_size_right, float softcap, bool return_softmax, int philox_seed, "
      "int philox_offset, Tensor? rng_state, *, Tensor? seqused_k=None, "
      "Tensor? learnable_sink=None, Tensor? seqused_q=None, int num_splits=0, "
      "Tensor? q_descale=None, Tensor? k_descale=None, Tensor? v_descale=None) "
      "-> (Tensor out, Tensor softmax_lse, Tensor S_dmask, Tensor rng_state)");
  m.def(
      "varlen_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, "
      "Tensor cu_seqlens_q, Tensor cu_seqlens_k, Tensor? alibi_slopes, int max_seqlen_q, "
      "int max_seqlen_k, float dropout_p, float softmax_scale, bool causal, "
      "int window_size_left, int window_size_right, float softcap, bool deterministic, "
      "Tensor? rng_state, *, Tensor? seqused_k=None, Tensor(a!)? softmax_d=None, "
      "Tensor? seqused_q=None) -> (Tensor dq, Tensor dk, Tensor dv)");
  m.def(
      "fwd_kvcache(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k, Tensor? v, "
      "Tensor? cache_seqlens, Tensor? rotary_cos, Tensor? rotary_sin, Tensor? cache_batch_idx, "
      "Tensor? cache_leftpad, Tensor? block_table, Tensor? alibi_slopes, float softmax_scale, "
      "bool causal, int window_size_left, int window_size_right, float softcap, "
      "bool rotary_interleaved, int num_splits, *, Tensor? learnable_sink=None, "
      "Tensor? rotary_seqlens=None, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k_new=None, "
      "int? max_seqlen_q=None, Tensor? q_descale=None, Tensor? k_descale=None, Tensor? "
      "v_descale=None) "
      "-> (Tensor out, Tensor softmax_lse)");
  // The forwards that write the attention output into the caller's `out`
  // instead of a new tensor; they return the other results. (An op that
  // returned `out` as well, or a `Tensor(a!)? out=None` on the ops above that
  // allocates when it is None, would return an alias of an input, which
  // functionalization, torch.compile and opcheck do not accept for custom ops.)
  m.def(
      "fwd_out(Tensor q, Tensor k, Tensor v, Tensor? alibi_slopes, float dropout_p, "
      "float softmax_scale, bool causal, int window_size_left, int window_size_right, "
      "float softcap, bool return_softmax, int philox_seed, int philox_offset, "
      "Tensor? rng_state, *, Tensor(a!) out, Tensor? learnable_sink=None, "
      "Tensor? q_descale=None, Tensor? k_descale=None, Tensor? v_descale=None) "
      "-> (Tensor softmax_lse, Tensor S_dmask, Tensor rng_state)");
  m.def(
      "varlen_fwd_out(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "Tensor? block_table, Tensor? alibi_slopes, int max_seqlen_q, int max_seqlen_k, "
      "float dropout_p, float softmax_scale, bool causal, int window_size_left, "
      "int window_size_right, float softcap, bool return_softmax, int philox_seed, "
      "int philox_offset, Tensor? rng_state, *, Tensor? seqused_k=None, Tensor(a!) out, "
      "Tensor? learnable_sink=None, Tensor? seqused_q=None, int num_splits=0, "
      "Tensor? q_descale=None, Tensor? k_descale=None, Tensor? v_descale=None) "
      "-> (Tensor softmax_lse, Tensor S_dmask, Tensor rng_state)");
  m.def(
      "fwd_kvcache_out(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k, Tensor? v, "
      "Tensor? cache_seqlens, Tensor? rotary_cos, Tensor? rotary_sin, Tensor? cache_batch_idx, "
      "Tensor? cache_leftpad, Tensor? block_table, Tensor? alibi_slopes, float softmax_scale, "
      "bool causal, int window_size_left, int window_size_right, float softcap, "
      "bool rotary_interleaved, int num_splits, *, Tensor(c!) out, "
      "Tensor? learnable_sink=None, Tensor? rotary_seqlens=None, Tensor? cu_seqlens_q=None, "
      "Tensor? cu_seqlens_k_new=None, int? max_seqlen_q=None, "
      "Tensor? q_descale=None, Tensor? k_descale=None, Tensor? v_descale=None) -> Tensor "
      "softmax_lse");
  // The gradient of the attention sinks, from the forward's softmax_lse and
  // D = rowsum(dout * out) in its layout ((batch, nheads, seqlen_q), or
  // (nheads, total_q) with cu_seqlens_q): d sink_h = -sum_i exp(sink_h -
  // lse_i) * D_i, fp32 (nheads,). One ATen implementation for every device
  // (csrc/ops/sink_grad.cpp); the backward ops need no sink argument.
  m.def(
      "sink_grad(Tensor softmax_lse, Tensor softmax_d, Tensor learnable_sink, "
      "Tensor? cu_seqlens_q=None) -> Tensor");
  // The merge of partial attention results by their log-sum-exp
  // (flash_attn_combine: cascade attention, context parallelism, split-KV done
  // by the caller; the rule and its edge cases in csrc/common/lse_combine_rule.h).
  // out_partial: fp32 / fp16 / bf16 (num_splits, batch, seqlen, nheads,
  // head_dim), or varlen (num_splits, total, nheads, head_dim); lse_partial:
  // fp32 (num_splits, batch, seqlen, nheads), or (num_splits, total, nheads);
  // any strides. Returns out (out_partial's shape without num_splits, dtype
  // out_dtype, default out_partial's) and the fp32 lse (batch, seqlen, nheads)
  // or (total, nheads), contiguous. combine_out writes out into the caller's
  // tensor and returns the lse.
  m.def(
      "combine(Tensor out_partial, Tensor lse_partial, ScalarType? out_dtype=None) "
      "-> (Tensor out, Tensor softmax_lse)");
  m.def("combine_out(Tensor out_partial, Tensor lse_partial, *, Tensor(a!) out) -> Tensor");
  // The CUDA path's index checks (docs/memory_safety.md): raise what a kernel
  // recorded on `device`, after waiting for it; switch each call to waiting
  // for its own check (returns the previous setting).
  m.def("check_index_errors(int device) -> ()");
  m.def("set_sync_index_checks(bool enabled) -> bool");
  // The SDPA provider (flash_attn_cuda/integrations/sdpa.py,
  // csrc/ops/sdpa_flash_override.cpp): _sdpa_flash_override installs (or
  // removes) a C++ kernel of aten::_scaled_dot_product_flash_attention for a
  // dispatch key and says whether it did; the calls it does not serve itself go
  // to _sdpa_flash_fallback, aten's schema, served by the provider's Python
  // override.
  m.def("_sdpa_flash_override(str dispatch_key, bool install) -> bool");
  // How many calls the C++ kernel has served itself in this process (the tests'
  // count of calls the provider served).
  m.def("_sdpa_flash_served_calls() -> int");
  m.def(
      "_sdpa_flash_fallback(Tensor query, Tensor key, Tensor value, float dropout_p=0.0, "
      "bool is_causal=False, bool return_debug_mask=False, *, float? scale=None) -> (Tensor "
      "output, Tensor logsumexp, Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, SymInt max_k, "
      "Tensor rng_state, Tensor unused, Tensor debug_attn_mask)");
  // Debug ops (csrc/cuda/ops/plan_debug_ops.cpp, registered in every build):
  // the plan (csrc/cuda/launch/plan.h) the CUDA path makes for a call of this
  // shape on the described device (defaults: sm90, 132 SMs, 227 KiB of shared
  // memory per block), as one line
  // "kernel=... reason: ...". Nothing is launched.
  m.def(
      "_plan_fwd(int batch, int seqlen_q, int seqlen_k, int nheads, int nheads_k, int head_dim, "
      "*, bool causal=False, int window_size_left=-1, int window_size_right=-1, "
      "float softcap=0.0, bool alibi=False, float dropout_p=0.0, float? softmax_scale=None, "
      "bool varlen=False, bool return_softmax=False, "
      "int cc_major=9, int cc_minor=0, int num_sms=132, int smem_per_block_optin=232448, "
      "int smem_per_sm=233472, int reserved_smem_per_block=1024, "
      "bool sm90a_built=True, str kernel_override=\"\", bool tma_aligned=True, "
      "int page_size=0, int head_dim_v=-1, bool fp8=False, int num_splits=0) -> str");
  m.def(
      "_plan_bwd(int batch, int seqlen_q, int seqlen_k, int nheads, int nheads_k, int head_dim, "
      "*, bool causal=False, int window_size_left=-1, int window_size_right=-1, "
      "float softcap=0.0, bool alibi=False, float dropout_p=0.0, float? softmax_scale=None, "
      "bool varlen=False, bool deterministic=False, "
      "int cc_major=9, int cc_minor=0, int num_sms=132, int smem_per_block_optin=232448, "
      "int smem_per_sm=233472, int reserved_smem_per_block=1024, "
      "bool sm90a_built=True, str kernel_override=\"\", bool tma_aligned=True, "
      "int head_dim_v=-1) -> str");
  m.def(
      "_plan_decode(int batch, int seqlen_q, int cache_capacity, int nheads, int nheads_k, "
      "int head_dim, *, bool paged=False, int num_splits=0, bool causal=False, "
      "int window_size_left=-1, int window_size_right=-1, float softcap=0.0, bool alibi=False, "
      "float? softmax_scale=None, int seqlen_new=0, int rotary_dim=0, bool rotary_aligned=True, "
      "int cc_major=9, int cc_minor=0, int num_sms=132, int smem_per_block_optin=232448, "
      "int smem_per_sm=233472, int reserved_smem_per_block=1024, bool v_in_k=False, "
      "bool fp8_cache=False, int min_splits=1) -> str");
}
