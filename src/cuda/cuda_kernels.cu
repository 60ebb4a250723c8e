// CUDA kernels of rms_norm_fp8 and add_rms_norm_fp8 (docs/spec.md), in three variants
// (cuda_launch_plan.h picks one per call), and their launch.
//
// Every variant makes three sweeps over a row:
//   1. h = x (+ residual), residual_out = T(h), sum of squares      -> row sum
//   2. n = (h * r) * (gamma + weight_offset), abs-max               -> row max
//   3. y = FP8(clamp(n * recip))
// block_shared: one block per row (grid-stride over rows). Sweep 1 keeps h in shared
//   memory (float32, laid out so that each thread reads back exactly what it wrote)
//   whenever the row fits, so x and residual are read from global memory once; sweep 2
//   overwrites it with n so that gamma is read once too. Rows too long for shared memory
//   re-read x (and residual) in sweeps 2 and 3. Takes any shape and alignment.
// warp_rows / block_registers: a group of threads (1-8 warps, or a whole block) holds the
//   row in registers, vector i of the row in thread i % group, so every global element is
//   read and written once and all of a thread's loads, gamma's included, are in flight
//   before the first arithmetic. A reduction spanning several warps costs one barrier.
//
// Every element-wise and per-row formula comes from fp8norm_math.h, shared with the CPU.
//
// nvcc compiles this file for GPUs; the host compiler compiles it unchanged for the SIMT
// emulation (src/simt, docs/simt.md), which runs the same kernels on the CPU in every test
// run. Global memory and the dynamic shared region are reached through device_memory.h so
// that the emulation can check and count each access.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "cuda_kernels.h"
#include "cuda_launch_plan.h"
#include "device_memory.h"
#include "fp8norm_math.h"

namespace fp8norm {
namespace {

template <typename T, int kCount>
struct alignas(sizeof(T) * kCount) Vec {
  T v[kCount];
};

// Elements of TIn per 16-byte load.
template <typename TIn>
constexpr int kVecOf = VectorWidth(sizeof(TIn));

// ----------------------------------------------------------------- reductions

__device__ __forceinline__ SumOfSquares WarpSum(SumOfSquares v) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    const SumOfSquares other{__shfl_xor_sync(0xffffffffu, v.hi, offset),
                             __shfl_xor_sync(0xffffffffu, v.lo, offset)};
    v = Combine(v, other);
  }
  return v;
}

__device__ __forceinline__ uint32_t WarpMax(uint32_t v) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    v = max(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  return v;
}

// Block-wide reduction; every thread gets the result. The partial and result slots are
// separate so that back-to-back calls need no extra barrier.
template <typename T, typename WarpOp>
__device__ __forceinline__ T BlockReduce(T v, T identity, WarpOp warp_op, T* partial /*[32]*/,
                                         T* result /*[1]*/) {
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  const int num_warps = (blockDim.x + kWarp - 1) / kWarp;
  v = warp_op(v);
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    T w = lane < num_warps ? partial[lane] : identity;
    w = warp_op(w);
    if (lane == 0) *result = w;
  }
  __syncthreads();
  return *result;
}

// ----------------------------------------------------------------- loads and stores
//
// `site` is the kernel line a load or store comes from (the caller's, by default): the
// emulation's memory accounting groups a warp's accesses by it. nvcc drops it.

template <typename TIn, int kVec>
__device__ __forceinline__ void LoadVec(const TIn* p, int64_t i, float (&out)[kVec], int site) {
  const Vec<TIn, kVec> v = LoadGlobal(reinterpret_cast<const Vec<TIn, kVec>*>(p) + i, site);
#pragma unroll
  for (int k = 0; k < kVec; ++k) out[k] = ToFloat(v.v[k]);
}

