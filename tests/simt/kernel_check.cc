// Runs the CUDA kernels of src/cuda, emulated on the CPU (src/simt), over every launch
// path, and compares each result bit for bit with the CPU kernel (src/cpu), which the
// Python tests hold to the reference. Every buffer is allocated at exactly its size, and
// the launch is told the same sizes, so one element past the end is an error of the
// emulation and of AddressSanitizer.
//
// Built plain, with AddressSanitizer + UndefinedBehaviorSanitizer, and with ThreadSanitizer by
// tools/checks/simt_check.sh; with planted bugs by tools/mutants/simt_mutants.py. Checks the
// emulator's own promises first (emulator_check.cc); the training kernels' checks are
// training_check.cc's, per-row global scales' per_row_check.cc's. Prints one line per failure
// and a summary of the launch paths reached; exits non-zero on any mismatch, launch error or path
// of the list below not reached. Checks 64-bit indexing (index_check.cc) in the full run.
//
//   kernel_check [--quick] [--only-allreduce | --no-allreduce] [--name-cases] [--stop-at-failure]
//                [--shard K/N]
//     --quick: fewer and shorter rows, for ThreadSanitizer; --only-allreduce: the one-kernel
//     all-reduce's checks alone (allreduce_check.cc), --no-allreduce: everything else (the
//     mutation check runs each mutant against the part its file reaches); --name-cases:
//     each case's name on stderr before it runs, so that a sanitizer's report, which ends
//     the run there, can be told apart by case; --stop-at-failure: no case after the first
//     that fails (the mutation check needs one failure, not all of them); --shard K/N: the
//     K-th of N parts of the checks (0 <= K < N), so that N processes share the cores (the
//     emulation runs on one); the checks that need every case (each launch path reached, the
//     all-reduce's order and caps tested) print, in a shard, an "UNSEEN <what>" line for each
//     thing the shard's cases did not show: what every shard names is a failure.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <new>
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

bool name_cases = false;
bool stop_at_failure = false;
Shard shard;

bool Shard::Takes() { return next++ % count == index; }

void NameCase(const std::string& name) {
  if (name_cases) std::fprintf(stderr, "case: %s\n", name.c_str());
}

