#include "daemon/engine/engine.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <numeric>
#include <optional>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "daemon/common/status_macros.h"
#include "daemon/common/status_map.h"
#include "daemon/engine/cycle_message.h"

namespace microd::engine {

using transport::CollectiveOptions;
using transport::MakeTag;
using transport::TagKind;

namespace {

constexpr int kDtypeFloat32 = 1;  // microd.v1.DataType.DATA_TYPE_FLOAT32
constexpr absl::Duration kPollSlice = absl::Seconds(1);

double Seconds(absl::Time since) { return absl::ToDoubleSeconds(absl::Now() - since); }

absl::Status JobFailed(const absl::Status& why) {
  return WithClientStatus(absl::AbortedError(why.message()), ClientStatus::kJobFailed);
}

}  // namespace

void BucketStats::AddDense(double local_sum, double exchange, double writeback) {
  ++steps;
  budget = last_selected = count;
  bytes_sent += count * sizeof(float);
  bytes_received += count * sizeof(float);
  local_sum_seconds += local_sum;
  exchange_seconds += exchange;
  writeback_seconds += writeback;
}

void BucketStats::AddSparse(const sparsify::StepStats& st, double local_sum, double writeback,
                            size_t history_limit) {
  ++steps;
  budget = st.budget;
  last_selected = st.selected;
  last_threshold = st.threshold;
  last_cre = st.cre;
  if (st.step >= 2) sum_cre += st.cre;
  bytes_sent += st.bytes_sent;
  bytes_received += st.bytes_received;
  local_sum_seconds += local_sum;
  select_seconds += st.select_seconds;
  exchange_seconds += st.exchange_seconds;
  writeback_seconds += st.apply_seconds + writeback;
  if (history_limit > 0) {
    if (history.size() >= history_limit) history.pop_front();
    history.push_back({st.step, st.selected, st.budget, st.threshold, st.cre});
  }
}

absl::Status CheckOptionsAgree(transport::Transport& transport, const EngineOptions& o,
                               absl::Time deadline) {
  const sparsify::SparsifyOptions& s = o.sparsify;
  // (flag, value) in a fixed order; doubles by their bits.
  auto bits = [](double x) {
    uint64_t b;
    std::memcpy(&b, &x, sizeof b);
    return b;
  };
  const std::vector<std::pair<const char*, uint64_t>> mine = {
      {"--sparsifier", static_cast<uint64_t>(s.sparsifier)},
      {"--controller", static_cast<uint64_t>(s.controller)},
      {"--density", bits(s.density)},
      {"--hard_threshold", bits(s.hard_threshold)},
      {"--momentum_correction", bits(s.momentum)},
      {"--clip_norm", bits(s.clip_norm)},
      {"--warmup_steps", s.warmup_steps},
      {"--warmup_density", bits(s.warmup_density)},
      {"--warmup_decay_steps", s.warmup_decay_steps},
      {"--dense_floor", o.dense_floor},
      {"--nonfinite", o.skip_nonfinite ? 1u : 0u},
      {"--response_cache", o.response_cache ? 1u : 0u},
      {"--cycle_floats", o.cycle_floats},
      {"--transport", o.device_resident ? 1u : 0u},
  };
  const size_t k = mine.size();
  std::vector<uint64_t> values(k), all(k * transport.size());
  for (size_t i = 0; i < k; ++i) values[i] = mine[i].second;
  transport::CollectiveOptions co;
  co.tag = transport::MakeTag(0, transport::TagKind::kControl);
  co.deadline = deadline;
  RETURN_IF_ERROR(transport.Allgather(values.data(), k * sizeof(uint64_t), all.data(), co));
  for (size_t i = 0; i < k; ++i) {
    for (int r = 1; r < transport.size(); ++r) {
      if (all[r * k + i] != all[i]) {
        return absl::InvalidArgumentError(absl::StrCat(
            mine[i].first, " differs between node 0 and node ", r,
            ": every node's microd must run with the same value"));
      }
    }
  }
  return absl::OkStatus();
}

Engine::Engine(EngineOptions options, control::Membership membership,
               control::CoordinatorClient* client, transport::Transport* transport,
               kernels::SparseOps* ops)
    : options_(std::move(options)),
      membership_(std::move(membership)),
      client_(client),
      transport_(transport),
      ops_(ops) {}

Engine::~Engine() { Stop(absl::CancelledError("the daemon is shutting down")); }

void Engine::Start() {
  if (options_.response_cache) {
    thread_ = std::thread([this] { CacheLoop(); });
    report_thread_ = std::thread([this] { ReportLoop(); });
  } else {
    thread_ = std::thread([this] { Loop(); });
  }
  poll_thread_ = std::thread([this] { PollLoop(); });
}

void Engine::Stop(const absl::Status& reason) {
  {
    absl::MutexLock lock(&mu_);
    if (stop_) return;
    stop_ = true;
  }
  Fail(reason, /*report=*/false);
  if (thread_.joinable()) thread_.join();
  if (poll_thread_.joinable()) poll_thread_.join();
  if (report_thread_.joinable()) report_thread_.join();
}

absl::Status Engine::FailedStatus() const { return failed_; }

void Engine::Fail(const absl::Status& reason, bool report) {
  std::vector<Work> pending;
  {
    absl::MutexLock lock(&mu_);
    if (!failed_.ok()) return;
    failed_ = JobFailed(reason);
    for (auto& [name, b] : buckets_) {
      if (b.submitted > 0) pending.push_back(TakeWork(b));
    }
    for (Work& w : in_flight_) pending.push_back(std::move(w));
    in_flight_.clear();
    newly_ready_.clear();
  }
  std::fprintf(stderr, "microd: node %d: %s: %s\n", membership_.node_rank,
               reason.code() == absl::StatusCode::kFailedPrecondition ||
                       reason.code() == absl::StatusCode::kCancelled
                   ? "job ended"
                   : "job failed",
               std::string(reason.message()).c_str());
  // Tell the coordinator first, so that peers whose steps break when this
  // node aborts its transport find the root cause there.
  if (report && client_ != nullptr) (void)client_->ReportFailure(std::string(reason.message()));
  // Unblock a step in flight, here and (by closed connections) on the peers.
  transport_->Abort(reason);
  const absl::Status status = JobFailed(reason);
  for (const Work& w : pending) CompleteWork(w, status);
}

absl::StatusOr<local::ProcessInfo> Engine::OnHello(uint64_t client, int requested_local_rank,
                                                   pid_t pid) {
  absl::MutexLock lock(&mu_);
  if (!failed_.ok()) return failed_;
  const int L = options_.local_size;
  std::vector<bool> taken(L, false);
  for (const auto& [id, p] : processes_) taken[p.local_rank] = true;
  int rank = -1;
  if (requested_local_rank >= 0) {
    if (requested_local_rank >= L) {
      return absl::InvalidArgumentError(absl::StrCat("local rank ", requested_local_rank,
                                                     " out of range: this node has ", L,
                                                     " local processes"));
    }
    if (taken[requested_local_rank]) {
      return absl::AlreadyExistsError(
          absl::StrCat("local rank ", requested_local_rank, " is already connected"));
    }
    rank = requested_local_rank;
  } else {
    for (int r = 0; r < L && rank < 0; ++r) {
      if (!taken[r]) rank = r;
    }
    if (rank < 0) {
      return WithClientStatus(
          absl::ResourceExhaustedError(absl::StrCat("all ", L, " local ranks are connected")),
          ClientStatus::kResource);
    }
  }
  Process p;
  p.local_rank = rank;
  p.pid = pid;
  processes_[client] = p;
  local::ProcessInfo info;
  info.local_rank = rank;
  info.local_size = L;
  info.node_rank = membership_.node_rank;
  info.node_count = membership_.node_count;
  info.world_size = membership_.world_size;
  info.momentum_correction = static_cast<float>(options_.sparsify.momentum);
  info.rank = std::accumulate(membership_.local_sizes.begin(),
                              membership_.local_sizes.begin() + membership_.node_rank, 0) +
              rank;
  return info;
}

absl::Status Engine::OnRegister(uint64_t client, uint32_t buffer_id, const std::string& name,
                                bool dense, std::shared_ptr<local::HostBuffer> buffer) {
  std::vector<Work> refused;
  absl::Status result = RegisterBuffer(client, buffer_id, name, dense, std::move(buffer), &refused);
  for (const Work& w : refused) CompleteWork(w, result);
  return result;
}

absl::Status Engine::RegisterBuffer(uint64_t client, uint32_t buffer_id, const std::string& name,
                                    bool dense, std::shared_ptr<local::HostBuffer> buffer,
                                    std::vector<Work>* refused) {
  if (options_.device_resident) {
    const local::DeviceMemory* dev = buffer->device();
    if (dev == nullptr || dev->ordinal() != options_.device) {
      return WithClientStatus(
          absl::FailedPreconditionError(absl::StrCat(
              "buffer '", name, "': this daemon reduces on GPU ", options_.device,
              " (--transport=nccl) and takes only CUDA buffers on that GPU; this one is ",
              dev == nullptr ? "host memory" : absl::StrCat("on GPU ", dev->ordinal()))),
          ClientStatus::kUnsupported);
    }
  }
  absl::MutexLock lock(&mu_);
  if (!failed_.ok()) return failed_;
  auto pit = processes_.find(client);
  if (pit == processes_.end()) return absl::FailedPreconditionError("unknown process");
  Process& p = pit->second;
  const int L = options_.local_size;
  Bucket& b = buckets_[name];
  if (b.count == 0) {
    b.name = name;
    b.count = buffer->count();
    b.buffers.resize(L);
    b.clients.assign(L, 0);
    b.buffer_ids.assign(L, 0);
    b.tickets.assign(L, 0);
    b.stats.name = name;
    b.stats.count = b.count;
    b.dense = dense || b.count < options_.dense_floor;
    b.stats.dense = b.dense;
    b.requested_dense = dense;
  } else if (b.count != buffer->count() || b.requested_dense != dense) {
    int other = -1;
    for (int r = 0; r < L; ++r) {
      if (b.buffers[r] != nullptr) other = r;
    }
    // The bucket can never run: fail it for every local process, now and later.
    b.poisoned = WithClientStatus(
        absl::InvalidArgumentError(absl::StrCat(
            "buffer '", name, "' has ", buffer->count(), dense ? " elements (dense)" : " elements",
            " on local rank ", p.local_rank, " but ", b.count, b.requested_dense ? " (dense)" : "",
            " on local rank ", other)),
        ClientStatus::kMismatch);
    if (b.submitted > 0) refused->push_back(TakeWork(b));
    return b.poisoned;
  }
  if (b.buffers[p.local_rank] != nullptr) {
    return absl::AlreadyExistsError(
        absl::StrCat("buffer '", name, "' is already registered by local rank ", p.local_rank));
  }
  b.buffers[p.local_rank] = std::move(buffer);
  b.clients[p.local_rank] = client;
  b.buffer_ids[p.local_rank] = buffer_id;
  p.buffers[buffer_id] = name;
  return absl::OkStatus();
}

absl::Status Engine::OnSubmit(uint64_t client, uint32_t buffer_id, uint64_t ticket) {
  absl::MutexLock lock(&mu_);
  if (!failed_.ok()) return failed_;
  auto pit = processes_.find(client);
  if (pit == processes_.end()) return absl::FailedPreconditionError("unknown process");
  auto nit = pit->second.buffers.find(buffer_id);
  if (nit == pit->second.buffers.end()) {
    return absl::InvalidArgumentError(absl::StrCat("unknown buffer id ", buffer_id));
  }
  Bucket& b = buckets_[nit->second];
  const int lr = pit->second.local_rank;
  if (!b.poisoned.ok()) return b.poisoned;
  if (b.tickets[lr] != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("buffer '", b.name, "' already has a submission in flight"));
  }
  b.tickets[lr] = ticket;
  if (b.submitted == 0) b.first_at = absl::Now();
  if (++b.submitted == options_.local_size) {
    b.ready_at = absl::Now();
    if (b.cache_id >= 0) {
      cached_ready_[b.cache_id] = true;  // negotiated in the next cycle
      changed_ = true;
    } else {
      newly_ready_.push_back(b.name);
    }
  }
  return absl::OkStatus();
}

