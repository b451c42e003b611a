// Plain parameter structs handed from the API layer to the CUDA launchers.
// No torch types here: the kernel translation units never include torch
// headers (they would cost minutes of compile time each).
#pragma once

#include <cstdint>

#include "common/host_device.h"
#include "common/index_error.h"
#include "common/score_features.h"
#include "cuda/core/int_divisor.h"

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
  void* p_ptr;             // optional, q's dtype: (batch, nheads, seqlen_q, seqlen_k) probabilities

  QKVStrides q, k, v, o;

  int batch;
  int nheads;
  int nheads_k;
  int seqlen_q;  // max over the batch for varlen
  int seqlen_k;
  int head_dim;  // d_qk, actual; the kernel's compiled head dim is >= this
  // d_v <= head_dim: the columns of v, o (and new_v, dout, dv). The kernels
  // read V (and dO) with the columns past it zero-filled and write only
  // these columns of O (and dV); the compiled width is chosen by head_dim.
  int head_dim_v;

  // Varlen: int32 prefix sums of length batch + 1; null for fixed length.
  const int* cu_seqlens_q;
  const int* cu_seqlens_k;
  // Varlen only, or null: int32 (batch); sequence b's keys are its first
  // seqused_k[b] rows from cu_seqlens_k[b] (BlockInfo reads it, guarded).
  const int* seqused_k;
  // Varlen only, or null: int32 (batch); sequence b's query rows are its
  // first seqused_q[b] rows from cu_seqlens_q[b] (BlockInfo reads it,
  // guarded); the op layer gives the rest their values (out 0, lse +inf).
  const int* seqused_q;
  int total_q;  // varlen: rows of q; the lse is (nheads, total_q)
  int total_k;  // varlen: rows of k and v; paged: num_pages * page_size
  // Paged K/V (varlen forward only), or null: k_ptr / v_ptr are caches of
  // (num_pages, page_size, nheads_k, head_dim) with k.batch_stride /
  // v.batch_stride the page strides, read in place. Sequence b's key j is
  // row j % page_size of page block_table[b * block_table_batch_stride +
  // j / page_size]; its keys are seqused_k[b], else cu_seqlens_k[b + 1] -
  // cu_seqlens_k[b] (lengths only), at most paged_max_seqlen_k (what its
  // table row addresses, cut to max_seqlen_k). BlockInfo guards all three.
  const int* block_table;
  int64_t block_table_batch_stride;
  IntDivisor page_size;
  int num_pages;
  int paged_max_seqlen_k;
  // Room for one counter, or null: a causal / local persistent grid of the
  // Hopper forward takes its tiles past the first wave from it, and its
  // launcher zeroes it first.
  unsigned long long* tile_counter;

  float softmax_scale;
  float softmax_scale_log2;  // softmax_scale * log2(e): the kernel works in exp2
  float softcap;             // 0 disables; else s = softcap * tanh(s / softcap)

  const float* alibi_slopes;  // null, or (nheads) / (batch, nheads) fp32
  int64_t alibi_batch_stride;

  // Null, or fp32 (nheads): attention sinks. Row i of head h adds
  // exp(sink[h] - m_i) to its softmax denominator, with no value row; the lse
  // includes it (docs/architecture.md, "The op contract"). Only the final
  // normalisation reads it, so the backward kernels need nothing: P and D
  // follow from the lse, and d_sink from the lse and D (op sink_grad).
  const float* learnable_sink;

  int window_left;   // < 0: unbounded
  int window_right;  // < 0: unbounded

  float dropout_p;
  uint32_t dropout_threshold;
  float dropout_rescale;     // 1 / (1 - dropout_p)
  const int64_t* rng_state;  // device pointer to [seed, offset]

  bool is_bf16;
  // k and v are float8_e4m3fn (docs/fp8.md): FP8 attention, whose q was
  // converted to bfloat16 (exactly), or an FP8 KV cache under an fp16 / bf16
  // q; the split-KV kernel serves both (plan_fwd_split).
  // Beside is_bf16, in what was padding: BwdParams' layout is unchanged.
  bool kv_fp8;

  // Where a kernel records a bad value of cu_seqlens / cache_seqlens /
  // block_table / ... that it clamped (index_guards.h); null: clamp only.
  IndexErrorSink index_errors;
};

