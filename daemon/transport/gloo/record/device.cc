// SPDX-License-Identifier: Apache-2.0
#include "daemon/transport/gloo/record/device.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/common/crypto.h"
#include "daemon/common/log.h"
#include "daemon/transport/gloo/record/device_impl.h"
#include "daemon/transport/gloo/record/pair.h"

namespace microd::transport::record {
namespace {

uint64_t Le64(const std::string& bytes) {
  uint64_t v = 0;
  for (size_t i = 0; i < 8 && i < bytes.size(); ++i) {
    v |= static_cast<uint64_t>(static_cast<unsigned char>(bytes[i])) << (8 * i);
  }
  return v;
}

}  // namespace

// An accepted connection in its handshake (the loop's thread only, but for
// the device's destructor).
struct DeviceImpl::Handshake final : Loop::Handler {
  Handshake(DeviceImpl* d, int f, std::string p, absl::Time t)
      : device(d), fd(f), peer(std::move(p)), deadline(t) {}
  void OnEvents(uint32_t events) override { device->OnHandshake(this, events); }

  DeviceImpl* const device;
  const int fd;
  const std::string peer;  // host:port, for the log
  const absl::Time deadline;
  uint64_t registration = 0;
  bool finishing = false;  // the Hello was answered: the Finish is next
  std::string in;          // what arrived of the current message
  std::string transcript;
  std::string auth_key;
  uint64_t pair_id = 0;
};

DeviceImpl::DeviceImpl(const DeviceOptions& options) : options_(options) {}

absl::StatusOr<std::shared_ptr<Device>> CreateDevice(const DeviceOptions& options) {
  auto d = DeviceImpl::Create(options);
  if (!d.ok()) return d.status();
  return std::shared_ptr<Device>(*std::move(d));
}

absl::StatusOr<std::shared_ptr<DeviceImpl>> DeviceImpl::Create(const DeviceOptions& options) {
  if (options.max_handshakes < 1) return absl::InvalidArgumentError("max_handshakes < 1");
  if (options.handshake_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("handshake_timeout must be positive");
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (const int rc = getaddrinfo(options.hostname.c_str(), "0", &hints, &found); rc != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("the data plane's address '", options.hostname, "': ", gai_strerror(rc)));
  }
  std::shared_ptr<DeviceImpl> d(new DeviceImpl(options));
  std::string last;
  int fd = -1;
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) continue;
    const int one = 1;
    (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, a->ai_addr, a->ai_addrlen) != 0 || listen(fd, 128) != 0) {
      last = strerror(errno);
      ::close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(found);
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", options.hostname, " for the data plane: ", last));
  }
  d->local_len_ = sizeof d->local_;
  getsockname(fd, reinterpret_cast<sockaddr*>(&d->local_), &d->local_len_);
  d->local_text_ = SockText(reinterpret_cast<const sockaddr*>(&d->local_));
  DeviceImpl* raw = d.get();
  auto loop = Loop::Start(options.io_nice, [raw] { raw->Tick(); });
  if (!loop.ok()) {
    ::close(fd);
    return loop.status();
  }
  d->loop_ = *std::move(loop);
  absl::MutexLock lock(&d->mu_);
  auto registration = d->loop_->Add(fd, EPOLLIN, d.get());
  if (!registration.ok()) {
    ::close(fd);
    return registration.status();
  }
  d->listen_fd_ = fd;
  d->listen_registration_ = *registration;
  return d;
}

DeviceImpl::~DeviceImpl() {
  StopListening();
  loop_.reset();  // no handler runs after this; pairs are gone (their contexts hold us)
  absl::MutexLock lock(&mu_);
  ended_.clear();
}

std::string DeviceImpl::str() const {
  return absl::StrCat("microd ", sealed() ? "sealed" : "open", " device on ", local_text_,
                      " (lane ", options_.lane, ")");
}

const std::string& DeviceImpl::getPCIBusID() const {
  static const std::string kNone;
  return kNone;
}

std::shared_ptr<::gloo::transport::Context> DeviceImpl::createContext(int rank, int size) {
  return std::make_shared<ContextImpl>(shared_from_this(), rank, size);
}

