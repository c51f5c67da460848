// SPDX-License-Identifier: Apache-2.0
// The compute operations of a MiCRO step, behind one interface so that a CPU
// and a CUDA implementation can sit side by side (docs/design.md section 3).
//
// Contract shared by every implementation:
// - Every pointer argument named as an array is memory of the implementation's
//   device (`SparseOps::device()`): host memory for the CPU backend, device
//   memory for CUDA. Counts and thresholds that the host needs to size an
//   exchange are passed by value or returned through a `StepScalars` block in
//   device memory that the caller copies with `CopyToHost`.
// - `stream` is an opaque queue handle (a `cudaStream_t` on CUDA); nullptr is
//   the implementation's default queue. The CPU backend runs synchronously and
//   ignores it. Calls on one stream run in order.
// - Indices are uint32 relative to the start of the bucket, so a bucket holds
//   at most kMaxBucketElements elements; larger sizes are refused.
// - Kernels validate their arguments and return a KernelStatus; they never
//   throw and never abort. This module depends on nothing but the C++ library.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "kernels/element_type.h"

namespace microd::kernels {

enum class Device : int { kCpu = 0, kCuda = 1 };

enum class KernelStatus : int {
  kOk = 0,
  kInvalidArgument = 1,  // null pointer, bad range, size too large
  kDeviceError = 2,      // the device reported an error (CUDA only)
  kUnsupported = 3,      // not available in this build or on this machine
  kTimedOut = 4,         // SynchronizeFor: the work was still running at the deadline
};
const char* KernelStatusString(KernelStatus status);

// Indices are uint32: a bucket has fewer than 2^32 elements.
constexpr uint64_t kMaxBucketElements = 0xFFFFFFFFull;

// Scalars a kernel reports back. Lives in device memory.
struct StepScalars {
  uint64_t count = 0;      // elements selected (written to the output arrays, up to their capacity)
  uint64_t nonfinite = 0;  // number of NaN/Inf values seen (0 = all finite)
};

// The fused pass of steps 2 and 6 of the algorithm:
//   acc[i] = residual[i] + grad[i]               for i in [0, size)
//   select (i, acc[i]) with |acc[i]| >= threshold for i in [select_begin, select_end)
// `acc` may be `residual` (in place) but must not otherwise overlap an input;
// without that identity the arrays are distinct (the backend may then read the
// inputs ahead of the stores, through a read-only path). `acc` may also be
// null: the sums are then only selected and checked, nothing is stored (the
// step's read-only pass, which leaves the residual as it is until every node
// agrees on the step). The outputs receive the selected indices and values
// (any order), at most `out_capacity` pairs of them; `scalars->count` counts
// every selected element, so a count above the capacity says the outputs
// hold only part of the selection (the caller grows them and runs the pass
// again). `scalars->nonfinite` counts non-finite sums over the whole bucket.
//
// Momentum correction folds into the same pass when `velocity_in` is set:
//   u[i] = beta * velocity_in[i] + grad[i];  velocity_out[i] = u[i]
//   acc[i] = residual[i] + u[i]
// (the same float operations, in the same order, as Momentum() followed by the
// plain pass). `velocity_out` may be null (u is not stored) or
// `velocity_in`, but must overlap none of grad, residual and acc; a
// non-finite u makes acc non-finite, so the count above covers it.
// `out_index`, `out_value` and `scalars` overlap no other array.
struct FusedSelectArgs {
  const float* grad = nullptr;
  const float* residual = nullptr;
  float* acc = nullptr;
  uint64_t size = 0;
  uint64_t select_begin = 0;
  uint64_t select_end = 0;
  float threshold = 0.0f;
  uint32_t* out_index = nullptr;
  float* out_value = nullptr;
  StepScalars* scalars = nullptr;
  // Momentum correction (see above); none while velocity_in is nullptr.
  const float* velocity_in = nullptr;
  float* velocity_out = nullptr;
  float beta = 0.0f;
  // Local clipping folded into the pass: the gradient is read as
  // grad[i] * grad_scale (a rounded multiply, before anything else). 1
  // leaves it as it is.
  float grad_scale = 1.0f;
  // Pairs out_index and out_value hold; the default: the whole selection
  // range.
  uint64_t out_capacity = kMaxBucketElements;
  // The commit's update: zero_out[i] = 0 over [0, size), each after grad[i]
  // is read (it may be grad: the update written over the gradient), so that
  // the update's zero fill rides on a pass that reads grad anyway. Only
  // with acc stored; overlaps nothing else.
  float* zero_out = nullptr;
};

// The argument checks every backend makes before the fused pass.
inline bool FusedSelectArgsValid(const FusedSelectArgs& a) {
  if (a.scalars == nullptr || a.size > kMaxBucketElements || a.select_begin > a.select_end ||
      a.select_end > a.size) {
    return false;
  }
  if (a.size > 0 && (a.grad == nullptr || a.residual == nullptr || a.acc == a.grad)) return false;
  if (a.velocity_out != nullptr && a.velocity_in == nullptr) return false;
  if (a.velocity_out != nullptr && a.size > 0 &&
      (a.velocity_out == a.grad || a.velocity_out == a.residual || a.velocity_out == a.acc)) {
    return false;
  }
  if (a.zero_out != nullptr && a.size > 0 &&
      (a.acc == nullptr || a.zero_out == a.residual || a.zero_out == a.acc ||
       a.zero_out == a.velocity_in || a.zero_out == a.velocity_out)) {
    return false;
  }
  return a.select_end == a.select_begin ||
         (a.out_index != nullptr && a.out_value != nullptr && a.out_capacity > 0);
}

// Which instruction set the CPU backend uses. kAuto picks the best one the
// processor supports at run time.
enum class CpuIsa : int { kAuto = 0, kScalar = 1, kAvx2 = 2 };

class SparseOps {
 public:
  virtual ~SparseOps() = default;

