// What the CPU kernels (the forward's cpu_kernels.cc, the backward's cpu_backward.cc and
// cpu_exact_sums.h) share about how they are built and run: whether the build has AVX2
// variants of the loops, and how a call's rows are split into tasks, which the calling
// thread and the pool's helpers claim one by one (cpu_handlers.cc).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <new>
#include <vector>

// The AVX2 + FMA + F16C variants, chosen at run time: x86-64 with GCC, whose target
// pragmas build them beside the baseline loops (cpu_isa_variants.inc).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FP8NORM_CPU_HAS_AVX2_VARIANT 1
#endif

namespace fp8norm {

// Whether this process's calls run the AVX2 variants of the loops: the build has them,
// the CPU runs AVX2, FMA and F16C, and FP8NORM_CPU_ISA=baseline in the environment does
// not force the baseline (the tests hold the two to the same bits). Decided once, for the
// forward and the backward alike (cpu_kernels.cc).
bool CpuUsesAvx2();

// The function `name` of the loops compiled per instruction set (cpu_isa_variants.inc),
// in the variant CpuUsesAvx2 picks.
#if defined(FP8NORM_CPU_HAS_AVX2_VARIANT)
#define FP8NORM_CPU_LOOP(name) (::fp8norm::CpuUsesAvx2() ? avx2::name : baseline::name)
#else
#define FP8NORM_CPU_LOOP(name) (baseline::name)
#endif

// About kTasksPerCall tasks a call, so that a helper that starts late still finds work
// and every core finishes within one task of the others; each at least
// kMinElementsPerTask elements (work well above the cost of claiming a task), so that a
// small call (16 x 4096) splits in a few and a one-row call stays on the calling thread;
// the forward's at most kMaxElementsPerTask, which bounds how long one core can wait for
// another at the end of a large call (docs/performance.md, "Figures behind choices in the
// source").
constexpr int64_t kTasksPerCall = 64;
constexpr int64_t kMinElementsPerTask = int64_t{1} << 14;
constexpr int64_t kMaxElementsPerTask = int64_t{1} << 17;

// The environment variable `name` as a positive integer; 0 when it is unset or anything
// else (the switches that take a count read it once, at first use).
inline int64_t PositiveIntegerFromEnvironment(const char* name) {
  const char* text = std::getenv(name);
  if (text == nullptr) return 0;
  char* end = nullptr;
  const long long value = std::strtoll(text, &end, 10);
  return (end != text && *end == '\0' && value > 0) ? static_cast<int64_t>(value) : 0;
}

// This thread's buffer `kWhich` (a value of a kernel's enum of its buffers) of at least
// `size` elements of T, kept between calls
// (grown to the largest size asked for, never shrunk): null when the memory cannot be had
// (the call then fails; the process goes on), and possibly for a size of 0.
template <auto kWhich, typename T = float>
T* ThreadBuffer(int64_t size) {
  thread_local std::vector<T> buffer;
  if (static_cast<int64_t>(buffer.size()) < size) {
    try {
      buffer.resize(size);
    } catch (const std::bad_alloc&) {
      return nullptr;
    }
  }
  return buffer.data();
}

}  // namespace fp8norm
