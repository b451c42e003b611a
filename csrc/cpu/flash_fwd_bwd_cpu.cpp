// The CPU attention core (attention_cpu.h): the GPU's tiled online-softmax
// forward and its recompute-P backward, in fp32 whatever the input dtype.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "common/fp8_rule.h"
#include "common/head_dim_bounds.h"
#include "common/score_features.h"
#include "common/sink_norm.h"
#include "cpu/attention_cpu.h"
#include "cpu/attention_tiles.h"

namespace flash::cpu {
namespace {

struct WorkItem {
  int batch;
  int head;
  int block_start;  // first query row (forward, dq) or first key (dk / dv)
};

// One item per (batch, head, block of `block` rows of length(span)).
template <typename Length>
std::vector<WorkItem> make_work_items(const std::vector<SequenceSpan>& sequences, int heads,
                                      int block, Length length) {
  std::vector<WorkItem> items;
  for (int b = 0; b < static_cast<int>(sequences.size()); ++b) {
    const int rows = length(sequences[b]);
    for (int h = 0; h < heads; ++h) {
      for (int start = 0; start < rows; start += block) items.push_back({b, h, start});
    }
  }
  return items;
}

int seqlen_q_of(const SequenceSpan& s) { return s.seqlen_q; }
int seqlen_k_of(const SequenceSpan& s) { return s.seqlen_k; }

float dropout_rescale(const AttentionProblem& p) {
  return p.dropout_p > 0.f ? 1.f / (1.f - p.dropout_p) : 1.f;
}

// Loads keys [key0, key0 + cols) of one kv head: transposed (d x kBlockN) into
// `transposed`, and row-major (kBlockN x d) into `rows` when given. An fp8
// tile is dequantised with `descale`, which other dtypes ignore.
template <typename T>
void load_kv_tile(const AttentionProblem& p, const void* base, const RowStrides& st,
                  const SequenceSpan& span, int key0, int cols, int kv_head, float* transposed,
                  float* rows, float descale = 1.f) {
  const int d = p.head_dim;
  for (int c = 0; c < cols; ++c) {
    const T* src = static_cast<const T*>(base) + kv_offset(p, st, span, key0 + c, kv_head);
    for (int dd = 0; dd < d; ++dd) {
      const float value = element_value(src[dd], descale);
      if (transposed != nullptr) transposed[dd * kBlockN + c] = value;
      if (rows != nullptr) rows[c * d + dd] = value;
    }
  }
}

// ---------------------------------------------------------------- forward --

struct ForwardScratch {
  std::vector<float> q, kt, v, s, acc, row_max, row_sum;
  explicit ForwardScratch(int d)
      : q(kBlockM * d),
        kt(d * kBlockN),
        v(kBlockN * d),
        s(kBlockM * kBlockN),
        acc(kBlockM * d),
        row_max(kBlockM),
        row_sum(kBlockM) {}
};

// Writes S_dmask for rows [m0, m0 + rows) (only when requested), in the
// convention of flash-attn 2.x: key blocks of kProbsBlockN columns, aligned to
// key 0, are visited from the last one to the first, and each visible entry
// holds the softmax numerator exp(s - m) with m the row's running max over the
// blocks visited so far (this block and every block to its right), negated
// (sign bit set) where dropout dropped it. Masked entries are not written (the
// caller zero-fills them). A second pass over the visible keys, after the
// forward's own: the q rows are still in the scratch.
template <typename TKV, typename TO>
void write_probabilities(const AttentionProblem& p, const ForwardOutputs& o, int b, int h, int m0,
                         int rows, ForwardScratch& sc) {
  static_assert(kProbsBlockN <= kBlockN, "one S_dmask key block must fit one score tile");
  const SequenceSpan& span = p.sequences[b];
  const int d = p.head_dim;
  const int kv_head = h / (p.nheads / p.nheads_k);
  const ScoreRule rule(p, span, b, h);
  const KeyRange range = flash::visible_key_range(m0, m0 + rows, span.seqlen_q, span.seqlen_k,
                                                  p.window_left, p.window_right);
  if (range.end <= range.begin) return;
  TO* probs = static_cast<TO*>(o.probs) + b * o.probs_batch_stride + h * o.probs_head_stride;
  float running_max[kBlockM];
  std::fill(running_max, running_max + rows, kNegInf);
  const int first_block = range.begin / kProbsBlockN;
  for (int block = (range.end - 1) / kProbsBlockN; block >= first_block; --block) {
    const int n0 = std::max(block * kProbsBlockN, range.begin);
    const int cols = std::min((block + 1) * kProbsBlockN, range.end) - n0;
    load_kv_tile<TKV>(p, p.k, p.k_strides, span, n0, cols, kv_head, sc.kt.data(), nullptr,
                      p.k_descale.at(b, kv_head));
    matmul_a_bt(sc.q.data(), d, sc.kt.data(), kBlockN, sc.s.data(), kBlockN, rows, cols, d);
    rule.apply(sc.s.data(), kBlockN, m0, rows, n0, cols);
    for (int r = 0; r < rows; ++r) {
      const float* sr = sc.s.data() + r * kBlockN;
      float m = running_max[r];
      for (int c = 0; c < cols; ++c) m = std::max(m, sr[c]);
      running_max[r] = m;
      if (m == kNegInf) continue;  // nothing visible to this row up to here
      TO* out_row = probs + (m0 + r) * o.probs_row_stride + n0;
      DropoutRow dropout(p, b, h, m0 + r);
      for (int c = 0; c < cols; ++c) {
        if (sr[c] == kNegInf) continue;  // masked: stays 0
        float numerator = std::exp(sr[c] - m);
        if (p.dropout_p > 0.f && !dropout.keep(n0 + c)) numerator = -numerator;
        out_row[c] = static_cast<TO>(numerator);
      }
    }
  }
}

// TQ, TKV: the dtypes of q and of k / v (fp8 ones are dequantised as they
// load), TO: of out and probs.
template <typename TQ, typename TKV, typename TO>
void forward_block(const AttentionProblem& p, const ForwardOutputs& o, const WorkItem& item,
                   ForwardScratch& sc) {
  const int b = item.batch, h = item.head, m0 = item.block_start;
  const SequenceSpan& span = p.sequences[b];
  const int d = p.head_dim;
  const int rows = std::min(kBlockM, span.seqlen_q - m0);
  const int kv_head = h / (p.nheads / p.nheads_k);
  const bool use_dropout = p.dropout_p > 0.f;

  const float q_descale = p.q_descale.at(b, kv_head);
  const float k_descale = p.k_descale.at(b, kv_head);
  const float v_descale = p.v_descale.at(b, kv_head);
  for (int r = 0; r < rows; ++r) {
    load_row(q_row<TQ>(p.q, p.q_strides, span, m0 + r, h), sc.q.data() + r * d, d, q_descale);
  }
  std::fill(sc.acc.begin(), sc.acc.begin() + rows * d, 0.f);
  std::fill(sc.row_max.begin(), sc.row_max.end(), kNegInf);
  std::fill(sc.row_sum.begin(), sc.row_sum.end(), 0.f);

  const ScoreRule rule(p, span, b, h);
  const KeyRange range = flash::visible_key_range(m0, m0 + rows, span.seqlen_q, span.seqlen_k,
                                                  p.window_left, p.window_right);
  for (int n0 = range.begin; n0 < range.end; n0 += kBlockN) {
    const int cols = std::min(kBlockN, range.end - n0);
    load_kv_tile<TKV>(p, p.k, p.k_strides, span, n0, cols, kv_head, sc.kt.data(), nullptr,
                      k_descale);
    load_kv_tile<TKV>(p, p.v, p.v_strides, span, n0, cols, kv_head, nullptr, sc.v.data(),
                      v_descale);
    matmul_a_bt(sc.q.data(), d, sc.kt.data(), kBlockN, sc.s.data(), kBlockN, rows, cols, d);
    rule.apply(sc.s.data(), kBlockN, m0, rows, n0, cols);

    for (int r = 0; r < rows; ++r) {
      float* sr = sc.s.data() + r * kBlockN;
      float block_max = kNegInf;
      for (int c = 0; c < cols; ++c) block_max = std::max(block_max, sr[c]);
      const float new_max = std::max(sc.row_max[r], block_max);
      if (new_max == kNegInf) {
        // Nothing visible to this row so far: its P row is zero.
        std::fill(sr, sr + cols, 0.f);
        continue;
      }
      const float correction = std::exp(sc.row_max[r] - new_max);
      if (correction != 1.f) {
        float* acc_row = sc.acc.data() + r * d;
        for (int dd = 0; dd < d; ++dd) acc_row[dd] *= correction;
        sc.row_sum[r] *= correction;
      }
      float block_sum = 0.f;
      for (int c = 0; c < cols; ++c) {
        sr[c] = std::exp(sr[c] - new_max);
        block_sum += sr[c];
      }
      sc.row_sum[r] += block_sum;
      sc.row_max[r] = new_max;
      if (use_dropout) {
        // The normaliser sums the undropped P; only the product with V drops.
        DropoutRow dropout(p, b, h, m0 + r);
        for (int c = 0; c < cols; ++c) {
          if (!dropout.keep(n0 + c)) sr[c] = 0.f;
        }
      }
    }
    matmul_acc_p_b(sc.s.data(), kBlockN, sc.v.data(), d, sc.acc.data(), d, rows, cols, d);
  }

  const float rescale = dropout_rescale(p);
  const float sink = p.learnable_sink != nullptr ? p.learnable_sink[h] : kNegInf;
  for (int r = 0; r < rows; ++r) {
    TO* out_row = q_row_mut<TO>(o.out, o.out_strides, span, m0 + r, h);
    float& lse = o.lse[lse_offset(o.lse_strides, span, m0 + r, h)];
    if (sc.row_sum[r] == 0.f) {
      // A row that sees no key: output 0, lse +inf (so that P = exp(s - lse) =
      // 0), or with a sink the sink's own lse, log(exp(sink)).
      for (int dd = 0; dd < d; ++dd) out_row[dd] = static_cast<TO>(0.f);
      lse = empty_row_lse(sink);
    } else if (sink == kNegInf) {
      store_row(sc.acc.data() + r * d, out_row, d, rescale / sc.row_sum[r]);
      lse = sc.row_max[r] + std::log(sc.row_sum[r]);
    } else {
      const RowNorm norm = row_norm_with_sink(sc.row_max[r], sc.row_sum[r], false, sink, rescale);
      store_row(sc.acc.data() + r * d, out_row, d, norm.out_scale);
      lse = norm.lse;
    }
  }
  if (o.probs != nullptr) write_probabilities<TKV, TO>(p, o, b, h, m0, rows, sc);
}

template <typename TQ, typename TKV = TQ, typename TO = TQ>
void forward_impl(const AttentionProblem& p, const ForwardOutputs& o) {
  const std::vector<WorkItem> items = make_work_items(p.sequences, p.nheads, kBlockM, seqlen_q_of);
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    ForwardScratch scratch(p.head_dim);
    for (int64_t i = begin; i < end; ++i) forward_block<TQ, TKV, TO>(p, o, items[i], scratch);
  });
}

