// The Python controls of the CUDA kernel variant (cuda_launch_plan.h), for the modules that
// carry the CUDA kernels: the CUDA build's and the SIMT emulation's, each over its own copy.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "cuda_kernels.h"

namespace fp8norm {

inline void AddKernelVariantControls(nanobind::module_& m) {
  m.def("kernel_variants", []() {
    nanobind::list names;
    for (const char* name : kKernelVariantNames) names.append(name);
    return names;
  });
  m.def("kernel_variant", []() {
    return std::string(kKernelVariantNames[static_cast<int>(RequestedKernelVariant())]);
  });
  m.def(
      "set_kernel_variant",
      [](const std::string& name) {
        for (int i = 0; i < kNumKernelVariants; ++i) {
          if (name == kKernelVariantNames[i]) {
            SetKernelVariant(static_cast<KernelVariant>(i));
            return;
          }
        }
        throw nanobind::value_error(("unknown CUDA kernel variant " + name).c_str());
      },
      nanobind::arg("name"));
}

}  // namespace fp8norm
