// The kernel families that hold a row in registers (register_row.cuh): warp_rows (1 to 8
// warps per row, several rows per block) and block_registers (a whole block per row). The
// same three sweeps as block_shared.cu, over registers instead of shared memory. Aligned
// rows that fit only (the launch plan decides).
#include <cuda_runtime.h>

#include <cstdint>

#include "kernel_families.h"
#include "kernel_launch.h"
#include "register_row.cuh"

namespace fp8norm {
namespace {

// warp_rows. grid: any number of blocks (groups of rows_per_block rows are strided over
// them); block: kWarpRowsBlockThreads threads, `threads_per_row` (a power of two, 32 to
// 256) per row. Aligned rows of at most threads_per_row * kVecs vectors.
template <typename TIn, int kVecs>
__global__ void __launch_bounds__(kWarpRowsBlockThreads, 2)
    WarpRowsKernel(const RmsNormFp8Args a, const int threads_per_row) {
  RegisterScratch& scratch = StaticShared<RegisterScratch>();
  const int rows_per_block = static_cast<int>(blockDim.x) / threads_per_row;
  const int block_row = static_cast<int>(threadIdx.x) / threads_per_row;
  const int lane = static_cast<int>(threadIdx.x) % threads_per_row;
  // The same trip count for every row of the block: the threads of a row past the end
  // still meet the others at the reductions' barriers.
  for (int64_t first = int64_t{blockIdx.x} * rows_per_block; first < a.rows;
       first += int64_t{gridDim.x} * rows_per_block) {
    RegisterRow<TIn, kVecs>(a, first + block_row, a.rows, lane, threads_per_row, scratch);
  }
}

// Registers per thread: at most 64 with 2 vectors, which bf16 rows need without spilling
// (docs/performance.md, "Figures behind choices in the source"), so that blocks of up to
// 256 threads (rows up to 4096 bf16) run 4 to an SM and 512-thread ones 2; at most 128
// with 4 vectors.
constexpr int BlockRegistersMinBlocks(int vectors) { return vectors <= 2 ? 2 : 1; }

// block_registers. grid: any number of blocks (rows are strided over them); block: up to
// kBlockRegistersMaxThreads threads, whole warps, all holding one row. Aligned rows of at
// most blockDim.x * kVecs vectors.
template <typename TIn, int kVecs>
__global__ void __launch_bounds__(kBlockRegistersMaxThreads, BlockRegistersMinBlocks(kVecs))
    BlockRegistersKernel(const RmsNormFp8Args a) {
  RegisterScratch& scratch = StaticShared<RegisterScratch>();
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    RegisterRow<TIn, kVecs>(a, row, a.rows, static_cast<int>(threadIdx.x),
                            static_cast<int>(blockDim.x), scratch);
  }
}

template <typename TIn>
cudaError_t LoadRegisterRowKernelsFor() {
  cudaFuncAttributes attributes{};
  cudaError_t err = cudaSuccess;
  const auto load = [&](auto kernel, const char* name, int max_threads) {
    if (err == cudaSuccess) {
      err = LoadKernel(kernel, name, sizeof(RegisterScratch), max_threads, &attributes);
    }
  };
  load(WarpRowsKernel<TIn, 1>, "warp_rows", kWarpRowsBlockThreads);
  load(WarpRowsKernel<TIn, 2>, "warp_rows", kWarpRowsBlockThreads);
  load(WarpRowsKernel<TIn, 4>, "warp_rows", kWarpRowsBlockThreads);
  load(BlockRegistersKernel<TIn, 2>, "block_registers", kBlockRegistersMaxThreads);
  load(BlockRegistersKernel<TIn, 4>, "block_registers", kBlockRegistersMaxThreads);
  return err;
}

}  // namespace

cudaError_t LoadRegisterRowKernels(FloatType input) {
  return WithInputType(
      input, [](auto type) { return LoadRegisterRowKernelsFor<typename decltype(type)::Type>(); });
}

cudaError_t LaunchRegisterRows(cudaStream_t stream, const RmsNormFp8Args& a, const LaunchPlan& p) {
  return WithInputType(a.input_type, [&](auto type) {
    using TIn = typename decltype(type)::Type;
    if (p.variant == KernelVariant::kWarpRows) {
      const auto kernel = p.vectors_per_thread == 1   ? WarpRowsKernel<TIn, 1>
                          : p.vectors_per_thread == 2 ? WarpRowsKernel<TIn, 2>
                                                      : WarpRowsKernel<TIn, 4>;
      return LaunchKernel(kernel, p.blocks, p.threads, 0, stream, a, p.threads_per_row);
    }
    const auto kernel =
        p.vectors_per_thread == 2 ? BlockRegistersKernel<TIn, 2> : BlockRegistersKernel<TIn, 4>;
    return LaunchKernel(kernel, p.blocks, p.threads, 0, stream, a);
  });
}

}  // namespace fp8norm
