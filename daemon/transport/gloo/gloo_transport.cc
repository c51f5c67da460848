// Gloo backend. Gloo throws; every exception is caught here and becomes a
// Status, after which the transport is broken (all later calls fail at once).
//
// AllreduceSum is a reduce-scatter (alltoallv: rank j receives chunk j from
// every rank) summed in rank order, then an allgatherv of the summed chunks:
// the same bandwidth as a ring, and the same bits as the in-process backend,
// so results do not depend on the backend. Small ones (histograms, a few
// values) are an allgather and a rank-order sum on every rank: one round
// (a direct exchange with every peer, not Gloo's ring, while they are small).
#include "daemon/transport/gloo/gloo_transport.h"

#include <gloo/allgather.h>
#include <gloo/allgatherv.h>
#include <gloo/alltoallv.h>
#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <future>
#include <memory>
#include <stdexcept>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "daemon/transport/gloo/store_adapter.h"

namespace microd::transport {
namespace {

absl::Status FromException(const std::exception& e, const char* op, uint32_t tag) {
  const std::string what = e.what();
  const std::string msg = absl::StrCat("gloo ", op, " tag ", tag, ": ", what);
  if (absl::StrContains(what, "Timed out") || absl::StrContains(what, "timed out") ||
      absl::StrContains(what, "Timeout")) {
    return absl::DeadlineExceededError(msg);
  }
  return absl::UnavailableError(msg);
}

// Up to this many elements an allreduce is an allgather plus a local sum.
constexpr size_t kSmallAllreduceElements = 4096;

// Up to this many bytes in all, an allgather is direct: every rank sends its
// block to every peer at once over Gloo's point-to-point buffers and waits
// for all of them, one round, where Gloo's ring takes n - 1 rounds one after
// another (each a wake-up on every rank: what a small bucket's latency is
// made of). Larger ones use Gloo's ring, which moves fewer bytes per link.
constexpr size_t kDirectAllgatherBytes = 256 << 10;
// Gloo slot prefix of the direct allgather (Gloo's own collectives use 0x01-0x08).
constexpr uint8_t kDirectAllgatherSlotPrefix = 0x40;

// Gloo matches operations by tag alone and aborts the process when two
// ranks use one tag for buffers of different sizes. The kind of collective
// is folded into the Gloo tag, so that ranks calling different collectives
// (a contract violation) time out instead.
enum class GlooKind : uint32_t { kAllgather = 1, kAllgatherV = 2, kAlltoallV = 3, kBarrier = 4 };
uint32_t GlooTag(uint32_t tag, GlooKind kind) { return tag * 8 + static_cast<uint32_t>(kind); }

class GlooTransport final : public Transport {
 public:
  GlooTransport(std::shared_ptr<gloo::Context> context, absl::Duration default_timeout)
      : context_(std::move(context)), default_timeout_(default_timeout) {}

  int rank() const override { return context_->rank; }
  int size() const override { return context_->size; }
  const char* name() const override { return "gloo"; }

  absl::Status Allgather(const void* in, size_t bytes, void* out,
                         const CollectiveOptions& o) override {
    if (absl::Status s = CheckBuffers("Allgather", bytes, in, out); !s.ok()) return s;
    return Run("Allgather", o, [&](std::chrono::milliseconds timeout) {
      if (bytes == 0) return;
      if (size() == 1) {
        std::memmove(out, in, bytes);
        return;
      }
      GatherFixed(const_cast<void*>(in), bytes, out, GlooTag(o.tag, GlooKind::kAllgather), timeout);
    });
  }

  absl::Status AllgatherV(const void* in, absl::Span<const size_t> recv_bytes, void* out,
                          const CollectiveOptions& o) override {
    if (absl::Status s = CheckAllgatherV(rank(), size(), in, recv_bytes, out); !s.ok()) return s;
    return Run("AllgatherV", o, [&](std::chrono::milliseconds timeout) {
      GatherV(in, std::vector<size_t>(recv_bytes.begin(), recv_bytes.end()), out,
              GlooTag(o.tag, GlooKind::kAllgatherV), timeout);
    });
  }

