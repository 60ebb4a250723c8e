// kernel_check's check of the output gradient's FP4 quantiser (quantize_gradient.cu)
// against the CPU kernel, bit for bit: both copies, NVFP4 and MXFP4, round-to-nearest and
// stochastic rounding, the columns copy's Hadamard transform, packed and one-per-byte
// codes, an odd number of columns (packed bytes that straddle rows), NaN and Inf, and (the
// full run) more rows than the 65535 blocks of a striding grid. Before that, the butterfly itself
// (fp4_parts.h), which both kernels share: twice over a block with no signs it is d times the
// identity, exactly on small integers, which a skipped or repeated stage breaks.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "check_options.h"
#include "check_support.h"
#include "cuda_kernels.h"
#include "fp4_parts.h"
#include "quantize_gradient.h"
#include "simt.h"

namespace fp8norm {
namespace {

template <int D>
bool ButterflyTwiceIsScaledIdentity() {
  float v[D], w[D];
  for (int i = 0; i < D; ++i) v[i] = w[i] = float((i * 7) % 11) - 5.0f;
  HadamardBlock<D>(w, 1, 0u);
  HadamardBlock<D>(w, 1, 0u);
  for (int i = 0; i < D; ++i) {
    if (w[i] != float(D) * v[i]) {
      std::printf("FAIL the %d-point butterfly applied twice is not %d times the identity\n", D, D);
      return false;
    }
  }
  return true;
}

}  // namespace

int CheckQuantizeGradient(bool quick) {
  int failures = 0;
  if (!ButterflyTwiceIsScaledIdentity<16>() || !ButterflyTwiceIsScaledIdentity<32>()) {
    ++failures;
  }
  struct Shape {
    int64_t rows, cols;
  };
  const std::vector<Shape> shapes =
      quick ? std::vector<Shape>{{64, 37}, {32, 96}}
            : std::vector<Shape>{{64, 37}, {32, 96}, {96, 64}, {65535 + 33, 32}};
  UseDevice(kLimits[0]);
  const uint32_t key_words[2] = {0x9E3779B9u, 0x7F4A7C15u};
  int k = 0;
  for (const Shape shape : shapes) {
    for (const bool nvfp4 : {true, false}) {
      for (const bool columns : {false, true}) {
        for (const bool stochastic : {false, true}) {
          for (const bool hadamard : {false, true}) {
            const int64_t block = nvfp4 ? 16 : 32;
            if (hadamard && !columns) continue;
            if ((columns ? shape.rows : shape.cols) % block != 0) continue;
            ++k;
            if (!shard.Takes()) continue;
            const bool packed = k % 4 != 3;
            const bool specials = k % 3 == 0;
            // The longest: only its rows copy, with stochastic rounding.
            if (shape.rows > 65535 && (columns || !stochastic)) continue;
            const int64_t rows = shape.rows, cols = shape.cols;
            const size_t elements = static_cast<size_t>(rows * cols);
            Rng rng{static_cast<uint64_t>(k) * 104729 + 3};
            ExactBuffer g(elements * sizeof(float)), key(sizeof(key_words));
            Fill(g, FloatType::kF32, rows, cols, rng, specials, 3.0f);
            std::memcpy(key.data, key_words, sizeof(key_words));
            const size_t code_bytes = packed ? elements / 2 + elements % 2 : elements;
            const size_t scale_count = elements / static_cast<size_t>(block);
            const size_t global_count = nvfp4 ? (columns ? 1 : static_cast<size_t>(rows)) : 0;
            ExactBuffer codes(code_bytes), codes_cpu(code_bytes);
            ExactBuffer scales(scale_count), scales_cpu(scale_count);
            ExactBuffer global(global_count * sizeof(float)), global_cpu(global.bytes);
            QuantizeGradientArgs a{reinterpret_cast<const float*>(g.data),
                                   reinterpret_cast<const uint32_t*>(key.data),
                                   rows,
                                   cols,
                                   block,
                                   nvfp4,
                                   columns,
                                   stochastic,
                                   hadamard,
                                   nvfp4 ? uint32_t{0xC05D} : uint32_t{0x6DEB8448},
                                   codes.data,
                                   packed,
                                   scales.data,
                                   nvfp4 ? reinterpret_cast<float*>(global.data) : nullptr};
            const std::string name = std::string("quantize_gradient ") + std::to_string(rows) +
                                     "x" + std::to_string(cols) + (nvfp4 ? " nvfp4" : " mxfp4") +
                                     (columns ? " columns" : " rows") +
                                     (stochastic ? " sr" : " rtn") + (hadamard ? " hadamard" : "") +
                                     (packed ? " packed" : " unpacked") +
                                     (specials ? " specials" : "");
            if (name_cases) std::fprintf(stderr, "case %s\n", name.c_str());
            cudaError_t status;
            {
              simt::ScopedBuffers buffers;
              AddBuffers(buffers, {{"g", &g},
                                   {"key", &key},
                                   {"codes", &codes},
                                   {"scales", &scales},
                                   {"global_scales", nvfp4 ? &global : nullptr}});
              status = LaunchQuantizeGradient(nullptr, a);
            }
            a.codes = codes_cpu.data;
            a.scales = scales_cpu.data;
            a.global_scales = nvfp4 ? reinterpret_cast<float*>(global_cpu.data) : nullptr;
            const ParallelFor serial = [](int64_t n, const std::function<void(int64_t)>& task) {
              for (int64_t i = 0; i < n; ++i) task(i);
            };
            QuantizeGradientCpu(a, serial);
            bool ok = status == cudaSuccess;
            if (!ok) std::printf("FAIL %s: %s\n", name.c_str(), cudaGetErrorString(status));
            ok = ok && SameBytes(codes, codes_cpu, "codes", name) &&
                 SameBytes(scales, scales_cpu, "scales", name) &&
                 SameBytes(global, global_cpu, "global scales", name);
            if (!ok) {
              ++failures;
              if (stop_at_failure) return failures;
            }
          }
        }
      }
    }
  }
  simt::TakeLaunches();
  return failures;
}

}  // namespace fp8norm
