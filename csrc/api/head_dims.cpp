#include "api/head_dims.h"

#include <ATen/ATen.h>

namespace flash {

at::Tensor pad_head_dim(const at::Tensor& t, int64_t head_dim) {
  const int64_t pad = head_dim - t.size(-1);
  if (pad == 0) return t;
  return at::constant_pad_nd(t, at::IntArrayRef{0, pad}, 0);
}

at::Tensor crop_head_dim(const at::Tensor& t, int64_t head_dim) {
  if (t.size(-1) == head_dim) return t;
  return t.narrow(-1, 0, head_dim).contiguous();
}

void copy_appended_v_rows(const at::Tensor& v_cache, const at::Tensor& v_cache_padded,
                          const KvcacheShape& shape, const at::Tensor& cache_seqlens,
                          const std::optional<at::Tensor>& cache_batch_idx,
                          const std::optional<at::Tensor>& block_table,
                          const std::optional<at::Tensor>& cu_seqlens_k_new) {
  if (shape.seqlen_new == 0 || shape.batch == 0) return;
  const at::TensorOptions long_options = cache_seqlens.options().dtype(at::kLong);
  // (batch, seqlen_new) logical positions in each sequence; varlen new keys:
  // (1, total_k_new), token t of sequence b (the last offset at or below t)
  // at cache_seqlens[b] + t - cu_seqlens_k_new[b]. A token outside every
  // sequence lands on a clamped position, whose row it copies onto itself.
  at::Tensor positions;
  at::Tensor token_batch;  // varlen: (1, total_k_new) batch entry of each token
  if (cu_seqlens_k_new.has_value()) {
    const at::Tensor cu = cu_seqlens_k_new->to(at::kLong);
    const at::Tensor tokens = at::arange(shape.seqlen_new, long_options);
    token_batch = (at::searchsorted(cu, tokens, /*out_int32=*/false, /*right=*/true) - 1)
                      .clamp(0, shape.batch - 1);
    positions = (cache_seqlens.to(at::kLong).index_select(0, token_batch) + tokens -
                 cu.index_select(0, token_batch))
                    .unsqueeze(0);
    token_batch = token_batch.unsqueeze(0);
  } else {
    positions = cache_seqlens.to(at::kLong).unsqueeze(1) +
                at::arange(shape.seqlen_new, long_options).unsqueeze(0);
  }
  positions = positions.clamp(0, shape.cache_capacity - 1);
  at::Tensor rows;   // index into dim 0: the cache row or the page
  at::Tensor steps;  // index into dim 1: the position in it
  if (block_table.has_value()) {
    const at::Tensor slots =
        at::div(positions, shape.page_size, "floor").clamp(0, shape.max_blocks_per_seq - 1);
    // (batch, max_blocks_per_seq): batch entry b's table row, cache_batch_idx[b] or b.
    at::Tensor table =
        cache_batch_idx.has_value()
            ? block_table->index_select(0, cache_batch_idx->clamp(0, shape.batch_cache - 1))
            : *block_table;
    if (token_batch.defined()) table = table.index_select(0, token_batch.squeeze(0));
    rows = table.to(at::kLong)
               .gather(1, token_batch.defined() ? slots.t() : slots)
               .clamp(0, shape.num_blocks - 1);
    if (token_batch.defined()) rows = rows.t();
    steps = at::remainder(positions, shape.page_size);
  } else {
    at::Tensor batch_rows = cache_batch_idx.has_value() ? cache_batch_idx->to(at::kLong)
                                                        : at::arange(shape.batch, long_options);
    batch_rows = batch_rows.clamp(0, shape.batch_cache - 1);
    rows = token_batch.defined() ? batch_rows.index_select(0, token_batch.squeeze(0)).unsqueeze(0)
                                 : batch_rows.unsqueeze(1).expand_as(positions);
    steps = positions;
  }
  c10::List<std::optional<at::Tensor>> indices;
  indices.push_back(rows);
  indices.push_back(steps);
  const at::Tensor new_rows = at::index(v_cache_padded, indices).narrow(-1, 0, v_cache.size(-1));
  v_cache.index_put_(indices, new_rows);
}

}  // namespace flash