// --------------------------------------------------------------- backward --
//
// Two passes, each free of races without atomics: dk / dv per (batch, kv
// head, key block), looping over the query heads of its group and the query
// blocks that see the key block; then dq per (batch, head, query block),
// looping over its visible key blocks. P and dP are recomputed in both passes
// (the price of needing no dq accumulation buffer). Every reduction runs in a
// fixed order, so the result does not depend on the thread count: the
// backward is always deterministic and the `deterministic` flag has nothing
// to change on the CPU.

struct BackwardScratch {
  std::vector<float> q, dout, kt, vt, k, s, dscore_ddot, dp, acc_a, acc_b, lse, delta;
  explicit BackwardScratch(int d)
      : q(kBlockM * d),
        dout(kBlockM * d),
        kt(d * kBlockN),
        vt(d * kBlockN),
        k(kBlockN * d),
        s(kBlockM * kBlockN),
        dscore_ddot(kBlockM * kBlockN),
        dp(kBlockM * kBlockN),
        acc_a(std::max(kBlockM, kBlockN) * d),
        acc_b(std::max(kBlockM, kBlockN) * d),
        lse(kBlockM),
        delta(kBlockM) {}
};

// delta = rowsum(dout * out) of every (query row, head), indexed by
// (query_row_base[b] + i) * nheads + h.
struct Delta {
  std::vector<int64_t> query_row_base;
  std::vector<float> values;
  float at(int b, int i, int h, int nheads) const {
    return values[(query_row_base[b] + i) * nheads + h];
  }
};