  absl::Status AllreduceSum(void* data, size_t count, DataType type,
                            const CollectiveOptions& o) override {
    if (count > 0 && data == nullptr) return absl::InvalidArgumentError("AllreduceSum: null data");
    return Run("AllreduceSum", o, [&](std::chrono::milliseconds timeout) {
      if (count == 0 || size() == 1) return;
      switch (type) {
        case DataType::kFloat32:
          Reduce(static_cast<float*>(data), count, o.tag, timeout);
          break;
        case DataType::kInt32:
          Reduce(static_cast<int32_t*>(data), count, o.tag, timeout);
          break;
        case DataType::kInt64:
          Reduce(static_cast<int64_t*>(data), count, o.tag, timeout);
          break;
      }
    });
  }

  // An allgather of one byte: unlike gloo::barrier it can be aborted.
  absl::Status Barrier(const CollectiveOptions& o) override {
    return Run("Barrier", o, [&](std::chrono::milliseconds timeout) {
      if (size() == 1) return;
      char mine = 1;
      std::vector<char> all(size());
      GatherFixed(&mine, 1, all.data(), GlooTag(o.tag, GlooKind::kBarrier), timeout);
    });
  }

  void Abort(const absl::Status& reason) override {
    {
      absl::MutexLock lock(&mu_);
      if (broken_.ok()) {
        broken_ = absl::AbortedError(absl::StrCat("gloo transport aborted: ", reason.message()));
      }
    }
    // Wake a collective blocked on this rank. Gloo consumes an abort with
    // the one wait it ends, and its algorithms go on to their next wait, so
    // keep aborting until the collective has left (its buffers untracked),
    // for a bounded time.
    const absl::Time give_up = absl::Now() + absl::Seconds(2);
    for (bool first = true;; first = false) {
      {
        absl::MutexLock lock(&active_mu_);
        aborted_ = true;
        if (!first && active_.empty()) break;
        for (gloo::transport::UnboundBuffer* b : active_) {
          b->abortWaitRecv();
          b->abortWaitSend();
        }
      }
      if (absl::Now() > give_up) break;
      absl::SleepFor(absl::Milliseconds(5));
    }
    // Closing the connections makes a blocked call on this rank fail, and
    // every peer's calls fail when they notice the closed sockets.
    try {
      context_->closeConnections();
    } catch (const std::exception&) {
    }
  }

 private:
  template <typename Body>
  absl::Status Run(const char* op, const CollectiveOptions& o, Body body) {
    {
      absl::MutexLock lock(&mu_);
      if (!broken_.ok()) return broken_;
    }
    const absl::Time now = absl::Now();
    const absl::Time deadline =
        o.deadline == absl::InfiniteFuture() ? now + default_timeout_ : o.deadline;
    if (deadline <= now) {
      return Break(absl::DeadlineExceededError(
          absl::StrCat("gloo ", op, " tag ", o.tag, ": deadline already passed")));
    }
    const auto timeout =
        std::chrono::milliseconds(std::max<int64_t>(1, absl::ToInt64Milliseconds(deadline - now)));
    try {
      body(timeout);
    } catch (const std::exception& e) {
      return Break(FromException(e, op, o.tag));
    }
    absl::MutexLock lock(&mu_);
    return broken_;  // an abort during the call fails it even if Gloo returned
  }

  // Buffers of the collective in flight are tracked so that Abort can wake
  // it: gloo has no cancellation, but its buffers' waits can be aborted.
  // Declare an ActiveScope after the collective's options object, so that the
  // buffers are untracked before the options free them.
  struct ActiveScope {
    GlooTransport* t;
    ~ActiveScope() {
      absl::MutexLock lock(&t->active_mu_);
      t->active_.clear();
    }
  };
  std::unique_ptr<gloo::transport::UnboundBuffer> Track(void* ptr, size_t bytes) {
    auto b = context_->createUnboundBuffer(ptr, bytes);
    absl::MutexLock lock(&active_mu_);
    // Aborted before the collective began waiting: do not start it (Run
    // turns this into the transport's broken status).
    if (aborted_) throw std::runtime_error("transport aborted");
    active_.push_back(b.get());
    return b;
  }

  void GatherFixed(void* in, size_t bytes, void* out, uint32_t tag,
                   std::chrono::milliseconds timeout) {
    if (bytes * size() <= kDirectAllgatherBytes) {
      GatherDirect(in, bytes, out, tag, timeout);
      return;
    }
    gloo::AllgatherOptions opts(context_);
    ActiveScope scope{this};
    opts.setInput<char>(Track(in, bytes));
    opts.setOutput<char>(Track(out, bytes * size()));
    opts.setTag(tag);
    opts.setTimeout(timeout);
    gloo::allgather(opts);
  }

