// The arithmetic of the backward pass (docs/spec.md, "Training: the backward pass"),
// written once for the CPU kernel (host compiler) and the CUDA kernel (nvcc), as
// fp8norm_math.h is for the forward: the flushing rule, the gradient's element-wise
// steps and the exact sum of float32 terms.
#pragma once

#include <cstdint>

#include "fp8norm_math.h"

namespace fp8norm {

// Every input and every result of a float32 operation of magnitude at most 2^-126 is
// taken as a zero of its sign, explicitly. Flushing 2^-126 itself, float32's smallest
// normal number, is what makes the bits independent of the hardware: a product whose
// exact value lies just below 2^-126 rounds to 2^-126 with gradual underflow (GPUs, IEEE)
// but to zero where tininess is detected before rounding and flushed (x86 with FTZ, as in
// XLA's CPU threads); both become zero here. A sum or difference that small is exact
// either way.

// v, or a zero of v's sign where |v| <= 2^-126.
FP8NORM_HD float FlushTiny(float v) {
  const uint32_t u = BitsOf(v);
  return FloatOf(Select((u & kF32AbsMask) <= kF32MinNormalBits, u & 0x80000000u, u));
}

// u_j = f32(h_j * r): the normalised input before gamma.
FP8NORM_HD float NormalizedInput(float h, float r) { return FlushTiny(FlushTiny(h) * r); }

// a_j = dn_j * g_j, g_j = f32(gamma_j) + wo32 (flushed by the caller once per call).
FP8NORM_HD float GradTimesGamma(float dn, float g) { return FlushTiny(FlushTiny(dn) * g); }

// A float32 term of one of the backward's sums: a_j * u_j for c, dn_j * u_j for dgamma.
FP8NORM_HD float ProductTerm(float p, float u) { return FlushTiny(p * u); }

// c / N: the row's mean of a_j * u_j.
FP8NORM_HD float MeanOfTerms(float c, int64_t hidden) { return FlushTiny(c / float(hidden)); }

// dx_j = r * (a_j - u_j * (c / N)).
FP8NORM_HD float InputGradient(float a, float u, float c_over_n, float r) {
  return CanonicalNan(FlushTiny(r * FlushTiny(a - FlushTiny(u * c_over_n))));
}

// dh_j = dx_j + f32(d_residual_out_j), the add variants' gradient of h.
FP8NORM_HD float PlusResidualGradient(float dx, float d_residual_out) {
  return CanonicalNan(FlushTiny(dx + FlushTiny(d_residual_out)));
}

// The exact sum of float32 terms, rounded once: the backward's two sums. Every finite
// nonzero term is m * 2^(e - 1) units of 2^-149 (m its 24-bit significand, e its biased
// exponent, 1..254), added as an integer to 32-bit digits held in int64 limbs: limb k
// counts units of 2^(32 k - 149). A term touches two limbs and moves each by less than
// 2^32, so 2^31 terms never overflow a limb; the top limb takes the carries. Integer
// addition is associative: the result is the same for every order, split and merge.
struct ExactSum {
  // 253 + 24 bits of terms, and a limb above them for AddScaled's widest value; the top
  // limb holds the carries.
  static constexpr int kLimbs = 10;
  int64_t limbs[kLimbs];
  uint32_t specials;  // kSumNan | kSumPlusInf | kSumMinusInf
};

constexpr uint32_t kSumNan = 1u;
constexpr uint32_t kSumPlusInf = 2u;
constexpr uint32_t kSumMinusInf = 4u;

FP8NORM_HD void Clear(ExactSum& acc) {
  for (int k = 0; k < ExactSum::kLimbs; ++k) acc.limbs[k] = 0;
  acc.specials = 0;
}

// Adds one term; a term below 2^-126 in magnitude (a flushed subnormal) adds nothing.
FP8NORM_HD void Add(ExactSum& acc, float term) {
  const uint32_t u = BitsOf(term);
  const uint32_t exponent = (u >> 23) & 0xffu;
  if (exponent == 0) return;
  const bool negative = (u >> 31) != 0;
  if (exponent == 0xffu) {
    acc.specials |= (u & 0x7fffffu) != 0 ? kSumNan : (negative ? kSumMinusInf : kSumPlusInf);
    return;
  }
  const uint32_t offset = exponent - 1u;
  const uint64_t shifted = uint64_t((u & 0x7fffffu) | 0x800000u) << (offset & 31u);
  const int64_t low = int64_t(shifted & 0xffffffffu);
  const int64_t high = int64_t(shifted >> 32);
  const int k = int(offset >> 5);
  acc.limbs[k] += negative ? -low : low;
  acc.limbs[k + 1] += negative ? -high : high;
}

// Adds v * 2^offset units of 2^-149 (|v| < 2^62, offset <= 254). A negative offset needs
// v to be a multiple of 2^-offset, as a sum of float32 terms on a coarser grid is.
FP8NORM_HD void AddScaled(ExactSum& acc, int64_t v, int offset) {
  if (v == 0) return;
  if (offset < 0) {
    v >>= -offset;  // exact: the bits shifted out are zeros
    offset = 0;
  }
  const bool negative = v < 0;
  const uint64_t magnitude = negative ? uint64_t(0) - uint64_t(v) : uint64_t(v);
  const int k = offset >> 5;
  const int shift = offset & 31;
  const uint64_t low = (magnitude & 0xffffffffu) << shift;  // below 2^63
  const uint64_t high = (magnitude >> 32) << shift;         // below 2^61
  const int64_t digits[3] = {int64_t(low & 0xffffffffu),
                             int64_t((low >> 32) + (high & 0xffffffffu)), int64_t(high >> 32)};
  for (int i = 0; i < 3 && k + i < ExactSum::kLimbs; ++i) {
    acc.limbs[k + i] += negative ? -digits[i] : digits[i];
  }
}

FP8NORM_HD void Merge(ExactSum& acc, const ExactSum& other) {
  for (int k = 0; k < ExactSum::kLimbs; ++k) acc.limbs[k] += other.limbs[k];
  acc.specials |= other.specials;
}

// Carries so that every limb but the top one is a digit in [0, 2^32).
FP8NORM_HD void Normalize(int64_t* limbs) {
  for (int k = 0; k + 1 < ExactSum::kLimbs; ++k) {
    const int64_t carry = limbs[k] >> 32;  // arithmetic: floor(limbs[k] / 2^32)
    limbs[k] -= int64_t(uint64_t(carry) << 32);
    limbs[k + 1] += carry;
  }
}

// The float32 nearest to the exact sum (ties to even, exponent range unbounded), then
// +-inf past float32's largest and +0 below 2^-126 (an exact zero too). NaN if a term
// was NaN or the terms held both infinities; +-inf if they held one of them.
FP8NORM_HD float Round(const ExactSum& acc) {
  if (acc.specials != 0) {
    const bool nan = (acc.specials & kSumNan) != 0 ||
                     (acc.specials & (kSumPlusInf | kSumMinusInf)) == (kSumPlusInf | kSumMinusInf);
    return FloatOf(nan ? kF32QuietNan
                       : ((acc.specials & kSumMinusInf) != 0 ? 0xff800000u : kF32Inf));
  }
  int64_t d[ExactSum::kLimbs];
  for (int k = 0; k < ExactSum::kLimbs; ++k) d[k] = acc.limbs[k];
  Normalize(d);
  const bool negative = d[ExactSum::kLimbs - 1] < 0;
  if (negative) {
    for (int k = 0; k < ExactSum::kLimbs; ++k) d[k] = -d[k];
    Normalize(d);
  }
  // The leading bit's position p (bit 0: 2^-149); the top limb may exceed 32 bits.
  int top = ExactSum::kLimbs - 1;
  while (top >= 0 && d[top] == 0) --top;
  if (top < 0) return 0.0f;
  const uint64_t lead = uint64_t(d[top]);
  int width = 0;
  while (width < 64 && (lead >> width) != 0) ++width;
  const int p = 32 * top + width - 1;
  // Bits p - 24 .. p of the sum (the significand and the rounding bit), and whether any
  // bit below them is set.
  const int q = p - 24;
  uint64_t window = 0;
  bool sticky = false;
  for (int k = 0; k < ExactSum::kLimbs; ++k) {
    const uint64_t digit = uint64_t(d[k]);
    if (digit == 0) continue;
    const int at = 32 * k - q;  // where the digit's bit 0 lands in the window
    if (at >= 0) {
      window |= digit << at;  // at <= 24: nothing of the window is lost
    } else if (at > -64) {
      window |= digit >> -at;
      sticky = sticky || (digit & ((uint64_t{1} << -at) - 1)) != 0;
    } else {
      sticky = true;
    }
  }
  uint64_t significand = window >> 1;  // 24 bits
  const bool round_bit = (window & 1u) != 0;
  int leading = p;
  if (round_bit && (sticky || (significand & 1u) != 0)) {
    ++significand;
    if (significand == (uint64_t{1} << 24)) {
      significand >>= 1;
      ++leading;
    }
  }
  const int biased = leading - 149 + 127;
  const uint32_t sign = negative ? 0x80000000u : 0u;
  if (biased >= 255) return FloatOf(sign | kF32Inf);
  if (biased <= 0) return 0.0f;
  return FloatOf(sign | (uint32_t(biased) << 23) | (uint32_t(significand) & 0x7fffffu));
}

}  // namespace fp8norm