template <typename T>
Delta compute_delta(const AttentionProblem& p, const BackwardTensors& t) {
  Delta delta;
  const int batch = static_cast<int>(p.sequences.size());
  delta.query_row_base.resize(batch + 1, 0);
  for (int b = 0; b < batch; ++b) {
    delta.query_row_base[b + 1] = delta.query_row_base[b] + p.sequences[b].seqlen_q;
  }
  delta.values.resize(delta.query_row_base[batch] * p.nheads);
  const std::vector<WorkItem> items = make_work_items(p.sequences, p.nheads, kBlockM, seqlen_q_of);
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t it = begin; it < end; ++it) {
      const WorkItem& item = items[it];
      const SequenceSpan& span = p.sequences[item.batch];
      const int rows = std::min(kBlockM, span.seqlen_q - item.block_start);
      for (int r = 0; r < rows; ++r) {
        const int i = item.block_start + r;
        const T* dout = q_row<T>(t.dout, t.dout_strides, span, i, item.head);
        const T* out = q_row<T>(t.out, t.out_strides, span, i, item.head);
        float sum = 0.f;
        for (int dd = 0; dd < p.head_dim; ++dd) {
          sum += static_cast<float>(dout[dd]) * static_cast<float>(out[dd]);
        }
        delta.values[(delta.query_row_base[item.batch] + i) * p.nheads + item.head] = sum;
        if (t.delta_out != nullptr) {
          t.delta_out[lse_offset(t.delta_out_strides, span, i, item.head)] = sum;
        }
      }
    }
  });
  return delta;
}

