// How the CUDA kernel of rms_norm_fp8 / add_rms_norm_fp8 is launched for one call: every
// decision the host makes (16-byte vectors or scalars, threads per block, blocks, the row
// cached in shared memory or re-read, dynamic shared bytes, the attribute opt-in), as one
// function of the call's arguments and the device's limits. The real launch
// (cuda_kernels.cu) calls it with the device's limits; tests call it with injected ones
// (48 KiB or 100 KiB of shared memory, a grid cap of 3 blocks) to reach every path at
// small sizes. Plain C++: no CUDA types.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "fp8norm_math.h"
#include "rms_norm_fp8.h"

namespace fp8norm {

constexpr int kWarp = 32;
// 1024 threads (the hardware limit) keep up to 16 KiB of a row in flight per block with
// 16-byte loads, enough to cover DRAM latency when there are fewer rows than SMs.
constexpr int kMaxThreads = 1024;
constexpr int kVectorBytes = 16;
// Shared memory a block may use without opting in.
constexpr size_t kDefaultSharedBytes = 48 * 1024;
// Rows beyond this many blocks are strided over them: far below the x-dimension limit
// (2^31 - 1), and already more blocks than any GPU runs at once.
constexpr int64_t kMaxBlocks = int64_t{1} << 30;

// Elements per 16-byte load of a type of `element_bytes` bytes; the kernels' template
// width and the plan's run-time width are both this.
constexpr int VectorWidth(size_t element_bytes) {
  return kVectorBytes / static_cast<int>(element_bytes);
}

struct DeviceLimits {
  size_t optin_shared_bytes;   // cudaDevAttrMaxSharedMemoryPerBlockOptin
  size_t static_shared_bytes;  // the kernel's own __shared__ storage
  int64_t max_blocks = kMaxBlocks;
  // cudaDevAttrMaxSharedMemoryPerBlock: what a block may use without opting in.
  size_t default_shared_bytes = kDefaultSharedBytes;
};

struct LaunchPlan {
  bool vectorized;              // kVectorBytes per load; else one element per load
  int vector_width;             // elements per load: kVectorBytes / input bytes, or 1
  int threads;                  // per block, a multiple of kWarp
  unsigned blocks;              // rows are strided over them
  bool cached;                  // the row's float32 values kept in dynamic shared memory
  size_t dynamic_shared_bytes;  // hidden floats when cached, else 0
  bool opt_in;                  // dynamic + static shared bytes exceed default_shared_bytes
};

inline bool AlignedTo(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

inline LaunchPlan PlanRmsNormFp8Launch(const RmsNormFp8Args& a, const DeviceLimits& limits) {
  LaunchPlan plan{};
  const int width = VectorWidth(FloatTypeBytes(a.input_type));
  // The vector path needs every row start aligned: hidden a multiple of the vector width
  // and each base pointer aligned to the width of its own vector.
  const size_t residual_vector = width * FloatTypeBytes(a.residual_type);
  plan.vectorized = a.hidden % width == 0 && AlignedTo(a.x, kVectorBytes) &&
                    (a.residual == nullptr || AlignedTo(a.residual, residual_vector)) &&
                    (a.residual_out == nullptr || AlignedTo(a.residual_out, residual_vector)) &&
                    AlignedTo(a.gamma, width * FloatTypeBytes(a.gamma_type)) &&
                    AlignedTo(a.y, width);
  plan.vector_width = plan.vectorized ? width : 1;
  const int64_t num_loads = a.hidden / plan.vector_width;
  // One load per thread up to the block limit: the most bytes in flight per row.
  plan.threads = static_cast<int>(std::min<int64_t>(
      kMaxThreads, std::max<int64_t>(kWarp, (num_loads + kWarp - 1) / kWarp * kWarp)));
  plan.blocks = static_cast<unsigned>(std::min<int64_t>(a.rows, limits.max_blocks));
  const size_t cache_bytes = static_cast<size_t>(a.hidden) * sizeof(float);
  plan.cached = cache_bytes + limits.static_shared_bytes <= limits.optin_shared_bytes;
  plan.dynamic_shared_bytes = plan.cached ? cache_bytes : 0;
  plan.opt_in =
      plan.dynamic_shared_bytes + limits.static_shared_bytes > limits.default_shared_bytes;
  return plan;
}

}  // namespace fp8norm
