// The rate of the dropout mask's Philox calls on one SM (issue 57,
// docs/dropout_sm90.md section 2): how many calls of the contract's
// Philox4x32-10 (csrc/common/philox.h) an SM makes per clock, and so the
// least time a key tile's draws take wherever they run. A call is 10 rounds
// of two 32 x 32 -> 64-bit products (IMAD.WIDE.U32) and two three-input XORs;
// the products run on the FMA-heavy pipe.
//
// Each block runs `warps` warps on one SM (one block per SM, every SM); each
// thread makes `units` units of four calls, the calls of a unit either
// interleaved round by round (dropout_random_bits_interleaved below, as design 2's
// draw warps made them) or one after another (dropout_random_bits,
// as the MMA threads do). The block's first thread times its block with
// clock64, so the rate is in calls per SM-clock whatever the clock runs at.
//
//   nvcc -std=c++20 -O3 -I csrc -gencode arch=compute_90a,code=sm_90a \
//     benchmarks/microbench/philox_rate.cu -o philox_rate
//   ./philox_rate [units per thread, default 256]
//
// The keep bits are folded into one word per thread and written out, so the
// calls cannot be dropped; the run prints that checksum for both orders,
// which must agree (same calls, same bits).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_runtime.h>

#include "common/philox.h"
#include "cuda/core/cuda_check.h"

