// Argument validation of fwd_kvcache at the torch boundary, shared by the CPU
// and CUDA implementations. Shapes, dtypes and devices only: the contents of
// cache_seqlens / cache_leftpad / cache_batch_idx / block_table live on the
// device, so reading them is left to the caller (check_kvcache_contents_host
// for host data). Every failure is a TORCH_CHECK whose message names the
// argument and says what was expected.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace flash {

// FA3's varlen form of fwd_kvcache (the ops' keyword-only arguments): with
// cu_seqlens_q, q is (total_q, nheads, head_dim) and sequence b's query rows
// are cu_seqlens_q[b] .. cu_seqlens_q[b + 1], at most max_seqlen_q of them;
// with cu_seqlens_k_new, the new k / v are (total_k_new, nheads_k, head_dim)
// and sequence b appends rows cu_seqlens_k_new[b] .. cu_seqlens_k_new[b + 1].
struct KvcacheVarlenArgs {
  const std::optional<at::Tensor>& cu_seqlens_q;
  const std::optional<at::Tensor>& cu_seqlens_k_new;
  std::optional<int64_t> max_seqlen_q;
};

// Sizes of a kvcache problem. q is (batch, seqlen_q, nheads, head_dim); the
// cache is (batch_cache, seqlen_cache, nheads_k, head_dim), or paged
// (num_blocks, page_size, nheads_k, head_dim) with a block_table
// (table_rows, max_blocks_per_seq). v_cache and the new v have head_dim_v <=
// head_dim as their last dim (FwdParams::head_dim_v; api/head_dims.h on the CPU).
struct KvcacheShape {
  int batch;
  int seqlen_q;
  int nheads;
  int nheads_k;
  int head_dim;
  int head_dim_v;
  // Key rows one sequence can hold: seqlen_cache, or max_blocks_per_seq * page_size.
  int cache_capacity;
  // Cache entries cache_batch_idx selects from: k_cache.size(0) when not
  // paged, else the rows of block_table (batch without cache_batch_idx).
  int batch_cache;
  bool paged;
  int num_blocks;          // paged only
  int page_size;           // paged only
  int max_blocks_per_seq;  // paged only
  // Rows of k / v each sequence appends; 0 without them. Varlen new keys:
  // total_k_new, the most any one sequence may append (the content checks
  // hold each sequence to the cache).
  int seqlen_new;
  // Varlen q: seqlen_q is max_seqlen_q, total_q the rows of q; batch is
  // cu_seqlens_q's entries - 1.
  bool varlen_q;
  int total_q;
  bool varlen_new;    // cu_seqlens_k_new given: k / v are (total_k_new, nheads_k, head_dim)
  int rotary_dim;     // 0 without rotary_cos / rotary_sin
  int seqlen_rotary;  // rows of rotary_cos / rotary_sin
  // Absorbed MLA's shared cache: v_cache is k_cache's first head_dim_v
  // columns (the same memory, the same strides), so each cache row holds V
  // inside K (docs/head_dims_dv_and_512.md section 4, "Detection").
  bool v_in_k;
};

// allowed_dtypes is the set the calling device accepts (fp16/bf16 on CUDA;
// fp32/fp16/bf16 on CPU). Any positive page size passes here; a device path
// with a stricter tiling requirement checks that itself. The rules of
// flash-attn 2.x apply: k and v come together and need cache_seqlens (and then
// seqlen_q <= cache length); rotary tables need k / v and at least as many rows
// as the cache length. With block_table, cache_batch_idx[b] selects the table
// row of batch entry b (FA3's rule; the table then may have any number of
// rows), and cache_leftpad[b] the first logical row of that sequence, as for
// a contiguous cache. rotary_seqlens (int32 (batch,)) needs the rotary tables.
// q / caches / k / v need a contiguous last dim; the int32 index tensors and
// the rotary tables may have any strides (a kernel that needs them contiguous
// makes them so).
KvcacheShape check_fwd_kvcache_args(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v,
    const std::optional<at::Tensor>& cache_seqlens, const std::optional<at::Tensor>& rotary_cos,
    const std::optional<at::Tensor>& rotary_sin, const std::optional<at::Tensor>& cache_batch_idx,
    const std::optional<at::Tensor>& cache_leftpad, const std::optional<at::Tensor>& block_table,
    const std::optional<at::Tensor>& rotary_seqlens, const std::optional<at::Tensor>& alibi_slopes,
    double softmax_scale, double softcap, c10::ArrayRef<at::ScalarType> allowed_dtypes,
    const KvcacheVarlenArgs& varlen);

// The shapes of out and of q (q's with head_dim_v as the last dim for out):
// (batch, seqlen_q, nheads, d), or (total_q, nheads, d) for a varlen q.
std::vector<int64_t> kvcache_q_shape(const KvcacheShape& shape, int64_t head_dim);
const char* kvcache_q_layout(const KvcacheShape& shape);
// softmax_lse: (batch, nheads, seqlen_q), or (nheads, total_q) for a varlen q.
std::vector<int64_t> kvcache_lse_shape(const KvcacheShape& shape);

// Contents of the int32 index tensors, read on the host (each optional may be
// empty; all must already be shape-checked and on the CPU). First the varlen
// offsets: cu_seqlens_q starts >= 0, never decreases, gives no sequence more
// than max_seqlen_q rows and ends at most at total_q; cu_seqlens_k_new the
// same against total_k_new (no length bound). Then for every batch b, with
// end[b] = cache_seqlens[b] (cache_capacity when absent), seqlen_new[b] the
// rows b appends and seqlen_q[b] its query rows:
//   0 <= end[b] <= cache_capacity, and end[b] + seqlen_new[b] <= cache_capacity;
//   0 <= cache_leftpad[b] <= end[b];
//   cache_batch_idx[b] in [0, batch_cache);
//   the entries of block_table row cache_batch_idx[b] (row b without it) that
//   rows [cache_leftpad[b], end[b] + seqlen_new[b]) reach are in [0, num_blocks);
//   with rotary tables, start[b] = rotary_seqlens[b] (end[b] without it) is
//   >= 0 and the tables hold every position used: start[b] + seqlen_new[b] - 1
//   for the new keys and start[b] + seqlen_q[b] - 1 (rotary_q_per_row) or
//   start[b] for q.
// The rules and messages are those the CUDA kernels apply and record
// (csrc/cuda/core/index_guards.h, csrc/api/index_error_message.h), checked in
// this order.
void check_kvcache_contents_host(
    const KvcacheShape& shape, const std::optional<at::Tensor>& cache_seqlens,
    const std::optional<at::Tensor>& cache_batch_idx,
    const std::optional<at::Tensor>& cache_leftpad, const std::optional<at::Tensor>& block_table,
    const std::optional<at::Tensor>& rotary_seqlens, const std::optional<at::Tensor>& cu_seqlens_q,
    const std::optional<at::Tensor>& cu_seqlens_k_new, bool rotary_q_per_row);

}  // namespace flash
