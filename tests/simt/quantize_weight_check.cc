// kernel_check's check of the weight quantiser's kernels (quantize_weight.cu) against the
// CPU kernel (cpu_quantize_weight.cc), bit for bit: codes (FP4 packed and one per byte),
// scales and the global scale, for NVFP4 and MXFP4 tiles and FP8 per channel and in
// blocks, every weight type, F a multiple of the tile and not (odd, so that packed bytes
// straddle tiles and rows). Each tile's magnitude differs from its neighbours' by a power
// of two, so that a scale read from the wrong tile or block changes codes; the special
// cases hold a zero tile and a NaN or an Inf.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "check_options.h"
#include "check_support.h"
#include "cpu_quantize_weight.h"
#include "cuda_kernels.h"
#include "quantize_weight.h"
#include "simt.h"

namespace fp8norm {
namespace {

struct WeightCase {
  int64_t rows, cols;
  WeightFormat format;
  FloatType type;
  bool packed;
  float special;  // 0: none; else a zero tile and this value in the second tile row
};

void FillWeight(ExactBuffer& w, const WeightCase& c, int64_t block, Rng& rng) {
  for (int64_t i = 0; i < c.rows; ++i) {
    for (int64_t j = 0; j < c.cols; ++j) {
      const int64_t step = (i / block + 3 * (j / block)) % 9;
      float v = rng.Normal() * std::ldexp(1.0f, static_cast<int>(step) - 4);
      if (c.special != 0.0f && i < block && j < block) v = 0.0f;
      if (c.special != 0.0f && i == block + 1 && j == c.cols - 1) v = c.special;
      StoreAs(c.type, w.data, i * c.cols + j, v);
    }
  }
}

// The side of a format's tile, or its block of rows (FP8 blocks: MXFP8's 32).
int64_t BlockOf(WeightFormat format) { return format == WeightFormat::kNvfp4Tiles ? 16 : 32; }

bool RunWeightCase(const WeightCase& c) {
  const bool nvfp4 = c.format == WeightFormat::kNvfp4Tiles;
  const bool fp4 = nvfp4 || c.format == WeightFormat::kMxfp4Tiles;
  const int64_t block = c.format == WeightFormat::kFp8Channels ? c.rows : BlockOf(c.format);
  const int64_t scale_bytes = c.format == WeightFormat::kFp8Channels
                                  ? c.cols * 4
                                  : c.rows / block * (fp4 ? (c.cols + block - 1) / block : c.cols);
  const bool packed = fp4 && c.packed;
  const size_t code_bytes = static_cast<size_t>(packed ? c.rows * c.cols / 2 : c.rows * c.cols);
  ExactBuffer w(static_cast<size_t>(c.rows * c.cols) * FloatTypeBytes(c.type));
  Rng rng{static_cast<uint64_t>(c.rows * 131 + c.cols * 7 + static_cast<int>(c.format))};
  FillWeight(w, c, BlockOf(c.format), rng);
  ExactBuffer codes(code_bytes), scales(static_cast<size_t>(scale_bytes)), gs(sizeof(float));
  ExactBuffer cpu_codes(code_bytes), cpu_scales(static_cast<size_t>(scale_bytes)),
      cpu_gs(sizeof(float));
  QuantizeWeightArgs a{w.data,
                       c.type,
                       c.rows,
                       c.cols,
                       block,
                       c.format,
                       nvfp4,
                       codes.data,
                       packed,
                       scales.data,
                       reinterpret_cast<float*>(gs.data)};
  cudaError_t status;
  {
    simt::ScopedBuffers buffers;
    AddBuffers(buffers, {{"w", &w}, {"codes", &codes}, {"scales", &scales}, {"global_scale", &gs}});
    status = LaunchQuantizeWeight(nullptr, a);
  }
  a.codes = cpu_codes.data;
  a.scales = cpu_scales.data;
  a.global_scale = reinterpret_cast<float*>(cpu_gs.data);
  QuantizeWeightCpu(a, [](int64_t n, const std::function<void(int64_t)>& task) {
    for (int64_t i = 0; i < n; ++i) task(i);
  });
  const char* format_names[] = {"nvfp4 ", "mxfp4 ", "fp8 channels ", "fp8 blocks "};
  const std::string name = std::string("quantize_weight ") +
                           format_names[static_cast<int>(c.format)] + std::to_string(c.rows) + "x" +
                           std::to_string(c.cols) + " " + TypeName(c.type) +
                           (packed ? " packed" : "") +
                           (c.special != 0.0f ? " special " + std::to_string(c.special) : "");
  NameCase(name);
  if (status != cudaSuccess) {
    std::printf("FAIL %s: %s\n", name.c_str(), cudaGetErrorString(status));
    return false;
  }
  return SameBytes(gs, cpu_gs, "global_scale", name) &&
         SameBytes(scales, cpu_scales, "scales", name) &&
         SameBytes(codes, cpu_codes, "codes", name);
}

}  // namespace

int CheckQuantizeWeight(bool quick) {
  std::vector<WeightCase> cases;
  for (const WeightFormat format : {WeightFormat::kNvfp4Tiles, WeightFormat::kMxfp4Tiles,
                                    WeightFormat::kFp8Channels, WeightFormat::kFp8Blocks}) {
    const int64_t block = BlockOf(format);
    // Wider than a CUDA block's 256 columns, for FP8's strips.
    const int64_t wide = format == WeightFormat::kFp8Blocks ? 300 : 2 * block + 7;
    for (const int64_t cols : {3 * block, wide, int64_t{1}}) {
      for (const FloatType type : {FloatType::kF32, FloatType::kBF16, FloatType::kF16}) {
        if (quick && type != FloatType::kBF16) continue;
        for (const bool packed : {true, false}) {
          cases.push_back({(quick ? 2 : 3) * block, cols, format, type, packed, 0.0f});
        }
      }
    }
    for (const float special : {NAN, -INFINITY}) {
      cases.push_back({2 * block, 2 * block + 7, format, FloatType::kF32, true, special});
    }
  }
  int failures = 0;
  for (const WeightCase& c : cases) {
    if (stop_at_failure && failures > 0) break;
    failures += RunWeightCase(c) ? 0 : 1;
  }
  simt::TakeLaunches();
  return failures;
}

}  // namespace fp8norm
