// The quantiser of a weight w [K, F] into FP4 square tiles (docs/spec.md, "2-D weight
// scales"; its jnp statement is jax_fp8norm/quantize.py's quantize_weight_tiles): one
// scale per block x block tile by the FP4 group rule of fp8norm_math.h (Nvfp4Scale,
// Mxfp4Scale, QuantizeFp4Element), NVFP4's under the tensor's global scale. A partial tile
// at F's end is quantised as that tile padded with zeros: a zero changes no abs-max. Shared
// by the CPU kernel (src/cpu/cpu_quantize_weight.cc) and the CUDA one
// (src/cuda/quantize_weight.cu), so that the two cannot drift.
#pragma once

#include <cstdint>

#include "fp8norm_math.h"
#include "named_codes.h"

namespace fp8norm {

// The format attribute of the quantize_weight target.
enum class WeightFormat : int64_t { kNvfp4Tiles = 0, kMxfp4Tiles = 1 };
// Their names, which every compiled module exports (constant_bindings.h) and the Python
// package reads the codes from (jax_fp8norm/_quantize_weight_kernel.py).
constexpr NamedCode<WeightFormat> kWeightFormatNames[] = {
    {WeightFormat::kNvfp4Tiles, "nvfp4_tiles"},
    {WeightFormat::kMxfp4Tiles, "mxfp4_tiles"},
};

struct QuantizeWeightArgs {
  const void* w;  // [rows, cols] of w_type
  FloatType w_type;
  int64_t rows;   // K, a multiple of block
  int64_t cols;   // F
  int64_t block;  // the tile's side: 16 (NVFP4) or 32 (MXFP4), even
  bool nvfp4;
  void* codes;  // [rows, cols] E2M1
  bool codes_packed;
  uint8_t* scales;      // [rows / block, TileColumns] e4m3 (NVFP4) or e8m0 (MXFP4) bytes
  float* global_scale;  // []: NVFP4's; 1 for MXFP4, which has none
};

FP8NORM_HD int64_t TileColumns(const QuantizeWeightArgs& a) {
  return (a.cols + a.block - 1) / a.block;
}

// NVFP4's global (decode) scale of a tensor whose abs-max has the ordered bits amax_bits
// (AbsBits): amax / (448 * 6), at least 2^-126, 1 for a zero tensor, NaN for a tensor
// holding NaN (jax_fp8norm/quantize.py, nvfp4_global_scale). An Inf gives Inf, which no
// tile scale accepts: every tile then gets a NaN scale, as in the twin.
FP8NORM_HD float Nvfp4GlobalScale(uint32_t amax_bits) {
  const float amax = FloatOf(amax_bits);
  if (IsNan(amax)) return FloatOf(kF32QuietNan);
  // A float comparison, as the twin's: a subnormal amax reads as zero where the thread
  // flushes denormals, as XLA's CPU threads do.
  if (amax == 0.0f) return 1.0f;
  const float scale = amax / (Fp8Traits<OutFormat::kE4M3FN>::kMax * kFp4Max);
  const float smallest_normal = FloatOf(kF32MinNormalBits);
  return scale > smallest_normal ? scale : smallest_normal;
}

// The stored scale byte of a tile with abs-max amax_bits (ordered bits, the zero padding
// included or not), under the global scale gs (NVFP4 only): e4m3 (0x7F for NaN) or e8m0
// (0xFF for NaN), by the rule of the norm's FP4 groups. MXFP4's bound is none (inf), the
// weight quantisers' default.
FP8NORM_HD uint8_t WeightTileScaleCode(bool nvfp4, uint32_t amax_bits, float gs) {
  if (nvfp4) return E4M3ScaleCode(Nvfp4Scale(0.0f, amax_bits, gs).scale);
  return E8M0Code(Mxfp4Scale(0.0f, amax_bits, FloatOf(kF32Inf)).scale);
}

// The element rule of a tile from its stored scale byte: what Nvfp4Scale / Mxfp4Scale gave
// for it (a stored NaN or a zero scale gives zero codes), read back from the byte so that
// a kernel that writes the codes apart from the scales needs nothing else per tile.
FP8NORM_HD Fp4Scale WeightTileScale(bool nvfp4, uint8_t code, float gs) {
  if (nvfp4) {
    const float scale = E4M3FnValue(code);
    return Fp4Scale{scale, 0.0f, gs, true, IsNan(scale) || scale == 0.0f};
  }
  return Fp4Scale{0.0f, PowerOfTwoReciprocal(code), 0.0f, false, code == 0xFFu};
}

}  // namespace fp8norm