// Loads q, dout, lse and delta of query rows [m0, m0 + rows) of head h.
template <typename T>
void load_query_block(const AttentionProblem& p, const BackwardTensors& t, const Delta& delta,
                      int b, int h, int m0, int rows, BackwardScratch& sc) {
  const SequenceSpan& span = p.sequences[b];
  const int d = p.head_dim;
  for (int r = 0; r < rows; ++r) {
    load_row(q_row<T>(p.q, p.q_strides, span, m0 + r, h), sc.q.data() + r * d, d);
    load_row(q_row<T>(t.dout, t.dout_strides, span, m0 + r, h), sc.dout.data() + r * d, d);
    sc.lse[r] = t.lse[lse_offset(t.lse_strides, span, m0 + r, h)];
    sc.delta[r] = delta.at(b, m0 + r, h, p.nheads);
  }
}

// From the loaded q / dout block and key tile: sc.s <- P dropped and rescaled
// (what multiplied V), sc.dp <- dS with the softcap factor (d loss / d(q·k)
// up to softmax_scale).
void probabilities_and_dscores(const AttentionProblem& p, const ScoreRule& rule, int b, int h,
                               int m0, int rows, int n0, int cols, BackwardScratch& sc) {
  const int d = p.head_dim;
  const bool use_softcap = softcap_on(p.softcap);
  const bool use_dropout = p.dropout_p > 0.f;
  const float rescale = dropout_rescale(p);
  matmul_a_bt(sc.q.data(), d, sc.kt.data(), kBlockN, sc.s.data(), kBlockN, rows, cols, d);
  rule.apply(sc.s.data(), kBlockN, m0, rows, n0, cols,
             use_softcap ? sc.dscore_ddot.data() : nullptr);
  matmul_a_bt(sc.dout.data(), d, sc.vt.data(), kBlockN, sc.dp.data(), kBlockN, rows, cols, d);
  for (int r = 0; r < rows; ++r) {
    float* sr = sc.s.data() + r * kBlockN;
    float* dpr = sc.dp.data() + r * kBlockN;
    const float* gr = sc.dscore_ddot.data() + r * kBlockN;
    DropoutRow dropout(p, b, h, m0 + r);
    for (int c = 0; c < cols; ++c) {
      // Masked scores are -inf, so P = 0 there whatever the lse (+inf, or
      // the sink, for a row that saw no key).
      const float prob = sr[c] == kNegInf ? 0.f : std::exp(sr[c] - sc.lse[r]);
      float prob_applied = prob, dprob = dpr[c];
      if (use_dropout) {
        if (dropout.keep(n0 + c)) {
          prob_applied *= rescale;
          dprob *= rescale;
        } else {
          prob_applied = 0.f;
          dprob = 0.f;
        }
      }
      float dscore = prob * (dprob - sc.delta[r]);
      if (use_softcap) dscore *= gr[c];
      sr[c] = prob_applied;
      dpr[c] = dscore;
    }
  }
}

