// SPDX-License-Identifier: Apache-2.0
// Every CUDA kernel against the CPU backend (the reference) on the same
// inputs: dense outputs bit for bit, selections as sets (the GPU emits them
// in any order), counts and non-finite counts exactly, the sum of squares
// within a relative 1e-12. Skipped, with CUDA's reason, where no GPU is
// usable. Nothing here touches CUDA before a test body runs, so listing the
// tests (gtest_discover_tests at build time) works on machines without one.
#include "kernels/cuda/cuda_ops.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/sparse_ops.h"
#include "tests/common/kernel_inputs.h"

namespace microd::kernels {
namespace {

using test::Bits;
using test::kSizes;
using test::RandomValues;
using test::Ranges;
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

using Pairs = std::vector<std::pair<uint32_t, uint32_t>>;  // (index, value bits)

Pairs Collect(const std::vector<uint32_t>& idx, const std::vector<float>& val, uint64_t n) {
  Pairs p;
  for (uint64_t j = 0; j < n; ++j) p.push_back({idx[j], Bits(val[j])});
  std::sort(p.begin(), p.end());
  return p;
}

// Bit for bit, except that any two NaNs are equal: the GPU returns its one
// canonical NaN from arithmetic on a NaN where x86 keeps the input's payload
// (the interface promises nothing about payloads; a non-finite result is
// discarded by the caller).
void ExpectSameBits(const std::vector<float>& got, const std::vector<float>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i]) && std::isnan(want[i])) continue;
    ASSERT_EQ(Bits(got[i]), Bits(want[i])) << "at " << i << ": " << got[i] << " vs " << want[i];
  }
}

class CudaOpsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string reason;
    gpu_ = CreateCudaSparseOps(0, &reason);
    if (gpu_ == nullptr) GTEST_SKIP() << "no GPU: " << reason;
    cpu_ = CreateCpuSparseOps(CpuIsa::kScalar);
    ASSERT_NE(cpu_, nullptr);
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
  }
  void TearDown() override {
    for (void* p : owned_) gpu_->Free(p);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  // Device copy of a host array (nullptr-safe for empty arrays: 1 element).
  template <typename T>
  T* Up(const std::vector<T>& host, size_t extra = 0) {
    const size_t n = host.size() + extra;
    T* p = static_cast<T*>(gpu_->Allocate(std::max<size_t>(n, 1) * sizeof(T)));
    EXPECT_NE(p, nullptr);
    owned_.push_back(p);
    if (!host.empty()) {
      EXPECT_EQ(gpu_->CopyToDevice(p, host.data(), host.size() * sizeof(T), stream_),
                KernelStatus::kOk);
    }
    return p;
  }
  template <typename T>
  T* Zeros(size_t n) {
    return Up(std::vector<T>(n));
  }
  template <typename T>
  std::vector<T> Down(const T* p, size_t n) {
    std::vector<T> host(n);
    if (n > 0) {
      EXPECT_EQ(gpu_->CopyToHost(host.data(), p, n * sizeof(T), stream_), KernelStatus::kOk);
    }
    return host;
  }
  StepScalars DownScalars(const StepScalars* p) {
    StepScalars s{};
    EXPECT_EQ(gpu_->CopyToHost(&s, p, sizeof s, stream_), KernelStatus::kOk);
    return s;
  }
  void* stream() { return stream_; }

  std::unique_ptr<SparseOps> gpu_;
  std::unique_ptr<SparseOps> cpu_;
  cudaStream_t stream_ = nullptr;
  std::vector<void*> owned_;
};

TEST_F(CudaOpsTest, FusedAccumulateSelectMatchesCpu) {
  for (uint64_t d : kSizes) {
    const std::vector<float> g = RandomValues(d, 1 + d);
    const std::vector<float> e = RandomValues(d, 2 + d);
    for (auto [b, end] : Ranges(d)) {
      for (float thr : {0.0f, 1e-3f, 0.5f, kInf}) {
        // offset 1: pointers that are not 16-byte aligned take the scalar path.
        for (int variant = 0; variant < 3; ++variant) {
          const bool in_place = variant == 1;
          const size_t offset = variant == 2 ? 1 : 0;
          SCOPED_TRACE(testing::Message() << "d=" << d << " range=[" << b << "," << end
                                          << ") thr=" << thr << " variant=" << variant);
          // CPU reference.
          std::vector<float> acc_c(d), e_c = e;
          std::vector<uint32_t> idx_c(end - b + 1);
          std::vector<float> val_c(end - b + 1);
          StepScalars s_c;
          FusedSelectArgs ac{g.data(),
                             e_c.data(),
                             in_place ? e_c.data() : acc_c.data(),
                             d,
                             b,
                             end,
                             thr,
                             idx_c.data(),
                             val_c.data(),
                             &s_c};
          ASSERT_EQ(cpu_->FusedAccumulateSelect(ac, nullptr), KernelStatus::kOk);
          const std::vector<float>& want_acc = in_place ? e_c : acc_c;
          // GPU.
          std::vector<float> g_pad(offset, 9.0f), e_pad(offset, 9.0f);
          g_pad.insert(g_pad.end(), g.begin(), g.end());
          e_pad.insert(e_pad.end(), e.begin(), e.end());
          float* gd = Up(g_pad) + offset;
          float* ed = Up(e_pad) + offset;
          float* accd = in_place ? ed : Zeros<float>(d + offset) + offset;
          uint32_t* idxd = Zeros<uint32_t>(end - b + 1);
          float* vald = Zeros<float>(end - b + 1);
          StepScalars* sd = Up(std::vector<StepScalars>{{123, 456}});
          FusedSelectArgs ag{gd, ed, accd, d, b, end, thr, idxd, vald, sd};
          ASSERT_EQ(gpu_->FusedAccumulateSelect(ag, stream()), KernelStatus::kOk);
          const StepScalars s_g = DownScalars(sd);
          EXPECT_EQ(s_g.nonfinite, s_c.nonfinite);
          ASSERT_EQ(s_g.count, s_c.count);
          ExpectSameBits(Down(accd, d), want_acc);
          if (!in_place) ExpectSameBits(Down(ed, d), e);  // residual untouched
          EXPECT_EQ(Collect(Down(idxd, s_g.count), Down(vald, s_g.count), s_g.count),
                    Collect(idx_c, val_c, s_c.count));
        }
      }
    }
  }
}