  void GatherDirect(void* in, size_t bytes, void* out, uint32_t tag,
                    std::chrono::milliseconds timeout) {
    const int n = size();
    const int r = rank();
    char* const dst = static_cast<char*>(out);
    if (bytes > 0) std::memmove(dst + r * bytes, in, bytes);
    if (n == 1 || bytes == 0) return;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    // The buffers outlive the scope: Abort may touch them until it untracks.
    std::unique_ptr<gloo::transport::UnboundBuffer> send, recv;
    ActiveScope scope{this};
    send = Track(in, bytes);
    recv = Track(out, bytes * n);
    const uint64_t slot = gloo::Slot::build(kDirectAllgatherSlotPrefix, tag);
    for (int p = 0; p < n; ++p) {
      if (p == r) continue;
      recv->recv(p, slot, p * bytes, bytes);
      send->send(p, slot);
    }
    // Each wait ends one transfer; false means Abort woke it.
    for (int i = 0; i < n - 1; ++i) {
      if (!recv->waitRecv(deadline)) throw std::runtime_error("transport aborted");
    }
    for (int i = 0; i < n - 1; ++i) {
      if (!send->waitSend(deadline)) throw std::runtime_error("transport aborted");
    }
  }

  absl::Status Break(absl::Status status) {
    absl::MutexLock lock(&mu_);
    if (broken_.ok()) broken_ = status;
    return broken_;
  }

  void GatherV(const void* in, std::vector<size_t> bytes, void* out, uint32_t tag,
               std::chrono::milliseconds timeout) {
    size_t total = 0;
    for (size_t b : bytes) total += b;
    if (total == 0) return;
    if (size() == 1) {
      std::memmove(out, in, bytes[0]);
      return;
    }
    gloo::AllgathervOptions opts(context_);
    ActiveScope scope{this};
    char dummy = 0;
    opts.setInput<char>(Track(bytes[rank()] > 0 ? const_cast<void*>(in) : &dummy, bytes[rank()]));
    opts.setOutput<char>(Track(out, total), std::move(bytes));
    opts.setTag(tag);
    opts.setTimeout(timeout);
    gloo::allgatherv(opts);
  }

  template <typename T>
  void Reduce(T* data, size_t count, uint32_t tag, std::chrono::milliseconds timeout) {
    const int n = size();
    const int r = rank();
    if (count <= kSmallAllreduceElements) {
      // Small: one allgather, then every rank sums all contributions in rank
      // order (one round instead of two).
      std::vector<T> all(count * n);
      GatherFixed(data, count * sizeof(T), all.data(), GlooTag(tag, GlooKind::kAllgather), timeout);
      std::memcpy(data, all.data(), count * sizeof(T));
      for (int q = 1; q < n; ++q) {
        const T* in = all.data() + q * count;
        for (size_t i = 0; i < count; ++i) data[i] += in[i];
      }
      return;
    }
    std::vector<size_t> chunk(n), offset(n);
    for (int j = 0; j < n; ++j) {
      chunk[j] = count / n + (static_cast<size_t>(j) < count % n ? 1 : 0);
      offset[j] = j == 0 ? 0 : offset[j - 1] + chunk[j - 1];
    }
    // Reduce-scatter: receive chunk r from every rank, in rank order.
    std::vector<T> recv(chunk[r] * n + 1);
    {
      std::vector<int64_t> send_counts(chunk.begin(), chunk.end());
      std::vector<int64_t> recv_counts(n, static_cast<int64_t>(chunk[r]));
      gloo::AlltoallvOptions opts(context_);
      ActiveScope scope{this};
      opts.setInput<T>(Track(data, count * sizeof(T)), send_counts);
      opts.setOutput<T>(Track(recv.data(), chunk[r] * n * sizeof(T)), recv_counts);
      opts.setTag(GlooTag(tag, GlooKind::kAlltoallV));
      opts.setTimeout(timeout);
      gloo::alltoallv(opts);
    }
    std::vector<T> sum(chunk[r] + 1);
    if (chunk[r] > 0) {
      std::memcpy(sum.data(), recv.data(), chunk[r] * sizeof(T));
      for (int q = 1; q < n; ++q) {
        const T* in = recv.data() + q * chunk[r];
        for (size_t i = 0; i < chunk[r]; ++i) sum[i] += in[i];
      }
    }
    std::vector<size_t> bytes(n);
    for (int j = 0; j < n; ++j) bytes[j] = chunk[j] * sizeof(T);
    GatherV(sum.data(), std::move(bytes), data, GlooTag(tag, GlooKind::kAllgatherV), timeout);
  }

