// block_shared's rows, the building blocks of the kernels that take one row per block:
// block_shared's own (block_shared.cu) and the one-kernel all-reduce's, which normalises
// the rows it has summed (allreduce.cu). Three sweeps over a row:
//   1. h = x (+ residual), residual_out = T(h), sum of squares      -> row sum
//   2. n = Normalize(h, r, gamma + weight_offset), abs-max          -> row max
//   3. y = FP8(clamp(n * recip))
// Sweep 1 keeps h in dynamic shared memory (float32, laid out so that each thread reads
// back exactly what it wrote) whenever the row fits, so x and residual are read from
// global memory once; sweep 2 overwrites it with n so that gamma is read once too. Rows
// too long for shared memory re-read x (and residual) in sweeps 2 and 3. Scales per group
// of any size take SharedGroups.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "row_blocks.cuh"

namespace fp8norm {

struct SharedScratch {
  SumOfSquares sum_partial[kWarp];
  SumOfSquares sum_result;
  uint32_t max_partial[kWarp];
  uint32_t max_result;
};

// block_shared's scales per group, for any group size: after sweep 1, each thread takes
// whole groups, normalises each element (from the row cache, or re-read), finds the
// group's abs-max, stores its scale and quantises it. The register variants' shuffle
// paths serve the common group sizes; this one serves every other and rows too long for
// registers. The barrier at the end keeps the next row's sweep 1 from overwriting cache
// entries another thread still reads.
template <typename TIn, int kVec>
__device__ __forceinline__ void SharedGroups(const RmsNormFp8Args& a, int64_t row,
                                             const float* cache /*[kVec][hidden / kVec] or null*/,
                                             float sum_sq, float r, SharedScratch& scratch) {
  const int64_t num_vecs = a.hidden / kVec;
  const int64_t group = a.group_size;
  const int64_t groups = GroupsPerRow(a);
  const auto [x, residual, residual_out, y] = RowOf<TIn>(a, row);
  const auto normed_at = [&](int64_t j) {
    float h[1];
    if (cache != nullptr) {
      h[0] = cache[(j % kVec) * num_vecs + j / kVec];
    } else {
      LoadH<TIn, 1>(x, residual, a.residual_type, j, h);
    }
    float g[1];
    LoadAny<1>(a.gamma, a.gamma_type, j, g);
    return Normalize(h[0], r, GammaPlusOffset(g[0], a.constants.weight_offset));
  };
  float global_scale = GlobalScaleOf(a);
  if (PerRowGlobalScales(a)) {
    // The row's own global scale first: the abs-max of every group, reduced over the block.
    uint32_t amax = 0;
    for (int64_t j = threadIdx.x; j < a.hidden; j += blockDim.x) {
      amax = max(amax, AbsBits(normed_at(j)));
    }
    amax = BlockReduce(
        amax, 0u, [](uint32_t v) { return WarpMax(v); }, scratch.max_partial, &scratch.max_result);
    global_scale = PerRowGlobalScale(sum_sq, amax);
    if (threadIdx.x == 0) StoreRowGlobalScale(a, row, global_scale);
  }
  for (int64_t g = threadIdx.x; g < groups; g += blockDim.x) {
    uint32_t amax = 0;
    for (int64_t j = g * group; j < (g + 1) * group; ++j) amax = max(amax, AbsBits(normed_at(j)));
    if (IsFp4(a)) {
      // In pairs (group sizes are even): one packed byte, or two codes, per pair.
      const Fp4Scale s = Fp4ScaleOf(a, sum_sq, amax, global_scale);
      StoreScale(a, row * groups + g, s.scale);
      for (int64_t j = g * group; j < (g + 1) * group; j += 2) {
        const float pair[2] = {normed_at(j), normed_at(j + 1)};
        StoreFp4<2>(y, j / 2, pair, s, a.y_packed);
      }
      continue;
    }
    const RowScale s = ComputeScale(sum_sq, amax, a.out_format, a.scale_type, a.constants);
    StoreScale(a, row * groups + g, s.scale);
    for (int64_t j = g * group; j < (g + 1) * group; ++j) {
      const float normed[1] = {normed_at(j)};
      StoreFp8<1>(y, j, normed, s.recip, a.out_format);
    }
  }
  __syncthreads();
}

// Sweep 1 of a row: h = x (+ residual), residual_out, h cached (when `cache`), and the
// row's sum of squares, which every thread of the block gets.
template <typename TIn, int kVec>
__device__ __forceinline__ float RowSumOfSquares(const RmsNormFp8Args& a, int64_t row,
                                                 float* cache /*[kVec][hidden / kVec] or null*/,
                                                 SharedScratch& scratch) {
  const int64_t num_vecs = a.hidden / kVec;
  const auto [x, residual, residual_out, y] = RowOf<TIn>(a, row);
  SumOfSquares acc{0.0f, 0.0f};
  for (int64_t i = threadIdx.x; i < num_vecs; i += blockDim.x) {
    float h[kVec];
    LoadH<TIn, kVec>(x, residual, a.residual_type, i, h);
    if (residual_out != nullptr) StoreAny<kVec>(residual_out, a.residual_type, i, h);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      AddSquare<true>(acc.hi, acc.lo, h[k]);
      if (cache != nullptr) cache[k * num_vecs + i] = h[k];
    }
  }
  acc = BlockReduce(
      acc, SumOfSquares{0.0f, 0.0f}, [](SumOfSquares v) { return WarpSum(v); }, scratch.sum_partial,
      &scratch.sum_result);
  return Total(acc);
}

