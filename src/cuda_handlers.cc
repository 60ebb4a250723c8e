// XLA FFI handlers for the CUDA kernels: decode and check the buffers, then enqueue the
// kernel on XLA's stream. Marked command-buffer compatible: they only enqueue
// stream-ordered work, so XLA may capture them into CUDA graphs.
#include <cuda_runtime_api.h>

#include <string>

#include "cuda_kernels.h"
#include "ffi_decode.h"
#include "handlers.h"
#include "xla/ffi/api/ffi.h"

namespace fp8norm {
namespace {

ffi::Error CudaStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("jax_fp8norm: ") + what + ": " + cudaGetErrorString(err));
}

ffi::Error RmsNormFp8Impl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer gamma,
                          ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> scales,
                          float eps, float weight_offset, float scale_ub) {
  RmsNormFp8Args args;
  ffi::Error status =
      DecodeRmsNormFp8(x, nullptr, gamma, y, scales, nullptr, eps, weight_offset, scale_ub, &args);
  if (status.failure()) return status;
  return CudaStatus(LaunchRmsNormFp8(stream, args), "rms_norm_fp8 launch");
}

ffi::Error AddRmsNormFp8Impl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer residual,
                             ffi::AnyBuffer gamma, ffi::Result<ffi::AnyBuffer> y,
                             ffi::Result<ffi::AnyBuffer> scales,
                             ffi::Result<ffi::AnyBuffer> residual_out, float eps,
                             float weight_offset, float scale_ub) {
  RmsNormFp8Args args;
  ffi::Error status = DecodeRmsNormFp8(x, &residual, gamma, y, scales, &residual_out, eps,
                                       weight_offset, scale_ub, &args);
  if (status.failure()) return status;
  return CudaStatus(LaunchRmsNormFp8(stream, args), "add_rms_norm_fp8 launch");
}

ffi::Error RoundImpl(cudaStream_t stream, ffi::AnyBuffer in, ffi::Result<ffi::AnyBuffer> out) {
  RoundArgs args;
  ffi::Error status = DecodeRound(in, out, &args);
  if (status.failure()) return status;
  return CudaStatus(LaunchRound(stream, args), "round launch");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kRmsNormFp8Cuda, RmsNormFp8Impl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Arg<ffi::AnyBuffer>()  // x
                           .Arg<ffi::AnyBuffer>()  // gamma
                           .Ret<ffi::AnyBuffer>()  // y
                           .Ret<ffi::AnyBuffer>()  // scales
                           .Attr<float>("eps")
                           .Attr<float>("weight_offset")
                           .Attr<float>("scale_ub"),
                       {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER(kAddRmsNormFp8Cuda, AddRmsNormFp8Impl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Arg<ffi::AnyBuffer>()  // x
                           .Arg<ffi::AnyBuffer>()  // residual
                           .Arg<ffi::AnyBuffer>()  // gamma
                           .Ret<ffi::AnyBuffer>()  // y
                           .Ret<ffi::AnyBuffer>()  // scales
                           .Ret<ffi::AnyBuffer>()  // residual_out
                           .Attr<float>("eps")
                           .Attr<float>("weight_offset")
                           .Attr<float>("scale_ub"),
                       {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER(kRoundCuda, RoundImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Arg<ffi::AnyBuffer>()
                           .Ret<ffi::AnyBuffer>(),
                       {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_Error* RmsNormFp8CudaHandler(XLA_FFI_CallFrame* call_frame) {
  return kRmsNormFp8Cuda(call_frame);
}
XLA_FFI_Error* AddRmsNormFp8CudaHandler(XLA_FFI_CallFrame* call_frame) {
  return kAddRmsNormFp8Cuda(call_frame);
}
XLA_FFI_Error* RoundCudaHandler(XLA_FFI_CallFrame* call_frame) { return kRoundCuda(call_frame); }

}  // namespace fp8norm
