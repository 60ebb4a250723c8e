// The columnwise outputs of rms_norm_fp8 / add_rms_norm_fp8 (docs/spec.md, "Columnwise
// outputs"), a thread per column of a block of rows: the abs-max of the block's h of its
// column, then its codes (the second read hits the cache the first filled), stored
// contiguous in y_t, as 32-bit words where the block starts on one. A warp's lanes take 32
// consecutive columns, so each row's load is one coalesced access; the scale of a block
// needs no reduction across threads.
//   Two kernels: ColumnwiseKernel, after any rowwise kernel has saved each row's r; and
// BothLayoutsKernel, one launch for both layouts, whose block normalises a block of rows
// as warp_rows does and then makes their columns, re-reading x from the cache its rows'
// pass just filled instead of from memory (the launch plan says when).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "columnwise.h"
#include "kernel_families.h"
#include "kernel_launch.h"
#include "register_row.cuh"

namespace fp8norm {
namespace {

// 128 columns per block: four warps of coalesced row reads, and enough blocks for a grid
// that fills the device at 4096 columns by 32-row blocks of a few thousand rows.
constexpr int kColumnThreads = 128;

// h of element i of the call: x (+ residual), unrounded.
__device__ __forceinline__ float ColumnH(const RmsNormFp8Args& a, int64_t i) {
  float h = LoadElement(a.x, a.input_type, i);
  if (a.residual != nullptr) h += LoadElement(a.residual, a.residual_type, i);
  return h;
}

// A column's codes for one block, in order: collected into 32-bit words when the block's
// first byte starts one and its bytes fill whole words, else stored byte by byte. FP4
// codes are packed in pairs first when y_t is packed.
struct CodeWriter {
  uint8_t* out;
  bool words;
  bool packed;
  uint32_t word;
  int filled;  // bytes in `word`, or a pending low nibble (packed) in `pending`
  uint8_t pending;
  bool half;
  int64_t next;  // bytes written

  __device__ __forceinline__ void Byte(uint8_t b) {
    if (!words) {
      StoreGlobal(out + next, b);
      ++next;
      return;
    }
    word |= uint32_t{b} << (8 * filled);
    if (++filled == 4) {
      StoreGlobal(reinterpret_cast<uint32_t*>(out + next), word);
      next += 4;
      word = 0;
      filled = 0;
    }
  }