// A row with scales per group: sweep 1, then SharedGroups.
template <typename TIn, int kVec>
__device__ __forceinline__ void ProcessGroupedRow(const RmsNormFp8Args& a, int64_t row,
                                                  float* cache /*[kVec][hidden / kVec] or null*/,
                                                  SharedScratch& scratch) {
  const float sum_sq = RowSumOfSquares<TIn, kVec>(a, row, cache, scratch);
  const float r = InverseRms(sum_sq, a.hidden, a.constants.eps);
  if (threadIdx.x == 0) StoreInverseRms(a, row, sum_sq, r);
  SharedGroups<TIn, kVec>(a, row, cache, sum_sq, r, scratch);
}

template <typename TIn, int kVec>
__device__ __forceinline__ void ProcessRow(const RmsNormFp8Args& a, int64_t row,
                                           float* cache /*[kVec][hidden / kVec] or null*/,
                                           SharedScratch& scratch) {
  const int64_t n = a.hidden;
  const int64_t num_vecs = n / kVec;
  const auto [x, residual, residual_out, y] = RowOf<TIn>(a, row);
  const float sum_sq = RowSumOfSquares<TIn, kVec>(a, row, cache, scratch);
  const float r = InverseRms(sum_sq, n, a.constants.eps);
  if (threadIdx.x == 0) StoreInverseRms(a, row, sum_sq, r);

  // Sweep 2: n and its abs-max.
  uint32_t amax = 0;
  for (int64_t i = threadIdx.x; i < num_vecs; i += blockDim.x) {
    float h[kVec];
    if (cache != nullptr) {
#pragma unroll
      for (int k = 0; k < kVec; ++k) h[k] = cache[k * num_vecs + i];
    } else {
      LoadH<TIn, kVec>(x, residual, a.residual_type, i, h);
    }
    float g[kVec];
    LoadAny<kVec>(a.gamma, a.gamma_type, i, g);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const float normed = Normalize(h[k], r, GammaPlusOffset(g[k], a.constants.weight_offset));
      amax = max(amax, AbsBits(normed));
      if (cache != nullptr) cache[k * num_vecs + i] = normed;
    }
  }
  amax = BlockReduce(
      amax, 0u, [](uint32_t v) { return WarpMax(v); }, scratch.max_partial, &scratch.max_result);
  const RowScale s = RowScaleOf(a, sum_sq, amax);
  if (threadIdx.x == 0) {
    StoreScale(a, row, s.scale);
    StoreAmax(a, row, sum_sq, amax);
  }

  // Sweep 3: quantise.
  for (int64_t i = threadIdx.x; i < num_vecs; i += blockDim.x) {
    float normed[kVec];
    if (cache != nullptr) {
#pragma unroll
      for (int k = 0; k < kVec; ++k) normed[k] = cache[k * num_vecs + i];
    } else {
      LoadH<TIn, kVec>(x, residual, a.residual_type, i, normed);
      float g[kVec];
      LoadAny<kVec>(a.gamma, a.gamma_type, i, g);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        normed[k] = Normalize(normed[k], r, GammaPlusOffset(g[k], a.constants.weight_offset));
      }
    }
    StoreFp8<kVec>(y, i, normed, s.recip, a.out_format);
  }
}

}  // namespace fp8norm
