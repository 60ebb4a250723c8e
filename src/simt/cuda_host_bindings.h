// The CUDA path's host logic with injected values, for tests on machines without a GPU:
// the launch plan (cuda_launch_plan.h) over device limits a test makes up, the driver
// check's message for given versions, and the variant names. The CUDA module runs the
// same code with the device's own values.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstdint>

#include "cuda_driver_check.h"
#include "cuda_launch_plan.h"
#include "rms_norm_fp8.h"

namespace fp8norm {

inline void AddCudaHostLogic(nanobind::module_& m) {
  namespace nb = nanobind;
  nb::enum_<FloatType>(m, "FloatType")
      .value("float32", FloatType::kF32)
      .value("float16", FloatType::kF16)
      .value("bfloat16", FloatType::kBF16);
  nb::enum_<KernelVariant>(m, "KernelVariant")
      .value("auto", KernelVariant::kAuto)
      .value("block_shared", KernelVariant::kBlockShared)
      .value("warp_rows", KernelVariant::kWarpRows)
      .value("block_registers", KernelVariant::kBlockRegisters);
  nb::class_<DeviceLimits>(m, "DeviceLimits")
      .def(nb::init<>())
      .def_rw("optin_shared_bytes", &DeviceLimits::optin_shared_bytes)
      .def_rw("static_shared_bytes", &DeviceLimits::static_shared_bytes)
      .def_rw("max_blocks", &DeviceLimits::max_blocks)
      .def_rw("default_shared_bytes", &DeviceLimits::default_shared_bytes)
      .def_rw("max_dynamic_shared_bytes", &DeviceLimits::max_dynamic_shared_bytes)
      .def_rw("reserved_shared_bytes", &DeviceLimits::reserved_shared_bytes)
      .def_rw("multiprocessor_shared_bytes", &DeviceLimits::multiprocessor_shared_bytes)
      .def_rw("multiprocessors", &DeviceLimits::multiprocessors);
  nb::class_<LaunchPlan>(m, "LaunchPlan")
      .def_prop_ro("variant",
                   [](const LaunchPlan& p) {
                     return std::string(kKernelVariantNames[static_cast<int>(p.variant)]);
                   })
      .def_ro("vectorized", &LaunchPlan::vectorized)
      .def_ro("vector_width", &LaunchPlan::vector_width)
      .def_ro("threads", &LaunchPlan::threads)
      .def_ro("blocks", &LaunchPlan::blocks)
      .def_ro("cached", &LaunchPlan::cached)
      .def_ro("dynamic_shared_bytes", &LaunchPlan::dynamic_shared_bytes)
      .def_ro("opt_in", &LaunchPlan::opt_in)
      .def_ro("threads_per_row", &LaunchPlan::threads_per_row)
      .def_ro("rows_per_block", &LaunchPlan::rows_per_block)
      .def_ro("vectors_per_thread", &LaunchPlan::vectors_per_thread)
      .def_ro("both_layouts", &LaunchPlan::both_layouts);
  m.def(
      "plan_launch",
      [](int64_t rows, int64_t hidden, FloatType input_type, bool residual, FloatType gamma_type,
         int64_t misalign_bytes, const DeviceLimits& limits, KernelVariant variant) {
        // Buffers at 256-byte aligned addresses, which the plan only inspects; x (and
        // residual) moved by misalign_bytes.
        const auto at = [](uintptr_t address) { return reinterpret_cast<void*>(address); };
        RmsNormFp8Args a{};
        a.x = at(0x10000 + misalign_bytes);
        a.residual = residual ? at(0x20000 + misalign_bytes) : nullptr;
        a.residual_out = residual ? at(0x30000) : nullptr;
        a.gamma = at(0x40000);
        a.y = at(0x50000);
        a.scales = at(0x60000);
        a.rows = rows;
        a.hidden = hidden;
        a.group_size = hidden;  // one scale per row
        a.input_type = a.residual_type = input_type;
        a.gamma_type = gamma_type;
        return PlanRmsNormFp8Launch(a, limits, variant);
      },
      nb::arg("rows"), nb::arg("hidden"), nb::arg("input_type"), nb::arg("residual"),
      nb::arg("gamma_type"), nb::arg("misalign_bytes"), nb::arg("limits"), nb::arg("variant"));
  m.def("cuda_driver_problem", &CudaDriverProblem, nb::arg("runtime_version"),
        nb::arg("driver_version"));
}

}  // namespace fp8norm
