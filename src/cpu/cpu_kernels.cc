// CPU kernel of rms_norm_fp8 and add_rms_norm_fp8 (docs/spec.md): each row is loaded once
// into a float32 scratch row that stays in cache, normalised in place and quantised from
// there (the row loops are in cpu_rows.inc). Rows are split into tasks that the caller's
// thread pool runs in parallel.
//
// Built with -ffp-contract=off: a multiply-add contracted by the compiler would round
// differently from the CUDA kernel and the reference. The only FMA is the explicit one
// of the exact square, whose result is exact either way.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <type_traits>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "columnwise.h"
#include "cpu_config.h"
#include "fp8norm_math.h"
#include "rms_norm_fp8.h"

#if defined(FP8NORM_CPU_HAS_AVX2_VARIANT)
#include "cpu_avx2.h"
#endif

namespace fp8norm {
namespace {

// The buffers of each thread (ThreadBuffer).
enum class Buffer {
  kScratchRow,
  kGammaRow,
  kStagedScales,
  // ColumnScratch's.
  kTile,
  kCodes,
  kAmax,
  kRecips,
  kScales,
  kFp4,
  kColumnExponents,
  kRowRecips,
};

// The staged column scales of a call (RmsNormFp8Cpu): in the calling thread's buffer,
// kept between calls, up to kKeptStagedScalesBytes; a larger call's in memory of its own,
// freed when the call ends (they are as large as scales_t: kept at the largest call's,
// they would hold that much for the life of the thread). data() is null when the memory
// cannot be had, and for no bytes (a call without them touches no buffer).
constexpr int64_t kKeptStagedScalesBytes = int64_t{16} << 20;

class StagedColumnScales {
 public:
  explicit StagedColumnScales(int64_t bytes) {
    if (bytes == 0) return;
    if (bytes <= kKeptStagedScalesBytes) {
      data_ = ThreadBuffer<Buffer::kStagedScales, uint8_t>(bytes);
      return;
    }
    owned_.reset(new (std::nothrow) uint8_t[static_cast<size_t>(bytes)]);
    data_ = owned_.get();
  }
  uint8_t* data() const { return data_; }

