// How the CUDA kernel of rms_norm_fp8 / add_rms_norm_fp8 is launched for one call: every
// decision the host makes (16-byte vectors or scalars, threads per block, blocks, the row
// cached in shared memory or re-read, dynamic shared bytes, the attribute opt-in), as one
// function of the call's arguments and the device's limits. The real launch
// (device_setup.cc) calls it with the device's limits; tests call it with injected ones
// (48 KiB or 100 KiB of shared memory, a grid cap of 3 blocks) to reach every path at
// small sizes. Plain C++: no CUDA types.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "columnwise.h"
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

// The kernels of rms_norm_fp8 / add_rms_norm_fp8 (block_shared.cu, register_rows.cu),
// each complete on its own; FP8NORM_CUDA_KERNEL or jax_fp8norm.use_cuda_kernel picks one,
// `auto` by the table in PlanRmsNormFp8Launch.
enum class KernelVariant : int {
  kAuto = 0,
  // One block per row; the row's float32 values cached in dynamic shared memory when they
  // fit, re-read from global memory otherwise. Takes every shape and alignment.
  kBlockShared = 1,
  // A group of 1 to 8 warps per row, several rows per 256-thread block, the row in
  // registers; no barrier at all when a warp holds the row.
  kWarpRows = 2,
  // One block of up to 512 threads per row, up to 4 vectors per thread in registers, gamma
  // loaded in the first sweep, one barrier per block reduction.
  kBlockRegisters = 3,
};
constexpr int kNumKernelVariants = 4;
constexpr const char* kKernelVariantNames[kNumKernelVariants] = {"auto", "block_shared",
                                                                 "warp_rows", "block_registers"};

// The register variants: threads of a warp_rows block, and the most threads of a
// block_registers block. A thread holds a vector as 2 x 8 floats for 16-bit inputs (h
// and gamma): 4 vectors fit in a thread's registers, 8 would spill (docs/performance.md,
// "Figures behind choices in the source"). So
// warp_rows holds up to 256 x 4 vectors (8192 bf16) and block_registers 512 x 4 (16384
// bf16, 8192 float32); longer rows go to block_shared.
constexpr int kWarpRowsBlockThreads = 256;
constexpr int kBlockRegistersMaxThreads = 512;
// 16-byte vectors per thread: the register arrays' compile-time sizes.
constexpr int kWarpRowsMaxVectors = 4;
constexpr int kBlockRegistersMaxVectors = 4;
// auto: below this many rows per multiprocessor a row gets a block of its own, so that
// short batches still spread over every SM (docs/performance.md says how it is chosen).
constexpr int64_t kWarpRowsMinRowsPerSm = 4;

struct DeviceLimits {
  size_t optin_shared_bytes;   // cudaDevAttrMaxSharedMemoryPerBlockOptin
  size_t static_shared_bytes;  // block_shared's own __shared__ storage (cudaFuncGetAttributes)
  int64_t max_blocks = kMaxBlocks;
  // cudaDevAttrMaxSharedMemoryPerBlock: static + dynamic a block may use without opting in.
  size_t default_shared_bytes = kDefaultSharedBytes;
  // block_shared's cudaFuncAttributes::maxDynamicSharedSizeBytes: the attribute as the
  // one-time setup left it (the opt-in limit less the static size, or the default limit
  // less it when the driver refused the attribute).
  size_t max_dynamic_shared_bytes = SIZE_MAX;
  // cudaDevAttrReservedSharedMemoryPerBlock and cudaDevAttrMaxSharedMemoryPerMultiprocessor:
  // a block needs its static, dynamic and the reserved bytes on one SM.
  size_t reserved_shared_bytes = 0;
  size_t multiprocessor_shared_bytes = SIZE_MAX;
  int multiprocessors = 132;  // cudaDevAttrMultiProcessorCount
};

