// The output gradient's FP4 quantiser (docs/spec.md, "The gradient's quantiser"), the
// kernel behind jax_fp8norm.quantize_gradient_rows / quantize_gradient_columns: its
// arguments, as the CPU and CUDA kernels take them, and the arithmetic of one group,
// written once for the host compiler and nvcc. The group rule is the norm's
// (fp8norm_math.h: Nvfp4Scale, Mxfp4Scale, QuantizeFp4Element); the random bits, the
// stochastic rounding and the Hadamard butterfly are fp4_parts.h's. Plain C++: no XLA,
// CUDA or nanobind types.
#pragma once

#include <cstdint>

#include "fp4_parts.h"
#include "fp8norm_math.h"

#if !defined(__CUDACC__)
#include "rms_norm_fp8.h"  // ParallelFor
#endif

namespace fp8norm {

struct QuantizeGradientArgs {
  const float* g;  // [rows, cols]
  // The stream's Threefry key words (uint32[2], device memory on the GPU); read only when
  // stochastic.
  const uint32_t* key;
  int64_t rows;
  int64_t cols;
  // The recipe's block: the group along the columns (the rows copy) or along the rows (the
  // columns copy); 16 (NVFP4) or 32 (MXFP4), even.
  int64_t block;
  bool nvfp4;       // NVFP4 (e4m3 scales under a float32 global scale), else MXFP4 (e8m0)
  bool columns;     // the wgrad copy (groups along the rows), else the dgrad copy
  bool stochastic;  // SR with the bits of (row, col), else round to nearest even
  bool hadamard;    // the columns copy only: M = H S over each block of rows first
  uint32_t hadamard_mask;
  // [rows, cols] float4_e2m1fn: two per byte with element 2k (of the whole array) in the
  // low nibble when codes_packed, else one per byte.
  uint8_t* codes;
  bool codes_packed;
  // The rows copy [rows, cols / block], the columns copy [rows / block, cols]: e4m3 codes
  // (NVFP4) or e8m0 bytes (MXFP4).
  uint8_t* scales;
  // NVFP4's float32 global decode scales: one per row (the rows copy) or one for the
  // tensor (the columns copy, max |M g| / 2688); null for MXFP4.
  float* global_scales;
};

// The scale of a group of abs-max amax_bits: NVFP4 under the decode scale gs, MXFP4 by the
// power-of-two rule, unbounded (the recipes' gradients have no scale_ub).
FP8NORM_HD Fp4Scale GradientGroupScale(bool nvfp4, uint32_t amax_bits, float gs) {
  return nvfp4 ? Nvfp4Scale(0.0f, amax_bits, gs) : Mxfp4Scale(0.0f, amax_bits, FloatOf(kF32Inf));
}

// The byte a group's scale is stored as: its e4m3 code (NVFP4) or e8m0 byte (MXFP4).
FP8NORM_HD uint8_t GradientScaleByte(bool nvfp4, const Fp4Scale& s) {
  return nvfp4 ? E4M3ScaleCode(s.scale) : E8M0Code(s.scale);
}

// The code of element v of a group with scale s: to nearest (the norm's rule), or
// stochastically with its random bits, from the same scaled value clamped to +-6.
FP8NORM_HD uint8_t GradientCode(float v, const Fp4Scale& s, bool stochastic, uint32_t bits) {
  if (!stochastic) return QuantizeFp4Element(v, s);
  if (s.zero) return 0;
  const float q = s.nvfp4 ? (v / s.global_scale) / s.scale : v * s.recip;
  return Fp4StochasticCode(q > kFp4Max ? kFp4Max : (q < -kFp4Max ? -kFp4Max : q), bits);
}

// M v over one block of `block` values v[0], v[stride], ...: HadamardBlock of the block
// sizes the recipes take. False for any other block (the decoding refuses it first).
FP8NORM_HD bool HadamardOfBlock(float* v, int64_t stride, int64_t block, uint32_t mask) {
  if (block == 16) {
    HadamardBlock<16>(v, stride, mask);
  } else if (block == 32) {
    HadamardBlock<32>(v, stride, mask);
  } else {
    return false;
  }
  return true;
}

#if !defined(__CUDACC__)
// The CPU kernel (src/cpu/cpu_quantize_gradient.cc); false when its scratch could not be
// allocated (the outputs are then incomplete).
bool QuantizeGradientCpu(const QuantizeGradientArgs& args, const ParallelFor& parallel_for);
// Tests force the number of rows (the rows copy) or row blocks (the columns copy) of a
// CPU task with a positive count; 0 restores the default split. The bits do not depend
// on it.
void SetQuantizeGradientTaskRows(int64_t rows);
#endif

}  // namespace fp8norm
