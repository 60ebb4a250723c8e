// Eight float32 lanes in AVX2 registers: the vector forms of the math header's loads,
// stores, exact square and FP8 / FP4 rounding, for the AVX2 row loops of cpu_rows.inc. Each one
// is the scalar definition of fp8norm_math.h applied lane by lane, with the same IEEE
// operations in the same order, so they give the same bits; tests/cpu/rounding_check.cc
// (tools/checks/cpu_check.sh) holds them to the scalar ones.
//
// x86-64 only. With GCC these functions are compiled for AVX2 + FMA + F16C whatever the
// build's flags (the pragma below), so that a baseline build can hold an AVX2 variant
// chosen at run time; they must only be called once the CPU is known to have them.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "fp8norm_math.h"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

namespace fp8norm {
namespace {  // internal linkage: these are compiled for AVX2 whatever the build's flags
namespace avx2_lanes {

inline __m256i Splat(uint32_t v) { return _mm256_set1_epi32(static_cast<int32_t>(v)); }

// ---------------------------------------------------------------------------------
// Loads: 8 elements as float32, exactly (ToFloat).
// ---------------------------------------------------------------------------------

inline __m256 Load(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 Load(const BF16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// The hardware conversion, exact like ToFloat(F16); a signalling NaN comes back quiet,
// and a NaN's payload never leaves the row (its outputs are the fixed NaN codes).
inline __m256 Load(const F16* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// ---------------------------------------------------------------------------------
// Stores: 8 float32 lanes rounded to T (FromFloat<T>).
// ---------------------------------------------------------------------------------

inline __m256i IsNanMask(__m256i bits) {
  return _mm256_cmpgt_epi32(_mm256_and_si256(bits, Splat(kF32AbsMask)), Splat(kF32Inf));
}

// The low 16 bits of each 32-bit lane, in order, as 8 halves.
inline __m128i Narrow16(__m256i v) {
  return _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
}

inline void Store(float* p, __m256 v) { _mm256_storeu_ps(p, v); }

// ToBF16: round to nearest even on the bits; a NaN is quietened, its payload kept.
inline void Store(BF16* p, __m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), Splat(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, Splat(0x7fffu)), odd), 16);
  const __m256i quiet_nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), Splat(0x40u));
  const __m256i out = _mm256_blendv_epi8(rounded, quiet_nan, IsNanMask(u));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), Narrow16(out));
}

// ToF16: the hardware's round to nearest even, which gives ToF16's bits for every number
// (float32 subnormals become a signed zero either way); a NaN becomes ToF16's fixed quiet
// NaN 0x7e00 with its sign, where the hardware would keep payload bits.
inline void Store(F16* p, __m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m128i converted = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256i nan =
      _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u, 16), Splat(0x8000u)), Splat(0x7e00u));
  const __m128i nan16 = Narrow16(nan);
  const __m128i is_nan = Narrow16(_mm256_srli_epi32(IsNanMask(u), 16));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_blendv_epi8(converted, nan16, is_nan));
}

// ---------------------------------------------------------------------------------
// The exact sum of squares, 8 lanes: AddSquare with an FMA, TwoSum(hi, p) computed as
// Fast2Sum on the pair ordered by size. Both are error-free, so they give the same sum s
// and the same error e (the one float equal to hi + p - s) with half the float additions,
// which bound this loop. hi and p are non-negative, so their order is that of their bits
// as unsigned integers, NaN above +Inf: a NaN stays in hi, and an Inf or an overflow
// still leaves the pair non-finite. Under denormal flushing the two can flush different
// subnormal intermediates (docs/spec.md says when that can show).
// ---------------------------------------------------------------------------------

