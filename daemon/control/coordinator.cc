// SPDX-License-Identifier: Apache-2.0
#include "daemon/control/coordinator.h"

#include <sys/random.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "daemon/common/crypto.h"
#include "daemon/common/log.h"
#include "daemon/common/status_macros.h"
#include "kernels/element_type.h"

namespace microd::control {

const char* JobStateName(JobState state) {
  switch (state) {
    case JobState::kForming:
      return "forming";
    case JobState::kRunning:
      return "running";
    case JobState::kFailed:
      return "failed";
    case JobState::kFinished:
      return "finished";
  }
  return "?";
}

Coordinator::Coordinator(CoordinatorOptions options)
    : options_(std::move(options)),
      admission_(options_.job_id, options_.token, options_.certificate_names_job),
      stalls_(options_.stall_warning, options_.stall_abort),
      seal_salt_(FreshSealSalt()) {
  watchdog_ran_us_ = absl::ToUnixMicros(absl::Now());
  watchdog_ = std::thread([this] { Watchdog(); });
  sentinel_ = std::thread([this] { Sentinel(); });
}

Coordinator::~Coordinator() {
  stop_.Notify();
  watchdog_.join();
  sentinel_.join();
  absl::MutexLock lock(&mu_);
  FailLocked("coordinator shut down", /*log=*/false);
}

absl::StatusOr<std::unique_ptr<Coordinator>> Coordinator::Create(CoordinatorOptions options) {
  if (options.expected_nodes < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("coordinator: node count must be >= 1, got ", options.expected_nodes));
  }
  if (options.peer_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("coordinator: peer timeout must be positive");
  }
  if (options.max_nodes != 0 &&
      (options.max_nodes < options.expected_nodes || options.max_nodes > kMaxNodes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("coordinator: the maximum node count must be in [", options.expected_nodes,
                     " (the node count), ", kMaxNodes, "], got ", options.max_nodes));
  }
  if (options.elastic_timeout < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("coordinator: the elastic timeout must not be negative");
  }
  if (options.min_nodes < 0 || options.min_nodes > options.expected_nodes) {
    return absl::InvalidArgumentError(
        absl::StrCat("coordinator: the minimum node count must be in [0, ", options.expected_nodes,
                     "] (the node count), got ", options.min_nodes));
  }
  if (absl::Status s = CheckName("job id", options.job_id); !s.ok()) return s;
  return std::make_unique<Coordinator>(std::move(options));
}

absl::Status Coordinator::JobError() const {
  if (state_ == JobState::kFailed)
    return absl::AbortedError(absl::StrCat("job failed: ", failure_));
  if (state_ == JobState::kFinished) {
    return absl::FailedPreconditionError(absl::StrCat("job finished: ", failure_));
  }
  return absl::OkStatus();
}

void Coordinator::FailLocked(const std::string& reason, bool log) {
  if (state_ == JobState::kFailed || state_ == JobState::kFinished) return;
  state_ = JobState::kFailed;
  failure_ = reason;
  store_.Fail(absl::AbortedError(absl::StrCat("job failed: ", reason)));
  if (!log) return;
  MICROD_LOG(Error, "coordinator: job '%s' failed: %s", options_.job_id.c_str(), reason.c_str());
}

void Coordinator::Fail(const std::string& reason) {
  absl::MutexLock lock(&mu_);
  FailLocked(reason);
}

absl::Status Coordinator::CheckMember(uint64_t session, int rank, int* caller, bool* stale) {
  if (state_ == JobState::kForming) {
    return absl::FailedPreconditionError("the job has not formed yet: join first");
  }
  int owner = -1, old_owner = -1;
  for (const Node& n : nodes_) {
    if (n.credential == session) owner = n.rank;  // every node compared, whichever matches
    for (uint64_t c : n.old_credentials) {
      if (c == session) old_owner = n.rank;
    }
  }
  if (stale != nullptr) *stale = false;
  if (owner < 0 && old_owner >= 0) {
    // A node that survived a change of membership, not told yet: alive, and
    // speaking for a rank it may no longer have.
    Node& node = nodes_[old_owner];
    node.last_seen = absl::Now();
    if (stale != nullptr) {
      *stale = true;
      if (caller != nullptr) *caller = old_owner;
      return absl::OkStatus();
    }
    return absl::FailedPreconditionError(absl::StrCat(
        "membership changed: the job is at epoch ", epoch_, ", where node '", node.name,
        "' is node ", old_owner, " of ", nodes_.size(), " (its heartbeat gets the new session)"));
  }
  if (owner < 0) {
    return absl::PermissionDeniedError(
        epoch_ == 0 ? "unknown session: this node did not join this job"
                    : "unknown session: this node did not join this job, or was dropped from "
                      "it by a change of membership");
  }
  if (rank < -1 || rank >= static_cast<int>(nodes_.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("node rank ", rank, " out of range [0, ", nodes_.size(), ")"));
  }
  if (rank >= 0 && rank != owner) {
    MICROD_LOG(Warning, "coordinator: refused a call of node %d ('%s') for node %d", owner,
               nodes_[owner].name.c_str(), rank);
    return absl::PermissionDeniedError(absl::StrCat("node ", owner, " ('", nodes_[owner].name,
                                                    "') may speak only for itself, not node ",
                                                    rank));
  }
  if (rank >= 0) nodes_[rank].last_seen = absl::Now();
  if (caller != nullptr) *caller = owner;
  return absl::OkStatus();
}

