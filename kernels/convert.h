// SPDX-License-Identifier: Apache-2.0
// fp32 <-> bf16 / fp16, one element: round to nearest, ties to even; fp16
// overflows to +-Inf (65520 and above: 65520 is the tie between 65504 and
// 2^16) and keeps subnormals; a NaN stays a NaN, quiet, with its sign and
// the top of its payload (what x86's F16C does for fp16). Shared by the CPU
// backend and the CUDA kernels, so both give the same bits.
#pragma once

#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#define MICROD_HD __host__ __device__ inline
#else
#define MICROD_HD inline
#endif

namespace microd::kernels::convert {

MICROD_HD uint32_t Bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

MICROD_HD float FromBits(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// x >> shift rounded to nearest, ties to even (1 <= shift < 32).
MICROD_HD uint32_t ShiftRoundEven(uint32_t x, uint32_t shift) {
  const uint32_t q = x >> shift;
  const uint32_t rem = x & ((1u << shift) - 1);
  const uint32_t half = 1u << (shift - 1);
  return q + ((rem > half || (rem == half && (q & 1u) != 0)) ? 1u : 0u);
}

MICROD_HD uint16_t FloatToBf16(float f) {
  const uint32_t u = Bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

MICROD_HD float Bf16ToFloat(uint16_t h) { return FromBits(static_cast<uint32_t>(h) << 16); }

MICROD_HD uint16_t FloatToF16(float f) {
  const uint32_t u = Bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);
  if (a < 0x38800000u) {
    // Below fp16's smallest normal: a multiple of 2^-24; 2^-25 and below
    // round to 0 (2^-25 itself is a tie, to the even 0).
    if (a <= 0x33000000u) return static_cast<uint16_t>(sign);
    const uint32_t e = a >> 23;
    const uint32_t m = (a & 0x7fffffu) | 0x800000u;
    return static_cast<uint16_t>(sign | ShiftRoundEven(m, 126 - e));
  }
  // A carry out of the mantissa moves into the exponent, as it should.
  const uint32_t h = (((a >> 23) - 112) << 10) | ((a & 0x7fffffu) >> 13);
  const uint32_t rem = a & 0x1fffu;
  return static_cast<uint16_t>(
      sign | (h + ((rem > 0x1000u || (rem == 0x1000u && (h & 1u) != 0)) ? 1u : 0u)));
}

MICROD_HD float F16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu;
  const uint32_t m = h & 0x3ffu;
  if (e == 0x1f) return FromBits(sign | 0x7f800000u | (m << 13) | (m != 0 ? 0x400000u : 0u));
  if (e == 0) {
    const float v = static_cast<float>(m) * 0x1p-24f;  // exact
    return sign != 0 ? -v : v;
  }
  return FromBits(sign | ((e + 112) << 23) | (m << 13));
}

}  // namespace microd::kernels::convert