template <typename TIn, int kVec>
__device__ __forceinline__ void StoreVec(TIn* p, int64_t i, const float (&in)[kVec], int site) {
  Vec<TIn, kVec> v;
#pragma unroll
  for (int k = 0; k < kVec; ++k) v.v[k] = FromFloat<TIn>(in[k]);
  StoreGlobal(reinterpret_cast<Vec<TIn, kVec>*>(p) + i, v, site);
}

// gamma's and the residual's dtypes are run-time values: one uniform branch per vector,
// instead of template parameters that would multiply the kernels compiled per architecture.
template <int kVec>
__device__ __forceinline__ void LoadAny(const void* p, FloatType type, int64_t i,
                                        float (&out)[kVec], int site = __builtin_LINE()) {
  switch (type) {
    case FloatType::kF16:
      LoadVec<F16, kVec>(static_cast<const F16*>(p), i, out, site);
      break;
    case FloatType::kBF16:
      LoadVec<BF16, kVec>(static_cast<const BF16*>(p), i, out, site);
      break;
    default:
      LoadVec<float, kVec>(static_cast<const float*>(p), i, out, site);
  }
}

template <int kVec>
__device__ __forceinline__ void StoreAny(void* p, FloatType type, int64_t i,
                                         const float (&in)[kVec], int site = __builtin_LINE()) {
  switch (type) {
    case FloatType::kF16:
      StoreVec<F16, kVec>(static_cast<F16*>(p), i, in, site);
      break;
    case FloatType::kBF16:
      StoreVec<BF16, kVec>(static_cast<BF16*>(p), i, in, site);
      break;
    default:
      StoreVec<float, kVec>(static_cast<float*>(p), i, in, site);
  }
}

// h for vector i of the row: x (+ residual).
template <typename TIn, int kVec>
__device__ __forceinline__ void LoadH(const TIn* x, const void* residual, FloatType residual_type,
                                      int64_t i, float (&h)[kVec], int site = __builtin_LINE()) {
  LoadVec<TIn, kVec>(x, i, h, site);
  if (residual != nullptr) {
    float r[kVec];
    LoadAny<kVec>(residual, residual_type, i, r, site);
#pragma unroll
    for (int k = 0; k < kVec; ++k) h[k] += r[k];
  }
}

// y for vector i of the row, with the reciprocal scale of its row or group. The output
// format is a run-time value, uniform over the launch: a template parameter would double
// every kernel compiled per architecture.
template <int kVec>
__device__ __forceinline__ void StoreFp8(uint8_t* y, int64_t i, const float (&normed)[kVec],
                                         float recip, Fp8Format format,
                                         int site = __builtin_LINE()) {
  Vec<uint8_t, kVec> q;
  if (format == Fp8Format::kE4M3FN) {
#pragma unroll
    for (int k = 0; k < kVec; ++k) q.v[k] = QuantizeElement<Fp8Format::kE4M3FN>(normed[k], recip);
  } else {
#pragma unroll
    for (int k = 0; k < kVec; ++k) q.v[k] = QuantizeElement<Fp8Format::kE4M3FNUZ>(normed[k], recip);
  }
  StoreGlobal(reinterpret_cast<Vec<uint8_t, kVec>*>(y) + i, q, site);
}

// Scale `index` of the call ([rows, groups] row-major); e8m0 as its exponent byte.
__device__ __forceinline__ void StoreScale(const RmsNormFp8Args& a, int64_t index, float scale,
                                           int site = __builtin_LINE()) {
  if (a.scale_type == FloatType::kE8M0) {
    StoreGlobal(static_cast<uint8_t*>(a.scales) + index, E8M0Code(scale), site);
    return;
  }
  const float value[1] = {scale};
  StoreAny<1>(a.scales, a.scale_type, index, value, site);
}

// The scale of a row with one scale (dynamic per row, or the calibrated one).
__device__ __forceinline__ RowScale RowScaleOf(const RmsNormFp8Args& a, float sum_sq,
                                               uint32_t amax) {
  if (a.static_scale != nullptr) {
    return StaticScale(sum_sq, LoadGlobal(a.static_scale), a.scale_type);
  }
  return ComputeScale(sum_sq, amax, a.out_format, a.scale_type, a.constants);
}