void Engine::OnDisconnect(uint64_t client, bool clean, const std::string& why) {
  std::string reason;
  {
    absl::MutexLock lock(&mu_);
    auto pit = processes_.find(client);
    if (pit == processes_.end()) return;
    const Process p = pit->second;
    processes_.erase(pit);
    bool pending = false;
    for (const auto& [id, name] : p.buffers) {
      Bucket& b = buckets_[name];
      pending = pending || b.tickets[p.local_rank] != 0 || b.submitted > 0;
      b.buffers[p.local_rank].reset();
      b.clients[p.local_rank] = 0;
    }
    // A process that registered nothing was never part of the training: drop
    // it quietly. One that leaves cleanly with nothing in flight is done.
    if (p.buffers.empty() || (clean && !pending)) return;
    reason = absl::StrCat("local process ", p.local_rank, " (pid ", p.pid, ") on node ",
                          membership_.node_rank, " disconnected", clean ? " with work pending" : "",
                          ": ", why);
  }
  Fail(absl::AbortedError(reason), /*report=*/true);
}

std::vector<control::BucketWait> Engine::Waiting(absl::Duration at_least, size_t limit) const {
  std::vector<control::BucketWait> out;
  absl::MutexLock lock(&mu_);
  if (!failed_.ok()) return out;
  const absl::Time now = absl::Now();
  std::map<int, pid_t> pid_of;  // local rank -> pid of the connected process
  for (const auto& [id, p] : processes_) pid_of[p.local_rank] = p.pid;
  for (const auto& [name, b] : buckets_) {
    if (b.submitted == 0 || now - b.first_at < at_least) continue;
    control::BucketWait w{name, absl::ToDoubleSeconds(now - b.first_at), {}};
    for (int r = 0; r < options_.local_size; ++r) {
      if (b.tickets[r] != 0) continue;
      auto it = pid_of.find(r);
      w.missing.push_back({r, it == pid_of.end() ? 0 : static_cast<int>(it->second)});
    }
    out.push_back(std::move(w));
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.seconds > b.seconds; });
  if (out.size() > limit) out.resize(limit);
  return out;
}

