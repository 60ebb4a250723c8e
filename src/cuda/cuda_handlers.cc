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
// The SIMT emulation's module compiles this file too, against its own runtime, so that the
// same handlers run the emulated kernels on XLA's CPU backend; what differs between the
// two is in gpu_platform.h.
#include <cuda_runtime_api.h>

#include <optional>
#include <string>
#include <vector>

#include "cuda_driver_check.h"
#include "cuda_kernels.h"
#include "ffi_decode.h"
#include "gpu_platform.h"
#include "handlers.h"
#include "peer_allreduce.h"
#include "peer_workspaces.h"
#include "quantize_gradient_ffi.h"
#include "xla/ffi/api/ffi.h"

namespace fp8norm {

// The one-kernel all-reduce's attributes (jax_fp8norm/_primitives.py writes them), which
// both its stages take: the norm's, then the call site, every group's devices (group
// after group), the devices per group, the method (an AllReduceMethod), and the rows and
// hidden size the workspaces are laid out for.
struct AllReduceAttributes {
  NormAttributes norm;
  int64_t call_site;
  ffi::Span<const int64_t> devices;
  int64_t group_devices;
  int64_t method;
  int64_t rows;
  int64_t hidden;
};

}  // namespace fp8norm

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    fp8norm::AllReduceAttributes, FP8NORM_NORM_ATTRIBUTE_MEMBERS,
    ::xla::ffi::StructMember<int64_t>("call_site"),
    ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("devices"),
    ::xla::ffi::StructMember<int64_t>("group_devices"), ::xla::ffi::StructMember<int64_t>("method"),
    ::xla::ffi::StructMember<int64_t>("rows"), ::xla::ffi::StructMember<int64_t>("hidden"));

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

ffi::Error RunNorm(const GpuTarget& gpu, const char* what, const RmsNormFp8Args& args) {
  return RunOnDevice(gpu.device, what,
                     [&](int d) { return LaunchRmsNormFp8(gpu.stream, d, args); });
}

ffi::Error RmsNormFp8Impl(GpuTarget gpu, ffi::AnyBuffer x, ffi::AnyBuffer gamma,
                          std::optional<ffi::AnyBuffer> scale_operand,
                          ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> scales,
                          ffi::RemainingRets form_results, NormAttributes attributes) {
  RmsNormFp8Args args;
  const ffi::Error status = DecodeNormForm(x, nullptr, gamma, scale_operand, y, scales, nullptr,
                                           form_results, attributes, &args);
  if (status.failure()) return status;
  return RunNorm(gpu, "rms_norm_fp8 launch", args);
}

ffi::Error AddRmsNormFp8Impl(GpuTarget gpu, ffi::AnyBuffer x, ffi::AnyBuffer residual,
                             ffi::AnyBuffer gamma, std::optional<ffi::AnyBuffer> scale_operand,
                             ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> scales,
                             ffi::Result<ffi::AnyBuffer> residual_out,
                             ffi::RemainingRets form_results, NormAttributes attributes) {
  RmsNormFp8Args args;
  const ffi::Error status = DecodeNormForm(x, &residual, gamma, scale_operand, y, scales,
                                           &residual_out, form_results, attributes, &args);
  if (status.failure()) return status;
  return RunNorm(gpu, "add_rms_norm_fp8 launch", args);
}

ffi::Error RmsNormBackwardImpl(GpuTarget gpu, ffi::AnyBuffer dn, ffi::AnyBuffer x,
                               ffi::AnyBuffer gamma, ffi::AnyBuffer inverse_rms,
                               ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dgamma,
                               float weight_offset) {
  RmsNormBackwardArgs args;
  ffi::Error status = DecodeRmsNormBackward(dn, nullptr, x, nullptr, gamma, inverse_rms, dx,
                                            nullptr, dgamma, weight_offset, &args);
  if (status.failure()) return status;
  return RunOnDevice(gpu.device, "rms_norm_backward launch",
                     [&](int) { return LaunchRmsNormBackward(gpu.stream, args); });
}

ffi::Error AddRmsNormBackwardImpl(GpuTarget gpu, ffi::AnyBuffer dn, ffi::AnyBuffer d_residual_out,
                                  ffi::AnyBuffer x, ffi::AnyBuffer residual, ffi::AnyBuffer gamma,
                                  ffi::AnyBuffer inverse_rms, ffi::Result<ffi::AnyBuffer> dx,
                                  ffi::Result<ffi::AnyBuffer> dresidual,
                                  ffi::Result<ffi::AnyBuffer> dgamma, float weight_offset) {
  RmsNormBackwardArgs args;
  ffi::Error status = DecodeRmsNormBackward(dn, &d_residual_out, x, &residual, gamma, inverse_rms,
                                            dx, &dresidual, dgamma, weight_offset, &args);
  if (status.failure()) return status;
  return RunOnDevice(gpu.device, "add_rms_norm_backward launch",
                     [&](int) { return LaunchRmsNormBackward(gpu.stream, args); });
}

