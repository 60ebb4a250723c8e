// The host entry points of the kernel families (one .cu file each), which device_setup.cc
// calls to prepare a device and to launch the family a call's plan picked. Plain C++ over
// the CUDA runtime API.
#pragma once

#include <cuda_runtime_api.h>

#include "cuda_launch_plan.h"
#include "rms_norm_fp8.h"

namespace fp8norm {

// block_shared.cu. Loads block_shared's kernels for `input` and sets their dynamic shared
// memory attribute to the most any call can use; `limits` becomes `device`'s with the
// kernels' static size and attribute.
cudaError_t SetUpBlockShared(FloatType input, const DeviceLimits& device, DeviceLimits* limits);
cudaError_t LaunchBlockShared(cudaStream_t stream, const RmsNormFp8Args& args,
                              const LaunchPlan& plan);

// register_rows.cu: warp_rows and block_registers (plan.variant says which).
cudaError_t LoadRegisterRowKernels(FloatType input);
cudaError_t LaunchRegisterRows(cudaStream_t stream, const RmsNormFp8Args& args,
                               const LaunchPlan& plan);

// round.cu (LaunchRound is in cuda_kernels.h).
cudaError_t LoadRoundKernel();

// backward.cu (LaunchRmsNormBackward is in cuda_kernels.h).
cudaError_t LoadBackwardKernels();

// columnwise.cu (LaunchColumnwise is in cuda_kernels.h). LaunchBothLayoutsKernel: both
// layouts of a call (its rows and hidden not 0) in one launch, on warp_rows' plan `plan`.
cudaError_t LoadColumnwiseKernel();
cudaError_t LaunchBothLayoutsKernel(cudaStream_t stream, const RmsNormFp8Args& args,
                                    const LaunchPlan& plan);

}  // namespace fp8norm
