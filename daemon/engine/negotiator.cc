// SPDX-License-Identifier: Apache-2.0
#include "daemon/engine/negotiator.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "daemon/engine/cycle_message.h"

namespace microd::engine {
namespace {

class CoordinatorNegotiator final : public Negotiator {
 public:
  CoordinatorNegotiator(control::ControlPlane* client, EngineState* state, JobControl* job)
      : client_(client), state_(state), job_(job) {}

  std::optional<Plan> Next() override {
    std::vector<control::BucketInfo> report;
    Plan plan;
    {
      absl::MutexLock lock(&state_->mu);
      auto has_work = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu) {
        return state_->stop || state_->table.has_newly_ready() || !state_->schedule.empty() ||
               state_->state_request.ready || job_->recovering();
      };
      state_->mu.AwaitWithTimeout(absl::Condition(&has_work), absl::Seconds(1));
      if (state_->stop) return std::nullopt;
      if (!state_->failed.ok()) {
        state_->table.DropNewlyReady();
        state_->schedule.clear();
        return plan;
      }
      if (job_->recovering()) return plan;  // the engine reconfigures first
      // While an elastic job recovers, what becomes ready is reported in
      // the next epoch.
      if (!job_->recovering()) report = state_->table.TakeNewlyReady();
      if (!state_->schedule.empty()) {
        plan.batches.push_back(std::move(state_->schedule.front()));
        state_->schedule.pop_front();
      }
    }
    if (!report.empty()) {
      if (absl::Status s = client_->Report(report); !s.ok()) {
        if (!job_->Hold({}, s)) job_->Fail(s, /*report=*/false);
        return Plan{};
      }
    }
    return plan;
  }

 private:
  control::ControlPlane* const client_;
  EngineState* const state_;
  JobControl* const job_;
};

// One long-lived thread that runs a task beside its caller, who then waits
// for it: the cycle's speculative passes (a thread a cycle cost its start).
class Beside {
 public:
  Beside() : thread_([this] { Loop(); }) {}
  ~Beside() {
    {
      absl::MutexLock lock(&mu_);
      quit_ = true;
    }
    thread_.join();
  }
  void Start(std::function<void()> task) {
    absl::MutexLock lock(&mu_);
    task_ = std::move(task);
  }
  void Wait() {
    absl::MutexLock lock(&mu_);
    auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return task_ == nullptr; };
    mu_.Await(absl::Condition(&idle));
  }

 private:
  void Loop() {
    for (;;) {
      std::function<void()> task;
      {
        absl::MutexLock lock(&mu_);
        auto woken = [this]()
                         ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return task_ != nullptr || quit_; };
        mu_.Await(absl::Condition(&woken));
        if (task_ == nullptr) return;  // quit, nothing left to run
        task = task_;
      }
      task();
      absl::MutexLock lock(&mu_);
      task_ = nullptr;
    }
  }

  absl::Mutex mu_;
  std::function<void()> task_ ABSL_GUARDED_BY(mu_);
  bool quit_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: it starts once the rest is built
};

class CycleNegotiator final : public Negotiator {
 public:
  CycleNegotiator(const EngineOptions& options, const control::Membership& membership,
                  control::ControlPlane* client, transport::Transport* transport,
                  kernels::SparseOps* ops, EngineState* state, JobControl* job,
                  Speculator speculate)
      : speculate_(std::move(speculate)),
        options_(options),
        membership_(membership),
        client_(client),
        transport_(transport),
        ops_(ops),
        state_(state),
        job_(job) {
    report_thread_ = std::thread([this] { ReportLoop(); });
    if (speculate_) beside_ = std::make_unique<Beside>();
  }

  std::optional<Plan> Next() override;
  void Join() override {
    quit_ = true;
    if (report_thread_.joinable()) report_thread_.join();
  }

 private:
  // A small dense bucket ready here that rides in the cycle: its local sum
  // goes in the message.
  struct ToSend {
    size_t id;
    uint64_t count;
    std::vector<std::shared_ptr<local::ProcessBuffer>> buffers;
  };