template <typename T>
void dkdv_block(const AttentionProblem& p, const BackwardTensors& t, const Delta& delta,
                const WorkItem& item, BackwardScratch& sc) {
  const int b = item.batch, kv_head = item.head, n0 = item.block_start;
  const SequenceSpan& span = p.sequences[b];
  const int d = p.head_dim;
  const int cols = std::min(kBlockN, span.seqlen_k - n0);
  const int group = p.nheads / p.nheads_k;
  load_kv_tile<T>(p, p.k, p.k_strides, span, n0, cols, kv_head, sc.kt.data(), nullptr);
  load_kv_tile<T>(p, p.v, p.v_strides, span, n0, cols, kv_head, sc.vt.data(), nullptr);
  float* dk_acc = sc.acc_a.data();
  float* dv_acc = sc.acc_b.data();
  std::fill(dk_acc, dk_acc + cols * d, 0.f);
  std::fill(dv_acc, dv_acc + cols * d, 0.f);

  for (int h = kv_head * group; h < (kv_head + 1) * group; ++h) {
    const ScoreRule rule(p, span, b, h);
    for (int m0 = 0; m0 < span.seqlen_q; m0 += kBlockM) {
      const int rows = std::min(kBlockM, span.seqlen_q - m0);
      const KeyRange range = flash::visible_key_range(m0, m0 + rows, span.seqlen_q, span.seqlen_k,
                                                      p.window_left, p.window_right);
      if (range.end <= n0 || range.begin >= n0 + cols) continue;
      load_query_block<T>(p, t, delta, b, h, m0, rows, sc);
      probabilities_and_dscores(p, rule, b, h, m0, rows, n0, cols, sc);
      matmul_acc_pt_a(sc.s.data(), kBlockN, sc.dout.data(), d, dv_acc, d, rows, cols, d);
      matmul_acc_pt_a(sc.dp.data(), kBlockN, sc.q.data(), d, dk_acc, d, rows, cols, d);
    }
  }
  for (int c = 0; c < cols; ++c) {
    store_row(dk_acc + c * d,
              static_cast<T*>(t.dk) + kv_offset(p, t.dk_strides, span, n0 + c, kv_head), d,
              p.softmax_scale);
    store_row(dv_acc + c * d,
              static_cast<T*>(t.dv) + kv_offset(p, t.dv_strides, span, n0 + c, kv_head), d, 1.f);
  }
}

