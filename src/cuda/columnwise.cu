// The columnwise outputs of rms_norm_fp8 / add_rms_norm_fp8 (docs/spec.md, "Columnwise
// outputs"), after the training form has written each row's r: a thread per column of a
// block of rows. It reads the block's h of its column twice (the abs-max, then the codes;
// the second read hits the cache the first filled), and writes the column's codes for the
// block, contiguous in y_t, as 32-bit words where the block starts on one.
//   A warp's lanes take 32 consecutive columns, so each row's load is one coalesced access;
//   the scale of a block needs no reduction across threads, and no barrier is needed.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "columnwise.h"
#include "cuda_kernels.h"
#include "kernel_families.h"
#include "kernel_launch.h"
#include "row_blocks.cuh"

namespace fp8norm {
namespace {

// 128 columns per block: four warps of coalesced row reads, and enough blocks for a grid
// that fills the device at 4096 columns by 32-row blocks of a few thousand rows.
constexpr int kColumnThreads = 128;
// Rows per block with a static scale, which has no block of its own.
constexpr int64_t kStaticRows = 32;

// h of element i of the call: x (+ residual), unrounded.
__device__ __forceinline__ float ColumnH(const ColumnwiseArgs& a, int64_t i) {
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

__device__ __forceinline__ CodeWriter WriterFor(const ColumnwiseArgs& a, int64_t column,
                                                int64_t row0, int64_t rows) {
  const int64_t first = YByte(a, column * a.rows + row0);
  const int64_t bytes = YByte(a, rows);
  const bool words = first % 4 == 0 && bytes % 4 == 0;
  return CodeWriter{static_cast<uint8_t*>(a.y) + first, words, a.y_packed, 0u, 0, 0, false, 0};
}

// grid: any number of blocks, striding over (column tile, row block) pairs; block:
// kColumnThreads.
__global__ void __launch_bounds__(kColumnThreads) ColumnwiseKernel(const ColumnwiseArgs a) {
  const bool is_static = a.static_scale != nullptr;
  const int64_t block_rows = is_static ? kStaticRows : a.group_size;
  const int64_t row_blocks = (a.rows + block_rows - 1) / block_rows;
  const int64_t tiles = (a.hidden + kColumnThreads - 1) / kColumnThreads;
  const float global_scale = a.global_scale != nullptr ? LoadGlobal(a.global_scale) : 0.0f;
  for (int64_t task = blockIdx.x; task < tiles * row_blocks; task += gridDim.x) {
    const int64_t column = (task % tiles) * kColumnThreads + threadIdx.x;
    const int64_t block = task / tiles;
    if (column >= a.hidden) continue;
    const int64_t row0 = block * block_rows;
    const int64_t rows = block_rows < a.rows - row0 ? block_rows : a.rows - row0;
    const float g =
        GammaPlusOffset(LoadElement(a.gamma, a.gamma_type, column), a.constants.weight_offset);
    CodeWriter writer = WriterFor(a, column, row0, rows);
    if (is_static) {
      const float static_scale = LoadGlobal(a.static_scale);
      for (int64_t i = 0; i < rows; ++i) {
        const float r = LoadGlobal(a.inverse_rms + row0 + i);
        const ColumnScale s = StaticColumnScale(a, !IsNan(r), static_scale);
        writer.Code(ColumnCode(a, s, Normalize(ColumnH(a, (row0 + i) * a.hidden + column), r, g)));
      }
      continue;
    }
    uint32_t amax = 0;
    bool finite = true;
    for (int64_t i = 0; i < rows; ++i) {
      const float r = LoadGlobal(a.inverse_rms + row0 + i);
      finite = finite && !IsNan(r);
      amax = max(amax, AbsBits(Normalize(ColumnH(a, (row0 + i) * a.hidden + column), r, g)));
    }
    const ColumnScale s = ColumnBlockScale(a, finite, amax, global_scale);
    StoreScale(a, column * ColumnBlocks(a) + block, StoredScale(a, s));
    for (int64_t i = 0; i < rows; ++i) {
      const float r = LoadGlobal(a.inverse_rms + row0 + i);
      writer.Code(ColumnCode(a, s, Normalize(ColumnH(a, (row0 + i) * a.hidden + column), r, g)));
    }
  }
}

// scales_t of a static scale: the scale rounded to its dtype, once per column (also for a
// call of no rows). grid: ceil(hidden / kColumnThreads); block: kColumnThreads.
__global__ void __launch_bounds__(kColumnThreads) StaticColumnScalesKernel(const ColumnwiseArgs a) {
  const int64_t column = int64_t{blockIdx.x} * kColumnThreads + threadIdx.x;
  if (column < a.hidden) {
    StoreScale(a, column, RoundTo(a.scale_type, LoadGlobal(a.static_scale)));
  }
}

}  // namespace

cudaError_t LoadColumnwiseKernel() {
  cudaFuncAttributes attributes{};
  cudaError_t err = LoadKernel(ColumnwiseKernel, "columnwise", 0, kColumnThreads, &attributes);
  if (err == cudaSuccess) {
    err = LoadKernel(StaticColumnScalesKernel, "static_column_scales", 0, kColumnThreads,
                     &attributes);
  }
  return err;
}

cudaError_t LaunchColumnwise(cudaStream_t stream, const ColumnwiseArgs& a) {
  if (a.hidden == 0) return cudaSuccess;
  DeclareKernel(ColumnwiseKernel, "columnwise", 0, kColumnThreads);
  DeclareKernel(StaticColumnScalesKernel, "static_column_scales", 0, kColumnThreads);
  const int64_t tiles = (a.hidden + kColumnThreads - 1) / kColumnThreads;
  if (a.static_scale != nullptr) {
    const cudaError_t err = LaunchKernel(StaticColumnScalesKernel, static_cast<unsigned>(tiles),
                                         kColumnThreads, 0, stream, a);
    if (err != cudaSuccess || a.rows == 0) return err;
  }
  if (a.rows == 0) return cudaSuccess;
  const int64_t block_rows = a.static_scale != nullptr ? kStaticRows : a.group_size;
  const int64_t tasks = tiles * ((a.rows + block_rows - 1) / block_rows);
  // At most 65535 blocks, striding over the rest (a grid that large fills every
  // multiprocessor many times over).
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(tasks, 65535));
  return LaunchKernel(ColumnwiseKernel, blocks, kColumnThreads, 0, stream, a);
}

}  // namespace fp8norm