// The backward pass reads everything the forward read (same score rule, same
// dropout seed) plus dO, O, and writes dQ, dK, dV through fp32 accumulators.
struct BwdParams : FwdParams {
  const void* do_ptr;
  void* dq_ptr;
  void* dk_ptr;
  void* dv_ptr;
  QKVStrides dout, dq, dk, dv;

  // rowsum(dO * O) per query row, in the layout of softmax_lse.
  float* softmax_d_ptr;

  // fp32 dQ accumulator, zeroed before the main kernel: num_splits slices
  // (one unless deterministic) of nheads x dq_accum_rows_per_head rows (per
  // batch entry unless varlen) of the compiled head dim, in the order
  // bwd_accum_layout.h describes.
  float* dq_accum_ptr;
  int64_t dq_accum_split_stride;
  int64_t dq_accum_rows_per_head;
  int num_splits;
  bool deterministic;
  // Deterministic on the Hopper kernel (else null): per (batch, head, query
  // block of the Hopper tile), how many key blocks have added their dQ; key
  // block n adds when it reads n (BwdSm90DQOrder). Zeroed, int32,
  // batch x nheads x dq_semaphore_m_blocks.
  int* dq_semaphore;
  int dq_semaphore_m_blocks;

  // GQA/MQA (else null): each kv head's fp32 dK and dV sums, zeroed,
  // nheads_k x dkv_sum_rows_per_head rows (per batch entry unless varlen) of
  // the compiled head dim, in the order bwd_accum_layout.h describes; every
  // query head's blocks add into them.
  float* dk_sum_ptr;
  float* dv_sum_ptr;
  int64_t dkv_sum_rows_per_head;

  // GQA/MQA, deterministic mode (else null): one zeroed counter per (batch,
  // kv head, key block of dkv_semaphore_n_blocks), with which the query heads
  // of a kv head add into its sums in head order (bwd_block_io.h,
  // BwdDkvTurn).
  int* dkv_semaphore;
  int dkv_semaphore_n_blocks;
};

// fwd_kvcache: attention of q against a per-batch prefix of a (possibly paged)
// cache, after the new keys / values were appended. The FwdParams k / v
// pointers and strides describe the cache; seqlen_k is the cache capacity (one
// sequence's rows). Key j of batch b is cache position cache_leftpad[b] + j,
// for j < cache_seqlens[b] + seqlen_new - cache_leftpad[b].
// An e4m3 cache's descales (docs/fp8.md): an fp32 (batch, nheads_k) tensor
// of any strides (vLLM passes expanded ones, stride 0).
struct DescaleStrides {
  int64_t batch_stride;
  int64_t head_stride;
};