  // This node's message (without the local sums yet), the buckets whose
  // local sums go in it, and where (slot, by cache id; kNoSlot: none); the
  // sparse cached buckets ready here (`sparse`, ascending).
  CycleMessage Prepare(std::vector<uint64_t>* slot, std::vector<ToSend>* to_send,
                       std::vector<size_t>* sparse);
  // The local sums into `mine` (host memory; none with a NaN/Inf: those go
  // the usual way, which reports it).
  void SumForCycle(const std::vector<ToSend>& to_send, const std::vector<uint64_t>& slot,
                   CycleMessage* mine);
  // Every node's message, in node order.
  absl::StatusOr<std::vector<CycleMessage>> Exchange(const CycleMessage& mine);
  // One cycle: what every node agrees to run.
  Plan Cycle();
  // How long a cycle waits for the submissions of a burst: a twentieth of a
  // round on the data plane, between 50 us and 2 ms.
  absl::Duration QuietTime() const {
    const transport::LinkModel* m = transport_->link_model();
    const double round = m != nullptr ? m->round_seconds : 1e-3;
    return absl::Seconds(std::clamp(round / 20, 50e-6, 2e-3));
  }
  void ReportLoop();

  static constexpr uint64_t kNoSlot = ~uint64_t{0};

  const Speculator speculate_;

  const EngineOptions& options_;
  const control::Membership& membership_;
  control::ControlPlane* const client_;
  transport::Transport* const transport_;
  kernels::SparseOps* const ops_;
  EngineState* const state_;
  JobControl* const job_;
  bool progressed_ = false;  // the last cycle ran something
  std::atomic<bool> quit_{false};
  sparsify::DeviceBuffer<kernels::StepScalars> scalars_;
  std::thread report_thread_;
  std::unique_ptr<Beside> beside_;  // the speculative passes' thread
};

std::optional<Plan> CycleNegotiator::Next() {
  {
    absl::MutexLock lock(&state_->mu);
    auto pending = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu) {
      return !state_->schedule.empty() || state_->table.any_cached_ready();
    };
    auto go = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu) {
      return state_->stop || state_->state_request.ready || job_->recovering() ||
             (pending() && (state_->changed || progressed_));
    };
    // A change (a submission, a schedule batch) starts a cycle at once.
    // With work pending but nothing new, the next cycle starts after 1 ms:
    // the others may be waiting in one for this node (two nodes each with
    // a bucket the other has not submitted yet would otherwise spin).
    state_->mu.AwaitWithTimeout(absl::Condition(&go),
                                pending() ? absl::Milliseconds(1) : absl::Seconds(1));
    if (state_->stop) return std::nullopt;
    if (job_->recovering()) {  // the engine reconfigures first
      progressed_ = false;
      return Plan{};
    }
    if (!state_->failed.ok()) {
      state_->schedule.clear();
      progressed_ = false;
      return Plan{};
    }
    if (!pending()) return Plan{};
    // A burst of submissions (a step's buckets, submitted one after another)
    // goes into one cycle: a cycle costs a round, and one that agrees on the
    // first bucket alone leaves the rest to another cycle and another
    // batch. So the cycle starts once no submission came for a sliver of a
    // round (bounded: a steady trickle does not hold it back).
    const absl::Duration quiet = QuietTime();
    const absl::Time give_up = absl::Now() + 10 * quiet;
    for (absl::Time now = absl::Now(); now < give_up && now - state_->last_submit < quiet;
         now = absl::Now()) {
      state_->mu.AwaitWithTimeout(absl::Condition(&state_->stop),
                                  quiet - (now - state_->last_submit));
      if (state_->stop) return std::nullopt;
    }
    state_->changed = false;
  }
  Plan plan = Cycle();
  progressed_ = !plan.empty();
  return plan;
}

CycleMessage CycleNegotiator::Prepare(std::vector<uint64_t>* slot, std::vector<ToSend>* to_send,
                                      std::vector<size_t>* sparse) {
  // The room, in floats: --cycle_floats, but the whole allgather kept under
  // 256 KiB, where the transport sends it to every peer in one round.
  const uint64_t per_node = (uint64_t{64} << 10) / membership_.node_count;
  const uint64_t room =
      std::min<uint64_t>(options_.cycle_floats, per_node > 512 ? per_node - 512 : 0);
  absl::MutexLock lock(&state_->mu);
  ProcessTable& table = state_->table;
  const size_t ids = table.cached_count();
  slot->assign(ids, kNoSlot);
  uint64_t floats = 0;
  const bool ride = !options_.device_resident && room > 0;
  for (size_t i = 0; i < ids && ride; ++i) {
    const Bucket& b = table.cached(i);
    if (!b.dense || floats + b.count > room) continue;
    (*slot)[i] = floats;
    floats += b.count;
    if (table.cached_ready(i)) to_send->push_back({i, b.count, b.buffers});
  }
  CycleMessage mine = CycleMessage::Empty(ids, floats);
  mine.batches_received = state_->log_run + state_->schedule.size();
  for (size_t i = 0; i < ids; ++i) {
    if (!table.cached_ready(i)) continue;
    mine.SetReady(i);
    if (!table.cached(i).dense) sparse->push_back(i);
  }
  return mine;
}