// Row `row` of the row-major arrays: x, the residual and residual_out (null when the op
// has none) and y.
template <typename TIn>
struct RowPointers {
  const TIn* x;
  const void* residual;
  void* residual_out;
  uint8_t* y;
};

template <typename TIn>
__device__ __forceinline__ RowPointers<TIn> RowOf(const RmsNormFp8Args& a, int64_t row) {
  const int64_t offset = row * a.hidden;
  const size_t residual_bytes = FloatTypeBytes(a.residual_type);
  return {static_cast<const TIn*>(a.x) + offset,
          a.residual != nullptr ? static_cast<const char*>(a.residual) + offset * residual_bytes
                                : nullptr,
          a.residual_out != nullptr ? static_cast<char*>(a.residual_out) + offset * residual_bytes
                                    : nullptr,
          static_cast<uint8_t*>(a.y) + offset};
}

// ----------------------------------------------------------------- block_shared

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
                                             float sum_sq, float r) {
  const int64_t num_vecs = a.hidden / kVec;
  const int64_t group = a.group_size;
  const int64_t groups = a.hidden / group;
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
    return (h[0] * r) * (g[0] + a.constants.weight_offset);
  };
  for (int64_t g = threadIdx.x; g < groups; g += blockDim.x) {
    uint32_t amax = 0;
    for (int64_t j = g * group; j < (g + 1) * group; ++j) amax = max(amax, AbsBits(normed_at(j)));
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
  SharedGroups<TIn, kVec>(a, row, cache, sum_sq, InverseRms(sum_sq, a.hidden, a.constants.eps));
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
      const float normed = (h[k] * r) * (g[k] + a.constants.weight_offset);
      amax = max(amax, AbsBits(normed));
      if (cache != nullptr) cache[k * num_vecs + i] = normed;
    }
  }
  amax = BlockReduce(
      amax, 0u, [](uint32_t v) { return WarpMax(v); }, scratch.max_partial, &scratch.max_result);
  const RowScale s = RowScaleOf(a, sum_sq, amax);
  if (threadIdx.x == 0) StoreScale(a, row, s.scale);

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
        normed[k] = (normed[k] * r) * (g[k] + a.constants.weight_offset);
      }
    }
    StoreFp8<kVec>(y, i, normed, s.recip, a.out_format);
  }
}

// grid: any number of blocks (rows are strided over them); block: a multiple of 32 threads.
// Dynamic shared memory: hidden floats when `cached`, none otherwise. kGroups: scales per
// group, a kernel of its own so that its registers do not weigh on the per-row one.
template <typename TIn, bool kGroups>
__global__ void __launch_bounds__(kMaxThreads)
    BlockSharedKernel(const RmsNormFp8Args a, const bool vectorized, const bool cached) {
  float* const cache = DynamicShared<float>();
  SharedScratch& scratch = StaticShared<SharedScratch>();
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    float* const row_cache = cached ? cache : nullptr;
    if constexpr (kGroups) {
      if (vectorized) {
        ProcessGroupedRow<TIn, kVecOf<TIn>>(a, row, row_cache, scratch);
      } else {
        ProcessGroupedRow<TIn, 1>(a, row, row_cache, scratch);
      }
    } else if (vectorized) {
      ProcessRow<TIn, kVecOf<TIn>>(a, row, row_cache, scratch);
    } else {
      ProcessRow<TIn, 1>(a, row, row_cache, scratch);
    }
  }
}

// ----------------------------------------------------------------- rows in registers

// One slot per warp of the block (at most 32) for each of the two reductions. A group
// writes its sum slots before the barrier of its sum reduction and its max slots before
// the barrier of its max reduction; every warp reads a slot before it arrives at the
// other reduction's barrier, which the next write of that slot follows. So one barrier per
// reduction suffices, also from one row to the next.
struct RegisterScratch {
  SumOfSquares sum_partial[kWarp];
  uint32_t max_partial[kWarp];
};

