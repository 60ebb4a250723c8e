// The element-wise float32 -> float16 / bfloat16 / FP8 / FP4 rounding kernel of the round target
// (tests check the kernels' own conversions with it on every boundary).
#include <cuda_runtime.h>

#include <cstdint>

#include "kernel_families.h"
#include "kernel_launch.h"
#include "row_blocks.cuh"

namespace fp8norm {
namespace {

// grid: any number of blocks (elements are strided over them); block: any size.
__global__ void RoundKernel(const RoundArgs a) {
  const auto load = [&](int64_t i) { return LoadGlobal(a.in + i); };
  const int64_t outputs = RoundedOutputs(a);
  for (int64_t k = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; k < outputs;
       k += int64_t{gridDim.x} * blockDim.x) {
    const uint16_t bits = RoundedOutput(a, k, load);
    if (IsOneByte(a.target)) {
      StoreGlobal(static_cast<uint8_t*>(a.out) + k, static_cast<uint8_t>(bits));
    } else {
      StoreGlobal(static_cast<uint16_t*>(a.out) + k, bits);
    }
  }
}

}  // namespace

cudaError_t LoadRoundKernel() {
  cudaFuncAttributes attributes{};
  return cudaFuncGetAttributes(&attributes, RoundKernel);
}

cudaError_t LaunchRound(cudaStream_t stream, const RoundArgs& a) {
  if (a.count == 0) return cudaSuccess;
  // 256 threads: an element-wise kernel needs no tuning; the grid-stride loop covers any
  // count.
  constexpr int kThreads = 256;
  return LaunchKernel(RoundKernel, StridingGrid((a.count + kThreads - 1) / kThreads), kThreads, 0,
                      stream, a);
}

}  // namespace fp8norm
