// SPDX-License-Identifier: Apache-2.0
// CPU backend of SparseOps: argument checks, the instruction-set dispatch of
// the memory-bound passes, and the small host loops around them.
#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kernels/convert.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/sparse_ops.h"

namespace microd::kernels {
namespace {

using cpu::PassResult;

inline uint32_t FloatBits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

class CpuSparseOps final : public SparseOps {
 public:
  explicit CpuSparseOps(CpuIsa isa) : isa_(isa) {}

  Device device() const override { return Device::kCpu; }
  const char* name() const override { return isa_ == CpuIsa::kAvx2 ? "cpu-avx2" : "cpu-scalar"; }

  void* Allocate(size_t bytes) override {
    // Large buffers (residuals, velocities, candidates) are fresh anonymous
    // mappings: zero without being written, each page faulted in when a
    // pass first writes it (memset-ing them all at once cost a bucket's
    // first step several hundred ms: ~460 MB for 25.6 M floats with momentum
    // correction, most of it only ever read as zeros or partly written).
    // 2 MiB aligned and backed by huge pages where the kernel allows it, so
    // the passes are not slowed by TLB misses.
    constexpr size_t kHuge = size_t{2} << 20;
    if (bytes >= 2 * kHuge) {
      const size_t rounded = (bytes + kHuge - 1) / kHuge * kHuge;
      void* base = mmap(nullptr, rounded + kHuge, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (base == MAP_FAILED) return nullptr;
      const uintptr_t b = reinterpret_cast<uintptr_t>(base);
      const uintptr_t aligned = (b + kHuge - 1) / kHuge * kHuge;
      if (aligned > b) munmap(base, aligned - b);
      const size_t tail = b + rounded + kHuge - (aligned + rounded);
      if (tail > 0) munmap(reinterpret_cast<void*>(aligned + rounded), tail);
      void* p = reinterpret_cast<void*>(aligned);
      madvise(p, rounded, MADV_HUGEPAGE);  // advice only: failure is harmless
      std::lock_guard<std::mutex> lock(mapped_mu_);
      mapped_[p] = rounded;
      return p;
    }
    const size_t rounded = (std::max<size_t>(bytes, 1) + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, rounded);
    if (p != nullptr) std::memset(p, 0, rounded);
    return p;
  }
  void Free(void* ptr) override {
    if (ptr == nullptr) return;
    {
      std::lock_guard<std::mutex> lock(mapped_mu_);
      if (auto it = mapped_.find(ptr); it != mapped_.end()) {
        munmap(ptr, it->second);
        mapped_.erase(it);
        return;
      }
    }
    std::free(ptr);
  }

  KernelStatus CopyToHost(void* dst, const void* src, size_t bytes, void*) override {
    if (bytes == 0) return KernelStatus::kOk;
    if (dst == nullptr || src == nullptr) return KernelStatus::kInvalidArgument;
    std::memmove(dst, src, bytes);
    CountHostWait();
    return KernelStatus::kOk;
  }
  KernelStatus CopyToDevice(void* dst, const void* src, size_t bytes, void* s) override {
    return CopyToHost(dst, src, bytes, s);
  }
  KernelStatus Synchronize(void*) override {
    CountHostWait();
    return KernelStatus::kOk;
  }
  KernelStatus SynchronizeFor(void*, double) override {
    CountHostWait();
    return KernelStatus::kOk;
  }

  KernelStatus FusedAccumulateSelect(const FusedSelectArgs& a, void*) override {
    if (!FusedSelectArgsValid(a)) return KernelStatus::kInvalidArgument;
    const PassResult r = isa_ == CpuIsa::kAvx2 ? cpu::FusedAvx2(a) : cpu::FusedScalar(a);
    a.scalars->count = r.count;
    a.scalars->nonfinite = r.nonfinite;
    return KernelStatus::kOk;
  }

  KernelStatus SelectRange(const float* acc, uint64_t begin, uint64_t end, float threshold,
                           uint32_t* out_index, float* out_value, StepScalars* scalars,
                           void*) override {
    if (scalars == nullptr || begin > end || end > kMaxBucketElements) {
      return KernelStatus::kInvalidArgument;
    }
    if (end > begin && (acc == nullptr || out_index == nullptr || out_value == nullptr)) {
      return KernelStatus::kInvalidArgument;
    }
    scalars->count = isa_ == CpuIsa::kAvx2
                         ? cpu::SelectRangeAvx2(acc, begin, end, threshold, out_index, out_value)
                         : cpu::SelectRangeScalar(acc, begin, end, threshold, out_index, out_value);
    return KernelStatus::kOk;
  }

  KernelStatus TrimBelow(uint32_t* index, float* value, uint64_t count, float threshold,
                         StepScalars* scalars, void*) override {
    if (scalars == nullptr || (count > 0 && (index == nullptr || value == nullptr))) {
      return KernelStatus::kInvalidArgument;
    }
    uint64_t c = 0;
    for (uint64_t j = 0; j < count; ++j) {
      const uint32_t i = index[j];
      const float v = value[j];
      index[c] = i;
      value[c] = v;
      c += std::fabs(v) >= threshold;
    }
    scalars->count = c;
    return KernelStatus::kOk;
  }

  KernelStatus LogHistogram(const float* values, uint64_t count, uint32_t shift, uint32_t first_bin,
                            uint32_t num_bins, int64_t* bins, void*) override {
    if (bins == nullptr || shift > 31 || (count > 0 && values == nullptr)) {
      return KernelStatus::kInvalidArgument;
    }
    std::fill(bins, bins + num_bins + 1, 0);
    for (uint64_t j = 0; j < count; ++j) {
      const uint32_t b = (FloatBits(values[j]) & 0x7FFFFFFFu) >> shift;
      if (b < first_bin) continue;
      const uint64_t slot = b - first_bin;
      ++bins[slot < num_bins ? slot : num_bins];
    }
    return KernelStatus::kOk;
  }

  KernelStatus Momentum(const float* grad, const float* velocity_in, float beta,
                        float* velocity_out, uint64_t size, void*) override {
    if (size > 0 && (grad == nullptr || velocity_in == nullptr || velocity_out == nullptr ||
                     velocity_out == grad)) {
      return KernelStatus::kInvalidArgument;
    }
    for (uint64_t i = 0; i < size; ++i) velocity_out[i] = beta * velocity_in[i] + grad[i];
    return KernelStatus::kOk;
  }

  KernelStatus SumOfSquares(const float* data, uint64_t size, double* host_result, void*) override {
    if (host_result == nullptr || (size > 0 && data == nullptr)) {
      return KernelStatus::kInvalidArgument;
    }
    double sum = 0.0;
    for (uint64_t i = 0; i < size; ++i) sum += static_cast<double>(data[i]) * data[i];
    *host_result = sum;
    if (size > 0) CountHostWait();
    return KernelStatus::kOk;
  }

  KernelStatus Gather(const float* acc, const uint32_t* index, uint64_t count, float* out,
                      void*) override {
    if (count > 0 && (acc == nullptr || index == nullptr || out == nullptr)) {
      return KernelStatus::kInvalidArgument;
    }
    for (uint64_t j = 0; j < count; ++j) out[j] = acc[index[j]];
    return KernelStatus::kOk;
  }

  KernelStatus GatherSum(const FusedSelectArgs& a, const uint32_t* index, uint64_t count,
                         float* out, void*) override {
    if (count > 0 && (a.grad == nullptr || a.residual == nullptr || index == nullptr ||
                      out == nullptr || a.size > kMaxBucketElements)) {
      return KernelStatus::kInvalidArgument;
    }
    cpu::GatherSumScalar(a, index, count, out);
    return KernelStatus::kOk;
  }

  KernelStatus ScatterAverage(const float* values, const uint32_t* index, uint64_t count,
                              float divisor, float* out, uint64_t size, bool out_zeroed,
                              void*) override {
    if (size > kMaxBucketElements || (size > 0 && out == nullptr) ||
        (count > 0 && (values == nullptr || index == nullptr))) {
      return KernelStatus::kInvalidArgument;
    }
    for (uint64_t j = 0; j < count; ++j) {
      if (index[j] >= size) return KernelStatus::kInvalidArgument;
    }
    if (size > 0 && !out_zeroed) std::memset(out, 0, size * sizeof(float));
    for (uint64_t j = 0; j < count; ++j) out[index[j]] = values[j] / divisor;
    return KernelStatus::kOk;
  }

  KernelStatus ZeroAt(float* acc, const uint32_t* index, uint64_t count, void*) override {
    if (count > 0 && (acc == nullptr || index == nullptr)) return KernelStatus::kInvalidArgument;
    for (uint64_t j = 0; j < count; ++j) acc[index[j]] = 0.0f;
    return KernelStatus::kOk;
  }

  KernelStatus CopyFloats(float* dst, const float* src, uint64_t count, void*) override {
    if (count > 0 && (dst == nullptr || src == nullptr)) return KernelStatus::kInvalidArgument;
    if (count > 0) std::memmove(dst, src, count * sizeof(float));
    return KernelStatus::kOk;
  }

  KernelStatus ZeroFloats(float* dst, uint64_t count, void*) override {
    if (count > 0 && dst == nullptr) return KernelStatus::kInvalidArgument;
    if (count > 0) std::memset(dst, 0, count * sizeof(float));
    return KernelStatus::kOk;
  }

  KernelStatus CountOutside(const uint32_t* index, uint64_t count, uint64_t begin, uint64_t end,
                            StepScalars* scalars, void*) override {
    if (scalars == nullptr || (count > 0 && index == nullptr))
      return KernelStatus::kInvalidArgument;
    uint64_t outside = 0;
    for (uint64_t j = 0; j < count; ++j) outside += index[j] < begin || index[j] >= end;
    *scalars = {outside, 0};
    return KernelStatus::kOk;
  }

  KernelStatus LocalSum(const float* const* inputs, int num_inputs, uint64_t size, float* out,
                        StepScalars* scalars, void*) override {
    if (num_inputs < 1 || inputs == nullptr || (size > 0 && out == nullptr)) {
      return KernelStatus::kInvalidArgument;
    }
    for (int l = 0; l < num_inputs; ++l) {
      if (size > 0 && inputs[l] == nullptr) return KernelStatus::kInvalidArgument;
    }
    // Cache-sized chunks: each chunk of every input is read once, summed in
    // input order.
    constexpr uint64_t kChunk = 4096;
    for (uint64_t c0 = 0; c0 < size; c0 += kChunk) {
      const uint64_t c1 = std::min(size, c0 + kChunk);
      if (out != inputs[0]) std::memcpy(out + c0, inputs[0] + c0, (c1 - c0) * sizeof(float));
      for (int l = 1; l < num_inputs; ++l) {
        const float* in = inputs[l];
        for (uint64_t i = c0; i < c1; ++i) out[i] += in[i];
      }
    }
    if (scalars != nullptr) scalars->nonfinite = CountNonFinite(out, size);
    return KernelStatus::kOk;
  }

  KernelStatus Divide(float* data, uint64_t size, float divisor, StepScalars* scalars,
                      void*) override {
    if (size > 0 && data == nullptr) return KernelStatus::kInvalidArgument;
    if (scalars != nullptr) scalars->nonfinite = CountNonFinite(data, size);
    for (uint64_t i = 0; i < size; ++i) data[i] /= divisor;
    return KernelStatus::kOk;
  }

  KernelStatus CountNonFinite(const float* data, uint64_t size, StepScalars* scalars,
                              void*) override {
    if (scalars == nullptr || (size > 0 && data == nullptr)) return KernelStatus::kInvalidArgument;
    scalars->nonfinite = CountNonFinite(data, size);
    return KernelStatus::kOk;
  }

  KernelStatus HalfToFloat(const uint16_t* src, ElementType type, uint64_t count, float* dst,
                           void*) override {
    if (!IsHalfType(type) || (count > 0 && (src == nullptr || dst == nullptr))) {
      return KernelStatus::kInvalidArgument;
    }
    (isa_ == CpuIsa::kAvx2 ? cpu::HalfToFloatAvx2 : cpu::HalfToFloatScalar)(src, type, count, dst);
    return KernelStatus::kOk;
  }

  KernelStatus FloatToHalf(const float* src, ElementType type, uint64_t count, uint16_t* dst,
                           void*) override {
    if (!IsHalfType(type) || (count > 0 && (src == nullptr || dst == nullptr))) {
      return KernelStatus::kInvalidArgument;
    }
    (isa_ == CpuIsa::kAvx2 ? cpu::FloatToHalfAvx2 : cpu::FloatToHalfScalar)(src, type, count, dst);
    return KernelStatus::kOk;
  }

  KernelStatus GatherRounded(float* acc, const uint32_t* index, uint64_t count, ElementType type,
                             uint16_t* out, void*) override {
    if (!IsHalfType(type) ||
        (count > 0 && (acc == nullptr || index == nullptr || out == nullptr))) {
      return KernelStatus::kInvalidArgument;
    }
    const bool bf16 = type == ElementType::kBFloat16;
    for (uint64_t j = 0; j < count; ++j) {
      float& a = acc[index[j]];
      out[j] = bf16 ? convert::FloatToBf16(a) : convert::FloatToF16(a);
      a -= bf16 ? convert::Bf16ToFloat(out[j]) : convert::F16ToFloat(out[j]);
    }
    return KernelStatus::kOk;
  }

  KernelStatus TopK(const float* acc, uint64_t size, uint64_t k, uint32_t* out_index,
                    float* out_value, StepScalars* scalars, void*) override {
    if (scalars == nullptr || size > kMaxBucketElements) return KernelStatus::kInvalidArgument;
    const uint64_t n = std::min(k, size);
    if (n > 0 && (acc == nullptr || out_index == nullptr || out_value == nullptr)) {
      return KernelStatus::kInvalidArgument;
    }
    scalars->count = n;
    if (n == 0) return KernelStatus::kOk;
    // A radix select on the magnitude's bits (the sign cleared: the order
    // of the magnitudes, a NaN above Inf; the CUDA backend's keys): a
    // histogram of the top bits finds the bin of the n-th largest; one more
    // pass writes every value of a higher bin and keeps those of that bin,
    // of which the largest are taken, ties to the lower index. Two passes
    // over acc, not a sort of the bucket.
    constexpr int kShift = 19;  // 4,096 bins: the exponent and 4 bits of mantissa
    constexpr uint32_t kBins = 1u << (31 - kShift);
    auto bits = [acc](uint64_t i) { return FloatBits(acc[i]) & 0x7FFFFFFFu; };
    // Four histograms, so that runs of one bin do not wait on each other's
    // increments.
    std::vector<uint32_t> hist(4 * kBins, 0);
    uint64_t i = 0;
    for (; i + 4 <= size; i += 4) {
      ++hist[bits(i) >> kShift];
      ++hist[kBins + (bits(i + 1) >> kShift)];
      ++hist[2 * kBins + (bits(i + 2) >> kShift)];
      ++hist[3 * kBins + (bits(i + 3) >> kShift)];
    }
    for (; i < size; ++i) ++hist[bits(i) >> kShift];
    uint32_t bin = kBins;
    uint64_t above = 0;  // values in the bins above `bin`
    for (;;) {
      --bin;
      const uint64_t here =
          uint64_t{hist[bin]} + hist[kBins + bin] + hist[2 * kBins + bin] + hist[3 * kBins + bin];
      if (above + here >= n) break;
      above += here;
    }
    std::vector<std::pair<uint32_t, uint32_t>> in_bin;  // (bits, index) of the n-th's bin
    uint64_t out = 0;
    for (uint64_t j = 0; j < size; ++j) {
      const uint32_t b = bits(j);
      const uint32_t at = b >> kShift;
      if (at > bin) {
        out_index[out] = static_cast<uint32_t>(j);
        out_value[out++] = acc[j];
      } else if (at == bin) {
        in_bin.emplace_back(b, static_cast<uint32_t>(j));
      }
    }
    const uint64_t need = n - above;
    auto before = [](const std::pair<uint32_t, uint32_t>& x,
                     const std::pair<uint32_t, uint32_t>& y) {
      return x.first > y.first || (x.first == y.first && x.second < y.second);
    };
    if (need < in_bin.size()) {
      std::nth_element(in_bin.begin(), in_bin.begin() + need, in_bin.end(), before);
    }
    for (uint64_t j = 0; j < need; ++j) {
      out_index[out] = in_bin[j].second;
      out_value[out++] = acc[in_bin[j].second];
    }
    return KernelStatus::kOk;
  }

  KernelStatus SortUnique(uint32_t* index, uint64_t count, StepScalars* scalars, void*) override {
    if (scalars == nullptr || (count > 0 && index == nullptr))
      return KernelStatus::kInvalidArgument;
    std::sort(index, index + count);
    scalars->count = static_cast<uint64_t>(std::unique(index, index + count) - index);
    return KernelStatus::kOk;
  }

 private:
  uint64_t CountNonFinite(const float* data, uint64_t size) const {
    return isa_ == CpuIsa::kAvx2 ? cpu::CountNonFiniteAvx2(data, size)
                                 : cpu::CountNonFiniteScalar(data, size);
  }

  const CpuIsa isa_;
  std::mutex mapped_mu_;
  std::unordered_map<void*, size_t> mapped_;  // large allocations and their sizes
};

}  // namespace

const char* KernelStatusString(KernelStatus status) {
  switch (status) {
    case KernelStatus::kOk:
      return "ok";
    case KernelStatus::kInvalidArgument:
      return "invalid argument";
    case KernelStatus::kDeviceError:
      return "device error";
    case KernelStatus::kUnsupported:
      return "unsupported";
    case KernelStatus::kTimedOut:
      return "timed out";
  }
  return "unknown kernel status";
}

bool CpuSupports(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAuto:
    case CpuIsa::kScalar:
      return true;
    case CpuIsa::kAvx2:
      // F16C comes with every AVX2 processor; the fp16 conversions use it.
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  }
  return false;
}

std::unique_ptr<SparseOps> CreateCpuSparseOps(CpuIsa isa) {
  if (isa == CpuIsa::kAuto) {
    isa = CpuSupports(CpuIsa::kAvx2) ? CpuIsa::kAvx2 : CpuIsa::kScalar;
    // MICROD_CPU_ISA=scalar forces the portable path (debugging, comparisons).
    if (const char* env = std::getenv("MICROD_CPU_ISA"); env && std::strcmp(env, "scalar") == 0) {
      isa = CpuIsa::kScalar;
    }
  }
  if (!CpuSupports(isa)) return nullptr;
  return std::make_unique<CpuSparseOps>(isa);
}

}  // namespace microd::kernels
