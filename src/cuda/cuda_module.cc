// Python module of a CUDA build: the FFI targets to register for platform "CUDA", the
// constants the Python package reads, and the choice of kernel variant.
#include <nanobind/nanobind.h>

#include "cuda_module_bindings.h"
#include "ffi_registrations.h"
#include "gpu_platform.h"
#include "handlers.h"

NB_MODULE(_fp8norm_cuda, m) {
  m.attr("version") = FP8NORM_VERSION;
  m.def("registrations", []() {
    return fp8norm::Registrations(
        {fp8norm::RmsNormFp8CudaHandler, fp8norm::AddRmsNormFp8CudaHandler,
         fp8norm::RoundCudaHandler, fp8norm::RmsNormBackwardCudaHandler,
         fp8norm::AddRmsNormBackwardCudaHandler, fp8norm::QuantizeWeightCudaHandler,
         fp8norm::QuantizeGradientCudaHandler},
        {fp8norm::kPrepareStage, fp8norm::PrepareCudaHandler},
        {fp8norm::AllReduceNormCudaHandler, fp8norm::SetUpAllReduceCudaHandler});
  });
  fp8norm::AddCudaModuleBindings(m);
}
