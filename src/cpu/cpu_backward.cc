// CPU kernel of the backward pass (docs/spec.md, "Training: the backward pass"), in two
// parallel passes over the call:
//   rows:    each row's c (an exact sum over the row), then dx (and dresidual);
//   columns: dgamma, an exact sum over every row of each column. Tasks take a block of
//            columns and a chunk of rows each, with an exact accumulator per column; the
//            chunks' accumulators are merged exactly at the end, so the bits depend on
//            neither the split nor the thread count.
// The arithmetic is fp8norm_math.h's, the same functions the CUDA kernels call. Built with
// -ffp-contract=off, as the forward: a contracted multiply-add would round differently.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <new>
#include <string_view>
#include <vector>

#include "cpu_exact_sums.h"
#include "fp8norm_math.h"
#include "rms_norm_backward.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FP8NORM_CPU_HAS_AVX2_VARIANT 1
#endif

namespace fp8norm {
namespace {

// About this many tasks per pass, for the reasons of the forward's (cpu_kernels.cc): a
// late helper still finds work, and the cores finish within a task of each other.
constexpr int64_t kTasksPerPass = 64;
constexpr int64_t kMinElementsPerTask = int64_t{1} << 14;
// Columns per dgamma task: a block's accumulators (88 bytes a column) stay in L1/L2 while
// its rows stream through.
constexpr int64_t kColumnBlock = 256;
// At most this many bytes of dgamma accumulators per call: the number of row chunks
// gives way first.
constexpr int64_t kMaxAccumulatorBytes = int64_t{64} << 20;

template <typename T>
float LoadAt(const void* p, int64_t i) {
  return ToFloat(static_cast<const T*>(p)[i]);
}

template <typename T>
void StoreAt(void* p, int64_t i, float v) {
  static_cast<T*>(p)[i] = FromFloat<T>(v);
}

// The loops, compiled once per instruction set like the forward's: the element-wise parts
// vectorise, the exact accumulation is scalar integer work either way.
#define FP8NORM_BACKWARD_ISA baseline
#define FP8NORM_BACKWARD_AVX2 0
#include "cpu_backward_rows.inc"
#undef FP8NORM_BACKWARD_ISA
#undef FP8NORM_BACKWARD_AVX2

#if defined(FP8NORM_CPU_HAS_AVX2_VARIANT)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define FP8NORM_BACKWARD_ISA avx2
#define FP8NORM_BACKWARD_AVX2 1
#include "cpu_backward_rows.inc"
#undef FP8NORM_BACKWARD_ISA
#undef FP8NORM_BACKWARD_AVX2
#pragma GCC pop_options
#endif

struct BackwardVariant {
  decltype(&baseline::BackwardRows) rows;
  decltype(&baseline::DgammaColumns) columns;
};

BackwardVariant SelectBackwardVariant() {
  // The same choice as the forward's (cpu_kernels.cc): its name is the one reported.
#if defined(FP8NORM_CPU_HAS_AVX2_VARIANT)
  if (std::string_view(CpuKernelVariant()) == "avx2") {
    return {avx2::BackwardRows, avx2::DgammaColumns};
  }
#endif
  return {baseline::BackwardRows, baseline::DgammaColumns};
}

template <typename T>
void FillGamma(const void* gamma, float weight_offset, int64_t n, float* out) {
  for (int64_t j = 0; j < n; ++j) {
    out[j] = FlushTiny(GammaPlusOffset(FlushTiny(LoadAt<T>(gamma, j)), weight_offset));
  }
}

}  // namespace

bool RmsNormBackwardCpu(const RmsNormBackwardArgs& a, const ParallelFor& parallel_for) {
  const int64_t n = a.hidden;
  if (n == 0) return true;
  if (a.rows == 0) {
    for (int64_t j = 0; j < n; ++j) a.dgamma[j] = 0.0f;
    return true;
  }
  static const BackwardVariant variant = SelectBackwardVariant();
  std::vector<float> g;
  try {
    g.resize(n);
  } catch (const std::bad_alloc&) {
    return false;
  }
  switch (a.gamma_type) {
    case FloatType::kF16:
      FillGamma<F16>(a.gamma, a.weight_offset, n, g.data());
      break;
    case FloatType::kBF16:
      FillGamma<BF16>(a.gamma, a.weight_offset, n, g.data());
      break;
    default:
      FillGamma<float>(a.gamma, a.weight_offset, n, g.data());
  }
  std::atomic<bool> out_of_memory{false};
  const size_t elements = static_cast<size_t>(a.rows) * static_cast<size_t>(n);
  AdviseHugePages(a.dx, elements * FloatTypeBytes(a.input_type));
  if (a.dresidual != nullptr)
    AdviseHugePages(a.dresidual, elements * FloatTypeBytes(a.residual_type));

  // Rows: dx (and dresidual).
  const int64_t rows_per_task =
      std::max<int64_t>(1, std::max(a.rows * n / kTasksPerPass, kMinElementsPerTask) / n);
  const int64_t row_tasks = (a.rows + rows_per_task - 1) / rows_per_task;
  parallel_for(row_tasks, [&](int64_t task) {
    const int64_t begin = task * rows_per_task;
    if (!variant.rows(a, g.data(), begin, std::min(a.rows, begin + rows_per_task))) {
      out_of_memory.store(true, std::memory_order_relaxed);
    }
  });

  // Columns: dgamma, in blocks of columns times chunks of rows.
  const int64_t width = std::min(n, kColumnBlock);
  const int64_t blocks = (n + width - 1) / width;
  const int64_t accumulator_bytes = n * int64_t{sizeof(ExactSum)};
  int64_t chunks = std::clamp<int64_t>(kTasksPerPass / blocks, 1, a.rows);
  chunks = std::min(chunks, std::max<int64_t>(1, kMaxAccumulatorBytes / accumulator_bytes));
  chunks = std::min(chunks, std::max<int64_t>(1, a.rows * n / kMinElementsPerTask));
  const int64_t rows_per_chunk = (a.rows + chunks - 1) / chunks;
  chunks = (a.rows + rows_per_chunk - 1) / rows_per_chunk;
  std::vector<ExactSum> partials;
  try {
    partials.resize(static_cast<size_t>(chunks * n));
  } catch (const std::bad_alloc&) {
    return false;
  }
  parallel_for(blocks * chunks, [&](int64_t task) {
    const int64_t block = task % blocks, chunk = task / blocks;
    const int64_t first = block * width, last = std::min(n, first + width);
    const int64_t begin = chunk * rows_per_chunk;
    if (!variant.columns(a, begin, std::min(a.rows, begin + rows_per_chunk), first, last,
                         partials.data() + chunk * n)) {
      out_of_memory.store(true, std::memory_order_relaxed);
    }
  });
  parallel_for(blocks, [&](int64_t block) {
    for (int64_t j = block * width, last = std::min(n, j + width); j < last; ++j) {
      ExactSum total = partials[j];
      for (int64_t chunk = 1; chunk < chunks; ++chunk) Merge(total, partials[chunk * n + j]);
      a.dgamma[j] = Round(total);
    }
  });
  return !out_of_memory.load();
}

}  // namespace fp8norm