void DeviceImpl::StopListening() {
  int fd = -1;
  uint64_t registration = 0;
  std::vector<Handshake*> pending;
  {
    absl::MutexLock lock(&mu_);
    std::swap(fd, listen_fd_);
    std::swap(registration, listen_registration_);
    for (auto& [h, owned] : handshakes_) pending.push_back(h);
  }
  if (registration != 0) loop_->Remove(registration, fd);
  if (fd >= 0) ::close(fd);
  // Every pair is connected: what is still in its handshake is no peer.
  for (Handshake* h : pending) Drop(h, /*close_fd=*/true);
}

absl::StatusOr<PairAddress> DeviceImpl::NewAddress() {
  PairAddress a;
  if (local_.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&local_);
    a.ip[10] = 0xff;
    a.ip[11] = 0xff;
    std::memcpy(a.ip.data() + 12, &in->sin_addr, 4);
    a.port = ntohs(in->sin_port);
  } else {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&local_);
    std::memcpy(a.ip.data(), &in6->sin6_addr, 16);
    a.port = ntohs(in6->sin6_port);
  }
  auto random = crypto::RandomBytes(8 + kTicketBytes);
  if (!random.ok()) return random.status();
  a.pair_id = Le64(random->substr(0, 8));
  std::memcpy(a.ticket.data(), random->data() + 8, kTicketBytes);
  return a;
}

void DeviceImpl::Register(PairImpl* pair) {
  absl::MutexLock lock(&mu_);
  pairs_[pair->id()] = pair;
}

void DeviceImpl::Unregister(PairImpl* pair) {
  absl::MutexLock lock(&mu_);
  auto it = pairs_.find(pair->id());
  if (it != pairs_.end() && it->second == pair) pairs_.erase(it);
}

void DeviceImpl::Refused(const std::string& from, const std::string& why) {
  ++refused_connections_;
  absl::MutexLock lock(&log_mu_);
  const absl::Time now = absl::Now();
  if (now - last_log_ < absl::Seconds(1)) {
    ++unlogged_;
    return;
  }
  std::string more;
  if (unlogged_ > 0) more = absl::StrCat(" (and ", unlogged_, " more not shown)");
  MICROD_LOG(Warning, "data plane (lane %d): refused a connection from %s: %s%s", options_.lane,
             from.c_str(), why.c_str(), more.c_str());
  last_log_ = now;
  unlogged_ = 0;
}

void DeviceImpl::OnEvents(uint32_t) {
  for (;;) {
    sockaddr_storage from{};
    socklen_t from_len = sizeof from;
    int listen_fd;
    {
      absl::MutexLock lock(&mu_);
      listen_fd = listen_fd_;
    }
    if (listen_fd < 0) return;
    const int fd = accept4(listen_fd, reinterpret_cast<sockaddr*>(&from), &from_len,
                           SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) return;  // EAGAIN, or an error the next event shows again
    const int one = 1;
    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    auto h = std::make_unique<Handshake>(this, fd, SockText(reinterpret_cast<sockaddr*>(&from)),
                                         absl::Now() + options_.handshake_timeout);
    Handshake* oldest = nullptr;
    {
      absl::MutexLock lock(&mu_);
      if (static_cast<int>(handshakes_.size()) >= options_.max_handshakes) {
        for (auto& [p, owned] : handshakes_) {
          if (oldest == nullptr || p->deadline < oldest->deadline) oldest = p;
        }
      }
    }
    if (oldest != nullptr) {
      Refused(oldest->peer, "too many connections in their handshake; the oldest is dropped");
      Drop(oldest, /*close_fd=*/true);
    }
    auto registration = loop_->Add(fd, EPOLLIN, h.get());
    if (!registration.ok()) {
      ::close(fd);
      continue;
    }
    h->registration = *registration;
    absl::MutexLock lock(&mu_);
    Handshake* key = h.get();
    handshakes_[key] = std::move(h);
  }
}

void DeviceImpl::OnHandshake(Handshake* h, uint32_t events) {
  const size_t need = h->finishing ? kFinishBytes : kHelloBytes;
  char buf[kHelloBytes];
  const ssize_t n = ::read(h->fd, buf, need - h->in.size());
  if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
    Refused(h->peer, h->finishing ? "the dialer left after this node's proof (it holds other "
                                    "keys: another epoch's or job's?)"
                                  : "the connection closed before its hello");
    Drop(h, /*close_fd=*/true);
    return;
  }
  if (n < 0) return;
  h->in.append(buf, static_cast<size_t>(n));
  if (h->in.size() < need) return;
  absl::Status s = h->finishing ? Finish(h) : Answer(h);
  if (!s.ok()) {
    Refused(h->peer, std::string(s.message()));
    Drop(h, /*close_fd=*/true);
  }
}

