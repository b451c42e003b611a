// Argument checks of the FP8 forwards (docs/fp8.md), shared by the CPU and
// CUDA implementations: which fp8 form a call takes, its descales, and the
// features FP8 attention does not serve. Every failure is a TORCH_CHECK whose
// message names the argument, the value and what was expected.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

#include "common/fp8_rule.h"

namespace flash {

// The three optional descales of a forward op: fp32 (batch, nheads_k), any
// strides (an expanded tensor of one value is fine).
struct Fp8Descales {
  const std::optional<at::Tensor>& q;
  const std::optional<at::Tensor>& k;
  const std::optional<at::Tensor>& v;

  bool any() const { return q.has_value() || k.has_value() || v.has_value(); }
};

// The fp8 form of a forward call.
enum class Fp8Call {
  kNone,       // no fp8 tensor: the 16-bit (or fp32) call, and no descale given
  kAttention,  // fwd / varlen_fwd: q, k and v float8_e4m3fn, output bf16
  kKvCache,    // k / v (fwd, varlen_fwd) or k_cache / v_cache (fwd_kvcache)
               // float8_e4m3fn, q fp16 / bf16, output q's dtype
};

// fwd / varlen_fwd and their *_out forms (messages start "flash_attn"). Run
// before the other checks, so that an fp8 call gets these messages rather
// than a generic dtype one. Two fp8 forms: all three e4m3 (kAttention), or
// e4m3 k and v with a float16 / bfloat16 q and no q_descale (kKvCache: an
// FP8 KV cache read by the varlen or paged forward). Refuses float8_e5m2,
// any other mix of fp8 and other dtypes, and descales without fp8 inputs.
Fp8Call fp8_attention_call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const Fp8Descales& descales);

// fwd_kvcache / fwd_kvcache_out (messages start "fwd_kvcache"). An fp8
// cache takes a float16 / bfloat16 q and no q_descale: q is not quantised.
// Refuses float8_e5m2, an fp8 q, k_cache and v_cache of different kinds,
// and k_descale / v_descale without an fp8 cache.
Fp8Call fp8_kvcache_call(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const Fp8Descales& descales);

// After the shape checks, for a call that is not kNone: each descale given
// is float32, on q's device, of shape (batch, nheads_k); batch is the
// number of sequences (varlen) or query batch entries (fwd_kvcache).
void check_fp8_descales(const char* prefix, const Fp8Descales& descales, const at::Tensor& q,
                        int64_t batch, int64_t nheads_k);

// What FP8 attention does not serve: dropout, ALiBi and the S_dmask of
// return_softmax (a dropout debugging aid).
void check_fp8_features(const char* prefix, double dropout_p, bool return_softmax,
                        const std::optional<at::Tensor>& alibi_slopes);

// The backward ops: FP8 attention is forward only.
void refuse_fp8_backward(const char* prefix, const at::Tensor& q, const at::Tensor& k,
                         const at::Tensor& v);

// The output dtype of a forward: bfloat16 for fp8 attention, else q's.
at::ScalarType fp8_out_dtype(Fp8Call call, at::ScalarType q_dtype);

// A checked host descale as the CPU core reads it; absent: descale 1.
Fp8Descale fp8_descale_view(const std::optional<at::Tensor>& descale);

}  // namespace flash
