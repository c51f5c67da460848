// SPDX-License-Identifier: Apache-2.0
// An elastic job's recovery on one node: what it holds between a sign of a
// change (a step's collective failed: perhaps a lost peer; or the
// coordinator's next membership epoch) and the next epoch running. The
// failed steps' works are held, the coordinator's verdict awaited until
// --elastic's wait ends, and handed back once the epoch runs (the engine
// answers them MICROD_ERR_MEMBERSHIP) or the job ends (it answers them
// with the failure).
//
// Its own lock. The engine may call it holding its own lock (EngineState::mu
// before Recovery's, never the reverse); Recovery calls nothing outside.
#pragma once

#include <atomic>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/control/types.h"
#include "daemon/engine/process_table.h"

namespace microd::engine {

class Recovery {
 public:
  // `wait`: how long a verdict is awaited (--elastic_timeout_s's share,
  // EngineOptions::membership_wait). `elastic`: the node follows changes.
  // `seal_failure_step`: a refused sealed transfer fails the step, not the
  // job (--seal_failure=step).
  Recovery(absl::Duration wait, bool elastic, bool seal_failure_step)
      : wait_(wait), elastic_(elastic), seal_failure_step_(seal_failure_step) {}

  // Whether a collective's failure `why` is the coordinator's to decide:
  // an elastic node's lost peer (anything but a refusal, InvalidArgument:
  // this node's buckets or options are not the job's), or a refused sealed
  // transfer (DataLoss) under --seal_failure=step. Else it fails the job.
  bool Holdable(const absl::Status& why) const;
  // Holds a failed step's `works` for the next epoch and enters recovery
  // for `why` unless recovering already; true if this call entered it.
  bool Hold(std::vector<Work> works, const absl::Status& why);
  // The coordinator's next membership `m` (`change`: what changed), this
  // node running epoch `current`. An epoch taken already, or an older one,
  // changes nothing. True when what runs on the current data plane must
  // end now (a loss); a node that joined comes after the old epoch's last
  // batch (ChangeDue), so nothing is cut for it.
  bool Offer(const control::Membership& m, const std::string& change, uint64_t current);
  // The batch that marks a join ran: recovery begins once its plan ended.
  void ChangeDue();
  // Enters recovery if a change is due (and clears it); true if it did.
  bool StartIfDue();
  // Lock-free (a condition of a wait on the engine's lock may ask; every
  // change of it is made under that lock too, so such waits wake).
  bool recovering() const { return recovering_.load(std::memory_order_acquire); }

  struct Verdict {
    bool ended = false;  // the job ended (End): nothing to do
    // The next membership and what changed; none: no newer one came in time.
    std::optional<std::pair<control::Membership, std::string>> next;
    absl::Status cause;  // what began the recovery
  };
  // Waits until a membership newer than epoch `after` was offered, the job
  // ended, or the recovery's deadline.
  Verdict Await(uint64_t after = 0);
  // The epoch runs: the works held (to answer), the recovery timed.
  std::vector<Work> Done();
  // Works whose step was committed after all (rolled forward): not held.
  void Release(const std::vector<Work>& done);
  // The job ended: nothing is held or awaited any more; the works held, to
  // answer with the failure.
  std::vector<Work> End();
  // Seconds from the first sign of the last change to its epoch running.
  double last_seconds() const;

 private:
  bool StartLocked(const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const absl::Duration wait_;
  const bool elastic_;
  const bool seal_failure_step_;
  mutable absl::Mutex mu_;
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<bool> recovering_{false};  // written under mu_, and not once ended
  absl::Time started_ ABSL_GUARDED_BY(mu_);
  absl::Time until_ ABSL_GUARDED_BY(mu_);
  absl::Status cause_ ABSL_GUARDED_BY(mu_);
  double last_seconds_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<Work> held_ ABSL_GUARDED_BY(mu_);
  std::optional<std::pair<control::Membership, std::string>> next_ ABSL_GUARDED_BY(mu_);
  // The latest epoch offered: one delivered again (a heartbeat's answer
  // after the poll's marker) or an older one changes nothing, so that no
  // epoch's data plane is ever made twice.
  uint64_t latest_epoch_ ABSL_GUARDED_BY(mu_) = 0;
  bool change_due_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace microd::engine