absl::Status DeviceImpl::Answer(Handshake* h) {
  auto hello = Hello::Decode(h->in);
  if (!hello.ok()) return hello.status();
  std::string auth;
  {
    absl::MutexLock lock(&mu_);
    auto it = pairs_.find(hello->pair_id);
    if (it == pairs_.end()) return absl::NotFoundError("a hello for no pair of this device");
    const PairImpl* pair = it->second;
    if (static_cast<int>(hello->listener_rank) != pair->self() ||
        static_cast<int>(hello->dialer_rank) != pair->peer() ||
        static_cast<int>(hello->lane) != options_.lane || hello->sealed != sealed()) {
      return absl::InvalidArgumentError(
          absl::StrCat("a hello from rank ", hello->dialer_rank, " for rank ", hello->listener_rank,
                       " (lane ", hello->lane, hello->sealed ? ", sealed" : ", open",
                       ") to the pair of rank ", pair->self(), " with rank ", pair->peer()));
    }
    auto key = AuthKey(pair->link_secret(), pair->mine(), *hello);
    if (!key.ok()) return key.status();
    auth = *std::move(key);
  }
  auto nonce = crypto::RandomBytes(kNonceBytes);
  if (!nonce.ok()) return nonce.status();
  h->transcript = absl::StrCat(h->in, *nonce);
  auto mac = HandshakeMac(auth, h->transcript, /*listener=*/true);
  if (!mac.ok()) return mac.status();
  const std::string reply = absl::StrCat(*nonce, *mac);
  // A fresh socket takes 64 bytes at once.
  if (::send(h->fd, reply.data(), reply.size(), MSG_NOSIGNAL) !=
      static_cast<ssize_t>(reply.size())) {
    return absl::UnavailableError("the reply could not be sent");
  }
  h->auth_key = std::move(auth);
  h->pair_id = hello->pair_id;
  h->finishing = true;
  h->in.clear();
  return absl::OkStatus();
}

absl::Status DeviceImpl::Finish(Handshake* h) {
  auto expected = HandshakeMac(h->auth_key, h->transcript, /*listener=*/false);
  if (!expected.ok()) return expected.status();
  if (!crypto::SameBytes(h->in, *expected)) {
    return absl::PermissionDeniedError(
        "its handshake did not prove the link's secret (a stranger, or another epoch's node)");
  }
  auto keys = DeriveTrafficKeys(h->auth_key, h->transcript);
  if (!keys.ok()) return keys.status();
  // The socket goes to the pair: this handshake no longer watches it.
  loop_->Remove(h->registration, h->fd);
  h->registration = 0;
  absl::MutexLock lock(&mu_);
  auto it = pairs_.find(h->pair_id);
  if (it == pairs_.end() || !it->second->Attach(h->fd, *keys, /*listener=*/true)) {
    return absl::AlreadyExistsError("a second connection for a connected pair");
  }
  // The socket is the pair's now: the handshake ends in the same breath,
  // so that nothing (StopListening) closes it as a handshake's.
  auto owned = handshakes_.find(h);
  if (owned != handshakes_.end()) {
    ended_.push_back(std::move(owned->second));
    handshakes_.erase(owned);
  }
  return absl::OkStatus();
}

void DeviceImpl::Drop(Handshake* h, bool close_fd) {
  std::unique_ptr<Handshake> owned;
  {
    absl::MutexLock lock(&mu_);
    auto it = handshakes_.find(h);
    if (it == handshakes_.end()) return;
    owned = std::move(it->second);
    handshakes_.erase(it);
  }
  if (h->registration != 0) loop_->Remove(h->registration, h->fd);
  if (close_fd) ::close(h->fd);
  // Not destroyed here: this may run inside its own OnEvents.
  absl::MutexLock lock(&mu_);
  ended_.push_back(std::move(owned));
}

void DeviceImpl::Tick() {
  const absl::Time now = absl::Now();
  std::vector<Handshake*> late;
  std::vector<std::unique_ptr<Handshake>> ended;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [h, owned] : handshakes_) {
      if (h->deadline <= now) late.push_back(h);
    }
    ended.swap(ended_);
  }
  for (Handshake* h : late) {
    Refused(h->peer, "no handshake in time");
    Drop(h, /*close_fd=*/true);
  }
}

}  // namespace microd::transport::record
