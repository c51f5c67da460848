// SPDX-License-Identifier: Apache-2.0
// What the engine's parts share, under one mutex: the job's state, the
// process table, the schedule read from the coordinator and the work of the
// running batch; and how a part ends the job or answers a Work.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "daemon/control/control_plane.h"
#include "daemon/engine/process_table.h"

namespace microd::engine {

// A save or load of the compression state that the local processes asked
// for (every one of them, the same): run by the engine's thread between
// plans once all asked.
struct StateRequest {
  bool save = false;
  // The directory of the first process that asked (the others named the
  // same one: same device and inode); its owner is given the file.
  local::StateDirectory dir;
  std::vector<uint64_t> clients;  // by local rank
  std::vector<uint64_t> tickets;  // by local rank, 0: not asked yet
  int asked = 0;
};

struct EngineState {
  EngineState(int local_size, uint64_t dense_floor) : table(local_size, dense_floor) {}

  bool job_failed() const {
    absl::MutexLock lock(&mu);
    return !failed.ok();
  }

  mutable absl::Mutex mu;
  absl::Status failed ABSL_GUARDED_BY(mu);  // the job's end, once failed
  bool stop ABSL_GUARDED_BY(mu) = false;
  ProcessTable table ABSL_GUARDED_BY(mu);
  std::deque<control::ScheduleBatch> schedule ABSL_GUARDED_BY(mu);  // read, not yet run
  uint64_t log_run ABSL_GUARDED_BY(mu) = 0;  // schedule batches taken from `schedule`
  // Something changed since the last cycle (a submission, a schedule batch).
  bool changed ABSL_GUARDED_BY(mu) = false;
  // When a local process last submitted (the cycle waits for a burst of
  // submissions to end before it starts).
  absl::Time last_submit ABSL_GUARDED_BY(mu) = absl::InfinitePast();
  // The running batch's work not yet answered (Fail() answers it).
  std::vector<Work> in_flight ABSL_GUARDED_BY(mu);
  // The fence (MICROD_WIRE_CAP_FENCE): per connected process, the changes of
  // membership it must have read before it submits. `changes` made,
  // `notified` told to the processes; a submission refused by the fence
  // while a change is being told is answered once it is (`fenced`).
  struct Fenced {
    uint64_t client = 0;
    uint32_t buffer_id = 0;
    uint64_t ticket = 0;
    std::string bucket;
  };
  std::map<uint64_t, uint32_t> fence ABSL_GUARDED_BY(mu);
  uint64_t changes ABSL_GUARDED_BY(mu) = 0;
  uint64_t notified ABSL_GUARDED_BY(mu) = 0;
  std::vector<Fenced> fenced ABSL_GUARDED_BY(mu);
  StateRequest state_request ABSL_GUARDED_BY(mu);
  bool state_request_ready ABSL_GUARDED_BY(mu) = false;  // every local process asked
  uint64_t batches ABSL_GUARDED_BY(mu) = 0;
  uint64_t cache_batches ABSL_GUARDED_BY(mu) = 0;
  uint64_t cycle_reductions ABSL_GUARDED_BY(mu) = 0;
  // Elastic jobs: a step failed on the data plane, or the membership
  // changed. The engine holds the failed steps' submissions (`held`) until
  // the next epoch's membership arrives (`next_membership`, with what
  // changed) or `recover_until`, then reconfigures (engine.cc).
  bool recovering ABSL_GUARDED_BY(mu) = false;
  absl::Time recover_started ABSL_GUARDED_BY(mu);
  absl::Time recover_until ABSL_GUARDED_BY(mu);
  double last_recovery_seconds ABSL_GUARDED_BY(mu) = 0;
  // Sealed transfers refused on the data planes of earlier epochs.
  uint64_t refused_before ABSL_GUARDED_BY(mu) = 0;
  // Steps confirmed before the current data plane's (Transport::confirmed):
  // on the earlier ones, adopted when joining, or rolled forward.
  uint64_t confirmed_before ABSL_GUARDED_BY(mu) = 0;
  absl::Status recover_cause ABSL_GUARDED_BY(mu);
  std::vector<Work> held ABSL_GUARDED_BY(mu);
  std::optional<std::pair<control::Membership, std::string>> next_membership ABSL_GUARDED_BY(mu);
  // The latest epoch whose membership this node took (as next_membership,
  // or running): one delivered again (a heartbeat's answer after the
  // poll's marker) or an older one changes nothing, so that no epoch's data
  // plane is ever made twice.
  uint64_t latest_epoch ABSL_GUARDED_BY(mu) = 0;
  // A node joined: the batch that marks the change ran (the engine
  // reconfigures once the plan that held it ends).
  bool change_due ABSL_GUARDED_BY(mu) = false;
};

// The engine, as its parts see it.
class JobControl {
 public:
  virtual ~JobControl() = default;
  // Ends the job on this node (and tells the coordinator when `report`).
  virtual void Fail(const absl::Status& reason, bool report) = 0;
  // A step failed here: the reason another node gave the coordinator first.
  virtual absl::Status WithRootCause(const absl::Status& local) = 0;
  // Answers a Work of the running batch, unless Fail() did already.
  virtual void Finish(const Work& work, const absl::Status& status) = 0;
  // A collective failed (`why`) with `works` in flight: in an elastic job,
  // perhaps a lost peer. True: the works are held for the next membership
  // epoch (the coordinator decides); false: not elastic, or the job failed
  // already: the caller fails them as before.
  virtual bool Hold(const std::vector<Work>& works, const absl::Status& why) { return false; }
};

// The status every submission gets once the job failed for `why`.
absl::Status JobFailed(const absl::Status& why);

}  // namespace microd::engine
