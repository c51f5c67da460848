// SPDX-License-Identifier: Apache-2.0
// The coordinator's stall inspector: from the buckets every node's
// heartbeat says have waited long, and the local processes that have not
// submitted them, the reports of buckets stalled past --stall_warning_s
// (each logged when new and again every warning period), and the one that
// ends the job past --stall_abort_s; and, for buckets that wait less than
// that, what each waits for (not logged: a trainer whose wait timed out
// asks its daemon, which has them from its heartbeats). Not thread-safe: the coordinator calls
// it under its lock.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "daemon/control/types.h"

namespace microd::control {

class StallInspector {
 public:
  // `abort`: zero for never.
  StallInspector(absl::Duration warning, absl::Duration abort) : warning_(warning), abort_(abort) {}

  // A node as the inspector sees it.
  struct NodeWaits {
    int rank = -1;
    std::string name;
    const std::vector<BucketWait>* waiting = nullptr;  // from its last heartbeat
  };
  // Once per watchdog tick: the reports, in bucket order. Returns the
  // report that ends the job ("" if none does), with the limit named.
  std::string Inspect(absl::Time now, const std::vector<NodeWaits>& nodes);
  // Nothing runs (fewer nodes than the job's minimum): `why` is the only
  // report.
  void Short(std::string why);
  void Clear();
  const std::vector<std::string>& reports() const { return reports_; }
  // The buckets some node reported waiting, not stalled yet: "bucket 'x'
  // waiting for 3 s: ready on ...; waiting for node 2 (...): ...".
  const std::vector<std::string>& waits() const { return waits_; }

 private:
  const absl::Duration warning_;
  const absl::Duration abort_;
  std::vector<std::string> reports_;
  std::vector<std::string> waits_;
  std::map<std::string, absl::Time> logged_;  // by bucket
};

}  // namespace microd::control
