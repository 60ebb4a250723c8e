// The SIMT emulation's own promises, each held by a small deliberately wrong or
// order-sensitive kernel: a shuffle or barrier that can never complete is an error and not
// a hang; a bad mask, an access outside the launch's buffers and a misaligned vector
// access fail the launch without being made; blocks run last first; the launch limits are
// enforced. Run by kernel_check before the kernels themselves.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "device_memory.h"
#include "simt.h"

namespace {

using fp8norm::LoadGlobal;
using fp8norm::StoreGlobal;

__global__ void LaneExitsBeforeShuffle(uint32_t* out) {
  if (threadIdx.x == 7) return;  // lane 7 never reaches the shuffle the others wait in
  StoreGlobal(out + threadIdx.x, __shfl_xor_sync(0xffffffffu, threadIdx.x, 1));
}

__global__ void ThreadExitsBeforeBarrier(uint32_t* out) {
  if (threadIdx.x == 40) return;
  __syncthreads();
  StoreGlobal(out + threadIdx.x, 1u);
}

__global__ void MaskWithoutSelf(uint32_t* out) {
  StoreGlobal(out + threadIdx.x, __shfl_xor_sync(0x0000ffffu, threadIdx.x, 1));
}

__global__ void OnePastTheEnd(uint32_t* out) { StoreGlobal(out + threadIdx.x + 1, 1u); }

struct alignas(16) Four {
  uint32_t v[4];
};

__global__ void MisalignedVector(const uint32_t* in, uint32_t* out) {
  const Four f = LoadGlobal(reinterpret_cast<const Four*>(in + 1) + threadIdx.x);
  StoreGlobal(out + threadIdx.x, f.v[0]);
}

// Each block appends its index: the order blocks ran in.
__global__ void BlockOrder(uint32_t* order, uint32_t* count) {
  if (threadIdx.x == 0) {
    const uint32_t n = LoadGlobal(count);
    StoreGlobal(order + n, blockIdx.x);
    StoreGlobal(count, n + 1);
  }
}

// Shuffles and barriers used correctly: every lane gets its partner's value.
__global__ void Exchange(uint32_t* out) {
  const uint32_t mine = threadIdx.x * 3 + 1;
  __syncthreads();
  StoreGlobal(out + threadIdx.x, __shfl_xor_sync(0xffffffffu, mine, 5));
}

// Lane i reads element i (one 128-byte line: 4 sectors), then element 8 i (32 bytes
// apart: 32 sectors for the same 128 bytes).
__global__ void CoalescedThenStrided(const uint32_t* in, uint32_t* out) {
  const uint32_t a = LoadGlobal(in + threadIdx.x);
  const uint32_t b = LoadGlobal(in + 8 * threadIdx.x);
  StoreGlobal(out + threadIdx.x, a + b);
}

struct Scratch {
  uint32_t v[100];  // 400 bytes
};

// Static shared memory as a kernel declares it; the launch knows its size beforehand.
__global__ void UsesStatic(uint32_t* out) {
  Scratch& s = fp8norm::StaticShared<Scratch>();
  s.v[threadIdx.x] = threadIdx.x;
  __syncthreads();
  StoreGlobal(out + threadIdx.x, s.v[31 - threadIdx.x]);
}

int failures = 0;

template <typename... Params, typename... Args>
cudaError_t Run(void (*kernel)(Params...), unsigned blocks, unsigned threads, size_t shared,
                Args... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(blocks);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = shared;
  return cudaLaunchKernelEx(&config, kernel, args...);
}

void Expect(const char* what, bool ok, const std::string& detail) {
  std::printf("%s %s%s%s\n", ok ? "PASS" : "FAIL", what, detail.empty() ? "" : ": ",
              detail.c_str());
  failures += ok ? 0 : 1;
}

// The launch fails, with a message containing `words`.
void ExpectFailure(const char* what, cudaError_t status, const char* words) {
  const std::string message = cudaGetErrorString(status);
  cudaGetLastError();
  Expect(what, status != cudaSuccess && message.find(words) != std::string::npos, message);
}

}  // namespace

