// SPDX-License-Identifier: Apache-2.0
// CUDA backend of SparseOps (kernels/cuda/cuda_ops.h says what differs from
// the CPU backend). Written and compiled without a GPU: every kernel uses
// 64-bit element indices in grid-stride loops, so sizes up to
// kMaxBucketElements need no more blocks than the device runs at once.
//
// The fused pass works in tiles of kTile elements per block: each thread
// loads two float4 of `residual` and `grad` (scalar loads for the tail and
// for unaligned pointers), stores `acc`, and, only in tiles that intersect
// the owned partition, takes part in a block-level compaction: one ballot per
// element slot gives each warp its selected lanes, warp totals are scanned in
// shared memory, and one atomicAdd per tile claims the block's output range.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>
#include <cub/device/device_select.cuh>
#include <map>
#include <mutex>
#include <string>

#include "daemon/common/log.h"
#include "kernels/convert.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/poll_pacer.h"

namespace microd::kernels {
namespace {

static_assert(sizeof(StepScalars) == 2 * sizeof(unsigned long long), "StepScalars layout");
static_assert(sizeof(unsigned long long) == sizeof(uint64_t), "64-bit atomics on uint64_t");

constexpr int kThreads = 256;                            // threads per block, every kernel
constexpr int kVecPerThread = 2;                         // float4 groups per thread per tile
constexpr int kItems = 4 * kVecPerThread;                // elements per thread per tile
constexpr uint64_t kTile = uint64_t{kThreads} * kItems;  // elements per tile
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFullMask = 0xFFFFFFFFu;
// LogHistogram keeps its bins in shared memory up to this many (32 KiB).
constexpr uint32_t kMaxSharedBins = 8192;
// Blocks of the two-pass sum of squares (a fixed number keeps it deterministic).
constexpr int kSumBlocks = 1024;

__device__ __forceinline__ bool IsNonFinite(float x) { return !(fabsf(x) <= 3.402823466e38f); }

__device__ __forceinline__ unsigned long long* CountPtr(StepScalars* s) {
  return reinterpret_cast<unsigned long long*>(&s->count);
}
__device__ __forceinline__ unsigned long long* NonFinitePtr(StepScalars* s) {
  return reinterpret_cast<unsigned long long*>(&s->nonfinite);
}

// Sum over the warp of a 64-bit value, result in lane 0.
__device__ __forceinline__ unsigned long long WarpSum(unsigned long long v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(kFullMask, v, off);
  return v;
}

// Adds the block's per-thread counts to *target with one atomic per warp
// that has a non-zero count (non-finite values are rare).
__device__ __forceinline__ void FlushCount(unsigned long long local, unsigned long long* target) {
  const unsigned long long w = WarpSum(local);
  if ((threadIdx.x & 31) == 0 && w != 0) atomicAdd(target, w);
}

// Momentum correction u = beta * v + g, rounded multiply then add: no fused
// multiply-add, as the CPU computes it.
__device__ __forceinline__ float MomentumOf(float beta, float v, float g) {
  return __fadd_rn(__fmul_rn(beta, v), g);
}

struct FusedParams {
  const float* grad = nullptr;         // kAccumulate only
  const float* residual = nullptr;     // kAccumulate only
  float* acc = nullptr;                // written with kAccumulate (unless null), read otherwise
  const float* velocity_in = nullptr;  // kAccumulate with momentum correction only
  float* velocity_out = nullptr;       // nullptr: u is not stored
  float beta = 0.0f;
  float grad_scale = 1.0f;  // local clipping: grad is read as grad * grad_scale
  uint64_t first = 0;       // first element loaded (a multiple of 4)
  uint64_t end = 0;         // one past the last element loaded
  uint64_t sel_begin = 0;
  uint64_t sel_end = 0;
  float threshold = 0.0f;
  uint32_t* out_index = nullptr;
  float* out_value = nullptr;
  uint64_t capacity = kMaxBucketElements;  // pairs the outputs hold
  StepScalars* scalars = nullptr;
};

// The fused pass's work, shared by the kernels below, which name the arrays
// (p's own, or the same as __restrict__ kernel parameters).
// kAccumulate: acc = residual + grad over [first, end), stored unless acc is
// null, and count non-finite acc values (with velocity_in set, grad is first
// replaced by u = beta * velocity_in + grad, stored to velocity_out unless it
// is null, rounded multiply then add as on the CPU); otherwise acc is only
// read. Both select over [sel_begin,
// sel_end). kAligned: grad, residual and acc (those used) are 16-byte aligned.
template <bool kAccumulate, bool kAligned>
__device__ __forceinline__ void FusedTiles(const FusedParams& p, const float* grad,
                                           const float* residual, float* acc,
                                           const float* velocity_in, float* velocity_out) {
  __shared__ unsigned warp_offset[kWarps];
  __shared__ unsigned long long block_base;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const unsigned lanes_below = (1u << lane) - 1u;
  unsigned long long nonfinite = 0;
  const uint64_t num_tiles = (p.end - p.first + kTile - 1) / kTile;

  for (uint64_t tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const uint64_t tile_begin = p.first + tile * kTile;
    float v[kItems];
#pragma unroll
    for (int q = 0; q < kVecPerThread; ++q) {
      const uint64_t i0 = tile_begin + (uint64_t(q) * kThreads + threadIdx.x) * 4;
      if (kAligned && i0 + 4 <= p.end) {
        float4 a;
        if constexpr (kAccumulate) {
          const float4 e = *reinterpret_cast<const float4*>(residual + i0);
          float4 g = *reinterpret_cast<const float4*>(grad + i0);
          g = make_float4(__fmul_rn(g.x, p.grad_scale), __fmul_rn(g.y, p.grad_scale),
                          __fmul_rn(g.z, p.grad_scale), __fmul_rn(g.w, p.grad_scale));
          if (velocity_in != nullptr) {
            const float4 u = *reinterpret_cast<const float4*>(velocity_in + i0);
            g = make_float4(MomentumOf(p.beta, u.x, g.x), MomentumOf(p.beta, u.y, g.y),
                            MomentumOf(p.beta, u.z, g.z), MomentumOf(p.beta, u.w, g.w));
            if (velocity_out != nullptr) *reinterpret_cast<float4*>(velocity_out + i0) = g;
          }
          a = make_float4(__fadd_rn(e.x, g.x), __fadd_rn(e.y, g.y), __fadd_rn(e.z, g.z),
                          __fadd_rn(e.w, g.w));
          if (acc != nullptr) *reinterpret_cast<float4*>(acc + i0) = a;
        } else {
          a = *reinterpret_cast<const float4*>(acc + i0);
        }
        v[4 * q + 0] = a.x;
        v[4 * q + 1] = a.y;
        v[4 * q + 2] = a.z;
        v[4 * q + 3] = a.w;
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint64_t i = i0 + j;
          float x = 0.0f;
          if (i < p.end) {
            if constexpr (kAccumulate) {
              float g = __fmul_rn(grad[i], p.grad_scale);
              if (velocity_in != nullptr) {
                g = MomentumOf(p.beta, velocity_in[i], g);
                if (velocity_out != nullptr) velocity_out[i] = g;
              }
              x = __fadd_rn(residual[i], g);
              if (acc != nullptr) acc[i] = x;
            } else {
              x = acc[i];
            }
          }
          v[4 * q + j] = x;
        }
      }
      if constexpr (kAccumulate) {
#pragma unroll
        for (int j = 0; j < 4; ++j) nonfinite += (i0 + j < p.end) && IsNonFinite(v[4 * q + j]);
      }
    }

    // Block-uniform: tiles outside the owned partition select nothing.
    const uint64_t tile_end = tile_begin + kTile < p.end ? tile_begin + kTile : p.end;
    if (tile_end <= p.sel_begin || tile_begin >= p.sel_end) continue;

    unsigned ballot[kItems];
    unsigned warp_count = 0;
#pragma unroll
    for (int q = 0; q < kVecPerThread; ++q) {
      const uint64_t i0 = tile_begin + (uint64_t(q) * kThreads + threadIdx.x) * 4;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint64_t i = i0 + j;
        // NaN compares false: never selected, as on the CPU.
        const bool pred = i >= p.sel_begin && i < p.sel_end && fabsf(v[4 * q + j]) >= p.threshold;
        ballot[4 * q + j] = __ballot_sync(kFullMask, pred);
        warp_count += __popc(ballot[4 * q + j]);
      }
    }
    if (lane == 0) warp_offset[warp] = warp_count;
    __syncthreads();
    if (threadIdx.x == 0) {
      unsigned running = 0;
      for (int w = 0; w < kWarps; ++w) {
        const unsigned c = warp_offset[w];
        warp_offset[w] = running;
        running += c;
      }
      block_base = running != 0 ? atomicAdd(CountPtr(p.scalars), running) : 0ull;
    }
    __syncthreads();
    unsigned long long pos = block_base + warp_offset[warp];
#pragma unroll
    for (int q = 0; q < kVecPerThread; ++q) {
      const uint64_t i0 = tile_begin + (uint64_t(q) * kThreads + threadIdx.x) * 4;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const unsigned b = ballot[4 * q + j];
        if ((b >> lane) & 1u) {
          const unsigned long long slot = pos + __popc(b & lanes_below);
          if (slot < p.capacity) {
            p.out_index[slot] = static_cast<uint32_t>(i0 + j);
            p.out_value[slot] = v[4 * q + j];
          }
        }
        pos += __popc(b);
      }
    }
    // warp_offset and block_base are rewritten by the next tile.
    __syncthreads();
  }
  if constexpr (kAccumulate) FlushCount(nonfinite, NonFinitePtr(p.scalars));
}

