// The per-element and per-row arithmetic of jax_fp8norm (docs/spec.md), written once
// and compiled by both the host compiler (CPU kernel) and nvcc (CUDA kernel), so the
// two paths cannot drift: float16 / bfloat16 / FP8 rounding, the inverse-RMS guard,
// the scale, the guarded reciprocal and the clamp.
//
// Everything here is plain integer and IEEE float32 arithmetic. It never touches a
// float32 subnormal on a path whose result depends on it, so it gives the same bits
// whether or not the caller flushes denormals (XLA's CPU threads do).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define FP8NORM_HD __host__ __device__ __forceinline__
#else
#define FP8NORM_HD inline
#endif

namespace fp8norm {

// Storage types of the 16-bit floats. Only their bits are used: the kernels convert to
// float32 on load and round back on store with the functions below.
struct F16 {
  uint16_t bits;
};
struct BF16 {
  uint16_t bits;
};

// Run-time tags for the float types a kernel does not specialise on.
enum class FloatType : int32_t { kF32 = 0, kF16 = 1, kBF16 = 2 };
enum class Fp8Format : int32_t { kE4M3FN = 0, kE4M3FNUZ = 1 };

FP8NORM_HD uint32_t BitsOf(float v) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(v);
#else
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  return u;
#endif
}

FP8NORM_HD float FloatOf(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
#endif
}

constexpr uint32_t kF32AbsMask = 0x7fffffffu;
constexpr uint32_t kF32Inf = 0x7f800000u;
constexpr uint32_t kF32QuietNan = 0x7fc00000u;

// Bit tests rather than std::isfinite / isnan: they stay right under fast-math flags.
FP8NORM_HD bool IsFinite(float v) { return (BitsOf(v) & kF32Inf) != kF32Inf; }
FP8NORM_HD bool IsNan(float v) { return (BitsOf(v) & kF32AbsMask) > kF32Inf; }

// ---------------------------------------------------------------------------------
// 16-bit floats <-> float32, round to nearest even.
// ---------------------------------------------------------------------------------

FP8NORM_HD float ToFloat(float v) { return v; }

FP8NORM_HD float ToFloat(BF16 v) { return FloatOf(uint32_t(v.bits) << 16); }

FP8NORM_HD float ToFloat(F16 v) {
  const uint32_t sign = uint32_t(v.bits & 0x8000u) << 16;
  const uint32_t exp_mant = uint32_t(v.bits & 0x7fffu) << 13;
  const uint32_t exp = exp_mant & 0x0f800000u;
  uint32_t out = exp_mant + ((127u - 15u) << 23);  // rebias a normal number
  if (exp == 0x0f800000u) {
    out += (128u - 16u) << 23;  // Inf / NaN: exponent all ones
  } else if (exp == 0) {
    // Subnormal: renormalise with a subtraction of normal float32 numbers, exact
    // and unaffected by denormal flushing.
    out = BitsOf(FloatOf(out + (1u << 23)) - FloatOf(113u << 23));
  }
  return FloatOf(out | sign);
}

