// SPDX-License-Identifier: Apache-2.0
#include "daemon/engine/process_table.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "daemon/common/status_map.h"
#include "daemon/control/types.h"

namespace microd::engine {
namespace {}  // namespace

bool Work::missing_buffer() const {
  return std::find(buffers.begin(), buffers.end(), nullptr) != buffers.end();
}

absl::StatusOr<int> ProcessTable::Hello(uint64_t client, int requested_local_rank, pid_t pid) {
  std::vector<bool> taken(L_, false);
  for (const auto& [id, p] : processes_) taken[p.local_rank] = true;
  int rank = -1;
  if (requested_local_rank >= 0) {
    if (requested_local_rank >= L_) {
      return absl::InvalidArgumentError(absl::StrCat("local rank ", requested_local_rank,
                                                     " out of range: this node has ", L_,
                                                     " local processes"));
    }
    if (taken[requested_local_rank]) {
      return absl::AlreadyExistsError(
          absl::StrCat("local rank ", requested_local_rank, " is already connected"));
    }
    rank = requested_local_rank;
  } else {
    for (int r = 0; r < L_ && rank < 0; ++r) {
      if (!taken[r]) rank = r;
    }
    if (rank < 0) {
      return WithClientStatus(
          absl::ResourceExhaustedError(absl::StrCat("all ", L_, " local ranks are connected")),
          ClientStatus::kResource);
    }
  }
  Process p;
  p.local_rank = rank;
  p.pid = pid;
  processes_[client] = p;
  departed_.erase(rank);
  return rank;
}

absl::Status ProcessTable::Register(uint64_t client, uint32_t buffer_id, const std::string& name,
                                    bool dense, std::shared_ptr<local::ProcessBuffer> buffer,
                                    std::vector<Work>* refused) {
  auto pit = processes_.find(client);
  if (pit == processes_.end()) return absl::FailedPreconditionError("unknown process");
  Process& p = pit->second;
  if (budget_.cost && buckets_.find(name) == buckets_.end()) {
    const uint64_t count = buffer->count();
    const uint64_t cost = budget_.cost(count, dense || count < dense_floor_);
    const uint64_t total = bucket_state_bytes_ + cost;
    if (budget_.bytes > 0 && total > budget_.bytes) {
      return WithClientStatus(
          absl::ResourceExhaustedError(absl::StrFormat(
              "buffer '%s' of %d elements (local rank %d): the daemon's state for this node's "
              "buckets would take %d bytes (%d for this bucket, %d for the %d before it), over "
              "its budget of %d bytes (%s; --max_state_bytes)",
              name, count, p.local_rank, total, cost, bucket_state_bytes_, buckets_.size(),
              budget_.bytes, budget_.source)),
          ClientStatus::kResource);
    }
    bucket_state_bytes_ += cost;
  }
  Bucket& b = buckets_[name];
  if (b.count == 0) {
    b.name = name;
    b.count = buffer->count();
    b.dtype = buffer->dtype();
    b.buffers.resize(L_);
    b.clients.assign(L_, 0);
    b.buffer_ids.assign(L_, 0);
    b.tickets.assign(L_, 0);
    b.stats.name = name;
    b.stats.count = b.count;
    b.dense = dense || b.count < dense_floor_;
    b.stats.dense = b.dense;
    b.requested_dense = dense;
  } else if (b.count != buffer->count() || b.requested_dense != dense ||
             b.dtype != buffer->dtype()) {
    int other = -1;
    for (int r = 0; r < L_; ++r) {
      if (b.buffers[r] != nullptr) other = r;
    }
    // The element types only when they are what differs.
    auto type = [&](uint32_t dtype) -> std::string {
      if (b.dtype == buffer->dtype()) return "";
      return absl::StrCat(" ", kernels::ElementTypeName(static_cast<kernels::ElementType>(dtype)));
    };
    // The bucket can never run: fail it for every local process, now and later.
    b.poisoned = WithClientStatus(
        absl::InvalidArgumentError(absl::StrCat(
            "buffer '", name, "' has ", buffer->count(), type(buffer->dtype()),
            dense ? " elements (dense)" : " elements", " on local rank ", p.local_rank, " but ",
            b.count, type(b.dtype), b.requested_dense ? " (dense)" : "", " on local rank ", other)),
        ClientStatus::kMismatch);
    if (b.submitted > 0) refused->push_back(Take(b));
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

absl::StatusOr<ProcessTable::Ready> ProcessTable::Submit(uint64_t client, uint32_t buffer_id,
                                                         uint64_t ticket) {
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
  if (++b.submitted < L_) return Ready::kNo;
  b.ready_at = absl::Now();
  if (b.cache_id >= 0) {
    cached_ready_[b.cache_id] = true;
    return Ready::kCached;
  }
  newly_ready_.push_back(b.name);
  return Ready::kNew;
}

std::string ProcessTable::Disconnect(uint64_t client, bool clean, const std::string& why,
                                     int node_rank) {
  auto pit = processes_.find(client);
  if (pit == processes_.end()) return "";
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
  if (p.buffers.empty()) return "";
  departed_.insert(p.local_rank);
  if (clean && !pending) return "";
  return absl::StrCat("local process ", p.local_rank, " (pid ", p.pid, ") on node ", node_rank,
                      " disconnected", clean ? " with work pending" : "", ": ", why);
}

Work ProcessTable::Take(Bucket& b) {
  Work w;
  w.bucket = &b;
  w.buffers = b.buffers;
  w.answer = std::make_shared<Answer>(b.clients, b.tickets, b.buffer_ids);
  w.ready_at = b.ready_at;
  w.round = b.rounds++;
  std::fill(b.tickets.begin(), b.tickets.end(), 0);
  b.submitted = 0;
  if (b.cache_id >= 0) cached_ready_[b.cache_id] = false;
  return w;
}

std::vector<Work> ProcessTable::TakeAllSubmitted() {
  std::vector<Work> out;
  for (auto& [name, b] : buckets_) {
    if (b.submitted > 0) out.push_back(Take(b));
  }
  return out;
}

control::BucketInfo ProcessTable::InfoOf(const Bucket& b) {
  return {b.name, static_cast<int>(b.dtype), static_cast<int64_t>(b.count), b.requested_dense};
}

std::vector<control::BucketInfo> ProcessTable::TakeNewlyReady() {
  std::vector<control::BucketInfo> out;
  for (const std::string& name : newly_ready_) out.push_back(InfoOf(buckets_[name]));
  newly_ready_.clear();
  return out;
}

Bucket* ProcessTable::find(const std::string& name) {
  auto it = buckets_.find(name);
  return it == buckets_.end() || it->second.count == 0 ? nullptr : &it->second;
}

uint64_t ProcessTable::state_bytes() const { return bucket_state_bytes_; }

uint64_t ProcessTable::total_elements() const {
  uint64_t total = 0;
  for (const auto& [name, b] : buckets_) total += b.count;
  return total;
}

std::vector<Bucket*> ProcessTable::WithState() {
  std::vector<Bucket*> out;
  for (auto& [name, b] : buckets_) {
    if (b.state != nullptr || b.velocity.ok()) out.push_back(&b);
  }
  return out;
}

absl::StatusOr<int> ProcessTable::LocalRankOf(uint64_t client) const {
  auto it = processes_.find(client);
  if (it == processes_.end()) return absl::FailedPreconditionError("unknown process");
  return it->second.local_rank;
}

std::string ProcessTable::BufferName(uint64_t client, uint32_t buffer_id) const {
  auto it = processes_.find(client);
  if (it == processes_.end()) return "";
  auto b = it->second.buffers.find(buffer_id);
  return b == it->second.buffers.end() ? "" : b->second;
}

void ProcessTable::Cache(Bucket& b) {
  if (b.cache_id >= 0) return;
  b.cache_id = static_cast<int64_t>(cached_.size());
  cached_.push_back(&b);
  cached_ready_.push_back(false);
}

void ProcessTable::ResetCache() {
  for (Bucket* b : cached_) b->cache_id = -1;
  cached_.clear();
  cached_ready_.clear();
  newly_ready_.clear();
}

std::vector<std::pair<uint64_t, int>> ProcessTable::Clients() const {
  std::vector<std::pair<uint64_t, int>> out;
  for (const auto& [id, p] : processes_) {
    if (p.local_rank >= 0) out.push_back({id, p.local_rank});
  }
  return out;
}

bool ProcessTable::any_cached_ready() const {
  return std::find(cached_ready_.begin(), cached_ready_.end(), true) != cached_ready_.end();
}

std::vector<std::pair<int, int>> ProcessTable::Missing(const Bucket& b) const {
  std::map<int, pid_t> pid_of;  // local rank -> pid of the connected process
  for (const auto& [id, p] : processes_) pid_of[p.local_rank] = p.pid;
  std::vector<std::pair<int, int>> missing;
  for (int r = 0; r < L_; ++r) {
    if (b.tickets[r] != 0) continue;
    auto it = pid_of.find(r);
    missing.push_back({r, it == pid_of.end() ? 0 : static_cast<int>(it->second)});
  }
  return missing;
}

std::vector<control::BucketWait> ProcessTable::Waiting(absl::Time now, absl::Duration at_least,
                                                       size_t limit) const {
  std::vector<control::BucketWait> out;
  for (const auto& [name, b] : buckets_) {
    if (b.submitted == 0 || now - b.first_at < at_least) continue;
    out.push_back({name, absl::ToDoubleSeconds(now - b.first_at), Missing(b)});
  }
  std::sort(out.begin(), out.end(),
            [](const auto& a, const auto& b) { return a.seconds > b.seconds; });
  if (out.size() > limit) out.resize(limit);
  return out;
}

std::string ProcessTable::WaitingFor(uint64_t client, uint32_t buffer_id, absl::Time now,
                                     const std::string& node, std::string* name,
                                     bool* others) const {
  *others = false;
  auto pit = processes_.find(client);
  if (pit == processes_.end()) return "the daemon knows no such process";
  auto nit = pit->second.buffers.find(buffer_id);
  if (nit == pit->second.buffers.end()) return "the daemon knows no such buffer";
  *name = nit->second;
  const Bucket& b = buckets_.at(*name);
  if (b.tickets[pit->second.local_rank] == 0) {
    return absl::StrCat("bucket '", *name, "' is in a step on ", node,
                        " (its transfers wait for the other nodes)");
  }
  const int64_t waited = absl::ToInt64Seconds(now - b.first_at);
  if (b.submitted < L_) {
    return absl::StrCat("bucket '", *name, "' was submitted on ", node, " ", waited, " s ago by ",
                        b.submitted, " of its ", L_,
                        " local processes; waiting for local process(es) ",
                        control::ProcessList(Missing(b)), " to submit it");
  }
  *others = true;
  return absl::StrCat("bucket '", *name, "' is ready on ", node, " (its ", L_,
                      " local process(es) submitted it ", waited,
                      " s ago) and waits for the other nodes");
}

std::vector<BucketStats> ProcessTable::Stats(bool with_history) const {
  std::vector<BucketStats> out;
  for (const auto& [name, b] : buckets_) {
    out.push_back(b.stats);
    if (!with_history) out.back().history.clear();
  }
  return out;
}

}  // namespace microd::engine
