// SPDX-License-Identifier: Apache-2.0
// Portable fp32 <-> bf16 / fp16 conversions of whole arrays (the element
// rules in kernels/convert.h).
#include "kernels/convert.h"
#include "kernels/cpu/cpu_kernels.h"

namespace microd::kernels::cpu {

void HalfToFloatScalar(const uint16_t* src, ElementType type, uint64_t count, float* dst) {
  if (type == ElementType::kBFloat16) {
    for (uint64_t i = 0; i < count; ++i) dst[i] = convert::Bf16ToFloat(src[i]);
  } else {
    for (uint64_t i = 0; i < count; ++i) dst[i] = convert::F16ToFloat(src[i]);
  }
}

void FloatToHalfScalar(const float* src, ElementType type, uint64_t count, uint16_t* dst) {
  if (type == ElementType::kBFloat16) {
    for (uint64_t i = 0; i < count; ++i) dst[i] = convert::FloatToBf16(src[i]);
  } else {
    for (uint64_t i = 0; i < count; ++i) dst[i] = convert::FloatToF16(src[i]);
  }
}

}  // namespace microd::kernels::cpu
