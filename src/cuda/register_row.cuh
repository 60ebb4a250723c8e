// A row held in registers by a group of whole warps (RegisterRow), the building block of
// the register kernel families (register_rows.cu) and of the one-launch columnwise kernel
// (columnwise.cu). Vector i of the row lives in thread i % threads_per_row, so every
// global element is read and written once and all of a thread's loads, gamma's included,
// are in flight before the first arithmetic; a reduction spanning several warps costs one
// barrier.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "row_blocks.cuh"

namespace fp8norm {

// One slot per warp of the block (at most 32) for each of the two reductions. A row's warps
// write their sum slots before the barrier of its sum reduction and their max slots before
// the barrier of its max reduction; every warp reads a slot before it arrives at the
// other reduction's barrier, which the next write of that slot follows. So one barrier per
// reduction suffices, also from one row to the next.
struct RegisterScratch {
  SumOfSquares sum_partial[kWarp];
  uint32_t max_partial[kWarp];
};

// Reduces v over the `warps_per_row` consecutive warps that hold the calling thread's row;
// every thread of the row gets the result. Every thread of the block calls it together.
template <typename T, typename WarpOp>
__device__ __forceinline__ T RowReduce(T v, T identity, WarpOp warp_op, T* partial /*[32]*/,
                                       int warps_per_row) {
  v = warp_op(v);
  if (warps_per_row == 1) return v;
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  const int first = warp - warp % warps_per_row;
  return warp_op(lane < warps_per_row ? partial[first + lane] : identity);
}

// The register variants' scales per group (GroupFitsRegisters): a group of V whole vectors
// (V a power of two up to 32) is held by V consecutive lanes, vector i of the row in lane
// i % threads_per_row, and reduced by log2(V) shuffles, no barrier. Every lane of the warp
// calls it (the shuffles need all 32), held vectors or not.
// global_scale: NVFP4's, the call's or the row's own (0 for every other format).
template <int kVec, int kVecs, typename Held, typename Index>
__device__ __forceinline__ void RegisterGroups(const RmsNormFp8Args& a, int64_t row,
                                               const float (&normed)[kVecs][kVec], Held held,
                                               Index index, float sum_sq, float global_scale,
                                               uint8_t* y) {
  const int lanes = static_cast<int>(a.group_size / kVec);
  const int64_t groups = GroupsPerRow(a);
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    uint32_t amax = 0;
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      if (held(k)) amax = max(amax, AbsBits(normed[k][e]));
    }
    for (int offset = lanes / 2; offset > 0; offset /= 2) {
      amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    }
    if (!held(k)) continue;
    if constexpr (kVec % 2 == 0) {
      if (IsFp4(a)) {
        const Fp4Scale s = Fp4ScaleOf(a, sum_sq, amax, global_scale);
        if (index(k) % lanes == 0) StoreScale(a, row * groups + index(k) / lanes, s.scale);
        StoreFp4<kVec>(y, index(k), normed[k], s, a.y_packed);
        continue;
      }
    }
    const RowScale s = ComputeScale(sum_sq, amax, a.out_format, a.scale_type, a.constants);
    if (index(k) % lanes == 0) StoreScale(a, row * groups + index(k) / lanes, s.scale);
    StoreFp8<kVec>(y, index(k), normed[k], s.recip, a.out_format);
  }
}

// Row `row` held by `threads_per_row` threads (whole warps), the caller thread being `lane`
// of them: vector i of the row in registers of thread i % threads_per_row. Every thread of
// the block calls it equally often (the reductions may meet at a barrier); the threads of
// a row at or past row_end (a.rows, or the end of a block of rows) only take part in
// those.
template <typename TIn, int kVecs>
__device__ __forceinline__ void RegisterRow(const RmsNormFp8Args& a, int64_t row, int64_t row_end,
                                            int lane, int threads_per_row,
                                            RegisterScratch& scratch) {
  constexpr int kVec = kVecOf<TIn>;
  const int warps_per_row = threads_per_row / kWarp;
  const bool valid = row < row_end;
  const int64_t num_vecs = a.hidden / kVec;
  const auto [x, residual, residual_out, y] = RowOf<TIn>(a, valid ? row : 0);
  const auto held = [&](int k) { return valid && lane + int64_t{k} * threads_per_row < num_vecs; };
  const auto index = [&](int k) { return lane + int64_t{k} * threads_per_row; };

  // Sweep 1: every load of the thread issued before the first use of any.
  float h[kVecs][kVec] = {};
  float g[kVecs][kVec] = {};
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    if (held(k)) {
      LoadH<TIn, kVec>(x, residual, a.residual_type, index(k), h[k]);
      LoadAny<kVec>(a.gamma, a.gamma_type, index(k), g[k]);
    }
  }
  SumOfSquares acc{0.0f, 0.0f};
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    if (held(k)) {
      if (residual_out != nullptr) StoreAny<kVec>(residual_out, a.residual_type, index(k), h[k]);
#pragma unroll
      for (int e = 0; e < kVec; ++e) AddSquare<true>(acc.hi, acc.lo, h[k][e]);
    }
  }
  acc = RowReduce(
      acc, SumOfSquares{0.0f, 0.0f}, [](SumOfSquares v) { return WarpSum(v); }, scratch.sum_partial,
      warps_per_row);
  const float sum_sq = Total(acc);
  const float r = InverseRms(sum_sq, a.hidden, a.constants.eps);
  if (valid && lane == 0) StoreInverseRms(a, row, sum_sq, r);

  // Sweep 2: n, in place of h, and its abs-max.
  uint32_t amax = 0;
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      h[k][e] = Normalize(h[k][e], r, GammaPlusOffset(g[k][e], a.constants.weight_offset));
      if (held(k)) amax = max(amax, AbsBits(h[k][e]));
    }
  }
  // Scales per group, or a calibrated scale without its amax, need no block-wide abs-max:
  // the whole launch skips that reduction (but for per-row global scales, which are made
  // from it). Its barrier stays, when the sum's reduction crossed warps: it keeps the next
  // row's sum slots from being written before every warp has read these.
  const bool row_max =
      (PerRowScale(a) && (a.static_scale == nullptr || a.amax != nullptr)) || PerRowGlobalScales(a);
  if (row_max) {
    amax = RowReduce(
        amax, 0u, [](uint32_t v) { return WarpMax(v); }, scratch.max_partial, warps_per_row);
  } else if (warps_per_row > 1) {
    __syncthreads();
  }
  if (!PerRowScale(a)) {
    float global_scale = GlobalScaleOf(a);
    if (PerRowGlobalScales(a)) {
      global_scale = PerRowGlobalScale(sum_sq, amax);
      if (valid && lane == 0) StoreRowGlobalScale(a, row, global_scale);
    }
    RegisterGroups<kVec, kVecs>(a, row, h, held, index, sum_sq, global_scale, y);
    return;
  }
  if (!valid) return;
  const RowScale s = RowScaleOf(a, sum_sq, amax);
  if (lane == 0) {
    StoreScale(a, row, s.scale);
    StoreAmax(a, row, sum_sq, amax);
  }

  // Sweep 3: quantise.
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    if (held(k)) StoreFp8<kVec>(y, index(k), h[k], s.recip, a.out_format);
  }
}

}  // namespace fp8norm