inline void AddSquare(__m256& hi, __m256& lo, __m256 v) {
  const __m256 p = _mm256_mul_ps(v, v);
  const __m256 square_error = _mm256_fmsub_ps(v, v, p);
  const __m256i hi_bits = _mm256_castps_si256(hi), p_bits = _mm256_castps_si256(p);
  const __m256 larger = _mm256_castsi256_ps(_mm256_max_epu32(hi_bits, p_bits));
  const __m256 smaller = _mm256_castsi256_ps(_mm256_min_epu32(hi_bits, p_bits));
  const __m256 s = _mm256_add_ps(larger, smaller);
  const __m256 sum_error = _mm256_sub_ps(smaller, _mm256_sub_ps(s, larger));
  hi = s;
  lo = _mm256_add_ps(lo, _mm256_add_ps(sum_error, square_error));
}

// AbsBits, 8 lanes.
inline __m256i AbsBits(__m256 v) {
  return _mm256_and_si256(_mm256_castps_si256(v), Splat(kF32AbsMask));
}

// The largest of 8 unsigned lanes.
inline uint32_t HorizontalMax(__m256i v) {
  __m128i m = _mm_max_epu32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(1, 0, 3, 2)));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(2, 3, 0, 1)));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(m));
}

// ---------------------------------------------------------------------------------
// FP8: Fp8Code<kFormat, true> (saturating), 32 lanes at a time. The same integer and
// float operations as the scalar one on each lane's magnitude; the sign goes on after the
// codes are packed to bytes, 32 at a time.
// ---------------------------------------------------------------------------------

// The codes of |v| (below 2^8, one per 32-bit lane, no sign), kNanCode for a NaN.
// kMayBeNan = false: for lanes known not to be NaN, which it then does not test.
// e2 = max(E - E_min, 0), E the exponent field of the capped magnitude and E_min FP8's
// smallest normal one, by a saturating subtraction on the upper 16 bits (both lower
// halves are 0); then c = e2 + E_min + 20 * 2^23 and code = steps + (e2 >> 20), which is
// Fp8Code's steps + (e >> 20) - (127 + 1 - bias) * 8.
template <OutFormat kFormat, bool kMayBeNan>
inline __m256i Fp8MagnitudeCodes(__m256i u) {
  using Tr = Fp8Traits<kFormat>;
  constexpr uint32_t kMinNormalExponent = (127u + 1u - Tr::kBias) << 23;
  const __m256i magnitude = _mm256_and_si256(u, Splat(kF32AbsMask));
  const __m256i capped = _mm256_min_epu32(magnitude, Splat(Tr::kMaxBits));
  const __m256i e2 =
      _mm256_subs_epu16(_mm256_and_si256(capped, Splat(kF32Inf)), Splat(kMinNormalExponent));
  const __m256i c = _mm256_add_epi32(e2, Splat(kMinNormalExponent + (20u << 23)));
  const __m256i sum =
      _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(capped), _mm256_castsi256_ps(c)));
  const __m256i code = _mm256_add_epi32(_mm256_sub_epi32(sum, c), _mm256_srli_epi32(e2, 20));
  if constexpr (!kMayBeNan) return code;
  // A NaN's magnitude is capped like a finite one to the largest code, kMaxCode, and
  // kNanCode is kMaxCode + 1 in both formats: subtracting the all-ones mask adds that 1.
  static_assert(Tr::kNanCode == Tr::kMaxCode + 1, "NaN code follows the largest code");
  const __m256i nan = _mm256_cmpgt_epi32(magnitude, Splat(kF32Inf));
  return _mm256_sub_epi32(code, nan);
}

