// The device building blocks every kernel family of rms_norm_fp8 / add_rms_norm_fp8 is
// made of: 16-byte vectors, warp and block reductions, the loads and stores of a row's
// elements (any of the float input types, run-time dtypes for gamma and the residual),
// FP8 codes and scales, and the row's pointers. Element-wise and per-row arithmetic comes
// from fp8norm_math.h, shared with the CPU kernel. Global memory is reached through
// device_memory.h so that the SIMT emulation can check and count each access.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_launch_plan.h"
#include "device_memory.h"
#include "fp8norm_math.h"
#include "rms_norm_fp8.h"

namespace fp8norm {

template <typename T, int kCount>
struct alignas(sizeof(T) * kCount) Vec {
  T v[kCount];
};

// Elements of TIn per 16-byte load.
template <typename TIn>
constexpr int kVecOf = VectorWidth(sizeof(TIn));

// Reductions.

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

// Loads and stores. `site` is the kernel line a load or store comes from (the caller's, by
// default): the emulation's memory accounting groups a warp's accesses by it. nvcc drops it.

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

// One element i of p, of a float type chosen at run time.
__device__ __forceinline__ float LoadElement(const void* p, FloatType type, int64_t i,
                                             int site = __builtin_LINE()) {
  float v[1];
  LoadAny<1>(p, type, i, v, site);
  return v[0];
}

__device__ __forceinline__ void StoreElement(void* p, FloatType type, int64_t i, float value,
                                             int site = __builtin_LINE()) {
  const float v[1] = {value};
  StoreAny<1>(p, type, i, v, site);
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
                                         float recip, OutFormat format,
                                         int site = __builtin_LINE()) {
  Vec<uint8_t, kVec> q;
  if (format == OutFormat::kE4M3FN) {
#pragma unroll
    for (int k = 0; k < kVec; ++k) q.v[k] = QuantizeElement<OutFormat::kE4M3FN>(normed[k], recip);
  } else {
#pragma unroll
    for (int k = 0; k < kVec; ++k) q.v[k] = QuantizeElement<OutFormat::kE4M3FNUZ>(normed[k], recip);
  }
  StoreGlobal(reinterpret_cast<Vec<uint8_t, kVec>*>(y) + i, q, site);
}

// FP4 codes for vector i of a row of an FP4 group with scale s, at the row's y: kVec / 2
// bytes when packed (element 2k in the low nibble), else kVec (kVec even).
template <int kVec>
__device__ __forceinline__ void StoreFp4(uint8_t* y, int64_t i, const float (&normed)[kVec],
                                         const Fp4Scale& s, bool packed,
                                         int site = __builtin_LINE()) {
  static_assert(kVec % 2 == 0, "FP4 codes are stored in pairs");
  uint8_t codes[kVec];
#pragma unroll
  for (int k = 0; k < kVec; ++k) codes[k] = QuantizeFp4Element(normed[k], s);
  if (packed) {
    Vec<uint8_t, kVec / 2> q;
#pragma unroll
    for (int k = 0; k < kVec / 2; ++k) q.v[k] = PackFp4(codes[2 * k], codes[2 * k + 1]);
    StoreGlobal(reinterpret_cast<Vec<uint8_t, kVec / 2>*>(y) + i, q, site);
  } else {
    Vec<uint8_t, kVec> q;
#pragma unroll
    for (int k = 0; k < kVec; ++k) q.v[k] = codes[k];
    StoreGlobal(reinterpret_cast<Vec<uint8_t, kVec>*>(y) + i, q, site);
  }
}

// NVFP4's global scale (0 for every other format), read once per row.
__device__ __forceinline__ float GlobalScaleOf(const RmsNormFp8Args& a) {
  return a.global_scale != nullptr ? LoadGlobal(a.global_scale) : 0.0f;
}

// Scale `index` of `scales` in `type`: e8m0 as its exponent byte, NVFP4's e4m3 as its
// code.
__device__ __forceinline__ void StoreScaleAt(void* scales, FloatType type, int64_t index,
                                             float scale, int site) {
  if (type == FloatType::kE8M0 || type == FloatType::kE4M3) {
    const uint8_t code = type == FloatType::kE8M0 ? E8M0Code(scale) : E4M3ScaleCode(scale);
    StoreGlobal(static_cast<uint8_t*>(scales) + index, code, site);
    return;
  }
  const float value[1] = {scale};
  StoreAny<1>(scales, type, index, value, site);
}

// Scale `index` of the call ([rows, groups] row-major).
__device__ __forceinline__ void StoreScale(const RmsNormFp8Args& a, int64_t index, float scale,
                                           int site = __builtin_LINE()) {
  StoreScaleAt(a.scales, a.scale_type, index, scale, site);
}

// The training form's r of row `row` (SavedInverseRms); nothing for the plain forward.
__device__ __forceinline__ void StoreInverseRms(const RmsNormFp8Args& a, int64_t row, float sum_sq,
                                                float r, int site = __builtin_LINE()) {
  if (a.inverse_rms != nullptr) StoreGlobal(a.inverse_rms + row, SavedInverseRms(sum_sq, r), site);
}

// The amax beside a static scale of row `row` (SavedAmax), from its abs-max over the
// whole row; nothing without one.
__device__ __forceinline__ void StoreAmax(const RmsNormFp8Args& a, int64_t row, float sum_sq,
                                          uint32_t amax, int site = __builtin_LINE()) {
  if (a.amax != nullptr) StoreGlobal(a.amax + row, SavedAmax(sum_sq, amax), site);
}

// Row `row`'s own NVFP4 global scale (per-row global scales), PerRowGlobalScale of its
// abs-max.
__device__ __forceinline__ void StoreRowGlobalScale(const RmsNormFp8Args& a, int64_t row, float gs,
                                                    int site = __builtin_LINE()) {
  StoreGlobal(a.global_scales + row, gs, site);
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
// has none) and y (its first byte: packed FP4 rows take hidden / 2).
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
          static_cast<uint8_t*>(a.y) + YByte(a, offset)};
}

}  // namespace fp8norm
