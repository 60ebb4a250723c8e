// What kernel_check's parts share (kernel_check.cc, training_check.cc): the emulated
// devices' limits, the inputs' random numbers, buffers of exactly their size, the
// byte-for-byte comparison with the CPU kernel, and the launch paths reached.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <map>
#include <memory>
#include <new>
#include <string>

#include "cuda_kernels.h"
#include "fp8norm_math.h"
#include "simt.h"

namespace fp8norm {

struct Limits {
  const char* name;
  int shared_per_block;
  int shared_per_block_optin;
  int64_t max_grid_x;
};

// A Hopper GPU; a device whose opt-in shared memory barely holds a short row (rows past
// about 900 float32 are re-read); one that needs the opt-in beyond 2 KiB; a grid of at
// most 3 blocks, so each block strides over several rows.
inline constexpr Limits kLimits[] = {
    {"hopper", 48 * 1024, 232448, 2147483647}, {"optin-4k", 4096, 4096, 2147483647},
    {"default-2k", 2048, 16384, 2147483647},   {"grid-3", 48 * 1024, 232448, 3},
    {"grid-1", 48 * 1024, 232448, 1},
};

struct Rng {
  uint64_t s;
  uint64_t Next() {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return s;
  }
  float Uniform() { return static_cast<float>(Next() >> 40) * (1.0f / 16777216.0f); }
  float Normal() {
    const float u = std::max(Uniform(), 1e-7f), v = Uniform();
    return std::sqrt(-2.0f * std::log(u)) * std::cos(6.2831853f * v);
  }
};

// A heap buffer of exactly `bytes` bytes, starting `misalign` bytes past an aligned
// address: the allocation is misalign + bytes long, so its end is the buffer's end.
struct ExactBuffer {
  // 256-byte aligned, as cudaMalloc's, so that `misalign` alone decides the alignment the
  // launch plan sees (malloc's 16 bytes would leave a 32-byte vector of float32 gamma to
  // wherever the heap happens to put it).
  static constexpr std::align_val_t kAlignment{256};
  struct Free {
    void operator()(unsigned char* p) const { ::operator delete[](p, kAlignment); }
  };
  std::unique_ptr<unsigned char[], Free> storage;
  unsigned char* data;
  size_t bytes;
  ExactBuffer(size_t n, size_t misalign = 0)
      : storage(static_cast<unsigned char*>(::operator new[](misalign + n, kAlignment))),
        data(storage.get() + misalign),
        bytes(n) {
    std::memset(storage.get(), 0xa5, misalign + n);
  }
};

inline void Fill(ExactBuffer& b, FloatType type, int64_t rows, int64_t hidden, Rng& rng,
                 bool specials, float spread) {
  for (int64_t r = 0; r < rows; ++r) {
    const float magnitude = std::pow(10.0f, spread * (2.0f * rng.Uniform() - 1.0f));
    for (int64_t c = 0; c < hidden; ++c) {
      float v = rng.Normal() * magnitude;
      if (specials) {
        if (r % 7 == 1) v = 0.0f;
        if (r % 7 == 3 && c == hidden / 2) v = INFINITY;
        if (r % 7 == 5 && c == hidden - 1) v = NAN;
      }
      StoreAs(type, b.data, r * hidden + c, v);
    }
  }
}

inline bool SameBytes(const ExactBuffer& got, const ExactBuffer& want, const std::string& what,
                      const std::string& name) {
  if (std::memcmp(got.data, want.data, got.bytes) == 0) return true;
  size_t i = 0;
  while (got.data[i] == want.data[i]) ++i;
  std::printf("FAIL %s: %s differs from the CPU kernel first at byte %zu (0x%02x, want 0x%02x)\n",
              name.c_str(), what.c_str(), i, got.data[i], want.data[i]);
  return false;
}

inline const char* TypeName(FloatType t) {
  return t == FloatType::kF32    ? "f32"
         : t == FloatType::kF16  ? "f16"
         : t == FloatType::kE8M0 ? "e8m0"
         : t == FloatType::kE4M3 ? "e4m3"
                                 : "bf16";
}

// Registers each buffer as the launch's global memory under its name; a null one is left
// out (an operand the case does not have).
struct NamedBuffer {
  const char* name;
  const ExactBuffer* buffer;
};
inline void AddBuffers(simt::ScopedBuffers& buffers, std::initializer_list<NamedBuffer> named) {
  for (const NamedBuffer& n : named) {
    if (n.buffer != nullptr) buffers.Add(n.name, n.buffer->data, n.buffer->bytes);
  }
}

// The launch paths a check reached, with how often.
struct Coverage {
  std::map<std::string, int> paths;
  void Add(const std::string& path) { paths[path] += 1; }
};

// NVFP4 with per-row global scales against the CPU kernel (per_row_check.cc).
int CheckPerRowGlobalScales(bool quick);

inline void UseDevice(const Limits& limits) {
  simt::DeviceLimits device;
  device.shared_per_block = limits.shared_per_block;
  device.shared_per_block_optin = limits.shared_per_block_optin;
  device.shared_per_multiprocessor = limits.shared_per_block_optin + device.reserved_per_block;
  device.max_grid_x = limits.max_grid_x;
  simt::SetDeviceLimits(device);
  ForgetDeviceSetups();
}

}  // namespace fp8norm
