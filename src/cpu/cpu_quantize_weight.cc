#include "cpu_quantize_weight.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <new>

#include "cpu_config.h"

namespace fp8norm {
namespace {

// Scratch of n Ts, null where the host is out of memory: the tasks run on the pool's
// threads too, where an exception would end the process.
template <typename T>
std::unique_ptr<T[]> Scratch(int64_t n) {
  return std::unique_ptr<T[]>(new (std::nothrow) T[n]);
}

// Bands of `block` rows per task: about kTasksPerCall tasks of at least
// kMinElementsPerTask elements, as the norm's rows are split.
int64_t BandsPerTask(const QuantizeWeightArgs& a) {
  const int64_t bands = a.rows / a.block;
  const int64_t band_elements = std::max<int64_t>(1, a.block * a.cols);
  const int64_t by_count = (bands + kTasksPerCall - 1) / kTasksPerCall;
  const int64_t by_size = (kMinElementsPerTask + band_elements - 1) / band_elements;
  return std::max<int64_t>(1, std::max(by_count, by_size));
}

template <typename T>
uint32_t BandAbsMax(const QuantizeWeightArgs& a, int64_t band) {
  const T* w = static_cast<const T*>(a.w) + band * a.block * a.cols;
  uint32_t amax = 0;
  for (int64_t i = 0; i < a.block * a.cols; ++i) amax = std::max(amax, AbsBits(ToFloat(w[i])));
  return amax;
}

// One band of FP4 tiles: its tile scales (written to a.scales), then its codes, one per
// byte in `codes` (the band's block * F elements in order), then stored packed or not.
// Each tile's loops take one rule, so that the compiler vectorises them.
template <typename T>
void Fp4Band(const QuantizeWeightArgs& a, int64_t band, float gs, uint32_t* amax, Fp4Scale* rules,
             uint8_t* codes) {
  const int64_t tiles = TileColumns(a);
  const T* w = static_cast<const T*>(a.w) + band * a.block * a.cols;
  std::fill(amax, amax + tiles, 0u);
  for (int64_t r = 0; r < a.block; ++r) {
    for (int64_t t = 0; t < tiles; ++t) {
      const T* tile_row = w + r * a.cols + t * a.block;
      const int64_t n = std::min(a.block, a.cols - t * a.block);
      uint32_t m = amax[t];
      for (int64_t k = 0; k < n; ++k) m = std::max(m, AbsBits(ToFloat(tile_row[k])));
      amax[t] = m;
    }
  }
  for (int64_t t = 0; t < tiles; ++t) {
    const uint8_t code = WeightTileScaleCode(a.nvfp4, amax[t], gs);
    a.scales[band * tiles + t] = code;
    rules[t] = WeightTileScale(a.nvfp4, code, gs);
  }
  for (int64_t r = 0; r < a.block; ++r) {
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t j0 = r * a.cols + t * a.block;
      const int64_t n = std::min(a.block, a.cols - t * a.block);
      const Fp4Scale s = rules[t];
      for (int64_t k = 0; k < n; ++k) codes[j0 + k] = QuantizeFp4Element(ToFloat(w[j0 + k]), s);
    }
  }
  const int64_t count = a.block * a.cols;  // even: block is
  auto* out = static_cast<uint8_t*>(a.codes);
  if (!a.codes_packed) {
    std::copy(codes, codes + count, out + band * count);
    return;
  }
  uint8_t* packed = out + band * count / 2;
  for (int64_t k = 0; k < count / 2; ++k) packed[k] = PackFp4(codes[2 * k], codes[2 * k + 1]);
}

// f(TypeTag<T>{}) for the C++ type T of the weight's type.
template <typename T>
struct TypeTag {
  using Type = T;
};
template <typename F>
void WithWeightType(FloatType type, F f) {
  switch (type) {
    case FloatType::kF16:
      return f(TypeTag<F16>{});
    case FloatType::kBF16:
      return f(TypeTag<BF16>{});
    default:
      return f(TypeTag<float>{});
  }
}

// FP8 along K: tasks of strips of kStripColumns columns, each over every band of `block`
// rows (one band per channel), read row by row along the strip.
constexpr int64_t kStripColumns = 256;

// A strip's loops for one weight type and rule, the rules held as one array per field, so
// that the compiler vectorises the loops along the strip.
template <typename T, bool kBlocks>
void Fp8StripOf(const QuantizeWeightArgs& a, int64_t j0, int64_t n, uint32_t* amax, float* scale,
                float* recip, uint32_t* zero) {
  const T* w = static_cast<const T*>(a.w);
  auto* out = static_cast<uint8_t*>(a.codes);
  for (int64_t band = 0; band < a.rows / a.block; ++band) {
    const int64_t i0 = band * a.block;
    std::fill(amax, amax + n, 0u);
    for (int64_t i = i0; i < i0 + a.block; ++i) {
      const T* row = w + i * a.cols + j0;
      for (int64_t k = 0; k < n; ++k) amax[k] = std::max(amax[k], AbsBits(ToFloat(row[k])));
    }
    for (int64_t k = 0; k < n; ++k) {
      const Fp8ColumnScale s = Fp8ColumnScaleOf(kBlocks, amax[k]);
      StoreAs(kBlocks ? FloatType::kE8M0 : FloatType::kF32, a.scales, band * a.cols + j0 + k,
              s.scale);
      scale[k] = s.scale;
      recip[k] = s.recip;
      zero[k] = s.zero ? 1u : 0u;
    }
    for (int64_t i = i0; i < i0 + a.block; ++i) {
      const T* row = w + i * a.cols + j0;
      uint8_t* codes = out + i * a.cols + j0;
      for (int64_t k = 0; k < n; ++k) {
        codes[k] = Fp8ColumnCode(ToFloat(row[k]),
                                 Fp8ColumnScale{scale[k], recip[k], kBlocks, zero[k] != 0});
      }
    }
  }
}

bool Fp8Strip(const QuantizeWeightArgs& a, int64_t j0, int64_t j1) {
  const int64_t n = j1 - j0;
  const auto amax = Scratch<uint32_t>(n);
  const auto scale = Scratch<float>(n);
  const auto recip = Scratch<float>(n);
  const auto zero = Scratch<uint32_t>(n);
  if (amax == nullptr || scale == nullptr || recip == nullptr || zero == nullptr) return false;
  const bool blocks = a.format == WeightFormat::kFp8Blocks;
  WithWeightType(a.w_type, [&](auto tag) {
    using T = typename decltype(tag)::Type;
    (blocks ? Fp8StripOf<T, true> : Fp8StripOf<T, false>)(a, j0, n, amax.get(), scale.get(),
                                                          recip.get(), zero.get());
  });
  return true;
}

bool QuantizeFp8Columns(const QuantizeWeightArgs& a, const ParallelFor& parallel_for) {
  *a.global_scale = 1.0f;
  const int64_t strips = (a.cols + kStripColumns - 1) / kStripColumns;
  std::atomic<bool> out_of_memory{false};
  parallel_for(strips, [&](int64_t strip) {
    if (!Fp8Strip(a, strip * kStripColumns, std::min(a.cols, (strip + 1) * kStripColumns))) {
      out_of_memory.store(true);
    }
  });
  return !out_of_memory.load();
}

}  // namespace