  virtual Device device() const = 0;
  // Human-readable name of the code path, e.g. "cpu-avx2".
  virtual const char* name() const = 0;

  // How many calls so far returned only once the stream's work was done:
  // CopyToHost and CopyToDevice of at least one byte, Synchronize,
  // SynchronizeFor, SumOfSquares of at least one element. On a device each
  // is a round trip the host waits for; the CPU backend counts the same
  // calls, so a step's count is the same on both. Not counted: the waits of
  // allocation (Allocate, and a backend's scratch growing), which a step in
  // its steady state does not make.
  uint64_t host_waits() const { return host_waits_.load(std::memory_order_relaxed); }

  // Memory of this device, 64-byte aligned, zero-filled. Returns nullptr when
  // out of memory. Free(nullptr) is a no-op.
  virtual void* Allocate(size_t bytes) = 0;
  virtual void Free(void* ptr) = 0;
  // Copies between host and device memory; blocks until done.
  virtual KernelStatus CopyToHost(void* host_dst, const void* src, size_t bytes, void* stream) = 0;
  virtual KernelStatus CopyToDevice(void* dst, const void* host_src, size_t bytes,
                                    void* stream) = 0;
  // Waits until all work queued on `stream` has finished.
  virtual KernelStatus Synchronize(void* stream) = 0;
  // The same, for at most `seconds`: kTimedOut when the work is still
  // running then (it stays queued; the memory it uses must stay valid).
  virtual KernelStatus SynchronizeFor(void* stream, double seconds) = 0;

  // See FusedSelectArgs.
  virtual KernelStatus FusedAccumulateSelect(const FusedSelectArgs& args, void* stream) = 0;

  // Selection only: (i, acc[i]) with |acc[i]| >= threshold for i in [begin, end).
  // scalars->count receives the number selected; nonfinite is not computed.
  virtual KernelStatus SelectRange(const float* acc, uint64_t begin, uint64_t end, float threshold,
                                   uint32_t* out_index, float* out_value, StepScalars* scalars,
                                   void* stream) = 0;

  // Keeps, in place and in order, the pairs with |value| >= threshold.
  // scalars->count receives the number kept.
  virtual KernelStatus TrimBelow(uint32_t* index, float* value, uint64_t count, float threshold,
                                 StepScalars* scalars, void* stream) = 0;

  // Log-scale histogram over |values|: bin b = (bit pattern of |v|) >> shift.
  // bins[b - first_bin] += 1 for first_bin <= b < first_bin + num_bins;
  // bins[num_bins] counts the values above the window; values below it are
  // ignored. `bins` has num_bins + 1 entries and is overwritten.
  virtual KernelStatus LogHistogram(const float* values, uint64_t count, uint32_t shift,
                                    uint32_t first_bin, uint32_t num_bins, int64_t* bins,
                                    void* stream) = 0;

  // Momentum correction: velocity_out = beta * velocity_in + grad (may alias
  // velocity_in; not grad).
  virtual KernelStatus Momentum(const float* grad, const float* velocity_in, float beta,
                                float* velocity_out, uint64_t size, void* stream) = 0;

  // *host_result = sum of data[i]^2, accumulated in double in index order.
  virtual KernelStatus SumOfSquares(const float* data, uint64_t size, double* host_result,
                                    void* stream) = 0;

  // out[j] = acc[index[j]] for j in [0, count).
  virtual KernelStatus Gather(const float* acc, const uint32_t* index, uint64_t count, float* out,
                              void* stream) = 0;

