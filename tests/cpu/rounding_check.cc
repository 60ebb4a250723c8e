// The AVX2 vector forms of cpu_avx2.h against the scalar definitions of fp8norm_math.h,
// on every input they can take: all 2^32 float32 bit patterns for the FP8 codes
// (e4m3fn and e4m3fnuz, saturating; the path without NaN tests on every non-NaN one)
// and the bfloat16 / float16 stores, all 2^16 patterns
// for the 16-bit loads. Once with the default floating-point environment and once with
// denormals flushed (FTZ + DAZ, as XLA's CPU threads run), split over the machine's
// cores. Prints the first mismatches and exits non-zero on any; exits 0 without checking
// on a CPU without AVX2 + FMA + F16C, saying so.
#include <immintrin.h>

#include <atomic>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "cpu_avx2.h"
#include "fp8norm_math.h"

namespace fp8norm {
namespace {

namespace v = avx2_lanes;

std::atomic<int64_t> mismatches{0};

void Report(const char* what, uint32_t input, uint32_t got, uint32_t want) {
  if (mismatches.fetch_add(1) < 10) {
    std::printf("MISMATCH %s: input 0x%08" PRIx32 ": vector 0x%" PRIx32 ", scalar 0x%" PRIx32 "\n",
                what, input, got, want);
  }
}

// Inputs [first, first + count) of the 32-bit patterns, 32 at a time.
__attribute__((target("avx2,fma,f16c"))) void CheckFloats(uint64_t first, uint64_t count,
                                                          bool flush) {
  if (flush) _mm_setcsr(_mm_getcsr() | 0x8040);  // FTZ | DAZ
  alignas(32) uint32_t bits[32];
  alignas(32) uint8_t fn[32], fnuz[32], fn_finite[32], fnuz_finite[32];
  alignas(16) uint16_t bf16[32], f16[32];
  for (uint64_t base = first; base < first + count; base += 32) {
    for (int k = 0; k < 32; ++k) bits[k] = static_cast<uint32_t>(base + k);
    __m256 x[4];
    for (int i = 0; i < 4; ++i) {
      x[i] = _mm256_load_ps(reinterpret_cast<const float*>(bits + 8 * i));
      v::Store(reinterpret_cast<BF16*>(bf16 + 8 * i), x[i]);
      v::Store(reinterpret_cast<F16*>(f16 + 8 * i), x[i]);
    }
    _mm256_store_si256(reinterpret_cast<__m256i*>(fn),
                       v::Fp8Bytes<Fp8Format::kE4M3FN, true>(x[0], x[1], x[2], x[3]));
    _mm256_store_si256(reinterpret_cast<__m256i*>(fnuz),
                       v::Fp8Bytes<Fp8Format::kE4M3FNUZ, true>(x[0], x[1], x[2], x[3]));
    _mm256_store_si256(reinterpret_cast<__m256i*>(fn_finite),
                       v::Fp8Bytes<Fp8Format::kE4M3FN, false>(x[0], x[1], x[2], x[3]));
    _mm256_store_si256(reinterpret_cast<__m256i*>(fnuz_finite),
                       v::Fp8Bytes<Fp8Format::kE4M3FNUZ, false>(x[0], x[1], x[2], x[3]));
    for (int k = 0; k < 32; ++k) {
      const float f = FloatOf(bits[k]);
      const uint32_t want_fn = Fp8Code<Fp8Format::kE4M3FN, true>(f);
      const uint32_t want_fnuz = Fp8Code<Fp8Format::kE4M3FNUZ, true>(f);
      if (fn[k] != want_fn) Report("e4m3fn", bits[k], fn[k], want_fn);
      if (fnuz[k] != want_fnuz) Report("e4m3fnuz", bits[k], fnuz[k], want_fnuz);
      // The path for lanes known not to be NaN, on every other input (Inf included).
      if (!IsNan(f) && fn_finite[k] != want_fn) {
        Report("e4m3fn, no NaN", bits[k], fn_finite[k], want_fn);
      }
      if (!IsNan(f) && fnuz_finite[k] != want_fnuz) {
        Report("e4m3fnuz, no NaN", bits[k], fnuz_finite[k], want_fnuz);
      }
      if (bf16[k] != ToBF16(f).bits) Report("bfloat16", bits[k], bf16[k], ToBF16(f).bits);
      if (f16[k] != ToF16(f).bits) Report("float16", bits[k], f16[k], ToF16(f).bits);
    }
  }
}

// Every 16-bit pattern through the vector loads. A float16 signalling NaN comes back
// quiet from the hardware conversion (cpu_avx2.h): for NaNs only NaN-ness is compared.
__attribute__((target("avx2,fma,f16c"))) void CheckLoads(bool flush) {
  if (flush) _mm_setcsr(_mm_getcsr() | 0x8040);
  alignas(16) uint16_t halves[8];
  alignas(32) uint32_t from_bf16[8], from_f16[8];
  for (uint32_t base = 0; base < 0x10000u; base += 8) {
    for (int k = 0; k < 8; ++k) halves[k] = static_cast<uint16_t>(base + k);
    _mm256_store_ps(reinterpret_cast<float*>(from_bf16),
                    v::Load(reinterpret_cast<const BF16*>(halves)));
    _mm256_store_ps(reinterpret_cast<float*>(from_f16),
                    v::Load(reinterpret_cast<const F16*>(halves)));
    for (int k = 0; k < 8; ++k) {
      const uint32_t want_bf16 = BitsOf(ToFloat(BF16{halves[k]}));
      const uint32_t want_f16 = BitsOf(ToFloat(F16{halves[k]}));
      if (from_bf16[k] != want_bf16) Report("bfloat16 load", halves[k], from_bf16[k], want_bf16);
      const bool both_nan = IsNan(FloatOf(from_f16[k])) && IsNan(FloatOf(want_f16));
      if (from_f16[k] != want_f16 && !both_nan) {
        Report("float16 load", halves[k], from_f16[k], want_f16);
      }
    }
  }
}

int Run() {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") ||
      !__builtin_cpu_supports("f16c")) {
    std::printf("rounding_check: this CPU lacks AVX2 + FMA + F16C; nothing checked\n");
    return 0;
  }
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  for (const bool flush : {false, true}) {
    CheckLoads(flush);
    constexpr uint64_t kAll = uint64_t{1} << 32;
    const uint64_t share = (kAll / threads + 31) / 32 * 32;
    std::vector<std::thread> workers;
    for (unsigned t = 0; t < threads; ++t) {
      const uint64_t first = t * share;
      if (first >= kAll) break;
      const uint64_t count = std::min(share, kAll - first);
      workers.emplace_back(CheckFloats, first, count, flush);
    }
    for (auto& worker : workers) worker.join();
    std::printf(
        "rounding_check: all 2^32 float32 inputs and 2^16 16-bit inputs, denormals %s: "
        "%" PRId64 " mismatches so far\n",
        flush ? "flushed" : "kept", mismatches.load());
  }
  return mismatches.load() == 0 ? 0 : 1;
}

}  // namespace
}  // namespace fp8norm

int main() { return fp8norm::Run(); }
