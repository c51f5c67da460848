// SPDX-License-Identifier: Apache-2.0
// AVX2 + F16C fp32 <-> bf16 / fp16 conversions (built with -mavx2 -mf16c,
// called only when the processor has both). bf16 rounds with integer
// arithmetic (add 0x7fff plus the kept lowest bit, NaNs made quiet); fp16
// uses the F16C instructions with round-to-nearest-even. 16 elements per
// iteration, the tail scalar.
#include <immintrin.h>

#include "kernels/cpu/cpu_kernels.h"

namespace microd::kernels::cpu {
namespace {

// 8 floats to 8 bf16 (in the low 16 bits of each 32-bit lane).
inline __m256i Bf16Lanes(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i top = _mm256_srli_epi32(u, 16);
  const __m256i lsb = _mm256_and_si256(top, _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));
  const __m256i quiet = _mm256_or_si256(top, _mm256_set1_epi32(0x40));
  return _mm256_blendv_epi8(rounded, quiet, nan);
}

}  // namespace

void HalfToFloatAvx2(const uint16_t* src, ElementType type, uint64_t count, float* dst) {
  uint64_t i = 0;
  if (type == ElementType::kBFloat16) {
    for (; i + 8 <= count; i += 8) {
      const __m256i w =
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
      _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
  } else {
    for (; i + 8 <= count; i += 8) {
      _mm256_storeu_ps(dst + i,
                       _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
    }
  }
  HalfToFloatScalar(src + i, type, count - i, dst + i);
}

void FloatToHalfAvx2(const float* src, ElementType type, uint64_t count, uint16_t* dst) {
  uint64_t i = 0;
  if (type == ElementType::kBFloat16) {
    for (; i + 16 <= count; i += 16) {
      const __m256i a = Bf16Lanes(_mm256_loadu_ps(src + i));
      const __m256i b = Bf16Lanes(_mm256_loadu_ps(src + i + 8));
      // packus works per 128-bit half: a0-3 b0-3 a4-7 b4-7; put them in order.
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), packed);
    }
  } else {
    for (; i + 8 <= count; i += 8) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                       _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    }
  }
  FloatToHalfScalar(src + i, type, count - i, dst + i);
}

}  // namespace microd::kernels::cpu
