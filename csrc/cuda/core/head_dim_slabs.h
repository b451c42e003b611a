// Head-dim slabs: the SM80-design kernels run head dims above 256 in passes
// over slabs of at most kMaxSlabCols output columns, so that their fp32
// accumulators stay those of a 256-wide head dim (the forward's O, the
// backward's dK, dV and dQ). Each pass recomputes the scores at the full
// width (docs/head_dims_dv_and_512.md section 3). One slab up to 256.
#pragma once

namespace flash {

constexpr int kMaxSlabCols = 256;

constexpr int slab_cols(int head_dim) { return head_dim > kMaxSlabCols ? kMaxSlabCols : head_dim; }

}  // namespace flash
