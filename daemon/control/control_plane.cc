// SPDX-License-Identifier: Apache-2.0
#include "daemon/control/control_plane.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "daemon/control/coordinator.h"

namespace microd::control {

InProcessControlPlane::InProcessControlPlane(Coordinator* coordinator, Membership membership)
    : coordinator_(coordinator), membership_(std::move(membership)) {}

absl::StatusOr<InProcessControlPlane> InProcessControlPlane::Join(Coordinator* coordinator,
                                                                  const std::string& job_id,
                                                                  const std::string& name,
                                                                  int local_size,
                                                                  absl::Time deadline) {
  absl::StatusOr<Membership> m =
      coordinator->Join(job_id, name, local_size, /*token=*/"", /*requested_rank=*/-1, deadline);
  if (!m.ok()) return m.status();
  return InProcessControlPlane(coordinator, *std::move(m));
}

absl::Status InProcessControlPlane::Report(const std::vector<BucketInfo>& ready) {
  return coordinator_->Report(membership_.session, membership_.node_rank, ready, ++seq_);
}

absl::StatusOr<std::vector<ScheduleBatch>> InProcessControlPlane::Poll(uint64_t next,
                                                                       absl::Time deadline) {
  auto batches = coordinator_->Poll(membership_.session, membership_.node_rank, next, deadline);
  // The marker of a change: this node's membership in the next epoch.
  if (batches.ok() && !batches->empty() && batches->back().membership.has_value()) {
    membership_ = *batches->back().membership;
  }
  return batches;
}

absl::Status InProcessControlPlane::ReportFailure(const std::string& reason) {
  return coordinator_->ReportFailure(membership_.session, membership_.node_rank, reason);
}

absl::Status InProcessControlPlane::RefreshJobStatus() {
  // As the gRPC client reads a heartbeat's answer.
  absl::StatusOr<HeartbeatAnswer> a =
      coordinator_->Heartbeat(membership_.session, membership_.node_rank);
  if (!a.ok()) return absl::AbortedError(absl::StrCat("job failed: ", a.status().message()));
  if (a->state == JobState::kFailed)
    return absl::AbortedError(absl::StrCat("job failed: ", a->failure));
  if (a->state == JobState::kFinished) {
    return absl::FailedPreconditionError(absl::StrCat("job finished: ", a->failure));
  }
  return absl::OkStatus();
}

}  // namespace microd::control
