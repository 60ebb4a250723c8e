// 64-bit indexing of the CPU kernel and of every CUDA kernel variant (emulated): rows that
// start past byte 2^31 of x and past element 2^31 must give the bits of the same rows
// computed at the start of a small buffer.
//
// The large buffers (add_rms_norm_fp8, 524304 x 4096 bfloat16: 4 GiB each for x, residual
// and residual_out, 2 GiB for y) are reserved address space, not memory: only the pages
// of the rows computed are ever touched. The CPU kernel runs only the tasks that hold those
// rows (its ParallelFor is the caller's), an emulated launch only the blocks that hold them
// (simt::ScopedBlockWindow). Each buffer sits 4 GiB into its reservation, so that an
// offset truncated to 32 bits still lands in mapped memory (whose untouched pages read as
// zeros) or, for the emulated kernels, outside every registered buffer: either way a wrong
// row, reported as a FAIL line, never a crash.
#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "cuda_kernels.h"
#include "cuda_launch_plan.h"
#include "rms_norm_fp8.h"
#include "simt.h"

namespace fp8norm {
namespace {

constexpr int64_t kHidden = 4096;
constexpr int64_t kRows = (int64_t{1} << 31) / kHidden + 16;  // rows past element 2^31
// Rows [first, last) of each window: around byte 2^31 of x (row 2^18) and around element
// 2^31 (row 2^19), where a 32-bit byte offset and a 32-bit element index wrap.
constexpr int64_t kWindows[][2] = {{(int64_t{1} << 18) - 4, (int64_t{1} << 18) + 4},
                                   {(int64_t{1} << 19) - 8, kRows}};
constexpr int64_t kPeriod = 8;  // row r holds the values of row r % kPeriod
constexpr size_t kGuard = size_t{1} << 32;

// Reserved address space: `bytes` usable bytes `kGuard` past the start of the mapping.
class Reservation {
 public:
  explicit Reservation(size_t bytes) : length_(kGuard + bytes) {
    void* p = mmap(nullptr, length_, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    base_ = p == MAP_FAILED ? nullptr : static_cast<unsigned char*>(p);
    bytes_ = bytes;
  }
  ~Reservation() {
    if (base_ != nullptr) munmap(base_, length_);
  }
  Reservation(const Reservation&) = delete;
  Reservation& operator=(const Reservation&) = delete;
  bool ok() const { return base_ != nullptr; }
  unsigned char* data() const { return base_ + kGuard; }
  size_t bytes() const { return bytes_; }

 private:
  unsigned char* base_;
  size_t length_;
  size_t bytes_;
};

float PatternValue(int64_t row, int64_t column) {
  const int64_t phase = row % kPeriod;
  return static_cast<float>((column * 7 + phase * 13) % 251 - 125) * 0.01f * (phase + 1);
}

void FillRows(void* p, int64_t first, int64_t last, int64_t salt) {
  for (int64_t r = first; r < last; ++r) {
    for (int64_t c = 0; c < kHidden; ++c) {
      StoreAs(FloatType::kBF16, p, r * kHidden + c, PatternValue(r + salt, c));
    }
  }
}

struct Buffers {
  void* x;
  void* residual;
  void* y;
  void* scales;
  void* residual_out;
};

RmsNormFp8Args ArgsFor(const Buffers& b, int64_t rows, const float* gamma) {
  RmsNormFp8Args a{};
  a.x = b.x;
  a.residual = b.residual;
  a.gamma = gamma;
  a.y = b.y;
  a.scales = b.scales;
  a.residual_out = b.residual_out;
  a.rows = rows;
  a.hidden = kHidden;
  a.group_size = kHidden;
  a.input_type = a.residual_type = FloatType::kBF16;
  a.gamma_type = FloatType::kF32;
  a.scale_type = FloatType::kF32;
  a.out_format = OutFormat::kE4M3FN;
  a.constants = RowConstants{RoundTo(FloatType::kBF16, 1e-6f), 0.0f, INFINITY, false};
  return a;
}

void RunOnCpu(const RmsNormFp8Args& a, int64_t first, int64_t last) {
  // The CPU kernel's task size (cpu_kernels.cc): whole rows of 2^14 to 2^17 elements. Only
  // the tasks holding rows [first, last) run; a change of that rule shows as rows left
  // unwritten.
  const int64_t task_elements = std::clamp<int64_t>(a.rows * a.hidden / 64, 1 << 14, 1 << 17);
  const int64_t rows_per_task = std::max<int64_t>(1, task_elements / a.hidden);
  RmsNormFp8Cpu(a, [&](int64_t tasks, const std::function<void(int64_t)>& task) {
    for (int64_t t = first / rows_per_task; t < std::min(tasks, last / rows_per_task + 1); ++t) {
      task(t);
    }
  });
}

// The last failure's description, or empty.
std::string CompareWindow(const Buffers& big, const Buffers& small, int64_t first, int64_t last) {
  for (int64_t r = first; r < last; ++r) {
    const int64_t twin = r % kPeriod;
    const auto* y = static_cast<const unsigned char*>(big.y);
    const auto* want_y = static_cast<const unsigned char*>(small.y);
    if (std::memcmp(y + r * kHidden, want_y + twin * kHidden, kHidden) != 0) {
      return "y of row " + std::to_string(r);
    }
    if (std::memcmp(static_cast<const float*>(big.scales) + r,
                    static_cast<const float*>(small.scales) + twin, sizeof(float)) != 0) {
      return "the scale of row " + std::to_string(r);
    }
    const auto* out = static_cast<const unsigned char*>(big.residual_out);
    const auto* want_out = static_cast<const unsigned char*>(small.residual_out);
    if (std::memcmp(out + 2 * r * kHidden, want_out + 2 * twin * kHidden, 2 * kHidden) != 0) {
      return "residual_out of row " + std::to_string(r);
    }
  }
  return "";
}

}  // namespace

int CheckIndexing() {
  const size_t elements = static_cast<size_t>(kRows * kHidden);
  Reservation x(2 * elements), residual(2 * elements), residual_out(2 * elements), y(elements),
      scales(sizeof(float) * kRows);
  if (!x.ok() || !residual.ok() || !residual_out.ok() || !y.ok() || !scales.ok()) {
    std::printf("FAIL 64-bit indexing: the address space could not be reserved\n");
    return 1;
  }
  // Aligned for the register variants' vectors of gamma (8 float32 for a bfloat16 row).
  alignas(64) static float gamma[kHidden];
  for (int64_t c = 0; c < kHidden; ++c) gamma[c] = 0.5f + 0.001f * static_cast<float>(c % 1000);
  for (const auto& window : kWindows) {
    FillRows(x.data(), window[0], window[1], 0);
    FillRows(residual.data(), window[0], window[1], 3);
  }
  const Buffers big{x.data(), residual.data(), y.data(), scales.data(), residual_out.data()};

  // The twins: kPeriod rows at the start of ordinary buffers.
  std::vector<unsigned char> sx(2 * kPeriod * kHidden), sres(2 * kPeriod * kHidden),
      sy(kPeriod * kHidden), sscales(sizeof(float) * kPeriod), sout(2 * kPeriod * kHidden);
  FillRows(sx.data(), 0, kPeriod, 0);
  FillRows(sres.data(), 0, kPeriod, 3);
  const Buffers small{sx.data(), sres.data(), sy.data(), sscales.data(), sout.data()};
  RunOnCpu(ArgsFor(small, kPeriod, gamma), 0, kPeriod);

  int failures = 0;
  const RmsNormFp8Args args = ArgsFor(big, kRows, gamma);
  auto clear_windows = [&]() {
    for (const auto& window : kWindows) {
      std::memset(y.data() + window[0] * kHidden, 0xa5, (window[1] - window[0]) * kHidden);
      std::memset(residual_out.data() + 2 * window[0] * kHidden, 0xa5,
                  2 * (window[1] - window[0]) * kHidden);
      std::memset(scales.data() + sizeof(float) * window[0], 0xa5,
                  sizeof(float) * (window[1] - window[0]));
    }
  };
  auto report = [&](const std::string& who) {
    for (const auto& window : kWindows) {
      const std::string wrong = CompareWindow(big, small, window[0], window[1]);
      if (!wrong.empty()) {
        std::printf("FAIL 64-bit indexing, %s: %s differs from its twin below 2^31\n", who.c_str(),
                    wrong.c_str());
        ++failures;
        return;
      }
    }
  };

  clear_windows();
  for (const auto& window : kWindows) RunOnCpu(args, window[0], window[1]);
  report("CPU kernel");

  simt::SetDeviceLimits(simt::DeviceLimits{});
  ForgetDeviceSetups();
  for (const KernelVariant variant :
       {KernelVariant::kBlockShared, KernelVariant::kWarpRows, KernelVariant::kBlockRegisters}) {
    const std::string who = kKernelVariantNames[static_cast<int>(variant)];
    SetKernelVariant(variant);
    LaunchPlan plan{};
    if (PlanLaunch(0, args, &plan) != cudaSuccess || plan.variant != variant) {
      std::printf("FAIL 64-bit indexing, %s: the plan does not run this variant\n", who.c_str());
      ++failures;
      continue;
    }
    clear_windows();
    for (const auto& window : kWindows) {
      simt::ScopedBuffers buffers;
      buffers.Add("x", x.data(), x.bytes());
      buffers.Add("residual", residual.data(), residual.bytes());
      buffers.Add("gamma", gamma, sizeof(gamma));
      buffers.Add("y", y.data(), y.bytes());
      buffers.Add("scales", scales.data(), scales.bytes());
      buffers.Add("residual_out", residual_out.data(), residual_out.bytes());
      const int64_t rows_per_block = plan.rows_per_block;
      simt::ScopedBlockWindow blocks(static_cast<unsigned>(window[0] / rows_per_block),
                                     static_cast<unsigned>(window[1] / rows_per_block + 1));
      const cudaError_t status = LaunchRmsNormFp8(nullptr, 0, args);
      const std::vector<simt::LaunchRecord> launches = simt::TakeLaunches();
      if (status != cudaSuccess || launches.empty() || !launches.back().error.empty()) {
        std::printf("FAIL 64-bit indexing, %s: launch failed: %s\n", who.c_str(),
                    launches.empty() ? "no launch recorded" : launches.back().error.c_str());
        ++failures;
      }
    }
    report(who);
  }
  SetKernelVariant(KernelVariant::kAuto);
  if (failures == 0) {
    std::printf(
        "PASS 64-bit indexing: rows past byte and element 2^31, the CPU kernel and "
        "every variant\n");
  }
  return failures;
}

}  // namespace fp8norm
