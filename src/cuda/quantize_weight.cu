// The weight quantiser's kernels (src/common/quantize_weight.h). FP4 tiles: NVFP4's global
// scale, the tile scales, then the codes, three launches on one stream; the codes are
// written one output byte per thread (two packed codes), each looking up its tile's scale
// byte, so that no two threads write one byte whatever F's parity. FP8 along K: one thread
// per column of a band of rows, reading the band twice (its abs-max, then its codes).
#include <cuda_runtime.h>

#include <cstdint>

#include "kernel_families.h"
#include "kernel_launch.h"
#include "row_blocks.cuh"

namespace fp8norm {
namespace {

constexpr int kQuantizeWeightThreads = 256;

struct AmaxScratch {
  uint32_t partial[32];
  uint32_t result;
};

// grid: 1 block (the maximum is one value; a tensor quantised once per step needs no more);
// block: kQuantizeWeightThreads. MXFP4, which has no global scale, writes 1.
__global__ void __launch_bounds__(kQuantizeWeightThreads)
    WeightGlobalScaleKernel(const QuantizeWeightArgs a) {
  AmaxScratch& s = StaticShared<AmaxScratch>();
  uint32_t amax = 0;
  if (a.nvfp4) {
    for (int64_t i = threadIdx.x; i < a.rows * a.cols; i += blockDim.x) {
      amax = max(amax, AbsBits(LoadElement(a.w, a.w_type, i)));
    }
  }
  amax = BlockReduce(amax, 0u, [](uint32_t v) { return WarpMax(v); }, s.partial, &s.result);
  if (threadIdx.x == 0) StoreGlobal(a.global_scale, a.nvfp4 ? Nvfp4GlobalScale(amax) : 1.0f);
}

// grid: any number of blocks (tiles are strided over them); block: kQuantizeWeightThreads.
__global__ void __launch_bounds__(kQuantizeWeightThreads)
    WeightTileScalesKernel(const QuantizeWeightArgs a) {
  AmaxScratch& s = StaticShared<AmaxScratch>();
  const int64_t tile_columns = TileColumns(a);
  const int64_t tiles = a.rows / a.block * tile_columns;
  const float gs = LoadGlobal(a.global_scale);
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int64_t row0 = tile / tile_columns * a.block;
    const int64_t col0 = tile % tile_columns * a.block;
    uint32_t amax = 0;
    for (int64_t e = threadIdx.x; e < a.block * a.block; e += blockDim.x) {
      const int64_t j = col0 + e % a.block;
      // Past F: the zero padding, which changes no abs-max.
      if (j < a.cols) {
        amax = max(amax, AbsBits(LoadElement(a.w, a.w_type, (row0 + e / a.block) * a.cols + j)));
      }
    }
    amax = BlockReduce(amax, 0u, [](uint32_t v) { return WarpMax(v); }, s.partial, &s.result);
    if (threadIdx.x == 0) StoreGlobal(a.scales + tile, WeightTileScaleCode(a.nvfp4, amax, gs));
  }
}

__device__ __forceinline__ uint8_t WeightElementCode(const QuantizeWeightArgs& a, int64_t e,
                                                     float gs) {
  const int64_t i = e / a.cols;
  const int64_t j = e % a.cols;
  const int64_t tile = i / a.block * TileColumns(a) + j / a.block;
  const Fp4Scale rule = WeightTileScale(a.nvfp4, LoadGlobal(a.scales + tile), gs);
  return QuantizeFp4Element(LoadElement(a.w, a.w_type, e), rule);
}

// grid: any number of blocks (output bytes are strided over them); block: any size.
__global__ void __launch_bounds__(kQuantizeWeightThreads)
    WeightCodesKernel(const QuantizeWeightArgs a) {
  const int64_t count = a.rows * a.cols;
  // Even: rows is a multiple of the (even) block.
  const int64_t outputs = a.codes_packed ? count / 2 : count;
  const float gs = LoadGlobal(a.global_scale);
  auto* out = static_cast<uint8_t*>(a.codes);
  for (int64_t k = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; k < outputs;
       k += int64_t{gridDim.x} * blockDim.x) {
    const uint8_t byte = a.codes_packed ? PackFp4(WeightElementCode(a, 2 * k, gs),
                                                  WeightElementCode(a, 2 * k + 1, gs))
                                        : WeightElementCode(a, k, gs);
    StoreGlobal(out + k, byte);
  }
}

// grid: any number of blocks (a band's strips of blockDim.x columns are strided over them);
// block: any size.
__global__ void __launch_bounds__(kQuantizeWeightThreads)
    WeightFp8ColumnsKernel(const QuantizeWeightArgs a) {
  const bool blocks = a.format == WeightFormat::kFp8Blocks;
  const int64_t strips = (a.cols + blockDim.x - 1) / blockDim.x;
  const int64_t groups = a.rows / a.block * strips;
  auto* out = static_cast<uint8_t*>(a.codes);
  for (int64_t g = blockIdx.x; g < groups; g += gridDim.x) {
    const int64_t band = g / strips;
    const int64_t j = g % strips * blockDim.x + threadIdx.x;
    if (j >= a.cols) continue;
    const int64_t first = band * a.block * a.cols + j;
    uint32_t amax = 0;
    for (int64_t i = 0; i < a.block; ++i) {
      amax = max(amax, AbsBits(LoadElement(a.w, a.w_type, first + i * a.cols)));
    }
    const Fp8ColumnScale s = Fp8ColumnScaleOf(blocks, amax);
    if (blocks) {
      StoreGlobal(a.scales + band * a.cols + j, E8M0Code(s.scale));
    } else {
      StoreGlobal(reinterpret_cast<float*>(a.scales) + j, s.scale);
    }
    for (int64_t i = 0; i < a.block; ++i) {
      const int64_t e = first + i * a.cols;
      StoreGlobal(out + e, Fp8ColumnCode(LoadElement(a.w, a.w_type, e), s));
    }
  }
}

void DeclareQuantizeWeightKernels() {
  DeclareKernel(WeightGlobalScaleKernel, "weight_global_scale", sizeof(AmaxScratch),
                kQuantizeWeightThreads);
  DeclareKernel(WeightTileScalesKernel, "weight_tile_scales", sizeof(AmaxScratch),
                kQuantizeWeightThreads);
  DeclareKernel(WeightCodesKernel, "weight_codes", 0, kQuantizeWeightThreads);
  DeclareKernel(WeightFp8ColumnsKernel, "weight_fp8_columns", 0, kQuantizeWeightThreads);
}

}  // namespace