 private:
  std::unique_ptr<uint8_t[]> owned_;
  uint8_t* data_ = nullptr;
};

template <typename TGamma>
void FillGammaPlusOffsetOf(const void* gamma, float weight_offset, int64_t n, float* out) {
  const TGamma* g = static_cast<const TGamma*>(gamma);
  for (int64_t j = 0; j < n; ++j) out[j] = GammaPlusOffset(ToFloat(g[j]), weight_offset);
}

// Bytes between the rows of a span's codes: an odd number of cache lines, so that a
// transpose's 16 rows fall in 16 different sets of L1 (rows of 4096 codes 4096 bytes apart
// would all share one set, 8 ways deep, and evict each other).
constexpr int64_t ColumnCodesStride(int64_t hidden) { return ((hidden + 63) / 64 | 1) * 64; }

// A thread's scratch for the columnwise outputs of one block of rows, kept between calls
// (grown, never shrunk): the block's n (rows x hidden floats, the rows normalised in
// place there), a span's codes (rows of hidden bytes, ColumnCodesStride apart), per
// column its abs-max (ordered bits), multiplier, its exponent field and (FP4) scale, and,
// where the columns' codes are moved from the rows' (MovesRowCodes), each row group's
// multiplier (rows x groups).
struct ColumnScratch {
  // Each row's n, row-major, for the columns' pass; null where the codes are moved from
  // the rows' (MovesRowCodes), which recomputes the few n it needs (ColumnNormalized).
  float* tile;
  uint8_t* codes;  // a span's codes, rows codes_stride bytes apart
  uint32_t* amax;
  float* recips;
  float* scales;
  Fp4Scale* fp4;
  uint8_t* column_exponents;
  float* row_recips;  // null unless MovesRowCodes
  // The call's scales_t transposed, [blocks][hidden] in the scale type, rows
  // staged_stride bytes apart, shared by every task (each writes its blocks' rows):
  // WriteColumnScales moves it into scales_t.
  uint8_t* staged_scales;
  int64_t staged_stride;
  const float* gamma_plus_offset;  // the call's, for ColumnNormalized
  int64_t codes_stride;
};

// Rows whose columnwise codes go to y_t together: a column's 128 bytes (FP8) are two
// whole cache lines of y_t, written whole without being read first, and one page's TLB entry
// serves 128 rows' codes instead of a block's (docs/performance.md, "Columnwise").
constexpr int64_t kColumnSpanRows = 128;

// Null `codes` when the memory cannot be had. No tile where the codes are moved
// (row_groups > 0: the rows' group multipliers are kept instead).
ColumnScratch ThreadColumnScratch(int64_t rows, int64_t span_rows, int64_t hidden,
                                  int64_t row_groups) {
  bool had = true;  // every buffer of a size above 0
  const auto buffer = [&](auto* data, int64_t size) {
    had = had && (data != nullptr || size == 0);
    return data;
  };
  // The last row's group scratch (2 floats per group, at most 2 x hidden) after the tile.
  const int64_t tile_floats = row_groups > 0 ? 0 : (rows + 2) * hidden;
  const int64_t codes_bytes = span_rows * ColumnCodesStride(hidden);
  ColumnScratch s{buffer(ThreadBuffer<Buffer::kTile>(tile_floats), tile_floats),
                  buffer(ThreadBuffer<Buffer::kCodes, uint8_t>(codes_bytes), codes_bytes),
                  buffer(ThreadBuffer<Buffer::kAmax, uint32_t>(hidden), hidden),
                  buffer(ThreadBuffer<Buffer::kRecips>(hidden), hidden),
                  buffer(ThreadBuffer<Buffer::kScales>(hidden), hidden),
                  buffer(ThreadBuffer<Buffer::kFp4, Fp4Scale>(hidden), hidden),
                  buffer(ThreadBuffer<Buffer::kColumnExponents, uint8_t>(hidden), hidden),
                  buffer(ThreadBuffer<Buffer::kRowRecips>(rows * row_groups), rows * row_groups),
                  nullptr,
                  0,
                  nullptr,
                  ColumnCodesStride(hidden)};
  if (!had) return ColumnScratch{};
  // A size of 0 may still find an earlier call's buffer: the tile and the rows'
  // multipliers are there only where this call has them.
  if (row_groups > 0) {
    s.tile = nullptr;
  } else {
    s.row_recips = nullptr;
  }
  return s;
}

// Whether a block's columnwise FP8 codes can be moved from its rowwise codes (AVX2
// variant, MovedFp8Codes32): power-of-two multipliers on both sides with no bound on the
// scale (so that neither side saturates), groups of a size the row loop keeps each
// group's multiplier for (QuantizeGroups' compile-time sizes, several per row), and column
// blocks of the rows' group size (the column pass finds the rows' multipliers by it).
bool MovesRowCodes(const RmsNormFp8Args& a) {
  const int64_t groups = GroupsPerRow(a);
  const int64_t group = groups > 0 ? a.hidden / groups : 0;
  return a.out_format != OutFormat::kE2M1 && a.static_scale == nullptr &&
         a.constants.power_of_two && !(a.constants.scale_ub < FloatOf(kF32Inf)) && groups > 1 &&
         (group == 32 || group == 64 || group == 128) && a.columns.block_rows == a.group_size;
}

// Element j of a float array of type `type`.
inline float ElementAt(const void* p, FloatType type, int64_t j) {
  switch (type) {
    case FloatType::kF16:
      return ToFloat(static_cast<const F16*>(p)[j]);
    case FloatType::kBF16:
      return ToFloat(static_cast<const BF16*>(p)[j]);
    default:
      return static_cast<const float*>(p)[j];
  }
}

// n of element j of row `row` of a finite row, whose saved r is its r: the row loop's
// Normalize of the same h, so the same bits (for the columns' pass that keeps no tile).
inline float ColumnNormalized(const RmsNormFp8Args& c, const float* gamma_plus_offset, int64_t row,
                              int64_t j) {
  const int64_t i = row * c.hidden + j;
  float h = ElementAt(c.x, c.input_type, i);
  if (c.residual != nullptr) h += ElementAt(c.residual, c.residual_type, i);
  return Normalize(h, c.inverse_rms[row], gamma_plus_offset[j]);
}

// Each column's NVFP4 global scale into a.columns.global_scales_t (per-row global scales):
// PerRowGlobalScale of its abs-max over every row's n, from x and each row's saved r (NaN
// for a row that is not finite, which makes every column's NaN). In strips of columns, a
// task each, each strip's rows read in order.
void ColumnGlobalScales(const RmsNormFp8Args& a, const float* gamma_plus_offset,
                        const ParallelFor& parallel_for) {
  constexpr int64_t kStrip = 64;
  parallel_for((a.hidden + kStrip - 1) / kStrip, [&](int64_t task) {
    const int64_t j0 = task * kStrip;
    const int64_t j1 = std::min(a.hidden, j0 + kStrip);
    uint32_t amax[kStrip] = {};
    for (int64_t row = 0; row < a.rows; ++row) {
      for (int64_t j = j0; j < j1; ++j) {
        amax[j - j0] =
            std::max(amax[j - j0], AbsBits(ColumnNormalized(a, gamma_plus_offset, row, j)));
      }
    }
    for (int64_t j = j0; j < j1; ++j)
      a.columns.global_scales_t[j] =
          ColumnGlobalScale(a.columns, PerRowGlobalScale(0.0f, amax[j - j0]));
  });
}

// The loops of the rows and of the columnwise outputs, compiled once per instruction set
// (cpu_isa_variants.inc); the AVX2 variant runs on the explicit vectors of cpu_avx2.h: 8
// lanes per instruction, the exact square in one FMA instead of Dekker's seven operations,
// FP8 bytes stored 32 at a time.
#define FP8NORM_CPU_LOOPS "cpu_rows.inc"
#include "cpu_isa_variants.inc"
#define FP8NORM_CPU_LOOPS "cpu_columns.inc"
#include "cpu_isa_variants.inc"

// Outputs of at least this many bytes are advised onto huge pages.
constexpr size_t kHugePageAdviceBytes = size_t{4} << 20;

}  // namespace

// Asks the kernel to back the whole 2 MiB pages inside [p, p + bytes) with transparent
// huge pages (Linux; where THP is "madvise", the common default). A large output of XLA's
// is often freshly mapped memory (glibc maps large allocations and unmaps them when
// freed), and writing it page by page costs one fault per 4 KiB, which can cost more than
// the kernel's own work (docs/performance.md, "Figures behind choices in the source").
// Only whole 2 MiB pages inside the output are advised, so no memory outside it is
// affected; pages already present stay until the kernel's khugepaged may merge them.
// Advice only: a refusal changes nothing. FP8NORM_CPU_HUGE_PAGES=0 turns it off.
void AdviseHugePages(void* p, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  static const bool enabled = [] {
    const char* text = std::getenv("FP8NORM_CPU_HUGE_PAGES");
    return text == nullptr || std::strcmp(text, "0") != 0;
  }();
  if (!enabled || p == nullptr || bytes < kHugePageAdviceBytes) return;
  constexpr uintptr_t kHugePage = uintptr_t{2} << 20;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(kHugePage - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)p;
  (void)bytes;
#endif
}

void FillGammaPlusOffset(FloatType type, const void* gamma, float weight_offset, int64_t n,
                         float* out) {
  switch (type) {
    case FloatType::kF16:
      FillGammaPlusOffsetOf<F16>(gamma, weight_offset, n, out);
      break;
    case FloatType::kBF16:
      FillGammaPlusOffsetOf<BF16>(gamma, weight_offset, n, out);
      break;
    default:
      FillGammaPlusOffsetOf<float>(gamma, weight_offset, n, out);
  }
}

bool CpuUsesAvx2() {
#if defined(FP8NORM_CPU_HAS_AVX2_VARIANT)
  static const bool uses_avx2 = [] {
    const char* forced = std::getenv("FP8NORM_CPU_ISA");
    if (forced != nullptr && std::strcmp(forced, "baseline") == 0) return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  }();
  return uses_avx2;
#else
  return false;
#endif
}

bool RmsNormFp8Cpu(const RmsNormFp8Args& a, const ParallelFor& parallel_for) {
  if (a.columns.y_t != nullptr && a.static_scale != nullptr) {
    // The columnwise scales of a static scale: the one scale, for every column, also where
    // there are no rows.
    const float scale = RoundTo(a.scale_type, *a.static_scale);
    for (int64_t j = 0; j < a.hidden; ++j) StoreAs(a.scale_type, a.columns.scales_t, j, scale);
  }
  if (a.columns.global_scales_t != nullptr && a.rows == 0) {
    // No rows: each column's abs-max is 0, its global scale the floor.
    std::fill(a.columns.global_scales_t, a.columns.global_scales_t + a.hidden,
              ColumnGlobalScale(a.columns, PerRowGlobalScale(0.0f, 0u)));
  }
  if (a.rows == 0) return true;
  if (a.hidden == 0) {
    // Empty rows: no groups, or the scale of a row of zeros.
    if (a.inverse_rms != nullptr) {
      const float r = InverseRms(0.0f, 0, a.constants.eps);
      for (int64_t row = 0; row < a.rows; ++row) a.inverse_rms[row] = r;
    }
    // The abs-max of no elements.
    if (a.amax != nullptr) std::fill(a.amax, a.amax + a.rows, 0.0f);
    if (PerRowGlobalScales(a)) {
      std::fill(a.global_scales, a.global_scales + a.rows, PerRowGlobalScale(0.0f, 0u));
    }
    if (!PerRowScale(a)) return true;
    const RowScale s = a.static_scale != nullptr
                           ? StaticScale(0.0f, *a.static_scale, a.scale_type)
                           : ComputeScale(0.0f, 0, a.out_format, a.scale_type, a.constants);
    for (int64_t row = 0; row < a.rows; ++row) StoreAs(a.scale_type, a.scales, row, s.scale);
    return true;
  }
  // gamma + weight_offset once per call, in float32, shared by every row: in the calling
  // thread's buffer, which the tasks only read, and only while this call waits for them.
  float* const gamma_plus_offset = ThreadBuffer<Buffer::kGammaRow>(a.hidden);
  if (gamma_plus_offset == nullptr) return false;
  FillGammaPlusOffset(a.gamma_type, a.gamma, a.constants.weight_offset, a.hidden,
                      gamma_plus_offset);
  const size_t elements = static_cast<size_t>(a.rows) * static_cast<size_t>(a.hidden);
  AdviseHugePages(a.y, static_cast<size_t>(YByte(a, static_cast<int64_t>(elements))));
  if (a.residual_out != nullptr) {
    AdviseHugePages(a.residual_out, elements * FloatTypeBytes(a.residual_type));
  }
  const int64_t task_elements =
      std::clamp(a.rows * a.hidden / kTasksPerCall, kMinElementsPerTask, kMaxElementsPerTask);
  int64_t rows_per_task = std::max<int64_t>(1, task_elements / a.hidden);
  // With the columnwise outputs a task takes whole spans of blocks of rows: each block's n
  // stays in the thread's tile, from the rows' pass to the columns', and a span's codes
  // go to y_t together (kColumnSpanRows).
  const bool columnwise = a.columns.y_t != nullptr;
  const int64_t block_rows = columnwise ? ColumnBlockRows(a) : 1;
  const int64_t span_rows = std::max(block_rows, kColumnSpanRows / block_rows * block_rows);
  if (columnwise) rows_per_task = std::max(span_rows, rows_per_task / span_rows * span_rows);
  const int64_t num_tasks = (a.rows + rows_per_task - 1) / rows_per_task;
  const float* gw = gamma_plus_offset;
  const auto process_rows = FP8NORM_CPU_LOOP(ProcessRows);
  const auto process_column_block = FP8NORM_CPU_LOOP(ProcessColumnBlock);
  const auto write_column_codes = FP8NORM_CPU_LOOP(WriteColumnCodes);
  // Only the AVX2 variant's ProcessColumnBlock moves codes.
  const bool moves_row_codes = CpuUsesAvx2() && MovesRowCodes(a);
  if (columnwise) {
    AdviseHugePages(a.columns.y_t, static_cast<size_t>(YByte(a, static_cast<int64_t>(elements))));
  }
  // Block scales are staged block by block ([blocks][hidden]), each task writing whole
  // rows of it, and moved into scales_t's [hidden][blocks] at the end: written in place,
  // a column's line of scales_t would be written a few bytes at a time by every task.
  const bool stages_scales = columnwise && a.static_scale == nullptr;
  // Rows of staged scales an odd number of lines apart, as a span's codes are
  // (ColumnCodesStride): the transpose into scales_t loads 16 of them at a time.
  const int64_t staged_stride =
      ColumnCodesStride(a.hidden * static_cast<int64_t>(FloatTypeBytes(a.scale_type)));
  const StagedColumnScales staging(stages_scales ? ColumnBlocks(a) * staged_stride : 0);
  uint8_t* const staged_scales = staging.data();
  if (stages_scales && staged_scales == nullptr) return false;
  // A task may run on a pool thread, where an escaping exception would end the process:
  // a failed allocation is reported through this flag instead.
  std::atomic<bool> out_of_memory{false};
  if (columnwise && a.columns.global_scales_t != nullptr) {
    // Each column's global scale needs every row's n before any block of the column is
    // quantised: the rows' pass first (its r), then the columns' abs-maxima from x.
    parallel_for(num_tasks, [&](int64_t task) {
      float* scratch = ThreadBuffer<Buffer::kScratchRow>(a.hidden + 2 * GroupsPerRow(a));
      if (scratch == nullptr) {
        out_of_memory.store(true, std::memory_order_relaxed);
        return;
      }
      const int64_t begin = task * rows_per_task;
      process_rows(a, gw, scratch, begin, std::min(a.rows, begin + rows_per_task), nullptr);
    });
    if (out_of_memory.load()) return false;
    ColumnGlobalScales(a, gw, parallel_for);
  }
  parallel_for(num_tasks, [&](int64_t task) {
    // The row, and the scale and its reciprocal of each of its groups when it has several
    // (or is FP4's).
    const int64_t groups = GroupsPerRow(a);
    const bool group_scratch = groups > 1 || a.out_format == OutFormat::kE2M1;
    float* scratch = ThreadBuffer<Buffer::kScratchRow>(a.hidden + (group_scratch ? 2 * groups : 0));
    if (scratch == nullptr) {
      out_of_memory.store(true, std::memory_order_relaxed);
      return;
    }
    const int64_t begin = task * rows_per_task;
    const int64_t end = std::min(a.rows, begin + rows_per_task);
    if (!columnwise) {
      process_rows(a, gw, scratch, begin, end, nullptr);
      return;
    }
    const uint8_t* const row_codes = static_cast<const uint8_t*>(a.y);
    if (a.static_scale != nullptr) {
      // A static scale's y_t is the rowwise codes transposed (docs/spec.md).
      for (int64_t span0 = begin; span0 < end; span0 += span_rows) {
        const int64_t span_end = std::min(end, span0 + span_rows);
        process_rows(a, gw, scratch, span0, span_end, nullptr);
        write_column_codes(a, row_codes + YByte(a, span0 * a.hidden), a.hidden, span0,
                           span_end - span0);
      }
      return;
    }
    ColumnScratch column_scratch =
        ThreadColumnScratch(block_rows, span_rows, a.hidden, moves_row_codes ? groups : 0);
    if (column_scratch.codes == nullptr) {
      out_of_memory.store(true, std::memory_order_relaxed);
      return;
    }
    column_scratch.gamma_plus_offset = gw;
    column_scratch.staged_scales = staged_scales;
    column_scratch.staged_stride = staged_stride;
    for (int64_t span0 = begin; span0 < end; span0 += span_rows) {
      const int64_t span_end = std::min(end, span0 + span_rows);
      for (int64_t row0 = span0; row0 < span_end; row0 += block_rows) {
        const int64_t rows = std::min(block_rows, span_end - row0);
        process_rows(a, gw, scratch, row0, row0 + rows, &column_scratch);
        process_column_block(a, row0, rows, column_scratch, row_codes + YByte(a, row0 * a.hidden),
                             column_scratch.codes + (row0 - span0) * column_scratch.codes_stride);
      }
      write_column_codes(a, column_scratch.codes, column_scratch.codes_stride, span0,
                         span_end - span0);
    }
  });
  if (out_of_memory.load()) return false;
  if (stages_scales) {
    // Tasks of whole 64-column strips (a line of 64 one-byte scales per block read at a
    // time) of about kMaxElementsPerTask scales.
    const int64_t blocks = ColumnBlocks(a);
    const int64_t strip = 64 * std::max<int64_t>(1, kMaxElementsPerTask / (64 * blocks));
    const auto write_column_scales = FP8NORM_CPU_LOOP(WriteColumnScales);
    parallel_for((a.hidden + strip - 1) / strip, [&](int64_t task) {
      const int64_t j0 = task * strip;
      write_column_scales(a, staged_scales, staged_stride, j0, std::min(a.hidden, j0 + strip));
    });
  }
  return true;
}

const char* CpuKernelVariant() { return CpuUsesAvx2() ? "avx2" : "baseline"; }

void RoundCpu(const RoundArgs& a) {
  const auto load = [&](int64_t i) { return a.in[i]; };
  for (int64_t k = 0, n = RoundedOutputs(a); k < n; ++k) {
    const uint16_t bits = RoundedOutput(a, k, load);
    if (IsOneByte(a.target)) {
      static_cast<uint8_t*>(a.out)[k] = static_cast<uint8_t>(bits);
    } else {
      static_cast<uint16_t*>(a.out)[k] = bits;
    }
  }
}

}  // namespace fp8norm
