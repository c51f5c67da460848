// SPDX-License-Identifier: Apache-2.0
// The element types of microd, numbered once: a bucket's in the processes'
// buffers (the wire's MICROD_DTYPE_* and microd.v1.DataType values, 1-3)
// and what the transports move besides (counts, 4-5). The step itself
// always runs in fp32: half-precision gradients are widened on the way in
// and rounded on the way out.
#pragma once

#include <cstddef>

namespace microd::kernels {

enum class ElementType : int {
  kFloat32 = 1,
  kBFloat16 = 2,
  kFloat16 = 3,
  kInt32 = 4,
  kInt64 = 5,
};

// Bytes per element; 0 for a value that is no ElementType.
constexpr size_t ElementBytes(ElementType type) {
  switch (type) {
    case ElementType::kFloat32:
    case ElementType::kInt32:
      return 4;
    case ElementType::kBFloat16:
    case ElementType::kFloat16:
      return 2;
    case ElementType::kInt64:
      return 8;
  }
  return 0;
}

// bf16 or fp16: the types HalfToFloat, FloatToHalf and GatherRounded take.
constexpr bool IsHalfType(ElementType type) {
  return type == ElementType::kBFloat16 || type == ElementType::kFloat16;
}

// Whether `value` (a wire or proto dtype) is a bucket's element type.
constexpr bool IsBucketType(int value) { return value >= 1 && value <= 3; }

constexpr const char* ElementTypeName(ElementType type) {
  switch (type) {
    case ElementType::kFloat32:
      return "float32";
    case ElementType::kBFloat16:
      return "bfloat16";
    case ElementType::kFloat16:
      return "float16";
    case ElementType::kInt32:
      return "int32";
    case ElementType::kInt64:
      return "int64";
  }
  return "unknown";
}

}  // namespace microd::kernels
