// The parts of FP4 training beyond round-to-nearest (docs/spec.md, "FP4 training"),
// written once for the CPU kernels and nvcc: the random bits of stochastic rounding
// (Threefry-2x32 at the element's (row, column)), the stochastic rounding of a scaled
// value to E2M1, and the Hadamard butterfly of the weight-gradient GEMM's operands. The
// jnp statement of each is jax_fp8norm/_fp4_parts.py; the kernels give its bits.
#pragma once

#include <cstdint>

#include "fp8norm_math.h"

namespace fp8norm {

// A Threefry-2x32 key: the caller's key folded with a stream (StreamKey).
struct KeyWords {
  uint32_t k0;
  uint32_t k1;
};

FP8NORM_HD uint32_t RotateLeft(uint32_t v, uint32_t r) { return (v << r) | (v >> (32u - r)); }

// Threefry-2x32 with 20 rounds, as jax.extend.random.threefry_2x32: the counter (x0, x1)
// becomes the output pair in place.
FP8NORM_HD void Threefry2x32(KeyWords key, uint32_t& x0, uint32_t& x1) {
  const uint32_t ks[3] = {key.k0, key.k1, key.k0 ^ key.k1 ^ 0x1BD11BDAu};
  constexpr uint32_t kRotations[2][4] = {{13, 15, 26, 6}, {17, 29, 16, 24}};
  x0 += ks[0];
  x1 += ks[1];
  for (uint32_t group = 0; group < 5; ++group) {
    for (uint32_t r : kRotations[group & 1]) {
      x0 += x1;
      x1 = RotateLeft(x1, r);
      x1 ^= x0;
    }
    x0 += ks[(group + 1) % 3];
    x1 += ks[(group + 2) % 3] + group + 1;
  }
}

// The caller's key folded with `stream`: what jax.random.fold_in gives a threefry key.
FP8NORM_HD KeyWords StreamKey(KeyWords key, uint32_t stream) {
  uint32_t x0 = 0, x1 = stream;
  Threefry2x32(key, x0, x1);
  return KeyWords{x0, x1};
}

// The 32 random bits of the element at (row, col) of an operand: the first output word.
FP8NORM_HD uint32_t RandomBits(KeyWords stream_key, uint32_t row, uint32_t col) {
  uint32_t x0 = row, x1 = col;
  Threefry2x32(stream_key, x0, x1);
  return x0;
}

// The E2M1 code of q (scaled, clamped to [-6, 6], finite), rounded stochastically: between
// the adjacent magnitudes lo <= |q| <= hi, hi where u = (bits >> 8) * 2^-24 is below
// frac = (|q| - lo) / (hi - lo), else lo; q's sign. Every step is exact (hi - lo is a power
// of two). A magnitude below the smallest normal float32 counts as zero, so that flushing
// denormals cannot change a code.
FP8NORM_HD uint8_t Fp4StochasticCode(float q, uint32_t bits) {
  const uint32_t sign = BitsOf(q) & 0x80000000u;
  const float a = AbsBits(q) < 0x00800000u ? 0.0f : FloatOf(AbsBits(q));
  const float step = a < 2.0f ? 0.5f : (a < 4.0f ? 1.0f : 2.0f);
  const float inverse_step = a < 2.0f ? 2.0f : (a < 4.0f ? 1.0f : 0.5f);
  const float lo = floorf(a * inverse_step) * step;
  const float frac = (a - lo) * inverse_step;  // 0 where |q| is representable
  const float u = float(bits >> 8) * 0x1p-24f;
  const float magnitude = u < frac ? lo + step : lo;
  return Fp4Code(FloatOf(BitsOf(magnitude) | sign));
}

// The sign of row i of a Hadamard block: bit i of the recipe's mask set, negated.
FP8NORM_HD float HadamardSign(uint32_t mask, int i) { return ((mask >> i) & 1u) ? -1.0f : 1.0f; }

// The butterfly's stages for blocks of d rows: log2(d).
constexpr int HadamardStages(int d) { return d > 1 ? 1 + HadamardStages(d / 2) : 0; }

// M v for the D values v[0], v[stride], ..., of one block: the mask's signs, then the
// unnormalised Walsh-Hadamard butterfly in float32, stage s mapping (i, i + 2^s), bit s of
// i clear, to (a + b, a - b), stages in increasing s. T: float, or a vector of floats (GCC's
// vector extension) whose lanes are as many blocks side by side, each lane computed with
// float's operations, so with their bits. Unrolled whole (nvcc), so that a block in an
// array of registers is indexed by constants and stays in them.
template <int D, typename T>
FP8NORM_HD void HadamardBlock(T* v, int64_t stride, uint32_t mask) {
  static_assert(D >= 2 && (D & (D - 1)) == 0, "a power of two");
#pragma unroll
  for (int i = 0; i < D; ++i) v[i * stride] *= HadamardSign(mask, i);
#pragma unroll
  for (int s = 0; s < HadamardStages(D); ++s) {
    const int span = 1 << s;
#pragma unroll
    for (int i = 0; i < D; ++i) {
      if (i & span) continue;
      const T a = v[i * stride], b = v[(i + span) * stride];
      v[i * stride] = a + b;
      v[(i + span) * stride] = a - b;
    }
  }
}

}  // namespace fp8norm