control::BucketInfo Engine::InfoOf(const Bucket& b) {
  return {b.name, kDtypeFloat32, static_cast<int64_t>(b.count), b.requested_dense};
}

std::vector<control::BucketInfo> Engine::TakeNewlyReady() {
  std::vector<control::BucketInfo> out;
  for (const std::string& name : newly_ready_) out.push_back(InfoOf(buckets_[name]));
  newly_ready_.clear();
  return out;
}

Engine::Work Engine::TakeWork(Bucket& b) {
  Work w;
  w.bucket = &b;
  w.buffers = b.buffers;
  w.answer = std::make_shared<Answer>(b.clients, b.tickets, b.buffer_ids);
  std::fill(b.tickets.begin(), b.tickets.end(), 0);
  b.submitted = 0;
  if (b.cache_id >= 0) cached_ready_[b.cache_id] = false;
  return w;
}

absl::Status Engine::WithRootCause(const absl::Status& local) {
  if (client_ == nullptr) return local;
  const absl::Status job = client_->RefreshJobStatus();
  if (job.ok()) return local;
  return absl::Status(local.code(), absl::StrCat(job.message(), " (here: ", local.message(), ")"));
}

void Engine::CompleteWork(const Work& w, const absl::Status& status) {
  w.answer->Finish(status, [this](uint64_t client, uint64_t ticket, uint32_t buffer_id,
                                  const absl::Status& s) {
    if (server_ != nullptr) server_->Complete(client, ticket, buffer_id, s);
  });
}

void Engine::PollLoop() {
  uint64_t next = 0;
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      if (stop_ || !failed_.ok()) return;
    }
    // Short polls, so that a stopping engine is never held up for long.
    auto batches = client_->Poll(next, absl::Now() + std::min(options_.op_timeout, kPollSlice));
    if (!batches.ok()) {
      {
        absl::MutexLock lock(&mu_);
        if (stop_) return;
      }
      Fail(batches.status(), /*report=*/false);
      return;
    }
    if (batches->empty()) continue;
    next = batches->back().index + 1;
    absl::MutexLock lock(&mu_);
    for (auto& b : *batches) schedule_.push_back(std::move(b));
    changed_ = true;
  }
}

void Engine::Loop() {
  for (;;) {
    std::vector<control::BucketInfo> report;
    std::optional<control::ScheduleBatch> batch;
    {
      absl::MutexLock lock(&mu_);
      auto has_work = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || !newly_ready_.empty() || !schedule_.empty();
      };
      mu_.AwaitWithTimeout(absl::Condition(&has_work), absl::Seconds(1));
      if (stop_) return;
      if (!failed_.ok()) {
        newly_ready_.clear();
        schedule_.clear();
        continue;
      }
      report = TakeNewlyReady();
      if (!schedule_.empty()) {
        batch = std::move(schedule_.front());
        schedule_.pop_front();
      }
    }
    if (!report.empty()) {
      if (absl::Status s = client_->Report(report); !s.ok()) {
        Fail(s, /*report=*/false);
        continue;
      }
    }
    if (batch.has_value()) RunBatch(*batch);
  }
}

