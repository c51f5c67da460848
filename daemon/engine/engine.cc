// SPDX-License-Identifier: Apache-2.0
#include "daemon/engine/engine.h"

#include <algorithm>
#include <cstdio>
#include <numeric>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "daemon/common/log.h"
#include "daemon/common/status_macros.h"
#include "daemon/common/status_map.h"

namespace microd::engine {
namespace {

constexpr absl::Duration kPollSlice = absl::Seconds(1);

}  // namespace

absl::Status JobFailed(const absl::Status& why) {
  return WithClientStatus(absl::AbortedError(why.message()), ClientStatus::kJobFailed);
}

Engine::Engine(EngineOptions options, control::Membership membership, control::ControlPlane* client,
               transport::Transport* transport, kernels::SparseOps* ops)
    : options_(std::move(options)),
      membership_(std::move(membership)),
      client_(client),
      transport_(transport),
      current_(transport, [](transport::Transport*) {}),
      ops_(ops),
      joining_(membership_.epoch > 0 && membership_.graceful),
      state_(options_.local_size, options_.dense_floor),
      recovery_(options_.membership_wait, options_.elastic, options_.seal_failure_step),
      memory_(MakeStepMemory(options_.device_resident, options_.device, ops)),
      runner_(options_, membership_, transport, ops, memory_.get(), &state_, this) {
  absl::MutexLock lock(&state_.mu);
  state_.table.SetStateBudget(
      {options_.state_budget, options_.state_budget_source,
       [sparsify = options_.sparsify, n = membership_.node_count](uint64_t count, bool dense) {
         // A dense bucket: its slot in the batch's fusion buffer, and its
         // velocity under momentum correction. A sparse one: its state
         // (several local processes are summed in place: nothing more).
         return dense ? (sparsify.momentum > 0 ? 2 : 1) * count * sizeof(float)
                      : sparsify::BucketState::MemoryBytes(count, n, sparsify);
       }});
}

Engine::~Engine() { Stop(absl::CancelledError("the daemon is shutting down")); }

void Engine::Start() {
  negotiator_ = NewNegotiator();
  thread_ = std::thread([this] { Loop(); });
  poll_thread_ = std::thread([this, next = membership_.first_batch] { PollLoop(next); });
}

void Engine::Stop(const absl::Status& reason) {
  {
    absl::MutexLock lock(&state_.mu);
    if (state_.stop) return;
    state_.stop = true;
  }
  Fail(reason, /*report=*/false);
  if (thread_.joinable()) thread_.join();
  if (poll_thread_.joinable()) poll_thread_.join();
  if (negotiator_ != nullptr) negotiator_->Join();
}

void Engine::Fail(const absl::Status& reason, bool report) {
  std::vector<Work> pending;
  std::vector<Fence::Parked> fenced;  // refused by the fence, not answered yet
  {
    absl::MutexLock lock(&state_.mu);
    if (!state_.failed.ok()) return;
    state_.failed = JobFailed(reason);
    fenced = state_.fence.TakeParked();
    pending = state_.table.TakeAllSubmitted();
    for (Work& w : state_.in_flight) pending.push_back(std::move(w));
    state_.in_flight.clear();
    for (Work& w : recovery_.End()) pending.push_back(std::move(w));
    state_.table.DropNewlyReady();
  }
  const bool ended = reason.code() == absl::StatusCode::kFailedPrecondition ||
                     reason.code() == absl::StatusCode::kCancelled;
  if (ended) {
    MICROD_LOG(Info, "node %d: job ended: %s", membership_.node_rank,
               std::string(reason.message()).c_str());
  } else {
    MICROD_LOG(Error, "node %d: job failed: %s", membership_.node_rank,
               std::string(reason.message()).c_str());
  }
  // Tell the coordinator first, so that peers whose steps break when this
  // node aborts its transport find the root cause there.
  if (report && client_ != nullptr) (void)client_->ReportFailure(std::string(reason.message()));
  // Unblock a step in flight, here and (by closed connections) on the peers.
  CurrentOwner()->Abort(reason);
  const absl::Status status = JobFailed(reason);
  for (const Work& w : pending) Complete(w, status);
  for (const Fence::Parked& f : fenced) {
    if (server_ != nullptr) server_->Complete(f.client, f.ticket, f.buffer_id, status);
  }
}

absl::StatusOr<local::ProcessInfo> Engine::OnHello(uint64_t client, int requested_local_rank,
                                                   pid_t pid) {
  absl::MutexLock lock(&state_.mu);
  if (!state_.failed.ok()) return state_.failed;
  auto rank = state_.table.Hello(client, requested_local_rank, pid);
  if (!rank.ok()) return rank.status();
  state_.fence.Connect(client);
  return InfoOf(*rank);
}

absl::Status Engine::FencedStatus(const std::string& bucket) const {
  return WithClientStatus(
      absl::AbortedError(absl::StrCat(
          "bucket '", bucket,
          "': submitted before this process read the change of the job's membership to epoch ",
          membership_.epoch, " (node ", membership_.node_rank, " of ", membership_.node_count,
          ", world size ", membership_.world_size, "): not applied; submit it again")),
      ClientStatus::kMembership);
}

local::ProcessInfo Engine::InfoOf(int local_rank) const {
  local::ProcessInfo info;
  info.local_rank = local_rank;
  info.local_size = options_.local_size;
  info.node_rank = membership_.node_rank;
  info.node_count = membership_.node_count;
  info.world_size = membership_.world_size;
  info.momentum_correction = static_cast<float>(options_.sparsify.momentum);
  info.epoch = membership_.epoch;
  info.rank = std::accumulate(membership_.local_sizes.begin(),
                              membership_.local_sizes.begin() + membership_.node_rank, 0) +
              local_rank;
  return info;
}

absl::Status Engine::OnRegister(uint64_t client, uint32_t buffer_id, const std::string& name,
                                bool dense, std::shared_ptr<local::ProcessBuffer> buffer) {
  RETURN_IF_ERROR(memory_->Admit(name, *buffer));
  std::vector<Work> refused;
  absl::Status result;
  {
    absl::MutexLock lock(&state_.mu);
    if (!state_.failed.ok()) return state_.failed;
    result = state_.table.Register(client, buffer_id, name, dense, std::move(buffer), &refused);
  }
  for (const Work& w : refused) Complete(w, result);
  return result;
}

absl::Status Engine::OnSubmit(uint64_t client, uint32_t buffer_id, uint64_t ticket,
                              std::optional<uint32_t> changes_seen) {
  absl::MutexLock lock(&state_.mu);
  if (!state_.failed.ok()) return state_.failed;
  if (const Fence::Verdict v = state_.fence.Check(client, changes_seen);
      v != Fence::Verdict::kPass) {
    // Made before the process heard of a change: not for the new epoch.
    const std::string bucket = state_.table.BufferName(client, buffer_id);
    if (v == Fence::Verdict::kRefuse) return FencedStatus(bucket);
    state_.fence.Park({client, buffer_id, ticket, bucket});  // told first, then answered
    return absl::OkStatus();
  }
  auto ready = state_.table.Submit(client, buffer_id, ticket);
  if (!ready.ok()) return ready.status();
  if (*ready == ProcessTable::Ready::kCached) state_.changed = true;  // the next cycle's
  state_.last_submit = absl::Now();
  return absl::OkStatus();
}

void Engine::OnDisconnect(uint64_t client, bool clean, const std::string& why) {
  std::string reason;
  StateRequest abandoned;  // a state request the leaving process will never join
  {
    absl::MutexLock lock(&state_.mu);
    StateRequest& q = state_.state_request;
    if (q.asked > 0 && !state_.state_request.ready) {
      auto rank = state_.table.LocalRankOf(client);
      if (rank.ok() && q.tickets[*rank] == 0) {
        abandoned = std::move(q);
        q = StateRequest{};
      }
    }
    reason = state_.table.Disconnect(client, clean, why, membership_.node_rank);
    state_.fence.Disconnect(client);
  }
  if (abandoned.asked > 0) {
    AnswerStateRequest(
        abandoned, absl::FailedPreconditionError(absl::StrCat(
                       "a local process of node ", membership_.node_rank, " left before asking to ",
                       abandoned.save ? "save" : "load", " the state")));
  }
  if (!reason.empty()) Fail(absl::AbortedError(reason), /*report=*/true);
}

std::vector<control::BucketWait> Engine::Waiting(absl::Duration at_least, size_t limit) const {
  absl::MutexLock lock(&state_.mu);
  if (!state_.failed.ok()) return {};
  return state_.table.Waiting(absl::Now(), at_least, limit);
}

absl::Status Engine::WithRootCause(const absl::Status& local) {
  if (client_ == nullptr) return local;
  const absl::Status job = client_->RefreshJobStatus();
  if (job.ok()) return local;
  return absl::Status(local.code(), absl::StrCat(job.message(), " (here: ", local.message(), ")"));
}

void Engine::Complete(const Work& w, const absl::Status& status) {
  w.Finish(status,
           [this](uint64_t client, uint64_t ticket, uint32_t buffer_id, const absl::Status& s) {
             if (server_ != nullptr) server_->Complete(client, ticket, buffer_id, s);
           });
}

void Engine::Finish(const Work& w, const absl::Status& status) {
  {
    absl::MutexLock lock(&state_.mu);
    auto& in_flight = state_.in_flight;
    auto it = std::find_if(in_flight.begin(), in_flight.end(),
                           [&](const Work& x) { return x.answer == w.answer; });
    if (it != in_flight.end()) in_flight.erase(it);
  }
  Complete(w, status);  // nothing when Fail() answered it already
}

void Engine::PollLoop(uint64_t next) {
  for (;;) {
    {
      absl::MutexLock lock(&state_.mu);
      // Recovering: the next epoch's poll starts once the engine
      // reconfigured (which waits for this one to end). A heartbeat may have
      // brought the new epoch's session before a poll failed with the old
      // one: this poll would then go on, finding nothing, for good.
      if (state_.stop || !state_.failed.ok() || recovery_.recovering()) return;
    }
    // Short polls, so that a stopping engine is never held up for long.
    auto batches = client_->Poll(next, absl::Now() + std::min(options_.op_timeout, kPollSlice));
    if (!batches.ok()) {
      {
        absl::MutexLock lock(&state_.mu);
        if (state_.stop) return;
      }
      // An elastic job's change of membership ends the poll: the next
      // epoch's poll starts once the engine reconfigured.
      if (!Hold({}, batches.status())) Fail(batches.status(), /*report=*/false);
      return;
    }
    if (batches->empty()) continue;
    next = batches->back().index + 1;
    absl::MutexLock lock(&state_.mu);
    // Polled with a new epoch's session while the engine recovers: the next
    // epoch's poll reads them again, from its first batch.
    if (recovery_.recovering()) return;
    bool marker = false;
    for (auto& b : *batches) {
      marker = marker || b.change_epoch != 0;
      state_.schedule.push_back(std::move(b));
    }
    state_.changed = true;
    // The old epoch's last batch: the next epoch's poll starts after it.
    if (marker) return;
  }
}

std::unique_ptr<Negotiator> Engine::NewNegotiator() {
  Speculator speculate;
  if (!options_.device_resident) {
    speculate = [this](const std::vector<size_t>& ids) { return runner_.Speculate(ids); };
  }
  return MakeNegotiator(options_, membership_, client_, transport_, ops_, &state_, this,
                        std::move(speculate));
}

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
  ASSIGN_OR_RETURN(std::unique_ptr<transport::Transport> t, options_.new_transport(next));
  RETURN_IF_ERROR(
      AgreeOnState(*t, next, /*joining=*/joining_ && !adopted_, options_.op_timeout, *this));
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
  current_ = std::shared_ptr<transport::Transport>(std::move(t));
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

void Engine::Loop() {
  if (joining_) {
    // Joined the running job: the job's state first, before any step. A
    // node lost meanwhile: the next epoch's data plane, as for the others.
    if (absl::Status s = AgreeOnState(*CurrentTransport(), membership_, /*joining=*/true,
                                      options_.op_timeout, *this);
        !s.ok() && (absl::IsFailedPrecondition(s) || !Hold({}, s))) {
      Fail(absl::Status(s.code(), absl::StrCat("node ", membership_.node_rank,
                                               ": joining the running job: ", s.message())),
           /*report=*/true);
    }
  }
  for (;;) {
    bool running;
    {
      absl::MutexLock lock(&state_.mu);
      running = state_.failed.ok() && !state_.stop;
    }
    if (running && recovery_.recovering()) {
      Reconfigure();
      continue;
    }
    RunStateRequest();
    std::optional<Plan> plan = negotiator_->Next();
    if (!plan.has_value()) return;
    Run(*plan);
    // A node joined: the plan that held the old epoch's last batch ended
    // on every node (a job that ended meanwhile recovers nothing). Under
    // the engine's lock, so that its waits see it.
    absl::MutexLock lock(&state_.mu);
    recovery_.StartIfDue();
  }
}

void Engine::Run(Plan& plan) {
  for (const control::ScheduleBatch& batch : plan.batches) {
    if (state_.job_failed()) return;
    RunBatch(batch, /*cached=*/false);
  }
  if (!plan.in_cycle.ids.empty()) {
    RunInCycle(plan.in_cycle, /*count_batch=*/plan.cached.scheduled.empty());
  }
  if (!plan.cached.scheduled.empty()) RunBatch(plan.cached, /*cached=*/true, plan.speculation);
}

void Engine::RunInCycle(const InCycle& in_cycle, bool count_batch) {
  std::vector<Work> works;
  {
    absl::MutexLock lock(&state_.mu);
    if (!state_.failed.ok()) return;
    if (count_batch) ++state_.counts.cache_batches;
    const absl::Time now = absl::Now();
    for (size_t i : in_cycle.ids) {
      Bucket& b = state_.table.cached(i);
      b.stats.AddWaiting(absl::ToDoubleSeconds(now - b.ready_at));
      works.push_back(state_.table.Take(b));
    }
    state_.in_flight.insert(state_.in_flight.end(), works.begin(), works.end());
  }
  runner_.FinishInCycle(works, in_cycle);
}

void Engine::RunBatch(const control::ScheduleBatch& batch, bool cached,
                      std::shared_ptr<Speculation> speculation) {
  std::vector<Work> dense, sparse;
  std::vector<std::pair<Work, absl::Status>> refused;
  {
    absl::MutexLock lock(&state_.mu);
    ++(cached ? state_.counts.cache_batches : state_.counts.batches);
    if (!state_.failed.ok()) return;
    if (batch.change_epoch != 0) recovery_.ChangeDue();
    for (const auto& [name, message] : batch.errors) {
      Bucket& b = state_.table.bucket(name);
      ++b.stats.failures;
      refused.push_back({state_.table.Take(b), WithClientStatus(absl::InvalidArgumentError(message),
                                                                ClientStatus::kMismatch)});
    }
    const absl::Time now = absl::Now();
    for (const control::BucketInfo& info : batch.scheduled) {
      Bucket& b = state_.table.bucket(info.name);
      b.stats.AddWaiting(absl::ToDoubleSeconds(now - b.ready_at));
      (b.dense ? dense : sparse).push_back(state_.table.Take(b));
      // Scheduled by the coordinator: every node reaches this point in the
      // same log order, so the cache ids agree everywhere.
      if (options_.response_cache) state_.table.Cache(b);
    }
    // While they run, Fail() can answer them (a collective blocked on a peer
    // that failed may only return at its timeout).
    state_.in_flight.insert(state_.in_flight.end(), dense.begin(), dense.end());
    state_.in_flight.insert(state_.in_flight.end(), sparse.begin(), sparse.end());
  }
  for (auto& [w, s] : refused) Complete(w, s);
  if (!dense.empty()) runner_.RunFusedDense(dense);
  if (!sparse.empty()) runner_.RunSparse(sparse, std::move(speculation));
  std::vector<const Work*> ran;
  for (const std::vector<Work>* ws : {&dense, &sparse}) {
    for (const Work& w : *ws) ran.push_back(&w);
  }
  if (absl::Status s = memory_->EndBatch(ran, options_.op_timeout); !s.ok()) {
    Fail(absl::Status(s.code(), absl::StrCat("node ", membership_.node_rank, ": ", s.message())),
         /*report=*/true);
  }
}

EngineSnapshot Engine::Snapshot(bool with_history) const {
  absl::MutexLock lock(&state_.mu);
  EngineSnapshot s;
  s.failure = state_.failed.ok() ? "" : std::string(state_.failed.message());
  s.batches = state_.counts.batches;
  s.cache_batches = state_.counts.cache_batches;
  s.cycle_reductions = state_.counts.cycle_reductions;
  s.transport_scratch_bytes = transport_ != nullptr ? transport_->scratch_bytes() : 0;
  s.sealed = transport_ != nullptr && transport_->sealed();
  s.refused_transfers =
      refused_before_ + (transport_ != nullptr ? transport_->refused_transfers() : 0);
  s.epoch = membership_.epoch;
  s.last_recovery_seconds = recovery_.last_seconds();
  s.buckets = state_.table.Stats(with_history);
  return s;
}

}  // namespace microd::engine