// Any allowed aliasing (acc may be residual, velocity_out velocity_in): the
// compiler keeps each store before the loads after it.
template <bool kAccumulate, bool kAligned>
__global__ void __launch_bounds__(kThreads) FusedKernel(FusedParams p) {
  FusedTiles<kAccumulate, kAligned>(p, p.grad, p.residual, p.acc, p.velocity_in, p.velocity_out);
}

// No output is an input (the engine's double-buffered residual and velocity):
// __restrict__ lets the compiler issue a tile's loads ahead of its stores and
// read the inputs through the read-only path (ld.global.nc). Left alone it
// takes 47 registers on sm_90 (5 blocks of 256 per SM); at least 6 blocks
// per SM, as the aliasing kernel gets with its 39-40, fits in 40 without
// spilling (ptxas -v).
template <bool kAligned>
__global__ void __launch_bounds__(kThreads, 6)
    FusedKernelDistinct(FusedParams p, const float* __restrict__ grad,
                        const float* __restrict__ residual, float* __restrict__ acc,
                        const float* __restrict__ velocity_in, float* __restrict__ velocity_out) {
  FusedTiles<true, kAligned>(p, grad, residual, acc, velocity_in, velocity_out);
}

template <bool kShared>
__global__ void __launch_bounds__(kThreads)
    HistogramKernel(const float* values, uint64_t count, uint32_t shift, uint32_t first_bin,
                    uint32_t num_bins, unsigned long long* bins) {
  extern __shared__ unsigned shared_bins[];
  if constexpr (kShared) {
    for (uint32_t b = threadIdx.x; b <= num_bins; b += blockDim.x) shared_bins[b] = 0;
    __syncthreads();
  }
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t j = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < count; j += stride) {
    const uint32_t b = (__float_as_uint(values[j]) & 0x7FFFFFFFu) >> shift;
    if (b < first_bin) continue;
    const uint32_t slot = b - first_bin < num_bins ? b - first_bin : num_bins;
    if constexpr (kShared) {
      atomicAdd(&shared_bins[slot], 1u);
    } else {
      atomicAdd(&bins[slot], 1ull);
    }
  }
  if constexpr (kShared) {
    __syncthreads();
    for (uint32_t b = threadIdx.x; b <= num_bins; b += blockDim.x) {
      if (shared_bins[b] != 0) atomicAdd(&bins[b], static_cast<unsigned long long>(shared_bins[b]));
    }
  }
}

__global__ void MomentumKernel(const float* grad, const float* vin, float beta, float* vout,
                               uint64_t size) {
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < size; i += stride) {
    vout[i] = MomentumOf(beta, vin[i], grad[i]);
  }
}

// The element rules of kernels/convert.h, the CPU backend's bits.
__global__ void HalfToFloatKernel(const uint16_t* src, bool bf16, uint64_t size, float* dst) {
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < size; i += stride) {
    dst[i] = bf16 ? convert::Bf16ToFloat(src[i]) : convert::F16ToFloat(src[i]);
  }
}

__global__ void FloatToHalfKernel(const float* src, bool bf16, uint64_t size, uint16_t* dst) {
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < size; i += stride) {
    dst[i] = bf16 ? convert::FloatToBf16(src[i]) : convert::FloatToF16(src[i]);
  }
}

__global__ void GatherRoundedKernel(float* acc, const uint32_t* index, uint64_t count, bool bf16,
                                    uint16_t* out) {
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t j = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < count; j += stride) {
    const float a = acc[index[j]];
    const uint16_t h = bf16 ? convert::FloatToBf16(a) : convert::FloatToF16(a);
    out[j] = h;
    acc[index[j]] = __fsub_rn(a, bf16 ? convert::Bf16ToFloat(h) : convert::F16ToFloat(h));
  }
}

// Pass 1 of the sum of squares: one double partial per block.
__global__ void __launch_bounds__(kThreads)
    SumSquaresPartialKernel(const float* data, uint64_t size, double* partial) {
  __shared__ double warp_sum[kWarps];
  double s = 0.0;
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < size; i += stride) {
    const double x = data[i];
    s += x * x;  // exact product of two floats; only the additions round
  }
  for (int off = 16; off > 0; off >>= 1) s += __shfl_down_sync(kFullMask, s, off);
  if ((threadIdx.x & 31) == 0) warp_sum[threadIdx.x >> 5] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    double t = 0.0;
    for (int w = 0; w < kWarps; ++w) t += warp_sum[w];
    partial[blockIdx.x] = t;
  }
}