struct LaunchPlan {
  KernelVariant variant;        // the kernel launched: never kAuto
  bool vectorized;              // kVectorBytes per load; else one element per load
  int vector_width;             // elements per load: kVectorBytes / input bytes, or 1
  int threads;                  // per block, a multiple of kWarp
  unsigned blocks;              // rows (or groups of rows) are strided over them
  bool cached;                  // block_shared: the row kept in dynamic shared memory
  size_t dynamic_shared_bytes;  // hidden floats when cached, else 0
  bool opt_in;                  // static + dynamic shared bytes exceed the default limit
  int threads_per_row;          // register variants: the threads that hold one row
  int rows_per_block;           // register variants: rows a block holds at once
  int vectors_per_thread;       // register variants: the kernel's register array size
  // A call with columnwise outputs: both layouts in this one launch (columnwise.cu's
  // BothLayoutsKernel, on warp_rows' plan); else the rows' kernel, then the columns'.
  bool both_layouts;
};

FP8NORM_HD bool AlignedTo(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// The smallest power of two >= n (n >= 1).
constexpr int64_t CeilPow2(int64_t n) {
  int64_t p = 1;
  while (p < n) p *= 2;
  return p;
}

constexpr int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// warp_rows' layout of one row: `threads` (a power of two, 32 to 256) of `vectors` each.
// As many vectors per thread as the row fills across a warp: loads in flight without idle
// lanes. False when the row needs more than a block.
inline bool FitWarpRows(int64_t num_vecs, int* threads, int* vectors) {
  const int64_t v = std::min<int64_t>(kWarpRowsMaxVectors, CeilPow2(CeilDiv(num_vecs, kWarp)));
  const int64_t t = CeilPow2(std::max<int64_t>(kWarp, CeilDiv(num_vecs, v)));
  if (t > kWarpRowsBlockThreads) return false;
  *threads = static_cast<int>(t);
  *vectors = static_cast<int>(v);
  return true;
}

// block_registers' layout: at least 2 vectors per thread (two loads in flight), more only
// when the row needs more than kBlockRegistersMaxThreads threads.
inline bool FitBlockRegisters(int64_t num_vecs, int* threads, int* vectors) {
  for (int v = 2; v <= kBlockRegistersMaxVectors; v *= 2) {
    const int64_t t = std::max<int64_t>(kWarp, CeilDiv(CeilDiv(num_vecs, v), kWarp) * kWarp);
    if (t <= kBlockRegistersMaxThreads) {
      *threads = static_cast<int>(t);
      *vectors = v;
      return true;
    }
  }
  return false;
}

// Whether the register variants' group path holds groups of `group_size` elements in
// vectors of `width`: 1 to 32 whole vectors (a power of two) on consecutive lanes of a
// warp. Other sizes (smaller than a vector, or odd multiples) go to block_shared: a path
// for them in the register kernels would cost every call registers.
constexpr bool GroupFitsRegisters(int64_t group_size, int width) {
  if (group_size <= 0 || group_size % width != 0) return false;
  const int64_t lanes = group_size / width;
  return lanes <= kWarp && (lanes & (lanes - 1)) == 0;
}

// Whether the kernels may take a's rows in 16-byte vectors of x: every row start aligned,
// with hidden a multiple of the vector width and each base pointer aligned to the width
// of its own vector.
inline bool RowsVectorizable(const RmsNormFp8Args& a) {
  const int width = VectorWidth(FloatTypeBytes(a.input_type));
  const size_t residual_vector = width * FloatTypeBytes(a.residual_type);
  return a.hidden % width == 0 && AlignedTo(a.x, kVectorBytes) &&
         (a.residual == nullptr || AlignedTo(a.residual, residual_vector)) &&
         (a.residual_out == nullptr || AlignedTo(a.residual_out, residual_vector)) &&
         AlignedTo(a.gamma, width * FloatTypeBytes(a.gamma_type)) && AlignedTo(a.y, width);
}

// Both layouts of a call with columnwise outputs in one launch (BothLayoutsKernel: a block
// of threads per block of rows, x read from memory once) rather than the rows' kernel and
// then the columnwise one, which reads x again. On warp_rows' plan only, whose blocks hold
// several rows: asked for by name, or picked by auto when the call has a block of rows for
// every multiprocessor. With fewer, the one launch would leave multiprocessors idle, where
// the columnwise kernel spreads the same work over hidden / 128 times as many blocks.
// Never with per-row global scales: a column's global scale needs every row, which no
// block of the one launch has before it quantises its columns.
inline bool OneLaunchForBothLayouts(const RmsNormFp8Args& a, KernelVariant variant,
                                    const DeviceLimits& limits, KernelVariant requested) {
  if (a.columns.y_t == nullptr || a.rows == 0 || a.hidden == 0 ||
      variant != KernelVariant::kWarpRows || a.columns.global_scales_t != nullptr) {
    return false;
  }
  return requested == KernelVariant::kWarpRows || RowBlocksOf(a) >= limits.multiprocessors;
}

inline LaunchPlan PlanRmsNormFp8Launch(const RmsNormFp8Args& a, const DeviceLimits& limits,
                                       KernelVariant requested = KernelVariant::kAuto) {
  LaunchPlan plan{};
  const int width = VectorWidth(FloatTypeBytes(a.input_type));
  plan.vectorized = RowsVectorizable(a);
  plan.vector_width = plan.vectorized ? width : 1;
  const int64_t num_loads = a.hidden / plan.vector_width;

  // The register variants hold whole 16-byte vectors: aligned rows only, and groups
  // their shuffles reach.
  int warp_threads = 0, warp_vectors = 0, block_threads = 0, block_vectors = 0;
  const bool registers =
      plan.vectorized && (PerRowScale(a) || GroupFitsRegisters(a.group_size, width));
  const bool warp_rows_fit = registers && FitWarpRows(num_loads, &warp_threads, &warp_vectors);
  const bool block_registers_fit =
      registers && FitBlockRegisters(num_loads, &block_threads, &block_vectors);
  KernelVariant variant = requested;
  if (variant == KernelVariant::kAuto) {
    // The table of docs/performance.md: many rows -> warp_rows; fewer, or longer rows that
    // fit -> block_registers; everything else -> block_shared.
    const bool many_rows = a.rows >= kWarpRowsMinRowsPerSm * limits.multiprocessors *
                                         (kWarpRowsBlockThreads / std::max(warp_threads, 1));
    variant = warp_rows_fit && many_rows ? KernelVariant::kWarpRows
              : block_registers_fit      ? KernelVariant::kBlockRegisters
                                         : KernelVariant::kBlockShared;
  }
  // A requested register variant that cannot hold the row falls back to block_shared.
  if (variant == KernelVariant::kWarpRows && !warp_rows_fit) variant = KernelVariant::kBlockShared;
  if (variant == KernelVariant::kBlockRegisters && !block_registers_fit) {
    variant = KernelVariant::kBlockShared;
  }
  plan.variant = variant;
  plan.both_layouts = OneLaunchForBothLayouts(a, variant, limits, requested);

  if (variant == KernelVariant::kWarpRows) {
    plan.threads = kWarpRowsBlockThreads;
    plan.threads_per_row = warp_threads;
    plan.rows_per_block = kWarpRowsBlockThreads / warp_threads;
    plan.vectors_per_thread = warp_vectors;
  } else if (variant == KernelVariant::kBlockRegisters) {
    plan.threads = plan.threads_per_row = block_threads;
    plan.rows_per_block = 1;
    plan.vectors_per_thread = block_vectors;
  } else {
    // One load per thread up to the block limit: the most bytes in flight per row.
    plan.threads = static_cast<int>(std::min<int64_t>(
        kMaxThreads, std::max<int64_t>(kWarp, CeilDiv(num_loads, kWarp) * kWarp)));
    plan.threads_per_row = plan.threads;
    plan.rows_per_block = 1;
    plan.vectors_per_thread = 0;
    const size_t cache_bytes = static_cast<size_t>(a.hidden) * sizeof(float);
    const size_t block_bytes = cache_bytes + limits.static_shared_bytes;
    plan.cached = block_bytes <= limits.optin_shared_bytes &&
                  cache_bytes <= limits.max_dynamic_shared_bytes &&
                  block_bytes + limits.reserved_shared_bytes <= limits.multiprocessor_shared_bytes;
    plan.dynamic_shared_bytes = plan.cached ? cache_bytes : 0;
    plan.opt_in =
        plan.dynamic_shared_bytes + limits.static_shared_bytes > limits.default_shared_bytes;
  }
  plan.blocks = static_cast<unsigned>(
      std::min<int64_t>(CeilDiv(a.rows, plan.rows_per_block), limits.max_blocks));
  return plan;
}

}  // namespace fp8norm
