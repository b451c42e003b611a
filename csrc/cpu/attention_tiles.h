// Tile-level building blocks of the CPU attention core (forward and
// backward): element conversion, row addressing, fp32 tile products and the
// score rule (scale, softcap, ALiBi, mask, dropout) applied to a score tile.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "common/fp8_rule.h"
#include "common/mask_rule.h"
#include "common/philox.h"
#include "common/score_features.h"
#include "cpu/attention_cpu.h"

namespace flash::cpu {

// Tile sizes: small enough that a thread's working set of fp32 tiles stays in
// L2 at head_dim 256, large enough to amortise per-tile overhead.
constexpr int kBlockM = 32;
constexpr int kBlockN = 64;
static_assert(kBlockN % 16 == 0, "matmul_a_bt computes key columns in strips of 16");

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kPosInf = std::numeric_limits<float>::infinity();

// Query-side rows (q, out, dout, dq) of query `row`, head `head`.
template <typename T>
inline const T* q_row(const void* base, const RowStrides& st, const SequenceSpan& span, int row,
                      int head) {
  return static_cast<const T*>(base) + span.q_batch * st.batch + (span.q_first_row + row) * st.row +
         static_cast<int64_t>(head) * st.head;
}

template <typename T>
inline T* q_row_mut(void* base, const RowStrides& st, const SequenceSpan& span, int row, int head) {
  return static_cast<T*>(base) + span.q_batch * st.batch + (span.q_first_row + row) * st.row +
         static_cast<int64_t>(head) * st.head;
}

// Element offset of key `key` of this sequence in a K/V-shaped tensor.
inline int64_t kv_offset(const AttentionProblem& p, const RowStrides& st, const SequenceSpan& span,
                         int key, int kv_head) {
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
constexpr bool kIsFp8 = std::is_same_v<T, c10::Float8_e4m3fn>;

// One element in fp32: an fp8 one dequantised with descale (common/fp8_rule.h),
// which other dtypes ignore.
template <typename T>
inline float element_value(T x, float descale) {
  if constexpr (kIsFp8<T>) {
    return fp8_dequantize(static_cast<float>(x), descale);
  } else {
    return static_cast<float>(x);
  }
}

// A row in fp32 (dequantised when fp8).
template <typename T>
inline void load_row(const T* src, float* dst, int n, float descale = 1.f) {
  for (int i = 0; i < n; ++i) dst[i] = element_value(src[i], descale);
}

template <typename T>
inline void store_row(const float* src, T* dst, int n, float scale) {
  for (int i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i] * scale);
}

// fp32 tile products. Each keeps a strip of output (two rows x 4V columns)
// in vector registers across the whole reduction: per term, one load of y
// feeds 2V independent multiply-adds, and no sum is reassociated. Vectors of
// 4 floats (GCC / Clang vector extensions) map onto SSE2 / NEON registers, so
// the default -O3 build is vectorised without any -march flag.
#if defined(__GNUC__) || defined(__clang__)
typedef float Float4 __attribute__((vector_size(16)));
#else
#error "the CPU attention tiles need GCC or Clang vector extensions"
#endif

inline Float4 load4(const float* src) {
  Float4 v;
  __builtin_memcpy(&v, src, sizeof v);
  return v;
}

inline void store4(float* dst, Float4 v) { __builtin_memcpy(dst, &v, sizeof v); }

// out_r[0, 4V) (+)= sum_t x_r[t * x_step] * y[t * y_stride + (0, 4V)], r = 0, 1;
// out1 may be null (one row).
template <int V, bool Accumulate>
inline void strip_2xW(const float* x0, const float* x1, int64_t x_step, const float* y,
                      int64_t y_stride, int terms, float* out0, float* out1) {
  Float4 acc0[V], acc1[V];
  for (int v = 0; v < V; ++v) {
    acc0[v] = Accumulate ? load4(out0 + 4 * v) : Float4{};
    acc1[v] = Accumulate && out1 != nullptr ? load4(out1 + 4 * v) : Float4{};
  }
  for (int t = 0; t < terms; ++t) {
    const float a0 = x0[t * x_step], a1 = x1[t * x_step];
    const float* yt = y + t * y_stride;
    for (int v = 0; v < V; ++v) {
      const Float4 yv = load4(yt + 4 * v);
      acc0[v] += yv * a0;
      acc1[v] += yv * a1;
    }
  }
  for (int v = 0; v < V; ++v) store4(out0 + 4 * v, acc0[v]);
  if (out1 != nullptr) {
    for (int v = 0; v < V; ++v) store4(out1 + 4 * v, acc1[v]);
  }
}

// c[m x n] = a[m x k] * bt[k x n]. Computes columns up to n rounded up to 16:
// bt and c must have that many columns (ldbt, ldc >= it); the extra columns
// of c hold garbage the caller never reads.
inline void matmul_a_bt(const float* a, int lda, const float* bt, int ldbt, float* c, int ldc,
                        int m, int n, int k) {
  const int n_padded = (n + 15) & ~15;
  for (int i = 0; i < m; i += 2) {
    const float* a0 = a + static_cast<int64_t>(i) * lda;
    const bool pair = i + 1 < m;
    const float* a1 = pair ? a0 + lda : a0;
    float* c0 = c + static_cast<int64_t>(i) * ldc;
    float* c1 = pair ? c0 + ldc : nullptr;
    for (int j = 0; j < n_padded; j += 16) {
      strip_2xW<4, false>(a0, a1, 1, bt + j, ldbt, k, c0 + j, c1 != nullptr ? c1 + j : nullptr);
    }
  }
}

// Rows (r0, r0 + 1) of c += x * y where x rows are read at x0 / x1 with
// x_step between terms, over `terms` rows of y; k (a multiple of 8) columns.
inline void accumulate_rows(const float* x0, const float* x1, int64_t x_step, const float* y,
                            int64_t ldy, int terms, float* c0, float* c1, int k) {
  int col = 0;
  for (; col + 16 <= k; col += 16) {
    strip_2xW<4, true>(x0, x1, x_step, y + col, ldy, terms, c0 + col,
                       c1 != nullptr ? c1 + col : nullptr);
  }
  for (; col < k; col += 8) {
    strip_2xW<2, true>(x0, x1, x_step, y + col, ldy, terms, c0 + col,
                       c1 != nullptr ? c1 + col : nullptr);
  }
}

// c[m x k] += p[m x n] * b[n x k]; k a multiple of 8.
inline void matmul_acc_p_b(const float* p, int ldp, const float* b, int ldb, float* c, int ldc,
                           int m, int n, int k) {
  for (int i = 0; i < m; i += 2) {
    const float* p0 = p + static_cast<int64_t>(i) * ldp;
    const bool pair = i + 1 < m;
    const float* p1 = pair ? p0 + ldp : p0;
    float* c0 = c + static_cast<int64_t>(i) * ldc;
    accumulate_rows(p0, p1, 1, b, ldb, n, c0, pair ? c0 + ldc : nullptr, k);
  }
}

// c[n x k] += p[m x n]^T * a[m x k]; k a multiple of 8.
inline void matmul_acc_pt_a(const float* p, int ldp, const float* a, int lda, float* c, int ldc,
                            int m, int n, int k) {
  for (int j = 0; j < n; j += 2) {
    const bool pair = j + 1 < n;
    float* c0 = c + static_cast<int64_t>(j) * ldc;
    accumulate_rows(p + j, pair ? p + j + 1 : p + j, ldp, a, lda, m, c0, pair ? c0 + ldc : nullptr,
                    k);
  }
}

// The score rule of one (batch, query head), applied to a tile of raw dot
// products q·k: scale, softcap, ALiBi, then the mask (docs/architecture.md,
// "The op contract and where each rule lives").
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
        alibi_slope(p.alibi_slopes != nullptr ? p.alibi_slopes[batch * p.alibi_batch_stride + head]
                                              : 0.f) {}

  // s[rows x cols] (leading dim lds) holds dot products of rows [row0, ..)
  // with keys [col0, ..); replaced by final scores, -inf where masked. When
  // softcap is on and dscore_ddot is given, it receives ds/d(dot) / softmax_scale
  // = 1 - tanh^2 for the backward (1 where softcap is off).
  void apply(float* s, int lds, int row0, int rows, int col0, int cols,
             float* dscore_ddot = nullptr) const {
    const float cap_in = softcap_on(softcap) ? softmax_scale / softcap : 0.f;
    for (int r = 0; r < rows; ++r) {
      float* sr = s + static_cast<int64_t>(r) * lds;
      float* gr = dscore_ddot != nullptr ? dscore_ddot + static_cast<int64_t>(r) * lds : nullptr;
      const int row = row0 + r;
      for (int c = 0; c < cols; ++c) {
        const int col = col0 + c;
        float score;
        if (softcap_on(softcap)) {
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
