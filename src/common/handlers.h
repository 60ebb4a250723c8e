// The XLA FFI handlers of jax_fp8norm, one per op and platform. The nanobind modules
// only hand these to Python for registration.
#pragma once

#include "xla/ffi/api/c_api.h"

namespace fp8norm {

XLA_FFI_Error* RmsNormFp8CpuHandler(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* AddRmsNormFp8CpuHandler(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* RoundCpuHandler(XLA_FFI_CallFrame* call_frame);

XLA_FFI_Error* RmsNormFp8CudaHandler(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* AddRmsNormFp8CudaHandler(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* RoundCudaHandler(XLA_FFI_CallFrame* call_frame);
// The instantiate stage of every CUDA target: the device's one-time preparation.
XLA_FFI_Error* PrepareCudaHandler(XLA_FFI_CallFrame* call_frame);

}  // namespace fp8norm
