// SPDX-License-Identifier: Apache-2.0
// What the control plane's parties say to one another, as plain structs:
// a job's membership, the buckets a node reports ready and the schedule
// batches every node runs. No gRPC here; the engine sees only these and
// ControlPlane (control_plane.h).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace microd::control {

// A bucket some local process of a node submitted that has not run yet
// (what the node's heartbeats carry): for how long, and the local processes
// that have not submitted it, as (local rank, pid; 0: not connected). None
// missing: ready on that node, waiting for the other nodes.
struct BucketWait {
  std::string name;
  double seconds = 0;
  std::vector<std::pair<int, int>> missing;
};

// Such (local rank, pid) pairs for a message: "0 (pid 4242), 1 (not
// connected)".
inline std::string ProcessList(const std::vector<std::pair<int, int>>& processes) {
  std::string out;
  for (const auto& [local_rank, pid] : processes) {
    absl::StrAppend(&out, out.empty() ? "" : ", ", local_rank,
                    pid > 0 ? absl::StrCat(" (pid ", pid, ")") : " (not connected)");
  }
  return out;
}

enum class JobState { kForming, kRunning, kFailed, kFinished };
const char* JobStateName(JobState state);

struct Membership {
  int node_rank = -1;
  int node_count = 0;
  std::vector<int> local_sizes;
  std::vector<std::string> node_names;
  int world_size = 0;
  uint64_t session = 0;
  // The address the coordinator saw the join come from (set by the client
  // from the answer; "" when unknown).
  std::string observed_host;
  // Elastic jobs: the membership epoch (0: as the job formed; each loss of
  // nodes forms the next, renumbering the survivors), and the index of the
  // first schedule batch of this epoch (where the node polls from).
  uint64_t epoch = 0;
  uint64_t first_batch = 0;
  // The epoch began at a batch of the log (a node joined: nothing in flight
  // is cut): the node runs every batch before first_batch on the old data
  // plane (the last one marks the change), then changes. Else (a node
  // lost) the old epoch's steps end where they are.
  bool graceful = false;
  // By peer rank: the salt of each link of this node in this epoch (32
  // bytes, fresh per epoch; empty at its own rank). With the job token's
  // secret, what the link's data-plane keys come from (transport::SealKeys).
  // Each node gets its own links' only, so that no member can pose as
  // another; they travel only over TLS, and are never logged or written.
  std::vector<std::string> link_salts;
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
  // Nonzero: the last batch of an epoch (no buckets), after which the job
  // runs in epoch `change_epoch` (a node joined); the node that polled it
  // finds its membership there, and what changed.
  uint64_t change_epoch = 0;
  std::optional<Membership> membership;
  std::string change;
};

}  // namespace microd::control
