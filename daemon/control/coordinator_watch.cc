// SPDX-License-Identifier: Apache-2.0
// The coordinator's watch over the job: the watchdog (silent nodes, held
// failures, the stall inspector, once per tick) and the sentinel that
// watches the watchdog without taking a lock.
#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "daemon/common/log.h"
#include "daemon/control/coordinator.h"

namespace microd::control {

void Coordinator::InspectStalls(absl::Time now) {
  if (ShortLocked()) {
    // Nothing runs: what every node waits for is nodes.
    stalls_.Short(
        absl::StrCat("the job has ", nodes_.size(), " node(s), fewer than its minimum of ",
                     min_nodes(), " (--min_nodes): nothing runs until nodes join, for up to ",
                     absl::FormatDuration(absl::Trunc(
                         options_.elastic_timeout - (now - short_since_), absl::Seconds(1))),
                     " more (--elastic_timeout_s)"));
    return;
  }
  std::vector<StallInspector::NodeWaits> nodes;
  for (const Node& n : nodes_) nodes.push_back({n.rank, n.name, &n.waiting});
  if (std::string abort = stalls_.Inspect(now, nodes); !abort.empty()) FailLocked(abort);
}

void Coordinator::HoldLockForTest(absl::Duration d) {
  absl::MutexLock lock(&mu_);
  absl::SleepFor(d);
}

void Coordinator::CreditLocked(absl::Time now, absl::Duration late) {
  for (Node& n : nodes_) n.last_seen = std::min(now, n.last_seen + late);
  MICROD_LOG(Warning,
             "coordinator: its watchdog ran %s late (this process, or the coordinator's lock, "
             "was held): the nodes' silence over that time is not counted",
             absl::FormatDuration(absl::Trunc(late, absl::Milliseconds(1))).c_str());
}

void Coordinator::Sentinel() {
  const absl::Duration warn_after = std::max(absl::Milliseconds(500), options_.peer_timeout / 2);
  bool warned = false;
  while (!stop_.WaitForNotificationWithTimeout(absl::Milliseconds(100))) {
    const absl::Time now = absl::Now();
    const absl::Duration idle = now - absl::FromUnixMicros(watchdog_ran_us_.load());
    if (idle < warn_after) {
      if (warned) MICROD_LOG(Info, "coordinator: its watchdog runs again");
      warned = false;
      continue;
    }
    if (warned) continue;
    warned = true;
    const int64_t waiting = watchdog_waiting_us_.load();
    const std::string why =
        waiting != 0
            ? absl::StrCat("waiting ",
                           absl::FormatDuration(absl::Trunc(now - absl::FromUnixMicros(waiting),
                                                            absl::Milliseconds(1))),
                           " for the coordinator's lock: a call holds it")
            : "not waiting for the lock: its thread was not scheduled";
    MICROD_LOG(Warning, "coordinator: its watchdog has not run for %s (%s)",
               absl::FormatDuration(absl::Trunc(idle, absl::Milliseconds(1))).c_str(), why.c_str());
  }
}

void Coordinator::Watchdog() {
  const absl::Duration tick = std::max(
      absl::Milliseconds(10), std::min(absl::Milliseconds(100), options_.peer_timeout / 10));
  const absl::Duration held_after = std::min(absl::Seconds(1), options_.peer_timeout / 2);
  absl::Time last = absl::Now();
  while (!stop_.WaitForNotificationWithTimeout(tick)) {
    watchdog_waiting_us_ = absl::ToUnixMicros(absl::Now());
    absl::MutexLock lock(&mu_);
    watchdog_waiting_us_ = 0;
    const absl::Time now = absl::Now();
    watchdog_ran_us_ = absl::ToUnixMicros(now);
    const absl::Duration late = now - last - tick;
    last = now;
    if (late > held_after) CreditLocked(now, late);
    if (state_ != JobState::kRunning) continue;
    // The first node past the peer timeout fails the job; others silent for
    // over half of it are named too (a partition silences several at once,
    // a few heartbeats apart).
    const Node* first = nullptr;
    std::string also;
    std::vector<int> lost;  // every node past the timeout
    std::vector<std::string> lost_text;
    for (const Node& n : nodes_) {
      if (n.left) continue;
      const absl::Duration silent = now - n.last_seen;
      const std::string text =
          absl::StrCat("node ", n.rank, " (", n.name, ") silent for ",
                       absl::FormatDuration(absl::Trunc(silent, absl::Milliseconds(1))));
      if (silent > options_.peer_timeout) {
        lost.push_back(n.rank);
        lost_text.push_back(text);
      }
      if (silent > options_.peer_timeout && first == nullptr) {
        first = &n;
      } else if (silent > options_.peer_timeout / 2) {
        absl::StrAppend(&also, also.empty() ? "; also silent: " : ", ", "node ", n.rank, " (",
                        n.name, ") for ",
                        absl::FormatDuration(absl::Trunc(silent, absl::Milliseconds(1))));
      }
    }
    InspectStalls(now);
    if (state_ != JobState::kRunning) continue;
    const std::string timeout =
        absl::StrCat(" (peer timeout ", absl::FormatDuration(options_.peer_timeout), ")");
    const int left = static_cast<int>(nodes_.size() - lost.size());
    if (first != nullptr && elastic() && (first->rank != 0 || !options_.served_by_node0) &&
        (left >= min_nodes() || options_.elastic_timeout > absl::ZeroDuration())) {
      // Node 0 serves this coordinator: silent, it is this process that
      // stalled, and it cannot be dropped.
      const std::string cause = absl::StrCat(absl::StrJoin(lost_text, ", "), timeout);
      FormEpochLocked(lost, cause);
      NoteShortLocked(cause);
      continue;
    }
    if (first == nullptr && ShortLocked() && now - short_since_ > options_.elastic_timeout) {
      FailLocked(absl::StrCat("the job waited ", absl::FormatDuration(options_.elastic_timeout),
                              " (--elastic_timeout_s) for nodes to join and has ", nodes_.size(),
                              " node(s), fewer than its minimum of ", min_nodes(),
                              " (--min_nodes), since ", short_cause_));
      continue;
    }
    if (first != nullptr) {
      std::string why = absl::StrCat(
          "node ", first->rank, " (", first->name, ") silent for ",
          absl::FormatDuration(absl::Trunc(now - first->last_seen, absl::Milliseconds(1))), timeout,
          also);
      if (elastic()) {
        absl::StrAppend(&why, first->rank == 0 && options_.served_by_node0
                                  ? "; node 0 serves the coordinator and cannot be dropped "
                                    "(microd --coordinator_only serves one of its own)"
                                  : absl::StrCat("; ", left,
                                                 " node(s) would remain, fewer "
                                                 "than the minimum of ",
                                                 min_nodes(), " (--min_nodes)"));
      }
      FailLocked(why);
      continue;
    }
    if (!held_failure_.empty()) {
      if (held_epoch_ != epoch_) {
        held_failure_.clear();  // a node was lost since: the epoch formed instead
      } else if (now >= held_until_) {
        // No node was lost: the data plane broke between live nodes (a
        // connection reset on the path). The same members connect afresh.
        const std::string text = std::move(held_failure_);
        held_failure_.clear();
        const std::string failed =
            ReformLocked(&breaks_, text, "the data plane broke between live nodes",
                         "no node was lost within the peer timeout: the step failed on every "
                         "node, the data plane is connected afresh");
        if (!failed.empty()) FailLocked(failed);
      }
    }
  }
}

}  // namespace microd::control