absl::Status Coordinator::CheckOptions(const std::string& node_name, const std::string& options,
                                       bool running) const {
  if (nodes_.empty() || nodes_[0].options.empty()) return absl::OkStatus();
  // A node that sends no options would skip their check.
  if (options.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "node '", node_name, "' may not join: it sent no options, which the job's first node '",
        nodes_[0].name, "' did (a node's are checked against the job's at its join)"));
  }
  if (!options_.check_options) return absl::OkStatus();
  return options_.check_options(node_name, options, nodes_[0].name, nodes_[0].options, running);
}

absl::Status Coordinator::CheckKeyWrite(int caller, const std::string& key, size_t bytes) {
  // The data plane's rendezvous is the current epoch's alone: a key of
  // another epoch's (a later one, where ranks are numbered anew) could put
  // a member between two others once that epoch connects.
  if (absl::StartsWith(key, "gloo/")) {
    const std::string current = absl::StrCat(kRendezvousPrefix, epoch_, "/");
    if (!absl::StartsWith(key, current)) {
      return absl::PermissionDeniedError(absl::StrCat("key '", key,
                                                      "' is not in the rendezvous of the job's "
                                                      "epoch ",
                                                      epoch_, " ('", current, "'): node ", caller,
                                                      " may not write it"));
    }
  }
  // Each rank writes its own entries only ("<prefix>/<rank>", or Gloo's
  // "<prefix>/rank_<rank>"). Every other key is job-wide (NCCL's bootstrap
  // id): node 0's alone, so that no member can plant one before node 0
  // writes it.
  const size_t slash = key.rfind('/');
  int entry_rank = -1;
  std::string last = slash == std::string::npos ? "" : key.substr(slash + 1);
  if (absl::StartsWith(last, "rank_")) last = last.substr(5);  // Gloo's full-mesh entries
  if (!last.empty() && absl::SimpleAtoi(last, &entry_rank) && entry_rank >= 0 &&
      entry_rank < static_cast<int>(nodes_.size())) {
    if (entry_rank != caller) {
      return absl::PermissionDeniedError(absl::StrCat("key '", key, "' is node ", entry_rank,
                                                      "'s rendezvous entry: node ", caller,
                                                      " may not write it"));
    }
  } else if (caller != 0) {
    return absl::PermissionDeniedError(absl::StrCat(
        "key '", key, "' is job-wide and only node 0 writes those: node ", caller, " may not"));
  }
  // A node's writes in an epoch are bounded (node 0 holds them all).
  Written& w = written_[caller];
  if (w.keys + 1 > kMaxKeysPerNode || w.bytes + bytes > kMaxKeyBytesPerNode) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "node ", caller, " wrote ", w.keys, " keys (", w.bytes,
        " bytes) to the rendezvous in epoch ", epoch_, ": at most ", kMaxKeysPerNode, " keys and ",
        kMaxKeyBytesPerNode, " bytes a node; key '", key, "' is refused"));
  }
  ++w.keys;
  w.bytes += bytes;
  return absl::OkStatus();
}

absl::Status Coordinator::KeySet(uint64_t session, const std::string& key,
                                 const std::string& value) {
  {
    absl::MutexLock lock(&mu_);
    int caller = -1;
    if (absl::Status s = CheckMember(session, -1, &caller); !s.ok()) return s;
    if (absl::Status s = JobError(); !s.ok()) return s;
    if (absl::Status s = rendezvous::ValidateKey(key); !s.ok()) return s;
    if (absl::Status s = rendezvous::ValidateValue(value); !s.ok()) return s;
    if (absl::Status s = CheckKeyWrite(caller, key, value.size()); !s.ok()) return s;
  }
  return store_.Set(key, value);
}

