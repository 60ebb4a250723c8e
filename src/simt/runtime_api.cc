// The SIMT emulation's CUDA runtime API: the cuda* functions of cuda_runtime.h, the
// registry of what the runtime knows of each kernel, the emulated device's limits, the
// errors injected for tests and the records of past launches; and simt.h's controls of
// them. A launch is checked here (launch_check.h), then run by the calling OS thread's
// scheduler (scheduler.h) while its memory accounting (memory_accounting.h) counts.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <iterator>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "launch_check.h"
#include "memory_accounting.h"
#include "sanitizers.h"
#include "scheduler.h"
#include "simt.h"

namespace simt {
namespace {

using internal::KernelRecord;

// What the runtime calls of every OS thread share.
struct Shared {
  std::mutex mutex;
  DeviceLimits limits;
  std::unordered_map<const void*, KernelRecord> kernels;
  std::unordered_map<std::string, std::pair<cudaError_t, int>> injected;  // error, calls left
  std::deque<LaunchRecord> launches;
};

Shared& Global() {
  static Shared* shared = new Shared;  // never destroyed: launches may run at exit
  return *shared;
}

// What the runtime knows of `kernel`; all defaults for one it has never heard of.
KernelRecord RecordOf(const Shared& g, const void* kernel) {
  auto it = g.kernels.find(kernel);
  return it == g.kernels.end() ? KernelRecord{} : it->second;
}

// The runtime's own lock, which every launch takes, orders nothing for ThreadSanitizer:
// two devices' launches are ordered only by their kernels' flags (peer_signals.cc).
void Keep(LaunchRecord record) {
  HiddenSync hidden;
  Shared& g = Global();
  std::lock_guard<std::mutex> lock(g.mutex);
  g.launches.push_back(std::move(record));
  if (g.launches.size() > 4096) g.launches.pop_front();
}

// Per OS thread, as the CUDA runtime keeps its error state per host thread.
struct ThreadErrors {
  cudaError_t last_error = cudaSuccess;
  std::string last_failure;  // the last failed call's description, for cudaGetErrorString
};

thread_local ThreadErrors errors;
thread_local bool capturing = false;
thread_local int current_device = 0;

cudaError_t SetError(cudaError_t error) {
  if (error != cudaSuccess) errors.last_error = error;
  return error;
}

// The error injected for this call of `function`, or cudaSuccess.
cudaError_t Injected(const char* function) {
  HiddenSync hidden;  // see Keep
  Shared& g = Global();
  std::lock_guard<std::mutex> lock(g.mutex);
  auto it = g.injected.find(function);
  if (it == g.injected.end()) return cudaSuccess;
  const cudaError_t error = it->second.first;
  if (--it->second.second <= 0) g.injected.erase(it);
  return error;
}

// A call that loads a module or changes a kernel: refused inside capture, or injected.
cudaError_t Refusal(const char* function, bool loads_module) {
  if (loads_module && capturing) return cudaErrorStreamCaptureUnsupported;
  return Injected(function);
}

size_t PaddedStatic(size_t bytes) { return (bytes + 15) / 16 * 16; }

// Fresh device memory holds what was there before, which a kernel must not read before
// writing (compute-sanitizer's initcheck). Here every word of every allocation differs:
// one byte repeated would give every device of a group that forgets to zero its
// workspace the same epochs, one ahead of equal flags, a protocol that agrees with
// itself and passes; words that differ by allocation and offset make the devices
// disagree, so the missing zeroing fails the check. Numbered, not hashed from the
// address, so that a run repeats.
void Poison(uint32_t* words, size_t count) {
  static std::atomic<uint64_t> allocations{0};
  uint64_t s = (allocations.fetch_add(1, std::memory_order_relaxed) + 1) * 0x9e3779b97f4a7c15ull;
  for (size_t i = 0; i < count; ++i) {
    s += 0x9e3779b97f4a7c15ull;
    uint64_t z = s;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    words[i] = static_cast<uint32_t>(z ^ (z >> 31));
  }
}

}  // namespace

// ------------------------------------------------------------------ kernel registry

void DeclareKernel(const void* kernel, const char* name, size_t static_bytes, int max_threads) {
  Shared& g = Global();
  std::lock_guard<std::mutex> lock(g.mutex);
  KernelRecord& record = g.kernels[kernel];
  record.static_shared = PaddedStatic(static_bytes);
  record.name = name;
  record.max_threads = max_threads;
}

cudaError_t SetMaxDynamicShared(const void* kernel, int bytes) {
  if (const cudaError_t e = Refusal("cudaFuncSetAttribute", true)) return SetError(e);
  Shared& g = Global();
  std::lock_guard<std::mutex> lock(g.mutex);
  const size_t static_bytes = RecordOf(g, kernel).static_shared;
  // The runtime's rule: the attribute plus the kernel's static shared memory may not
  // exceed the opt-in limit.
  if (bytes < 0 || static_cast<size_t>(bytes) + static_bytes >
                       static_cast<size_t>(g.limits.shared_per_block_optin)) {
    errors.last_failure = "cudaFuncSetAttribute: " + std::to_string(bytes) +
                          " bytes of dynamic shared memory beside " + std::to_string(static_bytes) +
                          " static exceed the device's " +
                          std::to_string(g.limits.shared_per_block_optin);
    return SetError(cudaErrorInvalidValue);
  }
  g.kernels[kernel].max_dynamic_shared = bytes;
  return cudaSuccess;
}

cudaError_t GetFuncAttributes(const void* kernel, cudaFuncAttributes* attributes) {
  if (const cudaError_t e = Refusal("cudaFuncGetAttributes", true)) return SetError(e);
  Shared& g = Global();
  std::lock_guard<std::mutex> lock(g.mutex);
  const KernelRecord record = RecordOf(g, kernel);
  attributes->sharedSizeBytes = record.static_shared;
  attributes->maxThreadsPerBlock =
      record.max_threads ? std::min(*record.max_threads, g.limits.max_threads_per_block)
                         : g.limits.max_threads_per_block;
  attributes->maxDynamicSharedSizeBytes =
      record.max_dynamic_shared
          ? *record.max_dynamic_shared
          : std::max(0, g.limits.shared_per_block - static_cast<int>(record.static_shared));
  return cudaSuccess;
}

// ------------------------------------------------------------------ launch

cudaError_t Launch(const void* kernel, const cudaLaunchConfig_t& config, ThreadBody thread_body,
                   const void* kernel_and_args) {
  // The kernel's threads see the launch's state through the scheduler, not through
  // anything ThreadSanitizer sees; the block's start and end order the kernel's memory.
  Bookkeeping hidden;
  internal::Scheduler& scheduler = internal::Scheduler::OfThisThread();
  if (scheduler.InKernel()) return SetError(cudaErrorInvalidConfiguration);  // from a kernel
  if (const cudaError_t e = Injected("cudaLaunchKernelEx")) return SetError(e);
  DeviceLimits limits;
  KernelRecord kernel_record;
  {
    HiddenSync hidden_lock;
    Shared& g = Global();
    std::lock_guard<std::mutex> lock(g.mutex);
    limits = g.limits;
    kernel_record = RecordOf(g, kernel);
  }
  internal::MemoryAccounting& accounting = internal::MemoryAccounting::OfThisThread();
  LaunchRecord record;
  record.blocks = config.gridDim.x;
  record.threads = config.blockDim.x;
  record.dynamic_shared_bytes = config.dynamicSmemBytes;
  record.static_shared_bytes = kernel_record.static_shared;
  record.kernel = kernel_record.name;
  if (const std::optional<internal::LaunchRefusal> refusal =
          internal::CheckLaunch(config, kernel_record, limits)) {
    errors.last_failure = "invalid launch: " + refusal->message;
    record.error = errors.last_failure;
    record.buffers = accounting.ZeroStats();
    Keep(std::move(record));
    return SetError(refusal->code);
  }

  internal::KernelRun run;
  run.body = thread_body;
  run.kernel_and_args = kernel_and_args;
  run.grid = config.gridDim;
  run.block = config.blockDim;
  run.dynamic_shared_bytes = config.dynamicSmemBytes;
  run.static_shared_bytes = kernel_record.static_shared;
  accounting.BeginLaunch(run.block.x);
  internal::RunOutcome outcome = scheduler.Run(run);
  record.buffers = accounting.EndLaunch();
  record.barriers = outcome.barriers;
  record.shuffles = outcome.shuffles;
  if (outcome.failure) {
    errors.last_failure = "unspecified launch failure (emulated): " + *outcome.failure;
    record.error = errors.last_failure;
  }
  Keep(std::move(record));
  return outcome.failure ? SetError(cudaErrorLaunchFailure) : cudaSuccess;
}

// ------------------------------------------------------------------ host side

void SetDeviceLimits(const DeviceLimits& limits) {
  Shared& g = Global();
  std::lock_guard<std::mutex> lock(g.mutex);
  g.limits = limits;
  // Another device: attributes start over.
  for (auto& [kernel, record] : g.kernels) record.max_dynamic_shared.reset();
}

DeviceLimits GetDeviceLimits() {
  Shared& g = Global();
  std::lock_guard<std::mutex> lock(g.mutex);
  return g.limits;
}

void InjectError(const std::string& function, int error, int count) {
  Shared& g = Global();
  std::lock_guard<std::mutex> lock(g.mutex);
  if (count <= 0) {
    g.injected.erase(function);
  } else {
    g.injected[function] = {static_cast<cudaError_t>(error), count};
  }
}

ScopedCapture::ScopedCapture() : previous_(capturing) { capturing = true; }
ScopedCapture::~ScopedCapture() { capturing = previous_; }

std::vector<LaunchRecord> TakeLaunches() {
  Shared& g = Global();
  std::lock_guard<std::mutex> lock(g.mutex);
  std::vector<LaunchRecord> out(std::make_move_iterator(g.launches.begin()),
                                std::make_move_iterator(g.launches.end()));
  g.launches.clear();
  return out;
}

}  // namespace simt

