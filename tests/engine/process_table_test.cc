// SPDX-License-Identifier: Apache-2.0
// The engine's process table without a transport or a coordinator: local
// ranks, registration, submissions and readiness, the response cache's ids,
// disconnects, stalls, and a Work's life cycle (answered once).
#include "daemon/engine/process_table.h"

#include <memory>
#include <vector>

#include "absl/strings/match.h"
#include "daemon/common/status_map.h"
#include "gtest/gtest.h"

namespace microd::engine {
namespace {

class ProcessTableTest : public ::testing::Test {
 protected:
  std::shared_ptr<local::ProcessBuffer> Buffer(uint64_t count) {
    storage_.push_back(std::make_unique<std::vector<float>>(count));
    return std::make_shared<local::ProcessBuffer>(storage_.back()->data(), count, 0);
  }
  ProcessTable table_{/*local_size=*/2, /*dense_floor=*/100};
  std::vector<std::unique_ptr<std::vector<float>>> storage_;
};

TEST_F(ProcessTableTest, LocalRanksAreTheRequestedOrTheLowestFree) {
  EXPECT_EQ(*table_.Hello(1, 1, 100), 1);
  EXPECT_EQ(*table_.Hello(2, -1, 101), 0);
  auto third = table_.Hello(3, -1, 102);
  ASSERT_FALSE(third.ok());
  EXPECT_EQ(ToClientStatus(third.status()), ClientStatus::kResource);
  EXPECT_EQ(table_.Hello(4, 1, 103).status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(table_.Hello(5, 2, 104).status().code(), absl::StatusCode::kInvalidArgument);
}

// The daemon's own state per bucket is counted against its budget at
// registration (before: only the buffers, 4 bytes an element, against a
// 1 TiB default, while the state is 3-6x that).
TEST_F(ProcessTableTest, ABucketWhoseStatePassesTheBudgetIsRefusedWithTheNumbers) {
  table_.SetStateBudget({14000, "a test's budget",
                         [](uint64_t count, bool dense) { return (dense ? 4 : 12) * count; }});
  ASSERT_TRUE(table_.Hello(1, 0, 100).ok());
  ASSERT_TRUE(table_.Hello(2, 1, 101).ok());
  std::vector<Work> refused;
  ASSERT_TRUE(table_.Register(1, 1, "a", false, Buffer(1000), &refused).ok());  // 12000
  ASSERT_TRUE(table_.Register(2, 1, "a", false, Buffer(1000), &refused).ok());  // the same bucket
  // 2 local processes add nothing: summed in place, the update written over
  // the first one's buffer (before: an update buffer, 4000 more).
  EXPECT_EQ(table_.state_bytes(), 12000u);
  const absl::Status over = table_.Register(1, 2, "b", false, Buffer(200), &refused);
  EXPECT_EQ(ToClientStatus(over), ClientStatus::kResource) << over;
  EXPECT_TRUE(absl::StrContains(over.message(),
                                "would take 14400 bytes (2400 for this bucket, 12000 for the 1 "
                                "before it), over its budget of 14000 bytes (a test's budget"))
      << over;
  EXPECT_EQ(table_.find("b"), nullptr);  // nothing registered
  EXPECT_EQ(table_.state_bytes(), 12000u);
}

TEST_F(ProcessTableTest, ABucketIsReadyWhenEveryLocalProcessSubmittedIt) {
  ASSERT_TRUE(table_.Hello(1, 0, 100).ok());
  ASSERT_TRUE(table_.Hello(2, 1, 101).ok());
  std::vector<Work> refused;
  ASSERT_TRUE(table_.Register(1, 7, "w", false, Buffer(1000), &refused).ok());
  ASSERT_TRUE(table_.Register(2, 9, "w", false, Buffer(1000), &refused).ok());
  EXPECT_FALSE(table_.bucket("w").dense);
  EXPECT_EQ(*table_.Submit(1, 7, 55), ProcessTable::Ready::kNo);
  EXPECT_EQ(table_.Submit(1, 7, 56).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(table_.Submit(2, 8, 57).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(*table_.Submit(2, 9, 66), ProcessTable::Ready::kNew);
  auto ready = table_.TakeNewlyReady();
  ASSERT_EQ(ready.size(), 1u);
  EXPECT_EQ(ready[0].name, "w");
  EXPECT_EQ(ready[0].count, 1000);
  EXPECT_FALSE(table_.has_newly_ready());

  // Scheduled: the Work owns both submissions; the bucket takes new ones.
  Work w = table_.Take(table_.bucket("w"));
  EXPECT_FALSE(w.missing_buffer());
  std::vector<std::pair<uint64_t, uint64_t>> answered;  // (client, ticket)
  auto record = [&](uint64_t c, uint64_t t, uint32_t, const absl::Status&) {
    answered.push_back({c, t});
  };
  w.Finish(absl::OkStatus(), record);
  w.Finish(absl::AbortedError("the job failed later"), record);  // nothing: answered once
  EXPECT_EQ(answered, (std::vector<std::pair<uint64_t, uint64_t>>{{1, 55}, {2, 66}}));
  EXPECT_EQ(*table_.Submit(1, 7, 58), ProcessTable::Ready::kNo);
}

TEST_F(ProcessTableTest, SmallOrDenseRequestedBucketsGoDense) {
  ASSERT_TRUE(table_.Hello(1, 0, 100).ok());
  std::vector<Work> refused;
  ASSERT_TRUE(table_.Register(1, 1, "small", false, Buffer(99), &refused).ok());
  ASSERT_TRUE(table_.Register(1, 2, "asked", true, Buffer(1000), &refused).ok());
  EXPECT_TRUE(table_.bucket("small").dense);
  EXPECT_FALSE(table_.bucket("small").requested_dense);
  EXPECT_TRUE(table_.bucket("asked").dense);
  EXPECT_TRUE(ProcessTable::InfoOf(table_.bucket("asked")).dense);
}

TEST_F(ProcessTableTest, ProcessesThatDisagreeOnABucketPoisonItAndItsPendingSubmissions) {
  ASSERT_TRUE(table_.Hello(1, 0, 100).ok());
  ASSERT_TRUE(table_.Hello(2, 1, 101).ok());
  std::vector<Work> refused;
  ASSERT_TRUE(table_.Register(1, 1, "w", false, Buffer(1000), &refused).ok());
  ASSERT_TRUE(table_.Submit(1, 1, 5).ok());
  const absl::Status s = table_.Register(2, 1, "w", false, Buffer(999), &refused);
  EXPECT_EQ(ToClientStatus(s), ClientStatus::kMismatch);
  EXPECT_TRUE(absl::StrContains(s.message(), "999 elements on local rank 1 but 1000")) << s;
  ASSERT_EQ(refused.size(), 1u);  // local rank 0's submission, to be answered with `s`
  EXPECT_EQ(table_.Submit(1, 1, 6).status(), s);
}

TEST_F(ProcessTableTest, CachedBucketsGetIdsInScheduleOrderAndReadyBits) {
  ProcessTable one(1, 100);
  ASSERT_TRUE(one.Hello(1, 0, 100).ok());
  std::vector<Work> refused;
  ASSERT_TRUE(one.Register(1, 1, "a", false, Buffer(1000), &refused).ok());
  ASSERT_TRUE(one.Register(1, 2, "b", false, Buffer(1000), &refused).ok());
  one.Cache(one.bucket("b"));
  one.Cache(one.bucket("a"));
  one.Cache(one.bucket("b"));  // once only
  ASSERT_EQ(one.cached_count(), 2u);
  EXPECT_EQ(one.cached(0).name, "b");
  EXPECT_EQ(one.bucket("a").cache_id, 1);
  EXPECT_FALSE(one.any_cached_ready());
  EXPECT_EQ(*one.Submit(1, 1, 9), ProcessTable::Ready::kCached);
  EXPECT_TRUE(one.cached_ready(1));
  EXPECT_FALSE(one.has_newly_ready());  // negotiated in a cycle, not reported
  (void)one.Take(one.bucket("a"));
  EXPECT_FALSE(one.any_cached_ready());
}

TEST_F(ProcessTableTest, ADisconnectWithWorkPendingNamesTheProcess) {
  ASSERT_TRUE(table_.Hello(1, 0, 4242).ok());
  ASSERT_TRUE(table_.Hello(2, 1, 4343).ok());
  std::vector<Work> refused;
  ASSERT_TRUE(table_.Register(1, 1, "w", false, Buffer(1000), &refused).ok());
  ASSERT_TRUE(table_.Register(2, 1, "w", false, Buffer(1000), &refused).ok());
  // Local rank 1 submitted, rank 0 not yet: a stall of rank 0.
  ASSERT_TRUE(table_.Submit(2, 1, 3).ok());
  auto waits = table_.Waiting(absl::Now() + absl::Seconds(10), absl::Seconds(5), 64);
  ASSERT_EQ(waits.size(), 1u);
  EXPECT_EQ(waits[0].name, "w");
  EXPECT_EQ(waits[0].missing, (std::vector<std::pair<int, int>>{{0, 4242}}));
  EXPECT_TRUE(table_.Waiting(absl::Now(), absl::Seconds(5), 64).empty());
  // Rank 0 leaves cleanly, but rank 1's submission waits on it: the job ends.
  const std::string why = table_.Disconnect(1, /*clean=*/true, "goodbye", /*node_rank=*/3);
  EXPECT_EQ(why, "local process 0 (pid 4242) on node 3 disconnected with work pending: goodbye");
  auto pending = table_.TakeAllSubmitted();
  ASSERT_EQ(pending.size(), 1u);
  EXPECT_TRUE(pending[0].missing_buffer());
  // A process that registered nothing leaves quietly.
  ProcessTable idle(1, 100);
  ASSERT_TRUE(idle.Hello(9, 0, 1).ok());
  EXPECT_EQ(idle.Disconnect(9, /*clean=*/false, "reset", 0), "");
}

}  // namespace
}  // namespace microd::engine