  __device__ __forceinline__ void Code(uint8_t code) {
    if (!packed) {
      Byte(code);
    } else if (!half) {
      pending = code;
      half = true;
    } else {
      Byte(PackFp4(pending, code));
      half = false;
    }
  }
};

__device__ __forceinline__ CodeWriter WriterFor(const RmsNormFp8Args& a, int64_t column,
                                                int64_t row0, int64_t rows) {
  const int64_t first = YByte(a, column * a.rows + row0);
  const int64_t bytes = YByte(a, rows);
  const bool words = first % 4 == 0 && bytes % 4 == 0;
  return CodeWriter{
      static_cast<uint8_t*>(a.columns.y_t) + first, words, a.y_packed, 0u, 0, 0, false, 0};
}

// Scale `index` of scales_t ([hidden, blocks] row-major).
__device__ __forceinline__ void StoreColumnScale(const RmsNormFp8Args& a, int64_t index,
                                                 float scale, int site = __builtin_LINE()) {
  StoreScaleAt(a.columns.scales_t, a.scale_type, index, scale, site);
}

// scales_t of a static scale for column `column`: the scale rounded to its dtype.
__device__ __forceinline__ void StoreStaticColumnScale(const RmsNormFp8Args& a, int64_t column) {
  StoreColumnScale(a, column, RoundTo(a.scale_type, LoadGlobal(a.static_scale)));
}

// ColumnOfBlock of a call whose columns are transformed (a.columns.hadamard: FP4 blocks of
// D rows): the block's n in registers, through the transform, then its scale and codes.
template <int D>
__device__ __forceinline__ void HadamardColumnOfBlock(const RmsNormFp8Args& a, int64_t block,
                                                      int64_t column, float g, float global_scale,
                                                      CodeWriter& writer) {
  const int64_t row0 = block * D;
  float t[D];
  bool finite = true;
#pragma unroll
  for (int i = 0; i < D; ++i) {
    const float r = LoadGlobal(a.inverse_rms + row0 + i);
    finite = finite && !IsNan(r);
    t[i] = Normalize(ColumnH(a, (row0 + i) * a.hidden + column), r, g);
  }
  const uint32_t amax = HadamardColumnBlock<D>(a, t, 1);
  const ColumnScale s = ColumnBlockScale(a, finite, amax, global_scale);
  StoreColumnScale(a, column * ColumnBlocks(a) + block, StoredScale(a, s));
#pragma unroll
  for (int i = 0; i < D; ++i) writer.Code(ColumnCode(a, s, t[i]));
}

// Column `column` of block `block` of the call's rows (ColumnBlockRows each), whose r
// are saved: the block's scale into scales_t (not with a static scale: see
// StoreStaticColumnScale), then its codes into y_t. global_scale: NVFP4's.
__device__ __forceinline__ void ColumnOfBlock(const RmsNormFp8Args& a, int64_t block,
                                              int64_t column, float global_scale) {
  const int64_t block_rows = ColumnBlockRows(a);
  const int64_t row0 = block * block_rows;
  const int64_t rows = block_rows < a.rows - row0 ? block_rows : a.rows - row0;
  const float g =
      GammaPlusOffset(LoadElement(a.gamma, a.gamma_type, column), a.constants.weight_offset);
  CodeWriter writer = WriterFor(a, column, row0, rows);
  if (a.static_scale != nullptr) {
    const float static_scale = LoadGlobal(a.static_scale);
    for (int64_t i = 0; i < rows; ++i) {
      const float r = LoadGlobal(a.inverse_rms + row0 + i);
      const ColumnScale s = StaticColumnScale(a, !IsNan(r), static_scale);
      writer.Code(ColumnCode(a, s, Normalize(ColumnH(a, (row0 + i) * a.hidden + column), r, g)));
    }
    return;
  }
  if (a.columns.hadamard) {
    if (block_rows == 16)
      return HadamardColumnOfBlock<16>(a, block, column, g, global_scale, writer);
    return HadamardColumnOfBlock<32>(a, block, column, g, global_scale, writer);
  }
  uint32_t amax = 0;
  bool finite = true;
  for (int64_t i = 0; i < rows; ++i) {
    const float r = LoadGlobal(a.inverse_rms + row0 + i);
    finite = finite && !IsNan(r);
    amax = max(amax, AbsBits(Normalize(ColumnH(a, (row0 + i) * a.hidden + column), r, g)));
  }
  const ColumnScale s = ColumnBlockScale(a, finite, amax, global_scale);
  StoreColumnScale(a, column * ColumnBlocks(a) + block, StoredScale(a, s));
  for (int64_t i = 0; i < rows; ++i) {
    const float r = LoadGlobal(a.inverse_rms + row0 + i);
    writer.Code(ColumnCode(a, s, Normalize(ColumnH(a, (row0 + i) * a.hidden + column), r, g)));
  }
}

// grid: any number of blocks, striding over (column tile, row block) pairs; block:
// kColumnThreads. With per-row global scales, each column's own (ColumnGlobalScalesKernel,
// launched before).
__global__ void __launch_bounds__(kColumnThreads) ColumnwiseKernel(const RmsNormFp8Args a) {
  const int64_t row_blocks = RowBlocksOf(a);
  const int64_t tiles = (a.hidden + kColumnThreads - 1) / kColumnThreads;
  const float global_scale =
      a.global_scale != nullptr ? ColumnGlobalScale(a.columns, LoadGlobal(a.global_scale)) : 0.0f;
  const float* column_gs = a.columns.global_scales_t;
  for (int64_t task = blockIdx.x; task < tiles * row_blocks; task += gridDim.x) {
    const int64_t column = (task % tiles) * kColumnThreads + threadIdx.x;
    const int64_t block = task / tiles;
    if (column < a.hidden) {
      ColumnOfBlock(a, block, column,
                    column_gs != nullptr ? LoadGlobal(column_gs + column) : global_scale);
    }
  }
}

// Each column's NVFP4 global scale (per-row global scales): PerRowGlobalScale of its
// abs-max over every row's n, NaN where a row is not finite (its saved r is NaN, and so is
// its n). A thread per column, the rows in order. grid: ceil(hidden / kColumnThreads);
// block: kColumnThreads.
__global__ void __launch_bounds__(kColumnThreads) ColumnGlobalScalesKernel(const RmsNormFp8Args a) {
  const int64_t column = int64_t{blockIdx.x} * kColumnThreads + threadIdx.x;
  if (column >= a.hidden) return;
  const float g =
      GammaPlusOffset(LoadElement(a.gamma, a.gamma_type, column), a.constants.weight_offset);
  uint32_t amax = 0;
  for (int64_t row = 0; row < a.rows; ++row) {
    const float r = LoadGlobal(a.inverse_rms + row);
    amax = max(amax, AbsBits(Normalize(ColumnH(a, row * a.hidden + column), r, g)));
  }
  StoreGlobal(a.columns.global_scales_t + column,
              ColumnGlobalScale(a.columns, PerRowGlobalScale(0.0f, amax)));
}

// Both layouts in one launch. grid: any number of blocks, striding over the call's blocks
// of rows (ColumnBlockRows each); block: kWarpRowsBlockThreads threads, `threads_per_row`
// per row, as warp_rows (whose plan it takes).
template <typename TIn, int kVecs>
__global__ void __launch_bounds__(kWarpRowsBlockThreads, 2)
    BothLayoutsKernel(const RmsNormFp8Args a, const int threads_per_row) {
  RegisterScratch& scratch = StaticShared<RegisterScratch>();
  const int rows_per_block = static_cast<int>(blockDim.x) / threads_per_row;
  const int block_row = static_cast<int>(threadIdx.x) / threads_per_row;
  const int lane = static_cast<int>(threadIdx.x) % threads_per_row;
  const int64_t block_rows = ColumnBlockRows(a);
  const int64_t row_blocks = RowBlocksOf(a);
  const float global_scale = ColumnGlobalScale(a.columns, GlobalScaleOf(a));
  for (int64_t block = blockIdx.x; block < row_blocks; block += gridDim.x) {
    const int64_t row0 = block * block_rows;
    const int64_t row_end = block_rows < a.rows - row0 ? row0 + block_rows : a.rows;
    // The same trip count for every thread of the block (the rows' reductions may meet at
    // barriers); rows at or past row_end belong to the next block and are skipped.
    for (int64_t first = row0; first < row_end; first += rows_per_block) {
      RegisterRow<TIn, kVecs>(a, first + block_row, row_end, lane, threads_per_row, scratch);
    }
    // Every r of the block, stored by its row's first thread, visible to every column's
    // thread; and every read of the reductions' slots done before the next block's rows
    // write them.
    __syncthreads();
    for (int64_t column = threadIdx.x; column < a.hidden; column += blockDim.x) {
      if (block == 0 && a.static_scale != nullptr) StoreStaticColumnScale(a, column);
      ColumnOfBlock(a, block, column, global_scale);
    }
  }
}

// scales_t of a static scale: the scale rounded to its dtype, once per column (also for a
// call of no rows). grid: ceil(hidden / kColumnThreads); block: kColumnThreads.
__global__ void __launch_bounds__(kColumnThreads) StaticColumnScalesKernel(const RmsNormFp8Args a) {
  const int64_t column = int64_t{blockIdx.x} * kColumnThreads + threadIdx.x;
  if (column < a.hidden) StoreStaticColumnScale(a, column);
}

// BothLayoutsKernel for the register arrays of `vectors` vectors (the plan's).
template <typename TIn>
auto BothLayoutsKernelFor(int vectors) {
  return vectors == 1   ? BothLayoutsKernel<TIn, 1>
         : vectors == 2 ? BothLayoutsKernel<TIn, 2>
                        : BothLayoutsKernel<TIn, 4>;
}

}  // namespace

cudaError_t LoadColumnwiseKernel() {
  cudaFuncAttributes attributes{};
  cudaError_t err = LoadKernel(ColumnwiseKernel, "columnwise", 0, kColumnThreads, &attributes);
  if (err == cudaSuccess) {
    err = LoadKernel(StaticColumnScalesKernel, "static_column_scales", 0, kColumnThreads,
                     &attributes);
  }
  if (err == cudaSuccess) {
    err = LoadKernel(ColumnGlobalScalesKernel, "column_global_scales", 0, kColumnThreads,
                     &attributes);
  }
  for (const FloatType input : {FloatType::kF32, FloatType::kF16, FloatType::kBF16}) {
    for (const int vectors : {1, 2, 4}) {
      if (err != cudaSuccess) return err;
      err = WithInputType(input, [&](auto type) {
        return LoadKernel(BothLayoutsKernelFor<typename decltype(type)::Type>(vectors),
                          "both_layouts", sizeof(RegisterScratch), kWarpRowsBlockThreads,
                          &attributes);
      });
    }
  }
  return err;
}

cudaError_t LaunchBothLayoutsKernel(cudaStream_t stream, const RmsNormFp8Args& a,
                                    const LaunchPlan& p) {
  const int64_t row_blocks = RowBlocksOf(a);
  // A block of rows per block: p.blocks bounds the grid as it does warp_rows'.
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(row_blocks, p.blocks));
  return WithInputType(a.input_type, [&](auto type) {
    const auto kernel = BothLayoutsKernelFor<typename decltype(type)::Type>(p.vectors_per_thread);
    DeclareKernel(kernel, "both_layouts", sizeof(RegisterScratch), kWarpRowsBlockThreads);
    return LaunchKernel(kernel, blocks, p.threads, 0, stream, a, p.threads_per_row);
  });
}

