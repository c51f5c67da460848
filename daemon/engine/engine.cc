// SPDX-License-Identifier: Apache-2.0
#include "daemon/engine/engine.h"

#include <algorithm>
#include <cstdio>
#include <numeric>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/common/hold_monitor.h"
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
  HoldMonitor::Process();  // watching from now: Fail says if this node was held
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

absl::Status Engine::WithHold(const absl::Status& reason) const {
  constexpr absl::string_view kSaid = "microd/held";  // said once, whichever path says it
  if (reason.ok() || reason.GetPayload(kSaid).has_value()) return reason;
  const absl::Duration held =
      HoldMonitor::Process().HeldWithin(options_.peer_timeout + absl::Seconds(5));
  if (held < options_.peer_timeout / 2) return reason;
  absl::Status s = WithMessage(
      reason, absl::StrCat("node ", membership_.node_rank, " (this node) was held for ",
                           absl::FormatDuration(absl::Trunc(held, absl::Milliseconds(100))),
                           " (its daemon stopped or not scheduled; the peer timeout is ",
                           absl::FormatDuration(options_.peer_timeout),
                           "): the other nodes may have given up on it; here: ", reason.message()));
  s.SetPayload(kSaid, absl::Cord());
  return s;
}

void Engine::Fail(const absl::Status& failure, bool report) {
  const bool ended = failure.code() == absl::StatusCode::kFailedPrecondition ||
                     failure.code() == absl::StatusCode::kCancelled;
  const absl::Status reason = ended ? failure : WithHold(failure);
  std::vector<Work> pending;
  std::vector<Fence::Parked> fenced;  // refused by the fence, not answered yet
  std::shared_ptr<transport::Transport> connecting;
  {
    absl::MutexLock lock(&state_.mu);
    if (!state_.failed.ok()) return;
    state_.failed = JobFailed(reason);
    connecting = connecting_;
    fenced = state_.fence.TakeParked();
    pending = state_.table.TakeAllSubmitted();
    for (Work& w : state_.in_flight) pending.push_back(std::move(w));
    state_.in_flight.clear();
    for (Work& w : recovery_.End()) pending.push_back(std::move(w));
    state_.table.DropNewlyReady();
  }
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
  if (connecting != nullptr) connecting->Abort(reason);  // the next epoch's first rounds
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

std::string Engine::OnWaiting(uint64_t client, uint32_t buffer_id) {
  std::string name, here;
  bool others = false;
  {
    absl::MutexLock lock(&state_.mu);
    if (!state_.failed.ok()) return absl::StrCat("the job failed: ", state_.failed.message());
    const int r = membership_.node_rank;
    std::string node = absl::StrCat("node ", r);
    if (r >= 0 && static_cast<size_t>(r) < membership_.node_names.size()) {
      absl::StrAppend(&node, " (", membership_.node_names[r], ")");
    }
    here = state_.table.WaitingFor(client, buffer_id, absl::Now(), node, &name, &others);
  }
  if (!others || client_ == nullptr) return here;
  const std::string prefix = absl::StrCat("bucket '", name, "' ");
  for (const std::string& report : client_->Reports()) {
    if (absl::StartsWith(report, prefix)) return absl::StrCat(here, "; the coordinator: ", report);
  }
  return absl::StrCat(here,
                      "; the coordinator has no report of it yet (nodes report waits of a "
                      "second or more, a heartbeat apart)");
}

absl::Status Engine::WithRootCause(const absl::Status& failure) {
  const absl::Status local = WithHold(failure);
  if (client_ == nullptr) return local;
  const absl::Status job = client_->RefreshJobStatus();
  if (job.ok()) return local;
  return WithMessage(local, absl::StrCat(job.message(), " (here: ", local.message(), ")"));
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
