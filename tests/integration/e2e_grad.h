// SPDX-License-Identifier: Apache-2.0
/* Deterministic gradients for the end-to-end tests, shared by the C client
 * program and the C++ reference (C99 and C++). */
#ifndef MICROD_TESTS_E2E_GRAD_H_
#define MICROD_TESTS_E2E_GRAD_H_

#include <stdint.h>
#include <string.h>

static inline uint64_t e2e_mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return x;
}

/* Gradient of global rank `rank`, bucket `bucket`, step `step`: layer-like
 * scales along the bucket, a component shared by all ranks, heavy-ish tails. */
static inline void e2e_fill(float* out, uint64_t count, int rank, int bucket, uint64_t step) {
  for (uint64_t i = 0; i < count; ++i) {
    const uint64_t shared = e2e_mix((uint64_t)bucket << 48 ^ step << 32 ^ i);
    const uint64_t own = e2e_mix(shared ^ ((uint64_t)(rank + 1) << 56));
    const float scale = ((i * 7 / (count + 1)) % 2) ? 1e-2f : 1e-4f;
    const float a = (float)((int64_t)(shared % 20001) - 10000) * 1e-4f;
    const float b = (float)((int64_t)(own % 20001) - 10000) * 1e-4f;
    out[i] = scale * (a + b * b * b);
  }
}

/* bf16 and fp16 by their definition, for the reference: round to nearest,
 * ties to even. bf16: of the two bf16 neighbours of x (its bits truncated,
 * and one more), the nearer, on a tie the even one; fp16: the compiler's
 * _Float16 conversion. Finite inputs (the gradients are). */
static inline uint16_t e2e_to_bf16(float x) {
  uint32_t u, ulo, uhi;
  float lo, hi;
  memcpy(&u, &x, sizeof u);
  ulo = u & 0xffff0000u;
  uhi = ulo + 0x10000u;
  memcpy(&lo, &ulo, sizeof lo);
  memcpy(&hi, &uhi, sizeof hi);
  {
    const double dlo = (double)x - (double)lo, dhi = (double)hi - (double)x;
    const double a = dlo < 0 ? -dlo : dlo, b = dhi < 0 ? -dhi : dhi;
    if (a < b || (a == b && ((ulo >> 16) & 1u) == 0)) return (uint16_t)(ulo >> 16);
    return (uint16_t)(uhi >> 16);
  }
}

static inline float e2e_from_bf16(uint16_t h) {
  const uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* GCC's _Float16 (an extension in C99, hence __extension__). */
__extension__ typedef _Float16 e2e_f16;

static inline uint16_t e2e_to_f16(float x) {
  const e2e_f16 h = (e2e_f16)x;
  uint16_t u;
  memcpy(&u, &h, sizeof u);
  return u;
}

static inline float e2e_from_f16(uint16_t u) {
  e2e_f16 h;
  memcpy(&h, &u, sizeof h);
  return (float)h;
}

/* dtype: 1 fp32, 2 bf16, 3 fp16 (microd_dtype). */
static inline void e2e_narrow(const float* in, uint64_t count, int dtype, uint16_t* out) {
  for (uint64_t i = 0; i < count; ++i) out[i] = dtype == 2 ? e2e_to_bf16(in[i]) : e2e_to_f16(in[i]);
}

static inline void e2e_widen(const uint16_t* in, uint64_t count, int dtype, float* out) {
  for (uint64_t i = 0; i < count; ++i) {
    out[i] = dtype == 2 ? e2e_from_bf16(in[i]) : e2e_from_f16(in[i]);
  }
}

static inline uint64_t e2e_hash(const void* data, size_t bytes) {
  const unsigned char* p = (const unsigned char*)data;
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

#endif /* MICROD_TESTS_E2E_GRAD_H_ */
