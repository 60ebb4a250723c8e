// The quantisers of a weight w [K, F], shared by the CPU kernel
// (src/cpu/cpu_quantize_weight.cc) and the CUDA one (src/cuda/quantize_weight.cu), so
// that the two cannot drift. FP4 square tiles (docs/spec.md, "2-D weight scales"; the jnp
// statement is jax_fp8norm/quantize.py's weight_tiles_reference): one scale per block x
// block tile by the FP4 group rule of fp8norm_math.h (Nvfp4Scale, Mxfp4Scale,
// QuantizeFp4Element), NVFP4's under the tensor's global scale; a partial tile at F's end
// is quantised as that tile padded with zeros (a zero changes no abs-max). FP8 E4M3 along
// K (quantize.py's quantize_per_channel and quantize_blocks): one float32 scale per column,
// or an e8m0 scale per block of rows of each column.
#pragma once

#include <cstdint>

#include "fp8norm_math.h"
#include "named_codes.h"

namespace fp8norm {

// The format attribute of the quantize_weight target.
enum class WeightFormat : int64_t {
  kNvfp4Tiles = 0,
  kMxfp4Tiles = 1,
  kFp8Channels = 2,
  kFp8Blocks = 3,
};
// Their names, which every compiled module exports (constant_bindings.h) and the Python
// package reads the codes from (jax_fp8norm/_quantize_weight_kernel.py).
constexpr NamedCode<WeightFormat> kWeightFormatNames[] = {
    {WeightFormat::kNvfp4Tiles, "nvfp4_tiles"},
    {WeightFormat::kMxfp4Tiles, "mxfp4_tiles"},
    {WeightFormat::kFp8Channels, "fp8_channels"},
    {WeightFormat::kFp8Blocks, "fp8_blocks"},
};

struct QuantizeWeightArgs {
  const void* w;  // [rows, cols] of w_type
  FloatType w_type;
  int64_t rows;  // K, a multiple of block
  int64_t cols;  // F
  // FP4: the tile's side, 16 (NVFP4) or 32 (MXFP4), even; FP8 blocks: the block of rows;
  // FP8 per channel: rows (one band).
  int64_t block;
  WeightFormat format;
  bool nvfp4;
  void* codes;  // [rows, cols] E2M1 or E4M3
  bool codes_packed;
  // FP4: [rows / block, TileColumns] e4m3 (NVFP4) or e8m0 (MXFP4) bytes; FP8: [cols]
  // float32 per channel, or [rows / block, cols] e8m0 bytes.
  uint8_t* scales;
  float* global_scale;  // []: NVFP4's; 1 for the others, which have none
};

FP8NORM_HD bool IsFp4(const QuantizeWeightArgs& a) {
  return a.format == WeightFormat::kNvfp4Tiles || a.format == WeightFormat::kMxfp4Tiles;
}

FP8NORM_HD int64_t TileColumns(const QuantizeWeightArgs& a) {
  return (a.cols + a.block - 1) / a.block;
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

// An FP8 column group's rule (per channel: a whole column; blocks: a block of rows of
// it) from its abs-max (ordered bits).
struct Fp8ColumnScale {
  float scale;  // as stored: float32, or a power of two (NaN: e8m0's 0xFF)
  float recip;  // the blocks' multiplier
  bool blocks;
  bool zero;  // every code 0: a block holding NaN or Inf
};

// Per channel: max(amax / 448, 2^-126), 1 where amax > 0 is false (a zero column, or one
// holding NaN); an Inf gives Inf, whose codes are NaN for Inf and 0 for finite values.
// Blocks: the power-of-two rule, as the norm's groups, at least 2^-127; a block holding
// NaN or Inf gets a NaN scale and zero codes.
FP8NORM_HD Fp8ColumnScale Fp8ColumnScaleOf(bool blocks, uint32_t amax_bits) {
  if (!blocks) {
    const float amax = FloatOf(amax_bits);
    const float scale = amax / Fp8Traits<OutFormat::kE4M3FN>::kMax;
    const float smallest_normal = FloatOf(kF32MinNormalBits);
    const float bounded = scale > smallest_normal ? scale : smallest_normal;
    return Fp8ColumnScale{amax > 0.0f ? bounded : 1.0f, 0.0f, false, false};
  }
  if (amax_bits >= kF32Inf) return Fp8ColumnScale{FloatOf(kF32QuietNan), 0.0f, true, true};
  const RowScale s =
      PowerOfTwoScale(amax_bits, OutFormat::kE4M3FN, FloatType::kE8M0, FloatOf(kF32Inf));
  return Fp8ColumnScale{s.scale, s.recip, true, false};
}

// The E4M3 code of a weight: w / scale per channel, w * recip in blocks, converted as
// ml_dtypes converts (no saturation: neither rule's values pass 448 but by rounding).
FP8NORM_HD uint8_t Fp8ColumnCode(float v, const Fp8ColumnScale& s) {
  if (s.zero) return 0;
  return Fp8Code<OutFormat::kE4M3FN, false>(s.blocks ? v * s.recip : v / s.scale);
}

}  // namespace fp8norm