void Engine::ReportLoop() {
  for (;;) {
    std::vector<control::BucketInfo> report;
    {
      absl::MutexLock lock(&mu_);
      auto has_work = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || !newly_ready_.empty();
      };
      mu_.AwaitWithTimeout(absl::Condition(&has_work), absl::Seconds(1));
      if (stop_) return;
      if (!failed_.ok()) {
        newly_ready_.clear();
        continue;
      }
      report = TakeNewlyReady();
    }
    if (report.empty()) continue;
    if (absl::Status s = client_->Report(report); !s.ok()) Fail(s, /*report=*/false);
  }
}

void Engine::CacheLoop() {
  bool progressed = false;
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      auto pending = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return !schedule_.empty() ||
               std::find(cached_ready_.begin(), cached_ready_.end(), true) != cached_ready_.end();
      };
      auto go = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || (pending() && (changed_ || progressed));
      };
      // A change (a submission, a schedule batch) starts a cycle at once.
      // With work pending but nothing new, the next cycle starts after 1 ms:
      // the others may be waiting in one for this node (two nodes each with
      // a bucket the other has not submitted yet would otherwise spin).
      mu_.AwaitWithTimeout(absl::Condition(&go),
                           pending() ? absl::Milliseconds(1) : absl::Seconds(1));
      if (stop_) return;
      if (!failed_.ok()) {
        schedule_.clear();
        progressed = false;
        continue;
      }
      if (!pending()) continue;
      changed_ = false;
    }
    progressed = Cycle();
  }
}

bool Engine::Cycle() {
  const int n = membership_.node_count;
  constexpr uint64_t kNoSlot = ~uint64_t{0};
  // What this node has: schedule batches received, ready cached buckets, and
  // its share of the small dense buckets it can send along (cycle_message.h).
  CycleMessage mine;
  size_t ids = 0;        // cached buckets at the time of the cycle
  uint64_t floats = 0;   // room taken in the message, in floats
  std::vector<uint64_t> slot;
  struct ToSend {
    size_t id;
    uint64_t count;
    std::vector<std::shared_ptr<local::HostBuffer>> buffers;
  };
  std::vector<ToSend> to_send;
  // The room, in floats: --cycle_floats, but the whole allgather kept under
  // 256 KiB, where the transport sends it to every peer in one round.
  const uint64_t room =
      std::min<uint64_t>(options_.cycle_floats, (uint64_t{64} << 10) / n > 512
                                                    ? (uint64_t{64} << 10) / n - 512
                                                    : 0);
  {
    absl::MutexLock lock(&mu_);
    ids = cached_.size();
    slot.assign(ids, kNoSlot);
    const bool ride = !options_.device_resident && room > 0;
    for (size_t i = 0; i < ids && ride; ++i) {
      const Bucket& b = *cached_[i];
      if (!b.dense || floats + b.count > room) continue;
      slot[i] = floats;
      floats += b.count;
      if (cached_ready_[i]) to_send.push_back({i, b.count, b.buffers});
    }
    mine = CycleMessage::Empty(ids, floats);
    mine.batches_received = log_run_ + schedule_.size();
    for (size_t i = 0; i < ids; ++i) {
      if (cached_ready_[i]) mine.SetReady(i);
    }
  }
  double local_sum = 0;
  if (!to_send.empty()) {
    // This node's local sums (host memory: the CPU backend, as for every
    // engine that is not device-resident). Host buffers only (CUDA ones
    // need staging), and none with a NaN/Inf: those go the usual way,
    // which reports it.
    const absl::Time start = absl::Now();
    if (!scalars_.Reserve(ops_, 1)) to_send.clear();
    for (const ToSend& t : to_send) {
      std::vector<const float*> inputs;
      for (const auto& buf : t.buffers) {
        if (buf == nullptr || buf->device() != nullptr) break;
        inputs.push_back(buf->data());
      }
      if (inputs.size() != t.buffers.size()) continue;
      kernels::StepScalars sc{};
      if (ops_->LocalSum(inputs.data(), static_cast<int>(inputs.size()), t.count,
                         mine.area.data() + slot[t.id], scalars_.get(),
                         nullptr) != kernels::KernelStatus::kOk ||
          ops_->CopyToHost(&sc, scalars_.get(), sizeof sc, nullptr) != kernels::KernelStatus::kOk ||
          sc.nonfinite != 0) {
        continue;
      }
      mine.SetSent(t.id);
    }
    local_sum = absl::ToDoubleSeconds(absl::Now() - start);
  }
  const absl::Time t0 = absl::Now();
  const std::vector<uint64_t> encoded = mine.Encode();
  const size_t words = encoded.size();
  std::vector<uint64_t> all(words * n);
  CollectiveOptions o;
  o.tag = MakeTag(0, TagKind::kControl);
  // A failed peer ends the wait through Fail(), a stall past
  // --stall_abort_s through the coordinator; a cycle that waits past
  // peer_wait fails the job.
  o.deadline = absl::Now() + options_.peer_wait;
  absl::Status s = transport_->Allgather(encoded.data(), words * sizeof(uint64_t), all.data(), o);
  if (absl::IsDeadlineExceeded(s)) {
    s = absl::DeadlineExceededError(absl::StrCat(
        "node ", membership_.node_rank, " waited ", absl::FormatDuration(options_.peer_wait),
        " for the other nodes to agree on the next buckets (", s.message(), ")"));
  }
  std::vector<CycleMessage> theirs;
  for (int r = 0; r < n && s.ok(); ++r) {
    auto m = CycleMessage::Decode(absl::MakeConstSpan(all).subspan(r * words, words), ids, floats);
    if (!m.ok()) {
      s = absl::Status(m.status().code(), absl::StrCat("node ", r, ": ", m.status().message(),
                                                        " (node ", membership_.node_rank, ")"));
    } else {
      theirs.push_back(std::move(m).value());
    }
  }
  if (!s.ok()) {
    {
      absl::MutexLock lock(&mu_);
      if (!failed_.ok()) return false;  // Fail() ended the cycle
    }
    s = WithRootCause(s);
    Fail(s, /*report=*/true);
    return false;
  }
  const double exchange = absl::ToDoubleSeconds(absl::Now() - t0);
  const CycleAgreement agreed = Intersect(theirs);
  const uint64_t agreed_log = agreed.batches;
  bool ran = false;
  // First the schedule batches every node has, in log order.
  for (;;) {
    std::optional<control::ScheduleBatch> batch;
    {
      absl::MutexLock lock(&mu_);
      if (!failed_.ok() || log_run_ >= agreed_log || schedule_.empty()) break;
      batch = std::move(schedule_.front());
      schedule_.pop_front();
      ++log_run_;
    }
    RunBatch(*batch);
    ran = true;
  }
  // Then the cached buckets ready on every node, in id order: those every
  // node sent along are reduced already, the others run as a batch.
  control::ScheduleBatch cached;
  std::vector<size_t> in_cycle;
  {
    absl::MutexLock lock(&mu_);
    if (!failed_.ok()) return ran;
    // Ids assigned by the batches just run have no agreed bits yet.
    for (size_t i = 0; i < ids; ++i) {
      if (!agreed.IsReady(i)) continue;
      if (agreed.IsSent(i)) {
        in_cycle.push_back(i);
      } else {
        cached.scheduled.push_back(InfoOf(*cached_[i]));
      }
    }
  }
  if (!in_cycle.empty()) {
    std::vector<float> area;
    for (const CycleMessage& m : theirs) area.insert(area.end(), m.area.begin(), m.area.end());
    RunInCycle(in_cycle, slot, area, floats, local_sum, exchange,
               /*count_batch=*/cached.scheduled.empty());
    ran = true;
  }
  if (!cached.scheduled.empty()) {
    RunBatch(cached, /*cached=*/true);
    ran = true;
  }
  return ran;
}

