// The SIMT emulation's stand-in for <cuda_runtime.h>: what the CUDA kernels of
// jax_fp8norm use, for the host C++ compiler, so that src/cuda's kernel files compile
// unchanged and its kernels run on the CPU (docs/simt.md).
//
// Only this directory is on the include path of the emulated build; nvcc builds never
// see it. Each thread of a block is a fiber (scheduler.h says why); the built-in
// variables are per-OS-thread values that the scheduler sets before it resumes a fiber.
#pragma once

#include <cstddef>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <utility>

// ------------------------------------------------------------------ keywords
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
// Static shared memory: one instance per OS thread, which runs one block at a time and all
// of that block's threads; a later block finds the previous block's values, as stale as a
// GPU's.
#define __shared__ static thread_local
#define CUDART_VERSION 13000

// ------------------------------------------------------------------ types
struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
};

enum cudaError_t : int {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDevice = 101,
  cudaErrorInvalidDeviceFunction = 98,
  cudaErrorLaunchOutOfResources = 701,
  cudaErrorPeerAccessAlreadyEnabled = 704,
  cudaErrorLaunchFailure = 719,
  cudaErrorStreamCaptureUnsupported = 900,
};
using cudaError = cudaError_t;

struct CUstream_st;
using cudaStream_t = CUstream_st*;

enum cudaDeviceAttr : int {
  cudaDevAttrMaxThreadsPerBlock = 1,
  cudaDevAttrMaxGridDimX = 5,
  cudaDevAttrMaxSharedMemoryPerBlock = 8,
  cudaDevAttrMultiProcessorCount = 16,
  cudaDevAttrMaxSharedMemoryPerMultiprocessor = 81,
  cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
  cudaDevAttrReservedSharedMemoryPerBlock = 111,
};

enum cudaFuncAttribute : int {
  cudaFuncAttributeMaxDynamicSharedMemorySize = 8,
};

// The fields of the runtime's cudaFuncAttributes that the launch reads.
struct cudaFuncAttributes {
  size_t sharedSizeBytes = 0;  // static shared memory, as the compiler laid it out
  int maxThreadsPerBlock = 0;
  int maxDynamicSharedSizeBytes = 0;  // the attribute as last set
};

struct cudaLaunchAttribute;
struct cudaLaunchConfig_t {
  dim3 gridDim;
  dim3 blockDim;
  size_t dynamicSmemBytes = 0;
  cudaStream_t stream = nullptr;
  cudaLaunchAttribute* attrs = nullptr;
  unsigned numAttrs = 0;
};

// ------------------------------------------------------------------ built-in variables
extern thread_local uint3 threadIdx;
extern thread_local uint3 blockIdx;
extern thread_local dim3 blockDim;
extern thread_local dim3 gridDim;

namespace simt {

// A block's dynamic shared memory, allocated at exactly the launch's byte count.
void* DynamicSharedMemory();

// A block's static shared memory: `bytes` of the region the running kernel declared
// (DeclareKernel); more than that fails the launch (null is returned).
void* StaticSharedMemory(size_t bytes);

// What the compiler would record of `kernel`: its static shared memory (the emulation has
// no compiler pass, so the kernel's source declares it, device_memory.h), laid out as
// ptxas lays it out before a 16-byte aligned dynamic region: rounded up to 16 bytes; the
// most threads per block its __launch_bounds__ allow; and a name for the launch records.
void DeclareKernel(const void* kernel, const char* name, size_t static_bytes, int max_threads);

// One global-memory access of the calling thread: checked against the buffers the
// emulator knows and against its alignment, as the GPU faults on a misaligned vector
// access (false: the launch fails, and the access must not be made), then counted per
// warp. `site` tells apart the accesses one warp makes at different places of the source.
bool RecordGlobalAccess(const void* address, size_t bytes, size_t alignment, bool write, int site);

void SyncThreads();
// Flags between devices (device_memory.h): a load with acquire and a store with release
// semantics at system scope, each checked and counted as a global access; and the wait
// of a thread until the flag's value reaches `target` (counting modulo 2^32, as epochs
// grow), a point where the scheduler runs other threads, and other devices.
uint32_t LoadAcquire(const uint32_t* flag, int site);
void StoreRelease(uint32_t* flag, uint32_t value, int site);
// The same accesses without their ordering, as a kernel that forgot the acquire and the
// release would make them (the mutation check plants them): still checked, counted and
// seen by the board, so that only the missing ordering differs, which ThreadSanitizer
// reports.
uint32_t LoadRelaxed(const uint32_t* flag, int site);
void StoreRelaxed(uint32_t* flag, uint32_t value, int site);
void AwaitFlag(const uint32_t* flag, uint32_t target);
uint32_t ShuffleXor(uint32_t mask, uint32_t value, int lane_mask, int width);

// Runs `thread_body` for every thread of every block of the launch; the launch's status.
using ThreadBody = void (*)(const void* kernel_and_args);
cudaError_t Launch(const void* kernel, const cudaLaunchConfig_t& config, ThreadBody thread_body,
                   const void* kernel_and_args);
cudaError_t SetMaxDynamicShared(const void* kernel, int bytes);
cudaError_t GetFuncAttributes(const void* kernel, cudaFuncAttributes* attributes);

template <typename Kernel, typename Args>
struct BoundKernel {
  Kernel kernel;
  Args args;
  static void Run(const void* self) {
    const auto* bound = static_cast<const BoundKernel*>(self);
    std::apply(bound->kernel, bound->args);
  }
};

}  // namespace simt

