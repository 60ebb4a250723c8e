// How the CUDA kernels touch memory other than registers: global loads and stores, and
// the dynamic shared region. On the GPU each is the plain access; in the SIMT emulation
// (src/simt, docs/simt.md) each global access is first checked against the launch's
// buffers (one outside them fails the launch and is not performed) and counted for the
// per-warp memory accounting, and the dynamic region is the block's emulated one. Flags
// between devices are acquire loads and release stores at system scope; in the emulation
// a thread's wait for one is a point where other threads and other devices run.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)

namespace fp8norm {

template <typename T>
__device__ __forceinline__ T LoadGlobal(const T* p, int /*site*/ = 0) {
  return *p;
}

template <typename T>
__device__ __forceinline__ void StoreGlobal(T* p, const T& value, int /*site*/ = 0) {
  *p = value;
}

// The launch's dynamic shared memory (its third launch parameter), 16-byte aligned.
template <typename T>
__device__ __forceinline__ T* DynamicShared() {
  extern __shared__ __align__(16) unsigned char dynamic_shared[];
  return reinterpret_cast<T*>(dynamic_shared);
}

// The block's static shared storage of type T: one per kernel that calls it, and one type
// per kernel (the emulation gives every type the same region). The launch reads its real
// size from cudaFuncGetAttributes.
template <typename T>
__device__ __forceinline__ T& StaticShared() {
  __shared__ T storage;
  return storage;
}

// The emulation's stand-in for the compiler's record of a kernel (its static shared
// memory, a name for the launch records); nvcc has the real one.
template <typename Kernel>
inline void DeclareKernel(Kernel, const char*, size_t, int) {}

// Flags between devices: a load that acquires and a store that releases at system scope,
// so that what a device wrote before its store is visible to a peer after its load.
__device__ __forceinline__ uint32_t LoadAcquireSystem(const uint32_t* flag, int /*site*/ = 0) {
  uint32_t value;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(value) : "l"(flag) : "memory");
  return value;
}

__device__ __forceinline__ void StoreReleaseSystem(uint32_t* flag, uint32_t value,
                                                   int /*site*/ = 0) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" : : "l"(flag), "r"(value) : "memory");
}

// One turn of a thread's wait for `flag` to reach `target`: the GPU spins.
__device__ __forceinline__ void FlagWaitPoint(const uint32_t* /*flag*/, uint32_t /*target*/) {}

// The emulation's record of a launch whose devices wait for each other (its peer group,
// this device's position in it, the group's size) and of the peers' memory it may touch;
// nothing on the GPU.
struct PeerLaunchRecord {
  PeerLaunchRecord(uint64_t, int, int) {}
  void AddMemory(const char*, const void*, size_t) {}
};

}  // namespace fp8norm

#else  // the SIMT emulation

#include <cuda_runtime.h>

#include "simt.h"

namespace fp8norm {

// `site` (the kernel line of the access) and the buffer tell apart a warp's requests.
template <typename T>
inline T LoadGlobal(const T* p, int site = __builtin_LINE()) {
  if (!simt::RecordGlobalAccess(p, sizeof(T), alignof(T), false, site)) return T{};
  return *p;
}

template <typename T>
inline void StoreGlobal(T* p, const T& value, int site = __builtin_LINE()) {
  if (simt::RecordGlobalAccess(p, sizeof(T), alignof(T), true, site)) *p = value;
}

template <typename T>
inline T* DynamicShared() {
  return static_cast<T*>(simt::DynamicSharedMemory());
}

// The block's region of the size the kernel declared (DeclareKernel): using more
// than declared fails the launch, so the declaration cannot understate the kernel.
template <typename T>
inline T& StaticShared() {
  static_assert(alignof(T) <= 16, "static shared storage is 16-byte aligned");
  return *static_cast<T*>(simt::StaticSharedMemory(sizeof(T)));
}

template <typename Kernel>
inline void DeclareKernel(Kernel kernel, const char* name, size_t static_bytes, int max_threads) {
  simt::DeclareKernel(reinterpret_cast<const void*>(kernel), name, static_bytes, max_threads);
}

inline uint32_t LoadAcquireSystem(const uint32_t* flag, int site = __builtin_LINE()) {
  return simt::LoadAcquire(flag, site);
}

inline void StoreReleaseSystem(uint32_t* flag, uint32_t value, int site = __builtin_LINE()) {
  simt::StoreRelease(flag, value, site);
}

// The thread waits until a peer stores to the flag: the scheduler runs the block's other
// threads meanwhile, and other devices, and reports a wait no device can ever meet.
inline void FlagWaitPoint(const uint32_t* flag, uint32_t target) { simt::AwaitFlag(flag, target); }

// The launch's peer group (simt::ScopedPeerLaunch) and the peers' memory, registered as
// buffers the launch may touch (simt::ScopedBuffers, nested in the handler's).
struct PeerLaunchRecord {
  PeerLaunchRecord(uint64_t group, int position, int size) : launch(group, position, size) {}
  void AddMemory(const char* name, const void* base, size_t bytes) {
    buffers.Add(name, base, bytes);
  }
  simt::ScopedPeerLaunch launch;
  simt::ScopedBuffers buffers;
};

}  // namespace fp8norm

#endif
