// Where one (batch, head) lives: sequence lengths and the element offsets of
// its first row in q/k/v/o and the lse, for fixed-length and varlen batches.
// 64-bit offsets throughout: a tensor may exceed 2^31 elements.
#pragma once

#include <cstdint>

#include "cuda/core/index_guards.h"
#include "cuda/core/params.h"

namespace flash {

struct BlockInfo {
  int seqlen_q;
  int seqlen_k;
  int64_t q_row_begin;  // first row of this batch in the (total, ...) view
  int64_t k_row_begin;
  bool varlen;

  __device__ BlockInfo(const FwdParams& params, int batch) {
    varlen = params.cu_seqlens_q != nullptr;
    if (varlen) {
      // Guarded: a bad cu_seqlens value is clamped into the packed tensors
      // and recorded, never followed outside them.
      const SequenceRows q_rows =
          guarded_sequence_rows(params.cu_seqlens_q, batch, params.total_q, params.seqlen_q,
                                IndexArg::kCuSeqlensQ, params.index_errors);
      q_row_begin = q_rows.begin;
      // seqused_q shortens the queries to a prefix of the sequence's rows,
      // and with it the bottom-right alignment of causal / local windows (as
      // FA3: the used lengths are the sequence's lengths). Every kernel
      // bounds its query loads, masks, epilogue writes and dQ / D rows by
      // seqlen_q, so the rows after it are neither read nor written; the op
      // layer gives them their values (fwd_ops.cpp, bwd_ops.cpp).
      seqlen_q =
          params.seqused_q == nullptr
              ? q_rows.length
              : guarded_seqused_q(params.seqused_q, batch, q_rows.length, params.index_errors);
      if (params.block_table != nullptr) {
        // Paged keys: located through the table (paged_rows.h), from row 0.
        k_row_begin = 0;
        seqlen_k = paged_seqlen_k(params, batch);
      } else {
        const SequenceRows k_rows =
            guarded_sequence_rows(params.cu_seqlens_k, batch, params.total_k, params.seqlen_k,
                                  IndexArg::kCuSeqlensK, params.index_errors);
        k_row_begin = k_rows.begin;
        // seqused_k shortens the keys to a prefix of the sequence's rows;
        // every kernel bounds its key loop, masks and tail zeroing by
        // seqlen_k, so the rows after it are never read into a result.
        seqlen_k = params.seqused_k == nullptr
                       ? k_rows.length
                       : guarded_seqused_k(params.seqused_k, batch, k_rows.length,
                                           /*paged=*/false, params.index_errors);
      }
    } else {
      q_row_begin = 0;
      k_row_begin = 0;
      seqlen_q = params.seqlen_q;
      seqlen_k = params.seqlen_k;
    }
  }

  // Sequence `batch`'s paged keys: seqused_k[b] when given, else the length
  // cu_seqlens_k gives, cut to the rows its table row addresses. Clamped
  // without a report: check_paged_keys (fwd/paged_keys_check.h) reports the
  // same values before the kernel runs, since guards inlined here, in every
  // role's per-tile BlockInfo, overran the Hopper producer's 24 registers.
  static __forceinline__ __device__ int paged_seqlen_k(const FwdParams& params, int batch) {
    const int64_t keys = params.seqused_k != nullptr
                             ? int64_t(params.seqused_k[batch])
                             : int64_t(params.cu_seqlens_k[batch + 1]) - params.cu_seqlens_k[batch];
    return int(keys < 0 ? 0 : keys < params.paged_max_seqlen_k ? keys : params.paged_max_seqlen_k);
  }

  __device__ int64_t q_offset(const QKVStrides& s, int batch, int head) const {
    return (varlen ? q_row_begin * s.row_stride : int64_t(batch) * s.batch_stride) +
           int64_t(head) * s.head_stride;
  }
  __device__ int64_t k_offset(const QKVStrides& s, int batch, int head) const {
    return (varlen ? k_row_begin * s.row_stride : int64_t(batch) * s.batch_stride) +
           int64_t(head) * s.head_stride;
  }
  // softmax_lse is (batch, nheads, seqlen_q), or (nheads, total_q) for varlen.
  __device__ int64_t lse_offset(const FwdParams& params, int batch, int head) const {
    return varlen ? int64_t(head) * params.total_q + q_row_begin
                  : (int64_t(batch) * params.nheads + head) * params.seqlen_q;
  }
};

}  // namespace flash
