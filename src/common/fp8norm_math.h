// The per-element and per-row arithmetic of jax_fp8norm (docs/spec.md), written once
// and compiled by both the host compiler (CPU kernel) and nvcc (CUDA kernel), so the
// two paths cannot drift: float16 / bfloat16 / FP8 rounding, the inverse-RMS guard,
// the scale, the guarded reciprocal and the clamp. The backward's is backward_math.h.
//
// Everything here is plain integer and IEEE float32 arithmetic. It never touches a
// float32 subnormal on a path whose result depends on it, so it gives the same bits
// whether or not the caller flushes denormals (XLA's CPU threads do).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

// Forced inline on the host too: the CPU kernel's loops over a row's groups vectorise
// only with the scale functions inlined into them (GCC otherwise keeps some as calls).
#if defined(__CUDACC__)
#define FP8NORM_HD __host__ __device__ __forceinline__
#elif defined(__GNUC__) || defined(__clang__)
#define FP8NORM_HD inline __attribute__((always_inline))
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

// Run-time tags for the float types a kernel does not specialise on. kE8M0 (MXFP8's and
// MXFP4's power-of-two scale: the float32 exponent byte, 0xFF for NaN) and kE4M3 (NVFP4's
// block scale, float8_e4m3fn) are scale types only.
enum class FloatType : int32_t { kF32 = 0, kF16 = 1, kBF16 = 2, kE8M0 = 3, kE4M3 = 4 };

FP8NORM_HD size_t FloatTypeBytes(FloatType type) {
  return type == FloatType::kF32 ? 4
                                 : (type == FloatType::kE8M0 || type == FloatType::kE4M3 ? 1 : 2);
}
// The formats of y: FP8 (one code per byte) or FP4 E2M1 (float4_e2m1fn, always
// block-scaled: NVFP4 with kE4M3 scales, MXFP4 with kE8M0 ones).
enum class OutFormat : int32_t { kE4M3FN = 0, kE4M3FNUZ = 1, kE2M1 = 2 };

FP8NORM_HD uint32_t BitsOf(float v) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(v);
#elif defined(__GNUC__) || defined(__clang__)
  return __builtin_bit_cast(uint32_t, v);  // a register move the vectoriser can see through
#else
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  return u;
#endif
}

