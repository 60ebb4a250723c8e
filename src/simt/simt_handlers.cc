// The emulated CUDA FFI handlers: the CUDA handlers (cuda_handlers.cc, compiled into this
// module by the host compiler against the SIMT emulation's runtime: the same decoding,
// driver check, device guard and launch calls), each run with the call's buffers
// registered as the launch's global memory, on XLA's CPU backend.
#include "simt_handlers.h"

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string_view>
#include <vector>

#include "handlers.h"
#include "simt.h"
#include "xla/ffi/api/ffi.h"

namespace fp8norm {
namespace {

std::atomic<bool> capture_calls{false};
std::atomic<uint64_t> stale_errors{0};

// Runs `handler` with every buffer of the call frame registered as the launch's global
// memory, under the names of the op's arguments and results: an access outside them
// fails the launch, and the accounting reports per buffer.
//
// Also, as tests ask: the call runs as if inside CUDA graph capture (set_capture), and a
// runtime error the handler leaves set for a later call is counted (stale_errors).

XLA_FFI_Error* CountingStaleErrors(XLA_FFI_CallFrame* frame, XLA_FFI_Handler* handler) {
  XLA_FFI_Error* error = handler(frame);
  if (cudaPeekAtLastError() != cudaSuccess) {
    stale_errors += 1;
    cudaGetLastError();
  }
  return error;
}

// The bool attribute `name` of the call (false where it has none): the norm's form,
// which names its results.
bool FlagAttribute(const XLA_FFI_CallFrame* frame, std::string_view name) {
  for (int64_t i = 0; i < frame->attrs.size; ++i) {
    const XLA_FFI_ByteSpan* attribute = frame->attrs.names[i];
    if (frame->attrs.types[i] != XLA_FFI_AttrType_SCALAR ||
        std::string_view(attribute->ptr, attribute->len) != name) {
      continue;
    }
    const auto* scalar = static_cast<const XLA_FFI_Scalar*>(frame->attrs.attrs[i]);
    return scalar->dtype == XLA_FFI_DataType_PRED && *static_cast<const bool*>(scalar->value);
  }
  return false;
}

// The norm's results in order, as its form (NormAttributes) has them.
std::vector<const char*> NormResultNames(const XLA_FFI_CallFrame* frame, bool add) {
  std::vector<const char*> names = {"y", "scales"};
  if (add) names.push_back("residual_out");
  if (FlagAttribute(frame, "with_inverse_rms")) names.push_back("inverse_rms");
  if (FlagAttribute(frame, "with_amax")) names.push_back("amax");
  const bool per_row = FlagAttribute(frame, "per_row_global_scale");
  if (per_row) names.push_back("global_scales");
  if (FlagAttribute(frame, "columnwise")) {
    names.insert(names.end(), {"y_t", "scales_t"});
    if (per_row) names.push_back("global_scales_t");
  }
  return names;
}

XLA_FFI_Error* WithBuffers(XLA_FFI_CallFrame* frame, XLA_FFI_Handler* handler,
                           std::initializer_list<const char*> arg_names,
                           const std::vector<const char*>& ret_names) {
  std::optional<simt::ScopedCapture> capture;
  if (capture_calls.load()) capture.emplace();
  simt::ScopedBuffers buffers;
  const auto add = [&](const auto& names, int64_t count, const auto* types,
                       void* const* buffers_of) {
    auto name = names.begin();
    for (int64_t i = 0; i < count; ++i, ++name) {
      if (name == names.end()) return;
      if (static_cast<int>(types[i]) != XLA_FFI_ArgType_BUFFER) continue;
      const auto* buffer = static_cast<const XLA_FFI_Buffer*>(buffers_of[i]);
      const auto dtype = static_cast<xla::ffi::DataType>(buffer->dtype);
      size_t elements = 1;
      for (int64_t d = 0; d < buffer->rank; ++d) elements *= static_cast<size_t>(buffer->dims[d]);
      // XLA's CPU backend packs float4_e2m1fn two per byte (docs/spec.md), while the FFI
      // header's ByteWidth counts one byte: the buffer's true size, so that the emulation
      // refuses a write past it.
      const size_t bytes = dtype == xla::ffi::DataType::F4E2M1FN
                               ? (elements + 1) / 2
                               : elements * xla::ffi::ByteWidth(dtype);
      buffers.Add(*name, buffer->data, bytes);
    }
  };
  add(arg_names, frame->args.size, frame->args.types, frame->args.args);
  add(ret_names, frame->rets.size, frame->rets.types, frame->rets.rets);
  return CountingStaleErrors(frame, handler);
}

}  // namespace

XLA_FFI_Error* SimtPrepareHandler(XLA_FFI_CallFrame* frame) {
  return CountingStaleErrors(frame, fp8norm::PrepareCudaHandler);
}
XLA_FFI_Error* SimtRmsNormFp8Handler(XLA_FFI_CallFrame* frame) {
  return WithBuffers(frame, fp8norm::RmsNormFp8CudaHandler, {"x", "gamma", "scale_operand"},
                     NormResultNames(frame, false));
}
XLA_FFI_Error* SimtAddRmsNormFp8Handler(XLA_FFI_CallFrame* frame) {
  return WithBuffers(frame, fp8norm::AddRmsNormFp8CudaHandler,
                     {"x", "residual", "gamma", "scale_operand"}, NormResultNames(frame, true));
}
XLA_FFI_Error* SimtRmsNormBackwardHandler(XLA_FFI_CallFrame* frame) {
  return WithBuffers(frame, fp8norm::RmsNormBackwardCudaHandler,
                     {"dn", "x", "gamma", "inverse_rms"}, {"dx", "dgamma"});
}
XLA_FFI_Error* SimtAddRmsNormBackwardHandler(XLA_FFI_CallFrame* frame) {
  return WithBuffers(frame, fp8norm::AddRmsNormBackwardCudaHandler,
                     {"dn", "d_residual_out", "x", "residual", "gamma", "inverse_rms"},
                     {"dx", "dresidual", "dgamma"});
}
XLA_FFI_Error* SimtAllReduceNormHandler(XLA_FFI_CallFrame* frame) {
  return WithBuffers(frame, fp8norm::AllReduceNormCudaHandler,
                     {"x", "residual", "gamma", "scale_operand"}, {"y", "scales", "residual_out"});
}
XLA_FFI_Error* SimtSetUpAllReduceHandler(XLA_FFI_CallFrame* frame) {
  return CountingStaleErrors(frame, fp8norm::SetUpAllReduceCudaHandler);
}
XLA_FFI_Error* SimtRoundHandler(XLA_FFI_CallFrame* frame) {
  return WithBuffers(frame, fp8norm::RoundCudaHandler, {"in"}, {"out"});
}
XLA_FFI_Error* SimtQuantizeWeightHandler(XLA_FFI_CallFrame* frame) {
  return WithBuffers(frame, fp8norm::QuantizeWeightCudaHandler, {"w"},
                     {"codes", "scales", "global_scale"});
}
XLA_FFI_Error* SimtQuantizeGradientHandler(XLA_FFI_CallFrame* frame) {
  return WithBuffers(frame, fp8norm::QuantizeGradientCudaHandler, {"g", "key"},
                     {"codes", "scales", "global_scales"});
}

void SetCaptureCalls(bool on) { capture_calls = on; }
uint64_t StaleErrors() { return stale_errors.load(); }

}  // namespace fp8norm
