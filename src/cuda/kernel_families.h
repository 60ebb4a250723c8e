// The host entry points of the kernel families (one .cu file each, declared here once):
// their loading, which device_setup.cc runs to prepare a device, and their launches, of
// the family a call's plan picked (device_setup.cc) or of an op of their own (the FFI
// handlers, through cuda_kernels.h). Plain C++ over the CUDA runtime API.
#pragma once

#include <cuda_runtime_api.h>

#include "columnwise.h"
#include "cuda_launch_plan.h"
#include "quantize_weight.h"
#include "quantize_gradient.h"
#include "rms_norm_backward.h"
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

// round.cu.
cudaError_t LoadRoundKernel();
cudaError_t LaunchRound(cudaStream_t stream, const RoundArgs& args);

// quantize_weight.cu: the weight's FP4 tiles, global scale first.
cudaError_t LoadQuantizeWeightKernels();
cudaError_t LaunchQuantizeWeight(cudaStream_t stream, const QuantizeWeightArgs& args);

// backward.cu: the backward of both ops (args.residual == null for rms_norm_fp8).
cudaError_t LoadBackwardKernels();
cudaError_t LaunchRmsNormBackward(cudaStream_t stream, const RmsNormBackwardArgs& args);

// columnwise.cu: the columnwise outputs of both ops, from the rows' saved r
// (LaunchColumnwise), or both layouts of a call (its rows and hidden not 0) in one launch,
// on warp_rows' plan `plan` (LaunchBothLayoutsKernel).
cudaError_t LoadColumnwiseKernel();
cudaError_t LaunchColumnwise(cudaStream_t stream, const RmsNormFp8Args& args);
cudaError_t LaunchBothLayoutsKernel(cudaStream_t stream, const RmsNormFp8Args& args,
                                    const LaunchPlan& plan);

// quantize_gradient.cu: the output gradient's FP4 quantiser, its rows copy or its columns
// copy (two launches for NVFP4's: the tensor's global scale, then the codes).
cudaError_t LoadQuantizeGradientKernels();
cudaError_t LaunchQuantizeGradient(cudaStream_t stream, const QuantizeGradientArgs& args);

}  // namespace fp8norm
