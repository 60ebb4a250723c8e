// Python module of every build: the FFI targets to register for platform "cpu", the
// name of the CPU kernel variant this machine runs, and the CUDA driver check's message
// logic (for tests; the CUDA module runs it with the real versions).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "cuda_driver_check.h"
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
  m.def("cuda_driver_problem", &fp8norm::CudaDriverProblem, nanobind::arg("runtime_version"),
        nanobind::arg("driver_version"));
}