// Reduces v over the `group_warps` consecutive warps of the calling thread's group; every
// thread of the group gets the result. Every thread of the block calls it together.
template <typename T, typename WarpOp>
__device__ __forceinline__ T GroupReduce(T v, T identity, WarpOp warp_op, T* partial /*[32]*/,
                                         int group_warps) {
  v = warp_op(v);
  if (group_warps == 1) return v;
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  const int first = warp - warp % group_warps;
  return warp_op(lane < group_warps ? partial[first + lane] : identity);
}

// The register variants' scales per group (GroupFitsRegisters): a group of V whole vectors
// (V a power of two up to 32) is held by V consecutive lanes, vector i of the row in lane
// i % threads_per_row, and reduced by log2(V) shuffles, no barrier. Every lane of the warp
// calls it (the shuffles need all 32), held vectors or not.
template <int kVec, int kVecs, typename Held, typename Index>
__device__ __forceinline__ void RegisterGroups(const RmsNormFp8Args& a, int64_t row,
                                               const float (&normed)[kVecs][kVec], Held held,
                                               Index index, float sum_sq, uint8_t* y) {
  const int lanes = static_cast<int>(a.group_size / kVec);
  const int64_t groups = a.hidden / a.group_size;
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
    const RowScale s = ComputeScale(sum_sq, amax, a.out_format, a.scale_type, a.constants);
    if (index(k) % lanes == 0) StoreScale(a, row * groups + index(k) / lanes, s.scale);
    StoreFp8<kVec>(y, index(k), normed[k], s.recip, a.out_format);
  }
}

// Row `row` held by a group of `group_threads` threads (whole warps), the caller thread
// being `lane` of it: vector i of the row in registers of thread i % group_threads. Every
// thread of the block calls it equally often (the reductions may meet at a barrier); a
// group past the last row only takes part in those.
template <typename TIn, int kVecs>
__device__ __forceinline__ void RegisterRow(const RmsNormFp8Args& a, int64_t row, int lane,
                                            int group_threads, RegisterScratch& scratch) {
  constexpr int kVec = kVecOf<TIn>;
  const int group_warps = group_threads / kWarp;
  const bool valid = row < a.rows;
  const int64_t num_vecs = a.hidden / kVec;
  const auto [x, residual, residual_out, y] = RowOf<TIn>(a, valid ? row : 0);
  const auto held = [&](int k) { return valid && lane + int64_t{k} * group_threads < num_vecs; };
  const auto index = [&](int k) { return lane + int64_t{k} * group_threads; };

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
  acc = GroupReduce(
      acc, SumOfSquares{0.0f, 0.0f}, [](SumOfSquares v) { return WarpSum(v); }, scratch.sum_partial,
      group_warps);
  const float sum_sq = Total(acc);
  const float r = InverseRms(sum_sq, a.hidden, a.constants.eps);

  // Sweep 2: n, in place of h, and its abs-max.
  uint32_t amax = 0;
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      h[k][e] = (h[k][e] * r) * (g[k][e] + a.constants.weight_offset);
      if (held(k)) amax = max(amax, AbsBits(h[k][e]));
    }
  }
  // Scales per group, or a calibrated scale, need no block-wide abs-max: the whole launch
  // skips that reduction. Its barrier stays, when the sum's reduction crossed warps: it
  // keeps the next row's sum slots from being written before every warp has read these.
  const bool row_max = PerRowScale(a) && a.static_scale == nullptr;
  if (row_max) {
    amax = GroupReduce(
        amax, 0u, [](uint32_t v) { return WarpMax(v); }, scratch.max_partial, group_warps);
  } else if (group_warps > 1) {
    __syncthreads();
  }
  if (!PerRowScale(a)) {
    RegisterGroups<kVec, kVecs>(a, row, h, held, index, sum_sq, y);
    return;
  }
  if (!valid) return;
  const RowScale s = RowScaleOf(a, sum_sq, amax);
  if (lane == 0) StoreScale(a, row, s.scale);

  // Sweep 3: quantise.
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    if (held(k)) StoreFp8<kVec>(y, index(k), h[k], s.recip, a.out_format);
  }
}