cudaError_t LaunchColumnwise(cudaStream_t stream, const RmsNormFp8Args& a) {
  if (a.hidden == 0) return cudaSuccess;
  DeclareKernel(ColumnwiseKernel, "columnwise", 0, kColumnThreads);
  DeclareKernel(StaticColumnScalesKernel, "static_column_scales", 0, kColumnThreads);
  const int64_t tiles = (a.hidden + kColumnThreads - 1) / kColumnThreads;
  if (a.static_scale != nullptr) {
    const cudaError_t err = LaunchKernel(StaticColumnScalesKernel, static_cast<unsigned>(tiles),
                                         kColumnThreads, 0, stream, a);
    if (err != cudaSuccess || a.rows == 0) return err;
  }
  if (a.columns.global_scales_t != nullptr) {
    // Also for no rows: each column's is then the floor.
    DeclareKernel(ColumnGlobalScalesKernel, "column_global_scales", 0, kColumnThreads);
    const cudaError_t err = LaunchKernel(ColumnGlobalScalesKernel, static_cast<unsigned>(tiles),
                                         kColumnThreads, 0, stream, a);
    if (err != cudaSuccess) return err;
  }
  if (a.rows == 0) return cudaSuccess;
  return LaunchKernel(ColumnwiseKernel, StridingGrid(tiles * RowBlocksOf(a)), kColumnThreads, 0,
                      stream, a);
}

}  // namespace fp8norm
