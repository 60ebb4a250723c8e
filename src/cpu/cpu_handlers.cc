// XLA FFI handlers for the CPU kernels: decode and check the buffers, then run the
// kernel with its row tasks spread over XLA's intra-op thread pool.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <string>

#include "cpu_config.h"
#include "cpu_quantize_weight.h"
#include "ffi_decode.h"
#include "handlers.h"
#include "quantize_gradient_ffi.h"
#include "rms_norm_backward.h"
#include "rms_norm_fp8.h"
#include "xla/ffi/api/ffi.h"

namespace fp8norm {
namespace {

// Tasks are claimed from a shared counter by the calling thread and by helpers scheduled
// on the pool. The caller never waits on a helper that has not started: it runs every
// unclaimed task itself, so a busy (or absent) pool cannot deadlock the call. Helpers
// that start late find nothing left and touch only the shared state they co-own.
struct TaskQueue {
  std::function<void(int64_t)> task;
  int64_t num_tasks = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> finished{0};
  std::mutex mutex;
  std::condition_variable all_finished;

  void Drain() {
    int64_t ran = 0;
    for (int64_t i = next.fetch_add(1); i < num_tasks; i = next.fetch_add(1)) {
      task(i);
      ++ran;
    }
    if (ran > 0 && finished.fetch_add(ran) + ran == num_tasks) {
      {
        std::lock_guard<std::mutex> lock(mutex);
      }
      all_finished.notify_all();
    }
  }
};

// FP8NORM_CPU_THREADS=k in the environment caps the threads one call uses at k (the caller
// included), for processes that share the machine's cores; unset or not a positive
// integer, every thread of XLA's pool may work. Read once.
int64_t MaxThreadsPerCall() {
  static const int64_t max_threads = PositiveIntegerFromEnvironment("FP8NORM_CPU_THREADS");
  return max_threads;
}

ParallelFor PoolParallelFor(ffi::ThreadPool& pool) {
  return [&pool](int64_t num_tasks, const std::function<void(int64_t)>& task) {
    if (num_tasks <= 1) {
      if (num_tasks == 1) task(0);
      return;
    }
    auto queue = std::make_shared<TaskQueue>();
    queue->task = task;
    queue->num_tasks = num_tasks;
    // The caller works too: one helper fewer than the pool's threads keeps one thread
    // per core (XLA sizes its pool to the cores) instead of oversubscribing them
    // (docs/performance.md, "Figures behind choices in the source").
    int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, num_tasks - 1);
    if (const int64_t cap = MaxThreadsPerCall(); cap > 0) helpers = std::min(helpers, cap - 1);
    // A helper that cannot be scheduled (its closure not allocated) leaves its share to
    // the caller: an exception here would unwind past helpers already running the task.
    for (int64_t i = 0; i < helpers; ++i) {
      try {
        pool.Schedule([queue] { queue->Drain(); });
      } catch (const std::bad_alloc&) {
        break;
      }
    }
    queue->Drain();
    std::unique_lock<std::mutex> lock(queue->mutex);
    queue->all_finished.wait(lock, [&] { return queue->finished.load() == num_tasks; });
  };
}

ffi::Error RunOnPool(const RmsNormFp8Args& args, ffi::ThreadPool& pool) {
  if (RmsNormFp8Cpu(args, PoolParallelFor(pool))) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                    "jax_fp8norm: out of host memory for the scratch of rows of " +
                        std::to_string(args.hidden) + " elements");
}

ffi::Error RmsNormFp8Impl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer gamma,
                          std::optional<ffi::AnyBuffer> scale_operand,
                          ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> scales,
                          ffi::RemainingRets form_results, NormAttributes attributes) {
  RmsNormFp8Args args;
  const ffi::Error status = DecodeNormForm(x, nullptr, gamma, scale_operand, y, scales, nullptr,
                                           form_results, attributes, &args);
  if (status.failure()) return status;
  return RunOnPool(args, pool);
}

ffi::Error AddRmsNormFp8Impl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer residual,
                             ffi::AnyBuffer gamma, std::optional<ffi::AnyBuffer> scale_operand,
                             ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> scales,
                             ffi::Result<ffi::AnyBuffer> residual_out,
                             ffi::RemainingRets form_results, NormAttributes attributes) {
  RmsNormFp8Args args;
  const ffi::Error status = DecodeNormForm(x, &residual, gamma, scale_operand, y, scales,
                                           &residual_out, form_results, attributes, &args);
  if (status.failure()) return status;
  return RunOnPool(args, pool);
}

