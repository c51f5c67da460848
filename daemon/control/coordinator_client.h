// SPDX-License-Identifier: Apache-2.0
// A node's side of the control plane: joins the job, keeps the coordinator
// informed that it is alive (and learns when the job failed), serves the
// data plane's rendezvous as a KeyValueStore and reads the schedule log.
// Every call has a deadline; once the job failed every call fails at once.
// The coordinator may be out of reach for up to the peer timeout (a pause,
// a lost answer) without harm: polls and reports are retried until the
// peer timeout since the last call it answered, then fail naming both ends.
#pragma once

#include <grpcpp/grpcpp.h>

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "daemon/control/control_plane.h"
#include "daemon/control/coordinator.h"
#include "daemon/control/tls.h"
#include "daemon/rendezvous/kv_store.h"
#include "microd/v1/coordinator.grpc.pb.h"

namespace microd::control {

struct CoordinatorClientOptions {
  std::string address;  // host:port of the coordinator
  std::string job_id = "microd";
  std::string node_name;
  // JobToken::JoinProof for this job and node ("": the job has no token).
  std::string token_proof;
  // The options every node must share ("--flag=value" lines), which the
  // coordinator checks when this node joins a running elastic job.
  std::string options;
  int local_size = 1;
  int requested_rank = -1;
  absl::Duration call_timeout = absl::Seconds(30);  // calls that do not wait
  absl::Duration peer_timeout = absl::Seconds(10);
  absl::Duration heartbeat_interval = absl::ZeroDuration();  // zero: peer_timeout / 10
  TlsFiles tls;                                              // none: plaintext
};

class CoordinatorClient final : public rendezvous::KeyValueStore, public ControlPlane {
 public:
  static absl::StatusOr<std::unique_ptr<CoordinatorClient>> Create(
      CoordinatorClientOptions options);
  ~CoordinatorClient() override;

  // Joins (waiting for the other nodes until `deadline`) and starts heartbeats.
  absl::StatusOr<Membership> Join(absl::Time deadline);

  absl::Status Set(const std::string& key, const std::string& value) override;
  absl::StatusOr<std::vector<std::string>> Get(absl::Span<const std::string> keys,
                                               absl::Time deadline) override;

  // This node's newly ready buckets (returns at once).
  absl::Status Report(const std::vector<BucketInfo>& ready) override;
  // Schedule batches from index `next` on; an empty list when `deadline`
  // passed without news (or the coordinator did not answer, for less than
  // the peer timeout since it last did).
  absl::StatusOr<std::vector<ScheduleBatch>> Poll(uint64_t next, absl::Time deadline) override;
  // Leaves cleanly and stops heartbeats.
  absl::Status Leave();
  // Ends the heartbeats (and with them the failure callback's calls) and
  // waits for their thread; Leave and the destructor do it first. Call it
  // before whatever the failure callback uses goes.
  void StopHeartbeats();
  // Tells the coordinator the job failed here (best effort, short deadline).
  absl::Status ReportFailure(const std::string& reason) override;
  absl::Status ReportDataPlaneFailure(const std::string& reason) override;
  absl::Status ReportRefusedTransfer(const std::string& reason) override;
  // Called on the heartbeat thread when a heartbeat brings a new epoch's
  // membership (which every later call then presents).
  void SetMembershipCallback(MembershipCallback callback) override;

  // OK while the job runs; the failure once it failed or ended.
  absl::Status job_status() const;
  // Asks the coordinator now (one heartbeat) and returns job_status(): after a
  // local error, this finds the root cause another node reported.
  absl::Status RefreshJobStatus() override;
  // Called once, from the heartbeat thread, when the job fails or ends.
  void SetFailureCallback(std::function<void(const absl::Status&)> callback);
  // What each heartbeat tells the stall inspector: this node's long-waiting
  // buckets (called on the heartbeat thread; must not block).
  void SetWaitingProvider(std::function<std::vector<BucketWait>()> provider);
  // The stall inspector's reports, as of the last heartbeat answer.
  std::vector<std::string> stalls() const;
  std::vector<std::string> Reports() const override;
  // This node's membership as of now (an elastic job's changes included).
  Membership membership() const;

 private:
  explicit CoordinatorClient(CoordinatorClientOptions options);
  void MarkFailed(const absl::Status& status);
  // This node's membership in a new epoch, as a heartbeat or the poll of a
  // change's marker brought it: taken, and the callback told.
  void TakeMembership(const microd::v1::JoinResponse& resp, const std::string& change);
  // The session and rank every call presents (the current epoch's).
  std::pair<uint64_t, int> Identity() const;
  absl::Status SendFailure(const std::string& reason, bool data_plane,
                           bool refused_transfer = false);
  void HeartbeatLoop();
  // One heartbeat; updates the failure state. The RPC's status.
  grpc::Status HeartbeatOnce(absl::Duration timeout);
  std::unique_ptr<grpc::ClientContext> Context(absl::Time deadline) const;
  // A call the coordinator answered / did not answer. Unreachable: OK while
  // it has answered a call within the peer timeout (and `s` says it may
  // just be slow or away: UNAVAILABLE, DEADLINE_EXCEEDED), else the error
  // to fail with: the coordinator's answer, or, when it stopped answering,
  // an error naming this node, the coordinator and `what`.
  void Answered();
  absl::Status Unreachable(const grpc::Status& s, const char* what);

  const CoordinatorClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<microd::v1::Coordinator::Stub> stub_;
  mutable absl::Mutex mu_;
  // Written by Join (before the heartbeats start) and by the heartbeat
  // thread when an epoch changes; read under mu_.
  Membership membership_ ABSL_GUARDED_BY(mu_);
  MembershipCallback on_membership_ ABSL_GUARDED_BY(mu_);
  absl::Status failed_ ABSL_GUARDED_BY(mu_);
  absl::Time last_answer_ ABSL_GUARDED_BY(mu_) = absl::Now();
  uint64_t report_seq_ = 0;  // reports are sent from one thread at a time
  std::function<void(const absl::Status&)> on_failure_ ABSL_GUARDED_BY(mu_);
  std::function<std::vector<BucketWait>()> waiting_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> stalls_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> waits_ ABSL_GUARDED_BY(mu_);
  absl::Notification stop_;
  std::thread heartbeat_;
};

}  // namespace microd::control
