// Python module of the SIMT emulation (docs/simt.md): the CUDA handlers and kernels run on
// the CPU, registered for platform "cpu" under their own target names, the emulated
// device's controls and memory accounting, and the CUDA path's host logic with injected
// values (cuda_host_bindings.h), for tests.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <atomic>
#include <cstdint>
#include <optional>

#include "cuda_host_bindings.h"
#include "cuda_kernels.h"
#include "ffi_registrations.h"
#include "handlers.h"
#include "kernel_variant_bindings.h"
#include "simt.h"
#include "xla/ffi/api/ffi.h"

namespace {

// Runs `handler` with every buffer of the call frame registered as the launch's global
// memory, under the names of the op's arguments and results: an access outside them
// fails the launch, and the accounting reports per buffer.
//
// Also, as tests ask: the call runs as if inside CUDA graph capture (set_capture), and a
// runtime error the handler leaves set for a later call is counted (stale_errors).
std::atomic<bool> capture_calls{false};
std::atomic<uint64_t> stale_errors{0};

XLA_FFI_Error* CountingStaleErrors(XLA_FFI_CallFrame* frame, XLA_FFI_Handler* handler) {
  XLA_FFI_Error* error = handler(frame);
  if (cudaPeekAtLastError() != cudaSuccess) {
    stale_errors += 1;
    cudaGetLastError();
  }
  return error;
}

XLA_FFI_Error* WithBuffers(XLA_FFI_CallFrame* frame, XLA_FFI_Handler* handler,
                           std::initializer_list<const char*> arg_names,
                           std::initializer_list<const char*> ret_names) {
  std::optional<simt::ScopedCapture> capture;
  if (capture_calls.load()) capture.emplace();
  simt::ScopedBuffers buffers;
  const auto add = [&](std::initializer_list<const char*> names, int64_t count, const auto* types,
                       void* const* buffers_of) {
    auto name = names.begin();
    for (int64_t i = 0; i < count; ++i, ++name) {
      if (name == names.end()) return;
      if (static_cast<int>(types[i]) != XLA_FFI_ArgType_BUFFER) continue;
      const auto* buffer = static_cast<const XLA_FFI_Buffer*>(buffers_of[i]);
      size_t bytes = xla::ffi::ByteWidth(static_cast<xla::ffi::DataType>(buffer->dtype));
      for (int64_t d = 0; d < buffer->rank; ++d) bytes *= static_cast<size_t>(buffer->dims[d]);
      buffers.Add(*name, buffer->data, bytes);
    }
  };
  add(arg_names, frame->args.size, frame->args.types, frame->args.args);
  add(ret_names, frame->rets.size, frame->rets.types, frame->rets.rets);
  return CountingStaleErrors(frame, handler);
}

XLA_FFI_Error* Prepare(XLA_FFI_CallFrame* frame) {
  return CountingStaleErrors(frame, fp8norm::PrepareCudaHandler);
}
XLA_FFI_Error* RmsNormFp8(XLA_FFI_CallFrame* frame) {
  return WithBuffers(frame, fp8norm::RmsNormFp8CudaHandler, {"x", "gamma", "static_scale"},
                     {"y", "scales"});
}
XLA_FFI_Error* AddRmsNormFp8(XLA_FFI_CallFrame* frame) {
  return WithBuffers(frame, fp8norm::AddRmsNormFp8CudaHandler,
                     {"x", "residual", "gamma", "static_scale"}, {"y", "scales", "residual_out"});
}
XLA_FFI_Error* Round(XLA_FFI_CallFrame* frame) {
  return WithBuffers(frame, fp8norm::RoundCudaHandler, {"in"}, {"out"});
}

}  // namespace

NB_MODULE(_fp8norm_simt, m) {
  m.attr("version") = FP8NORM_VERSION;
  m.def("registrations", []() {
    return fp8norm::Registrations({RmsNormFp8, AddRmsNormFp8, Round},
                                  {fp8norm::kPrepareStage, Prepare});
  });
  fp8norm::AddKernelVariantControls(m);
  fp8norm::AddCudaHostLogic(m);
  m.def("set_capture", [](bool on) { capture_calls = on; }, nanobind::arg("on"));
  m.def("stale_errors", []() { return stale_errors.load(); });
  m.def(
      "inject_error",
      [](const std::string& function, int error, int count) {
        simt::InjectError(function, error, count);
      },
      nanobind::arg("function"), nanobind::arg("error"), nanobind::arg("count") = 1);
  m.def("forget_device_setups", &fp8norm::ForgetDeviceSetups);
  m.def(
      "set_device_limits",
      [](int max_threads_per_block, int64_t max_grid_x, int shared_per_block,
         int shared_per_block_optin, int reserved_per_block, int shared_per_multiprocessor,
         int multiprocessors) {
        simt::SetDeviceLimits(simt::DeviceLimits{
            max_threads_per_block, max_grid_x, shared_per_block, shared_per_block_optin,
            reserved_per_block, shared_per_multiprocessor, multiprocessors});
        // Another device: the launch path's one-time work starts over with it.
        fp8norm::ForgetDeviceSetups();
      },
      nanobind::arg("max_threads_per_block"), nanobind::arg("max_grid_x"),
      nanobind::arg("shared_per_block"), nanobind::arg("shared_per_block_optin"),
      nanobind::arg("reserved_per_block"), nanobind::arg("shared_per_multiprocessor"),
      nanobind::arg("multiprocessors"));
  m.def("device_limits", []() {
    const simt::DeviceLimits l = simt::GetDeviceLimits();
    nanobind::dict out;
    out["max_threads_per_block"] = l.max_threads_per_block;
    out["max_grid_x"] = l.max_grid_x;
    out["shared_per_block"] = l.shared_per_block;
    out["shared_per_block_optin"] = l.shared_per_block_optin;
    out["reserved_per_block"] = l.reserved_per_block;
    out["shared_per_multiprocessor"] = l.shared_per_multiprocessor;
    out["multiprocessors"] = l.multiprocessors;
    return out;
  });
  m.def("set_schedule_seed", &simt::SetScheduleSeed, nanobind::arg("seed"));
  m.def("take_launches", []() {
    nanobind::list out;
    for (const simt::LaunchRecord& r : simt::TakeLaunches()) {
      nanobind::dict launch;
      launch["error"] = r.error;
      launch["blocks"] = r.blocks;
      launch["threads"] = r.threads;
      launch["dynamic_shared_bytes"] = r.dynamic_shared_bytes;
      launch["static_shared_bytes"] = r.static_shared_bytes;
      launch["kernel"] = r.kernel;
      launch["barriers"] = r.barriers;
      launch["shuffles"] = r.shuffles;
      nanobind::dict buffers;
      for (const simt::BufferStats& b : r.buffers) {
        nanobind::dict stats;
        stats["bytes"] = b.bytes;
        stats["bytes_read"] = b.bytes_read;
        stats["bytes_written"] = b.bytes_written;
        stats["requests"] = b.requests;
        stats["sectors"] = b.sectors;
        stats["min_sectors"] = b.min_sectors;
        stats["widest_access"] = b.widest_access;
        buffers[b.name.c_str()] = stats;
      }
      launch["buffers"] = buffers;
      out.append(launch);
    }
    return out;
  });
}
