// Python module of every build: the FFI targets to register for platform "cpu", and the
// name of the CPU kernel variant this machine runs.
#include <nanobind/nanobind.h>

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
}
