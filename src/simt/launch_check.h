// Whether the emulated device accepts a launch (docs/simt.md, "Launch limits"): the
// launch's grid, block and shared memory against the device's limits and what the runtime
// knows of the kernel, refused as the CUDA runtime refuses it, with the runtime's error
// code, before any block runs.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <optional>
#include <string>

#include "simt.h"

namespace simt::internal {

// What the runtime knows of one kernel: what its launch code declared (DeclareKernel),
// and the attribute the launch code last set.
struct KernelRecord {
  std::string name;                       // for the launch records; empty when never declared
  size_t static_shared = 0;               // padded as ptxas pads it
  std::optional<int> max_threads;         // as its __launch_bounds__ allow, when declared
  std::optional<int> max_dynamic_shared;  // cudaFuncAttributeMaxDynamicSharedMemorySize
};

struct LaunchRefusal {
  cudaError_t code;
  std::string message;  // what cudaGetErrorString describes, after "invalid launch: "
};

// Why the device refuses to launch `kernel` with `config`, or none when it accepts.
std::optional<LaunchRefusal> CheckLaunch(const cudaLaunchConfig_t& config,
                                         const KernelRecord& kernel, const DeviceLimits& limits);

}  // namespace simt::internal