FP8NORM_HD float FloatOf(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#elif defined(__GNUC__) || defined(__clang__)
  return __builtin_bit_cast(float, u);
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

// cond ? a : b as mask arithmetic on 32-bit lanes: GCC vectorises it where it narrows a
// select feeding a byte store into mask conversions that SSE and AVX lack.
FP8NORM_HD uint32_t Select(bool cond, uint32_t a, uint32_t b) {
  return b ^ ((a ^ b) & (0u - uint32_t(cond)));
}

// ---------------------------------------------------------------------------------
// 16-bit floats <-> float32, round to nearest even.
// ---------------------------------------------------------------------------------

FP8NORM_HD float ToFloat(float v) { return v; }

FP8NORM_HD float ToFloat(BF16 v) { return FloatOf(uint32_t(v.bits) << 16); }

// The conversions below compute every case and select, without branches, so that the
// CPU compiler vectorises them.

FP8NORM_HD float ToFloat(F16 v) {
  const uint32_t sign = uint32_t(v.bits & 0x8000u) << 16;
  const uint32_t exp_mant = uint32_t(v.bits & 0x7fffu) << 13;
  const uint32_t exp = exp_mant & 0x0f800000u;
  const uint32_t normal = exp_mant + ((127u - 15u) << 23);  // rebias
  const uint32_t inf_nan = normal + ((128u - 16u) << 23);   // exponent all ones
  // Subnormal: renormalise with a subtraction of normal float32 numbers, exact and
  // unaffected by denormal flushing.
  const uint32_t subnormal = BitsOf(FloatOf(normal + (1u << 23)) - FloatOf(113u << 23));
  const uint32_t out = exp == 0x0f800000u ? inf_nan : (exp == 0 ? subnormal : normal);
  return FloatOf(out | sign);
}

FP8NORM_HD BF16 ToBF16(float v) {
  const uint32_t u = BitsOf(v);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (u >> 16) | 0x40u;
  return BF16{uint16_t((u & kF32AbsMask) > kF32Inf ? quiet_nan : rounded)};
}

FP8NORM_HD F16 ToF16(float v) {
  uint32_t u = BitsOf(v);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  // float16 subnormal or zero: adding a float whose unit in the last place is float16's
  // smallest subnormal makes the FPU round to nearest even at that position.
  const uint32_t magic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
  const uint32_t subnormal = BitsOf(FloatOf(u) + FloatOf(magic)) - magic;
  const uint32_t normal = (u + ((15u - 127u) << 23) + 0xfffu + ((u >> 13) & 1u)) >> 13;
  uint32_t out = u < (113u << 23) ? subnormal : normal;
  // Past float16's range (or Inf / NaN).
  out = u >= ((127u + 16u) << 23) ? (u > kF32Inf ? 0x7e00u : 0x7c00u) : out;
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

// The e8m0 byte of a power-of-two scale (or NaN): its float32 exponent field, read from
// the bits, so that 2^-127 (a float32 subnormal, byte 0) survives denormal flushing.
FP8NORM_HD uint8_t E8M0Code(float power_of_two) {
  return uint8_t((BitsOf(power_of_two) >> 23) & 0xffu);
}

// The float8_e4m3fn byte of an NVFP4 scale (a value it holds exactly, or NaN: 0x7F).
FP8NORM_HD uint8_t E4M3ScaleCode(float scale);

// Stores v at p[i], p holding elements of a float type chosen at run time.
FP8NORM_HD void StoreAs(FloatType type, void* p, int64_t i, float v) {
  switch (type) {
    case FloatType::kF16:
      static_cast<F16*>(p)[i] = ToF16(v);
      break;
    case FloatType::kBF16:
      static_cast<BF16*>(p)[i] = ToBF16(v);
      break;
    case FloatType::kE8M0:
      static_cast<uint8_t*>(p)[i] = E8M0Code(v);
      break;
    case FloatType::kE4M3:
      static_cast<uint8_t*>(p)[i] = E4M3ScaleCode(v);
      break;
    default:
      static_cast<float*>(p)[i] = v;
  }
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
// ---------------------------------------------------------------------------------

template <OutFormat kFormat>
struct Fp8Traits;
template <>
struct Fp8Traits<OutFormat::kE4M3FN> {
  static constexpr uint32_t kBias = 7;
  static constexpr uint32_t kMaxCode = 0x7e;
  static constexpr uint32_t kNanCode = 0x7f;
  static constexpr float kMax = 448.0f;
  static constexpr uint32_t kMaxBits = 0x43e00000u;  // bits of kMax
};
template <>
struct Fp8Traits<OutFormat::kE4M3FNUZ> {
  static constexpr uint32_t kBias = 8;
  static constexpr uint32_t kMaxCode = 0x7f;
  static constexpr uint32_t kNanCode = 0x80;
  static constexpr float kMax = 240.0f;
  static constexpr uint32_t kMaxBits = 0x43700000u;
};

constexpr float kFp4Max = 6.0f;

// The largest finite value of y's format: FP8_MAX, or FP4_MAX = 6.
FP8NORM_HD float OutMax(OutFormat format) {
  return format == OutFormat::kE4M3FN     ? Fp8Traits<OutFormat::kE4M3FN>::kMax
         : format == OutFormat::kE4M3FNUZ ? Fp8Traits<OutFormat::kE4M3FNUZ>::kMax
                                          : kFp4Max;
}

// The FP8 code of v. kSaturate: magnitudes past the largest finite value (Inf included)
// become it, with their sign (the kernels' clamp); otherwise they become NaN, as in
// ml_dtypes. NaN stays NaN either way.
//
// One path for normal and subnormal results: with E the float32 exponent of |v|, raised
// to FP8's smallest normal exponent, adding C = E * 2^20 puts the unit in the last place
// at FP8's step for that binade, so the FPU's round to nearest even does the rounding;
// bits(|v| + C) - bits(C) counts steps, a carry into the next binade included. No branch
// and no float32 subnormal (those round to 0 either way), so it vectorises and gives the
// same bits with or without denormal flushing.
template <OutFormat kFormat, bool kSaturate>
FP8NORM_HD uint8_t Fp8Code(float v) {
  using Tr = Fp8Traits<kFormat>;
  constexpr uint32_t kMinNormalExponent = (127u + 1u - Tr::kBias) << 23;
  // Past the range: the largest finite value when saturating, else 2^15, whose code is
  // past kMaxCode while C stays a finite float.
  constexpr uint32_t kCap = kSaturate ? Tr::kMaxBits : (127u + 15u) << 23;
  const uint32_t u = BitsOf(v);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t magnitude = u & kF32AbsMask;
  const uint32_t capped = magnitude < kCap ? magnitude : kCap;
  const uint32_t exponent = capped & kF32Inf;
  const uint32_t e = exponent > kMinNormalExponent ? exponent : kMinNormalExponent;
  const uint32_t c = e + (20u << 23);
  const uint32_t steps = BitsOf(FloatOf(capped) + FloatOf(c)) - c;
  const uint32_t code = steps + (e >> 20) - ((127u + 1u - Tr::kBias) << 3);
  // Signed comparisons: both sides are below 2^31, and SSE / AVX2 compare only signed.
  const bool nan = (int32_t(magnitude) > int32_t(kF32Inf)) |
                   (!kSaturate && int32_t(code) > int32_t(Tr::kMaxCode));
  if (kFormat == OutFormat::kE4M3FNUZ) {
    return uint8_t(Select(nan, Tr::kNanCode, Select(code == 0, 0u, code | sign)));
  }
  // Saturating (the kernels): a NaN's sign depends on the order a compiler gave the
  // operands of the multiply that made it, so the kernels write the one positive NaN
  // code, as the reference does. Otherwise the sign is kept, as in ml_dtypes.
  return uint8_t(Select(nan, Tr::kNanCode | (kSaturate ? 0u : sign), code | sign));
}

template <OutFormat kFormat>
FP8NORM_HD uint8_t ToFp8(float v) {
  return Fp8Code<kFormat, false>(v);
}

FP8NORM_HD uint8_t E4M3ScaleCode(float scale) { return Fp8Code<OutFormat::kE4M3FN, true>(scale); }

// The float32 value of a float8_e4m3fn code: NVFP4's scale as the element division takes it.
FP8NORM_HD float E4M3FnValue(uint8_t code) {
  const uint32_t exponent = (code >> 3) & 0xfu;
  const uint32_t mantissa = code & 0x7u;
  // A subnormal code, mantissa * 2^-9: a product of normal floats, exact.
  const uint32_t subnormal = BitsOf(float(mantissa) * FloatOf((127u - 9u) << 23));
  const uint32_t normal = ((exponent + 127u - 7u) << 23) | (mantissa << 20);
  const uint32_t magnitude =
      (code & 0x7fu) == 0x7fu ? kF32QuietNan : (exponent == 0 ? subnormal : normal);
  return FloatOf(magnitude | (uint32_t(code & 0x80u) << 24));
}

// ---------------------------------------------------------------------------------
// float32 -> FP4 E2M1 (float4_e2m1fn), round to nearest even: bias 1, one mantissa bit,
// no Inf, no NaN; magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; the sign is bit 3.
// ---------------------------------------------------------------------------------

constexpr uint32_t kFp4MaxBits = 0x40c00000u;  // bits of kFp4Max

// The E2M1 code of v (in the low nibble). Magnitudes past 6, Inf included, saturate to
// +-6: the clamp of the spec, and what ml_dtypes' conversion does too. The same
// construction as Fp8Code: C = max(E, 2^0) * 2^22 puts the unit in the last place at
// E2M1's step for v's binade. A NaN, which the kernels never convert (a group holding one
// gets zero codes), becomes what ml_dtypes makes of it: a zero of the opposite sign.
FP8NORM_HD uint8_t Fp4Code(float v) {
  constexpr uint32_t kMinNormalExponent = 127u << 23;
  const uint32_t u = BitsOf(v);
  const uint32_t sign = (u >> 28) & 0x8u;
  const uint32_t magnitude = u & kF32AbsMask;
  const uint32_t capped = magnitude < kFp4MaxBits ? magnitude : kFp4MaxBits;
  const uint32_t exponent = capped & kF32Inf;
  const uint32_t e = exponent > kMinNormalExponent ? exponent : kMinNormalExponent;
  const uint32_t c = e + (22u << 23);
  const uint32_t steps = BitsOf(FloatOf(capped) + FloatOf(c)) - c;
  const uint32_t code = steps + (e >> 22) - (127u << 1);
  const bool nan = int32_t(magnitude) > int32_t(kF32Inf);
  return uint8_t(Select(nan, sign ^ 0x8u, code | sign));
}

// Two FP4 codes in one byte, element 2k in the low nibble: the packed layout of
// float4_e2m1fn buffers (docs/spec.md, "FP4 outputs").
FP8NORM_HD uint8_t PackFp4(uint8_t even, uint8_t odd) { return uint8_t(even | (odd << 4)); }

// ---------------------------------------------------------------------------------
// Row arithmetic: steps 2, 5, 6 and 7 of the spec.
// ---------------------------------------------------------------------------------

// Constants after the rounding the spec asks for (done once, in Python):
// eps and weight_offset rounded through the input dtype, scale_ub through the scale dtype.
struct RowConstants {
  float eps;            // f32(T(eps))
  float weight_offset;  // f32(T(weight_offset))
  // f32(S(scale_ub)) for nearest-rounded scales, f32(scale_ub) for power-of-two ones;
  // +inf when unbounded.
  float scale_ub;
  bool power_of_two;  // scales rounded up to a power of two (always for e8m0)
};

// The sum of squares of a row, carried as an unevaluated pair hi + lo: every square's
// rounding error (exact, from an FMA or a Dekker split) and every addition's (TwoSum) is
// kept in lo. The total is therefore the correctly rounded float32 sum in all but
// vanishingly rare near-tie cases, whatever the order of summation: the CPU lanes, the
// GPU block tree and the jnp reference agree bit for bit, and so do their scales.
struct SumOfSquares {
  float hi;
  float lo;
};

// s + e == a + b exactly (Knuth's TwoSum; needs no ordering of |a| and |b|).
FP8NORM_HD void TwoSum(float a, float b, float& s, float& e) {
  s = a + b;
  const float b_virtual = s - a;
  e = (a - (s - b_virtual)) + (b - b_virtual);
}

// p + e == v * v exactly (while v * v neither overflows nor underflows). kUseFma: with a
// hardware FMA (the GPU; the CPU kernel built for AVX2 + FMA), else Dekker's split of v
// into 12-bit halves whose products are exact. Both give the same p and e; a square
// below 2^-126 (|v| < 2^-63) counts as zero (docs/spec.md), as the FMA gives it with
// denormals flushed. Dekker's halves need saying so: just below 2^-63, `high` rounds up
// to 2^-63 and `high * high` is 2^-126, a normal number that would carry the flushed
// square into e.
template <bool kUseFma>
FP8NORM_HD void ExactSquare(float v, float& p, float& e) {
  p = v * v;
  if constexpr (kUseFma) {
    e = fmaf(v, v, -p);
  } else {
    const float c = 4097.0f * v;
    const float high = c - (c - v);
    const float low = v - high;
    const float error = ((high * high - p) + 2.0f * high * low) + low * low;
    const bool counted = (BitsOf(v) & kF32AbsMask) >= (64u << 23);  // |v| >= 2^-63
    p = counted ? p : 0.0f;
    e = counted ? error : 0.0f;
  }
}

// Adds v * v to the pair hi + lo. Takes the two floats rather than a SumOfSquares so that
// the CPU kernel can keep its lanes' hi and lo in separate arrays (one vector each).
template <bool kUseFma>
FP8NORM_HD void AddSquare(float& hi, float& lo, float v) {
  float p, square_error, s, sum_error;
  ExactSquare<kUseFma>(v, p, square_error);
  TwoSum(hi, p, s, sum_error);
  hi = s;
  lo += sum_error + square_error;
}

FP8NORM_HD SumOfSquares Combine(SumOfSquares a, SumOfSquares b) {
  float s, e;
  TwoSum(a.hi, b.hi, s, e);
  return SumOfSquares{s, (a.lo + b.lo) + e};
}

// Non-finite when the row holds a NaN or Inf or its sum overflows float32.
FP8NORM_HD float Total(SumOfSquares acc) { return acc.hi + acc.lo; }

// 1 / sqrt(mean_sq + eps), 0 when the denominator is exactly 0 (an all-zero row with an
// eps that rounded to zero). A row of no elements has a mean square of 0.
FP8NORM_HD float InverseRms(float sum_sq, int64_t hidden, float eps) {
  const float denom = (hidden > 0 ? sum_sq / float(hidden) : 0.0f) + eps;
  return denom == 0.0f ? 0.0f : 1.0f / sqrtf(denom);
}

// |v| as ordered bits: for non-negative floats the integer order is the float order and
// every NaN sorts above +Inf, so an unsigned max is a NaN-propagating abs-max that
// vectorises and reduces with integer instructions.
FP8NORM_HD uint32_t AbsBits(float v) { return BitsOf(v) & kF32AbsMask; }

// Step 5 of the spec, n = (h * r) * (gamma + weight_offset), in the order it fixes: every
// kernel, CPU and CUDA, normalises through these two (the CPU's AVX2 lanes do the same two
// products, gamma_plus_offset computed once per call).
FP8NORM_HD float GammaPlusOffset(float gamma, float weight_offset) { return gamma + weight_offset; }
FP8NORM_HD float Normalize(float h, float r, float gamma_plus_offset) {
  return (h * r) * gamma_plus_offset;
}

// Every NaN the backward and the training form's r write is the one quiet NaN: which NaN
// an IEEE operation returns (its sign, its payload) depends on the order of its operands,
// which vectorised and scalar code, and compilers, choose differently.
FP8NORM_HD float CanonicalNan(float v) {
  return FloatOf(Select(IsNan(v), kF32QuietNan, BitsOf(v)));
}

// The r the training form saves for a row: its r, the one quiet NaN for a row whose sum
// of squares is not finite (a NaN or Inf in it, or an overflow), whose outputs are NaN.
FP8NORM_HD float SavedInverseRms(float sum_sq, float r) {
  return IsFinite(sum_sq) ? CanonicalNan(r) : FloatOf(kF32QuietNan);
}

// The amax a static scale's call returns for a row (return_amax): max_j |n_j| from the
// abs-max's ordered bits (AbsBits), the one quiet NaN where an n is NaN or the row's sum
// of squares is not finite. Such a row's y is NaN; its n, made with r = 0, would give an
// overflowing row an amax of 0, which a delayed-scaling history must not take for a
// small row.
FP8NORM_HD float SavedAmax(float sum_sq, uint32_t amax_bits) {
  return IsFinite(sum_sq) ? CanonicalNan(FloatOf(amax_bits)) : FloatOf(kF32QuietNan);
}

struct RowScale {
  float scale;  // already rounded to the scale dtype
  float recip;  // multiplier applied before the clamp; NaN for a non-finite row
};

FP8NORM_HD float NanMin(float a, float b) { return (IsNan(a) || a < b) ? a : b; }

constexpr uint32_t kF32MinNormalBits = 0x00800000u;

// A positive, normal, finite float32 (a subnormal one counts as flushed to 0).
FP8NORM_HD bool IsPositiveNormal(float v) {
  const uint32_t bits = BitsOf(v);
  return bits >= kF32MinNormalBits && bits < kF32Inf;
}

// The biased float32 exponent of P(q), the smallest power of two >= q = a / fp8_max, at
// least `floor`. A q below 2^-126 (a float32 subnormal, flushed to 0 by GPUs and XLA's CPU
// threads) is decided from a instead, exactly: 2^-126 if a > fp8_max * 2^-127, else 2^-127
// (exponent 0). So the result is the same with and without denormal flushing; a q that
// rounds up to 2^-126 gives 2^-126 either way.
FP8NORM_HD uint32_t PowerOfTwoExponent(float a, float fp8_max, uint32_t floor) {
  const uint32_t q = BitsOf(a / fp8_max);
  uint32_t exponent = (q >> 23) & 0xffu;
  if (exponent == 0) {
    // fp8_max * 2^-127 in two normal steps: a subnormal 2^-127 operand reads as 0 under
    // denormal flushing.
    exponent = a > (fp8_max * FloatOf(63u << 23)) * FloatOf(64u << 23) ? 1u : 0u;
  } else if (exponent != 0xffu) {
    exponent += (q & 0x007fffffu) != 0 ? 1u : 0u;
  }
  return exponent > floor ? exponent : floor;
}

// The multiplier of a power-of-two scale of biased exponent e (e8m0's byte): 1 / 2^(e - 127)
// = 2^(127 - e), exactly: biased exponent 254 - e while normal. Past that (a scale of 2^127
// or Inf, from an infinite abs-max) it is 0.
FP8NORM_HD float PowerOfTwoReciprocal(uint32_t e) {
  return e <= 253u ? FloatOf((254u - e) << 23) : 0.0f;
}

// Steps 5 and 6 of the spec with power-of-two scales, for a finite row: the scale of an
// abs-max (ordered bits) bounded by ub = f32(scale_ub).
FP8NORM_HD RowScale PowerOfTwoScale(uint32_t amax_bits, OutFormat format, FloatType scale_type,
                                    float ub) {
  // The floor: e8m0's smallest value 2^-127 (byte 0), else float32's smallest normal.
  const uint32_t floor = scale_type == FloatType::kE8M0 ? 0u : 1u;
  const uint32_t e = PowerOfTwoExponent(NanMin(FloatOf(amax_bits), ub), OutMax(format), floor);
  const float scale = e == 0 ? FloatOf(0x00400000u) : FloatOf(e << 23);
  return RowScale{scale, PowerOfTwoReciprocal(e)};
}

// Steps 5 and 6 with nearest-rounded scales, for a finite row; ub = f32(S(scale_ub)).
FP8NORM_HD RowScale NearestScale(uint32_t amax_bits, OutFormat format, FloatType scale_type,
                                 float ub) {
  const float amax = RoundTo(scale_type, FloatOf(amax_bits));
  const float bounded = NanMin(amax, ub);
  const float scale = RoundTo(scale_type, bounded / OutMax(format));
  const float inverse = 1.0f / scale;
  const float recip = (scale == 0.0f || !IsFinite(inverse)) ? 0.0f : inverse;
  return RowScale{scale, recip};
}

// The scale of a row or group from its row's sum of squares and its own abs-max (steps
// 5 and 6 of the spec, nearest-rounded or power-of-two).
FP8NORM_HD RowScale ComputeScale(float sum_sq, uint32_t amax_bits, OutFormat format,
                                 FloatType scale_type, const RowConstants& c) {
  if (!IsFinite(sum_sq)) {
    // A NaN or Inf in the row, or a sum of squares past float32: the whole row is NaN.
    const float nan = FloatOf(kF32QuietNan);
    return RowScale{nan, nan};
  }
  return c.power_of_two ? PowerOfTwoScale(amax_bits, format, scale_type, c.scale_ub)
                        : NearestScale(amax_bits, format, scale_type, c.scale_ub);
}

// A calibrated scale `static_scale` (float32, rounded here to the scale dtype) for a row
// whose sum of squares is sum_sq. A scale that is not a positive normal finite float32
// (a subnormal one counts as flushed to 0) makes every y NaN; a reciprocal that would be
// subnormal (a scale above 2^126) is flushed to 0 here, on every platform alike. A
// non-finite row gives NaN y and keeps the scale.
FP8NORM_HD RowScale StaticScale(float sum_sq, float static_scale, FloatType scale_type) {
  const float scale = RoundTo(scale_type, static_scale);
  const float nan = FloatOf(kF32QuietNan);
  if (!IsPositiveNormal(scale) || !IsFinite(sum_sq)) {
    return RowScale{scale, nan};
  }
  const float inverse = 1.0f / scale;
  return RowScale{scale, BitsOf(inverse) >= kF32MinNormalBits ? inverse : 0.0f};
}

// FP8(clamp(normed * recip, +-FP8_MAX)): the clamp is the saturation of Fp8Code.
template <OutFormat kFormat>
FP8NORM_HD uint8_t QuantizeElement(float normed, float recip) {
  return Fp8Code<kFormat, true>(normed * recip);
}

// ---------------------------------------------------------------------------------
// FP4 groups (the spec's "FP4 outputs"): a group's scale and its elements' codes.
// ---------------------------------------------------------------------------------

// How the elements of one FP4 group become codes. NVFP4: E2M1((n / global_scale) / scale),
// two float32 divisions, as jax.nn's NVFP4 quantiser makes them. MXFP4: E2M1(n * recip),
// recip = 1 / scale exactly (a power of two). zero: every code of the group is 0 (its
// scale is 0 or NaN).
struct Fp4Scale {
  float scale;  // as stored: e4m3 (NVFP4) or a power of two (MXFP4); NaN for a non-finite group
  float recip;  // MXFP4's multiplier
  float global_scale;  // NVFP4's first divisor
  bool nvfp4;
  bool zero;
};

// NVFP4's scale of a group of normalised values with abs-max amax_bits (ordered bits), in a
// row with sum of squares sum_sq, under the global decode scale gs: e4m3(min(amax / gs / 6,
// 448)). max_j |n_j / gs| is (max_j |n_j|) / gs, since a correctly rounded division by a
// positive number is monotonic. NaN, with zero codes, for a non-finite row, a group holding
// NaN or Inf, or a global scale that is not a positive normal float32 (a subnormal one
// counts as flushed to 0); 0, with zero codes, for a group whose scale rounds to 0. A group
// whose values overflow when divided by gs takes the formula: scale 448, codes +-6.
// Without branches, so that the CPU kernel's loop over a row's groups vectorises.
FP8NORM_HD Fp4Scale Nvfp4Scale(float sum_sq, uint32_t amax_bits, float global_scale) {
  const float amax = FloatOf(amax_bits) / global_scale;
  const bool finite =
      IsFinite(sum_sq) && IsPositiveNormal(global_scale) && IsFinite(FloatOf(amax_bits));
  // The saturating conversion is the clamp at 448.
  const float scale = E4M3FnValue(E4M3ScaleCode(amax / kFp4Max));
  const float stored = FloatOf(Select(finite, BitsOf(scale), kF32QuietNan));
  return Fp4Scale{stored, 0.0f, global_scale, true, !finite || BitsOf(scale) == 0};
}

// NVFP4's global scale of one row (global_scale="per_row"), or of one column of the
// columnwise output: max(amax / (448 * 6), 2^-126), a float32 division, from the abs-max of
// the row's n (ordered bits), which maps the row's largest magnitude onto the top of the
// format's range (the largest e4m3 scale times the largest e2m1 code). The one quiet NaN
// for a row that is not finite (sum_sq not finite) or an abs-max that is not; then every
// scale of the row is NaN and its codes 0 (Nvfp4Scale). A quotient below the floor, flushed
// to zero or not, takes the floor: the result is the same with and without flushing.
constexpr float kPerRowGlobalDivisor = 448.0f * kFp4Max;
FP8NORM_HD float PerRowGlobalScale(float sum_sq, uint32_t amax_bits) {
  const float quotient = FloatOf(amax_bits) / kPerRowGlobalDivisor;
  const uint32_t gs = BitsOf(quotient) < kF32MinNormalBits ? kF32MinNormalBits : BitsOf(quotient);
  const bool finite = IsFinite(sum_sq) && IsFinite(FloatOf(amax_bits));
  return FloatOf(Select(finite, gs, kF32QuietNan));
}

// NVFP4's global decode scale of a weight or gradient of abs-max bits amax_bits: amax /
// 2688, at least 2^-126; 1 for a zero (or subnormal: flushed) amax; NaN for NaN, Inf for
// Inf (jax_fp8norm.quantize.nvfp4_global_scale).
FP8NORM_HD float Nvfp4GlobalScale(uint32_t amax_bits) {
  if (amax_bits < kF32MinNormalBits) return 1.0f;
  if (amax_bits > kF32Inf) return FloatOf(kF32QuietNan);
  const float scale = FloatOf(amax_bits) / (Fp8Traits<OutFormat::kE4M3FN>::kMax * kFp4Max);
  return BitsOf(scale) < kF32MinNormalBits ? FloatOf(kF32MinNormalBits) : scale;
}

// MXFP4's scale: the power-of-two rule with FP4_MAX, bounded by ub = f32(scale_ub). NaN,
// with zero codes, for a non-finite row or a group holding NaN or Inf (before the bound).
FP8NORM_HD Fp4Scale Mxfp4Scale(float sum_sq, uint32_t amax_bits, float ub) {
  if (!IsFinite(sum_sq) || !IsFinite(FloatOf(amax_bits))) {
    return Fp4Scale{FloatOf(kF32QuietNan), 0.0f, 0.0f, false, true};
  }
  const RowScale s = PowerOfTwoScale(amax_bits, OutFormat::kE2M1, FloatType::kE8M0, ub);
  return Fp4Scale{s.scale, s.recip, 0.0f, false, false};
}

// The FP4 code of a normalised element of a group (the clamp is Fp4Code's saturation).
FP8NORM_HD uint8_t QuantizeFp4Element(float normed, const Fp4Scale& s) {
  const float v = s.nvfp4 ? (normed / s.global_scale) / s.scale : normed * s.recip;
  return s.zero ? uint8_t{0} : Fp4Code(v);
}

}  // namespace fp8norm