  std::shared_ptr<gloo::Context> context_;
  const absl::Duration default_timeout_;
  absl::Mutex mu_;
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
  absl::Mutex active_mu_;
  std::vector<gloo::transport::UnboundBuffer*> active_ ABSL_GUARDED_BY(active_mu_);
  bool aborted_ ABSL_GUARDED_BY(active_mu_) = false;
};

// Runs setpriority on Gloo's network thread itself: an eventfd registered
// with the device's event loop, whose handler runs on that thread.
class IoNiceSetter final : public gloo::transport::tcp::Handler {
 public:
  explicit IoNiceSetter(int nice) : nice_(nice) {}

  absl::Status Apply(gloo::transport::tcp::Device& device) {
    const int fd = eventfd(1, EFD_NONBLOCK | EFD_CLOEXEC);
    if (fd < 0) return absl::InternalError(absl::StrCat("eventfd: ", strerror(errno)));
    std::future<int> done = result_.get_future();
    device.registerDescriptor(fd, EPOLLIN, this);
    const bool ran = done.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
    device.unregisterDescriptor(fd, this);  // waits for a loop tick: no call after this
    close(fd);
    if (!ran) return absl::DeadlineExceededError("gloo: the network thread did not run in 10 s");
    if (const int err = done.get(); err != 0) {
      return absl::InternalError(absl::StrCat("gloo: could not set the network thread's nice to ",
                                              nice_, ": ", strerror(err)));
    }
    return absl::OkStatus();
  }

  void handleEvents(int) override {
    if (fired_) return;  // level-triggered: may run again before unregistering
    fired_ = true;
    const id_t tid = static_cast<id_t>(gettid());
    errno = 0;
    const int current = getpriority(PRIO_PROCESS, tid);
    int err = errno;
    if (err == 0 && setpriority(PRIO_PROCESS, tid, std::min(19, current + nice_)) != 0) err = errno;
    result_.set_value(err);
  }

 private:
  const int nice_;
  bool fired_ = false;  // touched by the network thread only
  std::promise<int> result_;
};

void IgnoreSigpipe() {
  struct sigaction current {};
  if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
    signal(SIGPIPE, SIG_IGN);
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> CreateGlooTransport(const GlooOptions& o) {
  if (o.size < 1 || o.rank < 0 || o.rank >= o.size) {
    return absl::InvalidArgumentError(
        absl::StrCat("gloo: rank ", o.rank, " of ", o.size, " is out of range"));
  }
  if (o.store == nullptr) return absl::InvalidArgumentError("gloo: no rendezvous store");
  if (o.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("gloo: timeout must be positive");
  }
  if (o.io_nice < 0 || o.io_nice > 19) {
    return absl::InvalidArgumentError(
        absl::StrCat("gloo: io_nice must be 0 to 19, not ", o.io_nice));
  }
  // Gloo writes to sockets without MSG_NOSIGNAL: a peer that died would kill
  // this process with SIGPIPE instead of failing the call.
  IgnoreSigpipe();
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = o.hostname;
    auto device = gloo::transport::tcp::CreateDevice(attr);
    if (o.io_nice > 0) {
      auto* tcp = dynamic_cast<gloo::transport::tcp::Device*>(device.get());
      if (tcp == nullptr) return absl::InternalError("gloo: the device is not a tcp device");
      IoNiceSetter setter(o.io_nice);
      if (absl::Status s = setter.Apply(*tcp); !s.ok()) return s;
    }
    auto context = std::make_shared<gloo::rendezvous::Context>(o.rank, o.size);
    context->setTimeout(std::chrono::milliseconds(absl::ToInt64Milliseconds(o.timeout)));
    if (o.size > 1) {
      GlooStoreAdapter store(o.store, o.prefix, o.timeout);
      context->connectFullMesh(store, device);
    }
    return std::unique_ptr<Transport>(new GlooTransport(context, o.timeout));
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("gloo: rank ", o.rank, " of ", o.size, " could not connect: ", e.what()));
  }
}

}  // namespace microd::transport