absl::StatusOr<std::vector<std::string>> Coordinator::KeyGet(uint64_t session,
                                                             const std::vector<std::string>& keys,
                                                             absl::Time deadline) {
  {
    absl::MutexLock lock(&mu_);
    if (absl::Status s = CheckMember(session, -1); !s.ok()) return s;
    if (absl::Status s = JobError(); !s.ok()) return s;
  }
  if (keys.empty()) return absl::InvalidArgumentError("key-value store: no keys requested");
  return store_.Get(keys, deadline);
}

absl::Status Coordinator::Report(uint64_t session, int rank, const std::vector<BucketInfo>& ready,
                                 uint64_t seq) {
  if (rank < 0) return absl::InvalidArgumentError(absl::StrCat("node rank ", rank, " is negative"));
  RETURN_IF_ERROR(ScheduleLog::CheckReport(ready));
  absl::MutexLock lock(&mu_);
  if (absl::Status s = CheckMember(session, rank); !s.ok()) return s;
  if (absl::Status s = JobError(); !s.ok()) return s;
  if (seq != 0) {
    if (seq <= nodes_[rank].report_seq) return absl::OkStatus();  // taken already
    if (seq != nodes_[rank].report_seq + 1) {
      return absl::InvalidArgumentError(absl::StrCat("node ", rank, " sent report ", seq,
                                                     " after report ", nodes_[rank].report_seq));
    }
  }
  if (nodes_[rank].next_credential != 0) {
    // Of the epoch before a node joined: dropped (the node's engine answers
    // these submissions MICROD_ERR_MEMBERSHIP at the change).
    if (seq != 0) nodes_[rank].report_seq = seq;
    return absl::OkStatus();
  }
  RETURN_IF_ERROR(JoinerDiffers(rank, ready));
  RETURN_IF_ERROR(schedule_.CheckNotPending(rank, ready));
  if (seq != 0) nodes_[rank].report_seq = seq;
  std::vector<std::string> names;
  for (const Node& n : nodes_) names.push_back(n.name);
  // Below the job's minimum, nothing runs until nodes join (which drops
  // what is pending: each node submits it again in the next epoch).
  schedule_.Add(rank, ready, names, /*hold=*/ShortLocked());
  return absl::OkStatus();
}

