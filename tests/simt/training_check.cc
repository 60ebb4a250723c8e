// kernel_check's checks of the training kernels (backward.cu, columnwise.cu) against the
// CPU kernels, bit for bit: the backward's dx, dresidual and dgamma, and the columnwise
// outputs, from the columnwise kernel and from the one launch of both layouts.
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
#include "rms_norm_backward.h"
#include "rms_norm_fp8.h"
#include "simt.h"

namespace fp8norm {

// The backward's two kernels against the CPU kernel: every input type, dn type and the
// residual (16-bit beside a float32 x too, as the all-reduce layer's float32 sum gives it),
// hidden sizes around the block's 256 threads and the 32 columns of a dgamma block. One
// case in three holds zeros, Inf, NaN and r of 0, NaN and Inf; the others are finite
// rows, dn over 40 decades, whose dx and dgamma must come out finite, so that they compare
// numbers rather than NaN with NaN. The full run adds rows past the rows' grid of 65535
// blocks.
int CheckBackward(bool quick) {
  int failures = 0;
  const std::vector<int64_t> hiddens =
      quick ? std::vector<int64_t>{7, 300} : std::vector<int64_t>{1, 7, 33, 300, 1000};
  struct Case {
    int64_t rows, hidden;
    FloatType input;
    bool residual;
    FloatType dn_type, residual_type;
    float weight_offset;
  };
  std::vector<Case> cases;
  int k = 0;
  for (const int64_t hidden : hiddens) {
    for (const FloatType input : {FloatType::kBF16, FloatType::kF32, FloatType::kF16}) {
      for (const bool residual : {false, true}) {
        ++k;
        // From k / 2, which the cases with and without a residual share: each gets both.
        const int m = k / 2;
        const FloatType residual_type =
            residual && input == FloatType::kF32 && m % 2 == 1 ? FloatType::kBF16 : input;
        cases.push_back({quick ? 3 : 1 + k % 9, hidden, input, residual,
                         m % 2 == 0 ? FloatType::kF32 : input, residual_type,
                         m % 3 == 0 ? 1.0f : 0.0f});
      }
    }
  }
  if (!quick) {
    cases.push_back({65535 + 6, 3, FloatType::kF32, false, FloatType::kF32, FloatType::kF32, 0.0f});
  }
  int mixed = 0;  // cases with a 16-bit residual beside float32 x
  k = 0;
  for (const Case& c : cases) {
    ++k;
    const int64_t rows = c.rows, hidden = c.hidden;
    const FloatType input = c.input;
    const bool residual = c.residual;
    const bool specials = k % 3 == 0;
    const FloatType dn_type = c.dn_type, residual_type = c.residual_type;
    mixed += residual && residual_type != input;
    const size_t elements = static_cast<size_t>(rows * hidden);
    const size_t in_bytes = FloatTypeBytes(input), res_bytes = FloatTypeBytes(residual_type);
    Rng rng{static_cast<uint64_t>(k) * 7919 + 17};
    ExactBuffer x(elements * in_bytes), res(residual ? elements * res_bytes : 0);
    ExactBuffer dn(elements * FloatTypeBytes(dn_type)), dres(residual ? elements * res_bytes : 0);
    ExactBuffer gamma(static_cast<size_t>(hidden) * sizeof(float));
    ExactBuffer r(static_cast<size_t>(rows) * sizeof(float));
    Fill(x, input, rows, hidden, rng, specials, 2.0f);
    if (residual) Fill(res, residual_type, rows, hidden, rng, false, 1.0f);
    // dx in float16 holds at most 65504.
    const bool half = dn_type == FloatType::kF16 || input == FloatType::kF16;
    Fill(dn, dn_type, rows, hidden, rng, specials, half ? 3.0f : 20.0f);
    if (residual) Fill(dres, residual_type, rows, hidden, rng, false, 1.0f);
    Fill(gamma, FloatType::kF32, 1, hidden, rng, false, 0.5f);
    for (int64_t i = 0; i < rows; ++i) {
      float v = rng.Uniform() + 0.1f;
      if (specials) v = i == 2 ? 0.0f : (i == 4 ? NAN : (i == 6 ? INFINITY : v));
      StoreAs(FloatType::kF32, r.data, i, v);
    }
    ExactBuffer dx(elements * in_bytes), dx_cpu(elements * in_bytes);
    ExactBuffer dresidual(residual ? elements * res_bytes : 0), dresidual_cpu(dresidual.bytes);
    ExactBuffer dgamma(static_cast<size_t>(hidden) * sizeof(float)), dgamma_cpu(dgamma.bytes);
    RmsNormBackwardArgs a{dn.data,
                          x.data,
                          residual ? res.data : nullptr,
                          residual ? dres.data : nullptr,
                          gamma.data,
                          reinterpret_cast<const float*>(r.data),
                          dx.data,
                          residual ? dresidual.data : nullptr,
                          reinterpret_cast<float*>(dgamma.data),
                          rows,
                          hidden,
                          dn_type,
                          input,
                          residual_type,
                          FloatType::kF32,
                          c.weight_offset};
    const std::string name = "backward " + std::to_string(rows) + "x" + std::to_string(hidden) +
                             " " + TypeName(input) +
                             (residual ? std::string(" add ") + TypeName(residual_type) : "") +
                             (specials ? " specials" : "");
    if (name_cases) std::fprintf(stderr, "case %s\n", name.c_str());
    cudaError_t status;
    {
      simt::ScopedBuffers buffers;
      AddBuffers(buffers, {{"dn", &dn},
                           {"x", &x},
                           {"gamma", &gamma},
                           {"inverse_rms", &r},
                           {"dx", &dx},
                           {"dgamma", &dgamma},
                           {"residual", residual ? &res : nullptr},
                           {"d_residual_out", residual ? &dres : nullptr},
                           {"dresidual", residual ? &dresidual : nullptr}});
      status = LaunchRmsNormBackward(nullptr, a);
    }
    a.dx = dx_cpu.data;
    a.dresidual = residual ? dresidual_cpu.data : nullptr;
    a.dgamma = reinterpret_cast<float*>(dgamma_cpu.data);
    const ParallelFor serial = [](int64_t n, const std::function<void(int64_t)>& task) {
      for (int64_t i = 0; i < n; ++i) task(i);
    };
    RmsNormBackwardCpu(a, serial);
    if (status != cudaSuccess) {
      std::printf("FAIL %s: %s\n", name.c_str(), cudaGetErrorString(status));
      ++failures;
      continue;
    }
    bool ok = SameBytes(dx, dx_cpu, "dx", name) && SameBytes(dgamma, dgamma_cpu, "dgamma", name);
    if (residual) ok = ok && SameBytes(dresidual, dresidual_cpu, "dresidual", name);
    if (ok && !specials) {
      for (int64_t j = 0; j < hidden && ok; ++j) {
        ok = std::isfinite(reinterpret_cast<const float*>(dgamma.data)[j]);
      }
      for (int64_t i = 0; i < rows * hidden && ok; ++i) {
        const float v = input == FloatType::kF16 ? ToFloat(reinterpret_cast<const F16*>(dx.data)[i])
                        : input == FloatType::kBF16
                            ? ToFloat(reinterpret_cast<const BF16*>(dx.data)[i])
                            : reinterpret_cast<const float*>(dx.data)[i];
        ok = std::isfinite(v);
      }
      if (!ok) std::printf("FAIL %s: dx or dgamma is not finite on finite rows\n", name.c_str());
    }
    if (!ok) {
      ++failures;
      if (stop_at_failure) return failures;
    }
  }
  if (mixed == 0) {
    std::printf("FAIL backward: no case has a 16-bit residual beside float32 x\n");
    ++failures;
  }
  simt::TakeLaunches();
  return failures;
}

// The columnwise kernel against the CPU kernel's columnwise outputs (made in its rows'
// pass): every output format and scale rule, the residual, hidden sizes around the
// kernel's 128-column tile, blocks whose bytes are and are not whole 32-bit words, a
// static scale with a last tile of fewer rows, rows that are not finite (NaN r), and FP4
// columns through the Hadamard transform. The emulated kernel reads the r the CPU kernel
// saved.
int CheckColumnwise(bool quick) {
  struct Format {
    OutFormat out;
    FloatType scale;
    int64_t block;  // 0: a static scale
    bool power_of_two;
    bool packed;
    const char* name;
    bool hadamard = false;  // the columnwise outputs' transform, with this sign mask
    uint32_t hadamard_mask = 0;
  };
  const Format formats[] = {
      {OutFormat::kE4M3FN, FloatType::kE8M0, 32, true, false, "mxfp8"},
      {OutFormat::kE2M1, FloatType::kE4M3, 16, false, true, "nvfp4 packed"},
      {OutFormat::kE2M1, FloatType::kE8M0, 32, true, false, "mxfp4 unpacked"},
      {OutFormat::kE4M3FNUZ, FloatType::kBF16, 128, false, false, "group 128 bf16"},
      {OutFormat::kE4M3FN, FloatType::kF32, 6, false, false, "group 6 (byte stores)"},
      {OutFormat::kE2M1, FloatType::kE4M3, 2, false, true, "nvfp4 group 2 (byte stores)"},
      {OutFormat::kE4M3FN, FloatType::kF32, 0, false, false, "static"},
      {OutFormat::kE2M1, FloatType::kE4M3, 16, false, true, "nvfp4 packed hadamard", true, 0xC05D},
      {OutFormat::kE2M1, FloatType::kE8M0, 32, true, false, "mxfp4 hadamard", true, 0x5C0FF1E7},
      {OutFormat::kE2M1, FloatType::kE8M0, 32, true, true, "mxfp4 hadamard mask 0", true, 0},
  };
  // 2048: bfloat16 rows that warp_rows holds in several warps (its reductions' barriers
  // in the one launch).
  const std::vector<int64_t> hiddens = quick ? std::vector<int64_t>{12, 160, 2048}
                                             : std::vector<int64_t>{2, 12, 160, 200, 384, 2048};
  const auto scale_bytes = [](FloatType t) {
    return t == FloatType::kE8M0 || t == FloatType::kE4M3 ? size_t{1} : FloatTypeBytes(t);
  };
  int failures = 0;
  int one_launch_cases = 0;
  int k = 0;
  for (const Format& f : formats) {
    const auto columns = [&f](void* y_t, void* scales_t) {
      ColumnOutputs c{y_t, scales_t, f.block};
      c.hadamard = f.hadamard;
      c.hadamard_mask = f.hadamard_mask;
      return c;
    };
    for (const int64_t hidden : hiddens) {
      if (f.block > 0 && hidden % f.block != 0 && f.block <= hidden) continue;
      for (const bool residual : {false, true}) {
        ++k;
        const FloatType input =
            k % 3 == 0 ? FloatType::kF32 : (k % 3 == 1 ? FloatType::kBF16 : FloatType::kF16);
        const int64_t rows = f.block > 0 ? f.block * (quick ? 2 : 1 + k % 3) : 37;
        // Rowwise groups: the format's block where it divides the row, else the row.
        const int64_t group = f.block > 0 && hidden % f.block == 0 ? f.block : hidden;
        if (f.out == OutFormat::kE2M1 && group % 2 != 0) continue;
        const size_t elements = static_cast<size_t>(rows * hidden);
        const size_t in_bytes = FloatTypeBytes(input);
        Rng rng{static_cast<uint64_t>(k) * 104729 + 3};
        ExactBuffer x(elements * in_bytes), res(residual ? elements * in_bytes : 0);
        ExactBuffer gamma(static_cast<size_t>(hidden) * sizeof(float));
        ExactBuffer r(static_cast<size_t>(rows) * sizeof(float));
        ExactBuffer operand(sizeof(float));
        // Zero, Inf and NaN rows among the first 7 only: the blocks after them are finite.
        Fill(x, input, rows, hidden, rng, false, 2.0f);
        Fill(x, input, std::min<int64_t>(rows, 7), hidden, rng, true, 2.0f);
        if (residual) Fill(res, input, rows, hidden, rng, false, 1.0f);
        Fill(gamma, FloatType::kF32, 1, hidden, rng, false, 0.5f);
        StoreAs(FloatType::kF32, operand.data, 0, f.block == 0 ? 0.03f : 0.5f);
        const int64_t blocks = f.block > 0 ? rows / f.block : 1;
        const size_t y_bytes = f.packed ? elements / 2 : elements;
        const size_t scales_t_bytes = static_cast<size_t>(hidden * blocks) * scale_bytes(f.scale);
        ExactBuffer y(y_bytes),
            scales(static_cast<size_t>(rows * (hidden / group)) * scale_bytes(f.scale));
        ExactBuffer residual_out(residual ? elements * in_bytes : 0);
        ExactBuffer y_t(y_bytes), y_t_cpu(y_bytes), scales_t(scales_t_bytes),
            scales_t_cpu(scales_t_bytes);
        RmsNormFp8Args a{};
        a.x = x.data;
        a.residual = residual ? res.data : nullptr;
        a.gamma = gamma.data;
        a.y = y.data;
        a.scales = scales.data;
        a.residual_out = residual ? residual_out.data : nullptr;
        a.rows = rows;
        a.hidden = hidden;
        a.group_size = group;
        a.input_type = input;
        a.residual_type = input;
        a.gamma_type = FloatType::kF32;
        a.scale_type = f.scale;
        a.out_format = f.out;
        a.y_packed = f.packed;
        a.constants = RowConstants{RoundTo(input, 1e-6f), RoundTo(input, k % 2 ? 1.0f : 0.0f),
                                   f.scale == FloatType::kBF16 ? 0.25f : INFINITY, f.power_of_two};
        const bool nvfp4 = f.scale == FloatType::kE4M3;
        a.static_scale = f.block == 0 ? reinterpret_cast<const float*>(operand.data) : nullptr;
        a.global_scale = nvfp4 ? reinterpret_cast<const float*>(operand.data) : nullptr;
        a.inverse_rms = reinterpret_cast<float*>(r.data);
        a.columns = columns(y_t_cpu.data, scales_t_cpu.data);
        RmsNormFp8Cpu(a, [](int64_t n, const std::function<void(int64_t)>& task) {
          for (int64_t i = 0; i < n; ++i) task(i);
        });
        a.columns = columns(y_t.data, scales_t.data);
        const std::string name = std::string("columnwise ") + f.name + " " + std::to_string(rows) +
                                 "x" + std::to_string(hidden) + " " + TypeName(input) +
                                 (residual ? " add" : "");
        if (name_cases) std::fprintf(stderr, "case %s\n", name.c_str());
        cudaError_t status;
        {
          simt::ScopedBuffers buffers;
          AddBuffers(buffers, {{"x", &x},
                               {"gamma", &gamma},
                               {"inverse_rms", &r},
                               {"scale_operand", &operand},
                               {"y_t", &y_t},
                               {"scales_t", &scales_t},
                               {"residual", residual ? &res : nullptr}});
          status = LaunchColumnwise(nullptr, a);
        }
        if (status != cudaSuccess) {
          std::printf("FAIL %s: %s\n", name.c_str(), cudaGetErrorString(status));
          ++failures;
          continue;
        }
        const bool ok = SameBytes(y_t, y_t_cpu, "y_t", name) &&
                        SameBytes(scales_t, scales_t_cpu, "scales_t", name);
        if (!ok) ++failures;

        // Both layouts from LaunchRmsNormFp8 with warp_rows asked for: one launch where
        // its plan holds the rows (every other hidden size on a grid of one block, which
        // strides over the blocks of rows), else the two kernels; every output against
        // the CPU kernel's.
        ExactBuffer y2(y_bytes), scales2(scales.bytes), residual_out2(residual_out.bytes),
            r2(r.bytes), y_t2(y_bytes), scales_t2(scales_t_bytes);
        RmsNormFp8Args both = a;
        both.y = y2.data;
        both.scales = scales2.data;
        both.residual_out = residual ? residual_out2.data : nullptr;
        both.inverse_rms = reinterpret_cast<float*>(r2.data);
        both.columns = columns(y_t2.data, scales_t2.data);
        SetKernelVariant(KernelVariant::kWarpRows);
        LaunchPlan plan{};
        const bool one_launch = PlanLaunch(0, both, &plan) == cudaSuccess && plan.both_layouts;
        if (one_launch && (k / 2) % 2 == 0) UseDevice(kLimits[4]);
        simt::TakeLaunches();
        {
          simt::ScopedBuffers buffers;
          AddBuffers(buffers, {{"x", &x},
                               {"gamma", &gamma},
                               {"scale_operand", &operand},
                               {"y", &y2},
                               {"scales", &scales2},
                               {"inverse_rms", &r2},
                               {"y_t", &y_t2},
                               {"scales_t", &scales_t2},
                               {"residual", residual ? &res : nullptr},
                               {"residual_out", residual ? &residual_out2 : nullptr}});
          status = LaunchRmsNormFp8(nullptr, 0, both);
        }
        SetKernelVariant(KernelVariant::kAuto);
        UseDevice(kLimits[0]);
        const std::vector<simt::LaunchRecord> launches = simt::TakeLaunches();
        const size_t expected = one_launch ? 1 : (f.block == 0 ? 3 : 2);
        const std::string both_name = name + (one_launch ? ", one launch" : ", two kernels");
        bool launched = status == cudaSuccess && launches.size() == expected;
        for (const simt::LaunchRecord& launch : launches)
          launched = launched && launch.error.empty();
        if (!launched) {
          std::printf("FAIL %s: status %d, %zu launches (%zu expected)%s%s\n", both_name.c_str(),
                      static_cast<int>(status), launches.size(), expected,
                      launches.empty() ? "" : ": ",
                      launches.empty() ? "" : launches.back().error.c_str());
          ++failures;
          continue;
        }
        one_launch_cases += one_launch ? 1 : 0;
        bool same = SameBytes(y2, y, "y", both_name);
        same = SameBytes(scales2, scales, "scales", both_name) && same;
        same = SameBytes(r2, r, "inverse_rms", both_name) && same;
        if (residual)
          same = SameBytes(residual_out2, residual_out, "residual_out", both_name) && same;
        same = SameBytes(y_t2, y_t_cpu, "y_t", both_name) && same;
        same = SameBytes(scales_t2, scales_t_cpu, "scales_t", both_name) && same;
        if (!same) ++failures;
      }
    }
  }
  simt::TakeLaunches();
  if (one_launch_cases < (quick ? 8 : 20)) {
    std::printf("FAIL columnwise: %d cases made both layouts in one launch\n", one_launch_cases);
    ++failures;
  }
  return failures;
}

}  // namespace fp8norm