// warp_rows. grid: any number of blocks (groups of rows_per_block rows are strided over
// them); block: kWarpRowsBlockThreads threads, `threads_per_row` (a power of two, 32 to
// 256) per row. Aligned rows of at most threads_per_row * kVecs vectors.
template <typename TIn, int kVecs>
__global__ void __launch_bounds__(kWarpRowsBlockThreads, 2)
    WarpRowsKernel(const RmsNormFp8Args a, const int threads_per_row) {
  RegisterScratch& scratch = StaticShared<RegisterScratch>();
  const int rows_per_block = static_cast<int>(blockDim.x) / threads_per_row;
  const int group = static_cast<int>(threadIdx.x) / threads_per_row;
  const int lane = static_cast<int>(threadIdx.x) % threads_per_row;
  // The same trip count for every group of the block: a group past the end still meets
  // the others at the reductions' barriers.
  for (int64_t first = int64_t{blockIdx.x} * rows_per_block; first < a.rows;
       first += int64_t{gridDim.x} * rows_per_block) {
    RegisterRow<TIn, kVecs>(a, first + group, lane, threads_per_row, scratch);
  }
}

// Registers per thread: at most 64 with 2 vectors (ptxas needs about 56 for bf16 without
// spilling), so that blocks of up to 256 threads (rows up to 4096 bf16) run 4 to an SM
// and 512-thread ones 2; at most 128 with 4 vectors (about 100 needed).
constexpr int BlockRegistersMinBlocks(int vectors) { return vectors <= 2 ? 2 : 1; }

// block_registers. grid: any number of blocks (rows are strided over them); block: up to
// kBlockRegistersMaxThreads threads, whole warps, all holding one row. Aligned rows of at
// most blockDim.x * kVecs vectors.
template <typename TIn, int kVecs>
__global__ void __launch_bounds__(kBlockRegistersMaxThreads, BlockRegistersMinBlocks(kVecs))
    BlockRegistersKernel(const RmsNormFp8Args a) {
  RegisterScratch& scratch = StaticShared<RegisterScratch>();
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    RegisterRow<TIn, kVecs>(a, row, static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x),
                            scratch);
  }
}

__global__ void RoundKernel(const RoundArgs a) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < a.count;
       i += int64_t{gridDim.x} * blockDim.x) {
    const uint16_t bits = RoundedBits(a.target, LoadGlobal(a.in + i));
    if (IsFp8(a.target)) {
      StoreGlobal(static_cast<uint8_t*>(a.out) + i, static_cast<uint8_t>(bits));
    } else {
      StoreGlobal(static_cast<uint16_t*>(a.out) + i, bits);
    }
  }
}

// ----------------------------------------------------------------- launch

// The device's limits the plan needs: attribute reads, answered from the runtime's tables.
cudaError_t QueryDeviceLimits(int device, DeviceLimits* limits) {
  struct Read {
    cudaDeviceAttr attribute;
    int value;
  } reads[] = {{cudaDevAttrMaxSharedMemoryPerBlockOptin, 0},
               {cudaDevAttrMaxSharedMemoryPerBlock, 0},
               {cudaDevAttrMaxGridDimX, 0},
               {cudaDevAttrReservedSharedMemoryPerBlock, 0},
               {cudaDevAttrMaxSharedMemoryPerMultiprocessor, 0},
               {cudaDevAttrMultiProcessorCount, 0}};
  for (Read& r : reads) {
    const cudaError_t err = cudaDeviceGetAttribute(&r.value, r.attribute, device);
    if (err != cudaSuccess) return err;
  }
  limits->optin_shared_bytes = static_cast<size_t>(reads[0].value);
  limits->default_shared_bytes = static_cast<size_t>(reads[1].value);
  limits->max_blocks = std::min<int64_t>(kMaxBlocks, reads[2].value);
  limits->reserved_shared_bytes = static_cast<size_t>(reads[3].value);
  limits->multiprocessor_shared_bytes = static_cast<size_t>(reads[4].value);
  limits->multiprocessors = std::max(1, reads[5].value);
  return cudaSuccess;
}

