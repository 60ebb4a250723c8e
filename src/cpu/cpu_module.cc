// Python module of every build: the FFI targets to register for platform "cpu", the name
// of the CPU kernel variant this machine runs, the CPU backward's split of a call's rows
// (for the tests that force it), and the constants every module exports.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "constant_bindings.h"
#include "ffi_registrations.h"
#include "handlers.h"
#include "quantize_gradient.h"
#include "rms_norm_backward.h"
#include "rms_norm_fp8.h"

NB_MODULE(_fp8norm_cpu, m) {
  m.attr("version") = FP8NORM_VERSION;
  m.def("registrations", []() {
    return fp8norm::Registrations(
        {fp8norm::RmsNormFp8CpuHandler, fp8norm::AddRmsNormFp8CpuHandler, fp8norm::RoundCpuHandler,
         fp8norm::RmsNormBackwardCpuHandler, fp8norm::AddRmsNormBackwardCpuHandler,
         fp8norm::QuantizeWeightCpuHandler, fp8norm::QuantizeGradientCpuHandler});
  });
  m.def("cpu_kernel_variant", []() { return fp8norm::CpuKernelVariant(); });
  m.def("cpu_backward_rows_per_task", &fp8norm::CpuBackwardRowsPerTask, nanobind::arg("rows"),
        nanobind::arg("hidden"));
  m.def("set_quantize_gradient_task_rows", &fp8norm::SetQuantizeGradientTaskRows,
        nanobind::arg("rows"));
  fp8norm::AddFp4Layouts(m);
  fp8norm::AddWeightFormats(m);
}
