// SPDX-License-Identifier: Apache-2.0
// Gloo backend: the transport's life (connection, links' measure, abort)
// and the factory. Gloo throws; every exception is caught here and becomes
// a Status, after which the transport is broken (all later calls fail at
// once). The collectives live one file each: allgather.cc, allreduce.cc,
// exchange.cc.
#include "daemon/transport/gloo/gloo_transport.h"

#include <gloo/rendezvous/context.h>

#include <algorithm>
#include <future>

#include "absl/strings/match.h"
#include "daemon/common/status_macros.h"
#include "daemon/transport/gloo/gloo_internal.h"
#include "daemon/transport/gloo/store_adapter.h"

namespace microd::transport {
namespace gloo_backend {

absl::Status FromException(const std::exception& e, const char* op, uint32_t tag) {
  if (const auto* link = dynamic_cast<const record::LinkError*>(&e); link != nullptr) {
    const absl::Status& s = link->status();
    return absl::Status(s.code(), absl::StrCat("gloo ", op, " tag ", tag, ": ", s.message()));
  }
  const std::string what = e.what();
  const std::string msg = absl::StrCat("gloo ", op, " tag ", tag, ": ", what);
  if (absl::StrContains(what, "Timed out") || absl::StrContains(what, "timed out") ||
      absl::StrContains(what, "Timeout")) {
    return absl::DeadlineExceededError(msg);
  }
  return absl::UnavailableError(msg);
}

namespace {
// The control tag's slot of Confirm's rounds (the links' probes take 1-4).
constexpr uint32_t kConfirmSlot = 6;
}  // namespace

thread_local GlooTransport::ActiveScope* GlooTransport::ActiveScope::current = nullptr;

GlooTransport::ActiveScope::ActiveScope(GlooTransport* transport) : t(transport), outer(current) {
  current = this;
}

GlooTransport::ActiveScope::~ActiveScope() {
  current = outer;
  absl::MutexLock lock(&t->active_mu_);
  for (Buffer* b : mine) {
    auto it = std::find(t->active_.begin(), t->active_.end(), b);
    if (it != t->active_.end()) t->active_.erase(it);
  }
}

void GlooTransport::ActiveScope::Add(Buffer* b) {
  t->active_.push_back(b);
  mine.push_back(b);
}

GlooTransport::GlooTransport(std::shared_ptr<::gloo::Context> lane,
                             std::shared_ptr<record::Device> device, absl::Duration default_timeout,
                             bool sealed, bool confirm)
    : lanes_{std::move(lane)},
      devices_{std::move(device)},
      default_timeout_(default_timeout),
      sealed_(sealed),
      confirm_(confirm),
      scratch_(1) {
  model_.connections = 1;
}

void GlooTransport::AddLanes(std::vector<std::shared_ptr<::gloo::Context>> lanes,
                             std::vector<std::shared_ptr<record::Device>> devices) {
  for (auto& l : lanes) lanes_.push_back(std::move(l));
  for (auto& d : devices) devices_.push_back(std::move(d));
  scratch_.resize(lanes_.size());
  model_.connections = static_cast<int>(lanes_.size());
}

uint64_t GlooTransport::refused_transfers() const {
  uint64_t n = 0;
  for (const auto& d : devices_) n += d->refused_records();
  return n;
}

std::unique_ptr<::gloo::transport::UnboundBuffer> GlooTransport::Track(void* ptr, size_t bytes,
                                                                       size_t lane) {
  auto b = lanes_[lane]->createUnboundBuffer(ptr, bytes);
  absl::MutexLock lock(&active_mu_);
  // Aborted before the collective began waiting: do not start it (Run
  // turns this into the transport's broken status).
  if (aborted_) throw std::runtime_error("transport aborted");
  if (ActiveScope::current != nullptr) ActiveScope::current->Add(b.get());
  return b;
}

void GlooTransport::WaitRecv(Buffer* b, std::chrono::steady_clock::time_point deadline) {
  if (!b->waitRecv(deadline)) throw std::runtime_error("transport aborted");
}

void GlooTransport::WaitSend(Buffer* b, std::chrono::steady_clock::time_point deadline) {
  if (!b->waitSend(deadline)) throw std::runtime_error("transport aborted");
}

absl::Status GlooTransport::Break(absl::Status status) {
  absl::MutexLock lock(&mu_);
  if (broken_.ok()) broken_ = status;
  return broken_;
}

void* GlooTransport::Scratch(size_t bytes, size_t lane) {
  Scratchpad& s = scratch_[lane];
  if (bytes > s.size || (s.size > (size_t{16} << 20) && bytes <= s.size / 4)) {
    s.bytes.reset();
    scratch_bytes_ -= s.size;
    s.bytes.reset(new char[bytes]);
    s.size = bytes;
    scratch_bytes_ += bytes;
  }
  return s.bytes.get();
}

absl::Status GlooTransport::Confirm(absl::Time deadline) {
  // An empty direct round with its receives posted ahead (a one-way trip).
  if (!confirm_ || size() == 1) return absl::OkStatus();
  CollectiveOptions o;
  o.tag = MakeTag(kConfirmSlot, TagKind::kControl);
  o.deadline = deadline;
  if (!confirm_posted_) {
    Expect(o.tag, 0);
    confirm_posted_ = true;
  }
  std::vector<std::string> from;
  absl::Status s = ExchangeRound("", &from, o);
  Expect(o.tag, 0);  // the next Confirm's
  if (s.ok()) ++confirmed_;
  return s;
}

// Each rank times direct rounds of a few bytes, without and with their
// receives posted ahead (the latencies), and posted ones of 60 and 240 KiB
// to every peer (the bandwidth, from the difference: what a round's first
// flight costs cancels out); then all take the slowest of each
// (LinkModel::Combine). A `given` model replaces this rank's probes.
absl::Status GlooTransport::MeasureLinks(absl::Time deadline,
                                         const std::optional<LinkModel>& given) {
  model_.ranks = size();
  if (size() == 1) return absl::OkStatus();
  CollectiveOptions o;
  o.deadline = deadline;
  o.tag = MakeTag(0, TagKind::kControl);
  if (given.has_value()) {
    LinkModel mine = *given;
    mine.ranks = size();
    return ShareLinkModel(mine, o);
  }
  std::vector<std::string> from;
  // Each kind of probe round its own tag (slots 1-4 of the control tags).
  auto timed = [&](size_t bytes, bool posted) -> absl::StatusOr<double> {
    const std::string mine(bytes, 'x');
    CollectiveOptions r = o;
    r.tag = MakeTag(!posted ? 1 : bytes <= 8 ? 2 : bytes <= (64 << 10) ? 3 : 4, TagKind::kControl);
    if (posted) {
      Expect(r.tag, bytes + 4096);
      // The others post theirs too before anyone sends: a round apart.
      RETURN_IF_ERROR(ExchangeRound("", &from, o));
    }
    const absl::Time t0 = absl::Now();
    RETURN_IF_ERROR(ExchangeRound(mine, &from, r));
    return absl::ToDoubleSeconds(absl::Now() - t0);
  };
  // The fastest of each: what the link does (the daemons start at once, and
  // a busy machine only ever adds to a round).
  auto fastest = [](const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); };
  std::vector<double> cold, posted, small, large;
  for (int i = 0; i < 5; ++i) {
    ASSIGN_OR_RETURN(const double t, timed(8, false));
    cold.push_back(t);
  }
  for (int i = 0; i < 5; ++i) {
    ASSIGN_OR_RETURN(const double t, timed(8, true));
    posted.push_back(t);
  }
  constexpr size_t kSmall = 60 << 10, kLarge = 240 << 10;
  for (int i = 0; i < 2; ++i) {
    ASSIGN_OR_RETURN(const double a, timed(kSmall, true));
    small.push_back(a);
    ASSIGN_OR_RETURN(const double b, timed(kLarge, true));
    large.push_back(b);
  }
  LinkModel mine;
  mine.ranks = size();
  mine.round_seconds = fastest(cold);
  mine.posted_round_seconds = std::min(fastest(posted), mine.round_seconds);
  const double extra = fastest(large) - fastest(small);
  mine.bytes_per_second =
      static_cast<double>(size() - 1) * (kLarge - kSmall) / std::max(extra, 1e-6);
  return ShareLinkModel(mine, o);
}

absl::Status GlooTransport::ShareLinkModel(const LinkModel& mine, const CollectiveOptions& o) {
  std::vector<LinkModel> all(size());
  RETURN_IF_ERROR(Allgather(&mine, sizeof mine, all.data(), o));
  const int connections = model_.connections;
  model_ = LinkModel::Combine(all);
  model_.connections = connections;
  return absl::OkStatus();
}

void GlooTransport::Abort(const absl::Status& reason) {
  {
    absl::MutexLock lock(&mu_);
    if (broken_.ok()) {
      broken_ = absl::AbortedError(absl::StrCat("gloo transport aborted: ", reason.message()));
    }
  }
  // Wake a collective blocked on this rank. Gloo consumes an abort with the
  // one wait it ends, and its algorithms go on to their next wait, so keep
  // aborting until the collective has left (its buffers untracked), for a
  // bounded time.
  const absl::Time give_up = absl::Now() + absl::Seconds(2);
  for (bool first = true;; first = false) {
    {
      absl::MutexLock lock(&active_mu_);
      aborted_ = true;
      if (!first && active_.empty()) break;
      for (Buffer* b : active_) {
        b->abortWaitRecv();
        b->abortWaitSend();
      }
    }
    if (absl::Now() > give_up) break;
    absl::SleepFor(absl::Milliseconds(5));
  }
  // Closing the connections makes a blocked call on this rank fail, and
  // every peer's calls fail when they notice the closed sockets.
  for (auto& lane : lanes_) {
    try {
      lane->closeConnections();
    } catch (const std::exception&) {
    }
  }
}

}  // namespace gloo_backend

