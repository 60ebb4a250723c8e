// Python module of the SIMT emulation (docs/simt.md): the CUDA handlers and kernels run on
// the CPU, registered for platform "cpu" under their own target names, the emulated
// device's controls and memory accounting, and the CUDA path's host logic with injected
// values (cuda_host_bindings.h), for tests.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstdint>

#include "cuda_host_bindings.h"
#include "cuda_kernels.h"
#include "cuda_module_bindings.h"
#include "ffi_registrations.h"
#include "gpu_platform.h"
#include "handlers.h"
#include "simt.h"
#include "simt_handlers.h"

NB_MODULE(_fp8norm_simt, m) {
  m.attr("version") = FP8NORM_VERSION;
  m.def("registrations", []() {
    return fp8norm::Registrations(
        {fp8norm::SimtRmsNormFp8Handler, fp8norm::SimtAddRmsNormFp8Handler,
         fp8norm::SimtRoundHandler, fp8norm::SimtRmsNormBackwardHandler,
         fp8norm::SimtAddRmsNormBackwardHandler, fp8norm::SimtQuantizeWeightHandler,
         fp8norm::SimtQuantizeGradientHandler},
        {fp8norm::kPrepareStage, fp8norm::SimtPrepareHandler},
        {fp8norm::SimtAllReduceNormHandler, fp8norm::SimtSetUpAllReduceHandler});
  });
  fp8norm::AddCudaModuleBindings(m);
  fp8norm::AddCudaHostLogic(m);
  m.def("set_capture", &fp8norm::SetCaptureCalls, nanobind::arg("on"));
  m.def("stale_errors", &fp8norm::StaleErrors);
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
