// The Python bindings of the modules that carry the CUDA kernels, the CUDA build's and the
// SIMT emulation's, each over its own copy: the constants every module exports
// (constant_bindings.h), the all-reduce's (peer_allreduce.h) and the controls of the
// CUDA kernel variant (cuda_launch_plan.h). For the module .cc files only: nanobind,
// never seen by nvcc.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "constant_bindings.h"
#include "cuda_kernels.h"
#include "peer_allreduce.h"

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

// The one-kernel all-reduce's constants: {method name: code} and the most devices of a
// group.
inline void AddAllReduceConstants(nanobind::module_& m) {
  m.def("allreduce_methods", []() { return CodesByName(kAllReduceMethodNames); });
  m.def("max_peers", []() { return kMaxPeers; });
}

// Everything the two CUDA modules share.
inline void AddCudaModuleBindings(nanobind::module_& m) {
  AddFp4Layouts(m);
  AddWeightFormats(m);
  AddAllReduceConstants(m);
  AddKernelVariantControls(m);
}

}  // namespace fp8norm