// ------------------------------------------------------------------ device functions
inline void __syncthreads() { simt::SyncThreads(); }

template <typename T>
inline T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = 32) {
  static_assert(sizeof(T) == 4 && std::is_trivially_copyable_v<T>, "32-bit shuffles only");
  uint32_t bits;
  __builtin_memcpy(&bits, &value, 4);
  bits = simt::ShuffleXor(mask, bits, lane_mask, width);
  __builtin_memcpy(&value, &bits, 4);
  return value;
}

inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }

// ------------------------------------------------------------------ runtime API
cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
const char* cudaGetErrorString(cudaError_t error);
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaRuntimeGetVersion(int* version);
cudaError_t cudaDriverGetVersion(int* version);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attribute, int device);
cudaError_t cudaMemsetAsync(void* pointer, int value, size_t bytes, cudaStream_t stream = nullptr);
// Device memory of the current device: host memory, 256-byte aligned, never checked
// against a launch's buffers by these calls (the launch registers what it may touch).
cudaError_t cudaMalloc(void** pointer, size_t bytes);
cudaError_t cudaFree(void* pointer);
// Streams: the emulation runs everything at once on the calling thread, so a stream is a
// name only.
constexpr unsigned cudaStreamNonBlocking = 1;
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned flags);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
cudaError_t cudaGetDeviceCount(int* count);
// Every emulated device reaches every other's memory.
cudaError_t cudaDeviceCanAccessPeer(int* can_access, int device, int peer);
cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned flags);

inline cudaError_t cudaFuncSetAttribute(const void* kernel, cudaFuncAttribute attribute,
                                        int value) {
  if (attribute != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaErrorInvalidValue;
  return simt::SetMaxDynamicShared(kernel, value);
}
inline cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attributes, const void* kernel) {
  return simt::GetFuncAttributes(kernel, attributes);
}
template <typename... Params>
cudaError_t cudaFuncSetAttribute(void (*kernel)(Params...), cudaFuncAttribute attribute,
                                 int value) {
  return cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel), attribute, value);
}
template <typename... Params>
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attributes, void (*kernel)(Params...)) {
  return cudaFuncGetAttributes(attributes, reinterpret_cast<const void*>(kernel));
}

// The C++ launch of the CUDA runtime (cuda_runtime.h's variadic cudaLaunchKernelEx): the
// arguments are converted to the kernel's parameter types and copied, as a launch does.
template <typename... Params, typename... Args>
cudaError_t cudaLaunchKernelEx(const cudaLaunchConfig_t* config, void (*kernel)(Params...),
                               Args&&... args) {
  using Bound = simt::BoundKernel<void (*)(Params...), std::tuple<std::decay_t<Params>...>>;
  const Bound bound{kernel, std::tuple<std::decay_t<Params>...>(std::forward<Args>(args)...)};
  return simt::Launch(reinterpret_cast<const void*>(kernel), *config, &Bound::Run, &bound);
}
