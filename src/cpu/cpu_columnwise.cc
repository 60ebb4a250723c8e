// CPU kernel of the columnwise pass (docs/spec.md, "Columnwise outputs"). A task is one
// block of rows (the recipe's block; kStaticRows rows for a static scale) by up to
// kTileColumns columns: it loads the block's rows of those columns once, row by row
// (contiguous reads), normalises them into a float32 tile while taking each column's
// abs-max, then writes each column's codes, contiguous in y_t, from the tile. Every
// element's n is Normalize(h, r, gamma + weight_offset) with the r the training form
// saved, so it is the rowwise output's n bit for bit.
//
// Built with -ffp-contract=off, as the row kernel.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <new>
#include <type_traits>
#include <vector>

#include "columnwise.h"
#include "fp8norm_math.h"
#include "rms_norm_fp8.h"

namespace fp8norm {
namespace {

// Columns per task: the tile of n is kTileColumns floats per row, 32 KiB for a block of
// 32 rows and 128 KiB for 128 (in L2), and each column's codes go out contiguously.
constexpr int64_t kTileColumns = 256;
// Rows per task with a static scale, which has no block of its own.
constexpr int64_t kStaticRows = 32;

// This thread's tile, kept between calls (grown, never shrunk); null when the memory
// cannot be had.
float* TileBuffer(int64_t size) {
  thread_local std::vector<float> tile;
  if (static_cast<int64_t>(tile.size()) < size) {
    try {
      tile.resize(size);
    } catch (const std::bad_alloc&) {
      return nullptr;
    }
  }
  return tile.data();
}

// Nothing to add for rms_norm_fp8.
struct NoResidual {};

template <typename TRes>
float PlusResidual(float x, const void* residual, int64_t i) {
  if constexpr (std::is_same_v<TRes, NoResidual>) {
    return x;
  } else {
    return x + ToFloat(static_cast<const TRes*>(residual)[i]);
  }
}

// n of rows [row0, row0 + rows) x columns [col0, col0 + columns) into tile (row-major,
// `columns` wide), and each column's abs-max (ordered bits) into amax. Returns whether
// every row is finite.
template <typename TIn, typename TRes>
bool NormalizeTile(const ColumnwiseArgs& a, const float* gamma_plus_offset, int64_t row0,
                   int64_t rows, int64_t col0, int64_t columns, float* tile, uint32_t* amax) {
  const TIn* x = static_cast<const TIn*>(a.x);
  bool finite = true;
  std::fill(amax, amax + columns, 0u);
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t row = row0 + i;
    const float r = a.inverse_rms[row];
    finite = finite && !IsNan(r);
    const int64_t offset = row * a.hidden + col0;
    float* t = tile + i * columns;
    for (int64_t j = 0; j < columns; ++j) {
      const float h = PlusResidual<TRes>(ToFloat(x[offset + j]), a.residual, offset + j);
      const float n = Normalize(h, r, gamma_plus_offset[col0 + j]);
      t[j] = n;
      amax[j] = std::max(amax[j], AbsBits(n));
    }
  }
  return finite;
}

// The codes of column col0 + j's rows [row0, row0 + rows) of the tile under scale s (or,
// static, each row's own), contiguous in y_t.
void StoreColumn(const ColumnwiseArgs& a, const ColumnScale* row_scales, const ColumnScale& s,
                 const float* tile, int64_t columns, int64_t j, int64_t col, int64_t row0,
                 int64_t rows) {
  uint8_t* out = static_cast<uint8_t*>(a.y) + YByte(a, col * a.rows + row0);
  if (a.y_packed) {
    for (int64_t i = 0; i < rows; i += 2) {
      out[i / 2] = PackFp4(ColumnCode(a, s, tile[i * columns + j]),
                           ColumnCode(a, s, tile[(i + 1) * columns + j]));
    }
    return;
  }
  for (int64_t i = 0; i < rows; ++i) {
    out[i] = ColumnCode(a, row_scales != nullptr ? row_scales[i] : s, tile[i * columns + j]);
  }
}

template <typename TIn, typename TRes>
void ColumnTask(const ColumnwiseArgs& a, const float* gamma_plus_offset, int64_t task,
                float* tile) {
  const bool is_static = a.static_scale != nullptr;
  const int64_t block_rows = is_static ? kStaticRows : a.group_size;
  const int64_t tiles_per_row_block = (a.hidden + kTileColumns - 1) / kTileColumns;
  const int64_t block = task / tiles_per_row_block;
  const int64_t col0 = (task % tiles_per_row_block) * kTileColumns;
  const int64_t columns = std::min(kTileColumns, a.hidden - col0);
  const int64_t row0 = block * block_rows;
  const int64_t rows = std::min(block_rows, a.rows - row0);
  uint32_t amax[kTileColumns];
  const bool finite =
      NormalizeTile<TIn, TRes>(a, gamma_plus_offset, row0, rows, col0, columns, tile, amax);
  if (is_static) {
    ColumnScale row_scales[kStaticRows];
    for (int64_t i = 0; i < rows; ++i) {
      row_scales[i] = StaticColumnScale(a, !IsNan(a.inverse_rms[row0 + i]), *a.static_scale);
    }
    for (int64_t j = 0; j < columns; ++j) {
      StoreColumn(a, row_scales, row_scales[0], tile, columns, j, col0 + j, row0, rows);
    }
    return;
  }
  const float global_scale = a.global_scale != nullptr ? *a.global_scale : 0.0f;
  const int64_t blocks = ColumnBlocks(a);
  for (int64_t j = 0; j < columns; ++j) {
    const ColumnScale s = ColumnBlockScale(a, finite, amax[j], global_scale);
    StoreAs(a.scale_type, a.scales, (col0 + j) * blocks + block, StoredScale(a, s));
    StoreColumn(a, nullptr, s, tile, columns, j, col0 + j, row0, rows);
  }
}

using ColumnTaskFn = void (*)(const ColumnwiseArgs&, const float*, int64_t, float*);

template <typename TIn>
ColumnTaskFn TaskFor(const ColumnwiseArgs& a) {
  if (a.residual == nullptr) return ColumnTask<TIn, NoResidual>;
  switch (a.residual_type) {
    case FloatType::kF16:
      return ColumnTask<TIn, F16>;
    case FloatType::kBF16:
      return ColumnTask<TIn, BF16>;
    default:
      return ColumnTask<TIn, float>;
  }
}

ColumnTaskFn TaskFor(const ColumnwiseArgs& a) {
  switch (a.input_type) {
    case FloatType::kF16:
      return TaskFor<F16>(a);
    case FloatType::kBF16:
      return TaskFor<BF16>(a);
    default:
      return TaskFor<float>(a);
  }
}

}  // namespace

