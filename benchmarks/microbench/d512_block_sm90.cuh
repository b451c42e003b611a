// What the head-dim-512 microbenchmarks of docs/head_dims_dv_and_512.md share
// (pshare_d512.cu: option A, alternate_d512.cu: option B): one block of 64
// query rows and two MMA warpgroups, each owning 256 columns of V and O, over
// 32-key tiles resident in shared memory; their tiles, products and the check
// that the two warpgroups' O halves agree.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include <cuda_runtime.h>

#include <cute/tensor.hpp>

#include "cuda/core/cuda_check.h"

namespace d512 {

using namespace cute;

using Element = cutlass::bfloat16_t;
constexpr int kM = 64;       // query rows
constexpr int kN = 32;       // keys per tile
constexpr int kD = 512;      // d_qk = d_v
constexpr int kDHalf = 256;  // a warpgroup's columns of V and O
constexpr int kThreads = 256;

using SmemLayoutQ =
    decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{}, Shape<Int<kM>, Int<kD>>{}));
// Two key tiles (stages, or a pair step's slots).
using SmemLayoutK =
    decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{}, Shape<Int<kN>, Int<kD>, _2>{}));
// One half of V's columns, two key tiles.
using SmemLayoutVHalf = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                               Shape<Int<kN>, Int<kDHalf>, _2>{}));
// A V half seen as (Dv/2, N, tile): the MN-major B operand of P V.
using SmemLayoutVtHalf = decltype(composition(
    SmemLayoutVHalf{}, make_ordered_layout(Shape<Int<kDHalf>, Int<kN>, _2>{}, Step<_2, _1, _3>{})));

using OneWarpGroup = Layout<Shape<_1, _1, _1>>;
// S = Q K^T over all 512 columns.
using TiledMmaS = decltype(make_tiled_mma(
    GMMA::ss_op_selector<Element, Element, float, Shape<Int<kM>, Int<kN>, Int<kD>>>(),
    OneWarpGroup{}));
// O += P V on a warpgroup's 256 columns, P from registers (RS) or shared memory (SS).
using TiledMmaORs = decltype(make_tiled_mma(
    GMMA::rs_op_selector<Element, Element, float, Shape<Int<kM>, Int<kDHalf>, Int<kN>>,
                         GMMA::Major::K, GMMA::Major::MN>(),
    OneWarpGroup{}));
using TiledMmaOSs = decltype(make_tiled_mma(
    GMMA::ss_op_selector<Element, Element, float, Shape<Int<kM>, Int<kDHalf>, Int<kN>>,
                         GMMA::Major::K, GMMA::Major::MN>(),
    OneWarpGroup{}));

// The largest relative difference between the two warpgroups' O, over
// blocks (o_dump: each thread's O fragment, threads in order).
inline double halves_differ_by(const float* o_dump, int blocks) {
  const int per_thread = kM * kDHalf / 128;
  std::vector<float> host(size_t(blocks) * kThreads * per_thread);
  FA_CUDA_CHECK(
      cudaMemcpy(host.data(), o_dump, host.size() * sizeof(float), cudaMemcpyDeviceToHost));
  double worst = 0;
  for (int b = 0; b < blocks; ++b) {
    const float* a = host.data() + size_t(b) * kThreads * per_thread;
    const float* c = a + size_t(128) * per_thread;
    for (int i = 0; i < 128 * per_thread; ++i) {
      const double d = std::fabs(double(a[i]) - c[i]) / (std::fabs(double(a[i])) + 1e-6);
      worst = d > worst ? d : worst;
    }
  }
  return worst;
}

}  // namespace d512