bool QuantizeWeightCpu(const QuantizeWeightArgs& a, const ParallelFor& parallel_for) {
  if (!IsFp4(a)) return QuantizeFp8Columns(a, parallel_for);
  const int64_t bands = a.rows / a.block;
  const int64_t per_task = BandsPerTask(a);
  const int64_t tasks = (bands + per_task - 1) / per_task;
  float gs = 1.0f;
  if (a.nvfp4) {
    const auto task_amax = Scratch<uint32_t>(tasks);
    if (task_amax == nullptr) return false;
    WithWeightType(a.w_type, [&](auto tag) {
      using T = typename decltype(tag)::Type;
      parallel_for(tasks, [&](int64_t task) {
        uint32_t m = 0;
        for (int64_t b = task * per_task; b < std::min(bands, (task + 1) * per_task); ++b) {
          m = std::max(m, BandAbsMax<T>(a, b));
        }
        task_amax[task] = m;
      });
    });
    uint32_t amax = 0;
    for (int64_t task = 0; task < tasks; ++task) amax = std::max(amax, task_amax[task]);
    gs = Nvfp4GlobalScale(amax);
  }
  *a.global_scale = gs;
  const int64_t tiles = TileColumns(a);
  std::atomic<bool> out_of_memory{false};
  WithWeightType(a.w_type, [&](auto tag) {
    using T = typename decltype(tag)::Type;
    parallel_for(tasks, [&](int64_t task) {
      const auto amax = Scratch<uint32_t>(tiles);
      const auto rules = Scratch<Fp4Scale>(tiles);
      const auto codes = Scratch<uint8_t>(a.block * a.cols);
      if (amax == nullptr || rules == nullptr || codes == nullptr) {
        out_of_memory.store(true);
        return;
      }
      for (int64_t b = task * per_task; b < std::min(bands, (task + 1) * per_task); ++b) {
        Fp4Band<T>(a, b, gs, amax.get(), rules.get(), codes.get());
      }
    });
  });
  return !out_of_memory.load();
}

}  // namespace fp8norm
