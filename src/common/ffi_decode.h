// Turns the buffers and attributes XLA hands an FFI handler into RmsNormFp8Args, checking
// every shape, dtype and constant on the way. Shared by the CPU and CUDA handlers; the
// Python wrapper validates first, so these checks only fire for a caller that bypasses it.
#pragma once

#include "rms_norm_fp8.h"
#include "xla/ffi/api/ffi.h"

namespace fp8norm {

namespace ffi = ::xla::ffi;

// `residual` and `residual_out` are null for rms_norm_fp8.
ffi::Error DecodeRmsNormFp8(const ffi::AnyBuffer& x, const ffi::AnyBuffer* residual,
                            const ffi::AnyBuffer& gamma, ffi::Result<ffi::AnyBuffer>& y,
                            ffi::Result<ffi::AnyBuffer>& scales,
                            ffi::Result<ffi::AnyBuffer>* residual_out, float eps,
                            float weight_offset, float scale_ub, RmsNormFp8Args* args);

ffi::Error DecodeRound(const ffi::AnyBuffer& in, ffi::Result<ffi::AnyBuffer>& out, RoundArgs* args);

}  // namespace fp8norm
