// Launch functions of the CUDA kernels: plain C++ over the CUDA runtime API, called by
// the FFI handlers (host compiler) and defined in cuda_kernels.cu (nvcc).
#pragma once

#include <cuda_runtime_api.h>

#include "rms_norm_fp8.h"

namespace fp8norm {

// Enqueues rms_norm_fp8 (args.residual == null) or add_rms_norm_fp8 on `stream`, which
// belongs to `device`, the current device. Only stream-ordered work: safe inside CUDA
// graph capture. Returns the launch status.
cudaError_t LaunchRmsNormFp8(cudaStream_t stream, int device, const RmsNormFp8Args& args);

cudaError_t LaunchRound(cudaStream_t stream, const RoundArgs& args);

}  // namespace fp8norm