// ------------------------------------------------------------------ runtime API

cudaError_t cudaGetLastError() {
  const cudaError_t error = simt::errors.last_error;
  simt::errors.last_error = cudaSuccess;
  return error;
}

cudaError_t cudaPeekAtLastError() { return simt::errors.last_error; }

const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
    case cudaErrorInvalidConfiguration:
    case cudaErrorLaunchOutOfResources:
    case cudaErrorLaunchFailure:
      return simt::errors.last_failure.empty() ? "emulated launch error"
                                               : simt::errors.last_failure.c_str();
    case cudaErrorInvalidDevice:
      return "invalid device ordinal";
    case cudaErrorMemoryAllocation:
      return "out of memory";
    case cudaErrorPeerAccessAlreadyEnabled:
      return "peer access is already enabled";
    case cudaErrorInvalidDeviceFunction:
      return "invalid device function";
    case cudaErrorStreamCaptureUnsupported:
      return "operation not permitted when stream is capturing";
    default:
      return "unknown error";
  }
}

cudaError_t cudaGetDevice(int* device) {
  *device = simt::current_device;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= simt::kEmulatedDevices) {
    return simt::SetError(cudaErrorInvalidDevice);
  }
  simt::current_device = device;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceCount(int* count) {
  *count = simt::kEmulatedDevices;
  return cudaSuccess;
}

