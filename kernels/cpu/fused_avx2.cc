// SPDX-License-Identifier: Apache-2.0
// AVX2 code path of the fused pass (built with -mavx2, called only when the
// processor supports it). Works in 64-element blocks: eight 8-lane vectors
// compute acc = e + g (and store it, unless the pass is read-only), their
// comparison masks combine into one
// 64-bit mask, and a bit-scan loop writes the few selected elements. Blocks
// outside the owned partition skip the comparison. When acc is a separate,
// aligned, large buffer it is written with streaming stores, so the pass moves
// the same bytes as the in-place `e += g` floor. With momentum correction the
// velocity is read and rewritten in the same pass (multiply, then add: no
// fused multiply-add, so the bits match Momentum() followed by the pass).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/cpu/cpu_kernels.h"

namespace microd::kernels::cpu {
namespace {

constexpr uint64_t kBlock = 64;
constexpr uint64_t kStreamMinBytes = 4u << 20;  // below this acc stays in cache

inline __m256 Abs(__m256 x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x); }

// Bits of `mask` for block elements inside [begin, end).
inline uint64_t RangeMask(uint64_t base, uint64_t begin, uint64_t end) {
  uint64_t m = ~0ull;
  if (base < begin) m &= ~0ull << (begin - base);
  if (base + kBlock > end) m &= end <= base ? 0 : ((1ull << (end - base)) - 1);
  return m;
}

// The velocity of the momentum pass, when there is one.
struct Velocity {
  const float* in = nullptr;
  float* out = nullptr;  // null: u is not stored
  float beta = 0.0f;
  float grad_scale = 1.0f;  // local clipping, applied to the gradient first
};

// kAccumulate: acc = e + g (with momentum u = beta * v + g first) is computed
// over [0, size), stored where `acc` (and vel.out) are not null, and checked;
// otherwise acc is only read over [begin, end). Both select over [begin, end).
template <bool kAccumulate, bool kStream, bool kMomentum>
PassResult Pass(const FusedSelectArgs& args, const float* grad, const float* residual, float* acc,
                uint64_t size, uint64_t begin, uint64_t end, float threshold, uint32_t* out_index,
                float* out_value, uint64_t capacity, Velocity vel = {}) {
  const __m256 vthr = _mm256_set1_ps(threshold);
  const __m256 vbeta = _mm256_set1_ps(vel.beta);
  const __m256 vscale = _mm256_set1_ps(vel.grad_scale);
  const __m256 vinf = _mm256_set1_ps(__builtin_inff());
  const bool store = acc != nullptr;
  const bool store_velocity = vel.out != nullptr;
  float* const zero_out = kAccumulate ? args.zero_out : nullptr;
  __m256 bad = _mm256_setzero_ps();
  alignas(32) float block[kBlock];
  uint64_t count = 0;
  // With selection only, walk just the blocks covering [begin, end).
  const uint64_t first_block = kAccumulate ? 0 : begin / kBlock;
  const uint64_t full_blocks = kAccumulate ? size / kBlock : end / kBlock;
  for (uint64_t b = first_block; b < full_blocks; ++b) {
    const uint64_t base = b * kBlock;
    const bool select = base + kBlock > begin && base < end;
    uint64_t mask = 0;
#pragma GCC unroll 8
    for (int v = 0; v < 8; ++v) {
      const uint64_t i = base + 8 * v;
      __m256 a;
      if constexpr (kAccumulate) {
        __m256 g = _mm256_mul_ps(_mm256_loadu_ps(grad + i), vscale);
        if constexpr (kMomentum) {
          g = _mm256_add_ps(_mm256_mul_ps(vbeta, _mm256_loadu_ps(vel.in + i)), g);
          if (store_velocity) {
            if constexpr (kStream) {
              _mm256_stream_ps(vel.out + i, g);
            } else {
              _mm256_storeu_ps(vel.out + i, g);
            }
          }
        }
        a = _mm256_add_ps(_mm256_loadu_ps(residual + i), g);
        if (store) {
          if constexpr (kStream) {
            _mm256_stream_ps(acc + i, a);
          } else {
            _mm256_storeu_ps(acc + i, a);
          }
        }
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(Abs(a), vinf, _CMP_NLT_UQ));
        // The update's zero fill, after grad + i was read (it may be grad).
        if (zero_out != nullptr) _mm256_storeu_ps(zero_out + i, _mm256_setzero_ps());
      } else {
        a = _mm256_loadu_ps(acc + i);
      }
      if (select) {
        _mm256_store_ps(block + 8 * v, a);
        const uint32_t m =
            static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(Abs(a), vthr, _CMP_GE_OQ)));
        mask |= static_cast<uint64_t>(m) << (8 * v);
      }
    }
    if (select) {
      mask &= RangeMask(base, begin, end);
      while (mask != 0) {
        const int j = __builtin_ctzll(mask);
        if (count < capacity) {
          out_index[count] = static_cast<uint32_t>(base + j);
          out_value[count] = block[j];
        }
        ++count;
        mask &= mask - 1;
      }
    }
  }
  if constexpr (kStream) _mm_sfence();
  PassResult r;
  // Scalar tail after the last full block.
  uint64_t i = full_blocks * kBlock;
  if (!kAccumulate && i < begin) i = begin;
  const uint64_t tail_end = kAccumulate ? size : end;
  uint64_t tail_nonfinite = 0;
  for (; i < tail_end; ++i) {
    float v;
    if constexpr (kAccumulate) {
      float u;
      v = PassSumAt(args, i, &u);
      if (store_velocity) vel.out[i] = u;
      if (store) acc[i] = v;
      if (zero_out != nullptr) zero_out[i] = 0.0f;
      tail_nonfinite += !(__builtin_fabsf(v) < __builtin_inff());
    } else {
      v = acc[i];
    }
    if (i >= begin && i < end) {
      if (count < capacity) {
        out_index[count] = static_cast<uint32_t>(i);
        out_value[count] = v;
      }
      count += __builtin_fabsf(v) >= threshold;
    }
  }
  r.count = count;
  if constexpr (kAccumulate) {
    // Rare path: count the blocks' non-finite sums exactly only when some
    // lane was non-finite: from acc where the pass stored the sums (it may
    // have overwritten the residual, and zero_out the gradient), else
    // recomputed.
    r.nonfinite = tail_nonfinite;
    if (_mm256_movemask_ps(bad) != 0) {
      r.nonfinite += store ? CountNonFiniteScalar(acc, full_blocks * kBlock)
                           : CountNonFiniteSums(args, 0, full_blocks * kBlock);
    }
  }
  return r;
}

}  // namespace