// Outputs with room for fewer pairs than the pass selects: the count is
// every selected element's, every pair held is a selected one (in any
// order on the GPU), and nothing is written past the capacity.
TEST_F(CudaOpsTest, FusedPassWritesNoMoreThanTheOutputsHold) {
  const uint64_t d = 1000003;
  const std::vector<float> g = RandomValues(d, 5);
  const std::vector<float> e = RandomValues(d, 6);
  std::vector<std::pair<uint32_t, float>> want;
  for (uint64_t i = 0; i < d; ++i) {
    const float v = e[i] + g[i];
    if (std::fabs(v) >= 0.5f) want.push_back({uint32_t(i), v});
  }
  float* gd = Up(g);
  float* ed = Up(e);
  for (uint64_t capacity : {uint64_t{1}, uint64_t(want.size() / 3), uint64_t(want.size())}) {
    SCOPED_TRACE(testing::Message() << "capacity " << capacity);
    constexpr uint32_t kUntouched = 0xdeadbeef;
    uint32_t* idxd = Up(std::vector<uint32_t>(capacity + 64, kUntouched));
    float* vald = Up(std::vector<float>(capacity + 64, -7.0f));
    StepScalars* sd = Up(std::vector<StepScalars>{{0, 0}});
    FusedSelectArgs a{gd, ed, nullptr, d, 0, d, 0.5f, idxd, vald, sd};
    a.out_capacity = capacity;
    ASSERT_EQ(gpu_->FusedAccumulateSelect(a, stream()), KernelStatus::kOk);
    ASSERT_EQ(DownScalars(sd).count, want.size());
    const std::vector<uint32_t> idx = Down(idxd, capacity + 64);
    const std::vector<float> val = Down(vald, capacity + 64);
    for (uint64_t j = 0; j < idx.size(); ++j) {
      if (j >= capacity) {
        ASSERT_EQ(idx[j], kUntouched) << j;
        continue;
      }
      const auto at = std::lower_bound(want.begin(), want.end(), std::make_pair(idx[j], -kInf));
      ASSERT_TRUE(at != want.end() && at->first == idx[j]) << "slot " << j << " index " << idx[j];
      ASSERT_EQ(Bits(val[j]), Bits(at->second)) << "index " << idx[j];
    }
  }
}

// A bucket large enough that every block loops over several tiles (the grid
// is sized by occupancy, far below 2^24 / tile), with a dense selection (every
// element selected: the output offsets of every tile claimed in turn), on a
// stream of its own and on the legacy default stream.
TEST_F(CudaOpsTest, FusedPassOverManyTilesWithADenseSelectionMatchesCpu) {
  const uint64_t d = (uint64_t{1} << 24) + 3;
  const std::vector<float> g = RandomValues(d, 91);
  const std::vector<float> e = RandomValues(d, 92);
  std::vector<float> acc_c(d), e_c = e;
  std::vector<uint32_t> idx_c(d);
  std::vector<float> val_c(d);
  StepScalars s_c;
  FusedSelectArgs ac{g.data(), e_c.data(),   acc_c.data(), d,   0, d,
                     0.0f,     idx_c.data(), val_c.data(), &s_c};
  ASSERT_EQ(cpu_->FusedAccumulateSelect(ac, nullptr), KernelStatus::kOk);
  ASSERT_EQ(s_c.count, d);
  for (void* on : {stream(), static_cast<void*>(nullptr)}) {
    SCOPED_TRACE(on == nullptr ? "legacy default stream" : "own stream");
    float* gd = Up(g);
    float* ed = Up(e);
    float* accd = Zeros<float>(d);
    uint32_t* idxd = Zeros<uint32_t>(d);
    float* vald = Zeros<float>(d);
    StepScalars* sd = Up(std::vector<StepScalars>{{0, 0}});
    FusedSelectArgs ag{gd, ed, accd, d, 0, d, 0.0f, idxd, vald, sd};
    ASSERT_EQ(gpu_->FusedAccumulateSelect(ag, on), KernelStatus::kOk);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const StepScalars s_g = DownScalars(sd);
    ASSERT_EQ(s_g.count, d);
    EXPECT_EQ(s_g.nonfinite, s_c.nonfinite);
    ExpectSameBits(Down(accd, d), acc_c);
    EXPECT_EQ(Collect(Down(idxd, d), Down(vald, d), d), Collect(idx_c, val_c, d));
  }
}