cudaError_t LoadQuantizeWeightKernels() {
  cudaFuncAttributes attributes{};
  cudaError_t err = LoadKernel(WeightGlobalScaleKernel, "weight_global_scale", sizeof(AmaxScratch),
                               kQuantizeWeightThreads, &attributes);
  if (err == cudaSuccess) {
    err = LoadKernel(WeightTileScalesKernel, "weight_tile_scales", sizeof(AmaxScratch),
                     kQuantizeWeightThreads, &attributes);
  }
  if (err == cudaSuccess) {
    err = LoadKernel(WeightCodesKernel, "weight_codes", 0, kQuantizeWeightThreads, &attributes);
  }
  if (err == cudaSuccess) {
    err = LoadKernel(WeightFp8ColumnsKernel, "weight_fp8_columns", 0, kQuantizeWeightThreads,
                     &attributes);
  }
  return err;
}

cudaError_t LaunchQuantizeWeight(cudaStream_t stream, const QuantizeWeightArgs& a) {
  // What the emulation knows of the kernels: a launch needs no preparation first.
  DeclareQuantizeWeightKernels();
  cudaError_t err = LaunchKernel(WeightGlobalScaleKernel, 1, kQuantizeWeightThreads, 0, stream, a);
  if (!IsFp4(a)) {
    const int64_t strips = (a.cols + kQuantizeWeightThreads - 1) / kQuantizeWeightThreads;
    const int64_t groups = a.block > 0 ? a.rows / a.block * strips : 0;
    if (err == cudaSuccess && groups > 0) {
      err = LaunchKernel(WeightFp8ColumnsKernel, StridingGrid(groups), kQuantizeWeightThreads, 0,
                         stream, a);
    }
    return err;
  }
  const int64_t tiles = a.rows / a.block * TileColumns(a);
  if (err == cudaSuccess && tiles > 0) {
    err = LaunchKernel(WeightTileScalesKernel, StridingGrid(tiles), kQuantizeWeightThreads, 0,
                       stream, a);
  }
  const int64_t outputs = a.codes_packed ? a.rows * a.cols / 2 : a.rows * a.cols;
  if (err == cudaSuccess && outputs > 0) {
    err =
        LaunchKernel(WeightCodesKernel,
                     StridingGrid((outputs + kQuantizeWeightThreads - 1) / kQuantizeWeightThreads),
                     kQuantizeWeightThreads, 0, stream, a);
  }
  return err;
}

}  // namespace fp8norm
