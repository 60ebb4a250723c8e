// The output gradient's FP4 quantiser (src/common/quantize_gradient.h) on the GPU:
//   GradientRowsKernel (the dgrad copy): a block per row. NVFP4 reduces the row's abs-max
//     in shared memory for its global scale first; then each thread takes whole groups,
//     whose codes fill whole bytes.
//   GradientAmaxKernel (the columns copy, NVFP4): one block reduces max |M g| over the
//     tensor into the global scale, which the columns kernel reads after it on the stream.
//     One block, as there are no atomics here to merge many: the pass reads g once.
//   GradientColumnsKernel (the wgrad copy): a block per block of rows, a thread per column.
//     Two codes of a byte can belong to two threads (adjacent columns, or a row's last and
//     the next row's first), so the byte's even element is stored first, as the whole
//     byte, and after a barrier the odd one is OR-ed in, its group recomputed.
// Every value is a function of its group and of its element's random bits, so neither the
// grid nor the block size can change a bit.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernel_families.h"
#include "kernel_launch.h"
#include "quantize_gradient.h"
#include "row_blocks.cuh"

namespace fp8norm {
namespace {

constexpr int kGradientThreads = 256;
constexpr int kMaxBlock = 32;

struct AmaxScratch {
  uint32_t parts[kGradientThreads];
};

// The block's largest of each thread's `mine`, in every thread; a barrier before it
// returns, so that the scratch can be reused.
__device__ __forceinline__ uint32_t BlockMax(AmaxScratch& s, uint32_t mine) {
  s.parts[threadIdx.x] = mine;
  __syncthreads();
  for (unsigned half = blockDim.x / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) {
      const uint32_t other = s.parts[threadIdx.x + half];
      if (other > s.parts[threadIdx.x]) s.parts[threadIdx.x] = other;
    }
    __syncthreads();
  }
  const uint32_t out = s.parts[0];
  __syncthreads();
  return out;
}

__device__ __forceinline__ KeyWords KeyOf(const QuantizeGradientArgs& a) {
  if (!a.stochastic) return KeyWords{0, 0};
  return KeyWords{LoadGlobal(a.key), LoadGlobal(a.key + 1)};
}

__device__ __forceinline__ uint32_t BitsAt(const QuantizeGradientArgs& a, KeyWords key, int64_t row,
                                           int64_t col) {
  return a.stochastic ? RandomBits(key, uint32_t(row), uint32_t(col)) : 0u;
}

__device__ __forceinline__ uint32_t MaxBits(uint32_t a, uint32_t b) { return a > b ? a : b; }

// grid: any number of blocks (rows are strided over them); block: kGradientThreads.
__global__ void __launch_bounds__(kGradientThreads)
    GradientRowsKernel(const QuantizeGradientArgs a) {
  AmaxScratch& s = StaticShared<AmaxScratch>();
  const KeyWords key = KeyOf(a);
  const int64_t f = a.cols;
  const int64_t groups = f / a.block;
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const float* g = a.g + row * f;
    float gs = 1.0f;
    if (a.nvfp4) {
      uint32_t amax = 0;
      for (int64_t j = threadIdx.x; j < f; j += blockDim.x) {
        amax = MaxBits(amax, AbsBits(LoadGlobal(g + j)));
      }
      gs = Nvfp4GlobalScale(BlockMax(s, amax));
      if (threadIdx.x == 0) StoreGlobal(a.global_scales + row, gs);
    }
    for (int64_t b = threadIdx.x; b < groups; b += blockDim.x) {
      float t[kMaxBlock];
      uint32_t amax = 0;
      for (int k = 0; k < a.block; ++k) {
        // NVFP4 divides by the row's global scale first, as the twin (t = g / gs).
        t[k] = LoadGlobal(g + b * a.block + k);
        if (a.nvfp4) t[k] = t[k] / gs;
        amax = MaxBits(amax, AbsBits(t[k]));
      }
      const Fp4Scale scale = GradientGroupScale(a.nvfp4, amax, 1.0f);
      StoreGlobal(a.scales + row * groups + b, GradientScaleByte(a.nvfp4, scale));
      for (int k = 0; k < a.block; k += 2) {
        const int64_t j = b * a.block + k;
        const uint8_t even = GradientCode(t[k], scale, a.stochastic, BitsAt(a, key, row, j));
        const uint8_t odd = GradientCode(t[k + 1], scale, a.stochastic, BitsAt(a, key, row, j + 1));
        const int64_t flat = row * f + j;
        if (a.codes_packed) {
          StoreGlobal(a.codes + flat / 2, PackFp4(even, odd));
        } else {
          StoreGlobal(a.codes + flat, even);
          StoreGlobal(a.codes + flat + 1, odd);
        }
      }
    }
    __syncthreads();  // the scratch's last read before the next row's writes
  }
}

// Column j's group of block `rb` of rows, M-transformed where the call asks: its values in
// v and its scale.
__device__ __forceinline__ Fp4Scale ColumnGroup(const QuantizeGradientArgs& a, int64_t rb,
                                                int64_t j, float gs, float (&v)[kMaxBlock]) {
  for (int k = 0; k < a.block; ++k) v[k] = LoadGlobal(a.g + (rb * a.block + k) * a.cols + j);
  if (a.hadamard) HadamardOfBlock(v, 1, a.block, a.hadamard_mask);
  uint32_t amax = 0;
  for (int k = 0; k < a.block; ++k) amax = MaxBits(amax, AbsBits(v[k]));
  return GradientGroupScale(a.nvfp4, amax, gs);
}

