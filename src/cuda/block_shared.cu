// block_shared, the kernel family that takes every shape and alignment: one block per row
// (grid-stride over rows), three sweeps over the row (block_shared_rows.cuh,
// docs/performance.md). Scales per group of any size take a kernel of their own.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "block_shared_rows.cuh"
#include "kernel_families.h"
#include "kernel_launch.h"
#include "row_blocks.cuh"

namespace fp8norm {
namespace {

// grid: any number of blocks (rows are strided over them); block: a multiple of 32 threads.
// Dynamic shared memory: hidden floats when `cached`, none otherwise. kGroups: scales per
// group, a kernel of its own so that its registers do not weigh on the per-row one.
template <typename TIn, bool kGroups>
__global__ void __launch_bounds__(kMaxThreads)
    BlockSharedKernel(const RmsNormFp8Args a, const bool vectorized, const bool cached) {
  float* const cache = DynamicShared<float>();
  SharedScratch& scratch = StaticShared<SharedScratch>();
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    float* const row_cache = cached ? cache : nullptr;
    if constexpr (kGroups) {
      if (vectorized) {
        ProcessGroupedRow<TIn, kVecOf<TIn>>(a, row, row_cache, scratch);
      } else {
        ProcessGroupedRow<TIn, 1>(a, row, row_cache, scratch);
      }
    } else if (vectorized) {
      ProcessRow<TIn, kVecOf<TIn>>(a, row, row_cache, scratch);
    } else {
      ProcessRow<TIn, 1>(a, row, row_cache, scratch);
    }
  }
}

template <typename TIn>
cudaError_t SetUpBlockSharedFor(const DeviceLimits& device, DeviceLimits* limits) {
  cudaFuncAttributes attributes{};
  cudaError_t err = cudaSuccess;
  // Per row and per group: each loaded, its static size read and its dynamic-size
  // attribute set; the plan keeps to the stricter of the two.
  *limits = device;
  limits->static_shared_bytes = 0;
  limits->max_dynamic_shared_bytes = SIZE_MAX;
  const auto set_up = [&](auto kernel) {
    if (err != cudaSuccess) return;
    err = LoadKernel(kernel, "block_shared", sizeof(SharedScratch), kMaxThreads, &attributes);
    if (err != cudaSuccess) return;
    const size_t static_bytes = attributes.sharedSizeBytes;
    limits->static_shared_bytes = std::max(limits->static_shared_bytes, static_bytes);
    const size_t most_dynamic =
        device.optin_shared_bytes > static_bytes ? device.optin_shared_bytes - static_bytes : 0;
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(most_dynamic));
    if (err != cudaSuccess) {
      cudaGetLastError();
      // Refused inside graph capture: nothing is kept, so that a call outside capture sets
      // it. Refused otherwise: the plan keeps to what the kernel allows as it is.
      if (IsCaptureError(err)) return;
    }
    err = cudaFuncGetAttributes(&attributes, kernel);
    if (err != cudaSuccess) return;
    limits->max_dynamic_shared_bytes =
        std::min(limits->max_dynamic_shared_bytes,
                 static_cast<size_t>(std::max(0, attributes.maxDynamicSharedSizeBytes)));
  };
  set_up(BlockSharedKernel<TIn, false>);
  set_up(BlockSharedKernel<TIn, true>);
  return err;
}

}  // namespace

cudaError_t SetUpBlockShared(FloatType input, const DeviceLimits& device, DeviceLimits* limits) {
  return WithInputType(input, [&](auto type) {
    return SetUpBlockSharedFor<typename decltype(type)::Type>(device, limits);
  });
}

cudaError_t LaunchBlockShared(cudaStream_t stream, const RmsNormFp8Args& a, const LaunchPlan& p) {
  return WithInputType(a.input_type, [&](auto type) {
    using TIn = typename decltype(type)::Type;
    return LaunchKernel(
        PerRowScale(a) ? BlockSharedKernel<TIn, false> : BlockSharedKernel<TIn, true>, p.blocks,
        p.threads, p.dynamic_shared_bytes, stream, a, p.vectorized, p.cached);
  });
}

}  // namespace fp8norm
