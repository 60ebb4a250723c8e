// The CPU kernel timed on its own, without XLA: RmsNormFp8Cpu on warm input and output
// buffers (no page faults, no dispatch), the best of `repeats` calls, spread over
// `threads` std::threads started by each call (tens of microseconds, which small shapes
// with several threads feel).
// Prints the variant, the time and a hash of every output, so that two builds (say, before
// and after a change) can be timed in turn and shown to give the same bits.
//
// Built and run from the repository root as benchmarks/README.md says;
//   build/cpu_kernel [rows] [hidden] [bf16|f16|f32] [threads] [add: 0|1] [group] [repeats]
//                    [fp8|nvfp4|mxfp4]
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "rms_norm_fp8.h"

using fp8norm::FloatType;

int main(int argc, char** argv) {
  const auto arg = [&](int i, const char* fallback) { return argc > i ? argv[i] : fallback; };
  const int64_t rows = std::atoll(arg(1, "4096"));
  const int64_t hidden = std::atoll(arg(2, "4096"));
  const char* dtype = arg(3, "bf16");
  const int threads = std::atoi(arg(4, "1"));
  const bool add = std::atoi(arg(5, "0")) != 0;
  const int64_t group = std::atoll(arg(6, "0"));
  const int repeats = std::atoi(arg(7, "20"));
  // FP4 (NVFP4: e4m3 scales and a global scale; MXFP4: e8m0 scales) needs a group size.
  const std::string format = arg(8, "fp8");
  const bool fp4 = format == "nvfp4" || format == "mxfp4";
  if (rows <= 0 || hidden <= 0 || threads <= 0 || repeats <= 0 || group < 0 ||
      (group > 0 && hidden % group != 0) || (fp4 && (group <= 0 || group % 2 != 0)) ||
      !(fp4 || format == "fp8")) {
    std::fprintf(stderr,
                 "usage: %s [rows] [hidden] [bf16|f16|f32] [threads] [add] [group] "
                 "[repeats] [fp8|nvfp4|mxfp4 (with an even group)]\n",
                 argv[0]);
    return 2;
  }
  const FloatType type = std::strcmp(dtype, "f32") == 0   ? FloatType::kF32
                         : std::strcmp(dtype, "f16") == 0 ? FloatType::kF16
                                                          : FloatType::kBF16;
  const size_t n = static_cast<size_t>(rows * hidden);
  const size_t bytes = fp8norm::FloatTypeBytes(type);
  std::vector<uint8_t> x(n * bytes), residual(n * bytes), residual_out(n * bytes), y(n);
  const int64_t group_size = group > 0 ? group : hidden;  // the kernels' one scale per row
  const int64_t groups = fp8norm::GroupsPerRow(hidden, group_size);
  std::vector<float> gamma(hidden), scales(rows * groups);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  for (size_t i = 0; i < n; ++i) {
    const float v = normal(rng);
    if (type == FloatType::kF32) {
      std::memcpy(&x[i * 4], &v, 4);
    } else {
      const uint16_t b =
          type == FloatType::kBF16 ? fp8norm::ToBF16(v).bits : fp8norm::ToF16(v).bits;
      std::memcpy(&x[i * 2], &b, 2);
    }
  }
  residual = x;
  for (float& g : gamma) g = 1.0f + 0.1f * normal(rng);

  fp8norm::RmsNormFp8Args a{};
  a.x = x.data();
  a.residual = add ? residual.data() : nullptr;
  a.gamma = gamma.data();
  a.y = y.data();
  a.scales = scales.data();
  a.residual_out = add ? residual_out.data() : nullptr;
  a.rows = rows;
  a.hidden = hidden;
  a.group_size = group_size;
  a.input_type = a.residual_type = type;
  a.gamma_type = a.scale_type = FloatType::kF32;
  a.out_format = fp8norm::OutFormat::kE4M3FN;
  a.constants = fp8norm::RowConstants{1e-6f, 0.0f, INFINITY, false};
  const float global_scale = 0x1p-9f;
  if (fp4) {
    a.out_format = fp8norm::OutFormat::kE2M1;
    a.y_packed = true;
    a.scale_type = format == "nvfp4" ? FloatType::kE4M3 : FloatType::kE8M0;
    a.global_scale = format == "nvfp4" ? &global_scale : nullptr;
    a.constants.power_of_two = format == "mxfp4";
  }
  const fp8norm::ParallelFor parallel_for = [threads](int64_t tasks,
                                                      const std::function<void(int64_t)>& task) {
    std::atomic<int64_t> next{0};
    const auto drain = [&] {
      for (int64_t i = next++; i < tasks; i = next++) task(i);
    };
    std::vector<std::thread> helpers;
    for (int i = 1; i < threads; ++i) helpers.emplace_back(drain);
    drain();
    for (auto& helper : helpers) helper.join();
  };

  double best_ms = INFINITY;
  for (int r = 0; r < repeats; ++r) {
    const auto start = std::chrono::steady_clock::now();
    if (!fp8norm::RmsNormFp8Cpu(a, parallel_for)) return 1;
    const std::chrono::duration<double, std::milli> took = std::chrono::steady_clock::now() - start;
    best_ms = std::min(best_ms, took.count());
  }
  uint64_t hash = 1469598103934665603ull;  // FNV-1a over y, the scales and residual_out
  const auto mix = [&hash](const void* p, size_t count) {
    for (size_t i = 0; i < count; ++i)
      hash = (hash ^ static_cast<const uint8_t*>(p)[i]) * 1099511628211ull;
  };
  mix(y.data(), y.size());
  mix(scales.data(), scales.size() * sizeof(float));
  if (add) mix(residual_out.data(), residual_out.size());
  std::printf("%s %s %lld x %lld %s, %d thread(s)%s%s: best %.3f ms of %d, outputs %016llx\n",
              fp8norm::CpuKernelVariant(), format.c_str(), static_cast<long long>(rows),
              static_cast<long long>(hidden), dtype, threads, add ? ", add" : "",
              group > 0 ? (", group " + std::to_string(group)).c_str() : "", best_ms, repeats,
              static_cast<unsigned long long>(hash));
  return 0;
}