bool ColumnwiseCpu(const ColumnwiseArgs& a, const ParallelFor& parallel_for) {
  if (a.static_scale != nullptr) {
    // One scale, the same for every column, also where there are no rows.
    const float scale = RoundTo(a.scale_type, *a.static_scale);
    for (int64_t col = 0; col < a.hidden; ++col) StoreAs(a.scale_type, a.scales, col, scale);
  }
  if (a.rows == 0 || a.hidden == 0) return true;
  std::vector<float> gamma_plus_offset;
  try {
    gamma_plus_offset.resize(a.hidden);
  } catch (const std::bad_alloc&) {
    return false;
  }
  FillGammaPlusOffset(a.gamma_type, a.gamma, a.constants.weight_offset, a.hidden,
                      gamma_plus_offset.data());
  const size_t elements = static_cast<size_t>(a.rows) * static_cast<size_t>(a.hidden);
  AdviseHugePages(a.y, static_cast<size_t>(YByte(a, static_cast<int64_t>(elements))));
  const int64_t block_rows = a.static_scale != nullptr ? kStaticRows : a.group_size;
  const int64_t row_blocks = (a.rows + block_rows - 1) / block_rows;
  const int64_t num_tasks = row_blocks * ((a.hidden + kTileColumns - 1) / kTileColumns);
  const ColumnTaskFn task_fn = TaskFor(a);
  const float* gw = gamma_plus_offset.data();
  std::atomic<bool> out_of_memory{false};
  parallel_for(num_tasks, [&](int64_t task) {
    float* tile = TileBuffer(block_rows * kTileColumns);
    if (tile == nullptr) {
      out_of_memory.store(true, std::memory_order_relaxed);
      return;
    }
    task_fn(a, gw, task, tile);
  });
  return !out_of_memory.load();
}

}  // namespace fp8norm