// The FP8 bytes of the 32 lanes a, b, c, d (in element order), in that order. kMayBeNan =
// false: none of them is NaN, which saves the NaN tests.
template <OutFormat kFormat, bool kMayBeNan>
inline __m256i Fp8Bytes(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256i ua = _mm256_castps_si256(a), ub = _mm256_castps_si256(b);
  const __m256i uc = _mm256_castps_si256(c), ud = _mm256_castps_si256(d);
  // Both packs interleave 128-bit halves the same way; the permutation at the end undoes it.
  const __m256i codes =
      _mm256_packus_epi16(_mm256_packus_epi32(Fp8MagnitudeCodes<kFormat, kMayBeNan>(ua),
                                              Fp8MagnitudeCodes<kFormat, kMayBeNan>(ub)),
                          _mm256_packus_epi32(Fp8MagnitudeCodes<kFormat, kMayBeNan>(uc),
                                              Fp8MagnitudeCodes<kFormat, kMayBeNan>(ud)));
  // Signed saturation keeps each lane's sign: 0x80 in its byte where v is negative.
  const __m256i signs =
      _mm256_and_si256(_mm256_packs_epi16(_mm256_packs_epi32(ua, ub), _mm256_packs_epi32(uc, ud)),
                       _mm256_set1_epi8(static_cast<char>(0x80)));
  // Where the sign goes: e4m3fn everywhere but the NaN code 0x7f (the one positive NaN
  // the kernels write); e4m3fnuz on codes 1 to 0x7f only (no -0; NaN is 0x80 alone). As
  // signed bytes, both are the codes below a bound.
  __m256i bytes;
  if constexpr (kFormat == OutFormat::kE4M3FN && !kMayBeNan) {
    bytes = _mm256_or_si256(codes, signs);
  } else {
    const __m256i takes_sign = kFormat == OutFormat::kE4M3FN
                                   ? _mm256_cmpgt_epi8(_mm256_set1_epi8(0x7f), codes)
                                   : _mm256_cmpgt_epi8(codes, _mm256_setzero_si256());
    bytes = _mm256_or_si256(codes, _mm256_and_si256(signs, takes_sign));
  }
  return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// y[0, 32) = QuantizeElement<kFormat>(normed[k], recip); kMayBeNan as for Fp8Bytes, of
// the products normed[k] * recip.
template <OutFormat kFormat, bool kMayBeNan>
inline void Quantize32(const float* normed, __m256 recip, uint8_t* y) {
  const __m256i bytes =
      Fp8Bytes<kFormat, kMayBeNan>(_mm256_mul_ps(_mm256_loadu_ps(normed), recip),
                                   _mm256_mul_ps(_mm256_loadu_ps(normed + 8), recip),
                                   _mm256_mul_ps(_mm256_loadu_ps(normed + 16), recip),
                                   _mm256_mul_ps(_mm256_loadu_ps(normed + 24), recip));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), bytes);
}

// y[0, 32) = QuantizeElement<kFormat>(normed[k], recips[k]): a multiplier per element (per
// column of the columnwise outputs).
template <OutFormat kFormat, bool kMayBeNan>
inline void Quantize32Each(const float* normed, const float* recips, uint8_t* y) {
  const auto product = [&](int k) {
    return _mm256_mul_ps(_mm256_loadu_ps(normed + k), _mm256_loadu_ps(recips + k));
  };
  const __m256i bytes =
      Fp8Bytes<kFormat, kMayBeNan>(product(0), product(8), product(16), product(24));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), bytes);
}

