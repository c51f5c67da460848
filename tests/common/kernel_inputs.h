// SPDX-License-Identifier: Apache-2.0
// Inputs the kernel tests share (CPU backend against its scalar reference,
// CUDA backend against the CPU one): the sizes, random gradients, and every
// shape of owned-partition range a step produces.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

namespace microd::kernels::test {

inline constexpr uint64_t kSizes[] = {0, 1, 7, 1000, 1000003};

inline uint32_t Bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

// Where two arrays first differ bit for bit (n if nowhere): one memcmp in
// the common case, where an assertion per element of a million would cost
// more than the kernel it checks.
inline uint64_t FirstBitDifference(const float* a, const float* b, uint64_t n) {
  if (n == 0 || std::memcmp(a, b, n * sizeof(float)) == 0) return n;
  uint64_t i = 0;
  while (Bits(a[i]) == Bits(b[i])) ++i;
  return i;
}

// Values spanning orders of magnitude, both signs, some exact zeros.
inline std::vector<float> RandomValues(uint64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-12, 2);
  std::vector<float> v(n);
  for (uint64_t i = 0; i < n; ++i) {
    v[i] = (i % 97 == 5) ? 0.0f : normal(rng) * std::ldexp(1.0f, exponent(rng));
  }
  return v;
}

// An owned-partition range of each shape a step can produce: empty, whole,
// the first, middle and last of n partitions, unaligned at both ends.
inline std::vector<std::pair<uint64_t, uint64_t>> Ranges(uint64_t d) {
  std::vector<std::pair<uint64_t, uint64_t>> out = {{0, 0}, {0, d}};
  for (uint64_t n : {2, 3, 4, 7, 1000}) {
    const uint64_t q = d / n, rem = d % n;
    for (uint64_t i : {uint64_t{0}, n / 2, n - 1}) {
      const uint64_t b = i * q + std::min(i, rem);
      out.push_back({b, b + q + (i < rem ? 1 : 0)});
    }
  }
  if (d > 3) out.push_back({1, d - 1});
  return out;
}

}  // namespace microd::kernels::test
