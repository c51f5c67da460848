// SPDX-License-Identifier: Apache-2.0
// The engine's side of an elastic job's changes of membership (engine.h):
// the data planes it holds, a failed step held for the coordinator's
// verdict (recovery.h), the next epoch's data plane connected, its state
// agreed (state_agreement.h), and every local process told its place.
#include <algorithm>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/common/log.h"
#include "daemon/common/status_macros.h"
#include "daemon/common/status_map.h"
#include "daemon/engine/engine.h"

namespace microd::engine {

transport::Transport* Engine::CurrentTransport() const {
  absl::MutexLock lock(&state_.mu);
  return transport_;
}

std::shared_ptr<transport::Transport> Engine::CurrentOwner() const {
  absl::MutexLock lock(&state_.mu);
  return current_;
}

void Engine::AdoptTransport(std::unique_ptr<transport::Transport> t) {
  absl::MutexLock lock(&state_.mu);
  if (t.get() != current_.get()) return;  // not the data plane it runs on
  current_ = std::shared_ptr<transport::Transport>(std::move(t));
}

int Engine::transports_held() const {
  absl::MutexLock lock(&state_.mu);
  return (current_ != nullptr ? 1 : 0) + (previous_ != nullptr ? 1 : 0);
}

bool Engine::Hold(const std::vector<Work>& works, const absl::Status& why) {
  // A refusal (this node's buckets or options are not the job's) is no lost
  // peer; nor is a sealed transfer that failed verification (an attacker on
  // a link): it fails the job, naming the link, unless --seal_failure=step
  // makes it fail the step on every node (the coordinator's next epoch).
  if (!recovery_.Holdable(why)) return false;
  const bool refused = absl::IsDataLoss(why);
  bool first = false;
  std::shared_ptr<transport::Transport> t;
  {
    absl::MutexLock lock(&state_.mu);
    if (!state_.failed.ok() || state_.stop) return false;
    auto& in_flight = state_.in_flight;
    for (const Work& w : works) {
      auto it = std::find_if(in_flight.begin(), in_flight.end(),
                             [&](const Work& x) { return x.answer == w.answer; });
      if (it != in_flight.end()) in_flight.erase(it);
    }
    first = recovery_.Hold(works, why);  // under the engine's lock: Fail ends it after
    t = current_;
  }
  if (first) {
    MICROD_LOG(Warning,
               "node %d: %s; holding the step for the coordinator's verdict (%s), up to %s",
               membership_.node_rank, std::string(why.message()).c_str(),
               refused ? "the next membership epoch, keyed afresh"
                       : "a lost node: the job's next membership epoch",
               absl::FormatDuration(options_.membership_wait).c_str());
    if (client_ != nullptr) {
      const std::string text(why.message());
      (void)(refused ? client_->ReportRefusedTransfer(text)
                     : client_->ReportDataPlaneFailure(text));
    }
    t->Abort(why);  // the other steps on this data plane end too
  }
  return true;
}

void Engine::OnMembership(const control::Membership& membership, const std::string& change) {
  const absl::Status why =
      absl::UnavailableError(absl::StrCat("the job's membership changed: ", change));
  if (!options_.elastic) {
    Fail(absl::AbortedError(absl::StrCat(why.message(),
                                         "; this node does not follow such "
                                         "changes (--min_nodes)")),
         /*report=*/true);
    return;
  }
  std::shared_ptr<transport::Transport> t;
  {
    absl::MutexLock lock(&state_.mu);
    if (!state_.failed.ok() || state_.stop) return;
    if (!recovery_.Offer(membership, change, membership_.epoch)) return;
    t = current_;
  }
  t->Abort(why);  // what runs on the old data plane ends now
}

void Engine::Reconfigure() {
  Recovery::Verdict verdict = recovery_.Await();
  if (verdict.ended) return;
  std::optional<std::pair<control::Membership, std::string>> next = std::move(verdict.next);
  const absl::Status cause = verdict.cause;
  if (!next.has_value()) {
    Fail(absl::Status(
             cause.code(),
             absl::StrCat(cause.message(), " (no change of the job's membership came within ",
                          absl::FormatDuration(options_.membership_wait), ")")),
         /*report=*/true);
    return;
  }
  // The old epoch's readers end: the poll (its poll failed, or it sees the
  // engine recovering) and the negotiator's own threads.
  if (poll_thread_.joinable()) poll_thread_.join();
  if (negotiator_ != nullptr) negotiator_->Join();
  std::vector<Work> pending;
  for (;;) {
    const absl::Status s = Reconfigured(next->first, next->second, &pending);
    if (s.ok()) break;
    const bool refused = absl::IsDataLoss(s);
    if (absl::IsFailedPrecondition(s) || (refused && !options_.seal_failure_step)) {
      // The nodes' states differ (no later epoch changes that), or a refused
      // transfer, which fails the job unless --seal_failure=step.
      Fail(absl::Status(s.code(), absl::StrCat("node ", membership_.node_rank,
                                               ": the job's next membership epoch: ", s.message())),
           /*report=*/true);
      return;
    }
    if (refused && client_ != nullptr) {
      // A transfer refused while the epoch's data plane connected (a byte
      // altered on a link): the coordinator keys the next epoch afresh, as
      // for a step's refusal, as often as it allows.
      (void)client_->ReportRefusedTransfer(
          absl::StrCat("epoch ", next->first.epoch, ": ", s.message()));
    }
    // Another node lost meanwhile (two lost a few heartbeats apart), or a
    // refusal: this epoch's data plane could not connect; the next epoch's
    // may.
    Recovery::Verdict newer = recovery_.Await(next->first.epoch);
    if (newer.ended) return;
    if (!newer.next.has_value()) {
      Fail(absl::Status(s.code(), absl::StrCat("node ", membership_.node_rank,
                                               ": the job's next membership epoch: ", s.message())),
           /*report=*/true);
      return;
    }
    MICROD_LOG(Warning, "node %d: epoch %llu did not connect (%s); epoch %llu instead",
               membership_.node_rank, static_cast<unsigned long long>(next->first.epoch),
               std::string(s.message()).c_str(),
               static_cast<unsigned long long>(newer.next->first.epoch));
    next = std::move(newer.next);
  }
  runner_.SetTransport(transport_);
  negotiator_ = NewNegotiator();
  poll_thread_ = std::thread([this, first = membership_.first_batch] { PollLoop(first); });
  Announce(next->second, pending);
}

void Engine::Announce(const std::string& change, const std::vector<Work>& pending) {
  // Every process learns its place first, then that its step was not applied.
  std::vector<std::pair<uint64_t, local::ProcessInfo>> told;
  {
    absl::MutexLock lock(&state_.mu);
    for (const auto& [client, local_rank] : state_.table.Clients()) {
      told.push_back({client, InfoOf(local_rank)});
    }
  }
  for (const auto& [client, info] : told) {
    if (server_ != nullptr) server_->NotifyMembership(client, membership_.epoch, info, change);
  }
  std::vector<Fence::Parked> fenced;
  {
    absl::MutexLock lock(&state_.mu);
    fenced = state_.fence.Told();
  }
  for (const Fence::Parked& f : fenced) {
    if (server_ != nullptr)
      server_->Complete(f.client, f.ticket, f.buffer_id, FencedStatus(f.bucket));
  }
  for (const Work& w : pending) {
    Complete(w, WithClientStatus(absl::AbortedError(absl::StrCat(
                                     "bucket '", w.bucket->name,
                                     "': this step was not applied: the job's "
                                     "membership changed (",
                                     change, "); epoch ", membership_.epoch, ": node ",
                                     membership_.node_rank, " of ", membership_.node_count,
                                     ", world size ", membership_.world_size, "; submit it again")),
                                 ClientStatus::kMembership));
  }
  const double took = recovery_.last_seconds();
  MICROD_LOG(Warning,
             "node %d of %d: membership epoch %llu running, %.3f s after the first sign of the "
             "change (%zu pending submission(s) answered MICROD_ERR_MEMBERSHIP)",
             membership_.node_rank, membership_.node_count,
             static_cast<unsigned long long>(membership_.epoch), took, pending.size());
}

absl::Status Engine::Reconfigured(const control::Membership& next, const std::string& change,
                                  std::vector<Work>* pending) {
  if (!options_.new_transport) {
    return absl::FailedPreconditionError("no way to connect a new data plane");
  }
  MICROD_LOG(Warning, "node %d: membership epoch %llu: now node %d of %d (%s)",
             membership_.node_rank, static_cast<unsigned long long>(next.epoch), next.node_rank,
             next.node_count, change.c_str());
  ASSIGN_OR_RETURN(std::unique_ptr<transport::Transport> made, options_.new_transport(next));
  std::shared_ptr<transport::Transport> t(std::move(made));
  {
    absl::MutexLock lock(&state_.mu);
    if (!state_.failed.ok() || state_.stop) {
      return absl::CancelledError("the engine stops: the next epoch is not run");
    }
    connecting_ = t;
  }
  const absl::Status agreed =
      AgreeOnState(*t, next, /*joining=*/joining_ && !adopted_, options_.op_timeout, *this);
  {
    absl::MutexLock lock(&state_.mu);
    connecting_ = nullptr;
  }
  RETURN_IF_ERROR(agreed);
  const sparsify::JobShape shape{next.node_count, next.node_rank, next.world_size};
  // The data plane two epochs back, released once the lock is (its
  // connections close and its threads end: not under the engine's lock).
  std::shared_ptr<transport::Transport> retired;
  absl::MutexLock lock(&state_.mu);
  for (Bucket* b : state_.table.WithState()) {
    if (b->state != nullptr) RETURN_IF_ERROR(b->state->SetJob(shape));
  }
  // The new epoch: every pending submission is answered, nothing is cached,
  // the schedule starts at the epoch's first batch.
  *pending = state_.table.TakeAllSubmitted();
  state_.fence.Change();
  for (Work& w : state_.in_flight) pending->push_back(std::move(w));
  state_.in_flight.clear();
  for (Work& w : recovery_.Done()) pending->push_back(std::move(w));
  state_.table.ResetCache();
  state_.schedule.clear();
  state_.log_run = 0;
  state_.changed = false;
  membership_ = next;
  refused_before_ += transport_->refused_transfers();
  confirmed_before_ += transport_->confirmed();
  retired = std::move(previous_);
  previous_ = std::move(current_);
  current_ = std::move(t);
  transport_ = current_.get();
  return absl::OkStatus();
}

std::vector<BucketStated> Engine::Buckets() {
  std::vector<BucketStated> out;
  absl::MutexLock lock(&state_.mu);
  for (Bucket* b : state_.table.WithState()) {
    if (b->state != nullptr)
      out.push_back({b->name, b->state->step(), b->state->controller_state()});
  }
  return out;
}

uint64_t Engine::Confirmed() {
  absl::MutexLock lock(&state_.mu);
  return confirmed_before_ + (transport_ != nullptr ? transport_->confirmed() : 0);
}

bool Engine::HasUnconfirmed() { return runner_.has_unconfirmed(); }

void Engine::Settle(bool commit) {
  if (!commit) {
    runner_.DropUnconfirmed();
    return;
  }
  // Its works are answered with their results, no longer held.
  recovery_.Release(runner_.RollForward());
  absl::MutexLock lock(&state_.mu);
  ++confirmed_before_;
}

void Engine::Adopt(std::map<std::string, BucketStated> buckets, uint64_t confirmed) {
  runner_.Adopt(std::move(buckets));
  adopted_ = true;
  absl::MutexLock lock(&state_.mu);
  confirmed_before_ = confirmed;
}

}  // namespace microd::engine
