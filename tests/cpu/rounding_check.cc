// The CPU kernel's AVX2 vector code against the scalar definitions of fp8norm_math.h and
// the baseline variant's loops:
// - the FP8 codes (e4m3fn and e4m3fnuz, saturating; the path without NaN tests on every
//   non-NaN input), the FP4 codes (every non-NaN input) and the bfloat16 / float16 stores
//   on all 2^32 float32 bit patterns, the 16-bit loads on all 2^16;
// - NVFP4's and MXFP4's vector scales against Nvfp4Scale and Mxfp4Scale on a sixteenth
//   of all abs-max bit patterns,
//   and its vector quotient's codes against the two divisions on random and on
//   constructed tie and near-tie elements; the FP4 packing;
// - the vector sum of squares against the scalar one on 2^25 squares (NaN and Inf
//   included);
// - the AVX2 row load against the baseline's, lane by lane, on rows of 1 to 4099
//   elements.
// Once with the default floating-point environment and once with denormals flushed
// (FTZ + DAZ, as XLA's CPU threads run), split over the machine's cores. Prints the first
// mismatches and exits non-zero on any; exits 0 without checking on a CPU without
// AVX2 + FMA + F16C, saying so.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "cpu_avx2.h"
// The kernel's own row loops, both variants, to compare their lanes (they live in that
// file's anonymous namespace, so they are compiled into this check).
#include "cpu_kernels.cc"
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
  alignas(32) uint32_t fp4[32];
  for (uint64_t base = first; base < first + count; base += 32) {
    for (int k = 0; k < 32; ++k) bits[k] = static_cast<uint32_t>(base + k);
    __m256 x[4];
    for (int i = 0; i < 4; ++i) {
      x[i] = _mm256_load_ps(reinterpret_cast<const float*>(bits + 8 * i));
      v::Store(reinterpret_cast<BF16*>(bf16 + 8 * i), x[i]);
      v::Store(reinterpret_cast<F16*>(f16 + 8 * i), x[i]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(fp4 + 8 * i), v::Fp4Codes(x[i]));
    }
    _mm256_store_si256(reinterpret_cast<__m256i*>(fn),
                       v::Fp8Bytes<OutFormat::kE4M3FN, true>(x[0], x[1], x[2], x[3]));
    _mm256_store_si256(reinterpret_cast<__m256i*>(fnuz),
                       v::Fp8Bytes<OutFormat::kE4M3FNUZ, true>(x[0], x[1], x[2], x[3]));
    _mm256_store_si256(reinterpret_cast<__m256i*>(fn_finite),
                       v::Fp8Bytes<OutFormat::kE4M3FN, false>(x[0], x[1], x[2], x[3]));
    _mm256_store_si256(reinterpret_cast<__m256i*>(fnuz_finite),
                       v::Fp8Bytes<OutFormat::kE4M3FNUZ, false>(x[0], x[1], x[2], x[3]));
    for (int k = 0; k < 32; ++k) {
      const float f = FloatOf(bits[k]);
      const uint32_t want_fn = Fp8Code<OutFormat::kE4M3FN, true>(f);
      const uint32_t want_fnuz = Fp8Code<OutFormat::kE4M3FNUZ, true>(f);
      if (fn[k] != want_fn) Report("e4m3fn", bits[k], fn[k], want_fn);
      if (fnuz[k] != want_fnuz) Report("e4m3fnuz", bits[k], fnuz[k], want_fnuz);
      // The path for lanes known not to be NaN, on every other input (Inf included).
      if (!IsNan(f) && fn_finite[k] != want_fn) {
        Report("e4m3fn, no NaN", bits[k], fn_finite[k], want_fn);
      }
      if (!IsNan(f) && fnuz_finite[k] != want_fnuz) {
        Report("e4m3fnuz, no NaN", bits[k], fnuz_finite[k], want_fnuz);
      }
      if (!IsNan(f) && fp4[k] != Fp4Code(f)) Report("e2m1", bits[k], fp4[k], Fp4Code(f));
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

// The vector AddSquare (Fast2Sum on the ordered pair) against the scalar one (TwoSum, the
// FMA's exact square), bit for bit on both halves of every lane's (hi, lo), over sequences
// of values from 2^min_exponent to 2^60 and past float32's range, zeros among them. Where
// the scalar sum becomes non-finite (a square or a sum past float32), the vector one must
// be too; that is all the kernel reads of such a row. With denormals flushed, the two
// flush different intermediate subnormals, so values start at 2^-40: squares from 2^-80,
// whose rounding errors are normal numbers (docs/spec.md).
__attribute__((target("avx2,fma,f16c"))) void CheckSums(uint64_t seed, int sequences, bool flush) {
  if (flush) _mm_setcsr(_mm_getcsr() | 0x8040);
  const int min_exponent = flush ? -40 : -90;
  uint64_t state = seed;
  const auto next = [&state] {  // splitmix64
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  alignas(32) float values[8], vector_hi[8], vector_lo[8];
  for (int sequence = 0; sequence < sequences; ++sequence) {
    // Each lane's magnitudes around its own scale, so that sums of very different sizes
    // meet the squares; one sequence in 64 reaches past float32's range.
    const int lane_exponent = min_exponent + static_cast<int>(next() % (61 - min_exponent));
    const bool huge = next() % 64 == 0;
    __m256 hi = _mm256_setzero_ps(), lo = _mm256_setzero_ps();
    float scalar_hi[8] = {}, scalar_lo[8] = {};
    for (int step = 0; step < 64; ++step) {
      for (int k = 0; k < 8; ++k) {
        const uint64_t r = next();
        const int exponent =
            std::max(min_exponent, lane_exponent + static_cast<int>(r % 25) - 12) + (huge ? 70 : 0);
        const uint32_t mantissa = static_cast<uint32_t>(r >> 40) & 0x7fffffu;
        const uint32_t sign = static_cast<uint32_t>(r >> 63) << 31;
        const int biased = std::min(254, std::max(1, exponent + 127));
        const uint32_t kind = (r >> 8) % 512;  // mostly numbers; zeros, NaN and Inf of either sign
        values[k] = kind < 32    ? 0.0f
                    : kind == 32 ? FloatOf(sign | kF32QuietNan | (mantissa & 0x3fffffu))
                    : kind == 33 ? FloatOf(sign | kF32Inf)
                                 : FloatOf(sign | uint32_t(biased) << 23 | mantissa);
        AddSquare<true>(scalar_hi[k], scalar_lo[k], values[k]);
      }
      v::AddSquare(hi, lo, _mm256_load_ps(values));
      _mm256_store_ps(vector_hi, hi);
      _mm256_store_ps(vector_lo, lo);
      for (int k = 0; k < 8; ++k) {
        const float scalar_total = Total({scalar_hi[k], scalar_lo[k]});
        if (!IsFinite(scalar_total)) {
          if (IsFinite(Total({vector_hi[k], vector_lo[k]}))) {
            Report("sum of squares, non-finite", BitsOf(values[k]), BitsOf(vector_hi[k]),
                   BitsOf(scalar_hi[k]));
          }
          continue;
        }
        if (BitsOf(vector_hi[k]) != BitsOf(scalar_hi[k])) {
          Report("sum of squares, hi", BitsOf(values[k]), BitsOf(vector_hi[k]),
                 BitsOf(scalar_hi[k]));
        }
        if (BitsOf(vector_lo[k]) != BitsOf(scalar_lo[k])) {
          Report("sum of squares, lo", BitsOf(values[k]), BitsOf(vector_lo[k]),
                 BitsOf(scalar_lo[k]));
        }
      }
    }
  }
}

// NVFP4's (parameter: the global scale) or MXFP4's (parameter: the bound) vector scales
// against the scalar ones on every 16th abs-max bit pattern from 0 to NaN: the scale, and
// the multiplier (fl(1 / scale) for NVFP4, the exact reciprocal for MXFP4), NaN where the
// group's codes are all 0.
__attribute__((target("avx2,fma,f16c"))) void CheckFp4Scales(bool nvfp4, float parameter) {
  alignas(32) uint32_t amax[8];
  alignas(32) float scale[8], multiplier[8];
  const char* scale_name = nvfp4 ? "NVFP4 scale" : "MXFP4 scale";
  const char* multiplier_name = nvfp4 ? "NVFP4 1 / scale" : "MXFP4 1 / scale";
  for (uint64_t base = 0; base < (uint64_t{1} << 31); base += 8 * 16) {
    for (int k = 0; k < 8; ++k) amax[k] = static_cast<uint32_t>(base + 16 * k);
    const __m256i amax8 = _mm256_load_si256(reinterpret_cast<const __m256i*>(amax));
    __m256 s8, m8;
    if (nvfp4) {
      v::Nvfp4Scales(amax8, _mm256_set1_ps(parameter), &s8, &m8);
    } else {
      v::Mxfp4Scales(amax8, parameter, &s8, &m8);
    }
    _mm256_store_ps(scale, s8);
    _mm256_store_ps(multiplier, m8);
    for (int k = 0; k < 8; ++k) {
      const Fp4Scale want =
          nvfp4 ? Nvfp4Scale(1.0f, amax[k], parameter) : Mxfp4Scale(1.0f, amax[k], parameter);
      const float want_multiplier =
          want.zero ? FloatOf(kF32QuietNan) : (nvfp4 ? 1.0f / want.scale : want.recip);
      const bool same_scale =
          BitsOf(scale[k]) == BitsOf(want.scale) || (IsNan(scale[k]) && IsNan(want.scale));
      const bool same_multiplier = BitsOf(multiplier[k]) == BitsOf(want_multiplier) ||
                                   (IsNan(multiplier[k]) && IsNan(want_multiplier));
      if (!same_scale) Report(scale_name, amax[k], BitsOf(scale[k]), BitsOf(want.scale));
      if (!same_multiplier) {
        Report(multiplier_name, amax[k], BitsOf(multiplier[k]), BitsOf(want_multiplier));
      }
    }
  }
}

// NVFP4 on the AVX2 lanes against the scalar definitions: the scales of abs-maxima
// (every 16th bit pattern from 0 to NaN) under several global scales; the codes of the
// quotient (n / gs) / s from n * fl(1 / gs) * fl(1 / s) where that is safe, on random
// elements and on elements built to land on (and a few units in the last place beside)
// every rounding boundary of E2M1; the packing of 8 codes into 4 bytes.
__attribute__((target("avx2,fma,f16c"))) void CheckNvfp4(bool flush) {
  if (flush) _mm_setcsr(_mm_getcsr() | 0x8040);
  const float global_scales[] = {1.0f, 0.003f, 7.5f, 0x1p-100f, 3e37f};
  for (const float gs : global_scales) CheckFp4Scales(true, gs);
  // MXFP4's scales on the lanes, under bounds that cut in and one that does not.
  for (const float ub : {INFINITY, 2.0f, 0x1p-120f}) CheckFp4Scales(false, ub);
  uint64_t state = flush ? 7 : 3;
  const auto next = [&state] {  // splitmix64
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  const float boundaries[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, 6.0f};
  alignas(32) float n[8];
  alignas(32) uint32_t codes[8];
  for (int trial = 0; trial < (1 << 20); ++trial) {
    const float gs = (trial & 3) == 0 ? 1.0f : FloatOf(0x3a000000u + (next() & 0x3ffffffu));
    // An e4m3 scale from its code: 1 to 0x7e (0 and NaN give zero groups).
    const float s = E4M3FnValue(static_cast<uint8_t>(1 + next() % 0x7e));
    for (int k = 0; k < 8; ++k) {
      const uint64_t r = next();
      float value;
      if (r % 4 == 0) {
        // Random, around the scale.
        value = (static_cast<float>(r >> 40) * 0x1p-24f) * 7.0f * s * gs;
      } else {
        // A boundary of the quotient, built as its product with s and gs, and moved by a few
        // units in the last place.
        value = boundaries[(r >> 8) % 8] * s * gs;
        value = FloatOf(BitsOf(value) + static_cast<uint32_t>((r >> 16) % 9) - 4u);
      }
      n[k] = (r >> 63) != 0 ? -value : value;
    }
    const __m256i c = v::Nvfp4Codes(_mm256_load_ps(n), _mm256_set1_ps(gs), _mm256_set1_ps(s),
                                    _mm256_set1_ps(1.0f / gs), _mm256_set1_ps(1.0f / s));
    _mm256_store_si256(reinterpret_cast<__m256i*>(codes), c);
    const Fp4Scale scale{s, 0.0f, gs, true, false};
    uint8_t want_bytes[4];
    for (int k = 0; k < 8; ++k) {
      const uint8_t want = QuantizeFp4Element(n[k], scale);
      if (codes[k] != want) Report("NVFP4 code", BitsOf(n[k]), codes[k], want);
      if (k % 2 == 1) want_bytes[k / 2] = PackFp4(codes[k - 1], codes[k]);
    }
    // 32 codes: these 8 and three rotations of them.
    alignas(16) uint8_t packed32[16];
    const __m256i r1 = _mm256_permutevar8x32_epi32(c, _mm256_setr_epi32(1, 2, 3, 4, 5, 6, 7, 0));
    const __m256i r2 = _mm256_permutevar8x32_epi32(r1, _mm256_setr_epi32(1, 2, 3, 4, 5, 6, 7, 0));
    const __m256i r3 = _mm256_permutevar8x32_epi32(r2, _mm256_setr_epi32(1, 2, 3, 4, 5, 6, 7, 0));
    _mm_store_si128(reinterpret_cast<__m128i*>(packed32), v::PackFp4x32(c, r1, r2, r3));
    for (int k = 0; k < 32; k += 2) {
      const uint8_t want = PackFp4(codes[(k + k / 8) % 8], codes[(k + 1 + k / 8) % 8]);
      if (packed32[k / 2] != want) Report("FP4 packing of 32", codes[0], packed32[k / 2], want);
    }
    const uint32_t packed = v::PackFp4x8(c);
    if (std::memcmp(&packed, want_bytes, 4) != 0) {
      uint32_t want_word;
      std::memcpy(&want_word, want_bytes, 4);
      Report("FP4 packing", codes[0], packed, want_word);
    }
  }
}

#if defined(FP8NORM_CPU_HAS_AVX2_VARIANT)
// The AVX2 LoadRowLanes against the baseline's, bit for bit: h, residual_out and every
// lane's (hi, lo) before the tree. A wrong lane for some element would rarely change a
// row's total, so the lanes themselves are compared. Rows of 1 to 100 elements and a few
// longer ones, values over many binades, both ops and the mixed float32 + bfloat16 case.
template <typename TIn, typename TRes>
void CheckLanesOf(const char* what, uint64_t seed) {
  uint64_t state = seed;
  const auto next = [&state] {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  std::vector<int64_t> sizes;
  for (int64_t n = 1; n <= 100; ++n) sizes.push_back(n);
  for (int64_t n : {255, 256, 257, 4099}) sizes.push_back(n);
  for (const int64_t n : sizes) {
    for (const bool add : {false, true}) {
      std::vector<TIn> x(n);
      std::vector<TRes> residual(n), out_avx2(n), out_baseline(n);
      for (int64_t j = 0; j < n; ++j) {
        const uint64_t r = next();
        // Values from 2^-27 to 2^22, of either sign.
        const float a = FloatOf((uint32_t(r) & 0x7fffffu) | (uint32_t(100 + r % 50) << 23) |
                                (uint32_t(r >> 63) << 31));
        const float b =
            FloatOf((uint32_t(r >> 32) & 0x7fffffu) | (uint32_t(100 + (r >> 8) % 50) << 23));
        x[j] = FromFloat<TIn>(a);
        residual[j] = FromFloat<TRes>(b);
      }
      std::vector<float> h_avx2(n), h_baseline(n);
      float hi_avx2[16] = {}, lo_avx2[16] = {}, hi_baseline[16] = {}, lo_baseline[16] = {};
      avx2::LoadRowLanes(x.data(), add ? residual.data() : nullptr, add ? out_avx2.data() : nullptr,
                         h_avx2.data(), n, hi_avx2, lo_avx2);
      baseline::LoadRowLanes(x.data(), add ? residual.data() : nullptr,
                             add ? out_baseline.data() : nullptr, h_baseline.data(), n, hi_baseline,
                             lo_baseline);
      const bool same = std::memcmp(hi_avx2, hi_baseline, sizeof(hi_avx2)) == 0 &&
                        std::memcmp(lo_avx2, lo_baseline, sizeof(lo_avx2)) == 0 &&
                        std::memcmp(h_avx2.data(), h_baseline.data(), n * sizeof(float)) == 0 &&
                        std::memcmp(out_avx2.data(), out_baseline.data(), n * sizeof(TRes)) == 0;
      if (!same) Report(what, static_cast<uint32_t>(n), add, 0);
    }
  }
}

__attribute__((target("avx2,fma,f16c"))) void CheckLanes() {
  CheckLanesOf<BF16, BF16>("lanes, bfloat16 (length, add)", 11);
  CheckLanesOf<F16, F16>("lanes, float16 (length, add)", 12);
  CheckLanesOf<float, float>("lanes, float32 (length, add)", 13);
  CheckLanesOf<float, BF16>("lanes, float32 + bfloat16 (length, add)", 14);
}
#else
void CheckLanes() {}
#endif

int Run() {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") ||
      !__builtin_cpu_supports("f16c")) {
    std::printf("rounding_check: this CPU lacks AVX2 + FMA + F16C; nothing checked\n");
    return 0;
  }
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  CheckLanes();
  for (const bool flush : {false, true}) {
    CheckLoads(flush);
    CheckSums(flush ? 2 : 1, 1 << 16, flush);
    CheckNvfp4(flush);
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
        "rounding_check: all 2^32 float32 inputs, all 2^16 16-bit inputs, 2^25 summed "
        "squares and NVFP4's vector scales and quotients, denormals %s: "
        "%" PRId64 " mismatches so far\n",
        flush ? "flushed" : "kept", mismatches.load());
  }
  return mismatches.load() == 0 ? 0 : 1;
}

}  // namespace
}  // namespace fp8norm

int main() { return fp8norm::Run(); }
