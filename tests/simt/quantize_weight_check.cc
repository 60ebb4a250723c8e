// kernel_check's check of the weight quantiser's kernels (quantize_weight.cu) against the
// CPU kernel (cpu_quantize_weight.cc), bit for bit: codes (packed and one per byte), tile
// scales and the global scale, for NVFP4 and MXFP4 tiles, every weight type, F a multiple
// of the tile and not (odd, so that packed bytes straddle tiles and rows). Each tile's
// magnitude differs from its neighbours' by a power of two, so that a scale read from
// the wrong tile changes codes; the special cases hold a zero tile and a NaN or an Inf.
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
  bool nvfp4;
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

bool RunWeightCase(const WeightCase& c) {
  const int64_t block = c.nvfp4 ? 16 : 32;
  const int64_t tiles = c.rows / block * ((c.cols + block - 1) / block);
  const size_t code_bytes = static_cast<size_t>(c.packed ? c.rows * c.cols / 2 : c.rows * c.cols);
  ExactBuffer w(static_cast<size_t>(c.rows * c.cols) * FloatTypeBytes(c.type));
  Rng rng{static_cast<uint64_t>(c.rows * 131 + c.cols * 7 + (c.nvfp4 ? 1 : 2))};
  FillWeight(w, c, block, rng);
  ExactBuffer codes(code_bytes), scales(static_cast<size_t>(tiles)), gs(sizeof(float));
  ExactBuffer cpu_codes(code_bytes), cpu_scales(static_cast<size_t>(tiles)), cpu_gs(sizeof(float));
  QuantizeWeightArgs a{
      w.data,  c.type,     c.rows,   c.cols,      block,
      c.nvfp4, codes.data, c.packed, scales.data, reinterpret_cast<float*>(gs.data)};
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
  const std::string name = std::string("quantize_weight ") + (c.nvfp4 ? "nvfp4 " : "mxfp4 ") +
                           std::to_string(c.rows) + "x" + std::to_string(c.cols) + " " +
                           TypeName(c.type) + (c.packed ? " packed" : "") +
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
  for (const bool nvfp4 : {true, false}) {
    const int64_t block = nvfp4 ? 16 : 32;
    for (const int64_t cols : {3 * block, 2 * block + 7, int64_t{1}}) {
      for (const FloatType type : {FloatType::kF32, FloatType::kBF16, FloatType::kF16}) {
        if (quick && type != FloatType::kBF16) continue;
        for (const bool packed : {true, false}) {
          cases.push_back({(quick ? 2 : 3) * block, cols, nvfp4, type, packed, 0.0f});
        }
      }
    }
    for (const float special : {NAN, -INFINITY}) {
      cases.push_back({2 * block, 2 * block + 7, nvfp4, FloatType::kF32, true, special});
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