void Engine::RunInCycle(const std::vector<size_t>& ids, const std::vector<uint64_t>& slot,
                        const std::vector<float>& area, uint64_t floats, double local_sum_seconds,
                        double exchange_seconds, bool count_batch) {
  const int n = membership_.node_count;
  std::vector<Work> works;
  {
    absl::MutexLock lock(&mu_);
    if (!failed_.ok()) return;
    if (count_batch) ++cache_batches_;
    const absl::Time now = absl::Now();
    for (size_t i : ids) {
      Bucket& b = *cached_[i];
      b.stats.negotiate_seconds += absl::ToDoubleSeconds(now - b.ready_at);
      works.push_back(TakeWork(b));
    }
    in_flight_.insert(in_flight_.end(), works.begin(), works.end());
  }
  uint64_t total = 0;
  for (const Work& w : works) total += w.bucket->count;
  for (size_t k = 0; k < works.size(); ++k) {
    const Work& w = works[k];
    const absl::Time t0 = absl::Now();
    const uint64_t d = w.bucket->count;
    const uint64_t at = slot[ids[k]];
    if (std::find(w.buffers.begin(), w.buffers.end(), nullptr) != w.buffers.end()) {
      // A process left meanwhile (its disconnect fails the job).
      FinishWork(w, JobFailed(absl::AbortedError(
                        absl::StrCat("bucket '", w.bucket->name, "': a local process is gone"))));
      continue;
    }
    // The sum in node order, then the average: what the fused dense
    // allreduce computes, to the bit.
    std::vector<float> sum(area.begin() + at, area.begin() + at + d);
    for (int r = 1; r < n; ++r) {
      const float* in = area.data() + r * floats + at;
      for (uint64_t j = 0; j < d; ++j) sum[j] += in[j];
    }
    absl::Status s = KernelCall(
        ops_->Divide(sum.data(), d, static_cast<float>(membership_.world_size), nullptr, nullptr),
        "divide");
    {
      absl::MutexLock lock(&mu_);
      if (!failed_.ok()) return;  // the job failed meanwhile; Fail() answered this work
    }
    for (const auto& buf : w.buffers) {
      if (s.ok()) s = CopyFloats(buf->data(), sum.data(), d);
    }
    if (!s.ok()) {
      StagingFailed({&w}, absl::InternalError(absl::StrCat("bucket '", w.bucket->name,
                                                           "': write-back: ", s.message())));
      return;
    }
    {
      absl::MutexLock lock(&mu_);
      const double share = static_cast<double>(d) / static_cast<double>(total);
      ++cycle_reductions_;
      w.bucket->stats.AddDense(local_sum_seconds * share, exchange_seconds * share,
                               absl::ToDoubleSeconds(absl::Now() - t0));
    }
    FinishWork(w, absl::OkStatus());
  }
}

