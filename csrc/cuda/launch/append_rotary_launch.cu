// Host side of fwd_kvcache's append / rotary step (append_rotary_kernel.h):
// one thread per 8-element chunk of the new keys / values and of q.
#include "cuda/launch/append_rotary_launch.h"

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/decode/append_rotary_kernel.h"
#include "cuda/launch/dependent_launch.h"

namespace flash {
namespace {

template <typename T, bool kFp8Cache>
void launch(const KvcacheParams& p, cudaStream_t stream) {
  const int chunks = p.head_dim / kRotaryChunkElems;
  const bool appending = p.seqlen_new > 0 && p.new_k_ptr != nullptr;
  const bool rotating_q = p.rotary_dim > 0 && p.seqlen_q > 0;
  // Varlen: seqlen_new is total_k_new, and q has total_q rows.
  const int64_t new_rows = p.cu_seqlens_k_new ? p.seqlen_new : int64_t(p.batch) * p.seqlen_new;
  const int64_t q_rows = p.cu_seqlens_q ? p.total_q : int64_t(p.batch) * p.seqlen_q;
  const int64_t append_chunks = appending ? new_rows * p.nheads_k * chunks : 0;
  const int64_t q_chunks = rotating_q ? q_rows * p.nheads * chunks : 0;
  const int64_t all_chunks = append_chunks + q_chunks;
  if (all_chunks == 0) return;
  LaunchOptions options;
  options.programmatic = p.programmatic_launch;
  const dim3 grid(
      static_cast<unsigned>((all_chunks + kAppendRotaryThreads - 1) / kAppendRotaryThreads));
  launch_ex(&append_rotary_kernel<T, kFp8Cache>, grid, dim3(kAppendRotaryThreads), 0, stream,
            options, p, append_chunks, all_chunks);
}

}  // namespace

void launch_kvcache_append_rotary(const KvcacheParams& params, cudaStream_t stream) {
  // An e4m3 cache quantises the appended rows (kFp8Cache).
  if (params.is_bf16) {
    params.cache_fp8 ? launch<__nv_bfloat16, true>(params, stream)
                     : launch<__nv_bfloat16, false>(params, stream);
  } else {
    params.cache_fp8 ? launch<__half, true>(params, stream) : launch<__half, false>(params, stream);
  }
}

}  // namespace flash
