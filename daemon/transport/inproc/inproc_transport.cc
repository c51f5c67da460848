// SPDX-License-Identifier: Apache-2.0
// In-process transport. Every collective is two rendezvous of all ranks:
// (A) each rank posts what it contributes, then reads everyone's posts and
// computes its result; (B) nobody returns, and so frees its buffers, before
// everyone finished reading. Waits use the caller's deadline; a timeout,
// an abort or a mismatch breaks the group for every rank.
#include "daemon/transport/inproc/inproc_transport.h"

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "daemon/common/status_macros.h"
#include "daemon/transport/half_sum.h"

namespace microd::transport {
namespace {

enum class OpKind : int { kAllgather, kAllgatherV, kAllreduce, kBarrier, kExchange };

const char* OpName(OpKind k) {
  switch (k) {
    case OpKind::kAllgather:
      return "Allgather";
    case OpKind::kAllgatherV:
      return "AllgatherV";
    case OpKind::kAllreduce:
      return "AllreduceSum";
    case OpKind::kBarrier:
      return "Barrier";
    case OpKind::kExchange:
      return "ExchangeRound";
  }
  return "?";
}

struct Post {
  OpKind kind = OpKind::kBarrier;
  uint32_t tag = 0;
  const void* in = nullptr;
  size_t bytes = 0;  // Allgather: bytes per rank; Allreduce: element count
  DataType type = DataType::kFloat32;
  absl::Span<const size_t> recv;  // AllgatherV
};

class Hub {
 public:
  explicit Hub(int size) : size_(size), posts_(size) {}

  int size() const { return size_; }

  // Rendezvous of all ranks. When `post` is set it is published for this
  // rank first. Returns the group's failure, if any.
  absl::Status Sync(int rank, const Post* post, absl::Time deadline, const char* phase) {
    absl::MutexLock lock(&mu_);
    if (!broken_.ok()) return broken_;
    if (post != nullptr) posts_[rank] = *post;
    const uint64_t gen = generation_;
    if (++arrived_ == size_) {
      arrived_ = 0;
      ++generation_;
      cv_.SignalAll();
      return absl::OkStatus();
    }
    while (generation_ == gen && broken_.ok()) {
      if (cv_.WaitWithDeadline(&mu_, deadline) && generation_ == gen && broken_.ok()) {
        const std::string what =
            post != nullptr ? absl::StrCat(OpName(post->kind), " tag ", post->tag) : phase;
        broken_ = absl::DeadlineExceededError(
            absl::StrCat("inproc transport: rank ", rank, " timed out in ", what, ": ", arrived_,
                         " of ", size_, " ranks arrived before the deadline"));
        cv_.SignalAll();
      }
    }
    return broken_;
  }

  void Break(const absl::Status& status) {
    absl::MutexLock lock(&mu_);
    if (broken_.ok()) broken_ = status;
    cv_.SignalAll();
  }

  // Valid between the two rendezvous of a collective.
  const Post& post(int rank) const { return posts_[rank]; }

 private:
  const int size_;
  absl::Mutex mu_;
  absl::CondVar cv_;
  int arrived_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
  std::vector<Post> posts_;  // slot r written by rank r under mu_ before rendezvous A
};

// Every rank's contribution side by side, summed as the Gloo backend does
// (half_sum.h).
template <typename T>
void SumPosts(const Hub& hub, size_t count, T* out) {
  if (count == 0) return;  // (null buffers allowed then)
  std::vector<T> all(count * hub.size());
  for (int r = 0; r < hub.size(); ++r) {
    std::memcpy(all.data() + r * count, hub.post(r).in, count * sizeof(T));
  }
  SumInRankOrder(all.data(), count, hub.size(), count, out);
}

class InprocTransport final : public Transport {
 public:
  InprocTransport(std::shared_ptr<Hub> hub, int rank) : hub_(std::move(hub)), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return hub_->size(); }
  const char* name() const override { return "inproc"; }

  absl::Status Allgather(const void* in, size_t bytes, void* out,
                         const CollectiveOptions& o) override {
    if (absl::Status s = CheckBuffers("Allgather", bytes, in, out); !s.ok()) return s;
    Post p{OpKind::kAllgather, o.tag, in, bytes};
    return Run(p, o, [&]() -> absl::Status {
      for (int r = 0; r < size(); ++r) {
        if (bytes > 0) std::memcpy(static_cast<char*>(out) + r * bytes, hub_->post(r).in, bytes);
      }
      return absl::OkStatus();
    });
  }

  absl::Status AllgatherV(const void* in, absl::Span<const size_t> recv_bytes, void* out,
                          const CollectiveOptions& o) override {
    if (absl::Status s = CheckAllgatherV(rank_, size(), in, recv_bytes, out); !s.ok()) return s;
    Post p{OpKind::kAllgatherV, o.tag, in, recv_bytes[rank_]};
    p.recv = recv_bytes;
    return Run(p, o, [&]() -> absl::Status {
      size_t offset = 0;
      for (int r = 0; r < size(); ++r) {
        const Post& q = hub_->post(r);
        if (q.bytes != recv_bytes[r]) {
          return absl::InvalidArgumentError(
              absl::StrCat("AllgatherV tag ", o.tag, ": rank ", rank_, " expects ", recv_bytes[r],
                           " bytes from rank ", r, " which sends ", q.bytes));
        }
        if (q.bytes > 0) std::memcpy(static_cast<char*>(out) + offset, q.in, q.bytes);
        offset += q.bytes;
      }
      return absl::OkStatus();
    });
  }