void Engine::RunBatch(const control::ScheduleBatch& batch, bool cached) {
  std::vector<Work> dense, sparse;
  std::vector<std::pair<Work, absl::Status>> refused;
  {
    absl::MutexLock lock(&mu_);
    ++(cached ? cache_batches_ : batches_);
    if (!failed_.ok()) return;
    for (const auto& [name, message] : batch.errors) {
      Bucket& b = buckets_[name];
      ++b.stats.failures;
      refused.push_back({TakeWork(b), WithClientStatus(absl::InvalidArgumentError(message),
                                                       ClientStatus::kMismatch)});
    }
    const absl::Time now = absl::Now();
    for (const control::BucketInfo& info : batch.scheduled) {
      Bucket& b = buckets_[info.name];
      b.stats.negotiate_seconds += absl::ToDoubleSeconds(now - b.ready_at);
      (b.dense ? dense : sparse).push_back(TakeWork(b));
      if (options_.response_cache && b.cache_id < 0) {
        // Scheduled by the coordinator: every node reaches this point in the
        // same log order, so the ids agree everywhere.
        b.cache_id = static_cast<int64_t>(cached_.size());
        cached_.push_back(&b);
        cached_ready_.push_back(false);
      }
    }
  }
  for (auto& [w, s] : refused) CompleteWork(w, s);
  {
    // While they run, Fail() can answer them (a collective blocked on a peer
    // that failed may only return at its timeout).
    absl::MutexLock lock(&mu_);
    in_flight_.insert(in_flight_.end(), dense.begin(), dense.end());
    in_flight_.insert(in_flight_.end(), sparse.begin(), sparse.end());
  }
  if (!dense.empty()) RunFusedDense(dense);
  for (Work& w : sparse) RunSparse(w);
  if (options_.device_resident) {
    // A step that ended early (a failure) may have left kernels queued on
    // the processes' memory: let them finish before the Works let go of
    // the buffers (the last reference to a departed process's mapping
    // closes it). Work still running at the deadline keeps its buffers
    // mapped for the life of the daemon.
    const double seconds = absl::ToDoubleSeconds(options_.op_timeout);
    if (const auto k = ops_->SynchronizeFor(nullptr, seconds); k != kernels::KernelStatus::kOk) {
      std::fprintf(stderr, "microd: the GPU work of a batch did not end (%s): its buffers stay "
                           "mapped until the daemon exits\n", kernels::KernelStatusString(k));
      {
        absl::MutexLock lock(&mu_);
        for (const std::vector<Work>* ws : {&dense, &sparse}) {
          for (const Work& w : *ws) {
            kept_buffers_.insert(kept_buffers_.end(), w.buffers.begin(), w.buffers.end());
          }
        }
      }
      Fail(absl::DeadlineExceededError(absl::StrCat("node ", membership_.node_rank,
                                                    ": the GPU work of a batch did not end")),
           /*report=*/true);
    }
  }
}

namespace {

absl::Status InBucket(const absl::Status& s, const std::string& bucket, size_t local_rank) {
  absl::Status out(
      s.code(), absl::StrCat("bucket '", bucket, "', local rank ", local_rank, ": ", s.message()));
  s.ForEachPayload(
      [&](absl::string_view url, const absl::Cord& payload) { out.SetPayload(url, payload); });
  return out;
}

}  // namespace

absl::Status Engine::StageIn(const Work& w, absl::Time deadline) {
  // A failed job (a process died, a peer failed) ends the wait for a ready
  // event at once: the event may belong to a process that is gone.
  const std::function<bool()> abandoned = [this] {
    absl::MutexLock lock(&mu_);
    return !failed_.ok();
  };
  absl::Status result;
  for (size_t r = 0; r < w.buffers.size() && result.ok(); ++r) {
    local::DeviceMemory* dev = w.buffers[r] != nullptr ? w.buffers[r]->device() : nullptr;
    if (dev == nullptr) continue;
    absl::Status s = options_.device_resident ? dev->WaitReady(deadline, abandoned)
                                              : dev->BeginCopyIn(deadline, abandoned);
    if (!s.ok()) result = InBucket(s, w.bucket->name, r);
  }
  // Every copy queued is awaited, also after a failure.
  for (size_t r = 0; r < w.buffers.size(); ++r) {
    local::DeviceMemory* dev = w.buffers[r] != nullptr ? w.buffers[r]->device() : nullptr;
    if (dev == nullptr) continue;
    absl::Status s = dev->Finish(deadline);
    if (!s.ok() && result.ok()) result = InBucket(s, w.bucket->name, r);
  }
  return result;
}

absl::Status Engine::StageOut(const Work& w, absl::Time deadline) {
  if (options_.device_resident) {
    // The update was written in place by the step's GPU work: done when it is.
    const kernels::KernelStatus k = ops_->SynchronizeFor(
        nullptr, std::max(0.0, absl::ToDoubleSeconds(deadline - absl::Now())));
    if (k == kernels::KernelStatus::kOk) return absl::OkStatus();
    return absl::InternalError(absl::StrCat("bucket '", w.bucket->name, "': the step's GPU work (",
                                            ops_->name(), "): ", kernels::KernelStatusString(k)));
  }
  absl::Status result;
  for (size_t r = 0; r < w.buffers.size() && result.ok(); ++r) {
    local::DeviceMemory* dev = w.buffers[r] != nullptr ? w.buffers[r]->device() : nullptr;
    if (dev == nullptr) continue;
    absl::Status s = dev->BeginCopyOut();
    if (!s.ok()) result = InBucket(s, w.bucket->name, r);
  }
  for (size_t r = 0; r < w.buffers.size(); ++r) {
    local::DeviceMemory* dev = w.buffers[r] != nullptr ? w.buffers[r]->device() : nullptr;
    if (dev == nullptr) continue;
    absl::Status s = dev->Finish(deadline);
    if (!s.ok() && result.ok()) result = InBucket(s, w.bucket->name, r);
  }
  return result;
}

absl::Status Engine::CopyFloats(float* dst, const float* src, uint64_t count) {
  if (count == 0) return absl::OkStatus();
  // In ops_'s memory (host or device).
  return KernelCall(src == nullptr ? ops_->ZeroFloats(dst, count, nullptr)
                                   : ops_->CopyFloats(dst, src, count, nullptr),
                    "copy");
}

absl::Status Engine::KernelCall(kernels::KernelStatus k, const char* what) const {
  if (k == kernels::KernelStatus::kOk) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat(what, " (", ops_->name(), "): ", kernels::KernelStatusString(k)));
}

