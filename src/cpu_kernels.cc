// CPU kernel of rms_norm_fp8 and add_rms_norm_fp8 (docs/spec.md): each row is loaded once
// into a float32 scratch row that stays in cache, normalised in place and quantised from
// there. Rows are split into tasks that the caller's thread pool runs in parallel.
//
// The inner loops work on kLanes independent lanes so that the compiler vectorises the
// sum of squares and the abs-max without reassociating float additions itself. Built
// with -ffp-contract=off: a fused multiply-add would round differently from the CUDA
// kernel and the reference.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "fp8norm_math.h"
#include "rms_norm_fp8.h"

namespace fp8norm {
namespace {

constexpr int64_t kLanes = 16;
// Work per task: enough elements that scheduling costs nothing next to it, few enough
// that a 4096 x 4096 call still spreads over every core.
constexpr int64_t kElementsPerTask = int64_t{1} << 17;

float* ScratchRow(int64_t hidden) {
  thread_local std::vector<float> scratch;
  if (static_cast<int64_t>(scratch.size()) < hidden) scratch.resize(hidden);
  return scratch.data();
}

// h = x (+ residual); residual_out = h rounded to the residual's dtype; returns sum(h * h).
template <typename TIn, typename TRes>
float LoadRow(const TIn* x, const TRes* residual, TRes* residual_out, float* h, int64_t n) {
  SumOfSquares acc[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int64_t k = 0; k < kLanes; ++k) {
      float v = ToFloat(x[j + k]);
      if (residual != nullptr) v += ToFloat(residual[j + k]);
      h[j + k] = v;
      AddSquare(acc[k], v);
    }
  }
  for (int64_t k = 0; j < n; ++j, ++k) {
    float v = ToFloat(x[j]);
    if (residual != nullptr) v += ToFloat(residual[j]);
    h[j] = v;
    AddSquare(acc[k], v);
  }
  if (residual_out != nullptr) {
    for (int64_t i = 0; i < n; ++i) residual_out[i] = FromFloat<TRes>(h[i]);
  }
  for (int64_t width = kLanes / 2; width > 0; width /= 2) {
    for (int64_t k = 0; k < width; ++k) acc[k] = Combine(acc[k], acc[k + width]);
  }
  return Total(acc[0]);
}

// h = (h * r) * (gamma + weight_offset) in place; returns the abs-max as ordered bits.
uint32_t NormalizeRow(float* h, const float* gamma_plus_offset, float r, int64_t n) {
  uint32_t amax[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int64_t k = 0; k < kLanes; ++k) {
      const float v = (h[j + k] * r) * gamma_plus_offset[j + k];
      h[j + k] = v;
      amax[k] = std::max(amax[k], AbsBits(v));
    }
  }
  for (int64_t k = 0; j < n; ++j, ++k) {
    const float v = (h[j] * r) * gamma_plus_offset[j];
    h[j] = v;
    amax[k] = std::max(amax[k], AbsBits(v));
  }
  uint32_t result = 0;
  for (int64_t k = 0; k < kLanes; ++k) result = std::max(result, amax[k]);
  return result;
}

// y is a byte pointer, which may alias anything: __restrict tells the vectoriser it
// does not alias the scratch row.
template <Fp8Format kOut>
void QuantizeRow(const float* __restrict normed, float recip, uint8_t* __restrict y, int64_t n) {
  for (int64_t j = 0; j < n; ++j) y[j] = QuantizeElement<kOut>(normed[j], recip);
}