namespace {

struct Case {
  int64_t rows;
  int64_t hidden;
  FloatType input;
  int residual;  // 0: none, 1: the input's dtype, 2: bfloat16 beside a float32 input
  FloatType gamma;
  FloatType scale;
  OutFormat out;
  size_t misalign;  // bytes x (and residual) start past an aligned address
  int limits;       // index into kLimits
  bool specials;    // rows of zeros, an Inf and a NaN
  float scale_ub;
  int64_t group_size = 0;     // 0: one scale per row
  bool power_of_two = false;  // power-of-two scales (set for e8m0)
  float static_scale = 0.0f;  // a calibrated scale when nonzero
  bool amax = false;          // each row's amax beside the static scale
  bool packed = true;         // FP4: two codes per byte, else one
  float global_scale = 1.0f;  // NVFP4's (e4m3 scales)
};

// A case with scales per group, the k-th of its list: the fields the FP8 and FP4 group
// lists vary alike (residual, gamma dtype, misalignment, device limits, edge rows).
Case GroupedCase(int64_t hidden, int64_t group, FloatType input, int k, bool quick) {
  Case c{};
  c.rows = quick ? 3 : 6;
  c.hidden = hidden;
  c.input = input;
  c.residual = k % 3 == 1 ? 1 : 0;
  c.gamma = k % 2 ? FloatType::kBF16 : FloatType::kF32;
  c.misalign = k % 6 == 5 ? FloatTypeBytes(input) : 0;
  c.limits = k % 4;
  c.specials = k % 3 == 2;
  c.group_size = group;
  return c;
}

const char* VariantName(KernelVariant v) { return kKernelVariantNames[static_cast<int>(v)]; }

// False when the case failed. `variant` is the kernel asked for; a register variant that
// cannot hold the row is skipped (the plan would run block_shared, which has its own turn).
bool RunCase(const Case& c, KernelVariant variant, Coverage& coverage, int* runs) {
  const Limits& limits = kLimits[c.limits];
  UseDevice(limits);
  SetKernelVariant(variant);

  const FloatType residual_type = c.residual == 2 ? FloatType::kBF16 : c.input;
  const size_t elements = static_cast<size_t>(c.rows * c.hidden);
  Rng rng{0x1234567ull + static_cast<uint64_t>(c.rows * 7919 + c.hidden)};
  ExactBuffer x(elements * FloatTypeBytes(c.input), c.misalign);
  ExactBuffer residual(c.residual ? elements * FloatTypeBytes(residual_type) : 0, c.misalign);
  ExactBuffer gamma(static_cast<size_t>(c.hidden) * FloatTypeBytes(c.gamma));
  Fill(x, c.input, c.rows, c.hidden, rng, c.specials, 2.0f);
  if (c.residual) Fill(residual, residual_type, c.rows, c.hidden, rng, false, 1.0f);
  Fill(gamma, c.gamma, 1, c.hidden, rng, false, 0.3f);

  struct Outputs {
    ExactBuffer y, scales, residual_out, amax;
  };
  const int64_t groups = c.group_size > 0 ? c.hidden / c.group_size : 1;
  ExactBuffer static_scale(c.static_scale != 0.0f ? sizeof(float) : 0);
  if (c.static_scale != 0.0f) std::memcpy(static_scale.data, &c.static_scale, sizeof(float));
  const bool fp4 = c.out == OutFormat::kE2M1;
  const bool nvfp4 = fp4 && c.scale == FloatType::kE4M3;
  ExactBuffer global_scale(nvfp4 ? sizeof(float) : 0);
  if (nvfp4) std::memcpy(global_scale.data, &c.global_scale, sizeof(float));
  const bool packed = fp4 && c.packed;
  auto make_outputs = [&]() {
    // y: one byte per FP8 element, half a byte per packed FP4 one: exactly the buffer.
    return Outputs{ExactBuffer(packed ? elements / 2 : elements),
                   ExactBuffer(static_cast<size_t>(c.rows * groups) * FloatTypeBytes(c.scale)),
                   ExactBuffer(c.residual ? elements * FloatTypeBytes(residual_type) : 0),
                   ExactBuffer(c.amax ? static_cast<size_t>(c.rows) * sizeof(float) : 0)};
  };
  Outputs emulated = make_outputs(), cpu = make_outputs();

  auto args_for = [&](Outputs& o) {
    RmsNormFp8Args a{};
    a.x = x.data;
    a.residual = c.residual ? residual.data : nullptr;
    a.gamma = gamma.data;
    a.y = o.y.data;
    a.scales = o.scales.data;
    a.residual_out = c.residual ? o.residual_out.data : nullptr;
    a.rows = c.rows;
    a.hidden = c.hidden;
    a.input_type = c.input;
    a.residual_type = residual_type;
    a.gamma_type = c.gamma;
    a.scale_type = c.scale;
    a.out_format = c.out;
    a.constants =
        RowConstants{RoundTo(c.input, 1e-6f), RoundTo(c.input, 0.5f), c.scale_ub, c.power_of_two};
    a.group_size = c.group_size > 0 ? c.group_size : c.hidden;
    a.static_scale =
        c.static_scale != 0.0f ? reinterpret_cast<const float*>(static_scale.data) : nullptr;
    a.global_scale = nvfp4 ? reinterpret_cast<const float*>(global_scale.data) : nullptr;
    a.y_packed = packed;
    a.amax = c.amax ? reinterpret_cast<float*>(o.amax.data) : nullptr;
    return a;
  };

  char name_text[300];
  std::snprintf(name_text, sizeof(name_text),
                "%s %lldx%lld %s residual=%d gamma=%s scale=%s %s misalign=%zu limits=%s%s "
                "group=%lld pow2=%d static=%g amax=%d packed=%d global=%g",
                VariantName(variant), static_cast<long long>(c.rows),
                static_cast<long long>(c.hidden), TypeName(c.input), c.residual, TypeName(c.gamma),
                TypeName(c.scale),
                fp4 ? "e2m1" : (c.out == OutFormat::kE4M3FN ? "e4m3fn" : "e4m3fnuz"), c.misalign,
                limits.name, c.specials ? " specials" : "", static_cast<long long>(c.group_size),
                c.power_of_two, c.static_scale, c.amax, packed, c.global_scale);
  const std::string name = name_text;
  NameCase(name);

  const RmsNormFp8Args emulated_args = args_for(emulated);
  // The path the launch takes, as the plan decides it with the emulated device's limits.
  LaunchPlan plan{};
  if (PlanLaunch(0, emulated_args, &plan) != cudaSuccess) {
    std::printf("FAIL %s: the device could not be prepared\n", name.c_str());
    return false;
  }
  if (plan.variant != variant) return true;
  *runs += 1;
  cudaError_t status;
  {
    simt::ScopedBuffers buffers;
    buffers.Add("x", x.data, x.bytes);
    if (c.residual) buffers.Add("residual", residual.data, residual.bytes);
    buffers.Add("gamma", gamma.data, gamma.bytes);
    buffers.Add("y", emulated.y.data, emulated.y.bytes);
    buffers.Add("scales", emulated.scales.data, emulated.scales.bytes);
    if (c.static_scale != 0.0f) buffers.Add("static_scale", static_scale.data, static_scale.bytes);
    if (nvfp4) buffers.Add("global_scale", global_scale.data, global_scale.bytes);
    if (c.residual)
      buffers.Add("residual_out", emulated.residual_out.data, emulated.residual_out.bytes);
    if (c.amax) buffers.Add("amax", emulated.amax.data, emulated.amax.bytes);
    status = LaunchRmsNormFp8(nullptr, 0, emulated_args);
  }
  const std::vector<simt::LaunchRecord> launches = simt::TakeLaunches();
  if (status != cudaSuccess || launches.empty() || !launches.back().error.empty()) {
    std::printf("FAIL %s: launch failed (status %d): %s\n", name.c_str(), static_cast<int>(status),
                launches.empty() ? "no launch recorded" : launches.back().error.c_str());
    return false;
  }

  const RmsNormFp8Args cpu_args = args_for(cpu);
  const bool cpu_ok = RmsNormFp8Cpu(cpu_args, [](int64_t n, const std::function<void(int64_t)>& f) {
    for (int64_t i = 0; i < n; ++i) f(i);
  });
  if (!cpu_ok) {
    std::printf("FAIL %s: the CPU kernel could not allocate\n", name.c_str());
    return false;
  }
  bool ok = SameBytes(emulated.y, cpu.y, "y", name);
  ok = SameBytes(emulated.scales, cpu.scales, "scales", name) && ok;
  if (c.residual)
    ok = SameBytes(emulated.residual_out, cpu.residual_out, "residual_out", name) && ok;
  if (c.amax) ok = SameBytes(emulated.amax, cpu.amax, "amax", name) && ok;
  if (packed) {
    // The same codes one per byte, packed two per byte: the layouts agree.
    Outputs unpacked = make_outputs();
    ExactBuffer codes(elements);
    unpacked.y = std::move(codes);
    RmsNormFp8Args a = args_for(unpacked);
    a.y_packed = false;
    RmsNormFp8Cpu(a, [](int64_t n, const std::function<void(int64_t)>& f) {
      for (int64_t i = 0; i < n; ++i) f(i);
    });
    ExactBuffer repacked(elements / 2);
    for (size_t k = 0; k < elements / 2; ++k) {
      repacked.data[k] = PackFp4(unpacked.y.data[2 * k], unpacked.y.data[2 * k + 1]);
    }
    ok = SameBytes(cpu.y, repacked, "y packed vs one code per byte", name) && ok;
  }

  const simt::LaunchRecord& launch = launches.back();
  if (launch.threads != static_cast<unsigned>(plan.threads) || launch.blocks != plan.blocks ||
      launch.dynamic_shared_bytes != plan.dynamic_shared_bytes) {
    std::printf("FAIL %s: the launch did not follow the plan\n", name.c_str());
    ok = false;
  }
  const std::string v = VariantName(variant);
  if (variant == KernelVariant::kBlockShared) {
    coverage.Add(v + (plan.vectorized ? ", vectorized" : ", scalar") +
                 (launch.dynamic_shared_bytes > 0 ? " cached" : " re-read"));
    if (plan.opt_in) coverage.Add(v + ", shared memory opted in");
    if (c.hidden / plan.vector_width > launch.threads)
      coverage.Add(v + ", more loads than threads");
  } else {
    coverage.Add(v + ", " + std::to_string(plan.vectors_per_thread) + " vectors per thread");
    coverage.Add(v +
                 (plan.threads_per_row > kWarp ? ", several warps per row" : ", one warp per row"));
    if (c.rows % plan.rows_per_block != 0) coverage.Add(v + ", a block row past the last row");
  }
  if (launch.blocks * static_cast<int64_t>(plan.rows_per_block) < c.rows) {
    coverage.Add(v + ", grid-stride over rows");
  }
  if (c.residual == 1) coverage.Add("residual");
  if (c.residual == 2) coverage.Add("16-bit residual beside float32 x");
  if (c.misalign) coverage.Add("misaligned x");
  if (c.hidden % VectorWidth(FloatTypeBytes(c.input)) != 0)
    coverage.Add("hidden not a vector multiple");
  if (c.specials) coverage.Add("zero, Inf and NaN rows");
  if (c.group_size > 0 && c.group_size < c.hidden) {
    coverage.Add(v + (variant == KernelVariant::kBlockShared ? ", groups per thread"
                                                             : ", groups by shuffles"));
  }
  if (c.power_of_two) coverage.Add(std::string("power-of-two ") + TypeName(c.scale) + " scales");
  if (c.static_scale != 0.0f) {
    coverage.Add(v + (c.amax ? ", static scale, amax" : ", static scale"));
  }
  if (fp4) coverage.Add(v + (nvfp4 ? ", NVFP4" : ", MXFP4") + (packed ? " packed" : " unpacked"));
  return ok;
}

// fp8norm_round's kernel against the CPU loop, at counts around its block size.
int CheckRound() {
  int failures = 0;
  for (const int64_t count : {int64_t{1}, int64_t{255}, int64_t{1000}, int64_t{70001}}) {
    for (const auto& [target, packed] :
         {std::pair{RoundTarget::kF16, false}, std::pair{RoundTarget::kBF16, false},
          std::pair{RoundTarget::kE4M3FN, false}, std::pair{RoundTarget::kE4M3FNUZ, false},
          std::pair{RoundTarget::kE2M1, false}, std::pair{RoundTarget::kE2M1, true}}) {
      Rng rng{static_cast<uint64_t>(count) * 31 + static_cast<uint64_t>(target) + 1};
      ExactBuffer in(static_cast<size_t>(count) * sizeof(float));
      for (int64_t i = 0; i < count; ++i) {
        const float v = rng.Normal() * std::pow(2.0f, static_cast<float>(rng.Next() % 40) - 20);
        std::memcpy(in.data + i * sizeof(float), &v, sizeof(float));
      }
      RoundArgs a{reinterpret_cast<const float*>(in.data), nullptr, count, target, packed};
      const size_t out_bytes = static_cast<size_t>(RoundedOutputs(a)) * (IsOneByte(target) ? 1 : 2);
      ExactBuffer emulated(out_bytes), cpu(out_bytes);
      a.out = emulated.data;
      cudaError_t status;
      {
        simt::ScopedBuffers buffers;
        buffers.Add("in", in.data, in.bytes);
        buffers.Add("out", emulated.data, emulated.bytes);
        status = LaunchRound(nullptr, a);
      }
      a.out = cpu.data;
      RoundCpu(a);
      const std::string name =
          "round " + std::to_string(count) + " target " + std::to_string(static_cast<int>(target));
      if (status != cudaSuccess) {
        std::printf("FAIL %s: %s\n", name.c_str(), cudaGetErrorString(status));
        ++failures;
      } else if (!SameBytes(emulated, cpu, "out", name)) {
        ++failures;
      }
    }
  }
  // hidden == 0: no kernel, the scales cleared by a memset of exactly their size.
  ExactBuffer x(0), gamma(0), y(0), scales(5 * sizeof(float));
  RmsNormFp8Args a{};
  a.x = x.data;
  a.gamma = gamma.data;
  a.y = y.data;
  a.scales = scales.data;
  a.rows = 5;
  {
    simt::ScopedBuffers buffers;
    buffers.Add("scales", scales.data, scales.bytes);
    const cudaError_t status = LaunchRmsNormFp8(nullptr, 0, a);
    bool zero = true;
    for (size_t i = 0; i < scales.bytes; ++i) zero = zero && scales.data[i] == 0;
    if (status != cudaSuccess || !zero) {
      std::printf("FAIL hidden 0: the scales are not cleared\n");
      ++failures;
    }
  }
  simt::TakeLaunches();
  return failures;
}

int Main(bool quick, bool allreduce, bool rest) {
  if (!rest) return CheckAllReduce(quick) == 0 ? 0 : 1;
  std::vector<Case> cases;
  const int64_t hiddens_full[] = {1, 7, 8, 33, 64, 256, 1000, 1032, 4104, 8200, 12289};
  const int64_t hiddens_quick[] = {7, 64, 264, 1000, 2056};
  const std::vector<int64_t> hiddens =
      quick ? std::vector<int64_t>(std::begin(hiddens_quick), std::end(hiddens_quick))
            : std::vector<int64_t>(std::begin(hiddens_full), std::end(hiddens_full));
  const FloatType inputs[] = {FloatType::kBF16, FloatType::kF32, FloatType::kF16};
  const FloatType scales[] = {FloatType::kF32, FloatType::kBF16, FloatType::kF16};
  int k = 0;
  for (const int64_t hidden : hiddens) {
    for (const FloatType input : inputs) {
      for (int residual = 0; residual <= (input == FloatType::kF32 ? 2 : 1); ++residual) {
        for (int limits = 0; limits < 4; ++limits, ++k) {
          Case c{};
          c.rows = quick ? 4 : (limits == 3 ? 10 : 5);
          c.hidden = hidden;
          c.input = input;
          c.residual = residual;
          // k / 4 picks the options the four limits share, so that each meets each limit.
          c.gamma = (k / 4 + limits) % 2 ? FloatType::kBF16 : FloatType::kF32;
          c.scale = scales[k % 3];
          c.out = k % 5 == 4 ? OutFormat::kE4M3FNUZ : OutFormat::kE4M3FN;
          c.misalign = (k / 4 + limits) % 4 == 1 ? FloatTypeBytes(input) : 0;
          c.limits = limits;
          c.specials = k % 3 == 2;
          c.scale_ub = k % 7 == 3 ? 0.01f : INFINITY;
          cases.push_back(c);
        }
      }
    }
  }
  // Scales per group (sizes within a vector, shuffled across 1-32 vectors, and others),
  // power-of-two and e8m0 scales, and calibrated scales (valid, invalid, and one whose
  // reciprocal is flushed).
  const int64_t group_hiddens_full[] = {96, 384, 1024, 7168};
  const int64_t group_hiddens_quick[] = {96, 384};
  const std::vector<int64_t> group_hiddens =
      quick ? std::vector<int64_t>(std::begin(group_hiddens_quick), std::end(group_hiddens_quick))
            : std::vector<int64_t>(std::begin(group_hiddens_full), std::end(group_hiddens_full));
  const float static_scales[] = {0.05f, -1.0f, 0x1p127f, 0.002f};
  int g = 0;
  for (const int64_t hidden : group_hiddens) {
    for (const int64_t group : {int64_t{1}, int64_t{3}, int64_t{32}, int64_t{64}, int64_t{128}}) {
      if (hidden % group != 0) continue;
      for (const FloatType input : inputs) {
        Case c = GroupedCase(hidden, group, input, g, quick);
        const FloatType group_scales[] = {FloatType::kF32, FloatType::kE8M0, FloatType::kBF16,
                                          FloatType::kF32};
        c.scale = group_scales[g % 4];
        c.power_of_two = g % 4 != 0;
        c.out = g % 5 == 4 ? OutFormat::kE4M3FNUZ : OutFormat::kE4M3FN;
        c.scale_ub = g % 7 == 3 ? 0.01f : INFINITY;
        cases.push_back(c);
        ++g;
      }
    }
    Case c{};
    c.rows = quick ? 3 : 6;
    c.hidden = hidden;
    c.input = inputs[g % 3];
    c.residual = g % 2;
    c.gamma = FloatType::kF32;
    c.scale = scales[g % 3];
    c.out = OutFormat::kE4M3FN;
    c.specials = true;
    c.scale_ub = INFINITY;
    c.static_scale = static_scales[g % 4];
    c.amax = true;
    c.limits = g % 4;
    cases.push_back(c);
    ++g;
  }
  // FP4: NVFP4 (typical, invalid and tiny global scales) and MXFP4 (with and without a
  // bound), packed and one code per byte, groups from a pair of codes to 64, the edge rows.
  const float global_scales[] = {0.003f, 1.0f, 0.0f, -2.0f, 2e-38f};
  int f = 0;
  for (const int64_t hidden : group_hiddens) {
    for (const int64_t group : {int64_t{2}, int64_t{6}, int64_t{16}, int64_t{32}, int64_t{64}}) {
      if (hidden % group != 0) continue;
      for (const FloatType input : inputs) {
        Case c = GroupedCase(hidden, group, input, f, quick);
        c.out = OutFormat::kE2M1;
        c.scale = f % 2 ? FloatType::kE8M0 : FloatType::kE4M3;
        c.power_of_two = c.scale == FloatType::kE8M0;
        c.global_scale = global_scales[(f / 2) % 5];
        c.scale_ub = c.power_of_two && f % 4 == 3 ? 0.5f : INFINITY;
        c.packed = f % 5 != 4;
        cases.push_back(c);
        ++f;
      }
    }
  }
  // FP4 with one group per row (group_size == hidden), either format.
  for (const int64_t hidden : {int64_t{16}, int64_t{256}, int64_t{512}}) {
    for (const FloatType scale : {FloatType::kE4M3, FloatType::kE8M0}) {
      Case c{};
      c.rows = quick ? 3 : 7;
      c.hidden = hidden;
      c.input = FloatType::kBF16;
      c.gamma = FloatType::kF32;
      c.out = OutFormat::kE2M1;
      c.scale = scale;
      c.power_of_two = scale == FloatType::kE8M0;
      c.global_scale = 0.004f;
      c.scale_ub = INFINITY;
      c.group_size = hidden;
      c.specials = true;
      cases.push_back(c);
    }
  }
  // Rows held by several warps (1024 bf16: 2 warps per row in block_registers), strided
  // over a grid of 3 blocks: the barrier a grouped or static row keeps in place of the
  // abs-max reduction, and the reduction of a static row's amax. Quick set too, for TSan.
  for (const int kind : {0, 1, 2}) {  // groups, a static scale, and with its amax
    Case c{};
    c.rows = 8;
    c.hidden = 1024;
    c.input = FloatType::kBF16;
    c.gamma = FloatType::kF32;
    c.scale = FloatType::kF32;
    c.out = OutFormat::kE4M3FN;
    c.limits = 3;
    c.scale_ub = INFINITY;
    c.group_size = kind > 0 ? 0 : 64;
    c.static_scale = kind > 0 ? 0.05f : 0.0f;
    c.amax = kind == 2;
    c.specials = kind == 2;
    cases.push_back(c);
  }
  Coverage coverage;
  int failures = 0;
  using Check = int (*)(bool quick);
  const Check checks[] = {[](bool) { return CheckEmulator(); },
                          [](bool) { return CheckRound(); },
                          CheckBackward,
                          CheckColumnwise,
                          CheckQuantizeWeight,
                          CheckQuantizeGradient,
                          CheckPerRowGlobalScales};
  for (const Check check : checks) {
    if (shard.Takes()) failures += check(quick);
  }
  int runs = 0;
  size_t taken = 0;  // the cases this shard runs
  for (const Case& c : cases) {
    if (stop_at_failure && failures > 0) break;
    if (!shard.Takes()) continue;
    ++taken;
    for (const KernelVariant variant :
         {KernelVariant::kBlockShared, KernelVariant::kWarpRows, KernelVariant::kBlockRegisters}) {
      failures += RunCase(c, variant, coverage, &runs) ? 0 : 1;
    }
  }
  SetKernelVariant(KernelVariant::kAuto);
  // 64-bit indexing reserves tens of GiB of address space, which ThreadSanitizer's
  // shadow mapping does not take; the quick (ThreadSanitizer) run leaves it out.
  if (stop_at_failure && failures > 0) return 1;
  if (!quick && shard.Takes()) failures += CheckIndexing();
  if (allreduce && !(stop_at_failure && failures > 0)) failures += CheckAllReduce(quick);

  const char* required[] = {"block_shared, vectorized cached",
                            "block_shared, vectorized re-read",
                            "block_shared, scalar cached",
                            "block_shared, scalar re-read",
                            "block_shared, shared memory opted in",
                            "block_shared, grid-stride over rows",
                            "block_shared, more loads than threads",
                            "warp_rows, 1 vectors per thread",
                            "warp_rows, 2 vectors per thread",
                            "warp_rows, 4 vectors per thread",
                            "warp_rows, one warp per row",
                            "warp_rows, several warps per row",
                            "warp_rows, a block row past the last row",
                            "warp_rows, grid-stride over rows",
                            "block_registers, 2 vectors per thread",
                            "block_registers, 4 vectors per thread",
                            "block_registers, one warp per row",
                            "block_registers, several warps per row",
                            "block_registers, grid-stride over rows",
                            "residual",
                            "16-bit residual beside float32 x",
                            "misaligned x",
                            "hidden not a vector multiple",
                            "zero, Inf and NaN rows",
                            "block_shared, groups per thread",
                            "warp_rows, groups by shuffles",
                            "block_registers, groups by shuffles",
                            "power-of-two e8m0 scales",
                            "power-of-two f32 scales",
                            "power-of-two bf16 scales",
                            "block_shared, static scale",
                            "warp_rows, static scale",
                            "block_registers, static scale",
                            "block_shared, static scale, amax",
                            "warp_rows, static scale, amax",
                            "block_registers, static scale, amax",
                            "block_shared, NVFP4 packed",
                            "block_shared, MXFP4 packed",
                            "block_shared, NVFP4 unpacked",
                            "block_shared, MXFP4 unpacked",
                            "warp_rows, NVFP4 packed",
                            "warp_rows, MXFP4 packed",
                            "block_registers, NVFP4 packed",
                            "block_registers, MXFP4 packed"};
  if (shard.count > 1) {
    std::printf("%zu of %zu cases (shard %d/%d), ", taken, cases.size(), shard.index, shard.count);
  } else {
    std::printf("%zu cases, ", cases.size());
  }
  std::printf("%d launches over the variants, %d failed; launch paths reached:\n", runs, failures);
  for (const auto& [path, count] : coverage.paths) std::printf("  %-34s %d\n", path.c_str(), count);
  // Whether every path was reached is a question for the whole list of cases: a shard names
  // what it did not reach, and whoever runs the shards fails a path that none reached.
  for (const char* path : required) {
    if (quick && std::strstr(path, "more loads than threads") != nullptr) continue;
    if (quick && std::strstr(path, "4 vectors per thread") != nullptr) continue;
    if (coverage.paths.count(path) == 0) {
      if (shard.count > 1) {
        std::printf("UNSEEN path never reached: %s\n", path);
      } else {
        std::printf("FAIL path never reached: %s\n", path);
        ++failures;
      }
    }
  }
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace fp8norm

int main(int argc, char** argv) {
  bool quick = false, allreduce = true, rest = true;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else if (std::strcmp(argv[i], "--only-allreduce") == 0) {
      rest = false;
    } else if (std::strcmp(argv[i], "--no-allreduce") == 0) {
      allreduce = false;
    } else if (std::strcmp(argv[i], "--name-cases") == 0) {
      fp8norm::name_cases = true;
    } else if (std::strcmp(argv[i], "--stop-at-failure") == 0) {
      fp8norm::stop_at_failure = true;
    } else if (std::strcmp(argv[i], "--shard") == 0 && i + 1 < argc) {
      int index = -1, count = 0, end = 0;
      ++i;
      if (std::sscanf(argv[i], "%d/%d%n", &index, &count, &end) != 2 || argv[i][end] != '\0' ||
          count < 1 || index < 0 || index >= count) {
        std::fprintf(stderr, "kernel_check: --shard %s: expected K/N with 0 <= K < N\n", argv[i]);
        return 2;
      }
      fp8norm::shard.index = index;
      fp8norm::shard.count = count;
    } else {
      std::fprintf(stderr, "kernel_check: unknown argument %s\n", argv[i]);
      return 2;
    }
  }
  return fp8norm::Main(quick, allreduce, rest);
}