template <typename T>
void dq_block(const AttentionProblem& p, const BackwardTensors& t, const Delta& delta,
              const WorkItem& item, BackwardScratch& sc) {
  const int b = item.batch, h = item.head, m0 = item.block_start;
  const SequenceSpan& span = p.sequences[b];
  const int d = p.head_dim;
  const int rows = std::min(kBlockM, span.seqlen_q - m0);
  const int kv_head = h / (p.nheads / p.nheads_k);
  float* dq_acc = sc.acc_a.data();
  std::fill(dq_acc, dq_acc + rows * d, 0.f);
  load_query_block<T>(p, t, delta, b, h, m0, rows, sc);

  const ScoreRule rule(p, span, b, h);
  const KeyRange range = flash::visible_key_range(m0, m0 + rows, span.seqlen_q, span.seqlen_k,
                                                  p.window_left, p.window_right);
  for (int n0 = range.begin; n0 < range.end; n0 += kBlockN) {
    const int cols = std::min(kBlockN, range.end - n0);
    load_kv_tile<T>(p, p.k, p.k_strides, span, n0, cols, kv_head, sc.kt.data(), sc.k.data());
    load_kv_tile<T>(p, p.v, p.v_strides, span, n0, cols, kv_head, sc.vt.data(), nullptr);
    probabilities_and_dscores(p, rule, b, h, m0, rows, n0, cols, sc);
    matmul_acc_p_b(sc.dp.data(), kBlockN, sc.k.data(), d, dq_acc, d, rows, cols, d);
  }
  for (int r = 0; r < rows; ++r) {
    store_row(dq_acc + r * d, q_row_mut<T>(t.dq, t.dq_strides, span, m0 + r, h), d,
              p.softmax_scale);
  }
}

template <typename T>
void backward_impl(const AttentionProblem& p, const BackwardTensors& t) {
  const Delta delta = compute_delta<T>(p, t);
  const std::vector<WorkItem> kv_items =
      make_work_items(p.sequences, p.nheads_k, kBlockN, seqlen_k_of);
  at::parallel_for(0, static_cast<int64_t>(kv_items.size()), 1, [&](int64_t begin, int64_t end) {
    BackwardScratch scratch(p.head_dim);
    for (int64_t i = begin; i < end; ++i) dkdv_block<T>(p, t, delta, kv_items[i], scratch);
  });
  const std::vector<WorkItem> q_items =
      make_work_items(p.sequences, p.nheads, kBlockM, seqlen_q_of);
  at::parallel_for(0, static_cast<int64_t>(q_items.size()), 1, [&](int64_t begin, int64_t end) {
    BackwardScratch scratch(p.head_dim);
    for (int64_t i = begin; i < end; ++i) dq_block<T>(p, t, delta, q_items[i], scratch);
  });
}

void check_head_dim(const AttentionProblem& problem) {
  // The tile products work on column strips of 8.
  TORCH_CHECK(
      problem.head_dim > 0 && problem.head_dim % 8 == 0 && problem.head_dim <= kMaxHeadDimCpu,
      "flash_attn (CPU): head_dim must be a multiple of 8 in [8, ", kMaxHeadDimCpu, "], got ",
      problem.head_dim);
}

// The FP8 combinations (attention_cpu.h): fp8 attention, and a 16-bit q over
// an fp8 KV cache.
void fp8_forward(const AttentionProblem& problem, const ForwardOutputs& outputs,
                 c10::ScalarType kv_dtype, c10::ScalarType out_dtype) {
  using c10::ScalarType;
  using Fp8 = c10::Float8_e4m3fn;
  const ScalarType q_dtype = problem.dtype;
  if (q_dtype == ScalarType::Float8_e4m3fn && kv_dtype == q_dtype &&
      out_dtype == ScalarType::BFloat16) {
    return forward_impl<Fp8, Fp8, c10::BFloat16>(problem, outputs);
  }
  if (kv_dtype == ScalarType::Float8_e4m3fn && out_dtype == q_dtype) {
    if (q_dtype == ScalarType::Half)
      return forward_impl<c10::Half, Fp8, c10::Half>(problem, outputs);
    if (q_dtype == ScalarType::BFloat16) {
      return forward_impl<c10::BFloat16, Fp8, c10::BFloat16>(problem, outputs);
    }
  }
  TORCH_CHECK(false, "flash_attn (CPU): unsupported dtypes q ", q_dtype, ", k / v ", kv_dtype,
              ", out ", out_dtype);
}

}  // namespace

