// SPDX-License-Identifier: Apache-2.0
// Internal to the CPU backend: the memory-bound passes, one set per
// instruction set, selected at run time by cpu_ops.cc.
#pragma once

#include <cstdint>

#include "kernels/sparse_ops.h"

namespace microd::kernels::cpu {

struct PassResult {
  uint64_t count = 0;
  uint64_t nonfinite = 0;
};

// The fused pass's sum at i and its velocity u (FusedSelectArgs): u = g *
// scale, with momentum u = beta * v + u (rounded multiply, then add), then
// e + u. Internal linkage: each pass's file compiles its own copy, none with
// fused multiply-adds (fused_avx2.cc is built with -ffp-contract=off).
static inline float PassSumAt(const FusedSelectArgs& a, uint64_t i, float* u_out) {
  float u = a.grad[i] * a.grad_scale;
  if (a.velocity_in != nullptr) u = a.beta * a.velocity_in[i] + u;
  *u_out = u;
  return a.residual[i] + u;
}

// Semantics of SparseOps::FusedAccumulateSelect; arguments already validated.
PassResult FusedScalar(const FusedSelectArgs& args);
PassResult FusedAvx2(const FusedSelectArgs& args);

// Semantics of SparseOps::SelectRange; arguments already validated.
uint64_t SelectRangeScalar(const float* acc, uint64_t begin, uint64_t end, float threshold,
                           uint32_t* out_index, float* out_value);
uint64_t SelectRangeAvx2(const float* acc, uint64_t begin, uint64_t end, float threshold,
                         uint32_t* out_index, float* out_value);

// SparseOps::HalfToFloat / FloatToHalf (kernels/convert.h's rules),
// arguments already validated.
void HalfToFloatScalar(const uint16_t* src, ElementType type, uint64_t count, float* dst);
void FloatToHalfScalar(const float* src, ElementType type, uint64_t count, uint16_t* dst);
void HalfToFloatAvx2(const uint16_t* src, ElementType type, uint64_t count, float* dst);
void FloatToHalfAvx2(const float* src, ElementType type, uint64_t count, uint16_t* dst);

// SparseOps::GatherSum, arguments already validated.
void GatherSumScalar(const FusedSelectArgs& args, const uint32_t* index, uint64_t count,
                     float* out);
// The number of non-finite sums of the pass over [begin, end) (nothing stored).
uint64_t CountNonFiniteSums(const FusedSelectArgs& args, uint64_t begin, uint64_t end);

// Number of NaN/Inf values in data[0..size).
uint64_t CountNonFiniteScalar(const float* data, uint64_t size);
uint64_t CountNonFiniteAvx2(const float* data, uint64_t size);

}  // namespace microd::kernels::cpu
