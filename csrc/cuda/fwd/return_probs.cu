#include "cuda/fwd/return_probs.h"

#include <cmath>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/mask_rule.h"
#include "common/philox.h"
#include "common/score_features.h"
#include "cuda/core/block_info.h"
#include "cuda/core/cuda_check.h"
#include "cuda/core/grid_heads_batch.h"
#include "cuda/core/paged_rows.h"

namespace flash {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kMaxHeadDim = 256;
// Each lane owns this many consecutive columns of a key block.
constexpr int kColsPerLane = kReturnProbsBlockN / 32;
static_assert(kReturnProbsBlockN % 32 == 0, "a key block is split evenly over the 32 lanes");
// A lane's columns start at a multiple of kColsPerLane: with kColsPerLane
// dividing 4 they lie in one group of four, i.e. one Philox call.
static_assert(4 % kColsPerLane == 0, "a lane's columns must share one Philox call");

__device__ __forceinline__ float to_float(const __half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(const __nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  }
  return x;
}

// q (fp32, in shared memory) . k over head_dim (a multiple of 8). Rows of k
// are 16-byte aligned, as the forward kernel's loads require of them too.
template <typename Element>
__device__ __forceinline__ float dot_with_key(const float* q, const Element* k, int head_dim) {
  float acc = 0.f;
  for (int d = 0; d < head_dim; d += 8) {
    __align__(16) Element chunk[8];
    *reinterpret_cast<uint4*>(chunk) = *reinterpret_cast<const uint4*>(k + d);
#pragma unroll
    for (int i = 0; i < 8; ++i) acc += q[d + i] * to_float(chunk[i]);
  }
  return acc;
}

// One warp per query row of one (batch, head); grid (row groups of kWarps,
// (head, batch) pairs of grid_heads_batch.h). The warp visits the row's key
// blocks from the last to the first: it computes a block's scores (each lane
// its kColsPerLane columns), folds the block's max into the running max, then
// writes the block's numerators against it.
template <typename Element>
__global__ void __launch_bounds__(kThreads) return_probs_kernel(const FwdParams params) {
  __shared__ float q_rows[kWarps][kMaxHeadDim];
  HeadBatch pair;
  if (!block_head_batch(params.nheads, params.batch, pair)) return;
  const int head = pair.head;
  const int batch = pair.batch;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int row = blockIdx.x * kWarps + warp;
  const BlockInfo binfo(params, batch);
  // Everything below is uniform over the warp. Rows and keys past the output's
  // extent (seqlen_q x seqlen_k, the maxima for varlen) are never written.
  if (row >= binfo.seqlen_q || row >= params.seqlen_q) return;
  const KeyRange range = visible_key_range(row, row + 1, binfo.seqlen_q, binfo.seqlen_k,
                                           params.window_left, params.window_right);
  const int key_end = range.end < params.seqlen_k ? range.end : params.seqlen_k;
  if (key_end <= range.begin) return;  // the row sees no key: stays 0

  const int head_kv = head / (params.nheads / params.nheads_k);
  const Element* q = static_cast<const Element*>(params.q_ptr) +
                     binfo.q_offset(params.q, batch, head) + int64_t(row) * params.q.row_stride;
  float* q_row = q_rows[warp];
  for (int d = lane; d < params.head_dim; d += 32) q_row[d] = to_float(q[d]);
  __syncwarp();

  const Element* k_head =
      static_cast<const Element*>(params.k_ptr) + binfo.k_offset(params.k, batch, head_kv);
  const bool has_alibi = params.alibi_slopes != nullptr;
  const float slope =
      has_alibi ? params.alibi_slopes[batch * params.alibi_batch_stride + head] : 0.f;
  const bool has_dropout = params.dropout_p > 0.f;
  const uint64_t seed = has_dropout ? static_cast<uint64_t>(params.rng_state[0]) : 0;
  const uint64_t offset = has_dropout ? static_cast<uint64_t>(params.rng_state[1]) : 0;
  Element* out_row =
      static_cast<Element*>(params.p_ptr) +
      ((int64_t(batch) * params.nheads + head) * params.seqlen_q + row) * int64_t(params.seqlen_k);

  float running_max = -INFINITY;
  const int first_block = range.begin / kReturnProbsBlockN;
  for (int block = (key_end - 1) / kReturnProbsBlockN; block >= first_block; --block) {
    const int col0 = block * kReturnProbsBlockN + lane * kColsPerLane;
    float score[kColsPerLane];
    float block_max = -INFINITY;
#pragma unroll
    for (int i = 0; i < kColsPerLane; ++i) {
      const int col = col0 + i;
      score[i] = -INFINITY;
      if (col >= range.begin && col < key_end) {
        // Paged varlen: keys through the table.
        const int64_t key_offset = params.block_table != nullptr
                                       ? paged_key_offset(params, batch, col, params.k)
                                       : int64_t(col) * params.k.row_stride;
        const float dot = dot_with_key(q_row, k_head + key_offset, params.head_dim);
        float s = softcap_on(params.softcap)
                      ? params.softcap * tanhf(dot * params.softmax_scale / params.softcap)
                      : dot * params.softmax_scale;
        if (has_alibi) s += alibi_bias(slope, row, col, binfo.seqlen_q, binfo.seqlen_k);
        score[i] = s;
        block_max = fmaxf(block_max, s);
      }
    }
    // Every block from first_block on holds a visible key of this row, so the
    // running max is finite from the first block on.
    running_max = fmaxf(running_max, warp_max(block_max));
    PhiloxOut bits{};
    if (has_dropout) {
      bits = dropout_random_bits(seed, offset, batch, head, params.nheads, row, col0);
    }
#pragma unroll
    for (int i = 0; i < kColsPerLane; ++i) {
      const int col = col0 + i;
      if (col < range.begin || col >= key_end) continue;
      float numerator = expf(score[i] - running_max);
      if (has_dropout && !dropout_keep(bits, col, params.dropout_threshold)) {
        numerator = -numerator;
      }
      out_row[col] = from_float<Element>(numerator);
    }
  }
}

}  // namespace

void launch_return_probs(const FwdParams& params, cudaStream_t stream) {
  if (params.seqlen_q == 0 || params.seqlen_k == 0 || params.batch == 0 || params.nheads == 0) {
    return;
  }
  if (params.head_dim > kMaxHeadDim || params.head_dim % 8 != 0) {
    throw std::runtime_error(
        "flash_attn_cuda: return_softmax needs a head dim that is a "
        "multiple of 8 and at most 256");
  }
  const int64_t row_groups = (int64_t(params.seqlen_q) + kWarps - 1) / kWarps;
  const dim3 grid = grid_over_heads_batch(row_groups, params.nheads, params.batch);
  if (params.is_bf16) {
    return_probs_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(params);
  } else {
    return_probs_kernel<__half><<<grid, kThreads, 0, stream>>>(params);
  }
  FA_CUDA_CHECK(cudaGetLastError());
}

}  // namespace flash
