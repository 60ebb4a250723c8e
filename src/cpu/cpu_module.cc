// Python module of every build: the FFI targets to register for platform "cpu", the
// name of the CPU kernel variant this machine runs, and, for tests on machines without a
// GPU, the CUDA path's host logic with injected values: the driver check's message and
// the launch plan (the CUDA module runs both with the device's own).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstdint>

#include "cuda_driver_check.h"
#include "cuda_launch_plan.h"
#include "ffi_capsule.h"
#include "handlers.h"
#include "rms_norm_fp8.h"

NB_MODULE(_fp8norm_cpu, m) {
  m.attr("version") = FP8NORM_VERSION;
  m.def("registrations", []() {
    nanobind::dict targets;
    targets["fp8norm_rms_norm_fp8"] = fp8norm::FfiCapsule(fp8norm::RmsNormFp8CpuHandler);
    targets["fp8norm_add_rms_norm_fp8"] = fp8norm::FfiCapsule(fp8norm::AddRmsNormFp8CpuHandler);
    targets["fp8norm_round"] = fp8norm::FfiCapsule(fp8norm::RoundCpuHandler);
    return targets;
  });
  m.def("cpu_kernel_variant", []() { return fp8norm::CpuKernelVariant(); });
  m.def(
      "plan_rms_norm_fp8_launch",
      [](int64_t rows, int64_t hidden, int input_type, bool residual, int gamma_type,
         int64_t misalign_bytes, size_t optin_shared_bytes, size_t static_shared_bytes,
         int64_t max_blocks, size_t default_shared_bytes, int64_t max_dynamic_shared_bytes,
         size_t reserved_shared_bytes, int64_t multiprocessor_shared_bytes, int multiprocessors,
         int variant) {
        // Buffers at 256-byte aligned addresses, which the plan only inspects; x (and
        // residual) moved by misalign_bytes.
        const auto at = [](uintptr_t address) { return reinterpret_cast<void*>(address); };
        fp8norm::RmsNormFp8Args a{};
        a.x = at(0x10000 + misalign_bytes);
        a.residual = residual ? at(0x20000 + misalign_bytes) : nullptr;
        a.residual_out = residual ? at(0x30000) : nullptr;
        a.gamma = at(0x40000);
        a.y = at(0x50000);
        a.scales = at(0x60000);
        a.rows = rows;
        a.hidden = hidden;
        a.input_type = a.residual_type = static_cast<fp8norm::FloatType>(input_type);
        a.gamma_type = static_cast<fp8norm::FloatType>(gamma_type);
        fp8norm::DeviceLimits limits{optin_shared_bytes, static_shared_bytes, max_blocks,
                                     default_shared_bytes};
        // Negative: unlimited (the attribute not yet read).
        if (max_dynamic_shared_bytes >= 0) {
          limits.max_dynamic_shared_bytes = static_cast<size_t>(max_dynamic_shared_bytes);
        }
        limits.reserved_shared_bytes = reserved_shared_bytes;
        if (multiprocessor_shared_bytes >= 0) {
          limits.multiprocessor_shared_bytes = static_cast<size_t>(multiprocessor_shared_bytes);
        }
        limits.multiprocessors = multiprocessors;
        const fp8norm::LaunchPlan p =
            fp8norm::PlanRmsNormFp8Launch(a, limits, static_cast<fp8norm::KernelVariant>(variant));
        nanobind::dict plan;
        plan["variant"] = fp8norm::kKernelVariantNames[static_cast<int>(p.variant)];
        plan["vectorized"] = p.vectorized;
        plan["vector_width"] = p.vector_width;
        plan["threads"] = p.threads;
        plan["blocks"] = p.blocks;
        plan["cached"] = p.cached;
        plan["dynamic_shared_bytes"] = p.dynamic_shared_bytes;
        plan["opt_in"] = p.opt_in;
        plan["threads_per_row"] = p.threads_per_row;
        plan["rows_per_block"] = p.rows_per_block;
        plan["vectors_per_thread"] = p.vectors_per_thread;
        return plan;
      },
      nanobind::arg("rows"), nanobind::arg("hidden"), nanobind::arg("input_type"),
      nanobind::arg("residual"), nanobind::arg("gamma_type"), nanobind::arg("misalign_bytes"),
      nanobind::arg("optin_shared_bytes"), nanobind::arg("static_shared_bytes"),
      nanobind::arg("max_blocks"), nanobind::arg("default_shared_bytes") = 48 * 1024,
      nanobind::arg("max_dynamic_shared_bytes") = -1, nanobind::arg("reserved_shared_bytes") = 0,
      nanobind::arg("multiprocessor_shared_bytes") = -1, nanobind::arg("multiprocessors") = 132,
      nanobind::arg("variant") = 0);
  m.def("cuda_kernel_variant_names", []() {
    nanobind::list names;
    for (const char* name : fp8norm::kKernelVariantNames) names.append(name);
    return names;
  });
  m.def("cuda_driver_problem", &fp8norm::CudaDriverProblem, nanobind::arg("runtime_version"),
        nanobind::arg("driver_version"));
}