// What one device needs before its first launch, done once: every kernel loaded (a lazy
// module load inside CUDA graph capture fails on drivers before R545), block_shared's
// real static shared size read and its dynamic-size attribute set, to the most any call
// can use, so that no launch depends on an attribute another call may change.
struct DeviceSetup {
  // block_shared's limits per input type and output format: the device's, with the
  // kernel's static size and its attribute.
  DeviceLimits block_shared[3];
};

// cudaErrorStreamCaptureUnsupported (900) to cudaErrorStreamCaptureWrongThread (908): the
// call was made while a stream captures a graph.
bool IsCaptureError(cudaError_t err) { return err >= 900 && err <= 908; }

// Loads `kernel` (cudaFuncGetAttributes forces the lazy load) and returns its attributes.
// `name`, `static_shared` (the __shared__ struct it uses) and `max_threads` (its
// __launch_bounds__) are for the emulation.
template <typename Kernel>
cudaError_t LoadKernel(Kernel kernel, const char* name, size_t static_shared, int max_threads,
                       cudaFuncAttributes* attributes) {
  DeclareKernel(kernel, name, static_shared, max_threads);
  return cudaFuncGetAttributes(attributes, kernel);
}

template <typename TIn>
cudaError_t SetUpKernels(const DeviceLimits& device, DeviceLimits* block_shared) {
  cudaFuncAttributes attributes{};
  cudaError_t err = cudaSuccess;
  const auto load = [&](auto kernel, const char* name, size_t scratch, int max_threads) {
    if (err == cudaSuccess) err = LoadKernel(kernel, name, scratch, max_threads, &attributes);
  };
  constexpr size_t kRegisterScratch = sizeof(RegisterScratch);
  load(WarpRowsKernel<TIn, 1>, "warp_rows", kRegisterScratch, kWarpRowsBlockThreads);
  load(WarpRowsKernel<TIn, 2>, "warp_rows", kRegisterScratch, kWarpRowsBlockThreads);
  load(WarpRowsKernel<TIn, 4>, "warp_rows", kRegisterScratch, kWarpRowsBlockThreads);
  load(BlockRegistersKernel<TIn, 2>, "block_registers", kRegisterScratch,
       kBlockRegistersMaxThreads);
  load(BlockRegistersKernel<TIn, 4>, "block_registers", kRegisterScratch,
       kBlockRegistersMaxThreads);
  if (err != cudaSuccess) return err;
  // block_shared, per row and per group: each loaded, its static size read and its
  // dynamic-size attribute set; the plan keeps to the stricter of the two.
  *block_shared = device;
  block_shared->static_shared_bytes = 0;
  block_shared->max_dynamic_shared_bytes = SIZE_MAX;
  const auto set_up = [&](auto kernel) {
    if (err != cudaSuccess) return;
    err = LoadKernel(kernel, "block_shared", sizeof(SharedScratch), kMaxThreads, &attributes);
    if (err != cudaSuccess) return;
    const size_t static_bytes = attributes.sharedSizeBytes;
    block_shared->static_shared_bytes = std::max(block_shared->static_shared_bytes, static_bytes);
    const size_t most_dynamic =
        device.optin_shared_bytes > static_bytes ? device.optin_shared_bytes - static_bytes : 0;
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(most_dynamic));
    if (err != cudaSuccess) {
      cudaGetLastError();
      // Refused inside graph capture: nothing is kept, so that a call outside capture sets
      // it. Refused otherwise: the plan keeps to what the kernel allows as it is.
      if (IsCaptureError(err)) return;
    }
    err = cudaFuncGetAttributes(&attributes, kernel);
    if (err != cudaSuccess) return;
    block_shared->max_dynamic_shared_bytes =
        std::min(block_shared->max_dynamic_shared_bytes,
                 static_cast<size_t>(std::max(0, attributes.maxDynamicSharedSizeBytes)));
  };
  set_up(BlockSharedKernel<TIn, false>);
  set_up(BlockSharedKernel<TIn, true>);
  return err;
}