// Momentum correction folded into the pass: the velocity and acc bits of the
// CPU backend, aligned (vectorised path) and unaligned (with local clipping's
// scale), velocity in place too.
TEST_F(CudaOpsTest, FusedPassWithMomentumMatchesCpu) {
  const float beta = 0.9f;
  for (uint64_t d : kSizes) {
    const std::vector<float> g = RandomValues(d, 21 + d);
    const std::vector<float> e = RandomValues(d, 22 + d);
    const std::vector<float> v = RandomValues(d, 23 + d);
    const uint64_t b = d / 3, end = d - d / 3;
    for (int variant = 0; variant < 3; ++variant) {
      const bool velocity_in_place = variant == 1;
      const size_t offset = variant == 2 ? 1 : 0;
      SCOPED_TRACE(testing::Message() << "d=" << d << " variant=" << variant);
      std::vector<float> acc_c(d), v_c(d);
      std::vector<uint32_t> idx_c(end - b + 1);
      std::vector<float> val_c(end - b + 1);
      StepScalars s_c;
      FusedSelectArgs ac{g.data(), e.data(),     acc_c.data(), d,   b, end,
                         1e-3f,    idx_c.data(), val_c.data(), &s_c};
      ac.velocity_in = v.data();
      ac.velocity_out = v_c.data();
      ac.beta = beta;
      // The last variant with local clipping's scale folded in, too.
      ac.grad_scale = variant == 2 ? 0.37f : 1.0f;
      ASSERT_EQ(cpu_->FusedAccumulateSelect(ac, nullptr), KernelStatus::kOk);

      auto padded = [&](const std::vector<float>& x) {
        std::vector<float> out(offset, 9.0f);
        out.insert(out.end(), x.begin(), x.end());
        return Up(out) + offset;
      };
      float* vin = padded(v);
      FusedSelectArgs ag{padded(g),
                         padded(e),
                         Zeros<float>(d + offset) + offset,
                         d,
                         b,
                         end,
                         1e-3f,
                         Zeros<uint32_t>(end - b + 1),
                         Zeros<float>(end - b + 1),
                         Up(std::vector<StepScalars>{{123, 456}})};
      ag.velocity_in = vin;
      ag.velocity_out = velocity_in_place ? vin : Zeros<float>(d + offset) + offset;
      ag.beta = beta;
      ag.grad_scale = ac.grad_scale;
      ASSERT_EQ(gpu_->FusedAccumulateSelect(ag, stream()), KernelStatus::kOk);
      const StepScalars s_g = DownScalars(ag.scalars);
      EXPECT_EQ(s_g.nonfinite, s_c.nonfinite);
      ASSERT_EQ(s_g.count, s_c.count);
      ExpectSameBits(Down(ag.velocity_out, d), v_c);
      ExpectSameBits(Down(ag.acc, d), acc_c);
      EXPECT_EQ(Collect(Down(ag.out_index, s_g.count), Down(ag.out_value, s_g.count), s_g.count),
                Collect(idx_c, val_c, s_c.count));
    }
  }
}

TEST_F(CudaOpsTest, FusedPassCountsNonFiniteLikeCpu) {
  for (uint64_t d : {uint64_t{1}, uint64_t{7}, uint64_t{1000}, uint64_t{1000003}}) {
    std::vector<float> g = RandomValues(d, 9);
    std::vector<float> e = RandomValues(d, 10);
    g[d / 2] = kNaN;
    g[d - 1] = -kInf;
    e[0] = 3e38f;
    g[0] = 3e38f;  // overflows to infinity
    std::vector<float> acc_c(d);
    std::vector<uint32_t> idx_c(d);
    std::vector<float> val_c(d);
    StepScalars s_c;
    FusedSelectArgs ac{g.data(), e.data(),     acc_c.data(), d,   0, d,
                       0.1f,     idx_c.data(), val_c.data(), &s_c};
    ASSERT_EQ(cpu_->FusedAccumulateSelect(ac, nullptr), KernelStatus::kOk);
    float* accd = Zeros<float>(d);
    uint32_t* idxd = Zeros<uint32_t>(d);
    float* vald = Zeros<float>(d);
    StepScalars* sd = Zeros<StepScalars>(1);
    FusedSelectArgs ag{Up(g), Up(e), accd, d, 0, d, 0.1f, idxd, vald, sd};
    ASSERT_EQ(gpu_->FusedAccumulateSelect(ag, stream()), KernelStatus::kOk);
    const StepScalars s_g = DownScalars(sd);
    EXPECT_EQ(s_g.nonfinite, s_c.nonfinite) << d;
    EXPECT_GT(s_g.nonfinite, 0u);
    ASSERT_EQ(s_g.count, s_c.count);
    ExpectSameBits(Down(accd, d), acc_c);
    EXPECT_EQ(Collect(Down(idxd, s_g.count), Down(vald, s_g.count), s_g.count),
              Collect(idx_c, val_c, s_c.count));
  }
}

