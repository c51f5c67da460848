// SPDX-License-Identifier: Apache-2.0
// What the engine needs from the control plane, and nothing of how it is
// carried: report buckets ready, read the schedule, say the job failed here
// and ask whether it failed elsewhere. The gRPC client (CoordinatorClient)
// implements it for the daemon; InProcessControlPlane implements it over a
// Coordinator in the same process, for tests without a server or sockets.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/control/types.h"

namespace microd::control {

class Coordinator;

class ControlPlane {
 public:
  virtual ~ControlPlane() = default;
  // This node's newly ready buckets (returns at once).
  virtual absl::Status Report(const std::vector<BucketInfo>& ready) = 0;
  // Schedule batches from index `next` on; an empty list when `deadline`
  // passed without news.
  virtual absl::StatusOr<std::vector<ScheduleBatch>> Poll(uint64_t next, absl::Time deadline) = 0;
  // Tells the coordinator the job failed here (best effort).
  virtual absl::Status ReportFailure(const std::string& reason) = 0;
  // Tells it a collective failed here, which in an elastic job may be a
  // lost peer: the coordinator's watchdog decides (the job fails, or the
  // next membership epoch forms).
  virtual absl::Status ReportDataPlaneFailure(const std::string& reason) {
    return ReportFailure(reason);
  }
  // Tells it a sealed transfer failed verification here, which fails the
  // step on every node (--seal_failure=step): the coordinator forms the
  // next epoch of the same members at once (fresh keys and connections).
  virtual absl::Status ReportRefusedTransfer(const std::string& reason) {
    return ReportFailure(reason);
  }
  // Called when this node learns that the job's membership changed (the
  // node's membership in the new epoch, and the cause). Elastic jobs only.
  using MembershipCallback = std::function<void(const Membership&, const std::string& change)>;
  virtual void SetMembershipCallback(MembershipCallback callback) { (void)callback; }
  // OK while the job runs, else why it failed or ended, as of now (after a
  // local error this finds the root cause another node reported).
  virtual absl::Status RefreshJobStatus() = 0;
  // The coordinator's reports of buckets stalled or waiting (the stall
  // inspector's), as this node last heard them; each begins "bucket 'NAME' ".
  virtual std::vector<std::string> Reports() const { return {}; }
};

// One node's control plane over a Coordinator in this process (tests): the
// calls go straight to it, as CoordinatorService would pass them on.
class InProcessControlPlane final : public ControlPlane {
 public:
  InProcessControlPlane(Coordinator* coordinator, Membership membership);
  // Joins `coordinator` as node `name` (waiting for the others until
  // `deadline`); the membership is the coordinator's answer.
  static absl::StatusOr<InProcessControlPlane> Join(Coordinator* coordinator,
                                                    const std::string& job_id,
                                                    const std::string& name, int local_size,
                                                    absl::Time deadline);

  absl::Status Report(const std::vector<BucketInfo>& ready) override;
  absl::StatusOr<std::vector<ScheduleBatch>> Poll(uint64_t next, absl::Time deadline) override;
  absl::Status ReportFailure(const std::string& reason) override;
  absl::Status RefreshJobStatus() override;
  const Membership& membership() const { return membership_; }

 private:
  Coordinator* coordinator_;
  Membership membership_;
  uint64_t seq_ = 0;
};

}  // namespace microd::control