PassResult FusedAvx2(const FusedSelectArgs& a) {
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 32 == 0; };
  const bool momentum = a.velocity_in != nullptr;
  // Streaming stores only into separate buffers (acc, and the velocity when it
  // is stored and not updated in place): an aliased output is read in the
  // same pass.
  const bool stream =
      a.acc != nullptr && a.acc != a.residual && a.size * sizeof(float) >= kStreamMinBytes &&
      aligned(a.acc) &&
      (a.velocity_out == nullptr || (a.velocity_out != a.velocity_in && aligned(a.velocity_out)));
  const Velocity vel{a.velocity_in, a.velocity_out, a.beta, a.grad_scale};
  auto run = [&](auto stream_tag, auto momentum_tag) {
    return Pass<true, decltype(stream_tag)::value, decltype(momentum_tag)::value>(
        a, a.grad, a.residual, a.acc, a.size, a.select_begin, a.select_end, a.threshold,
        a.out_index, a.out_value, a.out_capacity, vel);
  };
  using T = std::true_type;
  using F = std::false_type;
  if (momentum) return stream ? run(T{}, T{}) : run(F{}, T{});
  return stream ? run(T{}, F{}) : run(F{}, F{});
}

uint64_t SelectRangeAvx2(const float* acc, uint64_t begin, uint64_t end, float threshold,
                         uint32_t* out_index, float* out_value) {
  return Pass<false, false, false>(FusedSelectArgs{}, nullptr, nullptr, const_cast<float*>(acc),
                                   end, begin, end, threshold, out_index, out_value,
                                   kMaxBucketElements)
      .count;
}

// A value is NaN or Inf exactly when its exponent bits are all ones: one
// and + compare per 8 values, counted in 32-bit lanes (flushed before they
// could overflow), so the scan runs at memory speed.
uint64_t CountNonFiniteAvx2(const float* data, uint64_t size) {
  const __m256i exponent = _mm256_set1_epi32(0x7f800000);
  uint64_t total = 0;
  uint64_t i = 0;
  constexpr uint64_t kFlush = uint64_t{1} << 24;  // vectors per flush, far below 2^31 per lane
  while (i + 8 <= size) {
    const uint64_t end = i + std::min<uint64_t>((size - i) / 8, kFlush) * 8;
    __m256i lanes = _mm256_setzero_si256();
    for (; i < end; i += 8) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(data + i));
      // cmpeq gives -1 per match: subtracting it counts.
      lanes = _mm256_sub_epi32(lanes, _mm256_cmpeq_epi32(_mm256_and_si256(v, exponent), exponent));
    }
    alignas(32) uint32_t out[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(out), lanes);
    for (uint32_t c : out) total += c;
  }
  return total + CountNonFiniteScalar(data + i, size - i);
}

}  // namespace microd::kernels::cpu
