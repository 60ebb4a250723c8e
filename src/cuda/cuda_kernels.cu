// CUDA kernels of rms_norm_fp8 and add_rms_norm_fp8 (docs/spec.md).
//
// One thread block per row (grid-stride over rows). Three sweeps over the row:
//   1. h = x (+ residual), residual_out = T(h), sum of squares      -> block sum
//   2. n = (h * r) * (gamma + weight_offset), abs-max               -> block max
//   3. y = FP8(clamp(n * recip))
// Sweep 1 keeps h in shared memory (float32, laid out so that each thread reads back
// exactly what it wrote) whenever the row fits, so x and residual are read from global
// memory once; sweep 2 overwrites it with n so that gamma is read once too. Rows too long
// for shared memory re-read x (and residual) in sweeps 2 and 3.
//
// Every element-wise and per-row formula comes from fp8norm_math.h, shared with the CPU.
//
// nvcc compiles this file for GPUs; the host compiler compiles it unchanged for the SIMT
// emulation (src/simt, docs/simt.md), which runs the same kernels on the CPU in every test
// run. Global memory and the dynamic shared region are reached through device_memory.h so
// that the emulation can check and count each access.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

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

// ----------------------------------------------------------------- the row

struct SharedScratch {
  SumOfSquares sum_partial[kWarp];
  SumOfSquares sum_result;
  uint32_t max_partial[kWarp];
  uint32_t max_result;
};

template <typename TIn, Fp8Format kOut, int kVec>
__device__ __forceinline__ void ProcessRow(const RmsNormFp8Args& a, int64_t row,
                                           float* cache /*[kVec][hidden / kVec] or null*/,
                                           SharedScratch& scratch) {
  const int64_t n = a.hidden;
  const int64_t num_vecs = n / kVec;
  const int64_t offset = row * n;
  const TIn* x = static_cast<const TIn*>(a.x) + offset;
  const size_t residual_bytes = FloatTypeBytes(a.residual_type);
  const void* residual = a.residual != nullptr
                             ? static_cast<const char*>(a.residual) + offset * residual_bytes
                             : nullptr;
  void* residual_out = a.residual_out != nullptr
                           ? static_cast<char*>(a.residual_out) + offset * residual_bytes
                           : nullptr;
  uint8_t* y = static_cast<uint8_t*>(a.y) + offset;

  // Sweep 1: h, residual_out, sum of squares.
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
  const float sum_sq = Total(acc);
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
  const RowScale s = ComputeRowScale(sum_sq, amax, kOut, a.scale_type, a.constants);
  if (threadIdx.x == 0) {
    const float scale[1] = {s.scale};
    StoreAny<1>(a.scales, a.scale_type, row, scale);
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
        normed[k] = (normed[k] * r) * (g[k] + a.constants.weight_offset);
      }
    }
    Vec<uint8_t, kVec> q;
#pragma unroll
    for (int k = 0; k < kVec; ++k) q.v[k] = QuantizeElement<kOut>(normed[k], s.recip);
    StoreGlobal(reinterpret_cast<Vec<uint8_t, kVec>*>(y) + i, q);
  }
}

// grid: any number of blocks (rows are strided over them); block: a multiple of 32 threads.
// Dynamic shared memory: hidden floats when `cached`, none otherwise.
template <typename TIn, Fp8Format kOut>
__global__ void __launch_bounds__(kMaxThreads)
    RmsNormFp8Kernel(const RmsNormFp8Args a, const bool vectorized, const bool cached) {
  float* const cache = DynamicShared<float>();
  __shared__ SharedScratch scratch;
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    if (vectorized) {
      ProcessRow<TIn, kOut, kVecOf<TIn>>(a, row, cached ? cache : nullptr, scratch);
    } else {
      ProcessRow<TIn, kOut, 1>(a, row, cached ? cache : nullptr, scratch);
    }
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

// The limits of `device` the launch plan needs: attribute reads, answered by the runtime
// from its own tables.
cudaError_t QueryLimits(int device, DeviceLimits* limits) {
  int optin_shared = 0;
  int default_shared = 0;
  int max_grid_x = 0;
  cudaError_t err =
      cudaDeviceGetAttribute(&optin_shared, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&default_shared, cudaDevAttrMaxSharedMemoryPerBlock, device);
  }
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&max_grid_x, cudaDevAttrMaxGridDimX, device);
  if (err != cudaSuccess) return err;
  limits->optin_shared_bytes = static_cast<size_t>(optin_shared);
  limits->default_shared_bytes = static_cast<size_t>(default_shared);
  limits->max_blocks = std::min<int64_t>(kMaxBlocks, max_grid_x);
  return cudaSuccess;
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

template <typename TIn, Fp8Format kOut>
cudaError_t Launch(cudaStream_t stream, int device, const RmsNormFp8Args& a) {
  DeviceLimits limits{0, sizeof(SharedScratch)};
  cudaError_t err = QueryLimits(device, &limits);
  if (err != cudaSuccess) return err;
  const LaunchPlan plan = PlanRmsNormFp8Launch(a, limits);
  auto kernel = RmsNormFp8Kernel<TIn, kOut>;
  if (plan.opt_in) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(plan.dynamic_shared_bytes));
    if (err != cudaSuccess) return err;
  }
  return LaunchKernel(kernel, plan.blocks, plan.threads, plan.dynamic_shared_bytes, stream, a,
                      plan.vectorized, plan.cached);
}

template <typename TIn>
cudaError_t DispatchOutput(cudaStream_t stream, int device, const RmsNormFp8Args& a) {
  return a.out_format == Fp8Format::kE4M3FN ? Launch<TIn, Fp8Format::kE4M3FN>(stream, device, a)
                                            : Launch<TIn, Fp8Format::kE4M3FNUZ>(stream, device, a);
}

}  // namespace

cudaError_t LaunchRmsNormFp8(cudaStream_t stream, int device, const RmsNormFp8Args& a) {
  if (a.rows == 0) return cudaSuccess;
  if (a.hidden == 0) {
    // Zero bits are 0.0 in every scale dtype.
    return cudaMemsetAsync(a.scales, 0, static_cast<size_t>(a.rows) * FloatTypeBytes(a.scale_type),
                           stream);
  }
  switch (a.input_type) {
    case FloatType::kF16:
      return DispatchOutput<F16>(stream, device, a);
    case FloatType::kBF16:
      return DispatchOutput<BF16>(stream, device, a);
    default:
      return DispatchOutput<float>(stream, device, a);
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
