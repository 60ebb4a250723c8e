// Python module of a CUDA build: the FFI targets to register for platform "CUDA".
#include <nanobind/nanobind.h>

#include "ffi_capsule.h"
#include "handlers.h"

NB_MODULE(_fp8norm_cuda, m) {
  m.attr("version") = FP8NORM_VERSION;
  m.def("registrations", []() {
    nanobind::dict targets;
    targets["fp8norm_rms_norm_fp8"] = fp8norm::FfiCapsule(fp8norm::RmsNormFp8CudaHandler);
    targets["fp8norm_add_rms_norm_fp8"] = fp8norm::FfiCapsule(fp8norm::AddRmsNormFp8CudaHandler);
    targets["fp8norm_round"] = fp8norm::FfiCapsule(fp8norm::RoundCudaHandler);
    return targets;
  });
}