template <typename TIn, typename TRes, Fp8Format kOut>
void QuantizeRows(const RmsNormFp8Args& a, const float* gamma_plus_offset, int64_t begin,
                  int64_t end) {
  const int64_t n = a.hidden;
  float* h = ScratchRow(n);
  for (int64_t row = begin; row < end; ++row) {
    const int64_t offset = row * n;
    const TRes* residual =
        a.residual != nullptr ? static_cast<const TRes*>(a.residual) + offset : nullptr;
    TRes* residual_out =
        a.residual_out != nullptr ? static_cast<TRes*>(a.residual_out) + offset : nullptr;
    const float sum_sq =
        LoadRow(static_cast<const TIn*>(a.x) + offset, residual, residual_out, h, n);
    const float r = InverseRms(sum_sq, n, a.constants.eps);
    const uint32_t amax = NormalizeRow(h, gamma_plus_offset, r, n);
    const RowScale s = ComputeRowScale(sum_sq, amax, kOut, a.scale_type, a.constants);
    StoreAs(a.scale_type, a.scales, row, s.scale);
    QuantizeRow<kOut>(h, s.recip, static_cast<uint8_t*>(a.y) + offset, n);
  }
}

template <typename TGamma>
void GammaPlusOffset(const void* gamma, float weight_offset, int64_t n, float* out) {
  const TGamma* g = static_cast<const TGamma*>(gamma);
  for (int64_t j = 0; j < n; ++j) out[j] = ToFloat(g[j]) + weight_offset;
}

template <typename TIn, typename TRes>
void DispatchOutput(const RmsNormFp8Args& a, const float* gamma_plus_offset, int64_t begin,
                    int64_t end) {
  if (a.out_format == Fp8Format::kE4M3FN) {
    QuantizeRows<TIn, TRes, Fp8Format::kE4M3FN>(a, gamma_plus_offset, begin, end);
  } else {
    QuantizeRows<TIn, TRes, Fp8Format::kE4M3FNUZ>(a, gamma_plus_offset, begin, end);
  }
}

// The residual shares the input's dtype, except after a float32 all-reduce, where a
// float32 x meets a 16-bit residual stream.
void DispatchTypes(const RmsNormFp8Args& a, const float* gamma_plus_offset, int64_t begin,
                   int64_t end) {
  switch (a.input_type) {
    case FloatType::kF16:
      return DispatchOutput<F16, F16>(a, gamma_plus_offset, begin, end);
    case FloatType::kBF16:
      return DispatchOutput<BF16, BF16>(a, gamma_plus_offset, begin, end);
    default:
      if (a.residual != nullptr && a.residual_type == FloatType::kBF16) {
        return DispatchOutput<float, BF16>(a, gamma_plus_offset, begin, end);
      }
      if (a.residual != nullptr && a.residual_type == FloatType::kF16) {
        return DispatchOutput<float, F16>(a, gamma_plus_offset, begin, end);
      }
      return DispatchOutput<float, float>(a, gamma_plus_offset, begin, end);
  }
}

}  // namespace

void RmsNormFp8Cpu(const RmsNormFp8Args& a, const ParallelFor& parallel_for) {
  if (a.rows == 0) return;
  if (a.hidden == 0) {
    for (int64_t row = 0; row < a.rows; ++row) StoreAs(a.scale_type, a.scales, row, 0.0f);
    return;
  }
  // gamma + weight_offset once per call, in float32, shared by every row.
  std::vector<float> gamma_plus_offset(a.hidden);
  switch (a.gamma_type) {
    case FloatType::kF16:
      GammaPlusOffset<F16>(a.gamma, a.constants.weight_offset, a.hidden, gamma_plus_offset.data());
      break;
    case FloatType::kBF16:
      GammaPlusOffset<BF16>(a.gamma, a.constants.weight_offset, a.hidden, gamma_plus_offset.data());
      break;
    default:
      GammaPlusOffset<float>(a.gamma, a.constants.weight_offset, a.hidden,
                             gamma_plus_offset.data());
  }
  const int64_t rows_per_task = std::max<int64_t>(1, kElementsPerTask / a.hidden);
  const int64_t num_tasks = (a.rows + rows_per_task - 1) / rows_per_task;
  const float* gw = gamma_plus_offset.data();
  parallel_for(num_tasks, [&](int64_t task) {
    const int64_t begin = task * rows_per_task;
    const int64_t end = std::min(a.rows, begin + rows_per_task);
    DispatchTypes(a, gw, begin, end);
  });
}

void RoundCpu(const RoundArgs& a) {
  for (int64_t i = 0; i < a.count; ++i) RoundElement(a, i);
}

}  // namespace fp8norm