// Pass 2: the partials summed in index order by one thread (kSumBlocks of them).
__global__ void SumPartialsKernel(const double* partial, int n, double* result) {
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    double t = 0.0;
    for (int b = 0; b < n; ++b) t += partial[b];
    *result = t;
  }
}

// The fused pass's sum at each index, as FusedTiles computes it.
__global__ void GatherSumKernel(FusedParams p, const uint32_t* index, uint64_t count, float* out) {
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t j = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < count; j += stride) {
    const uint32_t i = index[j];
    float g = __fmul_rn(p.grad[i], p.grad_scale);
    if (p.velocity_in != nullptr) g = MomentumOf(p.beta, p.velocity_in[i], g);
    out[j] = __fadd_rn(p.residual[i], g);
  }
}

__global__ void GatherKernel(const float* acc, const uint32_t* index, uint64_t count, float* out) {
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t j = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < count; j += stride) {
    out[j] = acc[index[j]];
  }
}

__global__ void ScatterAverageKernel(const float* values, const uint32_t* index, uint64_t count,
                                     float divisor, float* out, uint64_t size) {
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t j = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < count; j += stride) {
    const uint32_t i = index[j];
    if (i < size) out[i] = values[j] / divisor;  // IEEE division (no fast math)
  }
}

__global__ void CountOutsideKernel(const uint32_t* index, uint64_t count, uint64_t begin,
                                   uint64_t end, StepScalars* scalars) {
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  unsigned long long outside = 0;
  for (uint64_t j = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < count; j += stride) {
    outside += index[j] < begin || index[j] >= end;
  }
  FlushCount(outside, CountPtr(scalars));
}

__global__ void ZeroAtKernel(float* acc, const uint32_t* index, uint64_t count) {
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t j = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < count; j += stride) {
    acc[index[j]] = 0.0f;
  }
}

// Inputs of one LocalSum launch; longer lists take several launches.
constexpr int kSumInputsPerLaunch = 8;
struct SumInputs {
  const float* in[kSumInputsPerLaunch];
  int n;
};

// out = (out or in[0]) + in[1] + ... in order; counts non-finite results when
// `nonfinite` is not null (last launch only).
__global__ void __launch_bounds__(kThreads)
    LocalSumKernel(SumInputs inputs, bool accumulate_into_out, float* out, uint64_t size,
                   unsigned long long* nonfinite) {
  unsigned long long bad = 0;
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < size; i += stride) {
    // ((out) + in[0]) + in[1] + ...: the CPU's order. Constant indices keep
    // the pointer array in registers.
    float s = accumulate_into_out ? out[i] + inputs.in[0][i] : inputs.in[0][i];
#pragma unroll
    for (int l = 1; l < kSumInputsPerLaunch; ++l) {
      if (l < inputs.n) s += inputs.in[l][i];
    }
    out[i] = s;
    bad += IsNonFinite(s);
  }
  if (nonfinite != nullptr) FlushCount(bad, nonfinite);
}

__global__ void __launch_bounds__(kThreads)
    DivideKernel(float* data, uint64_t size, float divisor, unsigned long long* nonfinite) {
  unsigned long long bad = 0;
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < size; i += stride) {
    const float x = data[i];
    bad += IsNonFinite(x);
    data[i] = x / divisor;
  }
  if (nonfinite != nullptr) FlushCount(bad, nonfinite);
}

__global__ void __launch_bounds__(kThreads)
    CountNonFiniteKernel(const float* data, uint64_t size, unsigned long long* nonfinite) {
  unsigned long long bad = 0;
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < size; i += stride) {
    bad += IsNonFinite(data[i]);
  }
  FlushCount(bad, nonfinite);
}

__global__ void TrimFlagsKernel(const float* value, uint64_t count, float threshold,
                                uint8_t* flags) {
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t j = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < count; j += stride) {
    flags[j] = fabsf(value[j]) >= threshold ? 1 : 0;
  }
}

// Sort keys for exact top-k: ascending key = descending magnitude; the stable
// radix sort keeps index order among equal magnitudes (ties to lower index).
// The exact top-k as a radix select on the magnitude's bits (key = the
// float's bits with the sign cleared: the order of |x|, a NaN above Inf),
// three levels of the key's 31 bits (12, 10 and 9 bits), each a histogram
// of the values whose higher bits are the selected prefix so far; then the
// values above the k-th key are written, and of those equal to it the ones
// of lowest index (their rank among the equal ones, an exclusive scan).
struct SelectState {
  uint32_t prefix;  // the k-th key's bits found so far
  uint32_t pad;
  unsigned long long above;  // values whose key is above that prefix's bin
  unsigned long long written;
};

__device__ __forceinline__ uint32_t MagnitudeKey(float x) {
  return __float_as_uint(x) & 0x7FFFFFFFu;
}

// Level histogram: the bits [shift, shift + log2(bins)) of the keys whose
// bits from `high` up equal state->prefix (high 31: every key).
__global__ void SelectHistKernel(const float* acc, uint64_t size, uint32_t shift, uint32_t bins,
                                 uint32_t high, const SelectState* state, unsigned* hist) {
  extern __shared__ unsigned local[];
  for (uint32_t b = threadIdx.x; b < bins; b += blockDim.x) local[b] = 0;
  __syncthreads();
  const uint32_t prefix = high >= 31 ? 0 : state->prefix;
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < size; i += stride) {
    const uint32_t key = MagnitudeKey(acc[i]);
    if (high >= 31 || (key >> high) == prefix) atomicAdd(&local[(key >> shift) & (bins - 1)], 1u);
  }
  __syncthreads();
  for (uint32_t b = threadIdx.x; b < bins; b += blockDim.x) {
    if (local[b] != 0) atomicAdd(&hist[b], local[b]);
  }
}

// The bin of the n-th largest key at this level (`width` bits), appended
// to the prefix; the values above it counted. One thread: 4,096 bins at most.
__global__ void SelectFindKernel(const unsigned* hist, uint32_t bins, uint32_t width, uint64_t n,
                                 SelectState* state) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  unsigned long long above = state->above;
  uint32_t b = bins;
  while (b > 0) {
    --b;
    if (above + hist[b] >= n) break;
    above += hist[b];
  }
  state->prefix = (state->prefix << width) | b;
  state->above = above;
}

__global__ void SelectEqualKernel(const float* acc, uint64_t size, const SelectState* state,
                                  uint32_t* equal) {
  const uint32_t key = state->prefix;
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < size; i += stride) {
    equal[i] = MagnitudeKey(acc[i]) == key ? 1u : 0u;
  }
}

