// SPDX-License-Identifier: Apache-2.0
// An elastic job's recovery on one node (recovery.h), alone: no engine, no
// socket. What a user relies on: a lost node's failed step is held, not
// failed, until the next epoch, then handed back to be answered
// MICROD_ERR_MEMBERSHIP; a join cuts nothing in flight; a change during a
// change takes the newest epoch and never one twice; a refused sealed
// transfer fails the job unless --seal_failure=step; no verdict in time,
// or the job's end, gives every held step back to be answered.
#include "daemon/engine/recovery.h"

#include <memory>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace microd::engine {
namespace {

Work AWork() {
  Work w;
  w.answer = std::make_shared<Answer>(std::vector<uint64_t>{1}, std::vector<uint64_t>{7},
                                      std::vector<uint32_t>{0});
  return w;
}

control::Membership Epoch(uint64_t epoch, bool graceful = false) {
  control::Membership m;
  m.epoch = epoch;
  m.graceful = graceful;
  return m;
}

const absl::Status kLost = absl::UnavailableError("connection reset by peer");

TEST(Recovery, ALossHoldsTheStepUntilTheNextEpochRuns) {
  Recovery r(absl::Seconds(30), /*elastic=*/true, /*seal_failure_step=*/false);
  ASSERT_TRUE(r.Holdable(kLost));
  const Work w = AWork();
  EXPECT_TRUE(r.Hold({w}, kLost));         // the first sign enters recovery
  EXPECT_FALSE(r.Hold({AWork()}, kLost));  // the next ones only add their works
  EXPECT_TRUE(r.recovering());
  EXPECT_TRUE(r.Offer(Epoch(1), "node 2 lost", /*current=*/0));  // abort what runs
  const Recovery::Verdict v = r.Await();
  ASSERT_FALSE(v.ended);
  ASSERT_TRUE(v.next.has_value());
  EXPECT_EQ(v.next->first.epoch, 1u);
  EXPECT_EQ(v.next->second, "node 2 lost");
  EXPECT_EQ(v.cause, kLost);
  const std::vector<Work> held = r.Done();
  ASSERT_EQ(held.size(), 2u);
  EXPECT_EQ(held[0].answer, w.answer);
  EXPECT_FALSE(r.recovering());
  EXPECT_GE(r.last_seconds(), 0.0);
}

TEST(Recovery, AJoinCutsNothingInFlightAndBeginsAfterTheMarkersPlan) {
  Recovery r(absl::Seconds(30), true, false);
  EXPECT_FALSE(r.Offer(Epoch(1, /*graceful=*/true), "node 4 joined", 0));
  EXPECT_FALSE(r.recovering());  // the old epoch's batches run to its marker
  EXPECT_FALSE(r.StartIfDue());  // no marker ran yet
  r.ChangeDue();                 // the marker's batch ran
  EXPECT_TRUE(r.StartIfDue());   // its plan ended
  EXPECT_FALSE(r.StartIfDue());  // once
  const Recovery::Verdict v = r.Await();
  ASSERT_TRUE(v.next.has_value());
  EXPECT_EQ(v.next->first.epoch, 1u);
  EXPECT_TRUE(r.Done().empty());
}

TEST(Recovery, AChangeDuringAChangeTakesTheNewestEpochAndNoneTwice) {
  Recovery r(absl::Seconds(30), true, false);
  EXPECT_TRUE(r.Hold({AWork()}, kLost));
  EXPECT_TRUE(r.Offer(Epoch(1), "node 2 lost", 0));
  // Epoch 1's data plane did not connect: node 3 was lost meanwhile.
  Recovery::Verdict v = r.Await();
  ASSERT_TRUE(v.next.has_value());
  EXPECT_TRUE(r.Offer(Epoch(2), "node 3 lost", 0));
  EXPECT_FALSE(r.Offer(Epoch(2), "node 3 lost", 0));  // delivered again: nothing
  EXPECT_FALSE(r.Offer(Epoch(1), "node 2 lost", 0));  // older: nothing
  v = r.Await(/*after=*/1);
  ASSERT_TRUE(v.next.has_value());
  EXPECT_EQ(v.next->first.epoch, 2u);
  EXPECT_EQ(r.Done().size(), 1u);
  // An epoch this node runs already is no change either.
  EXPECT_FALSE(r.Offer(Epoch(2), "again", /*current=*/2));
  EXPECT_FALSE(r.recovering());
}

TEST(Recovery, ARefusedTransferFailsTheJobUnlessSealFailureStep) {
  const absl::Status refused = absl::DataLossError("link 0-1: a record failed verification");
  const absl::Status not_the_jobs = absl::InvalidArgumentError("bucket 'w' differs");
  EXPECT_FALSE(Recovery(absl::Seconds(1), true, false).Holdable(refused));
  EXPECT_TRUE(Recovery(absl::Seconds(1), true, true).Holdable(refused));
  EXPECT_FALSE(Recovery(absl::Seconds(1), true, true).Holdable(not_the_jobs));
  EXPECT_FALSE(Recovery(absl::Seconds(1), /*elastic=*/false, true).Holdable(kLost));
}

TEST(Recovery, NoVerdictInTimeGivesTheCauseAndEveryHeldStepBack) {
  Recovery r(absl::Milliseconds(50), true, false);
  EXPECT_TRUE(r.Hold({AWork(), AWork()}, kLost));
  const absl::Time start = absl::Now();
  const Recovery::Verdict v = r.Await();
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(40));
  EXPECT_FALSE(v.ended);
  EXPECT_FALSE(v.next.has_value());
  EXPECT_EQ(v.cause, kLost);
  EXPECT_EQ(r.End().size(), 2u);  // the engine fails the job, answering them
}

TEST(Recovery, TheJobsEndWakesTheWaitAndRecoversNothingAfter) {
  Recovery r(absl::Seconds(30), true, false);
  const Work w = AWork();
  EXPECT_TRUE(r.Hold({w}, kLost));
  std::vector<Work> given_back;
  std::thread failer([&] {
    absl::SleepFor(absl::Milliseconds(20));
    given_back = r.End();
  });
  const absl::Time start = absl::Now();
  const Recovery::Verdict v = r.Await();
  failer.join();
  EXPECT_TRUE(v.ended);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  ASSERT_EQ(given_back.size(), 1u);
  EXPECT_EQ(given_back[0].answer, w.answer);
  EXPECT_FALSE(r.recovering());
  EXPECT_FALSE(r.Offer(Epoch(1), "late", 0));
  r.ChangeDue();
  EXPECT_FALSE(r.StartIfDue());
}

TEST(Recovery, AStepRolledForwardIsNoLongerHeld) {
  Recovery r(absl::Seconds(30), true, true);
  const Work a = AWork(), b = AWork();
  r.Hold({a, b}, absl::DataLossError("confirm refused"));
  r.Release({a});  // another node committed it: answered with its results
  const std::vector<Work> held = r.End();
  ASSERT_EQ(held.size(), 1u);
  EXPECT_EQ(held[0].answer, b.answer);
}

}  // namespace
}  // namespace microd::engine