ffi::Error RoundImpl(GpuTarget gpu, ffi::AnyBuffer in, ffi::Result<ffi::AnyBuffer> out,
                     int64_t fp4_layout) {
  RoundArgs args;
  ffi::Error status = DecodeRound(in, out, fp4_layout, &args);
  if (status.failure()) return status;
  return RunOnDevice(gpu.device, "round launch",
                     [&](int) { return LaunchRound(gpu.stream, args); });
}

ffi::Error QuantizeWeightImpl(GpuTarget gpu, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> codes,
                              ffi::Result<ffi::AnyBuffer> scales,
                              ffi::Result<ffi::AnyBuffer> global_scale, int64_t format,
                              int64_t block, int64_t fp4_layout) {
  QuantizeWeightArgs args;
  ffi::Error status =
      DecodeQuantizeWeight(w, codes, scales, global_scale, format, block, fp4_layout, &args);
  if (status.failure()) return status;
  return RunOnDevice(gpu.device, "quantize_weight launch",
                     [&](int) { return LaunchQuantizeWeight(gpu.stream, args); });
}

ffi::Error QuantizeGradientImpl(GpuTarget gpu, ffi::AnyBuffer g, ffi::AnyBuffer key,
                                ffi::Result<ffi::AnyBuffer> codes,
                                ffi::Result<ffi::AnyBuffer> scales,
                                ffi::Result<ffi::AnyBuffer> global_scales, bool nvfp4,
                                int64_t block, bool columns, bool stochastic, int64_t hadamard_mask,
                                int64_t fp4_layout) {
  QuantizeGradientArgs args;
  const ffi::Error status =
      DecodeQuantizeGradient(g, key, codes, scales, global_scales,
                             {nvfp4, block, columns, stochastic, hadamard_mask, fp4_layout}, &args);
  if (status.failure()) return status;
  return RunOnDevice(gpu.device, "quantize_gradient launch",
                     [&](int) { return LaunchQuantizeGradient(gpu.stream, args); });
}

// What the all-reduce's attributes say about the call (AllReduceAttributes, checked): the
// call site, every group's devices (group after group), the devices per group, the
// method, and the rows and hidden size the workspaces are laid out for.
struct AllReduceCall {
  int64_t call_site;
  std::vector<int64_t> devices;
  int devices_per_group;
  AllReduceMethod method;
  int64_t rows;
  int64_t hidden;
  PeerWorkspaceLayout layout;
};

ffi::Error DecodeAllReduceCall(const AllReduceAttributes& attrs, AllReduceCall* call) {
  if (attrs.group_devices < 1 || attrs.group_devices > kMaxPeers || attrs.devices.size() == 0 ||
      attrs.devices.size() % attrs.group_devices != 0) {
    return ffi::Error::InvalidArgument("jax_fp8norm: the all-reduce's groups must have 1 to " +
                                       std::to_string(kMaxPeers) + " devices each");
  }
  if (attrs.method != static_cast<int64_t>(AllReduceMethod::kOneShot) &&
      attrs.method != static_cast<int64_t>(AllReduceMethod::kTwoShot)) {
    return ffi::Error::InvalidArgument("jax_fp8norm: unknown all-reduce method " +
                                       std::to_string(attrs.method));
  }
  if (attrs.rows < 0 || attrs.hidden < 1) {
    return ffi::Error::InvalidArgument("jax_fp8norm: the all-reduce's rows and hidden size");
  }
  call->call_site = attrs.call_site;
  call->devices.assign(attrs.devices.begin(), attrs.devices.end());
  call->devices_per_group = static_cast<int>(attrs.group_devices);
  call->method = static_cast<AllReduceMethod>(attrs.method);
  call->rows = attrs.rows;
  call->hidden = attrs.hidden;
  call->layout = LayOutPeerWorkspace(call->rows, call->hidden, call->method);
  return ffi::Error::Success();
}

// Set-up stage of the one-kernel all-reduce: every device's workspace of the call site, in
// the stage before execution, as PrepareCudaHandler (gpu_platform.h).
ffi::Error SetUpAllReduceImpl(AllReduceAttributes attrs) {
  AllReduceCall call;
  ffi::Error status = DecodeAllReduceCall(attrs, &call);
  if (status.failure()) return status;
  status = CheckCudaDriver();
  if (status.failure()) return status;
  std::string what;
  const cudaError_t err =
      SetUpPeerGroups(call.call_site, call.devices, call.devices_per_group, call.layout, &what);
  if (err != cudaSuccess) cudaGetLastError();
  return CudaStatus(err, what.c_str());
}

