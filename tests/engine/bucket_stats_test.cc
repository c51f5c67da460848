// SPDX-License-Identifier: Apache-2.0
// A bucket's statistics, written in one place for each kind of step.
#include "daemon/engine/engine.h"
#include "gtest/gtest.h"

namespace microd::engine {
namespace {

TEST(BucketStats, DenseStepsCountEveryElementBothWays) {
  BucketStats s;
  s.count = 1000;
  s.AddDense(0.5, 1.0, 0.25);
  s.AddDense(0.5, 1.0, 0.25);
  EXPECT_EQ(s.steps, 2u);
  EXPECT_EQ(s.budget, 1000u);
  EXPECT_EQ(s.last_selected, 1000u);
  EXPECT_EQ(s.bytes_sent, 8000u);
  EXPECT_EQ(s.bytes_received, 8000u);
  EXPECT_DOUBLE_EQ(s.local_sum_seconds, 1.0);
  EXPECT_DOUBLE_EQ(s.exchange_seconds, 2.0);
  EXPECT_DOUBLE_EQ(s.writeback_seconds, 0.5);
  EXPECT_TRUE(s.history.empty());
}

TEST(BucketStats, SparseStepsKeepTheirHistoryWithinItsLimit) {
  BucketStats s;
  s.count = 100000;
  for (uint64_t t = 0; t < 5; ++t) {
    sparsify::StepStats st;
    st.step = t;
    st.selected = 990 + t;
    st.budget = 1000;
    st.threshold = 0.1 * t;
    st.cre = 0.01 * t;
    st.bytes_sent = 4000;
    st.bytes_received = 12000;
    st.select_seconds = 0.1;
    st.exchange_seconds = 0.2;
    st.apply_seconds = 0.05;
    s.AddSparse(st, 0.3, 0.01, /*history_limit=*/3);
  }
  EXPECT_EQ(s.steps, 5u);
  EXPECT_EQ(s.last_selected, 994u);
  EXPECT_DOUBLE_EQ(s.last_cre, 0.04);
  EXPECT_DOUBLE_EQ(s.sum_cre, 0.02 + 0.03 + 0.04);  // steps >= 2 only
  EXPECT_EQ(s.bytes_sent, 20000u);
  EXPECT_EQ(s.bytes_received, 60000u);
  EXPECT_DOUBLE_EQ(s.writeback_seconds, 5 * 0.06);
  ASSERT_EQ(s.history.size(), 3u);
  EXPECT_EQ(s.history.front().step, 2u);
  EXPECT_EQ(s.history.back().step, 4u);
}

TEST(BucketStats, HistogramsCountEveryStepByPhaseAndCreFromStepTwo) {
  Histogram h(&SecondsBounds());
  h.Observe(0.0);     // at the lowest bound
  h.Observe(0.003);   // above 2.5e-3, at or below 5e-3
  h.Observe(1000.0);  // above every bound: counted in +Inf only
  EXPECT_EQ(h.count, 3u);
  EXPECT_DOUBLE_EQ(h.sum, 1000.003);
  EXPECT_EQ(h.counts[0], 1u);
  EXPECT_EQ(h.counts[5], 1u);  // 5e-3
  uint64_t listed = 0;
  for (uint64_t c : h.counts) listed += c;
  EXPECT_EQ(listed, 2u);

  BucketStats s;
  s.count = 100000;
  for (uint64_t t = 0; t < 4; ++t) {
    sparsify::StepStats st;
    st.step = t;
    st.cre = 0.002;
    st.select_seconds = 0.001;
    s.AddSparse(st, 0.01, 0.02, 0);
    s.AddWaiting(0.5);
  }
  for (int p = 0; p < kPhases; ++p) EXPECT_EQ(s.phase_seconds[p].count, 4u) << PhaseName(Phase(p));
  EXPECT_DOUBLE_EQ(s.phase_seconds[int(Phase::kWaiting)].sum, s.negotiate_seconds);
  EXPECT_DOUBLE_EQ(s.phase_seconds[int(Phase::kLocalSum)].sum, s.local_sum_seconds);
  EXPECT_EQ(s.cre_histogram.count, 2u);  // steps 2 and 3
}

}  // namespace
}  // namespace microd::engine