namespace {

std::chrono::milliseconds Millis(absl::Duration d) {
  return std::chrono::milliseconds(absl::ToInt64Milliseconds(d));
}

// One lane: a device of its own (its thread, its listening socket, closed
// once the lane connected), a full mesh through the store under `prefix`.
std::shared_ptr<::gloo::Context> ConnectLane(const GlooOptions& o, int lane,
                                             const std::string& prefix, absl::Duration connect,
                                             std::shared_ptr<record::Device>* device_out) {
  record::DeviceOptions d;
  d.hostname = o.hostname;
  d.lane = lane;
  d.io_nice = o.io_nice;
  d.handshake_timeout = std::min(connect, absl::Seconds(10));
  if (o.seal != nullptr) {
    d.link_secret = [seal = o.seal](int self, int peer) { return seal->LinkSecret(self, peer); };
  }
  auto device = record::CreateDevice(d);
  if (!device.ok()) throw record::LinkError(device.status());
  auto context = std::make_shared<::gloo::rendezvous::Context>(o.rank, o.size);
  context->setTimeout(Millis(connect));
  if (o.size > 1) {
    GlooStoreAdapter store(o.store, prefix, connect);
    std::shared_ptr<::gloo::transport::Device> base = *device;
    context->connectFullMesh(store, base);
  }
  (*device)->StopListening();
  context->setTimeout(Millis(o.timeout));
  *device_out = *device;
  return context;
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
  if (o.connections < 0 || o.connections > 16) {
    return absl::InvalidArgumentError(
        absl::StrCat("gloo: connections must be 0 to 16, not ", o.connections));
  }
  if (o.io_nice < 0 || o.io_nice > 19) {
    return absl::InvalidArgumentError(
        absl::StrCat("gloo: io_nice must be 0 to 19, not ", o.io_nice));
  }
  const absl::Duration connect =
      o.connect_timeout > absl::ZeroDuration() ? std::min(o.connect_timeout, o.timeout) : o.timeout;
  try {
    std::shared_ptr<record::Device> first_device;
    auto first = ConnectLane(o, 0, o.prefix, connect, &first_device);
    auto transport = std::make_unique<gloo_backend::GlooTransport>(first, first_device, o.timeout,
                                                                   o.seal != nullptr, o.confirm);
    transport->SetOnCollective(o.on_collective);
    if (absl::Status s = transport->MeasureLinks(absl::Now() + connect, o.link_model); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("gloo: rank ", o.rank, " of ", o.size,
                                                 " could not measure its links: ", s.message()));
    }
    // More connections per pair where one cannot fill the link: on a long
    // link one TCP connection's window (and its congestion control's
    // estimate) holds back a large allreduce. The model is every rank's
    // alike, so every rank makes as many. They connect at once, each
    // through keys of its own: on a long link their rendezvous (a few round
    // trips each) would add up.
    int lanes = o.connections;
    if (lanes == 0) {
      lanes = transport->link_model()->round_seconds >= gloo_backend::kLongLinkSeconds ? 4 : 1;
    }
    if (lanes > 1 && o.size > 1) {
      std::vector<std::future<std::shared_ptr<::gloo::Context>>> connecting;
      std::vector<std::shared_ptr<record::Device>> devices(lanes);
      for (int i = 1; i < lanes; ++i) {
        connecting.push_back(std::async(std::launch::async, [&, i] {
          return ConnectLane(o, i, absl::StrCat(o.prefix, "/lane", i), connect, &devices[i]);
        }));
      }
      std::vector<std::shared_ptr<::gloo::Context>> contexts;
      std::exception_ptr failed;
      for (auto& f : connecting) {
        try {
          contexts.push_back(f.get());  // every one waited for, even after a failure
        } catch (...) {
          if (!failed) failed = std::current_exception();
        }
      }
      if (failed) std::rethrow_exception(failed);
      devices.erase(devices.begin());
      transport->AddLanes(std::move(contexts), std::move(devices));
    }
    return std::unique_ptr<Transport>(std::move(transport));
  } catch (const record::LinkError& e) {
    return absl::Status(e.status().code(),
                        absl::StrCat("gloo: rank ", o.rank, " of ", o.size,
                                     " could not connect: ", e.status().message()));
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("gloo: rank ", o.rank, " of ", o.size, " could not connect: ", e.what()));
  }
}

}  // namespace microd::transport
