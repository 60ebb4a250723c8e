// Whether the machine's CUDA driver can run a module linked (statically) against a given
// CUDA runtime, and what to tell the user when it cannot. Plain C++ with no CUDA types: the
// CUDA handlers run it once per process with the real versions, and the emulation's module
// exposes it (src/simt/cuda_host_bindings.h) so that tests can inject versions on machines
// without a GPU.
#pragma once

#include <string>

namespace fp8norm {

// Versions as CUDA encodes them, 1000 * major + 10 * minor (13000 is 13.0); a driver
// version of 0 means no driver was found. Returns "" when the driver can run the runtime.
// Within one major version CUDA's minor-version compatibility lets an older driver run a
// newer runtime's kernels (built as SASS for the GPU, as ours are), so only a driver of an
// older major version, or none, is refused: with those the first launch fails with "CUDA
// driver version is insufficient for CUDA runtime version", which names neither version.
inline std::string CudaDriverProblem(int runtime_version, int driver_version) {
  auto name = [](int version) {
    return std::to_string(version / 1000) + "." + std::to_string(version % 1000 / 10);
  };
  const std::string fix_rebuild =
      " or rebuild jax_fp8norm with the CUDA toolkit of your driver's major version on PATH "
      "(`FP8NORM_CUDA=ON python -m pip install .`).";
  if (driver_version <= 0) {
    return "jax_fp8norm: no CUDA driver was found, and this build of jax_fp8norm needs one "
           "for CUDA " +
           name(runtime_version) + " or later (it links the CUDA " + name(runtime_version) +
           " runtime). Install the NVIDIA driver.";
  }
  if (driver_version / 1000 >= runtime_version / 1000) return "";
  return "jax_fp8norm: the NVIDIA driver supports CUDA up to " + name(driver_version) +
         ", but this build of jax_fp8norm links the CUDA " + name(runtime_version) +
         " runtime, which needs a driver for CUDA " + std::to_string(runtime_version / 1000) +
         ".x. Update the NVIDIA driver," + fix_rebuild;
}

}  // namespace fp8norm