void Engine::StagingFailed(const std::vector<Work>& works, const absl::Status& s) {
  std::vector<const Work*> all;
  for (const Work& w : works) all.push_back(&w);
  StagingFailed(all, s);
}

void Engine::StagingFailed(const std::vector<const Work*>& works, const absl::Status& s) {
  const absl::Status why = absl::Status(
      s.code(), absl::StrCat("node ", membership_.node_rank,
                             options_.device_resident ? ": GPU step: " : ": CUDA staging: ",
                             s.message()));
  {
    absl::MutexLock lock(&mu_);
    for (const Work* w : works) ++w->bucket->stats.failures;
  }
  for (const Work* w : works) FinishWork(*w, JobFailed(why));
  Fail(why, /*report=*/true);
}

void Engine::NonFinite(const Work& w, const absl::Status& status) {
  if (!options_.skip_nonfinite) {
    {
      absl::MutexLock lock(&mu_);
      ++w.bucket->stats.failures;
    }
    FinishWork(w, status);
    return;
  }
  // Skip: nothing was reduced; every process applies a zero update.
  absl::Status zeroed;
  for (const auto& buf : w.buffers) {
    if (buf != nullptr && zeroed.ok()) zeroed = CopyFloats(Data(*buf), nullptr, buf->count());
  }
  absl::Status s = zeroed.ok() ? StageOut(w, absl::Now() + options_.op_timeout) : zeroed;
  if (!s.ok()) {
    StagingFailed({&w}, s);
    return;
  }
  {
    absl::MutexLock lock(&mu_);
    ++w.bucket->stats.skipped;
  }
  std::fprintf(stderr, "microd: %s (skipped: zero update)\n",
               std::string(status.message()).c_str());
  FinishWork(w, absl::OkStatus());
}

void Engine::FinishWork(const Work& w, const absl::Status& status) {
  {
    absl::MutexLock lock(&mu_);
    auto it = std::find_if(in_flight_.begin(), in_flight_.end(),
                           [&](const Work& x) { return x.answer == w.answer; });
    if (it != in_flight_.end()) in_flight_.erase(it);
  }
  CompleteWork(w, status);  // nothing when Fail() answered it already
}

void Engine::RunSparse(Work& w) {
  Bucket& b = *w.bucket;
  const uint64_t d = b.count;
  const int L = options_.local_size;
  for (const auto& buf : w.buffers) {
    if (buf == nullptr) {
      FinishWork(w, JobFailed(absl::AbortedError(
                        absl::StrCat("bucket '", b.name, "': a local process is gone"))));
      return;
    }
  }
  if (b.state == nullptr) {
    auto state = sparsify::BucketState::Create(
        {b.name, d, next_slot_++},
        {membership_.node_count, membership_.node_rank, membership_.world_size}, options_.sparsify,
        ops_);
    if (!state.ok()) {
      FinishWork(w, state.status());
      Fail(state.status(), /*report=*/true);
      return;
    }
    b.state = std::move(state).value();
  }
  // With one local process the update is written straight over its buffer
  // (the step reads the gradient completely first); with several it goes to
  // a daemon buffer and is copied into each.
  if (L > 1 && (!grad_.Reserve(ops_, d) || !update_.Reserve(ops_, d))) {
    const absl::Status s = WithClientStatus(
        absl::ResourceExhaustedError(absl::StrCat("bucket '", b.name, "': out of memory")),
        ClientStatus::kResource);
    FinishWork(w, s);
    Fail(s, /*report=*/true);
    return;
  }
  // Step 1: the node's gradient. With one local process its buffer is g itself.
  const absl::Time t0 = absl::Now();
  if (absl::Status s = StageIn(w, t0 + options_.op_timeout); !s.ok()) {
    StagingFailed({&w}, s);
    return;
  }
  const float* grad = Data(*w.buffers[0]);
  if (L > 1) {
    std::vector<const float*> inputs;
    for (const auto& buf : w.buffers) inputs.push_back(Data(*buf));
    if (absl::Status s = KernelCall(
            ops_->LocalSum(inputs.data(), L, d, grad_.get(), nullptr, nullptr), "local sum");
        !s.ok()) {
      StagingFailed({&w}, absl::InternalError(absl::StrCat("bucket '", b.name, "': ", s.message())));
      return;
    }
    grad = grad_.get();
  }
  const double local_sum = Seconds(t0);
  float* update = L > 1 ? update_.get() : Data(*w.buffers[0]);
  auto st = b.state->Step(grad, update, *transport_, absl::Now() + options_.op_timeout);
  if (!st.ok()) {
    absl::Status s = st.status();
    if (ToClientStatus(s) == ClientStatus::kNonFinite) {
      NonFinite(w, s);  // this step only; the job goes on
    } else {
      {
        absl::MutexLock lock(&mu_);
        ++b.stats.failures;
      }
      s = WithRootCause(s);
      FinishWork(w, JobFailed(s));
      Fail(s, /*report=*/true);
    }
    return;
  }
  const absl::Time t1 = absl::Now();
  {
    absl::MutexLock lock(&mu_);
    if (!failed_.ok()) return;  // the job failed meanwhile; Fail() answered this work
  }
  absl::Status written;
  if (L > 1) {
    for (const auto& buf : w.buffers) {
      if (written.ok()) written = CopyFloats(Data(*buf), update, d);
    }
  }
  if (written.ok()) written = StageOut(w, absl::Now() + options_.op_timeout);
  if (!written.ok()) {
    StagingFailed({&w}, written);
    return;
  }
  const double writeback = Seconds(t1);
  {
    absl::MutexLock lock(&mu_);
    b.stats.AddSparse(*st, local_sum, writeback, options_.stats_history);
  }
  FinishWork(w, absl::OkStatus());
}

