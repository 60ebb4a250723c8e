// XLA FFI handlers for the CUDA kernels: decode and check the buffers, then enqueue the
// kernel on XLA's stream. Marked command-buffer compatible: they only enqueue
// stream-ordered work, so XLA may capture them into CUDA graphs. The one-time work that
// is not stream-ordered (loading the kernels, setting their attributes) runs in the
// initialize stage, before any capture.
//
// Which GPU: in a process that drives several GPUs (tensor parallelism), each call runs
// for the device XLA passes as the FFI DeviceOrdinal, whose stream it gets. The handlers
// make that device current for the launch (and restore the caller's), and the launch
// reads that device's shared-memory limit, so neither depends on which device the
// calling thread happened to have current.
//
// The SIMT emulation compiles this file too (src/simt/simt_handlers.cc), against its own
// runtime, so that the same handlers run the emulated kernels on XLA's CPU backend.
#include <cuda_runtime_api.h>

#include <optional>
#include <string>

#include "cuda_driver_check.h"
#include "cuda_kernels.h"
#include "ffi_decode.h"
#include "handlers.h"
#include "xla/ffi/api/ffi.h"

namespace fp8norm {

// Where a call's kernels go: XLA's stream for the call and the GPU it belongs to.
struct GpuTarget {
  cudaStream_t stream;
  int32_t device;
};

}  // namespace fp8norm

template <>
struct xla::ffi::CtxDecoding<fp8norm::GpuTarget> {
  using Type = fp8norm::GpuTarget;
  static std::optional<Type> Decode(const XLA_FFI_Api* api, XLA_FFI_ExecutionContext* ctx,
                                    DiagnosticEngine& diagnostic) {
#if defined(FP8NORM_SIMT)
    // The CPU backend has no stream: the emulated device runs each launch to completion
    // on the calling thread.
    return Type{nullptr, 0};
#else
    const auto stream = CtxDecoding<PlatformStream<cudaStream_t> >::Decode(api, ctx, diagnostic);
    const auto device = CtxDecoding<DeviceOrdinal>::Decode(api, ctx, diagnostic);
    if (!stream.has_value() || !device.has_value()) return std::nullopt;
    return Type{*stream, *device};
#endif
  }
};

namespace fp8norm {
namespace {

ffi::Error CudaStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("jax_fp8norm: ") + what + ": " + cudaGetErrorString(err));
}

// The driver against the runtime this module links, once per process: a driver too old
// otherwise fails the first launch with a message that names neither version.
ffi::Error CheckCudaDriver() {
  static const std::string problem = [] {
    int runtime_version = 0;
    int driver_version = 0;
    cudaRuntimeGetVersion(&runtime_version);
    if (cudaDriverGetVersion(&driver_version) != cudaSuccess) driver_version = 0;
    cudaGetLastError();  // a failed query must not fail a later launch's error check
    return CudaDriverProblem(runtime_version, driver_version);
  }();
  if (problem.empty()) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition, problem);
}

// Makes `device` current for the lifetime of the guard and restores the previous one;
// no runtime call beyond cudaGetDevice when it already is current (the usual case).
class ScopedDevice {
 public:
  explicit ScopedDevice(int device) {
    status_ = cudaGetDevice(&previous_);
    if (status_ == cudaSuccess && previous_ != device) {
      status_ = cudaSetDevice(device);
      switched_ = status_ == cudaSuccess;
    }
    if (status_ != cudaSuccess) cudaGetLastError();  // the error is returned, not left set
  }
  ~ScopedDevice() {
    if (switched_) cudaSetDevice(previous_);
  }
  cudaError_t status() const { return status_; }

 private:
  int previous_ = 0;
  bool switched_ = false;
  cudaError_t status_;
};

template <typename Launch>
ffi::Error RunOnDevice(int32_t device, const char* what, Launch launch) {
  ffi::Error status = CheckCudaDriver();
  if (status.failure()) return status;
  ScopedDevice current(device);
  if (current.status() != cudaSuccess) return CudaStatus(current.status(), "selecting the GPU");
  const cudaError_t err = launch(device);
  if (err != cudaSuccess) cudaGetLastError();  // returned, not left for the next caller
  return CudaStatus(err, what);
}

// Initialize stage: XLA runs it for each executable on each device before the first
// execution, and before it records any command buffer (CUDA graph) of the call; the
// instantiate stage would be too early, as it knows no device.
ffi::Error PrepareImpl(GpuTarget gpu) {
  return RunOnDevice(gpu.device, "preparing the CUDA kernels", PrepareDevice);
}

ffi::Error RmsNormFp8Impl(GpuTarget gpu, ffi::AnyBuffer x, ffi::AnyBuffer gamma,
                          std::optional<ffi::AnyBuffer> scale_operand,
                          ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> scales,
                          NormAttributes attributes) {
  RmsNormFp8Args args;
  ffi::Error status =
      DecodeRmsNormFp8(x, nullptr, gamma, scale_operand, y, scales, nullptr, attributes, &args);
  if (status.failure()) return status;
  return RunOnDevice(gpu.device, "rms_norm_fp8 launch",
                     [&](int d) { return LaunchRmsNormFp8(gpu.stream, d, args); });
}

ffi::Error AddRmsNormFp8Impl(GpuTarget gpu, ffi::AnyBuffer x, ffi::AnyBuffer residual,
                             ffi::AnyBuffer gamma, std::optional<ffi::AnyBuffer> scale_operand,
                             ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> scales,
                             ffi::Result<ffi::AnyBuffer> residual_out, NormAttributes attributes) {
  RmsNormFp8Args args;
  ffi::Error status = DecodeRmsNormFp8(x, &residual, gamma, scale_operand, y, scales, &residual_out,
                                       attributes, &args);
  if (status.failure()) return status;
  return RunOnDevice(gpu.device, "add_rms_norm_fp8 launch",
                     [&](int d) { return LaunchRmsNormFp8(gpu.stream, d, args); });
}

ffi::Error RoundImpl(GpuTarget gpu, ffi::AnyBuffer in, ffi::Result<ffi::AnyBuffer> out,
                     int64_t fp4_layout) {
  RoundArgs args;
  ffi::Error status = DecodeRound(in, out, fp4_layout, &args);
  if (status.failure()) return status;
  return RunOnDevice(gpu.device, "round launch",
                     [&](int) { return LaunchRound(gpu.stream, args); });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RmsNormFp8CudaHandler, RmsNormFp8Impl, RmsNormFp8Binding<GpuTarget>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(AddRmsNormFp8CudaHandler, AddRmsNormFp8Impl,
                              AddRmsNormFp8Binding<GpuTarget>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    RoundCudaHandler, RoundImpl,
    ffi::Ffi::Bind().Ctx<GpuTarget>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Attr<int64_t>(
        "fp4_layout"),
    {ffi::Traits::kCmdBufferCompatible});

#if defined(FP8NORM_SIMT)
XLA_FFI_DEFINE_HANDLER_SYMBOL(PrepareCudaHandler, PrepareImpl,
                              ffi::Ffi::BindInstantiate().Ctx<GpuTarget>());
#else
XLA_FFI_DEFINE_HANDLER_SYMBOL(PrepareCudaHandler, PrepareImpl,
                              ffi::Ffi::BindInitialize().Ctx<GpuTarget>());
#endif

}  // namespace fp8norm