TEST_F(CudaOpsTest, BadArgumentsAreRefusedLikeCpu) {
  float* v = Zeros<float>(16);
  float* out = Zeros<float>(16);
  float* vals = Zeros<float>(16);
  uint32_t* idx = Zeros<uint32_t>(16);
  StepScalars* s = Zeros<StepScalars>(1);
  FusedSelectArgs ok{v, v, out, 16, 0, 16, 0.5f, idx, vals, s};
  FusedSelectArgs a = ok;
  ASSERT_EQ(gpu_->FusedAccumulateSelect(a, stream()), KernelStatus::kOk);
  a.grad = nullptr;
  EXPECT_EQ(gpu_->FusedAccumulateSelect(a, stream()), KernelStatus::kInvalidArgument);
  a = ok;
  a.select_begin = 9;
  a.select_end = 8;
  EXPECT_EQ(gpu_->FusedAccumulateSelect(a, stream()), KernelStatus::kInvalidArgument);
  a = ok;
  a.select_end = 17;
  EXPECT_EQ(gpu_->FusedAccumulateSelect(a, stream()), KernelStatus::kInvalidArgument);
  a = ok;
  a.size = kMaxBucketElements + 1;
  a.select_end = 0;
  EXPECT_EQ(gpu_->FusedAccumulateSelect(a, stream()), KernelStatus::kInvalidArgument);
  a = ok;
  a.scalars = nullptr;
  EXPECT_EQ(gpu_->FusedAccumulateSelect(a, stream()), KernelStatus::kInvalidArgument);
  a = ok;
  a.out_index = nullptr;
  EXPECT_EQ(gpu_->FusedAccumulateSelect(a, stream()), KernelStatus::kInvalidArgument);
  a = ok;
  a.acc = const_cast<float*>(a.grad);
  EXPECT_EQ(gpu_->FusedAccumulateSelect(a, stream()), KernelStatus::kInvalidArgument);
  EXPECT_EQ(gpu_->SelectRange(v, 0, kMaxBucketElements + 1, 0, idx, out, s, stream()),
            KernelStatus::kInvalidArgument);
  EXPECT_EQ(gpu_->ScatterAverage(v, idx, 1, 1.0f, out, kMaxBucketElements + 1, false, stream()),
            KernelStatus::kInvalidArgument);
  EXPECT_EQ(gpu_->TopK(v, 16, 4, nullptr, out, s, stream()), KernelStatus::kInvalidArgument);
  EXPECT_EQ(gpu_->SortUnique(idx, 16, nullptr, stream()), KernelStatus::kInvalidArgument);
  EXPECT_EQ(gpu_->LogHistogram(v, 16, 32, 0, 8, nullptr, stream()), KernelStatus::kInvalidArgument);
  const float* const no_inputs[] = {nullptr};
  EXPECT_EQ(gpu_->LocalSum(no_inputs, 1, 16, out, nullptr, stream()),
            KernelStatus::kInvalidArgument);
  EXPECT_EQ(gpu_->CopyToHost(nullptr, v, 4, stream()), KernelStatus::kInvalidArgument);
  // An index outside the output is skipped (the CPU refuses it; see cuda_ops.h).
  std::vector<uint32_t> bad = {3, 16};
  uint32_t* badd = Up(bad);
  float* ones = Up(std::vector<float>(2, 1.0f));
  EXPECT_EQ(gpu_->ScatterAverage(ones, badd, 2, 2.0f, out, 16, false, stream()), KernelStatus::kOk);
  std::vector<float> want(16, 0.0f);
  want[3] = 0.5f;
  ExpectSameBits(Down(out, 16), want);
}

TEST_F(CudaOpsTest, SelectRangeMatchesCpu) {
  for (uint64_t d : kSizes) {
    const std::vector<float> acc = RandomValues(d, 3 + d);
    for (size_t offset : {size_t{0}, size_t{3}}) {
      std::vector<float> padded(offset, 5.0f);
      padded.insert(padded.end(), acc.begin(), acc.end());
      const float* ad = Up(padded) + offset;
      for (auto [b, end] : Ranges(d)) {
        for (float thr : {0.0f, 1e-2f, 2.0f}) {
          SCOPED_TRACE(testing::Message() << "d=" << d << " [" << b << "," << end << ") thr=" << thr
                                          << " offset=" << offset);
          std::vector<uint32_t> idx_c(end - b + 1);
          std::vector<float> val_c(end - b + 1);
          StepScalars s_c;
          ASSERT_EQ(
              cpu_->SelectRange(acc.data(), b, end, thr, idx_c.data(), val_c.data(), &s_c, nullptr),
              KernelStatus::kOk);
          uint32_t* idxd = Zeros<uint32_t>(end - b + 1);
          float* vald = Zeros<float>(end - b + 1);
          StepScalars* sd = Up(std::vector<StepScalars>{{77, 88}});
          ASSERT_EQ(gpu_->SelectRange(ad, b, end, thr, idxd, vald, sd, stream()),
                    KernelStatus::kOk);
          const StepScalars s_g = DownScalars(sd);
          ASSERT_EQ(s_g.count, s_c.count);
          EXPECT_EQ(s_g.nonfinite, 88u);  // not computed, left alone
          EXPECT_EQ(Collect(Down(idxd, s_g.count), Down(vald, s_g.count), s_g.count),
                    Collect(idx_c, val_c, s_c.count));
        }
      }
    }
  }
}

TEST_F(CudaOpsTest, TrimBelowKeepsOrderLikeCpu) {
  for (uint64_t n : kSizes) {
    for (float thr : {0.0f, 0.01f, 1.0f, kInf}) {
      std::vector<float> val = RandomValues(n, 4);
      std::vector<uint32_t> idx(n);
      for (uint64_t j = 0; j < n; ++j) idx[j] = uint32_t(n - j);
      uint32_t* idxd = Up(idx);
      float* vald = Up(val);
      StepScalars s_c;
      ASSERT_EQ(cpu_->TrimBelow(idx.data(), val.data(), n, thr, &s_c, nullptr), KernelStatus::kOk);
      StepScalars* sd = Zeros<StepScalars>(1);
      ASSERT_EQ(gpu_->TrimBelow(idxd, vald, n, thr, sd, stream()), KernelStatus::kOk);
      const StepScalars s_g = DownScalars(sd);
      ASSERT_EQ(s_g.count, s_c.count) << n << " " << thr;
      idx.resize(s_c.count);
      val.resize(s_c.count);
      EXPECT_EQ(Down(idxd, s_g.count), idx);
      ExpectSameBits(Down(vald, s_g.count), val);
    }
  }
}

