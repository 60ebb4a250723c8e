// The emulated CUDA FFI handlers (simt_handlers.cc) and the test controls of their calls.
#pragma once

#include <cstdint>

#include "xla/ffi/api/c_api.h"

namespace fp8norm {

XLA_FFI_Error* SimtPrepareHandler(XLA_FFI_CallFrame* frame);
XLA_FFI_Error* SimtRmsNormFp8Handler(XLA_FFI_CallFrame* frame);
XLA_FFI_Error* SimtAddRmsNormFp8Handler(XLA_FFI_CallFrame* frame);
XLA_FFI_Error* SimtRoundHandler(XLA_FFI_CallFrame* frame);
XLA_FFI_Error* SimtQuantizeWeightHandler(XLA_FFI_CallFrame* frame);
XLA_FFI_Error* SimtRmsNormBackwardHandler(XLA_FFI_CallFrame* frame);
XLA_FFI_Error* SimtAddRmsNormBackwardHandler(XLA_FFI_CallFrame* frame);
XLA_FFI_Error* SimtQuantizeGradientHandler(XLA_FFI_CallFrame* frame);
XLA_FFI_Error* SimtAllReduceNormHandler(XLA_FFI_CallFrame* frame);
XLA_FFI_Error* SimtSetUpAllReduceHandler(XLA_FFI_CallFrame* frame);

// Later calls run as if inside CUDA graph capture (on) or not.
void SetCaptureCalls(bool on);
// Calls whose handler left a CUDA runtime error set for a later call.
uint64_t StaleErrors();

}  // namespace fp8norm
