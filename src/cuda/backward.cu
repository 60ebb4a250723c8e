// The backward pass of rms_norm_fp8 / add_rms_norm_fp8 (docs/spec.md, "Training: the
// backward pass"): a plan of its own, two kernels.
//   BackwardRowsKernel: a block per row. Each thread adds its elements' terms a_j * u_j to
//     an exact accumulator (ExactSum, fp8norm_math.h); the block merges them exactly in
//     shared memory, rounds c once, and its threads write dx (and dresidual).
//   DgammaKernel: a block per kDgammaColumns columns, its warps taking every
//     kDgammaRowGroups-th row, each lane one column's exact accumulator; the row groups
//     are merged exactly through shared memory and rounded once.
// Integer limbs add in any order with the same result, so neither the block size, the
// grid nor the thread a row lands on can change a bit, and there are no float atomics.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernel_families.h"
#include "kernel_launch.h"
#include "rms_norm_backward.h"
#include "row_blocks.cuh"

namespace fp8norm {
namespace {

// 256 threads: a row's elements spread over eight warps, and the block's accumulators
// (88 bytes each) fit in 22.5 KiB of static shared memory.
constexpr int kBackwardThreads = 256;
// dgamma: a warp's lanes read 32 consecutive columns of a row (one coalesced access), and
// the block's 8 warps take every 8th row.
constexpr int kDgammaColumns = kWarp;
constexpr int kDgammaRowGroups = kBackwardThreads / kWarp;

struct BackwardScratch {
  ExactSum parts[kBackwardThreads];
  ExactSum total;
};

// h_j of element i of the call as the backward takes it: x (+ residual), each flushed.
__device__ __forceinline__ float LoadH(const RmsNormBackwardArgs& a, int64_t i) {
  float h = FlushTiny(LoadElement(a.x, a.input_type, i));
  if (a.residual != nullptr) h += FlushTiny(LoadElement(a.residual, a.residual_type, i));
  return h;
}

__device__ __forceinline__ float GammaAt(const RmsNormBackwardArgs& a, int64_t j) {
  return FlushTiny(
      GammaPlusOffset(FlushTiny(LoadElement(a.gamma, a.gamma_type, j)), a.weight_offset));
}

// The exact sum of parts[0, count) into `total`, by kLimbs + 1 threads: thread k sums
// limb k, thread kLimbs the specials. Called by every thread of the block, between
// barriers.
__device__ __forceinline__ void MergeParts(BackwardScratch& s, int count, int k) {
  if (k < ExactSum::kLimbs) {
    int64_t limb = 0;
    for (int i = 0; i < count; ++i) limb += s.parts[i].limbs[k];
    s.total.limbs[k] = limb;
  } else if (k == ExactSum::kLimbs) {
    uint32_t specials = 0;
    for (int i = 0; i < count; ++i) specials |= s.parts[i].specials;
    s.total.specials = specials;
  }
}

// grid: any number of blocks (rows are strided over them); block: kBackwardThreads.
__global__ void __launch_bounds__(kBackwardThreads)
    BackwardRowsKernel(const RmsNormBackwardArgs a) {
  BackwardScratch& s = StaticShared<BackwardScratch>();
  const int64_t n = a.hidden;
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const int64_t offset = row * n;
    const float r = FlushTiny(LoadGlobal(a.inverse_rms + row));
    ExactSum c;
    Clear(c);
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      const float u = NormalizedInput(LoadH(a, offset + j), r);
      const float ag = GradTimesGamma(LoadElement(a.dn, a.dn_type, offset + j), GammaAt(a, j));
      Add(c, ProductTerm(ag, u));
    }
    s.parts[threadIdx.x] = c;
    __syncthreads();  // every part written before any is merged
    MergeParts(s, blockDim.x, threadIdx.x);
    __syncthreads();
    const float c_over_n = MeanOfTerms(Round(s.total), n);
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      const float u = NormalizedInput(LoadH(a, offset + j), r);
      const float ag = GradTimesGamma(LoadElement(a.dn, a.dn_type, offset + j), GammaAt(a, j));
      float dx = InputGradient(ag, u, c_over_n, r);
      if (a.residual != nullptr) {
        dx = PlusResidualGradient(dx, LoadElement(a.d_residual_out, a.residual_type, offset + j));
        StoreElement(a.dresidual, a.residual_type, offset + j, dx);
      }
      StoreElement(a.dx, a.input_type, offset + j, dx);
    }
    // No barrier here: the next row's parts are written after this row's second barrier
    // (its merge done), its total after its own first one, which every thread reaches only
    // once it has read this row's total.
  }
}