void attention_forward(const AttentionProblem& problem, const ForwardOutputs& outputs) {
  check_head_dim(problem);
  const c10::ScalarType kv_dtype =
      problem.kv_dtype == c10::ScalarType::Undefined ? problem.dtype : problem.kv_dtype;
  const c10::ScalarType out_dtype =
      problem.out_dtype == c10::ScalarType::Undefined ? problem.dtype : problem.out_dtype;
  if (kv_dtype != problem.dtype || out_dtype != problem.dtype) {
    return fp8_forward(problem, outputs, kv_dtype, out_dtype);
  }
  switch (problem.dtype) {
    case c10::ScalarType::Float: return forward_impl<float>(problem, outputs);
    case c10::ScalarType::Half: return forward_impl<c10::Half>(problem, outputs);
    case c10::ScalarType::BFloat16: return forward_impl<c10::BFloat16>(problem, outputs);
    default:
      TORCH_CHECK(false, "flash_attn (CPU): unsupported dtype ", problem.dtype,
                  "; expected float32, float16 or bfloat16");
  }
}

void attention_backward(const AttentionProblem& problem, const BackwardTensors& tensors) {
  check_head_dim(problem);
  TORCH_CHECK(problem.page_size == 0,
              "flash_attn (CPU): the backward pass does not support paged K/V");
  switch (problem.dtype) {
    case c10::ScalarType::Float: return backward_impl<float>(problem, tensors);
    case c10::ScalarType::Half: return backward_impl<c10::Half>(problem, tensors);
    case c10::ScalarType::BFloat16: return backward_impl<c10::BFloat16>(problem, tensors);
    default:
      TORCH_CHECK(false, "flash_attn (CPU): unsupported dtype ", problem.dtype,
                  "; expected float32, float16 or bfloat16");
  }
}

std::vector<SequenceSpan> fixed_length_sequences(int batch, int seqlen_q, int seqlen_k) {
  std::vector<SequenceSpan> sequences(batch);
  for (int b = 0; b < batch; ++b) sequences[b] = {seqlen_q, seqlen_k, b, 0, b, 0, nullptr};
  return sequences;
}

std::vector<SequenceSpan> varlen_sequences(int batch, const int32_t* cu_seqlens_q,
                                           const int32_t* cu_seqlens_k, const int32_t* seqused_k,
                                           const int32_t* seqused_q, const int32_t* block_table,
                                           int64_t block_table_batch_stride) {
  std::vector<SequenceSpan> sequences(batch);
  for (int b = 0; b < batch; ++b) {
    SequenceSpan& s = sequences[b];
    // The used lengths are the sequence's lengths, for the rows computed and
    // for the bottom-right alignment of causal / local windows (as FA3).
    s.seqlen_q = seqused_q != nullptr ? seqused_q[b] : cu_seqlens_q[b + 1] - cu_seqlens_q[b];
    s.seqlen_k = seqused_k != nullptr ? seqused_k[b] : cu_seqlens_k[b + 1] - cu_seqlens_k[b];
    s.q_batch = 0;
    s.q_first_row = cu_seqlens_q[b];
    s.kv_batch = 0;
    // Paged keys are numbered from 0 within the batch entry's block table row.
    s.kv_first_row = block_table != nullptr ? 0 : cu_seqlens_k[b];
    s.block_table_row =
        block_table != nullptr ? block_table + b * block_table_batch_stride : nullptr;
  }
  return sequences;
}

}  // namespace flash::cpu