absl::Status Coordinator::JoinerDiffers(int rank, const std::vector<BucketInfo>& ready) {
  if (nodes_[rank].joined_epoch == 0) return absl::OkStatus();
  // A node that joined the running job must hold the job's buckets.
  for (const BucketInfo& b : ready) {
    const BucketInfo* job = schedule_.Scheduled(b.name);
    if (job == nullptr ||
        (job->dtype == b.dtype && job->count == b.count && job->dense == b.dense)) {
      continue;
    }
    const std::string why = absl::StrCat(
        "node ", rank, " ('", nodes_[rank].name, "'), which joined at epoch ",
        nodes_[rank].joined_epoch, ", has bucket '", b.name, "' as ", Describe(b),
        ", and the job has it as ", Describe(*job), ": refused, and dropped from the job");
    if (static_cast<int>(nodes_.size()) - 1 >= min_nodes() ||
        options_.elastic_timeout > absl::ZeroDuration()) {
      FormEpochLocked({rank}, why);
      NoteShortLocked(why);
    } else {
      FailLocked(why);
    }
    return absl::InvalidArgumentError(why);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<ScheduleBatch>> Coordinator::Poll(uint64_t session, int rank,
                                                             uint64_t next, absl::Time deadline) {
  if (rank < 0) return absl::InvalidArgumentError(absl::StrCat("node rank ", rank, " is negative"));
  absl::MutexLock lock(&mu_);
  int caller = -1;
  bool stale = false;
  if (absl::Status s = CheckMember(session, rank, &caller, &stale); !s.ok()) return s;
  if (stale) {
    // The answer that carried the node's new membership was lost: the node
    // asks again with its old session, and is answered the same.
    const Node& n = nodes_[caller];
    const bool again = marker_batch_ != UINT64_MAX && marker_batch_ >= schedule_.base() &&
                       next <= marker_batch_ && !n.old_credentials.empty() &&
                       n.old_credentials.back() == session;
    if (!again) return CheckMember(session, rank);  // "membership changed"
  } else {
    if (next < nodes_[rank].polled) {
      return absl::InvalidArgumentError(absl::StrCat("node ", rank, " asked for batch ", next,
                                                     " after having seen up to ",
                                                     nodes_[rank].polled));
    }
    if (next > schedule_.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("batch ", next, " does not exist yet (next is ", schedule_.end(), ")"));
    }
    nodes_[rank].polled = next;
    TrimSchedule();
  }
  const uint64_t epoch = epoch_;
  auto ready = [this, next, epoch]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return schedule_.end() > next || state_ == JobState::kFailed || state_ == JobState::kFinished ||
           epoch_ != epoch;
  };
  mu_.AwaitWithDeadline(absl::Condition(&ready), deadline);
  if (epoch_ != epoch) {
    // The membership changed during the wait, and with it the ranks (nodes
    // lost: fewer of them). A node joined: this session holds until the
    // node polls the marker; a node lost: the session is of the old epoch
    // now, and so is a stale one.
    if (absl::Status s = JobError(); !s.ok()) return s;
    caller = -1;
    for (const Node& n : nodes_) {
      if (n.credential == session && !stale) caller = n.rank;
    }
    if (caller < 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("membership changed: the job is at epoch ", epoch_));
    }
  }
  // Batches already in the log are delivered even after a failure, so that
  // every node sees the same errors (a mismatch) before the failure itself.
  if (schedule_.end() <= next) {
    if (absl::Status s = JobError(); !s.ok()) return s;
  }
  // A node that has not taken its next epoch's session reads up to the
  // marker only.
  const bool before_change = stale || nodes_[caller].next_credential != 0;
  const uint64_t end =
      before_change ? std::min(schedule_.end(), marker_batch_ + 1) : schedule_.end();
  std::vector<ScheduleBatch> out;
  for (uint64_t i = std::max(next, schedule_.base()); i < end && out.size() < kMaxBatchesPerPoll;
       ++i) {
    out.push_back(schedule_.at(i));
  }
  if (before_change && !out.empty() && out.back().index == marker_batch_) {
    // The marker: from here on the node speaks with its new session.
    Node& n = nodes_[caller];
    if (n.next_credential != 0) {
      n.old_credentials.push_back(n.credential);
      n.credential = n.next_credential;
      n.next_credential = 0;
    }
    out.back().membership = MembershipOf(caller);
    out.back().change = changes_.empty() ? "" : changes_.back().cause;
  }
  return out;
}

void Coordinator::TrimSchedule() {
  uint64_t seen_by_all = UINT64_MAX;
  for (const Node& n : nodes_) seen_by_all = std::min(seen_by_all, n.polled);
  schedule_.Trim(seen_by_all);
}

absl::StatusOr<HeartbeatAnswer> Coordinator::Heartbeat(uint64_t session, int rank,
                                                       std::vector<BucketWait> waiting) {
  if (waiting.size() > kMaxBucketsPerReport) {
    return absl::InvalidArgumentError(
        absl::StrCat(waiting.size(), " waiting buckets (limit ", kMaxBucketsPerReport, ")"));
  }
  for (const BucketWait& w : waiting) {
    if (absl::Status s = CheckName("bucket name", w.name); !s.ok()) return s;
    if (w.missing.size() > 4096 || !(w.seconds >= 0)) {
      return absl::InvalidArgumentError(absl::StrCat("bucket '", w.name, "': bad wait report"));
    }
  }
  absl::MutexLock lock(&mu_);
  if (rank < 0) return absl::InvalidArgumentError(absl::StrCat("node rank ", rank, " is negative"));
  int caller = -1;
  bool stale = false;
  if (absl::Status s = CheckMember(session, rank, &caller, &stale); !s.ok()) return s;
  HeartbeatAnswer answer{state_, failure_, stalls_.reports(), epoch_};
  answer.waits = stalls_.waits();
  if (stale) {
    // A survivor of a change: its new membership; what it waits for is
    // reported again once it runs in the new epoch.
    answer.membership = MembershipOf(caller);
    answer.change = changes_.empty() ? "" : changes_.back().cause;
    return answer;
  }
  nodes_[rank].waiting = std::move(waiting);
  return answer;
}

