// Host-side building blocks of the kernel families' launches: loading a kernel, launching
// it with a configuration, and dispatching on the input type (run-time in the call's
// arguments, a template parameter of the kernels).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "device_memory.h"
#include "fp8norm_math.h"

namespace fp8norm {

// cudaErrorStreamCaptureUnsupported (900) to cudaErrorStreamCaptureWrongThread (908): the
// call was made while a stream captures a graph.
inline bool IsCaptureError(cudaError_t err) { return err >= 900 && err <= 908; }

// Loads `kernel` (cudaFuncGetAttributes forces the lazy load) and returns its attributes.
// `name`, `static_shared` (the __shared__ struct it uses) and `max_threads` (its
// __launch_bounds__) are for the emulation.
template <typename Kernel>
cudaError_t LoadKernel(Kernel kernel, const char* name, size_t static_shared, int max_threads,
                       cudaFuncAttributes* attributes) {
  DeclareKernel(kernel, name, static_shared, max_threads);
  return cudaFuncGetAttributes(attributes, kernel);
}

// The grid of a kernel that strides over `tasks` blocks' worth of work: at most 65535
// blocks, striding over the rest (a grid that large fills every multiprocessor many times
// over).
constexpr int64_t kMaxStridingBlocks = 65535;
inline unsigned StridingGrid(int64_t tasks) {
  return static_cast<unsigned>(tasks < kMaxStridingBlocks ? tasks : kMaxStridingBlocks);
}

template <typename Kernel, typename... Args>
cudaError_t LaunchKernel(Kernel kernel, unsigned blocks, int threads, size_t dynamic_shared_bytes,
                         cudaStream_t stream, const Args&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(blocks);
  config.blockDim = dim3(static_cast<unsigned>(threads));
  config.dynamicSmemBytes = dynamic_shared_bytes;
  config.stream = stream;
  return cudaLaunchKernelEx(&config, kernel, args...);
}

template <typename T>
struct TypeTag {
  using Type = T;
};

// f(TypeTag<T>{}) for the C++ type T of the input type `type`.
template <typename F>
auto WithInputType(FloatType type, F f) {
  switch (type) {
    case FloatType::kF16:
      return f(TypeTag<F16>{});
    case FloatType::kBF16:
      return f(TypeTag<BF16>{});
    default:
      return f(TypeTag<float>{});
  }
}

}  // namespace fp8norm
