// SPDX-License-Identifier: Apache-2.0
// The answer owed to a step's submissions: given once, whoever calls Finish
// and however often (the step's end racing a failure of the job).
#include "daemon/engine/answer.h"

#include <atomic>
#include <mutex>
#include <thread>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"

namespace microd::engine {
namespace {

using Completion = std::tuple<uint64_t, uint64_t, uint32_t, absl::StatusCode>;

TEST(Answer, FinishAnswersEverySubmissionOnceAndSkipsRanksThatDidNotSubmit) {
  // Local rank 1 did not submit (ticket 0).
  Answer a({11, 12, 13}, {101, 0, 103}, {1, 2, 3});
  std::vector<Completion> got;
  auto record = [&](uint64_t c, uint64_t t, uint32_t b, const absl::Status& s) {
    got.emplace_back(c, t, b, s.code());
  };
  EXPECT_FALSE(a.finished());
  EXPECT_TRUE(a.Finish(absl::OkStatus(), record));
  EXPECT_TRUE(a.finished());
  EXPECT_FALSE(a.Finish(absl::AbortedError("job failed"), record));
  EXPECT_EQ(got, (std::vector<Completion>{{11, 101, 1, absl::StatusCode::kOk},
                                          {13, 103, 3, absl::StatusCode::kOk}}));
}

TEST(Answer, ConcurrentFinishesAnswerOnce) {
  for (int round = 0; round < 200; ++round) {
    Answer a({1, 2}, {7, 8}, {0, 0});
    std::mutex mu;
    std::vector<Completion> got;
    std::atomic<int> winners{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&, t] {
        const absl::Status s = t == 0 ? absl::OkStatus() : absl::AbortedError("failed");
        if (a.Finish(s, [&](uint64_t c, uint64_t k, uint32_t b, const absl::Status& st) {
              std::lock_guard<std::mutex> lock(mu);
              got.emplace_back(c, k, b, st.code());
            })) {
          ++winners;
        }
      });
    }
    for (auto& th : threads) th.join();
    ASSERT_EQ(winners.load(), 1);
    ASSERT_EQ(got.size(), 2u);  // both submissions, from the one winner
    EXPECT_EQ(std::get<3>(got[0]), std::get<3>(got[1]));
  }
}

}  // namespace
}  // namespace microd::engine
