// Arguments of one rms_norm_fp8 / add_rms_norm_fp8 call as the CPU and CUDA kernels take
// them, and the entry points of both kernels. Plain C++: no XLA, CUDA or nanobind types,
// so the FFI handlers (host compiler) and the CUDA kernels (nvcc) share it.
#pragma once

#include <cstdint>
#include <functional>

#include "fp8norm_math.h"

namespace fp8norm {

struct RmsNormFp8Args {
  const void* x;         // [rows, hidden], input_type
  const void* residual;  // [rows, hidden], residual_type; null for rms_norm_fp8
  const void* gamma;     // [hidden], gamma_type
  void* y;               // [rows, hidden], FP8 in out_format
  void* scales;          // [rows, hidden / group_size], scale_type
  // [1] float32, the calibrated scale of every row; null for scales computed per row or
  // group. On the device of the kernel that reads it.
  const float* static_scale;
  void* residual_out;  // [rows, hidden], residual_type; null when residual is null
  int64_t rows;
  int64_t hidden;
  // Elements that share one scale: a divisor of hidden, hidden itself for one scale per
  // row (so, per row, also with a static scale); 0 reads as hidden.
  int64_t group_size;
  FloatType input_type;
  // The input's dtype, or a 16-bit type when x is float32: the sum of a float32
  // all-reduce added to a bfloat16 / float16 residual stream.
  FloatType residual_type;
  FloatType gamma_type;
  FloatType scale_type;
  Fp8Format out_format;
  RowConstants constants;
};

// One scale for the whole row (per row, or static).
FP8NORM_HD bool PerRowScale(const RmsNormFp8Args& a) {
  return a.group_size <= 0 || a.group_size == a.hidden;
}

// Scales per row: hidden / group_size, or 1.
FP8NORM_HD int64_t GroupsPerRow(const RmsNormFp8Args& a) {
  return PerRowScale(a) ? 1 : a.hidden / a.group_size;
}

// Element-wise rounding of float32 values, the same functions the kernels use; exposed so
// that tests can hold every FP8 / float16 / bfloat16 boundary against ml_dtypes.
enum class RoundTarget : int32_t { kF16 = 0, kBF16 = 1, kE4M3FN = 2, kE4M3FNUZ = 3 };

struct RoundArgs {
  const float* in;  // [count]
  void* out;        // [count], 2 bytes per element for float16 / bfloat16, 1 for FP8
  int64_t count;
  RoundTarget target;
};

// float32 v rounded to `target`, as the one definition the CPU loop and the CUDA kernel
// share: an FP8 code (in the low byte) or the bits of a float16 / bfloat16.
FP8NORM_HD uint16_t RoundedBits(RoundTarget target, float v) {
  switch (target) {
    case RoundTarget::kE4M3FN:
      return ToFp8<Fp8Format::kE4M3FN>(v);
    case RoundTarget::kE4M3FNUZ:
      return ToFp8<Fp8Format::kE4M3FNUZ>(v);
    case RoundTarget::kF16:
      return ToF16(v).bits;
    default:
      return ToBF16(v).bits;
  }
}

FP8NORM_HD bool IsFp8(RoundTarget target) {
  return target == RoundTarget::kE4M3FN || target == RoundTarget::kE4M3FNUZ;
}

// `parallel_for(num_tasks, task)` calls task(i) once for every i in [0, num_tasks), in
// any order and on any threads, and returns when all calls have returned.
using ParallelFor = std::function<void(int64_t, const std::function<void(int64_t)>&)>;

// False when the host memory for the call's float32 rows could not be allocated; the
// outputs are then incomplete.
bool RmsNormFp8Cpu(const RmsNormFp8Args& args, const ParallelFor& parallel_for);
// The instruction-set variant of the CPU row loops in use: "avx2" or "baseline".
const char* CpuKernelVariant();
void RoundCpu(const RoundArgs& args);

}  // namespace fp8norm
