// CPU kernel of the output gradient's FP4 quantiser (src/common/quantize_gradient.h): the
// dgrad copy row by row, the wgrad copy block of rows by block of rows, in tasks that the
// caller's thread pool runs. Every element's code is a function of its group and of the
// random bits of its (row, column), so the split into tasks cannot change a bit.
//
// Built with the CPU kernels' flags (no FMA contraction, no fast math), so each division
// and product rounds as in the CUDA kernel and the jnp twin.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <new>
#include <vector>

#include "cpu_config.h"
#include "quantize_gradient.h"

namespace fp8norm {
namespace {

std::atomic<int64_t> forced_task_rows{0};

// The kernel's thread buffers (ThreadBuffer, cpu_config.h).
enum class GradientBuffer { kScratch };

// Units (rows, or blocks of rows) per task: about kTasksPerCall tasks, each at least
// kMinElementsPerTask elements, unless a test forces the count.
int64_t UnitsPerTask(int64_t units, int64_t elements_per_unit) {
  if (const int64_t forced = forced_task_rows.load(); forced > 0) return forced;
  const int64_t total = units * elements_per_unit;
  const int64_t per_task = std::max(total / kTasksPerCall, kMinElementsPerTask);
  return std::max<int64_t>(1, per_task / std::max<int64_t>(1, elements_per_unit));
}

void ForEachTask(int64_t units, int64_t elements_per_unit, const ParallelFor& parallel_for,
                 const std::function<void(int64_t, int64_t)>& run) {
  const int64_t per_task = UnitsPerTask(units, elements_per_unit);
  const int64_t tasks = (units + per_task - 1) / per_task;
  parallel_for(tasks, [&](int64_t t) { run(t * per_task, std::min(units, (t + 1) * per_task)); });
}

// Code `code` of flat element k of the codes: a nibble of a shared byte when packed. A
// task owns whole bytes (its rows and blocks of rows start at even elements), and writes
// the even element of a byte before the odd one.
void StoreCode(const QuantizeGradientArgs& a, int64_t k, uint8_t code) {
  if (!a.codes_packed) {
    a.codes[k] = code;
  } else if (k % 2 == 0) {
    a.codes[k / 2] = code;
  } else {
    a.codes[k / 2] = uint8_t(a.codes[k / 2] | (code << 4));
  }
}

// The random bits of columns [0, cols) of `row` (zeros when rounding to nearest), in a
// loop of its own: Threefry's integer rounds vectorise there, across the columns, which
// they cannot inside the branches of the codes' loop.
uint32_t* RowBits(const QuantizeGradientArgs& a, KeyWords key, int64_t row) {
  thread_local std::vector<uint32_t> bits;
  try {
    bits.resize(a.cols);
  } catch (const std::bad_alloc&) {
    return nullptr;
  }
  uint32_t* out = bits.data();
  for (int64_t j = 0; j < a.cols; ++j) {
    out[j] = a.stochastic ? RandomBits(key, uint32_t(row), uint32_t(j)) : 0u;
  }
  return out;
}

// The dgrad copy of rows [begin, end): NVFP4 divides each row by its own global scale
// first (t = g / gs), then quantises t's groups under a global scale of 1, as the twin.
bool QuantizeRows(const QuantizeGradientArgs& a, KeyWords key, int64_t begin, int64_t end) {
  const int64_t f = a.cols;
  float* t = ThreadBuffer<GradientBuffer::kScratch>(f);
  if (t == nullptr && f > 0) return false;
  for (int64_t i = begin; i < end; ++i) {
    const uint32_t* bits = RowBits(a, key, i);
    if (bits == nullptr) return false;
    const float* g = a.g + i * f;
    float gs = 1.0f;
    if (a.nvfp4) {
      uint32_t amax = 0;
      for (int64_t j = 0; j < f; ++j) amax = std::max(amax, AbsBits(g[j]));
      gs = Nvfp4GlobalScale(amax);
      a.global_scales[i] = gs;
      for (int64_t j = 0; j < f; ++j) t[j] = g[j] / gs;
    } else {
      std::copy(g, g + f, t);
    }
    for (int64_t b = 0; b < f / a.block; ++b) {
      const float* v = t + b * a.block;
      uint32_t amax = 0;
      for (int64_t k = 0; k < a.block; ++k) amax = std::max(amax, AbsBits(v[k]));
      const Fp4Scale s = GradientGroupScale(a.nvfp4, amax, 1.0f);
      a.scales[i * (f / a.block) + b] = GradientScaleByte(a.nvfp4, s);
      for (int64_t k = 0; k < a.block; ++k) {
        const int64_t j = b * a.block + k;
        StoreCode(a, i * f + j, GradientCode(v[k], s, a.stochastic, bits[j]));
      }
    }
  }
  return true;
}

// Block `rb` of rows of g into `m`, column after column (column j's group at m + j *
// block, so that its transform and its abs-max read one or two cache lines, not a line
// per row), Hadamard-transformed where the call asks for it.
void LoadBlock(const QuantizeGradientArgs& a, int64_t rb, float* m) {
  const int64_t f = a.cols;
  const int64_t block = a.block;
  const float* g = a.g + rb * block * f;
  for (int64_t k = 0; k < block; ++k) {
    for (int64_t j = 0; j < f; ++j) m[j * block + k] = g[k * f + j];
  }
  if (!a.hadamard) return;
  for (int64_t j = 0; j < f; ++j) HadamardOfBlock(m + j * block, 1, block, a.hadamard_mask);
}

// The largest |M g| of blocks [begin, end) of rows, as ordered bits.
bool BlocksAmax(const QuantizeGradientArgs& a, int64_t begin, int64_t end, uint32_t* amax) {
  float* m = ThreadBuffer<GradientBuffer::kScratch>(a.block * a.cols);
  if (m == nullptr) return false;
  uint32_t out = 0;
  for (int64_t rb = begin; rb < end; ++rb) {
    LoadBlock(a, rb, m);
    for (int64_t k = 0; k < a.block * a.cols; ++k) out = std::max(out, AbsBits(m[k]));
  }
  *amax = out;
  return true;
}

// The wgrad copy of blocks [begin, end) of rows: each column's block of M g is a group.
// Codes are written row after row, so that each byte's even element comes first.
bool QuantizeColumns(const QuantizeGradientArgs& a, KeyWords key, float gs, int64_t begin,
                     int64_t end) {
  const int64_t f = a.cols;
  const int64_t block = a.block;
  float* m = ThreadBuffer<GradientBuffer::kScratch>(block * f);
  if (m == nullptr) return false;
  thread_local std::vector<Fp4Scale> scales;
  try {
    scales.resize(f);
  } catch (const std::bad_alloc&) {
    return false;
  }
  for (int64_t rb = begin; rb < end; ++rb) {
    LoadBlock(a, rb, m);
    for (int64_t j = 0; j < f; ++j) {
      uint32_t amax = 0;
      for (int64_t k = 0; k < block; ++k) amax = std::max(amax, AbsBits(m[j * block + k]));
      scales[j] = GradientGroupScale(a.nvfp4, amax, gs);
      a.scales[rb * f + j] = GradientScaleByte(a.nvfp4, scales[j]);
    }
    for (int64_t k = 0; k < block; ++k) {
      const int64_t i = rb * block + k;
      const uint32_t* bits = RowBits(a, key, i);
      if (bits == nullptr) return false;
      for (int64_t j = 0; j < f; ++j) {
        const uint8_t code = GradientCode(m[j * block + k], scales[j], a.stochastic, bits[j]);
        StoreCode(a, i * f + j, code);
      }
    }
  }
  return true;
}

}  // namespace

void SetQuantizeGradientTaskRows(int64_t rows) { forced_task_rows = rows > 0 ? rows : 0; }

bool QuantizeGradientCpu(const QuantizeGradientArgs& a, const ParallelFor& parallel_for) {
  if (a.columns && (a.rows == 0 || a.cols == 0)) {
    // The tensor scale of no values: that of a zero amax.
    if (a.nvfp4) a.global_scales[0] = Nvfp4GlobalScale(0);
    return true;
  }
  const KeyWords key = a.stochastic ? KeyWords{a.key[0], a.key[1]} : KeyWords{0, 0};
  std::atomic<bool> ok{true};
  if (!a.columns) {
    // Rows of no elements too: each gets the global scale of a zero amax.
    ForEachTask(a.rows, a.cols, parallel_for, [&](int64_t begin, int64_t end) {
      if (!QuantizeRows(a, key, begin, end)) ok = false;
    });
    return ok;
  }
  const int64_t blocks = a.rows / a.block;
  const int64_t block_elements = a.block * a.cols;
  float gs = 1.0f;
  if (a.nvfp4) {
    // The tensor's scale needs every block's |M g| first: a pass of its own, each task's
    // abs-max kept apart and merged after (a max, in any order).
    std::vector<uint32_t> task_amax;
    try {
      task_amax.assign(blocks, 0u);
    } catch (const std::bad_alloc&) {
      return false;
    }
    ForEachTask(blocks, block_elements, parallel_for, [&](int64_t begin, int64_t end) {
      if (!BlocksAmax(a, begin, end, &task_amax[begin])) ok = false;
    });
    if (!ok) return false;
    gs = Nvfp4GlobalScale(*std::max_element(task_amax.begin(), task_amax.end()));
    a.global_scales[0] = gs;
  }
  ForEachTask(blocks, block_elements, parallel_for, [&](int64_t begin, int64_t end) {
    if (!QuantizeColumns(a, key, gs, begin, end)) ok = false;
  });
  return ok;
}

}  // namespace fp8norm
