// The CPU kernel's fast path into ExactSum (fp8norm_math.h): float32 terms summed exactly
// in int64 fixed point relative to the largest term of a block, then added to the exact
// accumulator once per block. With E the largest biased exponent among the terms, a term
// of exponent e lies in level L = (E - e) / kLevelBits and is the integer m << (kLevelBits *
// (L + 1) - 1 - (E - e)) in units of 2^(E - 150 - kLevelBits * (L + 1) + 1): below 2^47,
// so a level of up to kMaxBlock terms stays below 2^62. Terms below every level (48
// binades or more below the largest), infinities and NaN take ExactSum's own Add, one by
// one.
// Integer sums are exact, so the result is the same as adding every term with Add, in
// any order: only the speed differs. A portable version, and an AVX2 one that does 8 terms
// at a time with the same integers.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "backward_math.h"
#include "cpu_config.h"

#if defined(FP8NORM_CPU_HAS_AVX2_VARIANT)
#include <immintrin.h>
#endif

namespace fp8norm {
namespace {

constexpr int kLevelBits = 24;
constexpr int kLevels = 2;
constexpr int64_t kMaxBlock = int64_t{1} << 15;

// The grid offset (ExactSum's units of 2^-149) of level L's unit for a block whose largest
// biased exponent is top.
inline int LevelOffset(uint32_t top, int level) {
  return int(top) - 1 - (kLevelBits * (level + 1) - 1);
}

// The level of a normal term of biased exponent e in a block whose largest is top, and
// its fixed-point value there (signed); kLevels when it lies below every level.
inline int LevelOf(uint32_t bits, uint32_t top, int64_t* value) {
  const uint32_t e = (bits >> 23) & 0xffu;
  const uint32_t below = top - e;
  const int level = int(below / kLevelBits);
  if (level >= kLevels) return kLevels;
  const int64_t m = int64_t((bits & 0x7fffffu) | 0x800000u)
                    << (kLevelBits * (level + 1) - 1 - int(below));
  *value = (bits >> 31) != 0 ? -m : m;
  return level;
}

// The terms t[begin, end) of a block whose largest biased exponent is top (below 0xff):
// each level's sum into levels[], the terms below every level into acc.
inline void AddToLevels(ExactSum& acc, const float* t, int64_t begin, int64_t end, uint32_t top,
                        int64_t* levels) {
  for (int64_t i = begin; i < end; ++i) {
    const uint32_t bits = BitsOf(t[i]);
    if ((bits & kF32Inf) == 0) continue;
    int64_t value = 0;
    const int level = LevelOf(bits, top, &value);
    if (level == kLevels) {
      Add(acc, t[i]);
    } else {
      levels[level] += value;
    }
  }
}

// Adds terms t[0, count) exactly to acc, portably.
inline void AddTermsPortable(ExactSum& acc, const float* t, int64_t count) {
  for (int64_t begin = 0; begin < count; begin += kMaxBlock) {
    const int64_t end = std::min(count, begin + kMaxBlock);
    uint32_t top = 0;
    for (int64_t i = begin; i < end; ++i) top = std::max(top, BitsOf(t[i]) & kF32Inf);
    top >>= 23;
    if (top == 0) continue;  // every term flushed
    if (top == 0xffu) {
      for (int64_t i = begin; i < end; ++i) Add(acc, t[i]);
      continue;
    }
    int64_t levels[kLevels] = {};
    AddToLevels(acc, t, begin, end, top, levels);
    for (int level = 0; level < kLevels; ++level) {
      AddScaled(acc, levels[level], LevelOffset(top, level));
    }
  }
}

// Adds the columns of t [rows][width] (rows `stride` floats apart, rows <= kMaxBlock)
// exactly to acc[0, width), column by column, portably.
inline void AddColumnsPortable(ExactSum* acc, const float* t, int64_t rows, int64_t width,
                               int64_t stride) {
  for (int64_t j = 0; j < width; ++j) {
    uint32_t top = 0;
    for (int64_t i = 0; i < rows; ++i) top = std::max(top, BitsOf(t[i * stride + j]) & kF32Inf);
    top >>= 23;
    if (top == 0) continue;
    int64_t levels[kLevels] = {};
    for (int64_t i = 0; i < rows; ++i) {
      const float term = t[i * stride + j];
      const uint32_t bits = BitsOf(term);
      if ((bits & kF32Inf) == 0) continue;
      int64_t value = 0;
      const int level = top == 0xffu ? kLevels : LevelOf(bits, top, &value);
      if (level == kLevels) {
        Add(acc[j], term);
      } else {
        levels[level] += value;
      }
    }
    for (int level = 0; level < kLevels; ++level) {
      AddScaled(acc[j], levels[level], LevelOffset(top, level));
    }
  }
}

#if defined(FP8NORM_CPU_HAS_AVX2_VARIANT)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

// The AVX2 forms add a level's terms as float64 rather than shifted integers: a term of
// level L is a multiple of 2^(E - 150 - 24 L - 23) below 2^(E - 126 - 24 L), 47 bits of
// that unit, so a float64 lane sums up to kLaneTerms of them exactly (below 2^53 units),
// and the lane's sum is then added to ExactSum, exactly, by AddDouble. Same result; fewer
// instructions than the integer shifts.
constexpr int64_t kLaneTerms = 64;

// Adds a float64 that is an exact sum of float32 terms (a multiple of 2^-149) to acc.
inline void AddDouble(ExactSum& acc, double v) {
  if (v == 0.0) return;
  uint64_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const int exponent = int((bits >> 52) & 0x7ffu);
  const int64_t m = int64_t((bits & ((uint64_t{1} << 52) - 1)) | (uint64_t{1} << 52));
  AddScaled(acc, (bits >> 63) != 0 ? -m : m, exponent - 1075 + 149);
}

// The level sums of 8 terms (`top`: the largest biased exponent of each lane's block)
// added to levels[L][0..1] (lanes 0-3, 4-7). Returns a mask of the lanes below every
// level (and Inf / NaN, which no level takes): the caller's to Add.
inline int AccumulateLevels(__m256 terms, __m256i top, __m256d levels[kLevels][2]) {
  const __m256i bits = _mm256_castps_si256(terms);
  const __m256i exponent = _mm256_and_si256(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(0xff));
  const __m256i normal =
      _mm256_xor_si256(_mm256_cmpeq_epi32(exponent, _mm256_setzero_si256()), _mm256_set1_epi32(-1));
  const __m256i below = _mm256_sub_epi32(top, exponent);
  __m256i covered = _mm256_setzero_si256();
  for (int level = 0; level < kLevels; ++level) {
    const __m256i in_level = _mm256_and_si256(
        normal,
        _mm256_and_si256(_mm256_cmpgt_epi32(below, _mm256_set1_epi32(kLevelBits * level - 1)),
                         _mm256_cmpgt_epi32(_mm256_set1_epi32(kLevelBits * (level + 1)), below)));
    covered = _mm256_or_si256(covered, in_level);
    const __m256 masked = _mm256_and_ps(terms, _mm256_castsi256_ps(in_level));
    levels[level][0] =
        _mm256_add_pd(levels[level][0], _mm256_cvtps_pd(_mm256_castps256_ps128(masked)));
    levels[level][1] =
        _mm256_add_pd(levels[level][1], _mm256_cvtps_pd(_mm256_extractf128_ps(masked, 1)));
  }
  return _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_andnot_si256(covered, normal)));
}