// The FP8 codes of 32 elements under power-of-two multipliers, from their codes under
// another power-of-two multiplier (row_codes, under the multiplier with float32 exponent
// field row_exponent). Scaling by 2^d is exact and FP8's rounding is the same in every
// normal binade, so the code of n * 2^d * m is the code of n * m with its exponent field
// moved by d wherever both codes are normal and the first did not come from below the
// smallest normal (docs/performance.md, "Columnwise"). column_exponents: each element's
// multiplier's exponent field (0: a multiplier of 0). Returns the lanes (bit k: element k)
// whose code could not be moved: a code of magnitude at most the smallest normal (0, a
// subnormal, or the smallest normal, which values below it round up to on a coarser grid
// than the moved binade's), a moved exponent outside [1, 15], a multiplier of 0; their
// bytes in out are to be overwritten. The caller rules out saturation (both multipliers
// bound their block's abs-max by the format's max) and NaN codes (finite blocks, finite
// multipliers).
inline uint32_t MovedFp8Codes32(const uint8_t* row_codes, const uint8_t* column_exponents,
                                uint8_t row_exponent, uint8_t* out) {
  const __m256i code = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row_codes));
  const __m256i column = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(column_exponents));
  const __m256i row = _mm256_set1_epi8(static_cast<char>(row_exponent));
  const __m256i fifteen = _mm256_set1_epi8(0x0f), zero = _mm256_setzero_si256();
  const __m256i smallest_normal = _mm256_set1_epi8(0x08);
  const __m256i magnitude = _mm256_and_si256(code, _mm256_set1_epi8(0x7f));
  // The exponent field (bits 3-6): 16-bit shifts, the neighbour byte's bits masked off.
  const __m256i exponent = _mm256_and_si256(_mm256_srli_epi16(code, 3), fifteen);
  // exponent + (column - row) in unsigned saturating steps: 0 or above 15 when out of range.
  const __m256i moved = _mm256_subs_epu8(_mm256_adds_epu8(exponent, _mm256_subs_epu8(column, row)),
                                         _mm256_subs_epu8(row, column));
  __m256i unmoved =
      _mm256_or_si256(_mm256_cmpeq_epi8(_mm256_min_epu8(magnitude, smallest_normal), magnitude),
                      _mm256_cmpeq_epi8(moved, zero));
  unmoved = _mm256_or_si256(unmoved, _mm256_cmpeq_epi8(column, zero));
  unmoved = _mm256_or_si256(
      unmoved, _mm256_xor_si256(_mm256_cmpeq_epi8(_mm256_min_epu8(moved, fifteen), moved),
                                _mm256_set1_epi8(-1)));
  const __m256i codes =
      _mm256_or_si256(_mm256_and_si256(code, _mm256_set1_epi8(static_cast<char>(0x87))),
                      _mm256_and_si256(_mm256_slli_epi16(moved, 3), _mm256_set1_epi8(0x78)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), codes);
  return static_cast<uint32_t>(_mm256_movemask_epi8(unmoved));
}

// ---------------------------------------------------------------------------------
// FP4: Fp4Code of 8 lanes, two codes per byte, and NVFP4's quotient (n / gs) / s.
// ---------------------------------------------------------------------------------

// The E2M1 codes (sign in bit 3) of 8 lanes, none of them NaN: Fp4Code's operations.
inline __m256i Fp4Codes(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i sign = _mm256_slli_epi32(_mm256_srli_epi32(u, 31), 3);
  const __m256i capped =
      _mm256_min_epu32(_mm256_and_si256(u, Splat(kF32AbsMask)), Splat(kFp4MaxBits));
  const __m256i e = _mm256_max_epu32(_mm256_and_si256(capped, Splat(kF32Inf)), Splat(127u << 23));
  const __m256i c = _mm256_add_epi32(e, Splat(22u << 23));
  const __m256i sum =
      _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(capped), _mm256_castsi256_ps(c)));
  const __m256i code = _mm256_sub_epi32(
      _mm256_add_epi32(_mm256_sub_epi32(sum, c), _mm256_srli_epi32(e, 22)), Splat(127u << 1));
  return _mm256_or_si256(code, sign);
}