namespace {

// kCalls calls of dropout_random_bits for one (batch, head) and row, at
// columns col0 + kColStep * i: the same function, its rounds interleaved
// across the calls, so that a thread has kCalls independent chains of
// dependent multiplies in flight rather than one after another.
template <int kCalls, int kColStep>
__device__ __forceinline__ void dropout_random_bits_interleaved(uint64_t seed, uint64_t offset,
                                                                int batch, int head, int nheads,
                                                                int row, int col0,
                                                                flash::PhiloxOut (&out)[kCalls]) {
  const uint32_t bh =
      static_cast<uint32_t>(batch) * static_cast<uint32_t>(nheads) + static_cast<uint32_t>(head);
  uint32_t c[kCalls][4];
#pragma unroll
  for (int i = 0; i < kCalls; ++i) {
    c[i][0] = static_cast<uint32_t>(col0 + kColStep * i) >> 2;
    c[i][1] = static_cast<uint32_t>(row);
    c[i][2] = bh;
    c[i][3] = static_cast<uint32_t>(offset);
  }
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  // The key schedule from the seed here, two adds a round for all the calls,
  // rather than its 20 words hoisted out of the caller's loop into registers
  // that the calls in flight need.
  asm volatile("" : "+r"(k0), "+r"(k1));
  // philox4x32_10's rounds (common/philox.h), call by call within each
  // round: the measured instrument only, kept out of the kernels' header (a
  // shared round function changed the register allocation of the kernels
  // that draw per thread).
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
#pragma unroll
  for (int round = 0; round < 10; ++round) {
#pragma unroll
    for (int i = 0; i < kCalls; ++i) {
      const uint32_t hi0 = flash::mulhi_u32(kMul0, c[i][0]), lo0 = kMul0 * c[i][0];
      const uint32_t hi1 = flash::mulhi_u32(kMul1, c[i][2]), lo1 = kMul1 * c[i][2];
      const uint32_t n0 = hi1 ^ c[i][1] ^ k0, n2 = hi0 ^ c[i][3] ^ k1;
      c[i][0] = n0;
      c[i][1] = lo1;
      c[i][2] = n2;
      c[i][3] = lo0;
    }
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
#pragma unroll
  for (int i = 0; i < kCalls; ++i) out[i] = {{c[i][0], c[i][1], c[i][2], c[i][3]}};
}

constexpr int kCallsPerUnit = 4;

template <bool kInterleaved>
__global__ void philox_calls(uint64_t seed, uint64_t offset, uint32_t threshold, int units,
                             uint32_t* keep_out, long long* clocks) {
  __syncthreads();
  const long long start = clock64();
  uint32_t keep = 0u;
  const int row = blockIdx.x * blockDim.x + threadIdx.x;
  for (int u = 0; u < units; ++u) {
    const int col0 = 32 * u;
    flash::PhiloxOut bits[kCallsPerUnit];
    if constexpr (kInterleaved) {
      dropout_random_bits_interleaved<kCallsPerUnit, 8>(seed, offset, 0, 0, 1, row, col0, bits);
    } else {
#pragma unroll
      for (int j = 0; j < kCallsPerUnit; ++j) {
        bits[j] = flash::dropout_random_bits(seed, offset, 0, 0, 1, row, col0 + 8 * j);
      }
    }
#pragma unroll
    for (int j = 0; j < kCallsPerUnit; ++j) {
#pragma unroll
      for (int k = 0; k < 4; ++k) keep ^= uint32_t(bits[j].x[k] >= threshold) << (4 * j + k);
    }
    keep = (keep << 1) | (keep >> 31);
  }
  __syncthreads();
  const long long stop = clock64();
  keep_out[blockIdx.x * blockDim.x + threadIdx.x] = keep;
  if (threadIdx.x == 0) clocks[blockIdx.x] = stop - start;
}

template <bool kInterleaved>
void run(int sms, int warps, int units, uint32_t* keep, long long* clocks) {
  const int threads = 32 * warps;
  const uint32_t threshold = flash::dropout_threshold(0.1f);
  auto* kernel = &philox_calls<kInterleaved>;
  kernel<<<sms, threads>>>(0x123456789ABCDEFull, 991, threshold, units, keep, clocks);  // warm-up
  FA_CUDA_CHECK(cudaGetLastError());
  kernel<<<sms, threads>>>(0x123456789ABCDEFull, 991, threshold, units, keep, clocks);
  FA_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<long long> c(sms);
  FA_CUDA_CHECK(cudaMemcpy(c.data(), clocks, sms * sizeof(long long), cudaMemcpyDeviceToHost));
  long long worst = 0, sum = 0;
  for (long long x : c) {
    worst = x > worst ? x : worst;
    sum += x;
  }
  std::vector<uint32_t> k(size_t(sms) * threads);
  FA_CUDA_CHECK(cudaMemcpy(k.data(), keep, k.size() * sizeof(uint32_t), cudaMemcpyDeviceToHost));
  uint32_t checksum = 0;
  for (uint32_t x : k) checksum = checksum * 31u + x;
  const double calls = double(threads) * units * kCallsPerUnit;
  const double mean = double(sum) / sms;
  std::printf(
      "%-11s warps/SM %2d: %8.0f clocks mean (%8lld worst) for %9.0f calls: %.3f calls per "
      "SM-clock, %.1f clocks per call per warp; checksum %08x\n",
      kInterleaved ? "interleaved" : "serial", warps, mean, worst, calls, calls / mean,
      mean / (calls / warps), checksum);
}

}  // namespace

int main(int argc, char** argv) {
  const int units = argc > 1 ? std::atoi(argv[1]) : 256;
  int sms = 0;
  FA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  uint32_t* keep = nullptr;
  long long* clocks = nullptr;
  FA_CUDA_CHECK(cudaMalloc(&keep, size_t(sms) * 1024 * sizeof(uint32_t)));
  FA_CUDA_CHECK(cudaMalloc(&clocks, sms * sizeof(long long)));
  // 3: the Hopper forward's draw warps; 4: one per scheduler; 8: the MMA
  // warps; 32: a full SM.
  for (int warps : {3, 4, 8, 16, 32}) {
    run<true>(sms, warps, units, keep, clocks);
    run<false>(sms, warps, units, keep, clocks);
  }
  FA_CUDA_CHECK(cudaFree(keep));
  FA_CUDA_CHECK(cudaFree(clocks));
  return 0;
}
