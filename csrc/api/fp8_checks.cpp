#include "api/fp8_checks.h"

#include <c10/util/Exception.h>

#include <initializer_list>
#include <utility>

namespace flash {
namespace {

constexpr at::ScalarType kFp8 = at::kFloat8_e4m3fn;

bool is_fp8(const at::Tensor& t) { return t.scalar_type() == kFp8; }

void refuse_e5m2(const char* prefix, const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() != at::kFloat8_e5m2, prefix, ": ", name,
              " has dtype float8_e5m2, which is not served: FP8 inputs must be float8_e4m3fn "
              "(with a float32 descale)");
}

void refuse_descales_without_fp8(const char* prefix, const Fp8Descales& descales,
                                 const char* what) {
  const std::pair<const char*, const std::optional<at::Tensor>*> named[] = {
      {"q_descale", &descales.q}, {"k_descale", &descales.k}, {"v_descale", &descales.v}};
  for (const auto& [name, descale] : named) {
    TORCH_CHECK(!descale->has_value(), prefix, ": ", name, " is given but ", what,
                ": descales apply to float8_e4m3fn inputs only");
  }
}

void check_descale(const char* prefix, const char* name, const std::optional<at::Tensor>& descale,
                   const at::Tensor& q, int64_t batch, int64_t nheads_k) {
  if (!descale.has_value()) return;
  const at::Tensor& d = *descale;
  TORCH_CHECK(d.scalar_type() == at::kFloat, prefix, ": ", name, " must have dtype float32, got ",
              d.scalar_type());
  TORCH_CHECK(d.device() == q.device(), prefix, ": ", name, " must be on the device of q (",
              q.device(), "), got ", d.device());
  TORCH_CHECK(d.dim() == 2 && d.size(0) == batch && d.size(1) == nheads_k, prefix, ": ", name,
              " must have shape (batch, nheads_k) = (", batch, ", ", nheads_k, "), got ",
              d.sizes());
}

}  // namespace

Fp8Call fp8_attention_call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const Fp8Descales& descales) {
  constexpr const char* kPrefix = "flash_attn";
  refuse_e5m2(kPrefix, q, "q");
  refuse_e5m2(kPrefix, k, "k");
  refuse_e5m2(kPrefix, v, "v");
  const int fp8_count = int(is_fp8(q)) + int(is_fp8(k)) + int(is_fp8(v));
  if (fp8_count == 3) return Fp8Call::kAttention;
  if (fp8_count == 2 && !is_fp8(q)) {
    // An FP8 KV cache read by the varlen (paged) forward or flash_attn_func:
    // e4m3 keys and values with a 16-bit q, as fwd_kvcache takes them.
    TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16, kPrefix,
                ": with k and v of dtype float8_e4m3fn (an FP8 KV cache) q must have dtype "
                "float16 or bfloat16 (or float8_e4m3fn, for FP8 attention), got ",
                q.scalar_type());
    TORCH_CHECK(!descales.q.has_value(), kPrefix,
                ": q_descale is not taken with float8_e4m3fn k and v and a ", q.scalar_type(),
                " q: q is not quantised (k_descale and v_descale dequantise k and v)");
    return Fp8Call::kKvCache;
  }
  TORCH_CHECK(fp8_count == 0, kPrefix,
              ": q, k and v must be all float8_e4m3fn (FP8 attention), or k and v "
              "float8_e4m3fn with a float16 / bfloat16 q (an FP8 KV cache), or none of them; "
              "got q ",
              q.scalar_type(), ", k ", k.scalar_type(), ", v ", v.scalar_type());
  refuse_descales_without_fp8(kPrefix, descales, "q, k and v are not float8_e4m3fn");
  return Fp8Call::kNone;
}

Fp8Call fp8_kvcache_call(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const Fp8Descales& descales) {
  constexpr const char* kPrefix = "fwd_kvcache";
  refuse_e5m2(kPrefix, q, "q");
  refuse_e5m2(kPrefix, k_cache, "k_cache");
  refuse_e5m2(kPrefix, v_cache, "v_cache");
  TORCH_CHECK(!is_fp8(q), kPrefix,
              ": q has dtype float8_e4m3fn, which fwd_kvcache does not take: an FP8 KV cache "
              "(k_cache / v_cache float8_e4m3fn) is read with a float16 or bfloat16 q");
  TORCH_CHECK(is_fp8(k_cache) == is_fp8(v_cache), kPrefix,
              ": k_cache and v_cache must both be float8_e4m3fn or neither, got k_cache ",
              k_cache.scalar_type(), ", v_cache ", v_cache.scalar_type());
  if (!is_fp8(k_cache)) {
    refuse_descales_without_fp8(kPrefix, descales, "k_cache and v_cache are not float8_e4m3fn");
    return Fp8Call::kNone;
  }
  TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16, kPrefix,
              ": with a float8_e4m3fn cache q must have dtype float16 or bfloat16, got ",
              q.scalar_type());
  TORCH_CHECK(!descales.q.has_value(), kPrefix,
              ": q_descale is not taken with an FP8 KV cache: q is float16 / bfloat16 and not "
              "quantised (k_descale and v_descale dequantise the cache)");
  return Fp8Call::kKvCache;
}

void check_fp8_descales(const char* prefix, const Fp8Descales& descales, const at::Tensor& q,
                        int64_t batch, int64_t nheads_k) {
  check_descale(prefix, "q_descale", descales.q, q, batch, nheads_k);
  check_descale(prefix, "k_descale", descales.k, q, batch, nheads_k);
  check_descale(prefix, "v_descale", descales.v, q, batch, nheads_k);
}

void check_fp8_features(const char* prefix, double dropout_p, bool return_softmax,
                        const std::optional<at::Tensor>& alibi_slopes) {
  TORCH_CHECK(dropout_p == 0.0, prefix,
              ": dropout is not served with float8_e4m3fn inputs (FP8 attention is inference "
              "only): dropout_p must be 0, got ",
              dropout_p);
  TORCH_CHECK(!return_softmax, prefix,
              ": return_softmax (S_dmask) is not served with float8_e4m3fn inputs");
  TORCH_CHECK(!alibi_slopes.has_value(), prefix,
              ": alibi_slopes is not served with float8_e4m3fn inputs");
}

void refuse_fp8_backward(const char* prefix, const at::Tensor& q, const at::Tensor& k,
                         const at::Tensor& v) {
  for (const at::Tensor* t : {&q, &k, &v}) {
    TORCH_CHECK(!is_fp8(*t) && t->scalar_type() != at::kFloat8_e5m2, prefix,
                ": the backward pass does not take float8 inputs (got q ", q.scalar_type(), ", k ",
                k.scalar_type(), ", v ", v.scalar_type(),
                "): FP8 attention is forward only; train in float16 or bfloat16");
  }
}

at::ScalarType fp8_out_dtype(Fp8Call call, at::ScalarType q_dtype) {
  return call == Fp8Call::kAttention ? at::kBFloat16 : q_dtype;
}

Fp8Descale fp8_descale_view(const std::optional<at::Tensor>& descale) {
  Fp8Descale view;
  if (!descale.has_value()) return view;
  view.values = descale->const_data_ptr<float>();
  view.batch_stride = descale->stride(0);
  view.head_stride = descale->stride(1);
  return view;
}

}  // namespace flash