namespace fp8norm {

int CheckEmulator() {
  // 64 elements known to the launch and a sentinel past them.
  std::vector<uint32_t> out(65, 0);
  simt::TakeLaunches();
  {
    simt::ScopedBuffers buffers;
    buffers.Add("out", out.data(), 64 * sizeof(uint32_t));
    ExpectFailure("a lane that exits is never waited for forever",
                  Run(LaneExitsBeforeShuffle, 1, 32, 0, out.data()), "never arrive");
    ExpectFailure("a barrier some thread never reaches is an error",
                  Run(ThreadExitsBeforeBarrier, 1, 64, 0, out.data()), "__syncthreads");
    ExpectFailure("a shuffle mask without the calling lane is an error",
                  Run(MaskWithoutSelf, 1, 32, 0, out.data()), "leaves out lane");
    ExpectFailure("a store one element past the buffer fails the launch",
                  Run(OnePastTheEnd, 1, 64, 0, out.data()), "outside every buffer");
    Expect("  ... and is not made", out[64] == 0, "");
    ExpectFailure("a block larger than the device allows is refused",
                  Run(Exchange, 1, 2048, 0, out.data()), "threads");
    ExpectFailure("dynamic shared memory beyond the default needs the opt-in",
                  Run(Exchange, 1, 32, 64 * 1024, out.data()), "the default limit allows 49152");
    Expect("the opt-in is granted up to the device's limit",
           cudaFuncSetAttribute(Exchange, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 * 1024) ==
               cudaSuccess,
           "");
    Expect("  ... and the launch then runs",
           Run(Exchange, 1, 32, 64 * 1024, out.data()) == cudaSuccess, "");
    bool exchanged = true;
    for (uint32_t t = 0; t < 32; ++t) exchanged = exchanged && out[t] == ((t ^ 5u) * 3 + 1);
    Expect("shuffles deliver the partner lane's value", exchanged, "");
    // Static shared memory counts against the same limits, as the runtime counts it.
    fp8norm::DeclareKernel(UsesStatic, "UsesStatic", 396, 64);
    cudaFuncAttributes attributes{};
    const bool got = cudaFuncGetAttributes(&attributes, UsesStatic) == cudaSuccess;
    Expect("a kernel's static shared memory is padded as ptxas pads it",
           got && attributes.sharedSizeBytes == 400, std::to_string(attributes.sharedSizeBytes));
    ExpectFailure("static and dynamic shared memory together beyond the default are refused",
                  Run(UsesStatic, 1, 32, 48 * 1024 - 399, out.data()), "beside 400 static");
    Expect("  ... and up to it run", Run(UsesStatic, 1, 32, 48 * 1024 - 400, out.data()) == 0, "");
    ExpectFailure(
        "an attribute beyond the opt-in limit less the static size is refused",
        cudaFuncSetAttribute(UsesStatic, cudaFuncAttributeMaxDynamicSharedMemorySize, 232448 - 399),
        "exceed");
    ExpectFailure("a block beyond the kernel's __launch_bounds__ is refused",
                  Run(UsesStatic, 1, 96, 0, out.data()), "__launch_bounds__ of 64");
    fp8norm::DeclareKernel(UsesStatic, "UsesStatic", 16, 64);
    ExpectFailure("a kernel using more static shared memory than it declares fails",
                  Run(UsesStatic, 1, 32, 0, out.data()), "declare 16");
    simt::InjectError("cudaFuncGetAttributes", cudaErrorInvalidDeviceFunction, 1);
    ExpectFailure("an injected error fails the named call once",
                  cudaFuncGetAttributes(&attributes, UsesStatic), "invalid device function");
    Expect("  ... and only once", cudaFuncGetAttributes(&attributes, UsesStatic) == 0, "");
    {
      simt::ScopedCapture capture;
      ExpectFailure("inside capture the attribute calls are refused",
                    cudaFuncGetAttributes(&attributes, UsesStatic), "capturing");
    }
  }
  {
    std::vector<uint32_t> in(1 + 4 * 32, 0);
    simt::ScopedBuffers buffers;
    buffers.Add("in", in.data(), in.size() * sizeof(uint32_t));
    buffers.Add("out", out.data(), 64 * sizeof(uint32_t));
    ExpectFailure("a misaligned 16-byte load fails the launch",
                  Run(MisalignedVector, 1, 31, 0, in.data(), out.data()), "misaligned");
  }
  {
    std::vector<uint32_t> order(5, 0), count(1, 0);
    simt::ScopedBuffers buffers;
    buffers.Add("order", order.data(), order.size() * sizeof(uint32_t));
    buffers.Add("count", count.data(), sizeof(uint32_t));
    const cudaError_t status = Run(BlockOrder, 5, 32, 0, order.data(), count.data());
    Expect("blocks run last first", status == cudaSuccess && order[0] == 4 && order[4] == 0,
           std::to_string(order[0]) + ".." + std::to_string(order[4]));
  }
  {
    std::vector<uint32_t> in(8 * 32, 1);
    simt::ScopedBuffers buffers;
    buffers.Add("in", in.data(), in.size() * sizeof(uint32_t));
    buffers.Add("out", out.data(), 64 * sizeof(uint32_t));
    simt::TakeLaunches();
    const bool ran = Run(CoalescedThenStrided, 1, 32, 0, in.data(), out.data()) == cudaSuccess;
    const std::vector<simt::LaunchRecord> launches = simt::TakeLaunches();
    const simt::BufferStats& read = launches.back().buffers[0];
    // From a 32-byte boundary: 4 + 32 sectors touched, 4 + 4 the fewest possible; one
    // sector more each from elsewhere.
    const bool aligned = reinterpret_cast<uintptr_t>(in.data()) % 32 == 0;
    Expect("sectors are counted per warp-wide request",
           ran && read.requests == 2 && read.bytes_read == 256 &&
               read.sectors == (aligned ? 36u : 37u) && read.min_sectors == (aligned ? 8u : 10u),
           std::to_string(read.requests) + " requests, " + std::to_string(read.sectors) +
               " sectors, " + std::to_string(read.min_sectors) + " at least");
  }
  simt::TakeLaunches();
  return failures;
}

}  // namespace fp8norm
