// kernel_check's checks of NVFP4 with per-row global scales (global_scale="per_row")
// against the CPU kernel, bit for bit: each row's global scale, its block scales and codes
// from every variant (block_shared, warp_rows, block_registers, and block_shared where a
// group does not fit the registers), and with the columnwise outputs each column's global
// scale (the column kernel before the columnwise one: no one launch for both layouts).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "check_options.h"
#include "check_support.h"
#include "columnwise.h"
#include "cuda_kernels.h"
#include "cuda_launch_plan.h"
#include "rms_norm_fp8.h"
#include "simt.h"

namespace fp8norm {

// Rows of magnitudes over 10^+-3 (global scales far apart), hidden sizes held by one warp,
// by several, and past the register variants' groups (6); zero, Inf and NaN rows among the
// first 7 in the rowwise cases and one columnwise case in three (whose columns' global
// scales are then NaN), finite rows in the others; the residual; a grid of 3 blocks.
int CheckPerRowGlobalScales(bool quick) {
  struct Case {
    int64_t hidden, group;
    bool columnwise;
  };
  std::vector<Case> cases;
  for (const int64_t hidden :
       quick ? std::vector<int64_t>{96, 2048} : std::vector<int64_t>{32, 96, 384, 2048, 4096}) {
    for (const int64_t group : {16, 32, 6}) {
      if (hidden % group != 0) continue;
      for (const bool columnwise : {false, true}) cases.push_back({hidden, group, columnwise});
    }
  }
  int failures = 0;
  int k = 0;
  for (const Case& c : cases) {
    ++k;
    const int64_t hidden = c.hidden, group = c.group;
    const FloatType input =
        k % 3 == 0 ? FloatType::kF32 : (k % 3 == 1 ? FloatType::kBF16 : FloatType::kF16);
    const bool residual = k % 2 == 0;
    const bool specials = !c.columnwise || k % 3 == 0;
    const int64_t rows = c.columnwise ? 96 : (quick ? 9 : 17 + k % 5);
    const size_t elements = static_cast<size_t>(rows * hidden);
    const size_t in_bytes = FloatTypeBytes(input);
    const size_t scale_count = static_cast<size_t>(rows * (hidden / group));
    const size_t t_scale_count = static_cast<size_t>(hidden * (rows / group));
    Rng rng{static_cast<uint64_t>(k) * 6151 + 29};
    ExactBuffer x(elements * in_bytes), res(residual ? elements * in_bytes : 0);
    ExactBuffer gamma(static_cast<size_t>(hidden) * sizeof(float));
    Fill(x, input, rows, hidden, rng, false, input == FloatType::kF16 ? 1.5f : 3.0f);
    if (specials) Fill(x, input, std::min<int64_t>(rows, 7), hidden, rng, true, 2.0f);
    if (residual) Fill(res, input, rows, hidden, rng, false, 1.0f);
    Fill(gamma, FloatType::kF32, 1, hidden, rng, false, 0.5f);
    // Each output twice: the CPU kernel's, then the emulated kernels'.
    struct Outputs {
      ExactBuffer y, scales, gs, residual_out, r, y_t, scales_t, gs_t;
    };
    const auto outputs = [&] {
      return Outputs{ExactBuffer(elements / 2),
                     ExactBuffer(scale_count),
                     ExactBuffer(static_cast<size_t>(rows) * sizeof(float)),
                     ExactBuffer(residual ? elements * in_bytes : 0),
                     ExactBuffer(c.columnwise ? static_cast<size_t>(rows) * sizeof(float) : 0),
                     ExactBuffer(c.columnwise ? elements / 2 : 0),
                     ExactBuffer(c.columnwise ? t_scale_count : 0),
                     ExactBuffer(c.columnwise ? static_cast<size_t>(hidden) * sizeof(float) : 0)};
    };
    const auto args_of = [&](Outputs& o) {
      RmsNormFp8Args a{};
      a.x = x.data;
      a.residual = residual ? res.data : nullptr;
      a.gamma = gamma.data;
      a.y = o.y.data;
      a.scales = o.scales.data;
      a.residual_out = residual ? o.residual_out.data : nullptr;
      a.rows = rows;
      a.hidden = hidden;
      a.group_size = group;
      a.input_type = input;
      a.residual_type = input;
      a.gamma_type = FloatType::kF32;
      a.scale_type = FloatType::kE4M3;
      a.out_format = OutFormat::kE2M1;
      a.y_packed = true;
      a.constants = RowConstants{RoundTo(input, 1e-6f), RoundTo(input, k % 4 < 2 ? 1.0f : 0.0f),
                                 INFINITY, false};
      a.global_scales = reinterpret_cast<float*>(o.gs.data);
      if (c.columnwise) {
        a.inverse_rms = reinterpret_cast<float*>(o.r.data);
        a.columns = ColumnOutputs{o.y_t.data, o.scales_t.data, group,
                                  reinterpret_cast<float*>(o.gs_t.data)};
      }
      return a;
    };
    Outputs cpu = outputs();
    RmsNormFp8Cpu(args_of(cpu), [](int64_t n, const std::function<void(int64_t)>& task) {
      for (int64_t i = 0; i < n; ++i) task(i);
    });
    for (const KernelVariant variant :
         {KernelVariant::kBlockShared, KernelVariant::kWarpRows, KernelVariant::kBlockRegisters}) {
      Outputs got = outputs();
      const RmsNormFp8Args a = args_of(got);
      const std::string name =
          std::string("per-row global scales ") + kKernelVariantNames[static_cast<int>(variant)] +
          " " + std::to_string(rows) + "x" + std::to_string(hidden) + " group " +
          std::to_string(group) + " " + TypeName(input) + (residual ? " add" : "") +
          (c.columnwise ? " columnwise" : "") + (specials ? " specials" : "");
      if (name_cases) std::fprintf(stderr, "case %s\n", name.c_str());
      SetKernelVariant(variant);
      UseDevice(kLimits[k % 2 == 0 ? 0 : 3]);
      cudaError_t status;
      {
        simt::ScopedBuffers buffers;
        AddBuffers(buffers, {{"x", &x},
                             {"gamma", &gamma},
                             {"y", &got.y},
                             {"scales", &got.scales},
                             {"global_scales", &got.gs},
                             {"residual", residual ? &res : nullptr},
                             {"residual_out", residual ? &got.residual_out : nullptr},
                             {"inverse_rms", c.columnwise ? &got.r : nullptr},
                             {"y_t", c.columnwise ? &got.y_t : nullptr},
                             {"scales_t", c.columnwise ? &got.scales_t : nullptr},
                             {"global_scales_t", c.columnwise ? &got.gs_t : nullptr}});
        status = LaunchRmsNormFp8(nullptr, 0, a);
      }
      SetKernelVariant(KernelVariant::kAuto);
      UseDevice(kLimits[0]);
      std::string launch_error;
      for (const simt::LaunchRecord& launch : simt::TakeLaunches()) {
        if (!launch.error.empty()) launch_error = launch.error;
      }
      if (status != cudaSuccess || !launch_error.empty()) {
        std::printf("FAIL %s: status %d %s\n", name.c_str(), static_cast<int>(status),
                    launch_error.c_str());
        ++failures;
        continue;
      }
      bool same = SameBytes(got.gs, cpu.gs, "global_scales", name);
      same = SameBytes(got.scales, cpu.scales, "scales", name) && same;
      same = SameBytes(got.y, cpu.y, "y", name) && same;
      if (residual)
        same = SameBytes(got.residual_out, cpu.residual_out, "residual_out", name) && same;
      if (c.columnwise) {
        same = SameBytes(got.gs_t, cpu.gs_t, "global_scales_t", name) && same;
        same = SameBytes(got.scales_t, cpu.scales_t, "scales_t", name) && same;
        same = SameBytes(got.y_t, cpu.y_t, "y_t", name) && same;
      }
      if (!same) {
        ++failures;
        if (stop_at_failure) return failures;
      }
    }
  }
  return failures;
}

}  // namespace fp8norm