// PackFp4 of lanes 2k and 2k + 1 of 8 codes: 4 bytes, element 0 in the low nibble of the
// first.
inline uint32_t PackFp4x8(__m256i codes) {
  // Each 64-bit lane: even | odd << 32, so that its low byte after the shift is
  // even | odd << 4.
  const __m256i pairs = _mm256_or_si256(codes, _mm256_srli_epi64(codes, 28));
  const __m256i bytes = _mm256_shuffle_epi8(
      pairs, _mm256_setr_epi8(0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 8,
                              -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
  const uint32_t low = static_cast<uint32_t>(_mm_cvtsi128_si32(_mm256_castsi256_si128(bytes)));
  const uint32_t high =
      static_cast<uint32_t>(_mm_cvtsi128_si32(_mm256_extracti128_si256(bytes, 1)));
  return (low & 0xffffu) | (high << 16);
}

// PackFp4 of 32 codes (four vectors of 8, in element order): 16 bytes, element 0 in the
// low nibble of the first.
inline __m128i PackFp4x32(__m256i c0, __m256i c1, __m256i c2, __m256i c3) {
  // One code per byte, in element order (the packs interleave 128-bit halves; the
  // permutation undoes it), then each pair of bytes multiplied by (1, 16) and summed.
  const __m256i bytes = _mm256_permutevar8x32_epi32(
      _mm256_packus_epi16(_mm256_packus_epi32(c0, c1), _mm256_packus_epi32(c2, c3)),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  const __m256i pairs = _mm256_maddubs_epi16(bytes, _mm256_set1_epi16(0x1001));
  const __m256i packed = _mm256_packus_epi16(pairs, _mm256_setzero_si256());
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, _MM_SHUFFLE(3, 1, 2, 0)));
}

// The E2M1 codes of fl(fl(n / gs) / s), the quotient QuantizeFp4Element rounds for NVFP4,
// from w = (n * rg) * rs, rg = fl(1 / gs) and rs = fl(1 / s) both normal: w is within 6
// units in the last place (2^-21 relative) of the quotient, so where w lies farther than
// 2^-19 |w| from every rounding boundary of E2M1 (the midpoints between its values: 0.25,
// 0.75, ..., 5) both round to the same code. Only for a vector holding a lane that close
// (rarely, or on purpose, as tests/test_fp4.py does) are the two divisions made. The
// rounding of Fp4Codes and the distance to the boundary share their steps.
inline __m256i Nvfp4Codes(__m256 n, __m256 gs, __m256 s, __m256 rg, __m256 rs) {
  const __m256 w = _mm256_mul_ps(_mm256_mul_ps(n, rg), rs);
  const __m256i u = _mm256_castps_si256(w);
  const __m256i capped =
      _mm256_min_epu32(_mm256_and_si256(u, Splat(kF32AbsMask)), Splat(kFp4MaxBits));
  const __m256i e = _mm256_max_epu32(_mm256_and_si256(capped, Splat(kF32Inf)), Splat(127u << 23));
  const __m256i c = _mm256_add_epi32(e, Splat(22u << 23));
  const __m256 a = _mm256_castsi256_ps(capped);
  const __m256 sum = _mm256_add_ps(a, _mm256_castsi256_ps(c));
  // a rounded to E2M1's step in its binade is sum - c, exactly; a boundary lies half a
  // step, 2^(E - 2), from it. 2^(E - 18) bounds 2^-19 a from above, so a lane lies near a
  // boundary when its distance from the rounded value is at least their difference.
  // Near: |a - (sum - c)| >= 2^(E - 2) - 2^(E - 18) = 2^(E - 3) * (2 - 2^-15), a float
  // whose bits are e - 3 * 2^23 + 0x7fff00.
  const __m256 off = _mm256_andnot_ps(_mm256_set1_ps(-0.0f),
                                      _mm256_sub_ps(a, _mm256_sub_ps(sum, _mm256_castsi256_ps(c))));
  const __m256 threshold = _mm256_castsi256_ps(_mm256_add_epi32(e, Splat(0x7fff00u - (3u << 23))));
  if (_mm256_movemask_ps(_mm256_cmp_ps(off, threshold, _CMP_GE_OQ)) != 0) {
    return Fp4Codes(_mm256_div_ps(_mm256_div_ps(n, gs), s));
  }
  const __m256i sign = _mm256_slli_epi32(_mm256_srli_epi32(u, 31), 3);
  const __m256i code = _mm256_sub_epi32(
      _mm256_add_epi32(_mm256_sub_epi32(_mm256_castps_si256(sum), c), _mm256_srli_epi32(e, 22)),
      Splat(127u << 1));
  return _mm256_or_si256(code, sign);
}

// Nvfp4Scale of 8 groups, the abs-max bits of each in a lane, in a row whose sum of
// squares is finite, under a global scale that is a positive normal number: the scales
// (NaN for a group holding NaN or Inf) and fl(1 / scale), NaN where the group's codes are
// all 0 (a scale of 0 or NaN). The same operations as the scalar functions: two
// divisions, Fp8Code's saturating rounding (Fp8MagnitudeCodes on a non-negative lane, NaN
// only where masked: an Inf from the division saturates to 448), E4M3FnValue.
inline void Nvfp4Scales(__m256i amax_bits, __m256 gs, __m256* scale, __m256* multiplier) {
  const __m256 nan = _mm256_castsi256_ps(Splat(kF32QuietNan));
  const __m256 amax = _mm256_div_ps(_mm256_castsi256_ps(amax_bits), gs);
  const __m256i finite = _mm256_cmpgt_epi32(Splat(kF32Inf), amax_bits);
  const __m256 quotient = _mm256_div_ps(amax, _mm256_set1_ps(kFp4Max));
  const __m256i code = Fp8MagnitudeCodes<OutFormat::kE4M3FN, false>(_mm256_castps_si256(quotient));
  const __m256i exponent = _mm256_and_si256(_mm256_srli_epi32(code, 3), Splat(0xfu));
  const __m256i mantissa = _mm256_and_si256(code, Splat(0x7u));
  const __m256i normal =
      _mm256_or_si256(_mm256_slli_epi32(_mm256_add_epi32(exponent, Splat(120u)), 23),
                      _mm256_slli_epi32(mantissa, 20));
  const __m256 subnormal =
      _mm256_mul_ps(_mm256_cvtepi32_ps(mantissa), _mm256_castsi256_ps(Splat((127u - 9u) << 23)));
  const __m256i is_subnormal = _mm256_cmpeq_epi32(exponent, _mm256_setzero_si256());
  const __m256 value =
      _mm256_castsi256_ps(_mm256_blendv_epi8(normal, _mm256_castps_si256(subnormal), is_subnormal));
  *scale = _mm256_blendv_ps(nan, value, _mm256_castsi256_ps(finite));
  const __m256 zero = _mm256_or_ps(_mm256_castsi256_ps(_mm256_xor_si256(finite, Splat(~0u))),
                                   _mm256_cmp_ps(value, _mm256_setzero_ps(), _CMP_EQ_OQ));
  *multiplier = _mm256_blendv_ps(_mm256_div_ps(_mm256_set1_ps(1.0f), value), nan, zero);
}

// Mxfp4Scale of 8 groups (the abs-max bits of each in a lane) in a row whose sum of
// squares is finite, bounded by ub: the scales (NaN for a group holding NaN or Inf) and
// their reciprocals (NaN where the codes are all 0). PowerOfTwoScale's operations with
// FP4_MAX and the e8m0 floor, lane by lane.
inline void Mxfp4Scales(__m256i amax_bits, float ub, __m256* scale, __m256* multiplier) {
  const __m256 nan = _mm256_castsi256_ps(Splat(kF32QuietNan));
  const __m256i finite = _mm256_cmpgt_epi32(Splat(kF32Inf), amax_bits);
  const __m256 a = _mm256_min_ps(_mm256_castsi256_ps(amax_bits), _mm256_set1_ps(ub));
  const __m256i q = _mm256_castps_si256(_mm256_div_ps(a, _mm256_set1_ps(kFp4Max)));
  const __m256i exponent = _mm256_and_si256(_mm256_srli_epi32(q, 23), Splat(0xffu));
  const __m256i inexact = _mm256_xor_si256(
      _mm256_cmpeq_epi32(_mm256_and_si256(q, Splat(0x007fffffu)), _mm256_setzero_si256()),
      Splat(~0u));
  const __m256i rounded_up = _mm256_sub_epi32(exponent, inexact);  // + 1 where inexact
  // A q below 2^-126: 2^-126 if a > FP4_MAX * 2^-127 (made in two normal steps), else
  // 2^-127 (exponent 0), as PowerOfTwoExponent decides it.
  const float tiny_limit = (kFp4Max * FloatOf(63u << 23)) * FloatOf(64u << 23);
  const __m256i tiny = _mm256_and_si256(
      _mm256_castps_si256(_mm256_cmp_ps(a, _mm256_set1_ps(tiny_limit), _CMP_GT_OQ)), Splat(1u));
  const __m256i e =
      _mm256_blendv_epi8(rounded_up, tiny, _mm256_cmpeq_epi32(exponent, _mm256_setzero_si256()));
  const __m256i recip_bits = _mm256_and_si256(
      _mm256_slli_epi32(_mm256_sub_epi32(Splat(254u), e), 23), _mm256_cmpgt_epi32(Splat(254u), e));
  const __m256i scale_bits = _mm256_blendv_epi8(_mm256_slli_epi32(e, 23), Splat(0x00400000u),
                                                _mm256_cmpeq_epi32(e, _mm256_setzero_si256()));
  const __m256 keep = _mm256_castsi256_ps(finite);
  *scale = _mm256_blendv_ps(nan, _mm256_castsi256_ps(scale_bits), keep);
  *multiplier = _mm256_blendv_ps(nan, _mm256_castsi256_ps(recip_bits), keep);
}

// The lane-wise maxima of x's and y's 32-bit lanes interleaved by pairs (then by quads):
// the steps of NormalizeEightGroups' transposition.
inline __m256i MaxOfPairs(__m256i x, __m256i y) {
  return _mm256_max_epu32(_mm256_unpacklo_epi32(x, y), _mm256_unpackhi_epi32(x, y));
}
inline __m256i MaxOfQuads(__m256i x, __m256i y) {
  return _mm256_max_epu32(_mm256_unpacklo_epi64(x, y), _mm256_unpackhi_epi64(x, y));
}

// Normalize, in place, 8 consecutive groups of `size` elements (a multiple of 8) of h,
// each as NormalizeRow computes it; returns their abs-maxima (ordered bits), group g in
// lane g. The maxima of the 8 groups' vectors are reduced together, by a transposition.
inline __m256i NormalizeEightGroups(float* __restrict h, const float* __restrict gamma_plus_offset,
                                    __m256 r, int64_t size) {
  __m256i m[8];
  for (int g = 0; g < 8; ++g) {
    __m256i acc = _mm256_setzero_si256();
    for (int64_t j = g * size; j < (g + 1) * size; j += 8) {
      const __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(h + j), r),
                                     _mm256_loadu_ps(gamma_plus_offset + j));
      _mm256_storeu_ps(h + j, v);
      acc = _mm256_max_epu32(acc, AbsBits(v));
    }
    m[g] = acc;
  }
  // Per 128-bit half: lanes 0-3 the maxima of groups 0-3 (then 4-7) over that half.
  const __m256i low = MaxOfQuads(MaxOfPairs(m[0], m[1]), MaxOfPairs(m[2], m[3]));
  const __m256i high = MaxOfQuads(MaxOfPairs(m[4], m[5]), MaxOfPairs(m[6], m[7]));
  return _mm256_max_epu32(_mm256_permute2x128_si256(low, high, 0x20),
                          _mm256_permute2x128_si256(low, high, 0x31));
}