// grid: one block; block: kGradientThreads.
__global__ void __launch_bounds__(kGradientThreads)
    GradientAmaxKernel(const QuantizeGradientArgs a) {
  AmaxScratch& s = StaticShared<AmaxScratch>();
  const int64_t units = a.rows / a.block * a.cols;
  uint32_t amax = 0;
  for (int64_t u = threadIdx.x; u < units; u += blockDim.x) {
    float v[kMaxBlock];
    ColumnGroup(a, u / a.cols, u % a.cols, 1.0f, v);
    for (int k = 0; k < a.block; ++k) amax = MaxBits(amax, AbsBits(v[k]));
  }
  const uint32_t total = BlockMax(s, amax);
  if (threadIdx.x == 0) StoreGlobal(a.global_scales, Nvfp4GlobalScale(total));
}

// Stores the codes of column j's group whose flat index has parity `odd` (all of them when
// unpacked and odd is false).
__device__ __forceinline__ void StoreColumnCodes(const QuantizeGradientArgs& a, KeyWords key,
                                                 int64_t rb, int64_t j, float gs, bool odd) {
  float v[kMaxBlock];
  const Fp4Scale scale = ColumnGroup(a, rb, j, gs, v);
  if (!odd) StoreGlobal(a.scales + rb * a.cols + j, GradientScaleByte(a.nvfp4, scale));
  for (int k = 0; k < a.block; ++k) {
    const int64_t row = rb * a.block + k;
    const int64_t flat = row * a.cols + j;
    if (a.codes_packed && (flat % 2 == 1) != odd) continue;
    const uint8_t code = GradientCode(v[k], scale, a.stochastic, BitsAt(a, key, row, j));
    if (!a.codes_packed) {
      StoreGlobal(a.codes + flat, code);
    } else if (!odd) {
      StoreGlobal(a.codes + flat / 2, code);
    } else {
      StoreGlobal(a.codes + flat / 2, uint8_t(LoadGlobal(a.codes + flat / 2) | (code << 4)));
    }
  }
}

// grid: any number of blocks (blocks of rows are strided over them); block:
// kGradientThreads.
__global__ void __launch_bounds__(kGradientThreads)
    GradientColumnsKernel(const QuantizeGradientArgs a) {
  const KeyWords key = KeyOf(a);
  const float gs = a.nvfp4 ? LoadGlobal(a.global_scales) : 1.0f;
  for (int64_t rb = blockIdx.x; rb < a.rows / a.block; rb += gridDim.x) {
    for (int64_t j = threadIdx.x; j < a.cols; j += blockDim.x) {
      StoreColumnCodes(a, key, rb, j, gs, false);
    }
    if (!a.codes_packed) continue;
    __syncthreads();  // every byte's even element stored before its odd one is OR-ed in
    for (int64_t j = threadIdx.x; j < a.cols; j += blockDim.x) {
      StoreColumnCodes(a, key, rb, j, gs, true);
    }
  }
}

}  // namespace

cudaError_t LoadQuantizeGradientKernels() {
  cudaFuncAttributes attributes{};
  cudaError_t err = LoadKernel(GradientRowsKernel, "gradient_rows", sizeof(AmaxScratch),
                               kGradientThreads, &attributes);
  if (err == cudaSuccess) {
    err = LoadKernel(GradientAmaxKernel, "gradient_amax", sizeof(AmaxScratch), kGradientThreads,
                     &attributes);
  }
  if (err == cudaSuccess) {
    err = LoadKernel(GradientColumnsKernel, "gradient_columns", 0, kGradientThreads, &attributes);
  }
  return err;
}

cudaError_t LaunchQuantizeGradient(cudaStream_t stream, const QuantizeGradientArgs& a) {
  // What the emulation knows of the kernels (their static shared memory): a launch needs
  // no preparation first, as the other families' launches.
  DeclareKernel(GradientRowsKernel, "gradient_rows", sizeof(AmaxScratch), kGradientThreads);
  DeclareKernel(GradientAmaxKernel, "gradient_amax", sizeof(AmaxScratch), kGradientThreads);
  DeclareKernel(GradientColumnsKernel, "gradient_columns", 0, kGradientThreads);
  if (a.columns && a.nvfp4) {
    // Also for no values, whose tensor scale is that of a zero amax.
    const cudaError_t err = LaunchKernel(GradientAmaxKernel, 1, kGradientThreads, 0, stream, a);
    if (err != cudaSuccess) return err;
  }
  if (!a.columns) {
    // Rows of no elements too: each gets the global scale of a zero amax.
    if (a.rows == 0) return cudaSuccess;
    return LaunchKernel(GradientRowsKernel, StridingGrid(a.rows), kGradientThreads, 0, stream, a);
  }
  if (a.rows == 0 || a.cols == 0) return cudaSuccess;
  return LaunchKernel(GradientColumnsKernel, StridingGrid(a.rows / a.block), kGradientThreads, 0,
                      stream, a);
}

}  // namespace fp8norm
