// Gloo backend. Gloo throws; every exception is caught here and becomes a
// Status, after which the transport is broken (all later calls fail at once).
//
// AllreduceSum is a reduce-scatter (alltoallv: rank j receives chunk j from
// every rank) summed in rank order, then an allgatherv of the summed chunks:
// the same bandwidth as a ring, and the same bits as the in-process backend,
// so results do not depend on the backend.
#include "daemon/transport/gloo/gloo_transport.h"

#include <gloo/allgather.h>
#include <gloo/allgatherv.h>
#include <gloo/alltoallv.h>
#include <gloo/barrier.h>
#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>

#include <chrono>
#include <cstring>
#include <exception>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

namespace microd::transport {
namespace {

// gloo::rendezvous::Store over our KeyValueStore.
class StoreAdapter final : public gloo::rendezvous::Store {
 public:
  StoreAdapter(control::KeyValueStore* store, std::string prefix, absl::Duration timeout)
      : store_(store), prefix_(std::move(prefix)), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    absl::Status s = store_->Set(Key(key), std::string(data.begin(), data.end()));
    if (!s.ok()) throw gloo::IoException(std::string(s.message()));
  }
  std::vector<char> get(const std::string& key) override {
    const std::string k = Key(key);
    auto v = store_->Get({&k, 1}, absl::Now() + timeout_);
    if (!v.ok()) throw gloo::IoException(std::string(v.status().message()));
    return std::vector<char>((*v)[0].begin(), (*v)[0].end());
  }
  void wait(const std::vector<std::string>& keys) override {
    wait(keys, std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout_)));
  }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    std::vector<std::string> full;
    for (const auto& k : keys) full.push_back(Key(k));
    auto v = store_->Get(full, absl::Now() + absl::FromChrono(timeout));
    if (!v.ok()) throw gloo::IoException(std::string(v.status().message()));
  }

 private:
  std::string Key(const std::string& k) const { return absl::StrCat(prefix_, "/", k); }
  control::KeyValueStore* const store_;
  const std::string prefix_;
  const absl::Duration timeout_;
};

absl::Status FromException(const std::exception& e, const char* op, uint32_t tag) {
  const std::string what = e.what();
  const std::string msg = absl::StrCat("gloo ", op, " tag ", tag, ": ", what);
  if (absl::StrContains(what, "Timed out") || absl::StrContains(what, "timed out") ||
      absl::StrContains(what, "Timeout")) {
    return absl::DeadlineExceededError(msg);
  }
  return absl::UnavailableError(msg);
}

class GlooTransport final : public Transport {
 public:
  GlooTransport(std::shared_ptr<gloo::Context> context, absl::Duration default_timeout)
      : context_(std::move(context)), default_timeout_(default_timeout) {}

  int rank() const override { return context_->rank; }
  int size() const override { return context_->size; }
  const char* name() const override { return "gloo"; }

  absl::Status Allgather(const void* in, size_t bytes, void* out,
                         const CollectiveOptions& o) override {
    if (bytes > 0 && (in == nullptr || out == nullptr)) {
      return absl::InvalidArgumentError("Allgather: null buffer");
    }
    return Run("Allgather", o, [&](std::chrono::milliseconds timeout) {
      if (bytes == 0) return;
      if (size() == 1) {
        std::memmove(out, in, bytes);
        return;
      }
      gloo::AllgatherOptions opts(context_);
      opts.setInput(static_cast<char*>(const_cast<void*>(in)), bytes);
      opts.setOutput(static_cast<char*>(out), bytes * size());
      opts.setTag(o.tag);
      opts.setTimeout(timeout);
      gloo::allgather(opts);
    });
  }

  absl::Status AllgatherV(const void* in, absl::Span<const size_t> recv_bytes, void* out,
                          const CollectiveOptions& o) override {
    if (recv_bytes.size() != static_cast<size_t>(size())) {
      return absl::InvalidArgumentError(
          absl::StrCat("AllgatherV: ", recv_bytes.size(), " counts for ", size(), " ranks"));
    }
    size_t total = 0;
    for (size_t b : recv_bytes) total += b;
    if ((recv_bytes[rank()] > 0 && in == nullptr) || (total > 0 && out == nullptr)) {
      return absl::InvalidArgumentError("AllgatherV: null buffer");
    }
    return Run("AllgatherV", o, [&](std::chrono::milliseconds timeout) {
      GatherV(in, std::vector<size_t>(recv_bytes.begin(), recv_bytes.end()), out, o.tag, timeout);
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

  absl::Status Barrier(const CollectiveOptions& o) override {
    return Run("Barrier", o, [&](std::chrono::milliseconds timeout) {
      if (size() == 1) return;
      gloo::BarrierOptions opts(context_);
      opts.setTag(o.tag);
      opts.setTimeout(timeout);
      gloo::barrier(opts);
    });
  }

  void Abort(const absl::Status& reason) override {
    {
      absl::MutexLock lock(&mu_);
      if (broken_.ok()) {
        broken_ = absl::AbortedError(absl::StrCat("gloo transport aborted: ", reason.message()));
      }
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
      return Break(absl::DeadlineExceededError(absl::StrCat("gloo ", op, " tag ", o.tag,
                                                            ": deadline already passed")));
    }
    const auto timeout = std::chrono::milliseconds(
        std::max<int64_t>(1, absl::ToInt64Milliseconds(deadline - now)));
    try {
      body(timeout);
    } catch (const std::exception& e) {
      return Break(FromException(e, op, o.tag));
    }
    return absl::OkStatus();
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
    char dummy = 0;
    opts.setInput(bytes[rank()] > 0 ? static_cast<char*>(const_cast<void*>(in)) : &dummy,
                  bytes[rank()]);
    opts.setOutput(static_cast<char*>(out), std::move(bytes));
    opts.setTag(tag);
    opts.setTimeout(timeout);
    gloo::allgatherv(opts);
  }

  template <typename T>
  void Reduce(T* data, size_t count, uint32_t tag, std::chrono::milliseconds timeout) {
    const int n = size();
    const int r = rank();
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
      opts.setInput(data, send_counts);
      opts.setOutput(recv.data(), recv_counts);
      opts.setTag(tag);
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
    GatherV(sum.data(), std::move(bytes), data, tag, timeout);
  }

  std::shared_ptr<gloo::Context> context_;
  const absl::Duration default_timeout_;
  absl::Mutex mu_;
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
};

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
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = o.hostname;
    auto device = gloo::transport::tcp::CreateDevice(attr);
    auto context = std::make_shared<gloo::rendezvous::Context>(o.rank, o.size);
    context->setTimeout(std::chrono::milliseconds(absl::ToInt64Milliseconds(o.timeout)));
    if (o.size > 1) {
      StoreAdapter store(o.store, o.prefix, o.timeout);
      context->connectFullMesh(store, device);
    }
    return std::unique_ptr<Transport>(new GlooTransport(context, o.timeout));
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("gloo: rank ", o.rank, " of ", o.size, " could not connect: ", e.what()));
  }
}

}  // namespace microd::transport