cudaError_t SetUpDevice(int device, DeviceSetup* setup) {
  DeviceLimits limits{0, 0};
  cudaError_t err = QueryDeviceLimits(device, &limits);
  if (err == cudaSuccess) err = SetUpKernels<float>(limits, &setup->block_shared[0]);
  if (err == cudaSuccess) err = SetUpKernels<F16>(limits, &setup->block_shared[1]);
  if (err == cudaSuccess) err = SetUpKernels<BF16>(limits, &setup->block_shared[2]);
  if (err == cudaSuccess) {
    cudaFuncAttributes attributes{};
    err = cudaFuncGetAttributes(&attributes, RoundKernel);
  }
  return err;
}

struct Setups {
  std::mutex mutex;
  std::unordered_map<int, std::unique_ptr<const DeviceSetup>> by_device;
  std::vector<std::unique_ptr<const DeviceSetup>> forgotten;  // may still be read
};

Setups& AllSetups() {
  static Setups* setups = new Setups;  // never destroyed: launches may run at exit
  return *setups;
}

// The device's setup, done now if it was not; a failed setup is not kept, so that a call
// outside capture tries again.
cudaError_t GetDeviceSetup(int device, const DeviceSetup** out) {
  Setups& s = AllSetups();
  std::lock_guard<std::mutex> lock(s.mutex);
  auto it = s.by_device.find(device);
  if (it == s.by_device.end()) {
    auto setup = std::make_unique<DeviceSetup>();
    const cudaError_t err = SetUpDevice(device, setup.get());
    if (err != cudaSuccess) return err;
    it = s.by_device.emplace(device, std::move(setup)).first;
  }
  *out = it->second.get();
  return cudaSuccess;
}

std::atomic<int> requested_variant{static_cast<int>(KernelVariant::kAuto)};

KernelVariant RequestedVariant() {
  return static_cast<KernelVariant>(requested_variant.load(std::memory_order_relaxed));
}

template <typename Kernel, typename... Args>
cudaError_t LaunchKernel(Kernel kernel, unsigned blocks, int threads, size_t dynamic_shared_bytes,
                         cudaStream_t stream, const Args&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(blocks);
  config.blockDim = dim3(static_cast<unsigned>(threads));
  config.dynamicSmemBytes = dynamic_shared_bytes;
  config.stream = stream;
  return cudaLaunchKernelEx(&config, kernel, args...);
}

template <typename TIn>
cudaError_t LaunchPlanned(cudaStream_t stream, const RmsNormFp8Args& a, const LaunchPlan& p) {
  switch (p.variant) {
    case KernelVariant::kWarpRows: {
      const auto kernel = p.vectors_per_thread == 1   ? WarpRowsKernel<TIn, 1>
                          : p.vectors_per_thread == 2 ? WarpRowsKernel<TIn, 2>
                                                      : WarpRowsKernel<TIn, 4>;
      return LaunchKernel(kernel, p.blocks, p.threads, 0, stream, a, p.threads_per_row);
    }
    case KernelVariant::kBlockRegisters: {
      const auto kernel =
          p.vectors_per_thread == 2 ? BlockRegistersKernel<TIn, 2> : BlockRegistersKernel<TIn, 4>;
      return LaunchKernel(kernel, p.blocks, p.threads, 0, stream, a);
    }
    default:
      return LaunchKernel(
          PerRowScale(a) ? BlockSharedKernel<TIn, false> : BlockSharedKernel<TIn, true>, p.blocks,
          p.threads, p.dynamic_shared_bytes, stream, a, p.vectorized, p.cached);
  }
}

