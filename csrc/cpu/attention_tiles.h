// Tile-level building blocks of the CPU attention core (forward and
// backward): element conversion, row addressing, fp32 tile products and the
// score rule (scale, softcap, ALiBi, mask, dropout) applied to a score tile.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "../common/mask_rule.h"
#include "../common/philox.h"
#include "attention_cpu.h"

namespace flash::cpu {

// Tile sizes: small enough that a thread's working set of fp32 tiles stays in
// L2 at head_dim 256, large enough to amortise per-tile overhead.
constexpr int kBlockM = 32;
constexpr int kBlockN = 64;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kPosInf = std::numeric_limits<float>::infinity();

// Query-side rows (q, out, dout, dq) of query `row`, head `head`.
template <typename T>
inline const T* q_row(const void* base, const RowStrides& st, const SequenceSpan& span, int row,
                      int head) {
  return static_cast<const T*>(base) + span.q_batch * st.batch +
         (span.q_first_row + row) * st.row + static_cast<int64_t>(head) * st.head;
}

template <typename T>
inline T* q_row_mut(void* base, const RowStrides& st, const SequenceSpan& span, int row,
                    int head) {
  return static_cast<T*>(base) + span.q_batch * st.batch + (span.q_first_row + row) * st.row +
         static_cast<int64_t>(head) * st.head;
}

// Element offset of key `key` of this sequence in a K/V-shaped tensor.
inline int64_t kv_offset(const AttentionProblem& p, const RowStrides& st,
                         const SequenceSpan& span, int key, int kv_head) {
  const int64_t pos = span.kv_first_row + key;
  int64_t block = span.kv_batch, row = pos;
  if (span.block_table_row != nullptr) {
    block = span.block_table_row[pos / p.page_size];
    row = pos % p.page_size;
  }
  return block * st.batch + row * st.row + static_cast<int64_t>(kv_head) * st.head;
}

inline int64_t lse_offset(const RowStrides& st, const SequenceSpan& span, int row, int head) {
  return span.q_batch * st.batch + (span.q_first_row + row) * st.row +
         static_cast<int64_t>(head) * st.head;
}

template <typename T>
inline void load_row(const T* src, float* dst, int n) {
  for (int i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename T>
inline void store_row(const float* src, T* dst, int n, float scale) {
  for (int i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i] * scale);
}

// c[m x n] = a[m x k] * bt[k x n]. The inner loop runs over n so that it
// vectorises without reassociating a reduction.
inline void matmul_a_bt(const float* a, int lda, const float* bt, int ldbt, float* c, int ldc,
                        int m, int n, int k) {
  for (int i = 0; i < m; ++i) {
    float* ci = c + static_cast<int64_t>(i) * ldc;
    for (int j = 0; j < n; ++j) ci[j] = 0.f;
    const float* ai = a + static_cast<int64_t>(i) * lda;
    for (int kk = 0; kk < k; ++kk) {
      const float aik = ai[kk];
      const float* b = bt + static_cast<int64_t>(kk) * ldbt;
      for (int j = 0; j < n; ++j) ci[j] += aik * b[j];
    }
  }
}

// c[m x k] += p[m x n] * b[n x k]
inline void matmul_acc_p_b(const float* p, int ldp, const float* b, int ldb, float* c, int ldc,
                           int m, int n, int k) {
  for (int i = 0; i < m; ++i) {
    float* ci = c + static_cast<int64_t>(i) * ldc;
    const float* pi = p + static_cast<int64_t>(i) * ldp;
    for (int j = 0; j < n; ++j) {
      const float pij = pi[j];
      if (pij == 0.f) continue;
      const float* bj = b + static_cast<int64_t>(j) * ldb;
      for (int kk = 0; kk < k; ++kk) ci[kk] += pij * bj[kk];
    }
  }
}

// c[n x k] += p[m x n]^T * a[m x k]
inline void matmul_acc_pt_a(const float* p, int ldp, const float* a, int lda, float* c, int ldc,
                            int m, int n, int k) {
  for (int i = 0; i < m; ++i) {
    const float* pi = p + static_cast<int64_t>(i) * ldp;
    const float* ai = a + static_cast<int64_t>(i) * lda;
    for (int j = 0; j < n; ++j) {
      const float pij = pi[j];
      if (pij == 0.f) continue;
      float* cj = c + static_cast<int64_t>(j) * ldc;
      for (int kk = 0; kk < k; ++kk) cj[kk] += pij * ai[kk];
    }
  }
}

// The score rule of one (batch, query head), applied to a tile of raw dot
// products q·k: scale, softcap, ALiBi, then the mask (DESIGN.md, op contract).
struct ScoreRule {
  int seqlen_q;
  int seqlen_k;
  int window_left;
  int window_right;
  float softmax_scale;
  float softcap;
  bool has_alibi;
  float alibi_slope;

  ScoreRule(const AttentionProblem& p, const SequenceSpan& span, int batch, int head)
      : seqlen_q(span.seqlen_q),
        seqlen_k(span.seqlen_k),
        window_left(p.window_left),
        window_right(p.window_right),
        softmax_scale(p.softmax_scale),
        softcap(p.softcap),
        has_alibi(p.alibi_slopes != nullptr),
        alibi_slope(p.alibi_slopes != nullptr
                        ? p.alibi_slopes[batch * p.alibi_batch_stride + head]
                        : 0.f) {}

  // s[rows x cols] (leading dim lds) holds dot products of rows [row0, ..)
  // with keys [col0, ..); replaced by final scores, -inf where masked. When
  // softcap is on and dscore_ddot is given, it receives ds/d(dot) / softmax_scale
  // = 1 - tanh^2 for the backward (1 where softcap is off).
  void apply(float* s, int lds, int row0, int rows, int col0, int cols,
             float* dscore_ddot = nullptr) const {
    const float cap_in = softcap > 0.f ? softmax_scale / softcap : 0.f;
    for (int r = 0; r < rows; ++r) {
      float* sr = s + static_cast<int64_t>(r) * lds;
      float* gr = dscore_ddot != nullptr ? dscore_ddot + static_cast<int64_t>(r) * lds : nullptr;
      const int row = row0 + r;
      for (int c = 0; c < cols; ++c) {
        const int col = col0 + c;
        float score;
        if (softcap > 0.f) {
          const float t = std::tanh(sr[c] * cap_in);
          score = softcap * t;
          if (gr != nullptr) gr[c] = 1.f - t * t;
        } else {
          score = sr[c] * softmax_scale;
          if (gr != nullptr) gr[c] = 1.f;
        }
        if (has_alibi) score += flash::alibi_bias(alibi_slope, row, col, seqlen_q, seqlen_k);
        if (!flash::key_visible(row, col, seqlen_q, seqlen_k, window_left, window_right)) {
          score = kNegInf;
        }
        sr[c] = score;
      }
    }
  }
};

// Dropout keep decisions along one query row, one Philox call per group of
// four columns (the definition in common/philox.h).
class DropoutRow {
 public:
  DropoutRow(const AttentionProblem& p, int batch, int head, int row)
      : seed_(p.philox_seed),
        offset_(p.philox_offset),
        batch_(batch),
        head_(head),
        nheads_(p.nheads),
        row_(row),
        threshold_(flash::dropout_threshold(p.dropout_p)) {}

  bool keep(int col) {
    if ((col >> 2) != group_) {
      group_ = col >> 2;
      bits_ = flash::dropout_random_bits(seed_, offset_, batch_, head_, nheads_, row_, col);
    }
    return flash::dropout_keep(bits_, col, threshold_);
  }

 private:
  uint64_t seed_;
  uint64_t offset_;
  int batch_;
  int head_;
  int nheads_;
  int row_;
  uint32_t threshold_;
  int group_ = -1;
  flash::PhiloxOut bits_{};
};

}  // namespace flash::cpu