  // out[j] = the fused pass's sum at index[j] (residual + grad, with
  // `args`' momentum and grad_scale: the bits the pass computes there) for j
  // in [0, count), read from args.grad, residual and velocity_in; nothing
  // is written but `out`. Indices below args.size.
  virtual KernelStatus GatherSum(const FusedSelectArgs& args, const uint32_t* index, uint64_t count,
                                 float* out, void* stream) = 0;

  // out[0..size) = 0 (unless `out_zeroed`: the commit pass zeroed it,
  // FusedSelectArgs::zero_out), then out[index[j]] = values[j] / divisor.
  virtual KernelStatus ScatterAverage(const float* values, const uint32_t* index, uint64_t count,
                                      float divisor, float* out, uint64_t size, bool out_zeroed,
                                      void* stream) = 0;

  // acc[index[j]] = 0 for j in [0, count).
  virtual KernelStatus ZeroAt(float* acc, const uint32_t* index, uint64_t count, void* stream) = 0;

  // dst[0..count) = src[0..count) (both in this backend's memory; they may
  // overlap), queued on `stream`.
  virtual KernelStatus CopyFloats(float* dst, const float* src, uint64_t count, void* stream) = 0;
  // dst[0..count) = 0, queued on `stream`.
  virtual KernelStatus ZeroFloats(float* dst, uint64_t count, void* stream) = 0;

  // scalars->count = how many of index[0..count) lie outside [begin, end);
  // scalars->nonfinite = 0. The check of indices a peer sent, before any
  // kernel above uses them.
  virtual KernelStatus CountOutside(const uint32_t* index, uint64_t count, uint64_t begin,
                                    uint64_t end, StepScalars* scalars, void* stream) = 0;

  // out = inputs[0] + inputs[1] + ... (summed in that order). `inputs` is a
  // host array of num_inputs device pointers; out may alias inputs[0].
  // scalars->nonfinite counts non-finite sums (scalars may be null).
  virtual KernelStatus LocalSum(const float* const* inputs, int num_inputs, uint64_t size,
                                float* out, StepScalars* scalars, void* stream) = 0;

  // data[i] /= divisor, and scalars->nonfinite counts non-finite inputs (scalars
  // may be null).
  virtual KernelStatus Divide(float* data, uint64_t size, float divisor, StepScalars* scalars,
                              void* stream) = 0;

  // Counts non-finite values of data into scalars->nonfinite.
  virtual KernelStatus CountNonFinite(const float* data, uint64_t size, StepScalars* scalars,
                                      void* stream) = 0;

  // Exact top-k by magnitude: writes min(k, size) pairs with the largest
  // |acc[i]| (ties broken by lower index; a NaN above every number, as the
  // bits of |acc[i]| order it), in any order; scalars->count receives the
  // number written.
  virtual KernelStatus TopK(const float* acc, uint64_t size, uint64_t k, uint32_t* out_index,
                            float* out_value, StepScalars* scalars, void* stream) = 0;

  // dst[i] = src[i] widened to fp32 (exact) for a bf16 or fp16 `type`.
  virtual KernelStatus HalfToFloat(const uint16_t* src, ElementType type, uint64_t count,
                                   float* dst, void* stream) = 0;
  // dst[i] = src[i] rounded to `type` (bf16 or fp16), to nearest with ties to
  // even; beyond fp16's range +-Inf; a NaN stays a NaN (quiet, its sign and
  // the top of its payload kept). Every backend gives the same bits
  // (kernels/convert.h).
  virtual KernelStatus FloatToHalf(const float* src, ElementType type, uint64_t count,
                                   uint16_t* dst, void* stream) = 0;
  // The selected values sent as `type` (bf16 or fp16), what the rounding
  // drops kept: out[j] = round(acc[index[j]]) (as FloatToHalf), then
  // acc[index[j]] -= widen(out[j]) (exact: a rounding error is a float).
  virtual KernelStatus GatherRounded(float* acc, const uint32_t* index, uint64_t count,
                                     ElementType type, uint16_t* out, void* stream) = 0;
  // Sorts index[0..count) ascending and removes duplicates in place;
  // scalars->count receives the number of distinct indices.
  virtual KernelStatus SortUnique(uint32_t* index, uint64_t count, StepScalars* scalars,
                                  void* stream) = 0;

 protected:
  void CountHostWait() { host_waits_.fetch_add(1, std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t> host_waits_{0};
};

// Creates the CPU backend. kAvx2 on a processor without AVX2 returns nullptr.
std::unique_ptr<SparseOps> CreateCpuSparseOps(CpuIsa isa = CpuIsa::kAuto);

// True when this processor can run the given instruction set.
bool CpuSupports(CpuIsa isa);

}  // namespace microd::kernels