struct KvcacheParams : FwdParams {
  const int* cache_seqlens;  // null: every sequence fills the cache
  const int* cache_leftpad;  // null: no left padding
  // null: batch entry b uses cache entry b. Paged: the block_table row of b
  // (FA3's rule), as for a contiguous cache the cache entry.
  const int* cache_batch_idx;
  const int* block_table;  // null: contiguous cache; else (table rows, blocks) int32
  int64_t block_table_batch_stride;
  // null: the rotary position of new key i and (causal / local) query row i
  // is cache_seqlens[b] + i; else rotary_seqlens[b] + i.
  const int* rotary_seqlens;
  IntDivisor page_size;  // paged only: rows per page (a multiple of 16)
  // Extents the guards hold the index values to (index_guards.h): entries of
  // a contiguous cache (rows of the block table when paged), pages of a paged
  // one, rows of the rotary tables.
  int batch_cache;
  int num_pages;
  int seqlen_rotary;
  int seqlen_new;  // rows appended by this call (already in the cache)
  // FA3's varlen form. cu_seqlens_q (FwdParams, with total_q): batch entry
  // b's query rows are rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q and
  // out (batch strides 0), seqlen_q is max_seqlen_q and the lse is (nheads,
  // total_q). cu_seqlens_k_new (null: seqlen_new rows each): b appends rows
  // [cu_seqlens_k_new[b], cu_seqlens_k_new[b + 1]) of new_k / new_v (batch
  // strides 0), and seqlen_new is their total_k_new rows.
  const int* cu_seqlens_k_new;
  // FwdParams::cu_seqlens_k non-null: varlen_fwd's split run
  // (ops/fwd_splitkv.cpp), whose keys and query rows are the varlen
  // forward's (BlockInfo): the cache fields above are unused then, but for
  // block_table / page_size / num_pages of paged keys.
  // The varlen op's index check (fwd/paged_keys_check_block.h) reports the
  // paged keys' lengths and table entries: the split-KV kernel clamps a
  // table entry outside the pool without reporting it, so that the first
  // report is the check's, in the order the forward kernels' calls give (a
  // length before its pages). combine_checks_paged_keys: the combine's grid
  // has a block more per sequence, which runs the check beside the merge
  // (in place of a kernel of its own after the combine: PERF_LOG 2026-12-01,
  // "index check in the combine"); else the op
  // launches the check kernel after this call's kernels.
  bool table_checked_after;
  bool combine_checks_paged_keys;

  // Split-KV: num_splits > 1 writes fp32 partial outputs and lse per split,
  // (num_splits, batch, nheads, seqlen_q, compiled head dim) and
  // (num_splits, batch, nheads, seqlen_q), merged by the combine kernel.
  int num_splits;
  float* out_accum_ptr;
  float* lse_accum_ptr;
  // sm90+: each kernel of the call is launched as a programmatic dependent of
  // the kernel before it in the stream (dependent_launch.h): the append /
  // rotary kernel, the split-KV kernel and the combine.
  bool programmatic_launch;

  // Append + rotary (run before the attention kernel, or by it:
  // append_in_attention). new_k / new_v are
  // (batch, seqlen_new, nheads_k, head_dim); rotary tables (seqlen_ro,
  // rotary_dim / 2), contiguous, q's dtype. q_rotated (contiguous, q's shape)
  // receives q rotated; the attention then reads q_ptr = q_rotated.
  const void* new_k_ptr;
  const void* new_v_ptr;
  QKVStrides new_k, new_v;
  const void* rotary_cos_ptr;
  const void* rotary_sin_ptr;
  int rotary_dim;  // 0: no rotation
  bool rotary_interleaved;
  bool rotary_q_per_row;  // causal / local: query row i at position end + i
  const void* q_unrotated_ptr;
  QKVStrides q_unrotated;
  // The split-KV kernel does the append and the rotation itself (no
  // pre-kernel; q_ptr is then q as given, unrotated): each block copies its
  // query rows and the new keys / values of its tiles (from new_k / new_v)
  // into shared memory with its first tile, rotates them there, and the
  // first query block of each split writes the new rows of its key blocks
  // into the cache. The host sets it for the decode variant's plain kernel
  // with one block per work item and one query block, and
  // seqlen_new <= kAppendInAttentionMaxRows, among the other conditions of
  // append_in_attention_fits (plan_decode, launch/plan.cpp).
  bool append_in_attention;

  // An e4m3 cache (k_ptr / v_ptr point to float8_e4m3fn): element x of K or V
  // read for batch entry b and kv head g stands for x * k_descale[b, g] or
  // x * v_descale[b, g]; null: 1. b is the query batch entry, not
  // cache_batch_idx[b].
  const float* k_descale_ptr;
  const float* v_descale_ptr;
  DescaleStrides k_descale, v_descale;
  bool cache_fp8;  // the append quantises into an e4m3 cache (append_rotary_kernel.h)
};

// The score rule of a call (score_features.h): the plans pick the kernel
// variant by it, and the split-KV launcher its kernel instance.
FA_HOST_DEVICE ScoreFeatures score_features_of(const FwdParams& params) {
  return score_features(params.softcap, params.alibi_slopes != nullptr, params.dropout_p,
                        params.softmax_scale_log2);
}

}  // namespace flash