// grid: ceil(hidden / kDgammaColumns) blocks; block: kBackwardThreads.
__global__ void __launch_bounds__(kBackwardThreads) DgammaKernel(const RmsNormBackwardArgs a) {
  BackwardScratch& s = StaticShared<BackwardScratch>();
  const int lane = threadIdx.x % kDgammaColumns;
  const int group = threadIdx.x / kDgammaColumns;
  const int64_t column = int64_t{blockIdx.x} * kDgammaColumns + lane;
  ExactSum acc;
  Clear(acc);
  if (column < a.hidden) {
    for (int64_t row = group; row < a.rows; row += kDgammaRowGroups) {
      const int64_t i = row * a.hidden + column;
      const float u = NormalizedInput(LoadH(a, i), FlushTiny(LoadGlobal(a.inverse_rms + row)));
      Add(acc, ProductTerm(FlushTiny(LoadElement(a.dn, a.dn_type, i)), u));
    }
  }
  s.parts[threadIdx.x] = acc;
  __syncthreads();
  // Each column's row groups, merged by the first warp (one lane a column).
  if (threadIdx.x < kDgammaColumns) {
    ExactSum sum = s.parts[threadIdx.x];
    for (int g = 1; g < kDgammaRowGroups; ++g)
      Merge(sum, s.parts[g * kDgammaColumns + threadIdx.x]);
    const int64_t out = int64_t{blockIdx.x} * kDgammaColumns + threadIdx.x;
    if (out < a.hidden) StoreGlobal(a.dgamma + out, Round(sum));
  }
}

}  // namespace

cudaError_t LoadBackwardKernels() {
  cudaFuncAttributes attributes{};
  cudaError_t err = LoadKernel(BackwardRowsKernel, "backward_rows", sizeof(BackwardScratch),
                               kBackwardThreads, &attributes);
  if (err == cudaSuccess) {
    err =
        LoadKernel(DgammaKernel, "dgamma", sizeof(BackwardScratch), kBackwardThreads, &attributes);
  }
  return err;
}

cudaError_t LaunchRmsNormBackward(cudaStream_t stream, const RmsNormBackwardArgs& a) {
  if (a.hidden == 0) return cudaSuccess;
  // What the emulation knows of the kernels (nothing on a GPU, where the device's
  // preparation has loaded them): a launch needs no preparation first.
  DeclareKernel(BackwardRowsKernel, "backward_rows", sizeof(BackwardScratch), kBackwardThreads);
  DeclareKernel(DgammaKernel, "dgamma", sizeof(BackwardScratch), kBackwardThreads);
  // Rows: one block each (StridingGrid).
  if (a.rows > 0) {
    const cudaError_t err =
        LaunchKernel(BackwardRowsKernel, StridingGrid(a.rows), kBackwardThreads, 0, stream, a);
    if (err != cudaSuccess) return err;
  }
  const unsigned column_blocks =
      static_cast<unsigned>((a.hidden + kDgammaColumns - 1) / kDgammaColumns);
  return LaunchKernel(DgammaKernel, column_blocks, kBackwardThreads, 0, stream, a);
}

}  // namespace fp8norm