void CycleNegotiator::SumForCycle(const std::vector<ToSend>& to_send,
                                  const std::vector<uint64_t>& slot, CycleMessage* mine) {
  if (to_send.empty() || !scalars_.Reserve(ops_, 1)) return;
  for (const ToSend& t : to_send) {
    std::vector<const float*> inputs;
    for (const auto& buf : t.buffers) {
      if (buf == nullptr || buf->device() != nullptr) break;  // CUDA ones need staging
      if (buf->half() != nullptr &&
          ops_->HalfToFloat(buf->half(), static_cast<kernels::ElementType>(buf->dtype()),
                            buf->count(), buf->data(), nullptr) != kernels::KernelStatus::kOk) {
        break;
      }
      inputs.push_back(buf->data());
    }
    if (inputs.size() != t.buffers.size()) continue;
    kernels::StepScalars sc{};
    if (ops_->LocalSum(inputs.data(), static_cast<int>(inputs.size()), t.count,
                       mine->area.data() + slot[t.id], scalars_.get(),
                       nullptr) != kernels::KernelStatus::kOk ||
        ops_->CopyToHost(&sc, scalars_.get(), sizeof sc, nullptr) != kernels::KernelStatus::kOk ||
        sc.nonfinite != 0) {
      continue;
    }
    mine->SetSent(t.id);
  }
}

absl::StatusOr<std::vector<CycleMessage>> CycleNegotiator::Exchange(const CycleMessage& mine) {
  const int n = membership_.node_count;
  const std::vector<uint64_t> encoded = mine.Encode();
  const size_t words = encoded.size();
  transport::CollectiveOptions o;
  o.tag = transport::MakeTag(0, transport::TagKind::kCycle);
  // A failed peer ends the wait through Fail(), a stall past
  // --stall_abort_s through the coordinator; a cycle that waits past
  // peer_wait fails the job.
  o.deadline = absl::Now() + options_.peer_wait;
  // A direct round whose receives the cycle before posted: one trip.
  std::vector<std::string> from;
  absl::Status s = transport_->ExchangeRound(
      std::string_view(reinterpret_cast<const char*>(encoded.data()), words * sizeof(uint64_t)),
      &from, o);
  // The next cycle's receives, sized by this node's own message: a peer's
  // longer one takes a second transfer, and sizes nothing here.
  if (s.ok()) transport_->Expect(o.tag, 2 * words * sizeof(uint64_t));
  if (absl::IsDeadlineExceeded(s)) {
    return absl::DeadlineExceededError(absl::StrCat(
        "node ", membership_.node_rank, " waited ", absl::FormatDuration(options_.peer_wait),
        " for the other nodes to agree on the next buckets (", s.message(), ")"));
  }
  if (!s.ok()) return s;
  std::vector<CycleMessage> theirs;
  for (int r = 0; r < n; ++r) {
    if (from[r].size() != words * sizeof(uint64_t)) {
      return absl::DataLossError(absl::StrCat("node ", r, "'s cycle message has ", from[r].size(),
                                              " bytes, not ", words * sizeof(uint64_t), " (node ",
                                              membership_.node_rank, ")"));
    }
    std::vector<uint64_t> words_of(words);
    if (words > 0) std::memcpy(words_of.data(), from[r].data(), words * sizeof(uint64_t));
    auto m = CycleMessage::Decode(absl::MakeConstSpan(words_of), mine.ids, mine.area.size());
    if (!m.ok()) {
      return absl::Status(m.status().code(), absl::StrCat("node ", r, ": ", m.status().message(),
                                                          " (node ", membership_.node_rank, ")"));
    }
    theirs.push_back(std::move(m).value());
  }
  return theirs;
}

