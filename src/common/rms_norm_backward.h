// Arguments of one backward call of rms_norm_fp8 / add_rms_norm_fp8 (docs/spec.md,
// "Training: the backward pass") and the CPU kernel's entry point. Plain C++, shared by
// the FFI handlers and the kernels.
#pragma once

#include <cstdint>

#include "backward_math.h"
#include "rms_norm_fp8.h"

namespace fp8norm {

struct RmsNormBackwardArgs {
  const void* dn;              // [rows, hidden], dn_type: the cotangent of n
  const void* x;               // [rows, hidden], input_type
  const void* residual;        // [rows, hidden], residual_type; null for rms_norm_fp8
  const void* d_residual_out;  // [rows, hidden], residual_type; null when residual is
  const void* gamma;           // [hidden], gamma_type
  const float* inverse_rms;    // [rows]: each row's r, as the training forward saved it
  void* dx;                    // [rows, hidden], input_type
  void* dresidual;             // [rows, hidden], residual_type; null when residual is
  float* dgamma;               // [hidden] float32
  int64_t rows;
  int64_t hidden;
  FloatType dn_type;
  FloatType input_type;
  FloatType residual_type;
  FloatType gamma_type;
  float weight_offset;  // f32(T(weight_offset))
};

// False when host memory for the call's accumulators could not be had; the outputs are
// then incomplete.
bool RmsNormBackwardCpu(const RmsNormBackwardArgs& args, const ParallelFor& parallel_for);

// How many rows each of the CPU kernel's tasks takes in a call of `rows` x `hidden`: the
// split of dgamma's exact partials, which the tests force and read to show that its bits
// do not depend on it.
int64_t CpuBackwardRowsPerTask(int64_t rows, int64_t hidden);

}  // namespace fp8norm