  absl::Status AllreduceSum(void* data, size_t count, DataType type,
                            const CollectiveOptions& o) override {
    if (count > 0 && data == nullptr) return absl::InvalidArgumentError("AllreduceSum: null data");
    const size_t bytes = count * kernels::ElementBytes(type);
    std::vector<char> result(bytes);
    Post p{OpKind::kAllreduce, o.tag, data, count, type};
    absl::Status status = Run(p, o, [&]() -> absl::Status {
      for (int r = 0; r < size(); ++r) {
        if (hub_->post(r).type != type) {
          return absl::InvalidArgumentError(
              absl::StrCat("AllreduceSum tag ", o.tag, ": data types differ between ranks (",
                           kernels::ElementTypeName(type), " vs ",
                           kernels::ElementTypeName(hub_->post(r).type), ")"));
        }
      }
      switch (type) {
        case DataType::kFloat32:
          SumPosts(*hub_, count, reinterpret_cast<float*>(result.data()));
          break;
        case DataType::kInt32:
          SumPosts(*hub_, count, reinterpret_cast<int32_t*>(result.data()));
          break;
        case DataType::kInt64:
          SumPosts(*hub_, count, reinterpret_cast<int64_t*>(result.data()));
          break;
        case DataType::kBFloat16:
          SumPosts(*hub_, count, reinterpret_cast<Bf16*>(result.data()));
          break;
        case DataType::kFloat16:
          SumPosts(*hub_, count, reinterpret_cast<F16*>(result.data()));
          break;
      }
      return absl::OkStatus();
    });
    if (!status.ok()) return status;
    if (bytes > 0) std::memcpy(data, result.data(), bytes);
    return absl::OkStatus();
  }

  absl::Status AllreduceAverage(float* data, size_t count, float divisor,
                                const CollectiveOptions& o) override {
    RETURN_IF_ERROR(AllreduceSum(data, count, DataType::kFloat32, o));
    for (size_t i = 0; i < count; ++i) data[i] /= divisor;
    return absl::OkStatus();
  }

  absl::Status ExchangeRound(std::string_view mine, std::vector<std::string>* from,
                             const CollectiveOptions& o) override {
    if (from == nullptr) return absl::InvalidArgumentError("ExchangeRound: no output");
    Post p{OpKind::kExchange, o.tag, mine.data(), mine.size()};
    std::vector<std::string> got(size());
    RETURN_IF_ERROR(Run(p, o, [&]() -> absl::Status {
      for (int r = 0; r < size(); ++r) {
        const Post& q = hub_->post(r);
        got[r].assign(static_cast<const char*>(q.in), q.bytes);
      }
      return absl::OkStatus();
    }));
    *from = std::move(got);
    return absl::OkStatus();
  }

  absl::Status Barrier(const CollectiveOptions& o) override {
    Post p{OpKind::kBarrier, o.tag};
    return Run(p, o, [] { return absl::OkStatus(); });
  }

  void Abort(const absl::Status& reason) override {
    hub_->Break(absl::AbortedError(
        absl::StrCat("inproc transport aborted by rank ", rank_, ": ", reason.message())));
  }

 private:
  template <typename Body>
  absl::Status Run(const Post& p, const CollectiveOptions& o, Body body) {
    CountRounds(1);  // every collective here is one rendezvous of all ranks
    absl::Status s = hub_->Sync(rank_, &p, o.deadline, "post");
    if (!s.ok()) return s;
    // Every rank must be in the same collective.
    for (int r = 0; r < size(); ++r) {
      const Post& q = hub_->post(r);
      if (q.kind != p.kind || q.tag != p.tag ||
          (p.kind == OpKind::kAllgather && q.bytes != p.bytes) ||
          (p.kind == OpKind::kAllreduce && q.bytes != p.bytes)) {
        absl::Status err = absl::InvalidArgumentError(
            absl::StrCat("inproc transport: collective mismatch: rank ", rank_, " called ",
                         OpName(p.kind), " tag ", p.tag, " size ", p.bytes, ", rank ", r,
                         " called ", OpName(q.kind), " tag ", q.tag, " size ", q.bytes));
        hub_->Break(err);
        return err;
      }
    }
    absl::Status result = body();
    // Even on a local error, wait until everyone has read our buffers.
    s = hub_->Sync(rank_, nullptr, o.deadline, "completion");
    if (!result.ok()) {
      hub_->Break(result);
      return result;
    }
    return s;
  }

  std::shared_ptr<Hub> hub_;
  const int rank_;
};

}  // namespace

std::vector<std::unique_ptr<Transport>> CreateInprocGroup(int size) {
  std::vector<std::unique_ptr<Transport>> group;
  if (size < 1) return group;
  auto hub = std::make_shared<Hub>(size);
  for (int r = 0; r < size; ++r) group.push_back(std::make_unique<InprocTransport>(hub, r));
  return group;
}

}  // namespace microd::transport
