// The coordinator's logic, independent of gRPC: membership (join), the
// rendezvous key-value store, the schedule log (negotiation) and liveness. Served by
// node 0's daemon through CoordinatorService. Thread-safe; every blocking
// call takes a deadline, and a job failure wakes every waiter at once.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "daemon/control/kv_store.h"

namespace microd::control {

struct CoordinatorOptions {
  std::string job_id = "microd";
  std::string token;       // empty: no token required
  int expected_nodes = 1;  // n
  absl::Duration peer_timeout = absl::Seconds(10);
};

enum class JobState { kForming, kRunning, kFailed, kFinished };
const char* JobStateName(JobState state);

struct Membership {
  int node_rank = -1;
  int node_count = 0;
  std::vector<int> local_sizes;
  std::vector<std::string> node_names;
  int world_size = 0;
  uint64_t session = 0;
};

struct BucketInfo {
  std::string name;
  int dtype = 0;  // proto DataType value
  int64_t count = 0;
  bool dense = false;  // reduced without sparsification
};

// One entry of the schedule log: every node runs the same batches in order.
struct ScheduleBatch {
  uint64_t index = 0;
  std::vector<BucketInfo> scheduled;  // ready on every node, in execution order
  std::vector<std::pair<std::string, std::string>> errors;  // bucket, message
};

struct NodeSnapshot {
  int rank = -1;
  std::string name;
  int local_size = 0;
  double seconds_since_heartbeat = -1;
  bool left = false;
};

struct JobSnapshot {
  JobState state = JobState::kForming;
  std::string failure;
  int expected_nodes = 0;
  std::vector<NodeSnapshot> nodes;  // by rank once running, join order before
};

// Limits on what a request may carry.
constexpr size_t kMaxNameBytes = 256;
constexpr int kMaxLocalSize = 4096;
constexpr size_t kMaxBucketsPerReport = 65536;
constexpr size_t kMaxBatchesPerPoll = 1024;

class Coordinator {
 public:
  explicit Coordinator(CoordinatorOptions options);
  ~Coordinator();
  Coordinator(const Coordinator&) = delete;
  Coordinator& operator=(const Coordinator&) = delete;

  // Validates options (n >= 1, positive peer timeout); starts the liveness watchdog.
  static absl::StatusOr<std::unique_ptr<Coordinator>> Create(CoordinatorOptions options);

  // Blocks until n nodes joined or `deadline` (then this node is removed again
  // and the error says how many arrived). requested_rank -1 takes a free rank.
  absl::StatusOr<Membership> Join(const std::string& job_id, const std::string& node_name,
                                  int local_size, const std::string& token, int requested_rank,
                                  absl::Time deadline);
  absl::Status KeySet(uint64_t session, const std::string& key, const std::string& value);
  absl::StatusOr<std::vector<std::string>> KeyGet(uint64_t session,
                                                  const std::vector<std::string>& keys,
                                                  absl::Time deadline);
  // Node `rank` has these buckets ready. Buckets every node has now
  // reported are appended to the schedule as one batch. Never blocks.
  // `seq` > 0: the node's report number; one at or below the last taken is
  // a resend after a lost answer, answered OK and not taken again.
  absl::Status Report(uint64_t session, int rank, const std::vector<BucketInfo>& ready,
                      uint64_t seq = 0);
  // The batches from index `next` on, waiting until there is one or
  // `deadline` (then an empty list). Fails at once when the job failed.
  absl::StatusOr<std::vector<ScheduleBatch>> Poll(uint64_t session, int rank, uint64_t next,
                                                  absl::Time deadline);
  // Records liveness; returns the job state (and the failure, if any).
  absl::StatusOr<std::pair<JobState, std::string>> Heartbeat(uint64_t session, int rank);
  absl::Status Leave(uint64_t session, int rank);
  // A node reports that the job failed; the reason is kept with its name.
  absl::Status ReportFailure(uint64_t session, int rank, const std::string& reason);

  // Ends the job: every pending and later call fails with `reason`.
  void Fail(const std::string& reason);
  JobSnapshot Snapshot() const;

 private:
  struct Node {
    std::string name;
    int local_size = 0;
    int requested_rank = -1;
    int rank = -1;
    absl::Time last_seen;
    bool left = false;
    uint64_t polled = 0;  // the node has seen every batch below this index
    uint64_t report_seq = 0;  // the last numbered report taken
  };
  struct Pending {
    uint64_t order = 0;                  // first report, for a stable schedule
    std::map<int, BucketInfo> by_rank;   // what each node reported
  };

  absl::Status CheckMember(uint64_t session, int rank) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status JobError() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FailLocked(const std::string& reason, bool log = true) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AssignRanks() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void TrimSchedule() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Watchdog();

  const CoordinatorOptions options_;
  const uint64_t session_;
  InMemoryKeyValueStore store_;

  mutable absl::Mutex mu_;
  JobState state_ ABSL_GUARDED_BY(mu_) = JobState::kForming;
  std::string failure_ ABSL_GUARDED_BY(mu_);
  std::vector<Node> nodes_ ABSL_GUARDED_BY(mu_);  // join order; by rank once running
  // Negotiation: buckets reported by some nodes, and the schedule log
  // (batches [schedule_base_, schedule_base_ + schedule_.size())).
  uint64_t report_order_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, Pending> pending_ ABSL_GUARDED_BY(mu_);
  std::deque<ScheduleBatch> schedule_ ABSL_GUARDED_BY(mu_);
  uint64_t schedule_base_ ABSL_GUARDED_BY(mu_) = 0;

  absl::Notification stop_;
  std::thread watchdog_;
};

}  // namespace microd::control
