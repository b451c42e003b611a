#include "return_probs.h"

#include <cmath>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../common/mask_rule.h"
#include "../common/philox.h"
#include "block_info.h"
#include "cuda_check.h"
#include "grid_heads_batch.h"

namespace flash {
namespace {

__device__ __forceinline__ float to_float(const __half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(const __nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// One thread per (row, col) of one (batch, head); grid (row*col chunks,
// (head, batch) pairs of grid_heads_batch.h).
template <typename Element>
__global__ void return_probs_kernel(const FwdParams params) {
  HeadBatch pair;
  if (!block_head_batch(params.nheads, params.batch, pair)) return;
  const int head = pair.head;
  const int batch = pair.batch;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int row = static_cast<int>(idx / params.seqlen_k);
  const int col = static_cast<int>(idx % params.seqlen_k);
  if (row >= params.seqlen_q) return;
  const BlockInfo binfo(params, batch);
  if (row >= binfo.seqlen_q || col >= binfo.seqlen_k) return;
  if (!key_visible(row, col, binfo.seqlen_q, binfo.seqlen_k, params.window_left,
                   params.window_right)) {
    return;  // stays 0: the host zero-fills the output
  }
  const int head_kv = head / (params.nheads / params.nheads_k);
  const Element* q = static_cast<const Element*>(params.q_ptr) +
                     binfo.q_offset(params.q, batch, head) + row * params.q.row_stride;
  const Element* k = static_cast<const Element*>(params.k_ptr) +
                     binfo.k_offset(params.k, batch, head_kv) + col * params.k.row_stride;
  float dot = 0.f;
  for (int d = 0; d < params.head_dim; ++d) dot += to_float(q[d]) * to_float(k[d]);
  float score = params.softcap > 0.f
                    ? params.softcap * tanhf(dot * params.softmax_scale / params.softcap)
                    : dot * params.softmax_scale;
  if (params.alibi_slopes != nullptr) {
    score += alibi_bias(params.alibi_slopes[batch * params.alibi_batch_stride + head], row, col,
                        binfo.seqlen_q, binfo.seqlen_k);
  }
  const float lse = params.softmax_lse_ptr[binfo.lse_offset(params, batch, head) + row];
  float prob = isinf(lse) ? 0.f : expf(score - lse);
  if (params.dropout_p > 0.f) {
    const PhiloxOut bits = dropout_random_bits(static_cast<uint64_t>(params.rng_state[0]),
                                               static_cast<uint64_t>(params.rng_state[1]), batch,
                                               head, params.nheads, row, col);
    if (!dropout_keep(bits, col, params.dropout_threshold)) prob = -prob;
  }
  Element* out = static_cast<Element*>(params.p_ptr);
  out[((int64_t(batch) * params.nheads + head) * params.seqlen_q + row) * params.seqlen_k + col] =
      from_float<Element>(prob);
}

}  // namespace

void launch_return_probs(const FwdParams& params, cudaStream_t stream) {
  const int64_t elems = int64_t(params.seqlen_q) * params.seqlen_k;
  if (elems == 0 || params.batch == 0 || params.nheads == 0) return;
  constexpr int kThreads = 256;
  const dim3 grid =
      grid_over_heads_batch((elems + kThreads - 1) / kThreads, params.nheads, params.batch);
  if (params.is_bf16) {
    return_probs_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(params);
  } else {
    return_probs_kernel<__half><<<grid, kThreads, 0, stream>>>(params);
  }
  FA_CUDA_CHECK(cudaGetLastError());
}

}  // namespace flash
