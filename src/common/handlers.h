// The XLA FFI handlers of jax_fp8norm, one per op and platform. The nanobind modules
// only hand these to Python for registration. They are C symbols (XLA's handler-symbol
// macros), hidden in each module (nanobind builds with hidden visibility): the CUDA
// module and the emulation's both define the CUDA ones, so the two must never be linked
// into one binary.
#pragma once

#include "xla/ffi/api/api.h"

namespace fp8norm {

XLA_FFI_DECLARE_HANDLER_SYMBOL(RmsNormFp8CpuHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AddRmsNormFp8CpuHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(RoundCpuHandler);
// The backward.
XLA_FFI_DECLARE_HANDLER_SYMBOL(RmsNormBackwardCpuHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AddRmsNormBackwardCpuHandler);
// The weight's quantiser (src/common/quantize_weight.h).
XLA_FFI_DECLARE_HANDLER_SYMBOL(QuantizeWeightCpuHandler);
// The output gradient's FP4 quantiser (quantize_gradient.h).
XLA_FFI_DECLARE_HANDLER_SYMBOL(QuantizeGradientCpuHandler);

XLA_FFI_DECLARE_HANDLER_SYMBOL(RmsNormFp8CudaHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AddRmsNormFp8CudaHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(RoundCudaHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(RmsNormBackwardCudaHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AddRmsNormBackwardCudaHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(QuantizeWeightCudaHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(QuantizeGradientCudaHandler);
// The one-kernel all-reduce (no CPU kernel: the CPU backend's all-reduce is XLA's) and its
// set-up, which runs in the stage before execution, as PrepareCudaHandler.
XLA_FFI_DECLARE_HANDLER_SYMBOL(AllReduceNormCudaHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(SetUpAllReduceCudaHandler);
// The stage before execution of every CUDA target (src/cuda/gpu_platform.h's
// kPrepareStage): the device's one-time preparation.
XLA_FFI_DECLARE_HANDLER_SYMBOL(PrepareCudaHandler);

}  // namespace fp8norm
