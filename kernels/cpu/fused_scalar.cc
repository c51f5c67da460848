// SPDX-License-Identifier: Apache-2.0
// Portable reference code path of the CPU passes. Compaction is branch-free:
// every element is written at the current output slot and the slot advances
// only when the element is selected.
#include <cmath>
#include <limits>

#include "kernels/cpu/cpu_kernels.h"

namespace microd::kernels::cpu {
namespace {

inline bool IsNonFinite(float x) { return !(std::fabs(x) <= std::numeric_limits<float>::max()); }

}  // namespace

PassResult FusedScalar(const FusedSelectArgs& a) {
  PassResult r;
  // The sum at i, stored where the pass stores (acc and the velocity read
  // before either is written: both may be updated in place).
  auto accumulate = [&](uint64_t i) {
    float u;
    const float v = PassSumAt(a, i, &u);
    if (a.velocity_out != nullptr) a.velocity_out[i] = u;
    if (a.acc != nullptr) a.acc[i] = v;
    if (a.zero_out != nullptr) a.zero_out[i] = 0.0f;  // after grad[i] was read
    r.nonfinite += IsNonFinite(v);
    return v;
  };
  uint64_t i = 0;
  for (; i < a.select_begin; ++i) accumulate(i);
  uint64_t c = 0;
  for (; i < a.select_end; ++i) {
    const float v = accumulate(i);
    if (c < a.out_capacity) {
      a.out_index[c] = static_cast<uint32_t>(i);
      a.out_value[c] = v;
    }
    c += std::fabs(v) >= a.threshold;
  }
  for (; i < a.size; ++i) accumulate(i);
  r.count = c;
  return r;
}

void GatherSumScalar(const FusedSelectArgs& a, const uint32_t* index, uint64_t count, float* out) {
  float u;
  for (uint64_t j = 0; j < count; ++j) out[j] = PassSumAt(a, index[j], &u);
}

uint64_t CountNonFiniteSums(const FusedSelectArgs& a, uint64_t begin, uint64_t end) {
  uint64_t n = 0;
  float u;
  for (uint64_t i = begin; i < end; ++i) n += IsNonFinite(PassSumAt(a, i, &u));
  return n;
}

uint64_t SelectRangeScalar(const float* acc, uint64_t begin, uint64_t end, float threshold,
                           uint32_t* out_index, float* out_value) {
  uint64_t c = 0;
  for (uint64_t i = begin; i < end; ++i) {
    const float v = acc[i];
    out_index[c] = static_cast<uint32_t>(i);
    out_value[c] = v;
    c += std::fabs(v) >= threshold;
  }
  return c;
}

uint64_t CountNonFiniteScalar(const float* data, uint64_t size) {
  uint64_t n = 0;
  for (uint64_t i = 0; i < size; ++i) n += IsNonFinite(data[i]);
  return n;
}

}  // namespace microd::kernels::cpu