TEST_F(CudaOpsTest, LogHistogramMatchesCpu) {
  struct Case {
    uint32_t shift, first_bin, num_bins;
  };
  const Case cases[] = {{20, Bits(1e-4f) >> 20, 128},    // coarse bins of the controller
                        {12, Bits(0.01f) >> 12, 256},    // fine bins
                        {12, Bits(1e-6f) >> 12, 20000},  // more bins than shared memory holds
                        {23, 0, 0},                      // only the "above" bin
                        {0, 0, 64},                      // every bit pattern its own bin
                        {31, 0, 1}};
  for (uint64_t n : kSizes) {
    std::vector<float> val = RandomValues(n, 11);
    if (n > 2) {
      val[1] = kInf;
      val[2] = -kNaN;
    }
    const float* vd = Up(val);
    for (const Case& c : cases) {
      std::vector<int64_t> want(c.num_bins + 1, -1);
      ASSERT_EQ(
          cpu_->LogHistogram(val.data(), n, c.shift, c.first_bin, c.num_bins, want.data(), nullptr),
          KernelStatus::kOk);
      int64_t* bd = Up(std::vector<int64_t>(c.num_bins + 1, -1));
      ASSERT_EQ(gpu_->LogHistogram(vd, n, c.shift, c.first_bin, c.num_bins, bd, stream()),
                KernelStatus::kOk);
      EXPECT_EQ(Down(bd, c.num_bins + 1), want) << "n=" << n << " shift=" << c.shift;
    }
  }
}

TEST_F(CudaOpsTest, DensePassesMatchCpuBitForBit) {
  for (uint64_t n : kSizes) {
    SCOPED_TRACE(testing::Message() << "n=" << n);
    std::vector<float> g = RandomValues(n, 21);
    const std::vector<float> v = RandomValues(n, 22);
    if (n > 3) g[3] = kNaN;
    const float* gd = Up(g);
    // Momentum (into a separate buffer and in place).
    {
      std::vector<float> want(n);
      ASSERT_EQ(cpu_->Momentum(g.data(), v.data(), 0.9f, want.data(), n, nullptr),
                KernelStatus::kOk);
      float* vd = Up(v);
      float* outd = Zeros<float>(n);
      ASSERT_EQ(gpu_->Momentum(gd, vd, 0.9f, outd, n, stream()), KernelStatus::kOk);
      ExpectSameBits(Down(outd, n), want);
      ASSERT_EQ(gpu_->Momentum(gd, vd, 0.9f, vd, n, stream()), KernelStatus::kOk);
      ExpectSameBits(Down(vd, n), want);
    }
    // Divide with non-finite counting, and CountNonFinite.
    {
      std::vector<float> want = g;
      StepScalars s_c;
      ASSERT_EQ(cpu_->Divide(want.data(), n, 7.0f, &s_c, nullptr), KernelStatus::kOk);
      float* dd = Up(g);
      StepScalars* sd = Up(std::vector<StepScalars>{{55, 66}});
      ASSERT_EQ(gpu_->Divide(dd, n, 7.0f, sd, stream()), KernelStatus::kOk);
      ExpectSameBits(Down(dd, n), want);
      StepScalars s_g = DownScalars(sd);
      EXPECT_EQ(s_g.nonfinite, s_c.nonfinite);
      EXPECT_EQ(s_g.count, 55u);
      ASSERT_EQ(gpu_->Divide(dd, n, 3.0f, nullptr, stream()), KernelStatus::kOk);
      ASSERT_EQ(cpu_->Divide(want.data(), n, 3.0f, nullptr, nullptr), KernelStatus::kOk);
      ExpectSameBits(Down(dd, n), want);
      ASSERT_EQ(cpu_->CountNonFinite(g.data(), n, &s_c, nullptr), KernelStatus::kOk);
      ASSERT_EQ(gpu_->CountNonFinite(gd, n, sd, stream()), KernelStatus::kOk);
      s_g = DownScalars(sd);
      EXPECT_EQ(s_g.nonfinite, s_c.nonfinite);
      EXPECT_EQ(s_g.nonfinite, n > 3 ? 1u : 0u);
    }
    // Sum of squares: a different summation order (cuda_ops.h).
    {
      double want = -1, got = -1;
      ASSERT_EQ(cpu_->SumOfSquares(v.data(), n, &want, nullptr), KernelStatus::kOk);
      ASSERT_EQ(gpu_->SumOfSquares(Up(v), n, &got, stream()), KernelStatus::kOk);
      EXPECT_NEAR(got, want, 1e-12 * want);
      double again = -1;
      ASSERT_EQ(gpu_->SumOfSquares(Up(v), n, &again, stream()), KernelStatus::kOk);
      EXPECT_EQ(again, got);  // deterministic
    }
  }
}

TEST_F(CudaOpsTest, LocalSumMatchesCpuInInputOrder) {
  for (uint64_t n : kSizes) {
    for (int num : {1, 2, 3, 8, 9, 17}) {
      for (bool alias : {false, true}) {
        SCOPED_TRACE(testing::Message() << "n=" << n << " inputs=" << num << " alias=" << alias);
        std::vector<std::vector<float>> in(num);
        std::vector<const float*> in_c(num), in_g(num);
        for (int l = 0; l < num; ++l) {
          in[l] = RandomValues(n, 100 + l);
          if (l == 2 && n > 5) in[l][5] = kInf;
        }
        std::vector<float> first = in[0];
        for (int l = 0; l < num; ++l) {
          in_c[l] = in[l].data();
          in_g[l] = Up(in[l]);
        }
        std::vector<float> out_c(n);
        float* out_cp = alias ? first.data() : out_c.data();
        in_c[0] = alias ? first.data() : in_c[0];
        StepScalars s_c;
        ASSERT_EQ(cpu_->LocalSum(in_c.data(), num, n, out_cp, &s_c, nullptr), KernelStatus::kOk);
        float* out_g = alias ? const_cast<float*>(in_g[0]) : Zeros<float>(n);
        StepScalars* sd = Up(std::vector<StepScalars>{{9, 9}});
        ASSERT_EQ(gpu_->LocalSum(in_g.data(), num, n, out_g, sd, stream()), KernelStatus::kOk);
        ExpectSameBits(Down(out_g, n), alias ? first : out_c);
        const StepScalars s_g = DownScalars(sd);
        EXPECT_EQ(s_g.nonfinite, s_c.nonfinite);
        EXPECT_EQ(s_g.count, 9u);
        ASSERT_EQ(gpu_->LocalSum(in_g.data(), num, n, Zeros<float>(n), nullptr, stream()),
                  KernelStatus::kOk);
      }
    }
  }
}

// SynchronizeFor: a zero deadline on queued work ends at once (kOk if it
// already finished, else kTimedOut, the work left running); a long one
// waits for it, after which the result is there.
TEST_F(CudaOpsTest, SynchronizeForWaitsUntilItsDeadline) {
  const uint64_t n = uint64_t{1} << 26;  // 256 MiB per input
  std::vector<const float*> in(17);
  float* big = Zeros<float>(n);
  for (auto& p : in) p = big;
  float* out = Zeros<float>(n);
  const std::vector<float> one = {1.0f};
  ASSERT_EQ(gpu_->CopyToDevice(big + n - 1, one.data(), sizeof(float), stream()),
            KernelStatus::kOk);
  for (int rep = 0; rep < 4; ++rep) {
    ASSERT_EQ(gpu_->LocalSum(in.data(), 17, n, out, nullptr, stream()), KernelStatus::kOk);
  }
  const auto start = std::chrono::steady_clock::now();
  const KernelStatus quick = gpu_->SynchronizeFor(stream(), 0.0);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(100));
  EXPECT_TRUE(quick == KernelStatus::kOk || quick == KernelStatus::kTimedOut)
      << KernelStatusString(quick);
  ASSERT_EQ(gpu_->SynchronizeFor(stream(), 60.0), KernelStatus::kOk);
  std::vector<float> last(1);
  ASSERT_EQ(cudaMemcpy(last.data(), out + n - 1, sizeof(float), cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(last[0], 17.0f);
  EXPECT_EQ(cpu_->SynchronizeFor(nullptr, 0.0), KernelStatus::kOk);
  EXPECT_STREQ(KernelStatusString(KernelStatus::kTimedOut), "timed out");
}

// Both backends count the same calls as waits, so a step's count measured on
// the CPU is the GPU's.
TEST_F(CudaOpsTest, HostWaitsCountTheSameCallsAsCpu) {
  const std::vector<float> host = {1.0f, -2.0f, 3.0f, 4.0f};
  auto run = [&](SparseOps& ops, void* s) {
    float* a = static_cast<float*>(ops.Allocate(4 * sizeof(float)));
    float* b = static_cast<float*>(ops.Allocate(4 * sizeof(float)));
    auto* scalars = static_cast<StepScalars*>(ops.Allocate(sizeof(StepScalars)));
    const uint64_t before = ops.host_waits();
    EXPECT_EQ(ops.CopyToDevice(a, host.data(), 4 * sizeof(float), s), KernelStatus::kOk);
    EXPECT_EQ(ops.CopyToDevice(a, host.data(), 0, s), KernelStatus::kOk);
    EXPECT_EQ(ops.CopyFloats(b, a, 4, s), KernelStatus::kOk);
    EXPECT_EQ(ops.CountNonFinite(b, 4, scalars, s), KernelStatus::kOk);
    StepScalars sc;
    EXPECT_EQ(ops.CopyToHost(&sc, scalars, sizeof sc, s), KernelStatus::kOk);
    double sum = 0;
    EXPECT_EQ(ops.SumOfSquares(b, 4, &sum, s), KernelStatus::kOk);
    EXPECT_EQ(ops.SumOfSquares(b, 0, &sum, s), KernelStatus::kOk);
    EXPECT_EQ(ops.Synchronize(s), KernelStatus::kOk);
    EXPECT_EQ(ops.SynchronizeFor(s, 10.0), KernelStatus::kOk);
    const uint64_t waits = ops.host_waits() - before;
    ops.Free(a);
    ops.Free(b);
    ops.Free(scalars);
    return waits;
  };
  const uint64_t cpu_waits = run(*cpu_, nullptr);
  EXPECT_EQ(cpu_waits, 5u);
  EXPECT_EQ(run(*gpu_, stream()), cpu_waits);
}

TEST_F(CudaOpsTest, GatherScatterZeroMatchCpu) {
  for (uint64_t n : kSizes) {
    const std::vector<float> acc = RandomValues(n, 31);
    // Distinct indices in random order, about 1 in 5 elements.
    std::vector<uint32_t> idx;
    for (uint64_t i = 0; i < n; ++i) {
      if (i % 5 == 2 || i + 1 == n) idx.push_back(uint32_t(i));
    }
    std::shuffle(idx.begin(), idx.end(), std::mt19937(5));
    const uint64_t k = idx.size();
    const float* accd = Up(acc);
    const uint32_t* idxd = Up(idx);
    std::vector<float> got_c(k);
    ASSERT_EQ(cpu_->Gather(acc.data(), idx.data(), k, got_c.data(), nullptr), KernelStatus::kOk);
    float* got_g = Zeros<float>(k);
    ASSERT_EQ(gpu_->Gather(accd, idxd, k, got_g, stream()), KernelStatus::kOk);
    ExpectSameBits(Down(got_g, k), got_c);

    std::vector<float> upd_c(n, 3.0f);
    ASSERT_EQ(
        cpu_->ScatterAverage(got_c.data(), idx.data(), k, 3.0f, upd_c.data(), n, false, nullptr),
        KernelStatus::kOk);
    float* upd_g = Up(std::vector<float>(n, 3.0f));
    ASSERT_EQ(gpu_->ScatterAverage(got_g, idxd, k, 3.0f, upd_g, n, false, stream()),
              KernelStatus::kOk);
    ExpectSameBits(Down(upd_g, n), upd_c);

    std::vector<float> z_c = acc;
    ASSERT_EQ(cpu_->ZeroAt(z_c.data(), idx.data(), k, nullptr), KernelStatus::kOk);
    float* z_g = Up(acc);
    ASSERT_EQ(gpu_->ZeroAt(z_g, idxd, k, stream()), KernelStatus::kOk);
    ExpectSameBits(Down(z_g, n), z_c);
  }
}

TEST_F(CudaOpsTest, CopyAndZeroFloatsInDeviceMemory) {
  const std::vector<float> src = RandomValues(100003, 8);
  const float* srcd = Up(src);
  float* dstd = Up(std::vector<float>(src.size(), 7.0f));
  ASSERT_EQ(gpu_->CopyFloats(dstd, srcd, src.size(), stream()), KernelStatus::kOk);
  ExpectSameBits(Down(dstd, src.size()), src);
  ASSERT_EQ(gpu_->ZeroFloats(dstd, src.size(), stream()), KernelStatus::kOk);
  ExpectSameBits(Down(dstd, src.size()), std::vector<float>(src.size(), 0.0f));
}

TEST_F(CudaOpsTest, CountOutsideMatchesCpu) {
  for (uint64_t n : kSizes) {
    std::vector<uint32_t> idx(n);
    for (uint64_t j = 0; j < n; ++j)
      idx[j] = static_cast<uint32_t>((j * 2654435761u) % (3 * n + 1));
    const uint32_t* idxd = Up(idx);
    StepScalars want{}, got{};
    ASSERT_EQ(cpu_->CountOutside(idx.data(), n, n / 3, 2 * n, &want, nullptr), KernelStatus::kOk);
    StepScalars* sd = Zeros<StepScalars>(1);
    ASSERT_EQ(gpu_->CountOutside(idxd, n, n / 3, 2 * n, sd, stream()), KernelStatus::kOk);
    got = Down(sd, 1)[0];
    EXPECT_EQ(got.count, want.count) << n;
    EXPECT_EQ(got.nonfinite, 0u);
  }
}

TEST_F(CudaOpsTest, TopKMatchesCpuIncludingTies) {
  for (uint64_t n : kSizes) {
    for (int ties : {0, 1, 2}) {
      std::vector<float> acc = RandomValues(n, 41);
      if (ties == 1) {
        // Few distinct magnitudes of both signs: ties decide membership.
        for (uint64_t i = 0; i < n; ++i) acc[i] = float(int(i * 7919 % 13) - 6) * 0.25f;
      } else if (ties == 2) {
        // One bin of the radix select's first level (1 to 1 + 2^-4): its
        // later levels decide, some values tie.
        for (uint64_t i = 0; i < n; ++i) {
          acc[i] = 1.0f + std::ldexp(static_cast<float>((i * 2654435761u) % 4096), -16);
        }
      }
      const float* accd = Up(acc);
      for (uint64_t k : {uint64_t{0}, uint64_t{1}, uint64_t{10}, n / 100, n / 3, n, n + 5}) {
        SCOPED_TRACE(testing::Message() << "n=" << n << " k=" << k << " ties=" << ties);
        const uint64_t cap = std::max<uint64_t>(std::min(k, n), 1);
        std::vector<uint32_t> idx_c(cap);
        std::vector<float> val_c(cap);
        StepScalars s_c;
        ASSERT_EQ(cpu_->TopK(acc.data(), n, k, idx_c.data(), val_c.data(), &s_c, nullptr),
                  KernelStatus::kOk);
        uint32_t* idxd = Zeros<uint32_t>(cap);
        float* vald = Zeros<float>(cap);
        StepScalars* sd = Zeros<StepScalars>(1);
        ASSERT_EQ(gpu_->TopK(accd, n, k, idxd, vald, sd, stream()), KernelStatus::kOk);
        const StepScalars s_g = DownScalars(sd);
        ASSERT_EQ(s_g.count, s_c.count);
        EXPECT_EQ(Collect(Down(idxd, s_g.count), Down(vald, s_g.count), s_g.count),
                  Collect(idx_c, val_c, s_c.count));
      }
    }
  }
}

TEST_F(CudaOpsTest, SortUniqueMatchesCpu) {
  for (uint64_t n : kSizes) {
    std::mt19937 rng(51);
    std::uniform_int_distribution<uint32_t> dist(0, uint32_t(std::max<uint64_t>(n / 2, 1)));
    std::vector<uint32_t> idx(n);
    for (auto& x : idx) x = dist(rng);
    if (n > 2) idx[1] = 0xFFFFFFFEu;
    uint32_t* d = Up(idx);
    StepScalars s_c;
    ASSERT_EQ(cpu_->SortUnique(idx.data(), n, &s_c, nullptr), KernelStatus::kOk);
    StepScalars* sd = Zeros<StepScalars>(1);
    ASSERT_EQ(gpu_->SortUnique(d, n, sd, stream()), KernelStatus::kOk);
    const StepScalars s_g = DownScalars(sd);
    ASSERT_EQ(s_g.count, s_c.count) << n;
    idx.resize(s_c.count);
    EXPECT_EQ(Down(d, s_g.count), idx);
  }
}

// 64-bit indexing: a bucket of more than 2^31 elements selects exactly the
// few marked elements past 2^31, and counts a non-finite one there.
TEST_F(CudaOpsTest, FusedPassIndexesPast2To31) {
  const uint64_t d = (uint64_t{1} << 31) + 4099;
  float* g = static_cast<float*>(gpu_->Allocate(d * sizeof(float)));
  float* e = static_cast<float*>(gpu_->Allocate(d * sizeof(float)));
  if (g == nullptr || e == nullptr) {
    gpu_->Free(g);
    gpu_->Free(e);
    GTEST_SKIP() << "not enough device memory for 2 x " << d << " floats";
  }
  owned_.push_back(g);
  owned_.push_back(e);
  const uint64_t marks[] = {d / 2 - 1, (uint64_t{1} << 31), d - 4, d - 1};
  for (uint64_t i : marks) {
    const float one = 1.0f;
    ASSERT_EQ(gpu_->CopyToDevice(g + i, &one, 4, stream()), KernelStatus::kOk);
  }
  const float inf = kInf;
  ASSERT_EQ(gpu_->CopyToDevice(g + (d - 2), &inf, 4, stream()), KernelStatus::kOk);
  const uint64_t begin = d / 2, end = d - 1;  // an owned partition of the upper half
  uint32_t* idxd = Zeros<uint32_t>(end - begin);
  float* vald = Zeros<float>(end - begin);
  StepScalars* sd = Zeros<StepScalars>(1);
  FusedSelectArgs a{g, e, e, d, begin, end, 0.5f, idxd, vald, sd};
  ASSERT_EQ(gpu_->FusedAccumulateSelect(a, stream()), KernelStatus::kOk);
  const StepScalars s = DownScalars(sd);
  EXPECT_EQ(s.nonfinite, 1u);
  ASSERT_EQ(s.count, 3u);  // d/2 - 1 is outside, d - 2 is infinite (selected), d - 1 outside
  std::vector<uint32_t> got = Down(idxd, 3);
  std::sort(got.begin(), got.end());
  EXPECT_EQ(got, (std::vector<uint32_t>{uint32_t{1} << 31, uint32_t(d - 4), uint32_t(d - 2)}));
  float last = 0;
  ASSERT_EQ(gpu_->CopyToHost(&last, e + (d - 1), 4, stream()), KernelStatus::kOk);
  EXPECT_EQ(last, 1.0f);
}

}  // namespace
}  // namespace microd::kernels

namespace microd::kernels {
namespace {

// Every fp16 and bf16 value widened, and floats of every kind rounded
// (specials, ties, subnormal and overflow boundaries, random bits): the CPU
// backend's bits.
TEST_F(CudaOpsTest, HalfConversionsMatchCpu) {
  std::vector<uint16_t> every(65536);
  for (uint32_t i = 0; i < 65536; ++i) every[i] = static_cast<uint16_t>(i);
  std::vector<float> floats = RandomValues(200003, 9);
  std::mt19937 rng(10);
  for (int i = 0; i < 200000; ++i) {
    const uint32_t u = rng();
    float f;
    std::memcpy(&f, &u, sizeof f);
    floats.push_back(f);
  }
  for (const ElementType t : {ElementType::kBFloat16, ElementType::kFloat16}) {
    SCOPED_TRACE(ElementTypeName(t));
    std::vector<float> wide(every.size());
    ASSERT_EQ(cpu_->HalfToFloat(every.data(), t, every.size(), wide.data(), nullptr),
              KernelStatus::kOk);
    float* wd = Zeros<float>(every.size());
    ASSERT_EQ(gpu_->HalfToFloat(Up(every), t, every.size(), wd, stream()), KernelStatus::kOk);
    const std::vector<float> got_wide = Down(wd, every.size());
    for (size_t i = 0; i < every.size(); ++i) ASSERT_EQ(Bits(got_wide[i]), Bits(wide[i])) << i;
    std::vector<uint16_t> narrow(floats.size());
    ASSERT_EQ(cpu_->FloatToHalf(floats.data(), t, floats.size(), narrow.data(), nullptr),
              KernelStatus::kOk);
    uint16_t* nd = Zeros<uint16_t>(floats.size());
    ASSERT_EQ(gpu_->FloatToHalf(Up(floats), t, floats.size(), nd, stream()), KernelStatus::kOk);
    EXPECT_EQ(Down(nd, floats.size()), narrow);
    // The values sent with a half wire, and the remainders left behind.
    std::vector<uint32_t> index;
    for (uint32_t i = 3; i < floats.size(); i += 5) {
      if (std::isfinite(floats[i])) index.push_back(i);
    }
    std::vector<float> acc = floats;
    std::vector<uint16_t> sent(index.size());
    ASSERT_EQ(cpu_->GatherRounded(acc.data(), index.data(), index.size(), t, sent.data(), nullptr),
              KernelStatus::kOk);
    float* accd = Up(floats);
    uint16_t* sentd = Zeros<uint16_t>(index.size());
    ASSERT_EQ(gpu_->GatherRounded(accd, Up(index), index.size(), t, sentd, stream()),
              KernelStatus::kOk);
    EXPECT_EQ(Down(sentd, index.size()), sent);
    ExpectSameBits(Down(accd, floats.size()), acc);
  }
}

}  // namespace
}  // namespace microd::kernels