cudaError_t cudaMalloc(void** pointer, size_t bytes) {
  const size_t rounded = (bytes + 255) / 256 * 256;
  *pointer = bytes == 0 ? nullptr : std::aligned_alloc(256, rounded);
  if (*pointer == nullptr) {
    return bytes == 0 ? cudaSuccess : simt::SetError(cudaErrorMemoryAllocation);
  }
  simt::Poison(static_cast<uint32_t*>(*pointer), rounded / 4);
  return cudaSuccess;
}

cudaError_t cudaFree(void* pointer) {
  std::free(pointer);
  return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned) {
  static char streams;  // any address will do: no stream is ever dereferenced
  *stream = reinterpret_cast<cudaStream_t>(&streams);
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }

cudaError_t cudaStreamDestroy(cudaStream_t) { return cudaSuccess; }

cudaError_t cudaDeviceCanAccessPeer(int* can_access, int device, int peer) {
  const auto valid = [](int d) { return d >= 0 && d < simt::kEmulatedDevices; };
  if (!valid(device) || !valid(peer)) return simt::SetError(cudaErrorInvalidDevice);
  *can_access = device != peer;
  return cudaSuccess;
}

cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned flags) {
  if (peer < 0 || peer >= simt::kEmulatedDevices || peer == simt::current_device || flags != 0) {
    return simt::SetError(cudaErrorInvalidValue);
  }
  return cudaSuccess;
}

cudaError_t cudaRuntimeGetVersion(int* version) {
  *version = CUDART_VERSION;
  return cudaSuccess;
}

cudaError_t cudaDriverGetVersion(int* version) {
  *version = CUDART_VERSION;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attribute, int device) {
  if (device < 0 || device >= simt::kEmulatedDevices) return simt::SetError(cudaErrorInvalidDevice);
  if (const cudaError_t e = simt::Injected("cudaDeviceGetAttribute")) return simt::SetError(e);
  const simt::DeviceLimits limits = simt::GetDeviceLimits();
  switch (attribute) {
    case cudaDevAttrMaxThreadsPerBlock:
      *value = limits.max_threads_per_block;
      return cudaSuccess;
    case cudaDevAttrMaxGridDimX:
      *value = static_cast<int>(std::min<int64_t>(limits.max_grid_x, 2147483647));
      return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlock:
      *value = limits.shared_per_block;
      return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin:
      *value = limits.shared_per_block_optin;
      return cudaSuccess;
    case cudaDevAttrReservedSharedMemoryPerBlock:
      *value = limits.reserved_per_block;
      return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerMultiprocessor:
      *value = limits.shared_per_multiprocessor;
      return cudaSuccess;
    case cudaDevAttrMultiProcessorCount:
      *value = limits.multiprocessors;
      return cudaSuccess;
  }
  return simt::SetError(cudaErrorInvalidValue);
}

cudaError_t cudaMemsetAsync(void* pointer, int value, size_t bytes, cudaStream_t) {
  const simt::internal::MemoryAccounting& accounting =
      simt::internal::MemoryAccounting::OfThisThread();
  const auto at = reinterpret_cast<uintptr_t>(pointer);
  if (accounting.ChecksAccesses() && accounting.FindBuffer(at, bytes) < 0) {
    simt::errors.last_failure =
        "cudaMemsetAsync of " + std::to_string(bytes) + " bytes outside every buffer of the launch";
    return simt::SetError(cudaErrorInvalidValue);
  }
  std::memset(pointer, value, bytes);
  return cudaSuccess;
}
