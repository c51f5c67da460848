// SPDX-License-Identifier: Apache-2.0
// What the engine's parts share, under one mutex: the job's state, the
// process table, the schedule read from the coordinator, the work of the
// running batch and the fence; and how a part ends the job or answers a
// Work. An elastic job's recovery keeps its own (recovery.h).
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
#include "daemon/engine/fence.h"
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
  bool ready = false;  // every local process asked
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
  Fence fence ABSL_GUARDED_BY(mu);  // fence.h
  StateRequest state_request ABSL_GUARDED_BY(mu);
  // Batches run, by how they were agreed, and buckets the cycle reduced.
  struct Counts {
    uint64_t batches = 0;
    uint64_t cache_batches = 0;
    uint64_t cycle_reductions = 0;
  };
  Counts counts ABSL_GUARDED_BY(mu);
};

// The engine, as its parts see it.
class JobControl {
 public:
  virtual ~JobControl() = default;
  // Ends the job on this node (and tells the coordinator when `report`).
  virtual void Fail(const absl::Status& reason, bool report) = 0;
  // A step failed here: the reason another node gave the coordinator first,
  // and whether this node was held (Engine::WithHold).
  virtual absl::Status WithRootCause(const absl::Status& local) = 0;
  // Answers a Work of the running batch, unless Fail() did already.
  virtual void Finish(const Work& work, const absl::Status& status) = 0;
  // A collective failed (`why`) with `works` in flight: in an elastic job,
  // perhaps a lost peer. True: the works are held for the next membership
  // epoch (the coordinator decides); false: not elastic, or the job failed
  // already: the caller fails them as before.
  virtual bool Hold(const std::vector<Work>& works, const absl::Status& why) { return false; }
  // An elastic job recovers (recovery.h): nothing runs until the engine
  // reconfigured. Lock-free: a wait on EngineState::mu may ask.
  virtual bool recovering() const { return false; }
};

// The status every submission gets once the job failed for `why`.
absl::Status JobFailed(const absl::Status& why);

}  // namespace microd::engine