void Engine::RunFusedDense(std::vector<Work>& works) {
  const int L = options_.local_size;
  uint64_t total = 0;
  for (const Work& w : works) total += w.bucket->count;
  if (!fusion_.Reserve(ops_, total + 1) || !scalars_.Reserve(ops_, 1)) {
    const absl::Status s = WithClientStatus(
        absl::ResourceExhaustedError("fused dense buffer: out of memory"), ClientStatus::kResource);
    for (const Work& w : works) FinishWork(w, s);
    Fail(s, /*report=*/true);
    return;
  }
  const absl::Time t0 = absl::Now();
  uint64_t offset = 0, nonfinite = 0;
  for (const Work& w : works) {
    for (const auto& buf : w.buffers) {
      if (buf == nullptr) {
        const absl::Status s = JobFailed(absl::AbortedError("a local process is gone"));
        for (const Work& x : works) FinishWork(x, s);
        return;
      }
    }
    if (absl::Status s = StageIn(w, t0 + options_.op_timeout); !s.ok()) {
      StagingFailed(works, s);
      return;
    }
    std::vector<const float*> inputs;
    for (const auto& buf : w.buffers) inputs.push_back(Data(*buf));  // none null: checked above
    kernels::StepScalars sc;
    absl::Status s = KernelCall(ops_->LocalSum(inputs.data(), L, w.bucket->count,
                                               fusion_.get() + offset, scalars_.get(), nullptr),
                                "local sum");
    if (s.ok()) s = KernelCall(ops_->CopyToHost(&sc, scalars_.get(), sizeof sc, nullptr), "copy");
    if (!s.ok()) {
      StagingFailed(works, absl::Status(s.code(), absl::StrCat("bucket '", w.bucket->name,
                                                               "': ", s.message())));
      return;
    }
    nonfinite += sc.nonfinite;
    offset += w.bucket->count;
  }
  const double local_sum = Seconds(t0);
  const absl::Time t1 = absl::Now();
  // One allreduce carries the values and, in a last element, how many nodes
  // saw a NaN/Inf; only then does a second collective name them.
  const float flag = nonfinite != 0 ? 1.0f : 0.0f;
  CollectiveOptions o;
  o.deadline = absl::Now() + options_.op_timeout;
  o.tag = MakeTag(0, TagKind::kDense);
  absl::Status s = KernelCall(ops_->CopyToDevice(fusion_.get() + total, &flag, sizeof flag, nullptr),
                              "copy");
  if (s.ok()) {
    s = transport_->AllreduceSum(fusion_.get(), total + 1, transport::DataType::kFloat32, o);
  }
  float flags_sum = 0.0f;
  if (s.ok()) {
    s = KernelCall(ops_->CopyToHost(&flags_sum, fusion_.get() + total, sizeof flags_sum, nullptr),
                   "copy");
  }
  if (s.ok() && flags_sum != 0.0f) {
    o.tag = MakeTag(0, TagKind::kHeader);
    std::vector<uint64_t> flags(membership_.node_count);
    s = transport_->Allgather(&nonfinite, sizeof nonfinite, flags.data(), o);
    if (s.ok()) {
      std::vector<std::string> bad, names;
      for (int r = 0; r < membership_.node_count; ++r) {
        if (flags[r] != 0) bad.push_back(absl::StrCat("node ", r));
      }
      for (const Work& w : works) names.push_back(w.bucket->name);
      const absl::Status nan = WithClientStatus(
          absl::InvalidArgumentError(absl::StrCat("buckets '", absl::StrJoin(names, "', '"),
                                                  "': NaN or Inf in the gradient on ",
                                                  absl::StrJoin(bad, ", "), "; step skipped")),
          ClientStatus::kNonFinite);
      for (const Work& w : works) NonFinite(w, nan);
      return;
    }
  }
  if (!s.ok()) {
    s = WithRootCause(s);
    for (const Work& w : works) FinishWork(w, JobFailed(s));
    Fail(s, /*report=*/true);
    return;
  }
  const double exchange = Seconds(t1);
  const absl::Time t2 = absl::Now();
  {
    absl::MutexLock lock(&mu_);
    if (!failed_.ok()) return;  // the job failed meanwhile; Fail() answered this work
  }
  absl::Status written;
  if (const auto k = ops_->Divide(fusion_.get(), total, static_cast<float>(membership_.world_size),
                                  nullptr, nullptr);
      k != kernels::KernelStatus::kOk) {
    written = absl::InternalError(absl::StrCat("fused dense buffer: divide: ",
                                               kernels::KernelStatusString(k)));
  }
  offset = 0;
  for (const Work& w : works) {
    for (const auto& buf : w.buffers) {
      if (written.ok()) written = CopyFloats(Data(*buf), fusion_.get() + offset, w.bucket->count);
    }
    offset += w.bucket->count;
  }
  for (const Work& w : works) {
    if (written.ok()) written = StageOut(w, absl::Now() + options_.op_timeout);
  }
  if (!written.ok()) {
    StagingFailed(works, written);
    return;
  }
  const double writeback = Seconds(t2);
  {
    absl::MutexLock lock(&mu_);
    for (const Work& w : works) {
      const double share = static_cast<double>(w.bucket->count) / static_cast<double>(total);
      w.bucket->stats.AddDense(local_sum * share, exchange * share, writeback * share);
    }
  }
  for (const Work& w : works) FinishWork(w, absl::OkStatus());
}

EngineSnapshot Engine::Snapshot(bool with_history) const {
  absl::MutexLock lock(&mu_);
  EngineSnapshot s;
  s.failure = failed_.ok() ? "" : std::string(failed_.message());
  s.batches = batches_;
  s.cache_batches = cache_batches_;
  s.cycle_reductions = cycle_reductions_;
  for (const auto& [name, b] : buckets_) {
    s.buckets.push_back(b.stats);
    if (!with_history) s.buckets.back().history.clear();
  }
  return s;
}

}  // namespace microd::engine
