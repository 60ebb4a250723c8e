// Host-side controls of the SIMT emulation (docs/simt.md): the emulated device's limits,
// the global buffers a launch may touch, and what each launch did with global memory.
// Used by the Python module of the emulated kernels and by the sanitizer driver.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace simt {

// The emulated devices, all alike (DeviceLimits): as many as XLA's CPU client may be
// asked for virtual devices in a test. cudaSetDevice selects one per OS thread.
constexpr int kEmulatedDevices = 16;

// An H100 / H200 (sm_90) by default.
struct DeviceLimits {
  int max_threads_per_block = 1024;
  int64_t max_grid_x = 2147483647;
  int shared_per_block = 48 * 1024;     // static + dynamic, without opting in
  int shared_per_block_optin = 232448;  // static + dynamic with the attribute: 227 KiB
  int reserved_per_block = 1024;        // the system's share of each block (sm_80 on)
  int shared_per_multiprocessor = 233472;
  int multiprocessors = 132;
};

// Another device: the limits change and every kernel attribute starts over, as after
// cudaDeviceReset.
void SetDeviceLimits(const DeviceLimits& limits);
DeviceLimits GetDeviceLimits();

// Makes the next `count` calls of the runtime function `function` ("cudaFuncSetAttribute",
// "cudaFuncGetAttributes", "cudaDeviceGetAttribute", "cudaLaunchKernelEx") fail with
// `error`, as a driver may; count 0 clears it.
void InjectError(const std::string& function, int error, int count);

// While the guard lives, the calling OS thread's runtime calls behave as in CUDA graph
// capture on a driver older than R545: calls that may load a module or change a kernel's
// attributes (cudaFuncGetAttributes, cudaFuncSetAttribute) fail with
// cudaErrorStreamCaptureUnsupported.
class ScopedCapture {
 public:
  ScopedCapture();
  ~ScopedCapture();
  ScopedCapture(const ScopedCapture&) = delete;
  ScopedCapture& operator=(const ScopedCapture&) = delete;

 private:
  bool previous_;
};

// Seeds the order in which each block's threads are resumed (reproducible for one seed);
// returns the seed it replaces.
uint64_t SetScheduleSeed(uint64_t seed);

// What one launch did with one global buffer. A request is one warp-wide access: the
// accesses the warp's lanes make at one place of the source between two points where the
// warp meets (shuffles, barriers). `sectors` counts the 32-byte sectors each request
// touched; `min_sectors` the fewest that could hold the bytes it asked for, from where
// they start: a fully coalesced kernel has the two equal.
struct BufferStats {
  std::string name;
  uint64_t bytes = 0;  // the buffer's size
  uint64_t bytes_read = 0;
  uint64_t bytes_written = 0;
  uint64_t requests = 0;
  uint64_t sectors = 0;
  uint64_t min_sectors = 0;
  uint32_t widest_access = 0;  // bytes of the widest single load or store
};

struct LaunchRecord {
  std::string error;  // empty when the launch succeeded
  unsigned blocks = 0;
  unsigned threads = 0;
  size_t dynamic_shared_bytes = 0;
  size_t static_shared_bytes = 0;  // as the kernel's attributes report it
  std::string kernel;              // the name the kernel was declared with, if any
  uint64_t barriers = 0;           // completed __syncthreads, summed over blocks
  uint64_t shuffles = 0;           // completed warp shuffles, summed over warps
  std::vector<BufferStats> buffers;
};

// The global buffers the calling OS thread's launches may touch, while the guard lives.
// With buffers registered, any access outside all of them fails the launch (without
// being performed); with none, accesses are not checked. Guards nest: an inner one adds
// buffers (a peer's memory) to the outer one's until it ends.
class ScopedBuffers {
 public:
  ScopedBuffers();
  ~ScopedBuffers();
  ScopedBuffers(const ScopedBuffers&) = delete;
  ScopedBuffers& operator=(const ScopedBuffers&) = delete;
  void Add(const char* name, const void* base, size_t bytes);

 private:
  size_t outer_count_;
};

// While the guard lives, the calling OS thread's launches are those of the device at
// `position` of the peer group `group` (any key the devices agree on) of `size` devices,
// which run their launches at the same time on their own OS threads and wait for each
// other's flags (cuda_runtime.h's AwaitFlag). A wait that no device of the group can ever
// meet fails every waiting launch of the group, with a report of what each device waits
// for (docs/simt.md, "Several devices").
class ScopedPeerLaunch {
 public:
  ScopedPeerLaunch(uint64_t group, int position, int size);
  ~ScopedPeerLaunch();
  ScopedPeerLaunch(const ScopedPeerLaunch&) = delete;
  ScopedPeerLaunch& operator=(const ScopedPeerLaunch&) = delete;
};

// While the guard lives, the calling OS thread promises to begin another launch of the
// peer group `group`, as the device at `position`, right after each one ends, and the
// group keeps its turn for that launch: it begins before any peer resumes, as a GPU's
// stream may start a device's next call while its peers are still in this one. A kernel
// that overwrites memory its peers may still read (a buffer not doubled) then does so
// before they read it, in every run, not only in an unlucky one. The guard's end gives
// the turn back.
class ScopedPeerRunAhead {
 public:
  ScopedPeerRunAhead(uint64_t group, int position);
  ~ScopedPeerRunAhead();
  ScopedPeerRunAhead(const ScopedPeerRunAhead&) = delete;
  ScopedPeerRunAhead& operator=(const ScopedPeerRunAhead&) = delete;

 private:
  uint64_t group_;
  int position_;
};

// While the guard lives, the calling OS thread's launches run only the blocks
// `first <= blockIdx.x < last` of their grid; the others are skipped as if they had run
// without touching memory. For a grid whose work at a far index is what a check needs
// (tests/simt/index_check.cc: rows past element 2^31), at the cost of a few blocks.
class ScopedBlockWindow {
 public:
  ScopedBlockWindow(unsigned first, unsigned last);
  ~ScopedBlockWindow();
  ScopedBlockWindow(const ScopedBlockWindow&) = delete;
  ScopedBlockWindow& operator=(const ScopedBlockWindow&) = delete;

 private:
  unsigned previous_first_, previous_last_;
};

// Every launch recorded since the last call, from every OS thread, oldest first (the
// latest 4096 at most).
std::vector<LaunchRecord> TakeLaunches();

}  // namespace simt
