// SPDX-License-Identifier: Apache-2.0
// InProcessControlPlane: the engine's view of the control plane over a
// Coordinator in this process, with no gRPC server or sockets.
#include "daemon/control/control_plane.h"

#include <future>
#include <memory>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "daemon/control/coordinator.h"
#include "gtest/gtest.h"

namespace microd::control {
namespace {

struct Job {
  explicit Job(int nodes) {
    CoordinatorOptions o;
    o.expected_nodes = nodes;
    coordinator = std::move(Coordinator::Create(o)).value();
    std::vector<std::future<absl::StatusOr<InProcessControlPlane>>> joins;
    for (int r = 0; r < nodes; ++r) {
      joins.push_back(std::async(std::launch::async, [this, r] {
        return InProcessControlPlane::Join(coordinator.get(), "microd", "node" + std::to_string(r),
                                           1, absl::Now() + absl::Seconds(10));
      }));
    }
    for (auto& j : joins) {
      auto plane = j.get();
      EXPECT_TRUE(plane.ok()) << plane.status();
      planes.push_back(std::make_unique<InProcessControlPlane>(*std::move(plane)));
    }
  }
  std::unique_ptr<Coordinator> coordinator;
  std::vector<std::unique_ptr<InProcessControlPlane>> planes;
};

TEST(InProcessControlPlane, ABucketReadyOnEveryNodeIsScheduledForAll) {
  Job job(2);
  ASSERT_EQ(job.planes.size(), 2u);
  const BucketInfo b{"grads.0", /*dtype=DATA_TYPE_FLOAT32*/ 1, 1000, false};
  const absl::Status reported = job.planes[0]->Report({b});
  ASSERT_TRUE(reported.ok()) << reported;
  // Ready on one node only: nothing scheduled yet.
  auto none = job.planes[0]->Poll(0, absl::Now() + absl::Milliseconds(50));
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_TRUE(none->empty());
  ASSERT_TRUE(job.planes[1]->Report({b}).ok());
  for (auto& plane : job.planes) {
    auto batches = plane->Poll(0, absl::Now() + absl::Seconds(5));
    ASSERT_TRUE(batches.ok()) << batches.status();
    ASSERT_EQ(batches->size(), 1u);
    ASSERT_EQ((*batches)[0].scheduled.size(), 1u);
    EXPECT_EQ((*batches)[0].scheduled[0].name, "grads.0");
    EXPECT_EQ((*batches)[0].scheduled[0].count, 1000);
  }
}

TEST(InProcessControlPlane, AFailureReportedByOneNodeReachesTheOthers) {
  Job job(3);
  ASSERT_EQ(job.planes.size(), 3u);
  EXPECT_TRUE(job.planes[2]->RefreshJobStatus().ok());
  ASSERT_TRUE(job.planes[1]->ReportFailure("bucket 'b' step 7: NaN in the gradient").ok());
  const absl::Status s = job.planes[2]->RefreshJobStatus();
  EXPECT_TRUE(absl::IsAborted(s)) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "NaN in the gradient")) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "node1")) << s;  // who reported it
  // A poll fails at once rather than waiting for its deadline.
  const absl::Time start = absl::Now();
  EXPECT_FALSE(job.planes[0]->Poll(0, absl::Now() + absl::Seconds(30)).ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

}  // namespace
}  // namespace microd::control
