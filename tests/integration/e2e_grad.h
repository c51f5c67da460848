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

static inline uint64_t e2e_hash(const void* data, size_t bytes) {
  const unsigned char* p = (const unsigned char*)data;
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

#endif /* MICROD_TESTS_E2E_GRAD_H_ */