Plan CycleNegotiator::Cycle() {
  std::vector<uint64_t> slot;
  std::vector<ToSend> to_send;
  std::vector<size_t> sparse;
  CycleMessage mine = Prepare(&slot, &to_send, &sparse);
  const absl::Time start = absl::Now();
  SumForCycle(to_send, slot, &mine);
  const double local_sum = absl::ToDoubleSeconds(absl::Now() - start);
  const absl::Time t0 = absl::Now();
  // The ready sparse buckets' local passes run beside the exchange (they
  // touch no transport and no state a step would see).
  std::shared_ptr<Speculation> speculation;
  const bool speculating = beside_ != nullptr && !sparse.empty();
  if (speculating) beside_->Start([&] { speculation = speculate_(sparse); });
  auto theirs = Exchange(mine);
  if (speculating) beside_->Wait();
  if (!theirs.ok()) {
    if (!state_->job_failed() && !job_->Hold({}, theirs.status())) {
      job_->Fail(job_->WithRootCause(theirs.status()), /*report=*/true);
    }
    return Plan{};  // or Fail() ended the cycle
  }
  const double exchange = absl::ToDoubleSeconds(absl::Now() - t0);
  const CycleAgreement agreed = Intersect(*theirs);
  Plan plan;
  absl::MutexLock lock(&state_->mu);
  if (!state_->failed.ok()) return plan;
  // First the schedule batches every node has, in log order.
  while (state_->log_run < agreed.batches && !state_->schedule.empty()) {
    plan.batches.push_back(std::move(state_->schedule.front()));
    state_->schedule.pop_front();
    ++state_->log_run;
  }
  // Then the cached buckets ready on every node, in id order: those every
  // node sent along are reduced already, the others run as a batch. (Ids
  // the batches above assign have no agreed bits yet.)
  for (size_t i = 0; i < mine.ids; ++i) {
    if (!agreed.IsReady(i)) continue;
    if (agreed.IsSent(i)) {
      plan.in_cycle.ids.push_back(i);
      plan.in_cycle.at.push_back(slot[i]);
    } else {
      plan.cached.scheduled.push_back(ProcessTable::InfoOf(state_->table.cached(i)));
    }
  }
  if (!plan.cached.scheduled.empty()) plan.speculation = std::move(speculation);
  if (!plan.in_cycle.ids.empty()) {
    for (const CycleMessage& m : *theirs) {
      plan.in_cycle.area.insert(plan.in_cycle.area.end(), m.area.begin(), m.area.end());
    }
    plan.in_cycle.floats = mine.area.size();
    plan.in_cycle.local_sum_start = start;
    plan.in_cycle.local_sum_seconds = local_sum;
    plan.in_cycle.exchange_start = t0;
    plan.in_cycle.exchange_seconds = exchange;
  }
  return plan;
}

void CycleNegotiator::ReportLoop() {
  for (;;) {
    std::vector<control::BucketInfo> report;
    {
      absl::MutexLock lock(&state_->mu);
      auto has_work = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu) {
        return state_->stop || state_->table.has_newly_ready();
      };
      state_->mu.AwaitWithTimeout(absl::Condition(&has_work), absl::Milliseconds(200));
      if (state_->stop || quit_) return;
      if (!state_->failed.ok()) {
        state_->table.DropNewlyReady();
        continue;
      }
      if (job_->recovering()) continue;  // reported in the next epoch
      report = state_->table.TakeNewlyReady();
    }
    if (report.empty()) continue;
    if (absl::Status s = client_->Report(report); !s.ok() && !job_->Hold({}, s)) {
      job_->Fail(s, /*report=*/false);
    }
  }
}

}  // namespace

std::unique_ptr<Negotiator> MakeNegotiator(const EngineOptions& options,
                                           const control::Membership& membership,
                                           control::ControlPlane* client,
                                           transport::Transport* transport, kernels::SparseOps* ops,
                                           EngineState* state, JobControl* job,
                                           Speculator speculate) {
  if (options.response_cache) {
    return std::make_unique<CycleNegotiator>(options, membership, client, transport, ops, state,
                                             job, std::move(speculate));
  }
  return std::make_unique<CoordinatorNegotiator>(client, state, job);
}

}  // namespace microd::engine
