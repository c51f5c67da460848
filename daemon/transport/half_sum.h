// The host backends' sums of bf16 / fp16 elements: widened to fp32, summed
// in rank order, rounded once (transport.h). Element types of their own so
// that the collectives' templates pick these sums.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/convert.h"

namespace microd::transport {

struct Bf16 {
  uint16_t bits;
  static float Widen(uint16_t h) { return kernels::convert::Bf16ToFloat(h); }
  static uint16_t Round(float f) { return kernels::convert::FloatToBf16(f); }
};

struct F16 {
  uint16_t bits;
  static float Widen(uint16_t h) { return kernels::convert::F16ToFloat(h); }
  static uint16_t Round(float f) { return kernels::convert::FloatToF16(f); }
};

// out[i] = the sum over q < n of contribution q (at c + q * stride), in rank
// order: ((c0 + c1) + c2) + ...; halves summed in fp32 and rounded once.
template <typename T>
void SumInRankOrder(const T* c, size_t stride, int n, size_t len, T* out) {
  for (size_t i = 0; i < len; ++i) out[i] = c[i];
  for (int q = 1; q < n; ++q) {
    const T* in = c + q * stride;
    for (size_t i = 0; i < len; ++i) out[i] += in[i];
  }
}

template <typename H>
void SumHalvesInRankOrder(const H* c, size_t stride, int n, size_t len, H* out) {
  for (size_t i = 0; i < len; ++i) {
    float acc = H::Widen(c[i].bits);
    for (int q = 1; q < n; ++q) acc += H::Widen(c[q * stride + i].bits);
    out[i].bits = H::Round(acc);
  }
}

template <>
inline void SumInRankOrder<Bf16>(const Bf16* c, size_t stride, int n, size_t len, Bf16* out) {
  SumHalvesInRankOrder(c, stride, n, len, out);
}

template <>
inline void SumInRankOrder<F16>(const F16* c, size_t stride, int n, size_t len, F16* out) {
  SumHalvesInRankOrder(c, stride, n, len, out);
}

}  // namespace microd::transport