template <typename TIn>
cudaError_t Launch(cudaStream_t stream, const DeviceLimits& limits, const RmsNormFp8Args& a) {
  const KernelVariant variant = RequestedVariant();
  const LaunchPlan plan = PlanRmsNormFp8Launch(a, limits, variant);
  const cudaError_t err = LaunchPlanned<TIn>(stream, a, plan);
  if (err != cudaErrorInvalidValue || !plan.cached) return err;
  // The GPU refused the row cache after all (a limit the plan does not model): nothing
  // was enqueued, so re-read the row instead.
  cudaGetLastError();
  DeviceLimits uncached = limits;
  uncached.max_dynamic_shared_bytes = 0;
  return LaunchPlanned<TIn>(stream, a, PlanRmsNormFp8Launch(a, uncached, variant));
}

// block_shared's limits for the call's dtypes on a prepared device.
const DeviceLimits& LimitsFor(const DeviceSetup& setup, const RmsNormFp8Args& a) {
  return setup.block_shared[static_cast<int>(a.input_type)];
}

}  // namespace

cudaError_t PrepareDevice(int device) {
  const DeviceSetup* setup = nullptr;
  return GetDeviceSetup(device, &setup);
}

void ForgetDeviceSetups() {
  Setups& s = AllSetups();
  std::lock_guard<std::mutex> lock(s.mutex);
  for (auto& entry : s.by_device) s.forgotten.push_back(std::move(entry.second));
  s.by_device.clear();
}

void SetKernelVariant(KernelVariant variant) {
  requested_variant.store(static_cast<int>(variant), std::memory_order_relaxed);
}

KernelVariant RequestedKernelVariant() { return RequestedVariant(); }

cudaError_t PlanLaunch(int device, const RmsNormFp8Args& a, LaunchPlan* plan) {
  const DeviceSetup* setup = nullptr;
  const cudaError_t err = GetDeviceSetup(device, &setup);
  if (err == cudaSuccess) *plan = PlanRmsNormFp8Launch(a, LimitsFor(*setup, a), RequestedVariant());
  return err;
}

cudaError_t LaunchRmsNormFp8(cudaStream_t stream, int device, const RmsNormFp8Args& a) {
  if (a.rows == 0) return cudaSuccess;
  if (a.hidden == 0) {
    // Empty rows: no groups at all, or a row of zeros' scale. That is 0 for a dynamic
    // nearest-rounded scale (zero bits in every scale dtype); a power-of-two or calibrated
    // one comes from the kernel, whose sweeps are then empty.
    if (!PerRowScale(a)) return cudaSuccess;
    if (a.static_scale == nullptr && !a.constants.power_of_two) {
      return cudaMemsetAsync(a.scales, 0,
                             static_cast<size_t>(a.rows) * FloatTypeBytes(a.scale_type), stream);
    }
  }
  const DeviceSetup* setup = nullptr;
  const cudaError_t err = GetDeviceSetup(device, &setup);
  if (err != cudaSuccess) return err;
  switch (a.input_type) {
    case FloatType::kF16:
      return Launch<F16>(stream, LimitsFor(*setup, a), a);
    case FloatType::kBF16:
      return Launch<BF16>(stream, LimitsFor(*setup, a), a);
    default:
      return Launch<float>(stream, LimitsFor(*setup, a), a);
  }
}

cudaError_t LaunchRound(cudaStream_t stream, const RoundArgs& a) {
  if (a.count == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const unsigned blocks =
      static_cast<unsigned>(std::min<int64_t>((a.count + kThreads - 1) / kThreads, 65535));
  return LaunchKernel(RoundKernel, blocks, kThreads, 0, stream, a);
}

}  // namespace fp8norm