// Every value above the k-th key, and the first n - above of those equal
// to it (`rank`: how many equal ones come before each), in any order.
__global__ void SelectOutputKernel(const float* acc, uint64_t size, uint64_t n, SelectState* state,
                                   const uint32_t* rank, uint32_t* out_index, float* out_value) {
  const uint32_t kth = state->prefix;
  const unsigned long long ties = n - state->above;
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  for (uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < size; i += stride) {
    const uint32_t key = MagnitudeKey(acc[i]);
    if (key > kth || (key == kth && rank[i] < ties)) {
      const unsigned long long at = atomicAdd(&state->written, 1ull);
      out_index[at] = static_cast<uint32_t>(i);
      out_value[at] = acc[i];
    }
  }
}

__global__ void SetCountKernel(StepScalars* scalars, uint64_t count) {
  if (blockIdx.x == 0 && threadIdx.x == 0) scalars->count = count;
}

inline bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

inline size_t AlignUp(size_t x) { return (x + 255) / 256 * 256; }

// Device memory reused by the calls that need scratch, one per stream.
struct Scratch {
  void* ptr = nullptr;
  size_t bytes = 0;
};

// A CUDA error becomes kDeviceError, printed with the call that failed.
KernelStatus Check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return KernelStatus::kOk;
  MICROD_LOG(Error, "CUDA backend: %s failed: %s", what, cudaGetErrorString(err));
  return KernelStatus::kDeviceError;
}

#define TRY(call, what)                           \
  do {                                            \
    const KernelStatus st_ = Check((call), what); \
    if (st_ != KernelStatus::kOk) return st_;     \
  } while (0)
#define TRY_STATUS(expr)                      \
  do {                                        \
    const KernelStatus st_ = (expr);          \
    if (st_ != KernelStatus::kOk) return st_; \
  } while (0)

class CudaSparseOps final : public SparseOps {
 public:
  CudaSparseOps(int device, int sm_count, std::string name)
      : device_(device),
        sm_count_(std::max(1, sm_count)),
        max_blocks_(sm_count_ * (2048 / kThreads)),
        name_(std::move(name)) {}

  ~CudaSparseOps() override {
    if (!SetDevice()) return;
    std::lock_guard<std::mutex> lock(scratch_mu_);
    for (auto& [stream, s] : scratch_) {
      if (s.ptr != nullptr) cudaFree(s.ptr);
    }
  }

  Device device() const override { return Device::kCuda; }
  const char* name() const override { return name_.c_str(); }

  void* Allocate(size_t bytes) override {
    if (!SetDevice()) return nullptr;
    // cudaMalloc aligns to at least 256 bytes; size 0 still gets a pointer.
    const size_t rounded = AlignUp(std::max<size_t>(bytes, 1));
    void* p = nullptr;
    if (Check(cudaMalloc(&p, rounded), "cudaMalloc") != KernelStatus::kOk) return nullptr;
    // cudaMemset may return before it is done, and kernels on non-blocking
    // streams do not wait for the legacy stream: finish it here.
    if (Check(cudaMemsetAsync(p, 0, rounded, nullptr), "cudaMemset") != KernelStatus::kOk ||
        Check(cudaStreamSynchronize(nullptr), "cudaMemset sync") != KernelStatus::kOk) {
      cudaFree(p);
      return nullptr;
    }
    return p;
  }
  void Free(void* ptr) override {
    if (ptr == nullptr || !SetDevice()) return;
    Check(cudaFree(ptr), "cudaFree");
  }

