// Python module of a CUDA build: the FFI targets to register for platform "CUDA", and the
// choice of kernel variant.
#include <nanobind/nanobind.h>

#include "ffi_capsule.h"
#include "handlers.h"
#include "kernel_variant_bindings.h"

NB_MODULE(_fp8norm_cuda, m) {
  m.attr("version") = FP8NORM_VERSION;
  m.def("registrations", []() {
    nanobind::dict targets;
    const auto prepare = fp8norm::PrepareCudaHandler;
    const char* stage = fp8norm::kPrepareStage;
    targets["fp8norm_rms_norm_fp8"] =
        fp8norm::FfiStages(stage, prepare, fp8norm::RmsNormFp8CudaHandler);
    targets["fp8norm_add_rms_norm_fp8"] =
        fp8norm::FfiStages(stage, prepare, fp8norm::AddRmsNormFp8CudaHandler);
    targets["fp8norm_round"] = fp8norm::FfiStages(stage, prepare, fp8norm::RoundCudaHandler);
    return targets;
  });
  fp8norm::AddKernelVariantControls(m);
}
