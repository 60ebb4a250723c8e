// The columnwise pass of rms_norm_fp8 / add_rms_norm_fp8 (docs/spec.md, "Columnwise
// outputs"): n quantised along the rows, for a GEMM that contracts over them. The pass
// takes the call's RmsNormFp8Args: its inputs, constants and each row's r as the rowwise
// pass saved it (read here, never written), and the columnwise outputs in a.columns
// (y_t, scales_t, block_rows); never the rowwise y and scales. The math of a column's block
// that the CPU and CUDA kernels share. Plain C++, compiled by the host compiler and nvcc.
#pragma once

#include <cstdint>

#include "fp4_parts.h"
#include "fp8norm_math.h"
#include "rms_norm_fp8.h"

namespace fp8norm {

// Rows a columnwise block of the call spans: the recipe's block, or with a static scale
// (no block) kStaticColumnRows, the tile both kernels take.
constexpr int64_t kStaticColumnRows = 32;
FP8NORM_HD int64_t ColumnBlockRows(const RmsNormFp8Args& a) {
  return a.static_scale != nullptr ? kStaticColumnRows : a.columns.block_rows;
}

// The blocks of rows the kernels take, the last one shorter with a static scale.
FP8NORM_HD int64_t RowBlocksOf(const RmsNormFp8Args& a) {
  return (a.rows + ColumnBlockRows(a) - 1) / ColumnBlockRows(a);
}

// Blocks per column: scales_t's second dimension.
FP8NORM_HD int64_t ColumnBlocks(const RmsNormFp8Args& a) {
  return a.static_scale != nullptr ? 1 : a.rows / a.columns.block_rows;
}

// A row is finite (no NaN or Inf, no overflowing sum of squares) exactly when its saved r
// is not NaN (SavedInverseRms). The scale functions read a row's finiteness from its sum
// of squares: a block of finite rows passes 0 for it, any other block NaN.
FP8NORM_HD float BlockFiniteness(bool rows_finite) {
  return rows_finite ? 0.0f : FloatOf(kF32QuietNan);
}

// How one column's block becomes codes: the recipe's group rule over the block's n.
struct ColumnScale {
  RowScale fp8;
  Fp4Scale fp4;
};

// The NVFP4 global scale a column's blocks are quantised under: with the Hadamard
// transform, whose values are at most d times n's, d times the call's (or the column's),
// so that its block scales stay within e4m3's range (exact: d is a power of two).
FP8NORM_HD float ColumnGlobalScale(const ColumnOutputs& columns, float global_scale) {
  return columns.hadamard ? global_scale * float(columns.block_rows) : global_scale;
}

// The scale of a column's block from the abs-max of its n (ordered bits) and whether all
// of its rows are finite; global_scale: NVFP4's (0 for every other format).
FP8NORM_HD ColumnScale ColumnBlockScale(const RmsNormFp8Args& a, bool rows_finite, uint32_t amax,
                                        float global_scale) {
  ColumnScale s{};
  if (IsFp4(a)) {
    s.fp4 = Fp4ScaleOf(a, BlockFiniteness(rows_finite), amax, global_scale);
  } else {
    s.fp8 =
        ComputeScale(BlockFiniteness(rows_finite), amax, a.out_format, a.scale_type, a.constants);
  }
  return s;
}

// The Hadamard transform of a column's block of D rows of n, v[0], v[stride], ...,
// in place (a.columns.hadamard: the wgrad GEMM's operand, transformed before it is
// quantised); returns the abs-max (ordered bits) of the transformed values, which the
// block's scale takes instead of n's.
template <int D>
FP8NORM_HD uint32_t HadamardColumnBlock(const RmsNormFp8Args& a, float* v, int64_t stride) {
  HadamardBlock<D>(v, stride, a.columns.hadamard_mask);
  uint32_t amax = 0;
#pragma unroll
  for (int i = 0; i < D; ++i) {
    const uint32_t m = AbsBits(v[i * stride]);
    amax = m > amax ? m : amax;
  }
  return amax;
}

// A static scale's code for an element of a row: the rowwise rule, element by element.
FP8NORM_HD ColumnScale StaticColumnScale(const RmsNormFp8Args& a, bool row_finite,
                                         float static_scale) {
  ColumnScale s{};
  s.fp8 = StaticScale(BlockFiniteness(row_finite), static_scale, a.scale_type);
  return s;
}

// The scale as scales_t stores it (StoreAs / the CUDA kernels' StoreScale encode it).
FP8NORM_HD float StoredScale(const RmsNormFp8Args& a, const ColumnScale& s) {
  return IsFp4(a) ? s.fp4.scale : s.fp8.scale;
}

// The code of a normalised element under its block's scale: FP8's byte, or FP4's code in
// the low nibble.
FP8NORM_HD uint8_t ColumnCode(const RmsNormFp8Args& a, const ColumnScale& s, float normed) {
  switch (a.out_format) {
    case OutFormat::kE4M3FN:
      return QuantizeElement<OutFormat::kE4M3FN>(normed, s.fp8.recip);
    case OutFormat::kE4M3FNUZ:
      return QuantizeElement<OutFormat::kE4M3FNUZ>(normed, s.fp8.recip);
    default:
      return QuantizeFp4Element(normed, s.fp4);
  }
}

}  // namespace fp8norm