inline void ClearLevels(__m256d levels[kLevels][2]) {
  for (int level = 0; level < kLevels; ++level) {
    levels[level][0] = levels[level][1] = _mm256_setzero_pd();
  }
}

// Every lane of every level into acc, and the levels cleared.
inline void FoldLevels(ExactSum& acc, __m256d levels[kLevels][2]) {
  alignas(32) double lanes[4];
  for (int level = 0; level < kLevels; ++level) {
    for (int half = 0; half < 2; ++half) {
      _mm256_store_pd(lanes, levels[level][half]);
      for (double v : lanes) AddDouble(acc, v);
    }
  }
  ClearLevels(levels);
}

// AddTermsPortable on 8 lanes.
inline void AddTermsAvx2(ExactSum& acc, const float* t, int64_t count) {
  for (int64_t begin = 0; begin < count; begin += kMaxBlock) {
    const int64_t end = std::min(count, begin + kMaxBlock);
    const int64_t vector_end = begin + (end - begin) / 8 * 8;
    __m256i top8 = _mm256_setzero_si256();
    for (int64_t i = begin; i < vector_end; i += 8) {
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + i));
      top8 = _mm256_max_epu32(top8, _mm256_and_si256(bits, _mm256_set1_epi32(int(kF32Inf))));
    }
    alignas(32) uint32_t tops[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(tops), top8);
    uint32_t top = 0;
    for (uint32_t v : tops) top = std::max(top, v);
    for (int64_t i = vector_end; i < end; ++i) top = std::max(top, BitsOf(t[i]) & kF32Inf);
    top >>= 23;
    if (top == 0) continue;
    if (top == 0xffu) {
      for (int64_t i = begin; i < end; ++i) Add(acc, t[i]);
      continue;
    }
    __m256d levels[kLevels][2];
    ClearLevels(levels);
    const __m256i top_lanes = _mm256_set1_epi32(int(top));
    int64_t in_lanes = 0;
    for (int64_t i = begin; i < vector_end; i += 8) {
      int left = AccumulateLevels(_mm256_loadu_ps(t + i), top_lanes, levels);
      while (left != 0) {
        const int lane = __builtin_ctz(left);
        Add(acc, t[i + lane]);
        left &= left - 1;
      }
      if (++in_lanes == kLaneTerms) {
        FoldLevels(acc, levels);
        in_lanes = 0;
      }
    }
    FoldLevels(acc, levels);
    int64_t sums[kLevels] = {};
    AddToLevels(acc, t, vector_end, end, top, sums);
    for (int level = 0; level < kLevels; ++level) {
      AddScaled(acc, sums[level], LevelOffset(top, level));
    }
  }
}