ffi::Error AllReduceNormImpl(GpuTarget gpu, ffi::AnyBuffer x, ffi::AnyBuffer residual,
                             ffi::AnyBuffer gamma, std::optional<ffi::AnyBuffer> scale_operand,
                             ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> scales,
                             ffi::Result<ffi::AnyBuffer> residual_out, AllReduceAttributes attrs) {
  AllReduceCall call;
  ffi::Error status = DecodeAllReduceCall(attrs, &call);
  if (status.failure()) return status;
  RmsNormFp8Args norm;
  status = DecodeRmsNormFp8(x, &residual, gamma, scale_operand, y, scales, &residual_out,
                            attrs.norm, &norm);
  if (status.failure()) return status;
  if (norm.rows != call.rows || norm.hidden != call.hidden) {
    return ffi::Error::InvalidArgument(
        "jax_fp8norm: the all-reduce's buffers do not have the rows and hidden size its "
        "workspace was laid out for");
  }
  int position = 0;
  const PeerGroup* group =
      FindPeerGroup(call.call_site, call.devices, call.layout, gpu.device, &position);
  if (group == nullptr) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "jax_fp8norm: device " + std::to_string(gpu.device) +
                          " has no all-reduce workspace for this call (its set-up stage did "
                          "not run for it, or the device is not in the call's groups)");
  }
  AllReduceArgs args{};
  args.norm = norm;
  args.norm.x = group->workspaces[position] + group->layout.reduced;
  args.norm.input_type = FloatType::kF32;
  args.partial = norm.x;
  args.partial_type = norm.input_type;
  args.y = norm.y;
  args.scales = norm.scales;
  args.residual_out = norm.residual_out;
  args.y_row_bytes = YByte(norm, norm.hidden);
  args.scale_row_bytes = GroupsPerRow(norm) * static_cast<int64_t>(FloatTypeBytes(norm.scale_type));
  args.residual_row_bytes = norm.hidden * static_cast<int64_t>(FloatTypeBytes(norm.residual_type));
  for (size_t p = 0; p < group->devices.size(); ++p) args.workspaces[p] = group->workspaces[p];
  args.layout = group->layout;
  args.num_devices = static_cast<int32_t>(group->devices.size());
  args.position = position;
  args.method = call.method;
  return RunOnDevice(gpu.device, "allreduce_residual_rms_norm_fp8 launch", [&](int) {
    return LaunchAllReduceNorm(gpu.stream, args, group->key, group->max_blocks);
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RmsNormFp8CudaHandler, RmsNormFp8Impl, RmsNormFp8Binding<CallGpu>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(AddRmsNormFp8CudaHandler, AddRmsNormFp8Impl,
                              AddRmsNormFp8Binding<CallGpu>(), {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(RmsNormBackwardCudaHandler, RmsNormBackwardImpl,
                              RmsNormBackwardBinding<CallGpu>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(AddRmsNormBackwardCudaHandler, AddRmsNormBackwardImpl,
                              AddRmsNormBackwardBinding<CallGpu>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    RoundCudaHandler, RoundImpl,
    ffi::Ffi::Bind().Ctx<CallGpu>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Attr<int64_t>(
        "fp4_layout"),
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizeWeightCudaHandler, QuantizeWeightImpl,
                              QuantizeWeightBinding<CallGpu>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizeGradientCudaHandler, QuantizeGradientImpl,
                              QuantizeGradientBinding<CallGpu>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(AllReduceNormCudaHandler, AllReduceNormImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<PeerGpu>()
                                  .Arg<ffi::AnyBuffer>()          // x: this device's partial
                                  .Arg<ffi::AnyBuffer>()          // residual
                                  .Arg<ffi::AnyBuffer>()          // gamma
                                  .OptionalArg<ffi::AnyBuffer>()  // static or global scale
                                  .Ret<ffi::AnyBuffer>()          // y
                                  .Ret<ffi::AnyBuffer>()          // scales
                                  .Ret<ffi::AnyBuffer>()          // residual_out
                                  .Attrs<AllReduceAttributes>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(PrepareCudaHandler, PrepareImpl, BindPrepareStage().Ctx<CallGpu>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(SetUpAllReduceCudaHandler, SetUpAllReduceImpl,
                              BindPrepareStage().Attrs<AllReduceAttributes>());

}  // namespace fp8norm