FP8NORM_HD BF16 ToBF16(float v) {
  const uint32_t u = BitsOf(v);
  if ((u & kF32AbsMask) > kF32Inf) return BF16{uint16_t((u >> 16) | 0x40u)};
  return BF16{uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}

FP8NORM_HD F16 ToF16(float v) {
  uint32_t u = BitsOf(v);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  uint32_t out;
  if (u >= (127u + 16u) << 23) {  // overflows float16 (or Inf / NaN)
    out = u > kF32Inf ? 0x7e00u : 0x7c00u;
  } else if (u < (113u << 23)) {  // float16 subnormal or zero
    // Adding a float whose unit in the last place is float16's smallest subnormal
    // makes the FPU round to nearest even at that position.
    const uint32_t magic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
    out = BitsOf(FloatOf(u) + FloatOf(magic)) - magic;
  } else {
    const uint32_t mant_odd = (u >> 13) & 1u;
    u += ((15u - 127u) << 23) + 0xfffu + mant_odd;
    out = u >> 13;
  }
  return F16{uint16_t(out | (sign >> 16))};
}

template <typename T>
FP8NORM_HD T FromFloat(float v);
template <>
FP8NORM_HD float FromFloat<float>(float v) {
  return v;
}
template <>
FP8NORM_HD BF16 FromFloat<BF16>(float v) {
  return ToBF16(v);
}
template <>
FP8NORM_HD F16 FromFloat<F16>(float v) {
  return ToF16(v);
}

// Round a float32 to a float type chosen at run time and back: S(v) and T(v) of the spec.
FP8NORM_HD float RoundTo(FloatType type, float v) {
  switch (type) {
    case FloatType::kF16:
      return ToFloat(ToF16(v));
    case FloatType::kBF16:
      return ToFloat(ToBF16(v));
    default:
      return v;
  }
}

// ---------------------------------------------------------------------------------
// float32 -> FP8 E4M3, round to nearest even.
// e4m3fn: bias 7, no Inf, NaN = S.1111.111, largest 448.
// e4m3fnuz: bias 8, no Inf, no -0, NaN = 0x80, largest 240.
// Values past the largest finite number become NaN, as in ml_dtypes; the kernels clamp
// first, so only a NaN input produces a NaN code.
// ---------------------------------------------------------------------------------

template <Fp8Format kFormat>
struct Fp8Traits;
template <>
struct Fp8Traits<Fp8Format::kE4M3FN> {
  static constexpr uint32_t kBias = 7;
  static constexpr uint32_t kMaxCode = 0x7e;
  static constexpr uint32_t kNanCode = 0x7f;  // the sign bit is kept
  static constexpr float kMax = 448.0f;
};
template <>
struct Fp8Traits<Fp8Format::kE4M3FNUZ> {
  static constexpr uint32_t kBias = 8;
  static constexpr uint32_t kMaxCode = 0x7f;
  static constexpr uint32_t kNanCode = 0x80;
  static constexpr float kMax = 240.0f;
};

FP8NORM_HD float Fp8Max(Fp8Format format) {
  return format == Fp8Format::kE4M3FN ? Fp8Traits<Fp8Format::kE4M3FN>::kMax
                                      : Fp8Traits<Fp8Format::kE4M3FNUZ>::kMax;
}

template <Fp8Format kFormat>
FP8NORM_HD uint8_t ToFp8(float v) {
  using Tr = Fp8Traits<kFormat>;
  uint32_t u = BitsOf(v);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  uint32_t code;
  if (u < (127u + 1u - Tr::kBias) << 23) {
    // Below the smallest normal: round at the subnormal step 2^(-bias-2) by adding a
    // float whose unit in the last place is that step. Code 8 (the smallest normal)
    // comes out right when rounding carries.
    const uint32_t magic = (127u + 21u - Tr::kBias) << 23;
    code = BitsOf(FloatOf(u) + FloatOf(magic)) - magic;
  } else {
    const uint32_t mant_odd = (u >> 20) & 1u;
    code = (u + ((Tr::kBias - 127u) << 23) + 0x7ffffu + mant_odd) >> 20;
  }
  const bool nan = u > kF32Inf || code > Tr::kMaxCode;
  if (kFormat == Fp8Format::kE4M3FNUZ) {
    if (nan) return uint8_t(Tr::kNanCode);
    return uint8_t(code == 0 ? 0 : (code | (sign >> 24)));
  }
  return uint8_t((nan ? Tr::kNanCode : code) | (sign >> 24));
}

// ---------------------------------------------------------------------------------
// Row arithmetic: steps 2, 5, 6 and 7 of the spec.
// ---------------------------------------------------------------------------------

// Constants after the rounding the spec asks for (done once, in Python):
// eps and weight_offset rounded through the input dtype, scale_ub through the scale dtype.
struct RowConstants {
  float eps;            // f32(T(eps))
  float weight_offset;  // f32(T(weight_offset))
  float scale_ub;       // f32(S(scale_ub)), +inf when unbounded
};

// 1 / sqrt(mean_sq + eps), 0 when the denominator is exactly 0 (an all-zero row with an
// eps that rounded to zero).
FP8NORM_HD float InverseRms(float sum_sq, int64_t hidden, float eps) {
  const float denom = sum_sq / float(hidden) + eps;
  return denom == 0.0f ? 0.0f : 1.0f / sqrtf(denom);
}

// |v| as ordered bits: for non-negative floats the integer order is the float order and
// every NaN sorts above +Inf, so an unsigned max is a NaN-propagating abs-max that
// vectorises and reduces with integer instructions.
FP8NORM_HD uint32_t AbsBits(float v) { return BitsOf(v) & kF32AbsMask; }

struct RowScale {
  float scale;  // already rounded to the scale dtype
  float recip;  // multiplier applied before the clamp; NaN for a non-finite row
};

FP8NORM_HD float NanMin(float a, float b) { return (IsNan(a) || a < b) ? a : b; }

FP8NORM_HD RowScale ComputeRowScale(float sum_sq, uint32_t amax_bits, Fp8Format format,
                                    FloatType scale_type, const RowConstants& c) {
  if (!IsFinite(sum_sq)) {
    // A NaN or Inf in the row, or a sum of squares past float32: the whole row is NaN.
    const float nan = FloatOf(kF32QuietNan);
    return RowScale{nan, nan};
  }
  const float amax = RoundTo(scale_type, FloatOf(amax_bits));
  const float bounded = NanMin(amax, c.scale_ub);
  const float scale = RoundTo(scale_type, bounded / Fp8Max(format));
  const float inverse = 1.0f / scale;
  const float recip = (scale == 0.0f || !IsFinite(inverse)) ? 0.0f : inverse;
  return RowScale{scale, recip};
}

// The clamp keeps NaN (both comparisons are false) so that a NaN never becomes +-max.
FP8NORM_HD float ClampToFp8Range(float v, float fp8_max) {
  return v > fp8_max ? fp8_max : (v < -fp8_max ? -fp8_max : v);
}

template <Fp8Format kFormat>
FP8NORM_HD uint8_t QuantizeElement(float normed, float recip) {
  return ToFp8<kFormat>(ClampToFp8Range(normed * recip, Fp8Traits<kFormat>::kMax));
}

}  // namespace fp8norm
