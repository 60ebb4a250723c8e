// Arguments of one rms_norm_fp8 / add_rms_norm_fp8 call as the CPU and CUDA kernels take
// them, and the entry points of both kernels. Plain C++: no XLA, CUDA or nanobind types,
// so the FFI handlers (host compiler) and the CUDA kernels (nvcc) share it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

#include "fp8norm_math.h"

namespace fp8norm {

// The columnwise outputs of a call (docs/spec.md, "Columnwise outputs"): n quantised
// along the rows, in blocks of `block_rows` rows (0: a static scale, which has none).
struct ColumnOutputs {
  void* y_t = nullptr;       // [hidden, rows] in out_format (FP4 packed along the rows)
  void* scales_t = nullptr;  // [hidden, rows / block_rows], [hidden, 1] for a static scale
  int64_t block_rows = 0;
  // [hidden] float32, each column's NVFP4 global scale (PerRowGlobalScale of its abs-max
  // over every row) with per-row global scales, under which its blocks are quantised; null
  // otherwise.
  float* global_scales_t = nullptr;
  // The Hadamard transform of each column's block of n before it is quantised (FP4 blocks
  // of 16 or 32 rows; docs/spec.md, "Columnwise outputs"): HadamardBlock's sign mask.
  bool hadamard = false;
  uint32_t hadamard_mask = 0;
};

struct RmsNormFp8Args {
  const void* x;         // [rows, hidden], input_type
  const void* residual;  // [rows, hidden], residual_type; null for rms_norm_fp8
  const void* gamma;     // [hidden], gamma_type
  // [rows, hidden] in out_format: FP8, one code per byte; FP4, two codes per byte (element
  // 2k in the low nibble) when y_packed, else one per byte (in the low nibble).
  void* y;
  void* scales;  // [rows, hidden / group_size], scale_type
  // [1] float32, the calibrated scale of every row; null for scales computed per row or
  // group. On the device of the kernel that reads it.
  const float* static_scale;
  // [1] float32, NVFP4's global decode scale; null for every other format. On the device
  // of the kernel that reads it.
  const float* global_scale;
  void* residual_out;  // [rows, hidden], residual_type; null when residual is null
  int64_t rows;
  int64_t hidden;
  // Elements that share one scale: a divisor of hidden; hidden itself for one scale per
  // row (so, per row, also with a static scale), the only encoding of it here.
  int64_t group_size;
  FloatType input_type;
  // The input's dtype, or a 16-bit type when x is float32: the sum of a float32
  // all-reduce added to a bfloat16 / float16 residual stream.
  FloatType residual_type;
  FloatType gamma_type;
  FloatType scale_type;
  OutFormat out_format;
  bool y_packed;
  RowConstants constants;
  // [rows] float32, each row's r (the training form saves it for the backward); null
  // otherwise.
  float* inverse_rms = nullptr;
  // [rows] float32, each row's amax (SavedAmax) beside a static scale, for delayed
  // scaling; null otherwise (only a static scale's call has it: its one group is the row).
  float* amax = nullptr;
  // [rows] float32, each row's NVFP4 global scale (global_scale="per_row"): computed from
  // the row's abs-max (PerRowGlobalScale), written, and used for its groups in place of
  // *global_scale, which is then null; null otherwise.
  float* global_scales = nullptr;
  // The columnwise outputs (columnwise.h), which need inverse_rms; y_t null without them.
  ColumnOutputs columns;
};

FP8NORM_HD bool IsFp4(const RmsNormFp8Args& a) { return a.out_format == OutFormat::kE2M1; }

// Whether each row (and each column of the columnwise outputs) takes its own NVFP4 global
// scale, from its own abs-max.
FP8NORM_HD bool PerRowGlobalScales(const RmsNormFp8Args& a) { return a.global_scales != nullptr; }

// One scale for the whole row (per row, or static). FP4 always takes the group paths, a
// group of the whole row included.
FP8NORM_HD bool PerRowScale(const RmsNormFp8Args& a) {
  return a.group_size == a.hidden && !IsFp4(a);
}

// The byte of y where element `element` of the call (row-major) starts, or of y_t (its
// columnwise outputs, packed alike): packed FP4 holds two per byte (element counts are
// even in every row: group sizes are, and so are blocks of rows).
FP8NORM_HD int64_t YByte(const RmsNormFp8Args& a, int64_t element) {
  return a.y_packed ? element / 2 : element;
}

// The FP4 scale of a group: NVFP4 (e4m3 scales) or MXFP4 (e8m0); global_scale is
// *a.global_scale, read by the caller where it lives.
FP8NORM_HD Fp4Scale Fp4ScaleOf(const RmsNormFp8Args& a, float sum_sq, uint32_t amax,
                               float global_scale) {
  return a.scale_type == FloatType::kE4M3 ? Nvfp4Scale(sum_sq, amax, global_scale)
                                          : Mxfp4Scale(sum_sq, amax, a.constants.scale_ub);
}

// Scales per row: hidden / group_size, one when the group is the row (an empty one too).
FP8NORM_HD int64_t GroupsPerRow(int64_t hidden, int64_t group_size) {
  return group_size == hidden ? 1 : hidden / group_size;
}
FP8NORM_HD int64_t GroupsPerRow(const RmsNormFp8Args& a) {
  return GroupsPerRow(a.hidden, a.group_size);
}

// Element-wise rounding of float32 values, the same functions the kernels use; exposed so
// that tests can hold every FP8 / float16 / bfloat16 boundary against ml_dtypes.
enum class RoundTarget : int32_t { kF16 = 0, kBF16 = 1, kE4M3FN = 2, kE4M3FNUZ = 3, kE2M1 = 4 };

struct RoundArgs {
  const float* in;  // [count]
  // [count]: 2 bytes per element for float16 / bfloat16, 1 for FP8; FP4 codes two per
  // byte when out_packed (element 2k in the low nibble), else one per byte.
  void* out;
  int64_t count;
  RoundTarget target;
  bool out_packed;
};

// float32 v rounded to `target`, as the one definition the CPU loop and the CUDA kernel
// share: an FP8 code (in the low byte) or the bits of a float16 / bfloat16.
FP8NORM_HD uint16_t RoundedBits(RoundTarget target, float v) {
  switch (target) {
    case RoundTarget::kE4M3FN:
      return ToFp8<OutFormat::kE4M3FN>(v);
    case RoundTarget::kE4M3FNUZ:
      return ToFp8<OutFormat::kE4M3FNUZ>(v);
    case RoundTarget::kE2M1:
      return Fp4Code(v);
    case RoundTarget::kF16:
      return ToF16(v).bits;
    default:
      return ToBF16(v).bits;
  }
}

// One byte per element (FP8, or unpacked FP4) or two (float16 / bfloat16).
FP8NORM_HD bool IsOneByte(RoundTarget target) {
  return target == RoundTarget::kE4M3FN || target == RoundTarget::kE4M3FNUZ ||
         target == RoundTarget::kE2M1;
}

// Output k of a round call (a byte when IsOneByte, else 16 bits): elements 2k and 2k + 1
// packed (FP4, out_packed), element k otherwise. load(i) reads input i.
template <typename Load>
FP8NORM_HD uint16_t RoundedOutput(const RoundArgs& a, int64_t k, Load load) {
  if (a.target == RoundTarget::kE2M1 && a.out_packed) {
    const uint8_t even = Fp4Code(load(2 * k));
    const uint8_t odd = 2 * k + 1 < a.count ? Fp4Code(load(2 * k + 1)) : uint8_t{0};
    return PackFp4(even, odd);
  }
  return RoundedBits(a.target, load(k));
}

// The number of output bytes (or 16-bit words) of a round call.
FP8NORM_HD int64_t RoundedOutputs(const RoundArgs& a) {
  return a.target == RoundTarget::kE2M1 && a.out_packed ? (a.count + 1) / 2 : a.count;
}

// `parallel_for(num_tasks, task)` calls task(i) once for every i in [0, num_tasks), in
// any order and on any threads, and returns when all calls have returned.
using ParallelFor = std::function<void(int64_t, const std::function<void(int64_t)>&)>;

// False when the host memory for the call's float32 rows could not be allocated; the
// outputs are then incomplete.
bool RmsNormFp8Cpu(const RmsNormFp8Args& args, const ParallelFor& parallel_for);
// Advises the whole 2 MiB pages inside a large output [p, p + bytes) onto transparent huge
// pages (cpu_kernels.cc says why); nothing for a small one or off Linux.
void AdviseHugePages(void* p, size_t bytes);
// out[j] = f32(gamma[j]) + weight_offset for j < n, gamma of float type `type`: what the
// CPU kernels normalise with, once per call.
void FillGammaPlusOffset(FloatType type, const void* gamma, float weight_offset, int64_t n,
                         float* out);
// The instruction-set variant of the CPU row loops in use: "avx2" or "baseline".
const char* CpuKernelVariant();
void RoundCpu(const RoundArgs& args);

}  // namespace fp8norm
