// SPDX-License-Identifier: Apache-2.0
// The host backends' sums of bf16 / fp16 elements: widened to fp32, summed
// in rank order, rounded once (transport.h). Element types of their own so
// that the collectives' templates pick these sums.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

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

// The same sums, with rank r's contribution in `mine` (which receives the
// sum) and the other n - 1 in `others`, in rank order without r (rank q at
// others + (q < r ? q : q - 1) * stride): no copy of one's own part. The
// same operations in the same order as SumInRankOrder, so the same bits.
template <typename T>
void SumInRankOrderInPlace(const T* others, size_t stride, int n, int r, size_t len, T* mine) {
  constexpr bool kHalf = std::is_same_v<T, Bf16> || std::is_same_v<T, F16>;
  using Acc = std::conditional_t<kHalf, float, T>;
  auto load = [](const T& x) -> Acc {
    if constexpr (kHalf) {
      return T::Widen(x.bits);
    } else {
      return x;
    }
  };
  constexpr size_t kTile = 512;
  Acc acc[kTile];
  for (size_t b = 0; b < len; b += kTile) {
    const size_t m = std::min(kTile, len - b);
    for (int q = 0; q < n; ++q) {
      const T* in = q == r ? mine + b : others + (q < r ? q : q - 1) * stride + b;
      if (q == 0) {
        for (size_t i = 0; i < m; ++i) acc[i] = load(in[i]);
      } else {
        for (size_t i = 0; i < m; ++i) acc[i] += load(in[i]);
      }
    }
    for (size_t i = 0; i < m; ++i) {
      if constexpr (kHalf) {
        mine[b + i].bits = T::Round(acc[i]);
      } else {
        mine[b + i] = acc[i];
      }
    }
  }
}

}  // namespace microd::transport