// AddColumnsPortable, 8 columns at a time, kLaneTerms rows per fold.
inline void AddColumnsAvx2(ExactSum* acc, const float* t, int64_t rows, int64_t width,
                           int64_t stride) {
  const int64_t vector_width = width / 8 * 8;
  for (int64_t j = 0; j < vector_width; j += 8) {
    for (int64_t begin = 0; begin < rows; begin += kLaneTerms) {
      const int64_t end = std::min(rows, begin + kLaneTerms);
      __m256i top8 = _mm256_setzero_si256();
      for (int64_t i = begin; i < end; ++i) {
        const __m256i bits =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + i * stride + j));
        top8 = _mm256_max_epu32(top8, _mm256_and_si256(bits, _mm256_set1_epi32(int(kF32Inf))));
      }
      top8 = _mm256_srli_epi32(top8, 23);
      // A column holding Inf or NaN: a top that no level reaches, so that every term of
      // it goes to Add.
      const __m256i special = _mm256_cmpeq_epi32(top8, _mm256_set1_epi32(0xff));
      top8 = _mm256_or_si256(top8, _mm256_and_si256(special, _mm256_set1_epi32(0x7ff)));
      __m256d levels[kLevels][2];
      ClearLevels(levels);
      for (int64_t i = begin; i < end; ++i) {
        const float* row = t + i * stride + j;
        int left = AccumulateLevels(_mm256_loadu_ps(row), top8, levels);
        while (left != 0) {
          const int lane = __builtin_ctz(left);
          Add(acc[j + lane], row[lane]);
          left &= left - 1;
        }
      }
      alignas(32) double lanes[4];
      for (int level = 0; level < kLevels; ++level) {
        for (int half = 0; half < 2; ++half) {
          _mm256_store_pd(lanes, levels[level][half]);
          for (int lane = 0; lane < 4; ++lane) AddDouble(acc[j + 4 * half + lane], lanes[lane]);
        }
      }
    }
  }
  if (vector_width < width) {
    AddColumnsPortable(acc + vector_width, t + vector_width, rows, width - vector_width, stride);
  }
}
#pragma GCC pop_options
#endif

}  // namespace
}  // namespace fp8norm