absl::Status Coordinator::Leave(uint64_t session, int rank) {
  absl::MutexLock lock(&mu_);
  if (rank < 0) return absl::InvalidArgumentError(absl::StrCat("node rank ", rank, " is negative"));
  if (absl::Status s = CheckMember(session, rank); !s.ok()) return s;
  Node& node = nodes_[rank];
  node.left = true;
  if (state_ == JobState::kRunning && elastic() && (rank != 0 || !options_.served_by_node0) &&
      (static_cast<int>(nodes_.size()) - 1 >= min_nodes() ||
       options_.elastic_timeout > absl::ZeroDuration())) {
    // An elastic job goes on without it at once (a preempted node's daemon
    // gets SIGTERM first): no peer timeout to wait for.
    const std::string cause = absl::StrCat("node ", rank, " (", node.name, ") left the job");
    FormEpochLocked({rank}, cause);
    NoteShortLocked(cause);
    return absl::OkStatus();
  }
  if (state_ == JobState::kRunning) {
    state_ = JobState::kFinished;
    failure_ = absl::StrCat("node ", rank, " (", node.name, ") left the job");
    store_.Fail(absl::FailedPreconditionError(absl::StrCat("job finished: ", failure_)));
  }
  return absl::OkStatus();
}

absl::Status Coordinator::ReportFailure(uint64_t session, int rank, const std::string& reason,
                                        bool data_plane, bool refused_transfer) {
  if (rank < 0) return absl::InvalidArgumentError(absl::StrCat("node rank ", rank, " is negative"));
  if (reason.size() > 4096) return absl::InvalidArgumentError("failure reason over 4096 bytes");
  absl::MutexLock lock(&mu_);
  if (absl::Status s = CheckMember(session, rank); !s.ok()) return s;
  const std::string text = absl::StrCat("node ", rank, " (", nodes_[rank].name, "): ", reason);
  if (refused_transfer && elastic() && state_ == JobState::kRunning) {
    // Every node's step fails with the data plane; none was lost. The
    // caller's session is this epoch's (CheckMember): once per refusal.
    // Refusals that keep coming (someone on a link alters every step) fail
    // the job instead of forming epoch after epoch.
    const std::string failed =
        ReformLocked(&refusals_, text, "sealed transfers were refused",
                     "the step failed on every node, the data plane is connected and keyed afresh");
    if (!failed.empty()) FailLocked(absl::StrCat(failed, " (--seal_failure=step)"));
    return absl::OkStatus();
  }
  if (data_plane && elastic() && state_ == JobState::kRunning) {
    // Perhaps a peer was lost: the watchdog decides (the first report held).
    if (held_failure_.empty() || held_epoch_ != epoch_) {
      held_failure_ = text;
      held_epoch_ = epoch_;
      held_until_ = absl::Now() + options_.peer_timeout + kDataPlaneGrace;
      MICROD_LOG(Warning,
                 "coordinator: %s; waiting up to %s for the peer timeout to tell whether a node "
                 "was lost",
                 text.c_str(),
                 absl::FormatDuration(options_.peer_timeout + kDataPlaneGrace).c_str());
    }
    return absl::OkStatus();
  }
  FailLocked(text);
  return absl::OkStatus();
}

std::string Coordinator::ReformLocked(std::deque<absl::Time>* recent, const std::string& text,
                                      const std::string& what, const std::string& done) {
  const absl::Time now = absl::Now();
  recent->push_back(now);
  while (!recent->empty() && recent->front() < now - options_.refusal_window) recent->pop_front();
  if (static_cast<int>(recent->size()) > options_.max_refusal_epochs) {
    return absl::StrCat(text, "; ", what, " ", recent->size(), " times within ",
                        absl::FormatDuration(options_.refusal_window),
                        " (each failed a step and formed a new epoch): more than ",
                        options_.max_refusal_epochs, ", so the job fails instead");
  }
  FormEpochLocked({}, absl::StrCat(text, "; ", done));
  return "";
}

JobSnapshot Coordinator::Snapshot() const {
  absl::MutexLock lock(&mu_);
  JobSnapshot s;
  s.state = state_;
  s.failure = failure_;
  s.expected_nodes = options_.expected_nodes;
  s.epoch = epoch_;
  s.min_nodes = elastic() ? min_nodes() : options_.expected_nodes;
  s.max_nodes = max_nodes();
  s.changes = changes_;
  s.rendezvous_keys = store_.size();
  for (const Node& n : nodes_) s.old_credentials += n.old_credentials.size();
  const absl::Time now = absl::Now();
  for (const Node& n : nodes_) {
    NodeSnapshot ns;
    ns.rank = n.rank;
    ns.name = n.name;
    ns.local_size = n.local_size;
    ns.left = n.left;
    ns.seconds_since_heartbeat =
        state_ == JobState::kForming ? -1.0 : absl::ToDoubleSeconds(now - n.last_seen);
    s.nodes.push_back(ns);
  }
  return s;
}

}  // namespace microd::control