ffi::Error RunBackwardOnPool(const RmsNormBackwardArgs& args, ffi::ThreadPool& pool) {
  if (RmsNormBackwardCpu(args, PoolParallelFor(pool))) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                    "jax_fp8norm: out of host memory for the backward of rows of " +
                        std::to_string(args.hidden) + " elements");
}

ffi::Error RmsNormBackwardImpl(ffi::ThreadPool pool, ffi::AnyBuffer dn, ffi::AnyBuffer x,
                               ffi::AnyBuffer gamma, ffi::AnyBuffer inverse_rms,
                               ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dgamma,
                               float weight_offset) {
  RmsNormBackwardArgs args;
  ffi::Error status = DecodeRmsNormBackward(dn, nullptr, x, nullptr, gamma, inverse_rms, dx,
                                            nullptr, dgamma, weight_offset, &args);
  if (status.failure()) return status;
  return RunBackwardOnPool(args, pool);
}

ffi::Error AddRmsNormBackwardImpl(ffi::ThreadPool pool, ffi::AnyBuffer dn,
                                  ffi::AnyBuffer d_residual_out, ffi::AnyBuffer x,
                                  ffi::AnyBuffer residual, ffi::AnyBuffer gamma,
                                  ffi::AnyBuffer inverse_rms, ffi::Result<ffi::AnyBuffer> dx,
                                  ffi::Result<ffi::AnyBuffer> dresidual,
                                  ffi::Result<ffi::AnyBuffer> dgamma, float weight_offset) {
  RmsNormBackwardArgs args;
  ffi::Error status = DecodeRmsNormBackward(dn, &d_residual_out, x, &residual, gamma, inverse_rms,
                                            dx, &dresidual, dgamma, weight_offset, &args);
  if (status.failure()) return status;
  return RunBackwardOnPool(args, pool);
}

ffi::Error RoundImpl(ffi::AnyBuffer in, ffi::Result<ffi::AnyBuffer> out, int64_t fp4_layout) {
  RoundArgs args;
  ffi::Error status = DecodeRound(in, out, fp4_layout, &args);
  if (status.failure()) return status;
  RoundCpu(args);
  return ffi::Error::Success();
}

ffi::Error QuantizeWeightImpl(ffi::ThreadPool pool, ffi::AnyBuffer w,
                              ffi::Result<ffi::AnyBuffer> codes, ffi::Result<ffi::AnyBuffer> scales,
                              ffi::Result<ffi::AnyBuffer> global_scale, int64_t format,
                              int64_t block, int64_t fp4_layout) {
  QuantizeWeightArgs args;
  ffi::Error status =
      DecodeQuantizeWeight(w, codes, scales, global_scale, format, block, fp4_layout, &args);
  if (status.failure()) return status;
  if (QuantizeWeightCpu(args, PoolParallelFor(pool))) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                    "jax_fp8norm: out of host memory for a weight's scales");
}

ffi::Error QuantizeGradientImpl(ffi::ThreadPool pool, ffi::AnyBuffer g, ffi::AnyBuffer key,
                                ffi::Result<ffi::AnyBuffer> codes,
                                ffi::Result<ffi::AnyBuffer> scales,
                                ffi::Result<ffi::AnyBuffer> global_scales, bool nvfp4,
                                int64_t block, bool columns, bool stochastic, int64_t hadamard_mask,
                                int64_t fp4_layout) {
  QuantizeGradientArgs args;
  const ffi::Error status =
      DecodeQuantizeGradient(g, key, codes, scales, global_scales,
                             {nvfp4, block, columns, stochastic, hadamard_mask, fp4_layout}, &args);
  if (status.failure()) return status;
  if (QuantizeGradientCpu(args, PoolParallelFor(pool))) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                    "jax_fp8norm: out of host memory for the gradient quantiser's scratch");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RmsNormFp8CpuHandler, RmsNormFp8Impl,
                              RmsNormFp8Binding<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(AddRmsNormFp8CpuHandler, AddRmsNormFp8Impl,
                              AddRmsNormFp8Binding<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RmsNormBackwardCpuHandler, RmsNormBackwardImpl,
                              RmsNormBackwardBinding<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(AddRmsNormBackwardCpuHandler, AddRmsNormBackwardImpl,
                              AddRmsNormBackwardBinding<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    RoundCpuHandler, RoundImpl,
    ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Attr<int64_t>("fp4_layout"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizeWeightCpuHandler, QuantizeWeightImpl,
                              QuantizeWeightBinding<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizeGradientCpuHandler, QuantizeGradientImpl,
                              QuantizeGradientBinding<ffi::ThreadPool>());

}  // namespace fp8norm