// out[0, 32) = the FP4 codes (one a byte) of n[0, 32), element k under its own column's
// scale: NVFP4 with scales[k] and multipliers[k] = fl(1 / scales[k]) (gs8, rg8: the
// global scale and fl(1 / gs), normal), MXFP4 with multipliers[k] = 1 / scale; a NaN
// multiplier marks a column block of zero codes.
inline void Fp4Codes32Each(const float* n, const float* scales, const float* multipliers,
                           bool nvfp4, __m256 gs8, __m256 rg8, uint8_t* out) {
  __m256i c[4];
  for (int k = 0; k < 4; ++k) {
    const __m256 v = _mm256_loadu_ps(n + 8 * k);
    const __m256 m = _mm256_loadu_ps(multipliers + 8 * k);
    const __m256i codes = nvfp4 ? Nvfp4Codes(v, gs8, _mm256_loadu_ps(scales + 8 * k), rg8, m)
                                : Fp4Codes(_mm256_mul_ps(v, m));
    const __m256i zero = _mm256_castps_si256(_mm256_cmp_ps(m, m, _CMP_UNORD_Q));
    c[k] = _mm256_andnot_si256(zero, codes);
  }
  const __m256i bytes = _mm256_permutevar8x32_epi32(
      _mm256_packus_epi16(_mm256_packus_epi32(c[0], c[1]), _mm256_packus_epi32(c[2], c[3])),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), bytes);
}

}  // namespace avx2_lanes
}  // namespace
}  // namespace fp8norm

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif
