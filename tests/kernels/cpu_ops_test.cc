// SPDX-License-Identifier: Apache-2.0
// Every CPU kernel against a plain scalar reference written here, for each
// instruction set this processor runs, over sizes {0, 1, 7, 1000, 1000003}
// and every partition edge.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/poll_pacer.h"
#include "kernels/sparse_ops.h"
#include "tests/common/kernel_inputs.h"

namespace microd::kernels {
namespace {}  // namespace

void PrintTo(CpuIsa isa, std::ostream* os) { *os << (isa == CpuIsa::kAvx2 ? "avx2" : "scalar"); }

namespace {

using test::Bits;
using test::FirstBitDifference;
using test::kSizes;
using test::RandomValues;
using test::Ranges;

using Pairs = std::vector<std::pair<uint32_t, float>>;

Pairs Collect(const uint32_t* idx, const float* val, uint64_t n) {
  Pairs p;
  for (uint64_t j = 0; j < n; ++j) p.push_back({idx[j], val[j]});
  std::sort(p.begin(), p.end(), [](auto& a, auto& b) { return a.first < b.first; });
  return p;
}

void ExpectSamePairs(const Pairs& got, const Pairs& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t j = 0; j < got.size(); ++j) {
    ASSERT_EQ(got[j].first, want[j].first) << "at " << j;
    ASSERT_EQ(Bits(got[j].second), Bits(want[j].second)) << "index " << got[j].first;
  }
}

class CpuOpsTest : public ::testing::TestWithParam<CpuIsa> {
 protected:
  void SetUp() override {
    if (!CpuSupports(GetParam())) GTEST_SKIP() << "this processor lacks the instruction set";
    ops_ = CreateCpuSparseOps(GetParam());
    ASSERT_NE(ops_, nullptr);
  }
  // A buffer from the backend (aligned, as a step's buffers are).
  float* Device(const std::vector<float>& host) {
    float* p = static_cast<float*>(ops_->Allocate(host.size() * sizeof(float)));
    if (!host.empty()) std::memcpy(p, host.data(), host.size() * sizeof(float));
    owned_.push_back(p);
    return p;
  }
  void TearDown() override {
    for (void* p : owned_) ops_->Free(p);
  }
  std::unique_ptr<SparseOps> ops_;
  std::vector<void*> owned_;
};

// The CPU backend's work is done when a call returns: waits end at once.
TEST_P(CpuOpsTest, SynchronizeReturnsAtOnceAndStatusesHaveNames) {
  EXPECT_EQ(ops_->Synchronize(nullptr), KernelStatus::kOk);
  EXPECT_EQ(ops_->SynchronizeFor(nullptr, 0.0), KernelStatus::kOk);
  EXPECT_STREQ(KernelStatusString(KernelStatus::kTimedOut), "timed out");
  EXPECT_STREQ(KernelStatusString(KernelStatus::kDeviceError), "device error");
}

// The calls that wait for the stream's work are counted (on a device each is
// a round trip); kernels queued on the stream and empty copies are not.
TEST_P(CpuOpsTest, HostWaitsCountTheCallsThatWait) {
  const std::vector<float> host = {1.0f, -2.0f, 3.0f};
  float* a = Device(std::vector<float>(3));
  float* b = Device(std::vector<float>(3));
  StepScalars* scalars = static_cast<StepScalars*>(ops_->Allocate(sizeof(StepScalars)));
  owned_.push_back(scalars);
  const uint64_t before = ops_->host_waits();
  ASSERT_EQ(ops_->CopyToDevice(a, host.data(), 3 * sizeof(float), nullptr), KernelStatus::kOk);
  ASSERT_EQ(ops_->CopyToDevice(a, host.data(), 0, nullptr), KernelStatus::kOk);
  ASSERT_EQ(ops_->CopyFloats(b, a, 3, nullptr), KernelStatus::kOk);
  ASSERT_EQ(ops_->CountNonFinite(b, 3, scalars, nullptr), KernelStatus::kOk);
  EXPECT_EQ(ops_->host_waits() - before, 1u);
  StepScalars s;
  ASSERT_EQ(ops_->CopyToHost(&s, scalars, sizeof s, nullptr), KernelStatus::kOk);
  double sum = 0;
  ASSERT_EQ(ops_->SumOfSquares(b, 3, &sum, nullptr), KernelStatus::kOk);
  ASSERT_EQ(ops_->SumOfSquares(b, 0, &sum, nullptr), KernelStatus::kOk);
  ASSERT_EQ(ops_->Synchronize(nullptr), KernelStatus::kOk);
  ASSERT_EQ(ops_->SynchronizeFor(nullptr, 1.0), KernelStatus::kOk);
  EXPECT_EQ(ops_->host_waits() - before, 5u);
  EXPECT_EQ(ops_->CopyToHost(nullptr, scalars, sizeof s, nullptr), KernelStatus::kInvalidArgument);
  EXPECT_EQ(ops_->host_waits() - before, 5u);
}

// Polls of device work: yields while a wait is young, then naps of at most
// kNap, never the long sleeps of a doubling back-off.
TEST(PollPacer, YieldsFirstThenNapsShortly) {
  using std::chrono::microseconds;
  EXPECT_EQ(PollPacer::PauseAfter(microseconds(0)).count(), 0);
  EXPECT_EQ(PollPacer::PauseAfter(PollPacer::kSpin - microseconds(1)).count(), 0);
  EXPECT_EQ(PollPacer::PauseAfter(PollPacer::kSpin), PollPacer::kNap);
  EXPECT_EQ(PollPacer::PauseAfter(std::chrono::seconds(100)), PollPacer::kNap);
  EXPECT_LE(PollPacer::kNap, microseconds(100));
}

TEST_P(CpuOpsTest, FusedAccumulateSelectMatchesReference) {
  for (uint64_t d : kSizes) {
    const std::vector<float> g = RandomValues(d, 1 + d);
    const std::vector<float> e = RandomValues(d, 2 + d);
    std::vector<float> want_acc(d);
    for (uint64_t i = 0; i < d; ++i) want_acc[i] = e[i] + g[i];
    // The buffers once per size (e refilled before each call, the outputs
    // poisoned): 144 calls over a million elements stay in one set of pages.
    float* gd = Device(g);
    float* ed = Device(e);
    float* out = Device(std::vector<float>(d));
    std::vector<uint32_t> idx(d + 1);
    std::vector<float> val(d + 1);
    for (auto [b, end] : Ranges(d)) {
      for (float thr : {0.0f, 1e-3f, 0.5f, std::numeric_limits<float>::infinity()}) {
        for (bool in_place : {false, true}) {
          SCOPED_TRACE(testing::Message() << "d=" << d << " range=[" << b << "," << end
                                          << ") thr=" << thr << " in_place=" << in_place);
          if (d > 0) {
            std::memcpy(ed, e.data(), d * sizeof(float));
            std::memset(out, 0xff, d * sizeof(float));  // NaNs: an unwritten element shows
          }
          float* acc = in_place ? ed : out;
          StepScalars s{123, 456};
          FusedSelectArgs a{gd, ed, acc, d, b, end, thr, idx.data(), val.data(), &s};
          ASSERT_EQ(ops_->FusedAccumulateSelect(a, nullptr), KernelStatus::kOk);
          EXPECT_EQ(s.nonfinite, 0u);
          ASSERT_EQ(FirstBitDifference(acc, want_acc.data(), d), d);
          Pairs want;
          for (uint64_t i = b; i < end; ++i) {
            if (std::fabs(want_acc[i]) >= thr) want.push_back({uint32_t(i), want_acc[i]});
          }
          ASSERT_EQ(s.count, want.size());
          ExpectSamePairs(Collect(idx.data(), val.data(), s.count), want);
        }
      }
    }
  }
}

// The commit pass (sums stored in place) zeroes the update as it goes, the
// update a buffer of its own or the gradient itself: the same sums and
// velocity as without it, the update all zeros. Refused where the update
// would be the residual, the velocity, or where nothing is stored.
TEST_P(CpuOpsTest, TheCommitPassZeroesTheUpdate) {
  for (uint64_t d : kSizes) {
    const std::vector<float> g = RandomValues(d, 21 + d);
    const std::vector<float> e = RandomValues(d, 22 + d);
    const std::vector<float> v = RandomValues(d, 23 + d);
    for (bool momentum : {false, true}) {
      for (bool onto_grad : {false, true}) {
        SCOPED_TRACE(testing::Message()
                     << "d=" << d << " momentum=" << momentum << " onto_grad=" << onto_grad);
        StepScalars s_want, s_got;
        float* e_want = Device(e);
        float* v_want = Device(v);
        FusedSelectArgs want{Device(g), e_want, e_want, d, 0, 0, 0.0f, nullptr, nullptr, &s_want};
        float* e_got = Device(e);
        float* v_got = Device(v);
        float* g_got = Device(g);
        FusedSelectArgs got{g_got, e_got, e_got, d, 0, 0, 0.0f, nullptr, nullptr, &s_got};
        if (momentum) {
          want.velocity_in = want.velocity_out = v_want;
          got.velocity_in = got.velocity_out = v_got;
          want.beta = got.beta = 0.9f;
        }
        float* update = onto_grad ? g_got : Device(std::vector<float>(d, 5.0f));
        got.zero_out = update;
        ASSERT_EQ(ops_->FusedAccumulateSelect(want, nullptr), KernelStatus::kOk);
        ASSERT_EQ(ops_->FusedAccumulateSelect(got, nullptr), KernelStatus::kOk);
        EXPECT_EQ(s_got.nonfinite, s_want.nonfinite);
        for (uint64_t i = 0; i < d; ++i) {
          ASSERT_EQ(Bits(e_got[i]), Bits(e_want[i])) << i;
          ASSERT_EQ(Bits(v_got[i]), Bits(v_want[i])) << i;
          ASSERT_EQ(Bits(update[i]), Bits(0.0f)) << i;
        }
      }
    }
  }
  std::vector<float> a(16, 1.0f), b(16, 1.0f), u(16, 1.0f);
  StepScalars s;
  FusedSelectArgs ok{a.data(), b.data(), b.data(), 16, 0, 0, 0.0f, nullptr, nullptr, &s};
  ok.zero_out = u.data();
  EXPECT_EQ(ops_->FusedAccumulateSelect(ok, nullptr), KernelStatus::kOk);
  FusedSelectArgs bad = ok;
  bad.zero_out = b.data();  // the residual
  EXPECT_EQ(ops_->FusedAccumulateSelect(bad, nullptr), KernelStatus::kInvalidArgument);
  bad = ok;
  bad.acc = nullptr;  // nothing stored: the read-only pass
  EXPECT_EQ(ops_->FusedAccumulateSelect(bad, nullptr), KernelStatus::kInvalidArgument);
  bad = ok;
  bad.velocity_in = bad.velocity_out = u.data();
  bad.beta = 0.9f;
  EXPECT_EQ(ops_->FusedAccumulateSelect(bad, nullptr), KernelStatus::kInvalidArgument);
}

// Outputs with room for fewer pairs than the pass selects: the count is
// every selected element's, the outputs hold the first ones (index order on
// the CPU) and nothing is written past their capacity.
TEST_P(CpuOpsTest, FusedPassWritesNoMoreThanTheOutputsHold) {
  for (uint64_t d : kSizes) {
    const std::vector<float> g = RandomValues(d, 3 + d);
    const std::vector<float> e = RandomValues(d, 4 + d);
    float* const gd = Device(g);
    float* const ed = Device(e);
    for (auto [b, end] : Ranges(d)) {
      Pairs want;
      for (uint64_t i = b; i < end; ++i) {
        const float v = e[i] + g[i];
        if (std::fabs(v) >= 0.5f) want.push_back({uint32_t(i), v});
      }
      for (uint64_t capacity : {uint64_t{1}, uint64_t(want.size() / 2), uint64_t(want.size()),
                                uint64_t(want.size() + 1)}) {
        if (capacity == 0) continue;
        SCOPED_TRACE(testing::Message()
                     << "d=" << d << " range=[" << b << "," << end << ") capacity=" << capacity);
        constexpr uint32_t kUntouched = 0xdeadbeef;
        std::vector<uint32_t> idx(capacity + 70, kUntouched);
        std::vector<float> val(capacity + 70, -7.0f);
        StepScalars s;
        FusedSelectArgs a{gd, ed, nullptr, d, b, end, 0.5f, idx.data(), val.data(), &s};
        a.out_capacity = capacity;
        ASSERT_EQ(ops_->FusedAccumulateSelect(a, nullptr), KernelStatus::kOk);
        ASSERT_EQ(s.count, want.size());
        const uint64_t held = std::min<uint64_t>(capacity, want.size());
        ExpectSamePairs(Collect(idx.data(), val.data(), held),
                        Pairs(want.begin(), want.begin() + held));
        for (uint64_t j = capacity; j < idx.size(); ++j) {
          ASSERT_EQ(idx[j], kUntouched) << j;
          ASSERT_EQ(val[j], -7.0f) << j;
        }
      }
    }
  }
  // No room at all for a range to select from is a bad argument.
  std::vector<float> v(16, 1.0f);
  std::vector<uint32_t> idx(16);
  StepScalars s;
  FusedSelectArgs a{v.data(), v.data(), nullptr, 16, 0, 16, 0.5f, idx.data(), v.data(), &s};
  a.out_value = Device(v);
  a.out_capacity = 0;
  EXPECT_EQ(ops_->FusedAccumulateSelect(a, nullptr), KernelStatus::kInvalidArgument);
}

// Local clipping folded into the pass (grad_scale) gives the bits of scaling
// the gradient first (a rounded multiply) and then the plain pass, with and
// without momentum correction.
TEST_P(CpuOpsTest, FusedPassWithAGradientScaleMatchesScaleThenPass) {
  const float scale = 0.3711f, beta = 0.9f;
  for (uint64_t d : kSizes) {
    const std::vector<float> g = RandomValues(d, 21 + d);
    const std::vector<float> e = RandomValues(d, 22 + d);
    const std::vector<float> v = RandomValues(d, 23 + d);
    std::vector<float> scaled(d);
    for (uint64_t i = 0; i < d; ++i) scaled[i] = g[i] * scale;
    for (bool momentum : {false, true}) {
      SCOPED_TRACE(testing::Message() << "d=" << d << " momentum=" << momentum);
      std::vector<float> want_v(d), want_acc(d);
      if (momentum) {
        ASSERT_EQ(ops_->Momentum(scaled.data(), v.data(), beta, want_v.data(), d, nullptr),
                  KernelStatus::kOk);
      }
      for (uint64_t i = 0; i < d; ++i) want_acc[i] = e[i] + (momentum ? want_v[i] : scaled[i]);
      const uint64_t b = d / 4, end = d / 2;
      float* vout = Device(std::vector<float>(d));
      float* acc = Device(std::vector<float>(d));
      std::vector<uint32_t> idx(end - b + 1);
      std::vector<float> val(end - b + 1);
      StepScalars s;
      FusedSelectArgs a{Device(g), Device(e), acc, d, b, end, 1e-3f, idx.data(), val.data(), &s};
      a.grad_scale = scale;
      if (momentum) {
        a.velocity_in = Device(v);
        a.velocity_out = vout;
        a.beta = beta;
      }
      ASSERT_EQ(ops_->FusedAccumulateSelect(a, nullptr), KernelStatus::kOk);
      for (uint64_t i = 0; i < d; ++i) {
        ASSERT_EQ(Bits(acc[i]), Bits(want_acc[i])) << i;
        if (momentum) {
          ASSERT_EQ(Bits(vout[i]), Bits(want_v[i])) << i;
        }
      }
      Pairs want;
      for (uint64_t i = b; i < end; ++i) {
        if (std::fabs(want_acc[i]) >= 1e-3f) want.push_back({uint32_t(i), want_acc[i]});
      }
      ASSERT_EQ(s.count, want.size());
      ExpectSamePairs(Collect(idx.data(), val.data(), s.count), want);
    }
  }
}

// Momentum folded into the pass gives the bits of Momentum() followed by the
// plain pass, for the velocity updated into a separate buffer and in place.
TEST_P(CpuOpsTest, FusedPassWithMomentumMatchesMomentumThenPass) {
  const float beta = 0.9f;
  for (uint64_t d : kSizes) {
    const std::vector<float> g = RandomValues(d, 11 + d);
    const std::vector<float> e = RandomValues(d, 12 + d);
    const std::vector<float> v = RandomValues(d, 13 + d);
    std::vector<float> want_v(d), want_acc(d);
    ASSERT_EQ(ops_->Momentum(g.data(), v.data(), beta, want_v.data(), d, nullptr),
              KernelStatus::kOk);
    for (uint64_t i = 0; i < d; ++i) want_acc[i] = e[i] + want_v[i];
    const uint64_t b = d / 4, end = d / 2;
    for (bool velocity_in_place : {false, true}) {
      SCOPED_TRACE(testing::Message() << "d=" << d << " velocity_in_place=" << velocity_in_place);
      float* vin = Device(v);
      float* vout = velocity_in_place ? vin : Device(std::vector<float>(d));
      float* acc = Device(std::vector<float>(d));
      std::vector<uint32_t> idx(end - b + 1);
      std::vector<float> val(end - b + 1);
      StepScalars s;
      FusedSelectArgs a{Device(g), Device(e), acc, d, b, end, 1e-3f, idx.data(), val.data(), &s};
      a.velocity_in = vin;
      a.velocity_out = vout;
      a.beta = beta;
      ASSERT_EQ(ops_->FusedAccumulateSelect(a, nullptr), KernelStatus::kOk);
      EXPECT_EQ(s.nonfinite, 0u);
      for (uint64_t i = 0; i < d; ++i) {
        ASSERT_EQ(Bits(vout[i]), Bits(want_v[i])) << i;
        ASSERT_EQ(Bits(acc[i]), Bits(want_acc[i])) << i;
      }
      Pairs want;
      for (uint64_t i = b; i < end; ++i) {
        if (std::fabs(want_acc[i]) >= 1e-3f) want.push_back({uint32_t(i), want_acc[i]});
      }
      ASSERT_EQ(s.count, want.size());
      ExpectSamePairs(Collect(idx.data(), val.data(), s.count), want);
    }
  }
  // A non-finite velocity makes acc non-finite: counted like a bad gradient.
  std::vector<float> v(100, 0.0f);
  v[3] = std::numeric_limits<float>::infinity();
  StepScalars s;
  FusedSelectArgs a{Device(std::vector<float>(100, 1.0f)),
                    Device(std::vector<float>(100)),
                    Device(std::vector<float>(100)),
                    100,
                    0,
                    0,
                    0,
                    nullptr,
                    nullptr,
                    &s};
  a.velocity_in = Device(v);
  a.velocity_out = Device(std::vector<float>(100));
  a.beta = beta;
  ASSERT_EQ(ops_->FusedAccumulateSelect(a, nullptr), KernelStatus::kOk);
  EXPECT_EQ(s.nonfinite, 1u);
}

TEST_P(CpuOpsTest, FusedPassCountsNonFiniteAndLeavesSeparateResidual) {
  for (uint64_t d : {uint64_t{1}, uint64_t{7}, uint64_t{1000}, uint64_t{1000003}}) {
    std::vector<float> g = RandomValues(d, 9);
    const std::vector<float> e = RandomValues(d, 10);
    g[d / 2] = std::numeric_limits<float>::quiet_NaN();
    g[d - 1] = -std::numeric_limits<float>::infinity();
    float* ed = Device(e);
    float* acc = Device(std::vector<float>(d));
    std::vector<uint32_t> idx(d);
    std::vector<float> val(d);
    StepScalars s;
    FusedSelectArgs a{Device(g), ed, acc, d, 0, d, 0.1f, idx.data(), val.data(), &s};
    ASSERT_EQ(ops_->FusedAccumulateSelect(a, nullptr), KernelStatus::kOk);
    EXPECT_EQ(s.nonfinite, d == 1 ? 1u : 2u) << d;
    for (uint64_t i = 0; i < d; ++i) ASSERT_EQ(Bits(ed[i]), Bits(e[i]));
  }
  // Overflow to infinity counts too.
  std::vector<float> big(100, 3e38f);
  StepScalars s;
  float* acc = Device(std::vector<float>(100));
  FusedSelectArgs a{Device(big), Device(big), acc, 100, 0, 0, 0, nullptr, nullptr, &s};
  ASSERT_EQ(ops_->FusedAccumulateSelect(a, nullptr), KernelStatus::kOk);
  EXPECT_EQ(s.nonfinite, 100u);
}

TEST_P(CpuOpsTest, FusedPassRejectsBadArguments) {
  std::vector<float> v(16, 1.0f), out(16);
  std::vector<uint32_t> idx(16);
  StepScalars s;
  FusedSelectArgs ok{v.data(), v.data(), out.data(), 16, 0, 16, 0.5f, idx.data(), out.data(), &s};
  FusedSelectArgs a = ok;
  a.grad = nullptr;
  EXPECT_EQ(ops_->FusedAccumulateSelect(a, nullptr), KernelStatus::kInvalidArgument);
  a = ok;
  a.select_begin = 9;
  a.select_end = 8;
  EXPECT_EQ(ops_->FusedAccumulateSelect(a, nullptr), KernelStatus::kInvalidArgument);
  a = ok;
  a.select_end = 17;
  EXPECT_EQ(ops_->FusedAccumulateSelect(a, nullptr), KernelStatus::kInvalidArgument);
  a = ok;
  a.size = kMaxBucketElements + 1;
  a.select_end = 0;
  EXPECT_EQ(ops_->FusedAccumulateSelect(a, nullptr), KernelStatus::kInvalidArgument);
  a = ok;
  a.scalars = nullptr;
  EXPECT_EQ(ops_->FusedAccumulateSelect(a, nullptr), KernelStatus::kInvalidArgument);
  a = ok;
  a.out_index = nullptr;
  EXPECT_EQ(ops_->FusedAccumulateSelect(a, nullptr), KernelStatus::kInvalidArgument);
  a = ok;
  a.acc = const_cast<float*>(a.grad);
  EXPECT_EQ(ops_->FusedAccumulateSelect(a, nullptr), KernelStatus::kInvalidArgument);
  // Momentum: a velocity is needed to read, and the new one may not overwrite
  // an input of the pass or its output.
  std::vector<float> vel(16, 0.5f), vel_out(16);
  a = ok;
  a.velocity_out = vel_out.data();
  EXPECT_EQ(ops_->FusedAccumulateSelect(a, nullptr), KernelStatus::kInvalidArgument);
  a.velocity_in = vel.data();
  EXPECT_EQ(ops_->FusedAccumulateSelect(a, nullptr), KernelStatus::kOk);
  for (float* bad : {const_cast<float*>(ok.grad), const_cast<float*>(ok.residual), ok.acc}) {
    a.velocity_out = bad;
    EXPECT_EQ(ops_->FusedAccumulateSelect(a, nullptr), KernelStatus::kInvalidArgument);
  }
  EXPECT_EQ(ops_->SelectRange(v.data(), 0, kMaxBucketElements + 1, 0, idx.data(), out.data(), &s,
                              nullptr),
            KernelStatus::kInvalidArgument);
  EXPECT_EQ(ops_->ScatterAverage(v.data(), idx.data(), 1, 1.0f, out.data(), kMaxBucketElements + 1,
                                 false, nullptr),
            KernelStatus::kInvalidArgument);
  // An index outside the output is refused before anything is written.
  idx[0] = 16;
  out.assign(16, 7.0f);
  EXPECT_EQ(ops_->ScatterAverage(v.data(), idx.data(), 1, 1.0f, out.data(), 16, false, nullptr),
            KernelStatus::kInvalidArgument);
  EXPECT_EQ(out[0], 7.0f);
}

TEST_P(CpuOpsTest, SelectRangeMatchesReference) {
  for (uint64_t d : kSizes) {
    const std::vector<float> acc = RandomValues(d, 3 + d);
    const float* ad = Device(acc);
    for (auto [b, end] : Ranges(d)) {
      for (float thr : {0.0f, 1e-2f, 2.0f}) {
        std::vector<uint32_t> idx(end - b + 1);
        std::vector<float> val(end - b + 1);
        StepScalars s;
        ASSERT_EQ(ops_->SelectRange(ad, b, end, thr, idx.data(), val.data(), &s, nullptr),
                  KernelStatus::kOk);
        Pairs want;
        for (uint64_t i = b; i < end; ++i) {
          if (std::fabs(acc[i]) >= thr) want.push_back({uint32_t(i), acc[i]});
        }
        ASSERT_EQ(s.count, want.size()) << "d=" << d << " [" << b << "," << end << ")";
        ExpectSamePairs(Collect(idx.data(), val.data(), s.count), want);
      }
    }
  }
}

TEST_P(CpuOpsTest, TrimBelowKeepsOrderAndLargeValues) {
  for (uint64_t n : kSizes) {
    std::vector<float> val = RandomValues(n, 4);
    std::vector<uint32_t> idx(n);
    for (uint64_t j = 0; j < n; ++j) idx[j] = uint32_t(n - j);
    std::vector<uint32_t> want_idx;
    std::vector<float> want_val;
    for (uint64_t j = 0; j < n; ++j) {
      if (std::fabs(val[j]) >= 0.01f) {
        want_idx.push_back(idx[j]);
        want_val.push_back(val[j]);
      }
    }
    StepScalars s;
    ASSERT_EQ(ops_->TrimBelow(idx.data(), val.data(), n, 0.01f, &s, nullptr), KernelStatus::kOk);
    ASSERT_EQ(s.count, want_idx.size());
    for (uint64_t j = 0; j < s.count; ++j) {
      EXPECT_EQ(idx[j], want_idx[j]);
      EXPECT_EQ(Bits(val[j]), Bits(want_val[j]));
    }
  }
}

TEST_P(CpuOpsTest, LogHistogramBinsByBitPattern) {
  for (uint64_t n : kSizes) {
    const std::vector<float> v = RandomValues(n, 5);
    for (uint32_t shift : {12u, 20u, 23u}) {
      const uint32_t first = Bits(1e-3f) >> shift;
      const uint32_t num = 40;
      std::vector<int64_t> want(num + 1, 0), got(num + 1, -1);
      for (float x : v) {
        const uint32_t b = Bits(std::fabs(x)) >> shift;
        if (b < first) continue;
        ++want[std::min<uint64_t>(b - first, num)];
      }
      ASSERT_EQ(ops_->LogHistogram(Device(v), n, shift, first, num, got.data(), nullptr),
                KernelStatus::kOk);
      EXPECT_EQ(got, want) << "n=" << n << " shift=" << shift;
    }
  }
}

TEST_P(CpuOpsTest, GatherScatterZero) {
  for (uint64_t d : kSizes) {
    const std::vector<float> acc = RandomValues(d, 6);
    std::vector<uint32_t> idx;
    for (uint64_t i = 0; i < d; i += 3) idx.push_back(uint32_t(i));
    std::vector<float> gathered(idx.size());
    ASSERT_EQ(ops_->Gather(acc.data(), idx.data(), idx.size(), gathered.data(), nullptr),
              KernelStatus::kOk);
    for (size_t j = 0; j < idx.size(); ++j) ASSERT_EQ(Bits(gathered[j]), Bits(acc[idx[j]]));

    std::vector<float> out(d, 5.0f);
    ASSERT_EQ(ops_->ScatterAverage(gathered.data(), idx.data(), idx.size(), 3.0f, out.data(), d,
                                   false, nullptr),
              KernelStatus::kOk);
    for (uint64_t i = 0; i < d; ++i) {
      const float want = i % 3 == 0 ? acc[i] / 3.0f : 0.0f;
      ASSERT_EQ(Bits(out[i]), Bits(want)) << i;
    }
    // Onto an update the commit pass zeroed: only the values are placed.
    std::vector<float> onto(d, 5.0f);
    ASSERT_EQ(ops_->ScatterAverage(gathered.data(), idx.data(), idx.size(), 3.0f, onto.data(), d,
                                   /*out_zeroed=*/true, nullptr),
              KernelStatus::kOk);
    for (uint64_t i = 0; i < d; ++i) {
      ASSERT_EQ(Bits(onto[i]), Bits(i % 3 == 0 ? acc[i] / 3.0f : 5.0f)) << i;
    }
    std::vector<float> e = acc;
    ASSERT_EQ(ops_->ZeroAt(e.data(), idx.data(), idx.size(), nullptr), KernelStatus::kOk);
    for (uint64_t i = 0; i < d; ++i) ASSERT_EQ(Bits(e[i]), Bits(i % 3 == 0 ? 0.0f : acc[i]));
  }
}

TEST_P(CpuOpsTest, CopyAndZeroFloats) {
  std::vector<float> src = RandomValues(1003, 4), dst(1003, 7.0f);
  ASSERT_EQ(ops_->CopyFloats(dst.data(), src.data(), src.size(), nullptr), KernelStatus::kOk);
  for (size_t i = 0; i < src.size(); ++i) ASSERT_EQ(Bits(dst[i]), Bits(src[i])) << i;
  ASSERT_EQ(ops_->ZeroFloats(dst.data() + 1, 1000, nullptr), KernelStatus::kOk);
  EXPECT_EQ(Bits(dst[0]), Bits(src[0]));
  for (size_t i = 1; i < 1001; ++i) ASSERT_EQ(dst[i], 0.0f) << i;
  EXPECT_EQ(Bits(dst[1001]), Bits(src[1001]));
  EXPECT_EQ(ops_->CopyFloats(nullptr, src.data(), 1, nullptr), KernelStatus::kInvalidArgument);
  EXPECT_EQ(ops_->ZeroFloats(nullptr, 1, nullptr), KernelStatus::kInvalidArgument);
  EXPECT_EQ(ops_->ZeroFloats(nullptr, 0, nullptr), KernelStatus::kOk);
}

// The check of a peer's indices: those outside [begin, end) are counted.
TEST_P(CpuOpsTest, CountOutsideCountsIndicesOutsideTheRange) {
  const std::vector<uint32_t> idx = {0, 9, 10, 19, 20, 4294967295u, 15};
  StepScalars s{7, 7};
  ASSERT_EQ(ops_->CountOutside(idx.data(), idx.size(), 10, 20, &s, nullptr), KernelStatus::kOk);
  EXPECT_EQ(s.count, 4u);  // 0, 9, 20, 2^32 - 1
  EXPECT_EQ(s.nonfinite, 0u);
  ASSERT_EQ(ops_->CountOutside(idx.data(), 0, 10, 20, &s, nullptr), KernelStatus::kOk);
  EXPECT_EQ(s.count, 0u);
  EXPECT_EQ(ops_->CountOutside(nullptr, 3, 0, 1, &s, nullptr), KernelStatus::kInvalidArgument);
  EXPECT_EQ(ops_->CountOutside(idx.data(), 3, 0, 1, nullptr, nullptr),
            KernelStatus::kInvalidArgument);
}

TEST_P(CpuOpsTest, LocalSumDivideAndNonFinite) {
  for (uint64_t d : kSizes) {
    for (int L : {1, 2, 3, 5}) {
      std::vector<std::vector<float>> in;
      std::vector<const float*> ptr;
      for (int l = 0; l < L; ++l) in.push_back(RandomValues(d, 7 + l));
      for (auto& v : in) ptr.push_back(v.data());
      std::vector<float> out(d);
      StepScalars s{0, 99};
      ASSERT_EQ(ops_->LocalSum(ptr.data(), L, d, out.data(), &s, nullptr), KernelStatus::kOk);
      EXPECT_EQ(s.nonfinite, 0u);
      for (uint64_t i = 0; i < d; ++i) {
        float want = in[0][i];
        for (int l = 1; l < L; ++l) want += in[l][i];
        ASSERT_EQ(Bits(out[i]), Bits(want));
      }
      std::vector<float> div = out;
      ASSERT_EQ(ops_->Divide(div.data(), d, 7.0f, nullptr, nullptr), KernelStatus::kOk);
      for (uint64_t i = 0; i < d; ++i) ASSERT_EQ(Bits(div[i]), Bits(out[i] / 7.0f));
      // In place into the first input.
      ASSERT_EQ(ops_->LocalSum(ptr.data(), L, d, in[0].data(), nullptr, nullptr),
                KernelStatus::kOk);
      for (uint64_t i = 0; i < d; ++i) ASSERT_EQ(Bits(in[0][i]), Bits(out[i]));
    }
    if (d > 0) {
      std::vector<float> bad = RandomValues(d, 8);
      bad[d - 1] = std::numeric_limits<float>::infinity();
      StepScalars s;
      ASSERT_EQ(ops_->CountNonFinite(bad.data(), d, &s, nullptr), KernelStatus::kOk);
      EXPECT_EQ(s.nonfinite, 1u);
      // NaN (of either sign), +-Inf anywhere (vector body and tail) counted;
      // the largest finite values and denormals not.
      std::vector<float> mixed = RandomValues(d, 9);
      uint64_t planted = 0;
      const float kinds[] = {
          std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(),
          std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()};
      for (uint64_t i = 0; i < d; i += 13) {
        mixed[i] = kinds[(i / 13) % 4];
        ++planted;
      }
      for (uint64_t i = 5; i < d; i += 13) {
        mixed[i] = (i % 2 ? 1 : -1) * std::numeric_limits<float>::max();
      }
      for (uint64_t i = 7; i < d; i += 13) mixed[i] = std::numeric_limits<float>::denorm_min();
      ASSERT_EQ(ops_->CountNonFinite(mixed.data(), d, &s, nullptr), KernelStatus::kOk);
      EXPECT_EQ(s.nonfinite, planted) << "d = " << d;
      ASSERT_EQ(ops_->LocalSum(std::vector<const float*>{mixed.data()}.data(), 1, d, mixed.data(),
                               &s, nullptr),
                KernelStatus::kOk);
      EXPECT_EQ(s.nonfinite, planted) << "d = " << d;
    }
  }
}

TEST_P(CpuOpsTest, TopKIsExact) {
  for (uint64_t d : kSizes) {
    const std::vector<float> acc = RandomValues(d, 11);
    std::vector<uint32_t> order(d);  // by magnitude, ties to the lower index
    for (uint64_t i = 0; i < d; ++i) order[i] = uint32_t(i);
    std::stable_sort(order.begin(), order.end(),
                     [&](uint32_t a, uint32_t b) { return std::fabs(acc[a]) > std::fabs(acc[b]); });
    for (uint64_t k : {uint64_t{1}, uint64_t{5}, d / 100 + 1, d, d + 3}) {
      const uint64_t n = std::min(k, d);
      std::vector<uint32_t> want(order.begin(), order.begin() + n);
      std::sort(want.begin(), want.end());
      std::vector<uint32_t> idx(n + 1);
      std::vector<float> val(n + 1);
      StepScalars s;
      ASSERT_EQ(ops_->TopK(acc.data(), d, k, idx.data(), val.data(), &s, nullptr),
                KernelStatus::kOk);
      ASSERT_EQ(s.count, n);
      std::vector<uint32_t> got(idx.begin(), idx.begin() + n);
      std::sort(got.begin(), got.end());
      EXPECT_TRUE(got == want) << "d=" << d << " k=" << k << ": another set of indices";
      for (uint64_t j = 0; j < n; ++j) EXPECT_EQ(Bits(val[j]), Bits(acc[idx[j]]));
    }
  }
}

// Issue AA: the exact top-k is a radix select now. Magnitudes that tie in
// bulk (a few distinct values, both signs, signed zeros: the k-th
// value's bin holds most of the bucket) and magnitudes that share the
// histogram's bin but differ below it: the set is still the k largest,
// ties to the lower index.
TEST_P(CpuOpsTest, TopKBreaksTiesByTheLowerIndexWhateverTheBins) {
  const uint64_t d = 100003;
  std::vector<std::vector<float>> inputs(3, std::vector<float>(d));
  for (uint64_t i = 0; i < d; ++i) {
    const float few[] = {0.5f, -0.5f, 0.25f, 0.0f, -0.0f, 1.0f};
    inputs[0][i] = few[(i * 7919) % 6];
    // One histogram bin (1.0 to 1.0 + 2^-4): every value of it, apart
    // below the bin's bits; one value larger, some smaller.
    inputs[1][i] = 1.0f + std::ldexp(static_cast<float>((i * 2654435761u) % 4096), -16);
    if (i % 1000 == 0) inputs[1][i] = -3.0f;
    if (i % 7 == 0) inputs[1][i] = 0.125f;
    inputs[2][i] = 0.0f;
  }
  for (const std::vector<float>& acc : inputs) {
    std::vector<uint32_t> order(d);
    for (uint64_t i = 0; i < d; ++i) order[i] = uint32_t(i);
    std::stable_sort(order.begin(), order.end(),
                     [&](uint32_t a, uint32_t b) { return std::fabs(acc[a]) > std::fabs(acc[b]); });
    for (uint64_t k : {uint64_t{1}, uint64_t{50}, d / 3, d - 1}) {
      std::vector<uint32_t> want(order.begin(), order.begin() + k);
      std::sort(want.begin(), want.end());
      std::vector<uint32_t> idx(k);
      std::vector<float> val(k);
      StepScalars s;
      ASSERT_EQ(ops_->TopK(acc.data(), d, k, idx.data(), val.data(), &s, nullptr),
                KernelStatus::kOk);
      ASSERT_EQ(s.count, k);
      std::vector<uint32_t> got = idx;
      std::sort(got.begin(), got.end());
      EXPECT_TRUE(got == want) << "k=" << k << ": another set of indices";
      for (uint64_t j = 0; j < k; ++j) EXPECT_EQ(Bits(val[j]), Bits(acc[idx[j]]));
    }
  }
}

TEST_P(CpuOpsTest, SortUnique) {
  std::vector<uint32_t> v = {9, 3, 3, 0, 9, 7, 0, 4294967295u};
  StepScalars s;
  ASSERT_EQ(ops_->SortUnique(v.data(), v.size(), &s, nullptr), KernelStatus::kOk);
  ASSERT_EQ(s.count, 5u);
  EXPECT_EQ(std::vector<uint32_t>(v.begin(), v.begin() + 5),
            (std::vector<uint32_t>{0, 3, 7, 9, 4294967295u}));
  ASSERT_EQ(ops_->SortUnique(nullptr, 0, &s, nullptr), KernelStatus::kOk);
  EXPECT_EQ(s.count, 0u);
}

TEST_P(CpuOpsTest, AllocateIsAlignedAndZeroed) {
  for (size_t bytes : {size_t{0}, size_t{1}, size_t{4096}, size_t{1} << 20}) {
    auto* p = static_cast<unsigned char*>(ops_->Allocate(bytes));
    ASSERT_NE(p, nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);
    for (size_t i = 0; i < bytes; ++i) ASSERT_EQ(p[i], 0);
    ops_->Free(p);
  }
  ops_->Free(nullptr);
}

// --- bf16 / fp16 conversions -------------------------------------------------

// The reference of round to nearest, ties to even, from the definition: of
// the two neighbours of x in the format (found by truncating the bits), the
// nearer; on a tie the one with an even last bit. bf16 only (fp16's is the
// compiler's _Float16).
uint16_t RefBf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const uint16_t lo = static_cast<uint16_t>(u >> 16);  // toward zero
  const uint16_t hi = static_cast<uint16_t>(lo + 1);   // away from zero
  float flo, fhi;
  const uint32_t ulo = static_cast<uint32_t>(lo) << 16, uhi = static_cast<uint32_t>(hi) << 16;
  std::memcpy(&flo, &ulo, sizeof flo);
  std::memcpy(&fhi, &uhi, sizeof fhi);
  const double dlo = std::fabs(static_cast<double>(x) - flo);
  const double dhi = std::isinf(fhi) ? std::ldexp(1.0, 128) - std::fabs(static_cast<double>(x))
                                     : std::fabs(static_cast<double>(fhi) - x);
  if (dlo < dhi) return lo;
  if (dhi < dlo) return hi;
  return (lo & 1) == 0 ? lo : hi;
}

// Floats of every kind: random bits, gradient-like values, the specials,
// and the boundaries of both formats (ties, subnormals, overflow).
std::vector<float> ConversionInputs() {
  std::vector<float> v = RandomValues(100003, 21);
  std::mt19937 rng(22);
  for (int i = 0; i < 300000; ++i) {
    const uint32_t u = rng();
    float f;
    std::memcpy(&f, &u, sizeof f);
    v.push_back(f);
  }
  for (uint32_t hi = 0; hi < 0x10000; hi += 0x101) {  // bf16 ties both ways, +-0x8000 around them
    for (uint32_t lo : {0x7fffu, 0x8000u, 0x8001u, 0u}) {
      const uint32_t u = hi << 16 | lo;
      float f;
      std::memcpy(&f, &u, sizeof f);
      v.push_back(f);
    }
  }
  for (float f : {0.0f,
                  -0.0f,
                  1.0f,
                  -1.0f,
                  65504.0f,
                  65519.996f,
                  65520.0f,
                  -65520.0f,
                  65536.0f,
                  0x1p-14f,
                  0x1p-24f,
                  0x1p-25f,
                  0x1.8p-25f,
                  0x1.8p-24f,
                  0x1.4p-24f,
                  0x1p-26f,
                  0x1.ffcp-15f,
                  0x1.ffep-15f,
                  1.0f + 0x1p-11f,
                  1.0f + 0x3p-11f,
                  1e-45f,
                  3e38f,
                  std::numeric_limits<float>::max(),
                  std::numeric_limits<float>::infinity(),
                  -std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::quiet_NaN(),
                  -std::numeric_limits<float>::quiet_NaN(),
                  std::numeric_limits<float>::signaling_NaN()}) {
    v.push_back(f);
  }
  return v;
}

void ExpectSameHalf(uint16_t got, uint16_t want, bool nan, float x, bool f16) {
  const char* what = f16 ? "f16" : "bf16";
  if (nan) {  // a NaN stays a NaN of the same sign (payloads: the ISAs agree, below)
    ASSERT_EQ(got & 0x8000, want & 0x8000) << what << " of " << x;
    ASSERT_TRUE(f16 ? (got & 0x7c00) == 0x7c00 && (got & 0x3ff) != 0
                    : (got & 0x7f80) == 0x7f80 && (got & 0x7f) != 0)
        << what << " of NaN: " << got;
    return;
  }
  ASSERT_EQ(got, want) << what << " of " << x;
}

TEST_P(CpuOpsTest, HalfsRoundToNearestEven) {
  const std::vector<float> in = ConversionInputs();
  std::vector<uint16_t> bf(in.size()), f16(in.size());
  ASSERT_EQ(ops_->FloatToHalf(in.data(), ElementType::kBFloat16, in.size(), bf.data(), nullptr),
            KernelStatus::kOk);
  ASSERT_EQ(ops_->FloatToHalf(in.data(), ElementType::kFloat16, in.size(), f16.data(), nullptr),
            KernelStatus::kOk);
  for (size_t i = 0; i < in.size(); ++i) {
    const bool nan = std::isnan(in[i]);
    ExpectSameHalf(bf[i], nan ? (std::signbit(in[i]) ? 0xffc0 : 0x7fc0) : RefBf16(in[i]), nan,
                   in[i], /*f16=*/false);
    const _Float16 h = static_cast<_Float16>(in[i]);
    uint16_t want;
    std::memcpy(&want, &h, sizeof want);
    ExpectSameHalf(f16[i], want, nan, in[i], /*f16=*/true);
  }
}

TEST_P(CpuOpsTest, HalfsWidenExactlyAndRoundTrip) {
  std::vector<uint16_t> every(65536);
  for (uint32_t i = 0; i < 65536; ++i) every[i] = static_cast<uint16_t>(i);
  for (const ElementType t : {ElementType::kBFloat16, ElementType::kFloat16}) {
    SCOPED_TRACE(ElementTypeName(t));
    std::vector<float> wide(every.size());
    std::vector<uint16_t> back(every.size());
    ASSERT_EQ(ops_->HalfToFloat(every.data(), t, every.size(), wide.data(), nullptr),
              KernelStatus::kOk);
    ASSERT_EQ(ops_->FloatToHalf(wide.data(), t, wide.size(), back.data(), nullptr),
              KernelStatus::kOk);
    for (uint32_t i = 0; i < 65536; ++i) {
      const uint16_t h = static_cast<uint16_t>(i);
      float want;
      if (t == ElementType::kBFloat16) {
        const uint32_t u = i << 16;
        std::memcpy(&want, &u, sizeof want);
      } else {
        _Float16 x;
        std::memcpy(&x, &h, sizeof x);
        want = static_cast<float>(x);
      }
      if (std::isnan(want)) {
        ASSERT_TRUE(std::isnan(wide[i])) << i;
        ASSERT_EQ(std::signbit(wide[i]), std::signbit(want)) << i;
        continue;
      }
      ASSERT_EQ(Bits(wide[i]), Bits(want)) << "code " << i;
      ASSERT_EQ(back[i], h) << "code " << i;  // every value survives the round trip
    }
  }
}

// The vector path gives the scalar path's bits on every input, NaN payloads
// included, at every length (the tails run scalar).
TEST_P(CpuOpsTest, HalfConversionsMatchTheScalarPath) {
  auto scalar = CreateCpuSparseOps(CpuIsa::kScalar);
  std::vector<float> in = ConversionInputs();
  std::vector<uint16_t> codes(65536);
  for (uint32_t i = 0; i < 65536; ++i) codes[i] = static_cast<uint16_t>(i);
  for (const ElementType t : {ElementType::kBFloat16, ElementType::kFloat16}) {
    for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{15}, size_t{17}, in.size()}) {
      std::vector<uint16_t> a(n), b(n);
      ASSERT_EQ(ops_->FloatToHalf(in.data(), t, n, a.data(), nullptr), KernelStatus::kOk);
      ASSERT_EQ(scalar->FloatToHalf(in.data(), t, n, b.data(), nullptr), KernelStatus::kOk);
      ASSERT_EQ(a, b) << ElementTypeName(t) << " n " << n;
    }
    std::vector<float> a(codes.size()), b(codes.size());
    ASSERT_EQ(ops_->HalfToFloat(codes.data(), t, codes.size(), a.data(), nullptr),
              KernelStatus::kOk);
    ASSERT_EQ(scalar->HalfToFloat(codes.data(), t, codes.size(), b.data(), nullptr),
              KernelStatus::kOk);
    for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(Bits(a[i]), Bits(b[i])) << i;
  }
}

// Values sent as bf16/fp16: each rounded as FloatToHalf, and exactly what
// the rounding dropped left behind (acc after + widened value = acc before).
TEST_P(CpuOpsTest, GatherRoundedKeepsWhatRoundingDrops) {
  std::vector<float> before = RandomValues(100003, 31);
  for (float& x : before) x *= 3.0f;
  std::vector<uint32_t> index;
  for (uint32_t i = 5; i < before.size(); i += 7) index.push_back(i);
  for (const ElementType t : {ElementType::kBFloat16, ElementType::kFloat16}) {
    SCOPED_TRACE(ElementTypeName(t));
    std::vector<float> acc = before;
    std::vector<uint16_t> out(index.size()), want(index.size());
    ASSERT_EQ(ops_->GatherRounded(acc.data(), index.data(), index.size(), t, out.data(), nullptr),
              KernelStatus::kOk);
    std::vector<float> picked(index.size()), wide(index.size());
    for (size_t j = 0; j < index.size(); ++j) picked[j] = before[index[j]];
    ASSERT_EQ(ops_->FloatToHalf(picked.data(), t, picked.size(), want.data(), nullptr),
              KernelStatus::kOk);
    ASSERT_EQ(out, want);
    ASSERT_EQ(ops_->HalfToFloat(out.data(), t, out.size(), wide.data(), nullptr),
              KernelStatus::kOk);
    size_t j = 0;
    for (size_t i = 0; i < acc.size(); ++i) {
      if (j < index.size() && index[j] == i) {
        ASSERT_EQ(acc[i] + wide[j], before[i]) << i;  // the remainder, exactly
        ASSERT_LE(
            std::fabs(acc[i]),
            std::fabs(before[i]) * (t == ElementType::kBFloat16 ? 0x1p-8f : 0x1p-11f) + 0x1p-24f)
            << i;
        ++j;
      } else {
        ASSERT_EQ(Bits(acc[i]), Bits(before[i])) << "untouched at " << i;
      }
    }
  }
}

TEST_P(CpuOpsTest, HalfConversionsRefuseBadArguments) {
  float f = 1.0f;
  uint16_t h = 0;
  EXPECT_EQ(ops_->FloatToHalf(&f, ElementType::kFloat32, 1, &h, nullptr),
            KernelStatus::kInvalidArgument);
  EXPECT_EQ(ops_->HalfToFloat(&h, static_cast<ElementType>(9), 1, &f, nullptr),
            KernelStatus::kInvalidArgument);
  EXPECT_EQ(ops_->FloatToHalf(nullptr, ElementType::kBFloat16, 1, &h, nullptr),
            KernelStatus::kInvalidArgument);
  EXPECT_EQ(ops_->HalfToFloat(&h, ElementType::kFloat16, 1, nullptr, nullptr),
            KernelStatus::kInvalidArgument);
  EXPECT_EQ(ops_->HalfToFloat(nullptr, ElementType::kFloat16, 0, nullptr, nullptr),
            KernelStatus::kOk);
}

INSTANTIATE_TEST_SUITE_P(Isa, CpuOpsTest, ::testing::Values(CpuIsa::kScalar, CpuIsa::kAvx2),
                         [](const auto& info) {
                           return info.param == CpuIsa::kScalar ? std::string("Scalar")
                                                                : std::string("Avx2");
                         });

}  // namespace
}  // namespace microd::kernels
