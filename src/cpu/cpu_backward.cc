// CPU kernel of the backward pass (docs/spec.md, "Training: the backward pass"): one
// parallel pass over chunks of rows makes each row's c (an exact sum over the row), then
// dx (and dresidual), and adds the chunk's dgamma terms into an exact accumulator per
// column of its own, while the terms are in L2; the chunks' accumulators are merged
// exactly at the end, so dgamma's bits depend on neither the split nor the thread count.
// The arithmetic is fp8norm_math.h's, the same functions the CUDA kernels call. Built with
// -ffp-contract=off, as the forward: a contracted multiply-add would round differently.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <new>
#include <vector>

#include "cpu_config.h"
#include "cpu_exact_sums.h"
#include "fp8norm_math.h"
#include "rms_norm_backward.h"

namespace fp8norm {
namespace {

// Rows whose dgamma terms are made before they are added: at most 32, and at most 512 KB
// of float32 terms (32 rows of 4096), which stay in a core's L2 until the exact additions
// read them; at least 4, over which each column's additions are shared.
constexpr int64_t kFusedRows = 32;
constexpr int64_t kFusedTermBytes = int64_t{512} << 10;
constexpr int64_t FusedRows(int64_t n) {
  return std::clamp<int64_t>(kFusedTermBytes / (4 * n), 4, kFusedRows);
}
// Columns added at a time (and merged at a time): a block's accumulators (88 bytes a
// column) stay in L1 while the block's rows of terms go through.
constexpr int64_t kColumnBlock = 256;
// At most this many bytes of dgamma accumulators per call (one set per task): the number
// of tasks gives way first.
constexpr int64_t kMaxAccumulatorBytes = int64_t{64} << 20;

// FP8NORM_CPU_BACKWARD_TASK_ROWS=k forces k rows per task (still bounded by the
// accumulators' memory) in place of the split the shape picks, so that a test can show that
// dgamma's bits depend on neither the split nor the thread count: the split is otherwise a
// function of the shape alone, the same for every thread count. 0: unset or not a positive
// integer. Read once.
int64_t ForcedRowsPerTask() {
  static const int64_t forced = PositiveIntegerFromEnvironment("FP8NORM_CPU_BACKWARD_TASK_ROWS");
  return forced;
}

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
#define FP8NORM_CPU_LOOPS "cpu_backward_rows.inc"
#include "cpu_isa_variants.inc"

template <typename T>
void FillGamma(const void* gamma, float weight_offset, int64_t n, float* out) {
  for (int64_t j = 0; j < n; ++j) {
    out[j] = FlushTiny(GammaPlusOffset(FlushTiny(LoadAt<T>(gamma, j)), weight_offset));
  }
}

}  // namespace

int64_t CpuBackwardRowsPerTask(int64_t rows, int64_t hidden) {
  if (rows <= 0 || hidden <= 0) return 1;
  // A task of at least 2 x kFusedRows rows: its accumulators (88 bytes a column) then cost
  // at most about a third of what its rows read and write.
  int64_t rows_per_task = std::max<int64_t>(
      2 * kFusedRows, std::max(rows * hidden / kTasksPerCall, kMinElementsPerTask) / hidden);
  if (const int64_t forced = ForcedRowsPerTask(); forced > 0) rows_per_task = forced;
  const int64_t accumulator_bytes = hidden * int64_t{sizeof(ExactSum)};
  const int64_t max_tasks = std::max<int64_t>(1, kMaxAccumulatorBytes / accumulator_bytes);
  return std::max(rows_per_task, (rows + max_tasks - 1) / max_tasks);
}

bool RmsNormBackwardCpu(const RmsNormBackwardArgs& a, const ParallelFor& parallel_for) {
  const int64_t n = a.hidden;
  if (n == 0) return true;
  if (a.rows == 0) {
    for (int64_t j = 0; j < n; ++j) a.dgamma[j] = 0.0f;
    return true;
  }
  static const auto backward_rows = FP8NORM_CPU_LOOP(BackwardRows);
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

  // Rows: dx (and dresidual), and each task's exact dgamma partials.
  const int64_t rows_per_task = CpuBackwardRowsPerTask(a.rows, n);
  const int64_t row_tasks = (a.rows + rows_per_task - 1) / rows_per_task;
  // Not value-initialised: each task clears its own.
  std::unique_ptr<ExactSum[]> partials(new (std::nothrow)
                                           ExactSum[static_cast<size_t>(row_tasks * n)]);
  if (partials == nullptr) return false;
  parallel_for(row_tasks, [&](int64_t task) {
    const int64_t begin = task * rows_per_task;
    if (!backward_rows(a, g.data(), begin, std::min(a.rows, begin + rows_per_task),
                       partials.get() + task * n)) {
      out_of_memory.store(true, std::memory_order_relaxed);
    }
  });
  if (out_of_memory.load()) return false;

  // dgamma: the tasks' partials merged exactly, a block of columns at a time.
  const int64_t blocks = (n + kColumnBlock - 1) / kColumnBlock;
  parallel_for(blocks, [&](int64_t block) {
    for (int64_t j = block * kColumnBlock, last = std::min(n, j + kColumnBlock); j < last; ++j) {
      ExactSum total = partials[j];
      for (int64_t task = 1; task < row_tasks; ++task) Merge(total, partials[task * n + j]);
      a.dgamma[j] = Round(total);
    }
  });
  return !out_of_memory.load();
}

}  // namespace fp8norm