  KernelStatus CopyToHost(void* dst, const void* src, size_t bytes, void* stream) override {
    return Copy(dst, src, bytes, stream, "CopyToHost");
  }
  KernelStatus CopyToDevice(void* dst, const void* src, size_t bytes, void* stream) override {
    return Copy(dst, src, bytes, stream, "CopyToDevice");
  }
  KernelStatus Synchronize(void* stream) override {
    if (!SetDevice()) return KernelStatus::kDeviceError;
    CountHostWait();
    return Check(cudaStreamSynchronize(S(stream)), "cudaStreamSynchronize");
  }
  KernelStatus SynchronizeFor(void* stream, double seconds) override {
    if (!SetDevice()) return KernelStatus::kDeviceError;
    CountHostWait();
    // An event after the queued work, polled until the deadline (a host
    // wait with no deadline could hang on a stuck kernel).
    cudaEvent_t done = nullptr;
    TRY(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreate");
    KernelStatus result = Check(cudaEventRecord(done, S(stream)), "cudaEventRecord");
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::duration<double>(std::max(0.0, seconds));
    const PollPacer pacer;
    while (result == KernelStatus::kOk) {
      const cudaError_t e = cudaEventQuery(done);
      if (e == cudaSuccess) break;
      if (e != cudaErrorNotReady) {
        result = Check(e, "cudaEventQuery");
        break;
      }
      if (std::chrono::steady_clock::now() >= deadline) {
        (void)cudaGetLastError();
        result = KernelStatus::kTimedOut;
        break;
      }
      pacer.Pause();
    }
    cudaEventDestroy(done);  // released once the event completes, even if still pending
    return result;
  }

  KernelStatus FusedAccumulateSelect(const FusedSelectArgs& a, void* stream) override {
    if (!FusedSelectArgsValid(a)) return KernelStatus::kInvalidArgument;
    if (!SetDevice()) return KernelStatus::kDeviceError;
    cudaStream_t s = S(stream);
    TRY(cudaMemsetAsync(a.scalars, 0, sizeof(StepScalars), s), "memset scalars");
    if (a.size == 0) return KernelStatus::kOk;
    FusedParams p;
    p.grad = a.grad;
    p.residual = a.residual;
    p.acc = a.acc;
    p.velocity_in = a.velocity_in;
    p.velocity_out = a.velocity_out;
    p.beta = a.beta;
    p.grad_scale = a.grad_scale;
    p.first = 0;
    p.end = a.size;
    p.sel_begin = a.select_begin;
    p.sel_end = a.select_end;
    p.threshold = a.threshold;
    p.out_index = a.out_index;
    p.out_value = a.out_value;
    p.capacity = a.out_capacity;
    p.scalars = a.scalars;
    const uint64_t tiles = (a.size + kTile - 1) / kTile;
    const bool velocity_aligned =
        a.velocity_in == nullptr || (Aligned16(a.velocity_in) && Aligned16(a.velocity_out));
    const bool aligned =
        Aligned16(a.grad) && Aligned16(a.residual) && Aligned16(a.acc) && velocity_aligned;
    // FusedSelectArgs allows no overlap but these two identities.
    const bool distinct =
        a.acc != a.residual && (a.velocity_out == nullptr || a.velocity_out != a.velocity_in);
    if (distinct) {
      const auto kernel = aligned ? FusedKernelDistinct<true> : FusedKernelDistinct<false>;
      kernel<<<GridFor(kernel, tiles), kThreads, 0, s>>>(p, p.grad, p.residual, p.acc,
                                                         p.velocity_in, p.velocity_out);
    } else {
      const auto kernel = aligned ? FusedKernel<true, true> : FusedKernel<true, false>;
      kernel<<<GridFor(kernel, tiles), kThreads, 0, s>>>(p);
    }
    TRY(cudaGetLastError(), "fused kernel launch");
    // The update's zero fill, queued after the pass that reads grad (which
    // it may be): on the GPU not fused (the kernels take grad __restrict__).
    if (a.zero_out != nullptr) {
      TRY(cudaMemsetAsync(a.zero_out, 0, a.size * sizeof(float), s), "memset update");
    }
    return KernelStatus::kOk;
  }

  KernelStatus SelectRange(const float* acc, uint64_t begin, uint64_t end, float threshold,
                           uint32_t* out_index, float* out_value, StepScalars* scalars,
                           void* stream) override {
    if (scalars == nullptr || begin > end || end > kMaxBucketElements) {
      return KernelStatus::kInvalidArgument;
    }
    if (end > begin && (acc == nullptr || out_index == nullptr || out_value == nullptr)) {
      return KernelStatus::kInvalidArgument;
    }
    if (!SetDevice()) return KernelStatus::kDeviceError;
    cudaStream_t s = S(stream);
    TRY(cudaMemsetAsync(&scalars->count, 0, sizeof(uint64_t), s), "memset count");
    if (end == begin) return KernelStatus::kOk;
    FusedParams p;
    p.acc = const_cast<float*>(acc);  // read only without kAccumulate
    p.first = begin & ~uint64_t{3};   // keeps float4 loads aligned
    p.end = end;
    p.sel_begin = begin;
    p.sel_end = end;
    p.threshold = threshold;
    p.out_index = out_index;
    p.out_value = out_value;
    p.scalars = scalars;
    const uint64_t tiles = (p.end - p.first + kTile - 1) / kTile;
    const auto kernel = Aligned16(acc) ? FusedKernel<false, true> : FusedKernel<false, false>;
    kernel<<<GridFor(kernel, tiles), kThreads, 0, s>>>(p);
    return Check(cudaGetLastError(), "select kernel launch");
  }

  KernelStatus TrimBelow(uint32_t* index, float* value, uint64_t count, float threshold,
                         StepScalars* scalars, void* stream) override {
    if (scalars == nullptr || (count > 0 && (index == nullptr || value == nullptr)) ||
        count > kMaxBucketElements) {
      return KernelStatus::kInvalidArgument;
    }
    if (!SetDevice()) return KernelStatus::kDeviceError;
    cudaStream_t s = S(stream);
    if (count == 0) {
      TRY(cudaMemsetAsync(&scalars->count, 0, sizeof(uint64_t), s), "memset count");
      return KernelStatus::kOk;
    }
    unsigned long long* d_count = reinterpret_cast<unsigned long long*>(&scalars->count);
    const auto n = static_cast<int64_t>(count);
    size_t temp_index = 0, temp_value = 0;
    TRY(cub::DeviceSelect::Flagged(nullptr, temp_index, index, static_cast<uint8_t*>(nullptr),
                                   d_count, n, s),
        "DeviceSelect::Flagged size");
    TRY(cub::DeviceSelect::Flagged(nullptr, temp_value, value, static_cast<uint8_t*>(nullptr),
                                   d_count, n, s),
        "DeviceSelect::Flagged size");
    const size_t temp = std::max(temp_index, temp_value);
    char* base = nullptr;
    TRY_STATUS(GetScratch(s, AlignUp(count) + temp, &base));
    uint8_t* flags = reinterpret_cast<uint8_t*>(base);
    void* d_temp = base + AlignUp(count);
    TrimFlagsKernel<<<Grid(count, kThreads), kThreads, 0, s>>>(value, count, threshold, flags);
    TRY(cudaGetLastError(), "trim flags launch");
    // In place and stable: indices first, then values, with the same flags.
    size_t bytes = temp;
    TRY(cub::DeviceSelect::Flagged(d_temp, bytes, index, flags, d_count, n, s),
        "DeviceSelect::Flagged indices");
    bytes = temp;
    TRY(cub::DeviceSelect::Flagged(d_temp, bytes, value, flags, d_count, n, s),
        "DeviceSelect::Flagged values");
    return KernelStatus::kOk;
  }

  KernelStatus LogHistogram(const float* values, uint64_t count, uint32_t shift, uint32_t first_bin,
                            uint32_t num_bins, int64_t* bins, void* stream) override {
    if (bins == nullptr || shift > 31 || (count > 0 && values == nullptr) ||
        num_bins == 0xFFFFFFFFu) {
      return KernelStatus::kInvalidArgument;
    }
    if (!SetDevice()) return KernelStatus::kDeviceError;
    cudaStream_t s = S(stream);
    TRY(cudaMemsetAsync(bins, 0, (uint64_t{num_bins} + 1) * sizeof(int64_t), s), "memset bins");
    if (count == 0) return KernelStatus::kOk;
    // Per-block shared counters are 32-bit: keep each block under 2^31 values.
    const int grid = std::max(Grid(count, kThreads),
                              static_cast<int>(std::min<uint64_t>((count >> 31) + 1, 1u << 30)));
    auto* out = reinterpret_cast<unsigned long long*>(bins);
    if (num_bins + 1 <= kMaxSharedBins) {
      const size_t shared = (size_t{num_bins} + 1) * sizeof(unsigned);
      HistogramKernel<true>
          <<<grid, kThreads, shared, s>>>(values, count, shift, first_bin, num_bins, out);
    } else {
      HistogramKernel<false>
          <<<grid, kThreads, 0, s>>>(values, count, shift, first_bin, num_bins, out);
    }
    return Check(cudaGetLastError(), "histogram launch");
  }

  KernelStatus Momentum(const float* grad, const float* velocity_in, float beta,
                        float* velocity_out, uint64_t size, void* stream) override {
    if (size > 0 && (grad == nullptr || velocity_in == nullptr || velocity_out == nullptr ||
                     velocity_out == grad)) {
      return KernelStatus::kInvalidArgument;
    }
    if (size == 0) return KernelStatus::kOk;
    if (!SetDevice()) return KernelStatus::kDeviceError;
    MomentumKernel<<<Grid(size, kThreads), kThreads, 0, S(stream)>>>(grad, velocity_in, beta,
                                                                     velocity_out, size);
    return Check(cudaGetLastError(), "momentum launch");
  }

  KernelStatus SumOfSquares(const float* data, uint64_t size, double* host_result,
                            void* stream) override {
    if (host_result == nullptr || (size > 0 && data == nullptr)) {
      return KernelStatus::kInvalidArgument;
    }
    if (size == 0) {
      *host_result = 0.0;
      return KernelStatus::kOk;
    }
    if (!SetDevice()) return KernelStatus::kDeviceError;
    cudaStream_t s = S(stream);
    char* base = nullptr;
    TRY_STATUS(GetScratch(s, AlignUp(kSumBlocks * sizeof(double)) + sizeof(double), &base));
    auto* partial = reinterpret_cast<double*>(base);
    auto* result = reinterpret_cast<double*>(base + AlignUp(kSumBlocks * sizeof(double)));
    // Always kSumBlocks blocks (idle ones write 0), so the summation order
    // depends on the size only, not on the device.
    SumSquaresPartialKernel<<<kSumBlocks, kThreads, 0, s>>>(data, size, partial);
    TRY(cudaGetLastError(), "sum of squares launch");
    SumPartialsKernel<<<1, 32, 0, s>>>(partial, kSumBlocks, result);
    TRY(cudaGetLastError(), "sum of partials launch");
    double h = 0.0;
    TRY(cudaMemcpyAsync(&h, result, sizeof h, cudaMemcpyDeviceToHost, s), "copy sum");
    CountHostWait();
    TRY(cudaStreamSynchronize(s), "sum of squares sync");
    *host_result = h;
    return KernelStatus::kOk;
  }

  KernelStatus HalfToFloat(const uint16_t* src, ElementType type, uint64_t count, float* dst,
                           void* stream) override {
    if (!IsHalfType(type) || (count > 0 && (src == nullptr || dst == nullptr))) {
      return KernelStatus::kInvalidArgument;
    }
    if (count == 0) return KernelStatus::kOk;
    if (!SetDevice()) return KernelStatus::kDeviceError;
    HalfToFloatKernel<<<Grid(count, kThreads), kThreads, 0, S(stream)>>>(
        src, type == ElementType::kBFloat16, count, dst);
    return Check(cudaGetLastError(), "half to float launch");
  }

  KernelStatus FloatToHalf(const float* src, ElementType type, uint64_t count, uint16_t* dst,
                           void* stream) override {
    if (!IsHalfType(type) || (count > 0 && (src == nullptr || dst == nullptr))) {
      return KernelStatus::kInvalidArgument;
    }
    if (count == 0) return KernelStatus::kOk;
    if (!SetDevice()) return KernelStatus::kDeviceError;
    FloatToHalfKernel<<<Grid(count, kThreads), kThreads, 0, S(stream)>>>(
        src, type == ElementType::kBFloat16, count, dst);
    return Check(cudaGetLastError(), "float to half launch");
  }

  KernelStatus GatherRounded(float* acc, const uint32_t* index, uint64_t count, ElementType type,
                             uint16_t* out, void* stream) override {
    if (!IsHalfType(type) ||
        (count > 0 && (acc == nullptr || index == nullptr || out == nullptr))) {
      return KernelStatus::kInvalidArgument;
    }
    if (count == 0) return KernelStatus::kOk;
    if (!SetDevice()) return KernelStatus::kDeviceError;
    GatherRoundedKernel<<<Grid(count, kThreads), kThreads, 0, S(stream)>>>(
        acc, index, count, type == ElementType::kBFloat16, out);
    return Check(cudaGetLastError(), "gather rounded launch");
  }

  KernelStatus Gather(const float* acc, const uint32_t* index, uint64_t count, float* out,
                      void* stream) override {
    if (count > 0 && (acc == nullptr || index == nullptr || out == nullptr)) {
      return KernelStatus::kInvalidArgument;
    }
    if (count == 0) return KernelStatus::kOk;
    if (!SetDevice()) return KernelStatus::kDeviceError;
    GatherKernel<<<Grid(count, kThreads), kThreads, 0, S(stream)>>>(acc, index, count, out);
    return Check(cudaGetLastError(), "gather launch");
  }

  KernelStatus GatherSum(const FusedSelectArgs& a, const uint32_t* index, uint64_t count,
                         float* out, void* stream) override {
    if (count > 0 && (a.grad == nullptr || a.residual == nullptr || index == nullptr ||
                      out == nullptr || a.size > kMaxBucketElements)) {
      return KernelStatus::kInvalidArgument;
    }
    if (count == 0) return KernelStatus::kOk;
    if (!SetDevice()) return KernelStatus::kDeviceError;
    FusedParams p;
    p.grad = a.grad;
    p.residual = a.residual;
    p.velocity_in = a.velocity_in;
    p.beta = a.beta;
    p.grad_scale = a.grad_scale;
    GatherSumKernel<<<Grid(count, kThreads), kThreads, 0, S(stream)>>>(p, index, count, out);
    return Check(cudaGetLastError(), "gather launch");
  }

  KernelStatus ScatterAverage(const float* values, const uint32_t* index, uint64_t count,
                              float divisor, float* out, uint64_t size, bool out_zeroed,
                              void* stream) override {
    if (size > kMaxBucketElements || (size > 0 && out == nullptr) ||
        (count > 0 && (values == nullptr || index == nullptr))) {
      return KernelStatus::kInvalidArgument;
    }
    if (!SetDevice()) return KernelStatus::kDeviceError;
    cudaStream_t s = S(stream);
    if (size > 0 && !out_zeroed) {
      TRY(cudaMemsetAsync(out, 0, size * sizeof(float), s), "memset update");
    }
    if (count == 0 || size == 0) return KernelStatus::kOk;
    ScatterAverageKernel<<<Grid(count, kThreads), kThreads, 0, s>>>(values, index, count, divisor,
                                                                    out, size);
    return Check(cudaGetLastError(), "scatter launch");
  }

  KernelStatus CopyFloats(float* dst, const float* src, uint64_t count, void* stream) override {
    if (count > 0 && (dst == nullptr || src == nullptr)) return KernelStatus::kInvalidArgument;
    if (count == 0) return KernelStatus::kOk;
    if (!SetDevice()) return KernelStatus::kDeviceError;
    return Check(cudaMemcpyAsync(dst, src, count * sizeof(float), cudaMemcpyDefault, S(stream)),
                 "copy");
  }

  KernelStatus ZeroFloats(float* dst, uint64_t count, void* stream) override {
    if (count > 0 && dst == nullptr) return KernelStatus::kInvalidArgument;
    if (count == 0) return KernelStatus::kOk;
    if (!SetDevice()) return KernelStatus::kDeviceError;
    return Check(cudaMemsetAsync(dst, 0, count * sizeof(float), S(stream)), "zero");
  }

  KernelStatus CountOutside(const uint32_t* index, uint64_t count, uint64_t begin, uint64_t end,
                            StepScalars* scalars, void* stream) override {
    if (scalars == nullptr || (count > 0 && index == nullptr))
      return KernelStatus::kInvalidArgument;
    if (!SetDevice()) return KernelStatus::kDeviceError;
    cudaStream_t s = S(stream);
    TRY(cudaMemsetAsync(scalars, 0, sizeof(StepScalars), s), "memset scalars");
    if (count == 0) return KernelStatus::kOk;
    CountOutsideKernel<<<Grid(count, kThreads), kThreads, 0, s>>>(index, count, begin, end,
                                                                  scalars);
    return Check(cudaGetLastError(), "index check launch");
  }

  KernelStatus ZeroAt(float* acc, const uint32_t* index, uint64_t count, void* stream) override {
    if (count > 0 && (acc == nullptr || index == nullptr)) return KernelStatus::kInvalidArgument;
    if (count == 0) return KernelStatus::kOk;
    if (!SetDevice()) return KernelStatus::kDeviceError;
    ZeroAtKernel<<<Grid(count, kThreads), kThreads, 0, S(stream)>>>(acc, index, count);
    return Check(cudaGetLastError(), "zero launch");
  }

  KernelStatus LocalSum(const float* const* inputs, int num_inputs, uint64_t size, float* out,
                        StepScalars* scalars, void* stream) override {
    if (num_inputs < 1 || inputs == nullptr || (size > 0 && out == nullptr)) {
      return KernelStatus::kInvalidArgument;
    }
    for (int l = 0; l < num_inputs; ++l) {
      if (size > 0 && inputs[l] == nullptr) return KernelStatus::kInvalidArgument;
    }
    if (!SetDevice()) return KernelStatus::kDeviceError;
    cudaStream_t s = S(stream);
    unsigned long long* nonfinite = nullptr;
    if (scalars != nullptr) {
      TRY(cudaMemsetAsync(&scalars->nonfinite, 0, sizeof(uint64_t), s), "memset nonfinite");
      nonfinite = reinterpret_cast<unsigned long long*>(&scalars->nonfinite);
    }
    if (size == 0) return KernelStatus::kOk;
    // Inputs in order, kSumInputsPerLaunch per launch; later launches add to out.
    for (int l0 = 0; l0 < num_inputs; l0 += kSumInputsPerLaunch) {
      SumInputs batch{};
      batch.n = std::min(kSumInputsPerLaunch, num_inputs - l0);
      for (int l = 0; l < batch.n; ++l) batch.in[l] = inputs[l0 + l];
      const bool last = l0 + batch.n == num_inputs;
      LocalSumKernel<<<Grid(size, kThreads), kThreads, 0, s>>>(batch, l0 > 0, out, size,
                                                               last ? nonfinite : nullptr);
      TRY(cudaGetLastError(), "local sum launch");
    }
    return KernelStatus::kOk;
  }

  KernelStatus Divide(float* data, uint64_t size, float divisor, StepScalars* scalars,
                      void* stream) override {
    if (size > 0 && data == nullptr) return KernelStatus::kInvalidArgument;
    if (!SetDevice()) return KernelStatus::kDeviceError;
    cudaStream_t s = S(stream);
    unsigned long long* nonfinite = nullptr;
    if (scalars != nullptr) {
      TRY(cudaMemsetAsync(&scalars->nonfinite, 0, sizeof(uint64_t), s), "memset nonfinite");
      nonfinite = reinterpret_cast<unsigned long long*>(&scalars->nonfinite);
    }
    if (size == 0) return KernelStatus::kOk;
    DivideKernel<<<Grid(size, kThreads), kThreads, 0, s>>>(data, size, divisor, nonfinite);
    return Check(cudaGetLastError(), "divide launch");
  }

  KernelStatus CountNonFinite(const float* data, uint64_t size, StepScalars* scalars,
                              void* stream) override {
    if (scalars == nullptr || (size > 0 && data == nullptr)) return KernelStatus::kInvalidArgument;
    if (!SetDevice()) return KernelStatus::kDeviceError;
    cudaStream_t s = S(stream);
    TRY(cudaMemsetAsync(&scalars->nonfinite, 0, sizeof(uint64_t), s), "memset nonfinite");
    if (size == 0) return KernelStatus::kOk;
    CountNonFiniteKernel<<<Grid(size, kThreads), kThreads, 0, s>>>(
        data, size, reinterpret_cast<unsigned long long*>(&scalars->nonfinite));
    return Check(cudaGetLastError(), "count non-finite launch");
  }

  KernelStatus TopK(const float* acc, uint64_t size, uint64_t k, uint32_t* out_index,
                    float* out_value, StepScalars* scalars, void* stream) override {
    if (scalars == nullptr || size > kMaxBucketElements) return KernelStatus::kInvalidArgument;
    const uint64_t n = std::min(k, size);
    if (n > 0 && (acc == nullptr || out_index == nullptr || out_value == nullptr)) {
      return KernelStatus::kInvalidArgument;
    }
    if (!SetDevice()) return KernelStatus::kDeviceError;
    cudaStream_t s = S(stream);
    if (n == 0) {
      TRY(cudaMemsetAsync(&scalars->count, 0, sizeof(uint64_t), s), "memset count");
      return KernelStatus::kOk;
    }
    // Scratch: the state, a histogram, the equal flags and their ranks, the
    // scan's own.
    const size_t array = AlignUp(size * sizeof(uint32_t));
    const size_t head = AlignUp(sizeof(SelectState)) + AlignUp(4096 * sizeof(unsigned));
    size_t temp = 0;
    TRY(cub::DeviceScan::ExclusiveSum(nullptr, temp, static_cast<uint32_t*>(nullptr),
                                      static_cast<uint32_t*>(nullptr), static_cast<int64_t>(size),
                                      s),
        "DeviceScan::ExclusiveSum size");
    char* base = nullptr;
    TRY_STATUS(GetScratch(s, head + 2 * array + temp, &base));
    auto* state = reinterpret_cast<SelectState*>(base);
    auto* hist = reinterpret_cast<unsigned*>(base + AlignUp(sizeof(SelectState)));
    auto* equal = reinterpret_cast<uint32_t*>(base + head);
    auto* rank = reinterpret_cast<uint32_t*>(base + head + array);
    TRY(cudaMemsetAsync(state, 0, sizeof(SelectState), s), "memset select state");
    struct Level {
      uint32_t shift, width, high;
    };
    for (const Level l : {Level{19, 12, 31}, Level{9, 10, 19}, Level{0, 9, 9}}) {
      const uint32_t bins = 1u << l.width;
      TRY(cudaMemsetAsync(hist, 0, bins * sizeof(unsigned), s), "memset select histogram");
      SelectHistKernel<<<Grid(size, kThreads), kThreads, bins * sizeof(unsigned), s>>>(
          acc, size, l.shift, bins, l.high, state, hist);
      TRY(cudaGetLastError(), "top-k histogram launch");
      SelectFindKernel<<<1, 1, 0, s>>>(hist, bins, l.width, n, state);
      TRY(cudaGetLastError(), "top-k find launch");
    }
    SelectEqualKernel<<<Grid(size, kThreads), kThreads, 0, s>>>(acc, size, state, equal);
    TRY(cudaGetLastError(), "top-k ties launch");
    size_t bytes = temp;
    TRY(cub::DeviceScan::ExclusiveSum(base + head + 2 * array, bytes, equal, rank,
                                      static_cast<int64_t>(size), s),
        "DeviceScan::ExclusiveSum");
    SelectOutputKernel<<<Grid(size, kThreads), kThreads, 0, s>>>(acc, size, n, state, rank,
                                                                 out_index, out_value);
    TRY(cudaGetLastError(), "top-k output launch");
    SetCountKernel<<<1, 1, 0, s>>>(scalars, n);
    return Check(cudaGetLastError(), "set count launch");
  }

  KernelStatus SortUnique(uint32_t* index, uint64_t count, StepScalars* scalars,
                          void* stream) override {
    if (scalars == nullptr || (count > 0 && index == nullptr) || count > kMaxBucketElements) {
      return KernelStatus::kInvalidArgument;
    }
    if (!SetDevice()) return KernelStatus::kDeviceError;
    cudaStream_t s = S(stream);
    if (count == 0) {
      TRY(cudaMemsetAsync(&scalars->count, 0, sizeof(uint64_t), s), "memset count");
      return KernelStatus::kOk;
    }
    unsigned long long* d_count = reinterpret_cast<unsigned long long*>(&scalars->count);
    const size_t array = AlignUp(count * sizeof(uint32_t));
    cub::DoubleBuffer<uint32_t> keys(nullptr, nullptr);
    size_t temp_sort = 0, temp_unique = 0;
    TRY(cub::DeviceRadixSort::SortKeys(nullptr, temp_sort, keys, count, 0, 32, s),
        "DeviceRadixSort::SortKeys size");
    TRY(cub::DeviceSelect::Unique(nullptr, temp_unique, static_cast<uint32_t*>(nullptr),
                                  static_cast<uint32_t*>(nullptr), d_count,
                                  static_cast<int64_t>(count), s),
        "DeviceSelect::Unique size");
    const size_t temp = std::max(temp_sort, temp_unique);
    char* base = nullptr;
    TRY_STATUS(GetScratch(s, array + temp, &base));
    uint32_t* other = reinterpret_cast<uint32_t*>(base);
    void* d_temp = base + array;
    keys = cub::DoubleBuffer<uint32_t>(index, other);
    size_t bytes = temp;
    TRY(cub::DeviceRadixSort::SortKeys(d_temp, bytes, keys, count, 0, 32, s),
        "DeviceRadixSort::SortKeys");
    // Unique from the sorted buffer into the other one, then back if needed.
    uint32_t* sorted = keys.Current();
    uint32_t* dest = sorted == index ? other : index;
    bytes = temp;
    TRY(cub::DeviceSelect::Unique(d_temp, bytes, sorted, dest, d_count, static_cast<int64_t>(count),
                                  s),
        "DeviceSelect::Unique");
    if (dest != index) {
      TRY(cudaMemcpyAsync(index, dest, count * sizeof(uint32_t), cudaMemcpyDeviceToDevice, s),
          "copy unique indices");
    }
    return KernelStatus::kOk;
  }

 private:
  static cudaStream_t S(void* stream) { return static_cast<cudaStream_t>(stream); }

  // Makes this object's device current on the calling thread.
  bool SetDevice() const {
    int current = -1;
    if (cudaGetDevice(&current) == cudaSuccess && current == device_) return true;
    return Check(cudaSetDevice(device_), "cudaSetDevice") == KernelStatus::kOk;
  }

  // Blocks for a grid-stride loop over `items` work items of `per_block` each,
  // at most what the device runs at once.
  int Grid(uint64_t items, uint64_t per_block) const {
    const uint64_t blocks = (items + per_block - 1) / per_block;
    return static_cast<int>(std::max<uint64_t>(1, std::min<uint64_t>(blocks, max_blocks_)));
  }

  // The same for one kernel by its own occupancy (its registers decide how
  // many blocks an SM holds: the fused kernels take more than the 32 per
  // thread that 8 blocks of 256 threads leave), asked once per kernel.
  template <typename Kernel>
  int GridFor(Kernel kernel, uint64_t tiles) {
    const void* key = reinterpret_cast<const void*>(kernel);
    int per_sm = 0;
    {
      std::lock_guard<std::mutex> lock(occupancy_mu_);
      auto it = occupancy_.find(key);
      if (it != occupancy_.end()) {
        per_sm = it->second;
      } else {
        if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0) !=
                cudaSuccess ||
            per_sm < 1) {
          (void)cudaGetLastError();
          per_sm = 2048 / kThreads;
        }
        occupancy_[key] = per_sm;
      }
    }
    const uint64_t most = uint64_t(sm_count_) * uint64_t(per_sm);
    return static_cast<int>(std::max<uint64_t>(1, std::min<uint64_t>(tiles, most)));
  }

  KernelStatus Copy(void* dst, const void* src, size_t bytes, void* stream, const char* what) {
    if (bytes == 0) return KernelStatus::kOk;
    if (dst == nullptr || src == nullptr) return KernelStatus::kInvalidArgument;
    if (!SetDevice()) return KernelStatus::kDeviceError;
    cudaStream_t s = S(stream);
    TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s), what);
    CountHostWait();
    return Check(cudaStreamSynchronize(s), what);
  }

  // Scratch of at least `bytes` for work queued on `stream`. Growing it waits
  // for the stream, so work still using the old area is done before it goes.
  KernelStatus GetScratch(cudaStream_t stream, size_t bytes, char** out) {
    std::lock_guard<std::mutex> lock(scratch_mu_);
    Scratch& s = scratch_[stream];
    if (s.bytes < bytes) {
      TRY(cudaStreamSynchronize(stream), "scratch sync");
      if (s.ptr != nullptr) TRY(cudaFree(s.ptr), "scratch free");
      s.ptr = nullptr;
      s.bytes = 0;
      const size_t grown = AlignUp(bytes + bytes / 4);
      TRY(cudaMalloc(&s.ptr, grown), "scratch cudaMalloc");
      s.bytes = grown;
    }
    *out = static_cast<char*>(s.ptr);
    return KernelStatus::kOk;
  }

  const int device_;
  const int sm_count_;
  const uint64_t max_blocks_;
  std::mutex occupancy_mu_;
  std::map<const void*, int> occupancy_;  // blocks per SM, by kernel
  const std::string name_;
  std::mutex scratch_mu_;
  std::map<cudaStream_t, Scratch> scratch_;
};

#undef TRY
#undef TRY_STATUS

}  // namespace

std::unique_ptr<SparseOps> CreateCudaSparseOps(int device, std::string* reason) {
  auto fail = [reason](std::string why) -> std::unique_ptr<SparseOps> {
    if (reason != nullptr) *reason = std::move(why);
    return nullptr;
  };
  int count = 0;
  // Without a driver this returns an error (e.g. "CUDA driver version is
  // insufficient for CUDA runtime version"): no GPU, not a crash.
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear it
    return fail(std::string("no usable CUDA device: ") + cudaGetErrorString(err));
  }
  if (count == 0) return fail("no usable CUDA device: no CUDA device");
  if (device < 0 || device >= count) {
    return fail("CUDA device " + std::to_string(device) + " out of range (" +
                std::to_string(count) + " devices)");
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    cudaGetLastError();
    return fail("cannot read the properties of CUDA device " + std::to_string(device));
  }
  return std::make_unique<CudaSparseOps>(
      device, prop.multiProcessorCount,
      "cuda-sm" + std::to_string(prop.major) + std::to_string(prop.minor));
}

}  // namespace microd::kernels
