// SPDX-License-Identifier: Apache-2.0
#include "daemon/local/local_server.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "daemon/common/log.h"
#include "daemon/common/status_map.h"
#include "daemon/common/unix_socket.h"
#include "daemon/local/cuda_ipc.h"
#include "kernels/element_type.h"
#include "microd/wire.h"

namespace microd::local {

// The wire's dtypes are kernels' element types, numbered alike: a
// buffer's dtype is used as one without conversion.
static_assert(static_cast<int>(kernels::ElementType::kFloat32) == MICROD_WIRE_DTYPE_FLOAT32);
static_assert(static_cast<int>(kernels::ElementType::kBFloat16) == MICROD_WIRE_DTYPE_BFLOAT16);
static_assert(static_cast<int>(kernels::ElementType::kFloat16) == MICROD_WIRE_DTYPE_FLOAT16);

namespace {

// Messages an outbox may hold beyond one per registered buffer (the
// completions a client can have in flight): answers to refused
// submissions, register answers.
constexpr size_t kOutboxSlack = 1024;

size_t ExpectedSize(uint16_t type) {
  switch (type) {
    case MICROD_MSG_HELLO:
      return sizeof(microd_wire_hello);
    case MICROD_MSG_REGISTER:
      return sizeof(microd_wire_register);
    case MICROD_MSG_REGISTER_CUDA:
      return sizeof(microd_wire_register_cuda);
    case MICROD_MSG_SUBMIT:
      return sizeof(microd_wire_submit);
    case MICROD_MSG_GOODBYE:
      return sizeof(microd_wire_goodbye);
    case MICROD_MSG_STATE:
      return sizeof(microd_wire_state);
    case MICROD_MSG_WAITING:
      return sizeof(microd_wire_waiting);
    default:
      return 0;  // not a client-to-daemon message
  }
}

// The peer's supplementary groups (empty where the kernel cannot say).
std::vector<gid_t> PeerGroups(int fd) {
  std::vector<gid_t> groups(64);
  for (int tries = 0; tries < 4; ++tries) {
    socklen_t len = static_cast<socklen_t>(groups.size() * sizeof(gid_t));
    if (getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &len) == 0) {
      groups.resize(len / sizeof(gid_t));
      return groups;
    }
    if (errno != ERANGE) break;
    groups.resize(len / sizeof(gid_t) + 1);
  }
  return {};
}

// Whether a process of `uid`, `gid` and `groups` may make files in a
// directory of `st`, by its mode bits (an ACL that grants more is not
// looked at: such a directory is refused).
bool MayWriteDirectory(const struct stat& st, uid_t uid, gid_t gid,
                       const std::vector<gid_t>& groups) {
  if (uid == 0) return true;
  const mode_t m = st.st_mode;
  if (st.st_uid == uid) return (m & S_IWUSR) != 0 && (m & S_IXUSR) != 0;
  if (st.st_gid == gid || std::find(groups.begin(), groups.end(), st.st_gid) != groups.end()) {
    return (m & S_IWGRP) != 0 && (m & S_IXGRP) != 0;
  }
  return (m & S_IWOTH) != 0 && (m & S_IXOTH) != 0;
}

// The descriptor of a state request is a directory; a save goes only where
// the asking process could write itself (a process of the daemon's own uid
// could anyway).
absl::Status CheckStateDirectory(StateDirectory& dir, const std::vector<gid_t>& groups, bool save) {
  struct stat st;
  if (fstat(dir.fd.get(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat("the state directory ", dir.path, " is not a directory"));
  }
  dir.dev = st.st_dev;
  dir.ino = st.st_ino;
  if (save && dir.uid != geteuid() && !MayWriteDirectory(st, dir.uid, dir.gid, groups)) {
    return WithClientStatus(absl::PermissionDeniedError(absl::StrCat(
                                "process of uid ", dir.uid, " may not write the state directory ",
                                dir.path, " (owner ", st.st_uid, ", group ", st.st_gid, ", mode ",
                                absl::StrFormat("%04o", st.st_mode & 07777),
                                "): the daemon writes only where the "
                                "process asking could")),
                            ClientStatus::kPermission);
  }
  return absl::OkStatus();
}

}  // namespace

void CopyMessage(char* dst, const std::string& src) {
  const size_t n = std::min(src.size(), size_t{MICROD_WIRE_MESSAGE_BYTES - 1});
  std::memcpy(dst, src.data(), n);
  dst[n] = '\0';
}

ProcessBuffer::~ProcessBuffer() {
  if (half_ != nullptr) {
    if (mapped_bytes_ > 0) munmap(half_, mapped_bytes_);
    std::free(data_);
    return;
  }
  if (mapped_bytes_ > 0) munmap(data_, mapped_bytes_);
}

LocalServer::LocalServer(LocalServerOptions options, LocalHandler* handler)
    : options_(std::move(options)), handler_(handler) {}

absl::StatusOr<std::unique_ptr<LocalServer>> LocalServer::Start(const LocalServerOptions& options,
                                                                LocalHandler* handler) {
  if (handler == nullptr) return absl::InvalidArgumentError("local server: no handler");
  std::string warning;
  if (absl::Status s = PrepareSocketPath(options.socket_path, SOCK_SEQPACKET, &warning); !s.ok()) {
    return s;
  }
  if (!warning.empty()) MICROD_LOG(Warning, "%s", warning.c_str());
  std::unique_ptr<LocalServer> server(new LocalServer(options, handler));
  server->listen_fd_ = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (server->listen_fd_ < 0) {
    return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  }
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strcpy(addr.sun_path, options.socket_path.c_str());
  const mode_t old = umask(SocketUmask(options.allow_gid));
  const int bound = bind(server->listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  umask(old);
  if (bound != 0) {
    return absl::UnavailableError(
        absl::StrCat("bind ", options.socket_path, ": ", std::strerror(errno)));
  }
  if (absl::Status s = RestrictSocket(options.socket_path, options.allow_gid); !s.ok()) return s;
  if (listen(server->listen_fd_, 128) != 0) {
    return absl::UnavailableError(absl::StrCat("listen: ", std::strerror(errno)));
  }
  server->wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  server->thread_ = std::thread([s = server.get()] { s->Loop(); });
  return server;
}

LocalServer::~LocalServer() { Stop(); }

void LocalServer::Stop() {
  if (stopped_) return;
  stopped_ = true;
  stopping_ = true;
  Wake();
  if (thread_.joinable()) thread_.join();
  std::vector<uint64_t> ids;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [id, c] : clients_) ids.push_back(id);
  }
  for (uint64_t id : ids) Drop(id, false, "the daemon is shutting down");
  if (listen_fd_ >= 0) {
    close(listen_fd_);
    unlink(options_.socket_path.c_str());
  }
  if (wake_fd_ >= 0) close(wake_fd_);
  listen_fd_ = wake_fd_ = -1;
}

void LocalServer::Wake() {
  if (wake_fd_ < 0) return;
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof one);
}

namespace {

enum class SendResult { kSent, kFull, kBroken };

// One send that never blocks; `why` says what broke the connection.
SendResult SendNow(int fd, const void* msg, size_t len, std::string* why) {
  ssize_t n;
  do {
    n = send(fd, msg, len, MSG_NOSIGNAL | MSG_DONTWAIT);
  } while (n < 0 && errno == EINTR);
  if (n == static_cast<ssize_t>(len)) return SendResult::kSent;
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return SendResult::kFull;
  *why = n >= 0 ? "short send" : std::strerror(errno);
  return SendResult::kBroken;
}

}  // namespace

bool LocalServer::Send(Client& c, const void* msg, size_t len) {
  if (!c.broken.empty()) return false;
  if (c.outbox.empty()) {
    // Never block on a client: what its socket cannot take now waits.
    const SendResult r = SendNow(c.fd, msg, len, &c.broken);
    if (r == SendResult::kSent) return true;
    Wake();  // a broken client is reaped; a full one waited on for POLLOUT
    if (r == SendResult::kBroken) return false;
    c.outbox_since = absl::Now();
  }
  // A client has at most one submission in flight per buffer; beyond that
  // and the slack, it is not reading at all.
  if (c.outbox.size() >= c.buffers.size() + kOutboxSlack) {
    c.broken = absl::StrCat("it does not read its completions (", c.outbox.size(),
                            " messages waiting, it has ", c.buffers.size(), " buffers)");
    Wake();
    return false;
  }
  c.outbox.emplace_back(static_cast<const char*>(msg), len);
  return true;
}

void LocalServer::Flush(Client& c) {
  while (!c.outbox.empty() && c.broken.empty()) {
    const std::string& front = c.outbox.front();
    if (SendNow(c.fd, front.data(), front.size(), &c.broken) != SendResult::kSent) return;
    c.outbox.pop_front();
    c.outbox_since = absl::Now();  // it reads: the wait starts again
  }
}

void LocalServer::Reap() {
  std::vector<std::pair<uint64_t, std::string>> drop;
  std::vector<uint64_t> silent;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = absl::Now();
    for (const auto& [id, c] : clients_) {
      if (!c.broken.empty()) {
        drop.push_back({id, absl::StrCat("sending to it failed: ", c.broken)});
      } else if (!c.outbox.empty() && now - c.outbox_since > options_.stuck_after) {
        drop.push_back({id, absl::StrCat("it read no message for ",
                                         absl::FormatDuration(absl::Trunc(now - c.outbox_since,
                                                                          absl::Milliseconds(100))),
                                         " (", c.outbox.size(), " waiting; limit ",
                                         absl::FormatDuration(options_.stuck_after), ")")});
      } else if (!c.greeted && now - c.connected_at > options_.hello_timeout) {
        silent.push_back(id);
      }
    }
  }
  for (const auto& [id, why] : drop) Drop(id, false, why);
  for (uint64_t id : silent) {
    Refuse(id, static_cast<int>(ClientStatus::kProtocol),
           absl::StrCat("no hello within ", absl::FormatDuration(options_.hello_timeout),
                        " of connecting"));
  }
}

void LocalServer::Complete(uint64_t client, uint64_t ticket, uint32_t buffer_id,
                           const absl::Status& status) {
  microd_wire_completion m{};
  microd_wire_header_init(&m.h, MICROD_MSG_COMPLETION, sizeof m);
  m.ticket = ticket;
  m.buffer_id = buffer_id;
  m.status = static_cast<int32_t>(ToClientStatus(status));
  CopyMessage(m.message, std::string(status.message()));
  absl::MutexLock lock(&mu_);
  auto it = clients_.find(client);
  if (it == clients_.end()) return;
  if (m.status == static_cast<int32_t>(ClientStatus::kMembership) &&
      (it->second.caps & MICROD_WIRE_CAP_MEMBERSHIP) == 0) {
    // A library that predates elastic jobs cannot follow: its job ends here.
    m.status = static_cast<int32_t>(ClientStatus::kJobFailed);
    CopyMessage(m.message, absl::StrCat("this client library cannot follow a change of the "
                                        "job's membership: ",
                                        status.message()));
  }
  Send(it->second, &m, sizeof m);  // a failure: the server thread drops it
}

namespace {

microd_wire_membership MembershipMessage(uint64_t epoch, const ProcessInfo& info,
                                         const std::string& what) {
  microd_wire_membership m{};
  microd_wire_header_init(&m.h, MICROD_MSG_MEMBERSHIP, sizeof m);
  m.epoch = epoch;
  m.rank = info.rank;
  m.world_size = info.world_size;
  m.local_rank = info.local_rank;
  m.local_size = info.local_size;
  m.node_rank = info.node_rank;
  m.node_count = info.node_count;
  CopyMessage(m.message, what);
  return m;
}

}  // namespace

void LocalServer::NotifyMembership(uint64_t client, uint64_t epoch, const ProcessInfo& info,
                                   const std::string& what) {
  microd_wire_membership m = MembershipMessage(epoch, info, what);
  absl::MutexLock lock(&mu_);
  auto it = clients_.find(client);
  if (it == clients_.end() || (it->second.caps & MICROD_WIRE_CAP_MEMBERSHIP) == 0) return;
  Send(it->second, &m, sizeof m);
}

std::vector<ClientSnapshot> LocalServer::Clients() const {
  absl::MutexLock lock(&mu_);
  std::vector<ClientSnapshot> out;
  for (const auto& [id, c] : clients_) {
    out.push_back({id, c.pid, c.uid, c.local_rank, static_cast<int>(c.buffers.size()), c.bytes,
                   c.outbox.size()});
  }
  return out;
}

void LocalServer::Loop() {
  std::vector<pollfd> fds;
  std::vector<uint64_t> ids;
  for (;;) {
    fds.clear();
    ids.clear();
    fds.push_back({wake_fd_, POLLIN, 0});
    fds.push_back({listen_fd_, POLLIN, 0});
    {
      absl::MutexLock lock(&mu_);
      for (const auto& [id, c] : clients_) {
        const bool waiting = !c.outbox.empty() && c.broken.empty();
        fds.push_back({c.fd, static_cast<short>(POLLIN | (waiting ? POLLOUT : 0)), 0});
        ids.push_back(id);
      }
    }
    if (poll(fds.data(), fds.size(), 1000) < 0 && errno != EINTR) return;
    if (fds[0].revents != 0) {
      uint64_t ignored;
      (void)!read(wake_fd_, &ignored, sizeof ignored);
      if (stopping_) return;
    }
    if (fds[1].revents & POLLIN) Accept();
    for (size_t i = 2; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      const uint64_t id = ids[i - 2];
      Client* c;
      {
        absl::MutexLock lock(&mu_);
        auto it = clients_.find(id);
        if (it == clients_.end()) continue;
        c = &it->second;
        if (fds[i].revents & POLLOUT) Flush(*c);
      }
      // Only this thread erases clients, so `c` stays valid here.
      if ((fds[i].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
      HandleMessage(id, *c);
    }
    Reap();
  }
}

void LocalServer::Accept() {
  for (;;) {
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) return;
    ucred cred{};
    socklen_t len = sizeof cred;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
      close(fd);
      continue;
    }
    const uint64_t id = next_id_++;
    size_t count;
    {
      absl::MutexLock lock(&mu_);
      Client& c = clients_[id];
      c.fd = fd;
      c.pid = cred.pid;
      c.uid = cred.uid;
      c.gid = cred.gid;
      c.groups = PeerGroups(fd);
      c.connected_at = absl::Now();
      count = clients_.size();
    }
    const bool same_user = cred.uid == geteuid();
    const bool allowed_group =
        options_.allow_gid >= 0 && cred.gid == static_cast<gid_t>(options_.allow_gid);
    if (!same_user && !allowed_group) {
      Refuse(id, static_cast<int>(ClientStatus::kPermission),
             absl::StrCat("process ", cred.pid, " of uid ", cred.uid,
                          " may not use this daemon (uid ", geteuid(), ")"));
    } else if (static_cast<int>(count) > 2 * options_.max_clients) {
      // Connections that have not said hello yet are bounded too (each for
      // --hello_timeout_ms at most), but apart from the processes: they
      // never take a process's place.
      Refuse(id, static_cast<int>(ClientStatus::kResource),
             absl::StrCat("too many connections (", count - 1, " open; limit ",
                          2 * options_.max_clients, ")"));
    }
  }
}

void LocalServer::Refuse(uint64_t id, int status, const std::string& why) {
  microd_wire_error e{};
  microd_wire_header_init(&e.h, MICROD_MSG_ERROR, sizeof e);
  e.status = status;
  CopyMessage(e.message, why);
  {
    absl::MutexLock lock(&mu_);
    auto it = clients_.find(id);
    // Best effort, past anything queued: the connection ends here.
    if (it != clients_.end()) (void)send(it->second.fd, &e, sizeof e, MSG_NOSIGNAL | MSG_DONTWAIT);
  }
  Drop(id, false, why);
}

void LocalServer::Drop(uint64_t id, bool clean, const std::string& why) {
  bool greeted = false;
  {
    absl::MutexLock lock(&mu_);
    auto it = clients_.find(id);
    if (it == clients_.end()) return;
    greeted = it->second.greeted;
    // Close without unread input: a Unix socket closed with data still queued
    // resets the peer, which would then lose the ERROR just sent to it.
    const int fd = it->second.fd;
    shutdown(fd, SHUT_RDWR);
    char sink[MICROD_WIRE_MAX_BYTES + 1];
    while (recv(fd, sink, sizeof sink, MSG_DONTWAIT) > 0) {
    }
    close(fd);
    clients_.erase(it);
  }
  // Its CUDA allocations close once the engine let go of its buffers too.
  if (cuda_ != nullptr) cuda_->ForgetClient(id);
  if (greeted) handler_->OnDisconnect(id, clean, why);
}

bool LocalServer::HandleMessage(uint64_t id, Client& c) {
  union {
    microd_wire_header h;
    microd_wire_hello hello;
    microd_wire_register reg;
    microd_wire_register_cuda reg_cuda;
    microd_wire_submit submit;
    microd_wire_state state;
    microd_wire_waiting waiting;
    char bytes[MICROD_WIRE_MAX_BYTES + 1];
  } m;
  alignas(cmsghdr) char control[CMSG_SPACE(4 * sizeof(int))];
  iovec iov{&m, sizeof m};
  msghdr mh{};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  mh.msg_control = control;
  mh.msg_controllen = sizeof control;
  ssize_t n;
  do {
    n = recvmsg(c.fd, &mh, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
  } while (n < 0 && errno == EINTR);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
  // Collect any descriptors first, so none leaks whatever happens next.
  std::vector<int> fds;
  for (cmsghdr* cm = CMSG_FIRSTHDR(&mh); cm != nullptr; cm = CMSG_NXTHDR(&mh, cm)) {
    if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) {
      const size_t k = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < k; ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(cm) + i * sizeof(int), sizeof fd);
        fds.push_back(fd);
      }
    }
  }
  struct FdCloser {
    std::vector<int>& fds;
    ~FdCloser() {
      for (int fd : fds) close(fd);
    }
  } closer{fds};

  if (n <= 0) {
    Drop(id, false, n == 0 ? "connection closed without goodbye" : std::strerror(errno));
    return false;
  }
  const int kProtocol = static_cast<int>(ClientStatus::kProtocol);
  if ((mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0) {
    Refuse(id, kProtocol, "message too large");
    return false;
  }
  if (static_cast<size_t>(n) < sizeof(microd_wire_header) || m.h.magic != MICROD_WIRE_MAGIC) {
    Refuse(id, kProtocol, "not a microd message (bad magic or size)");
    return false;
  }
  if (m.h.version != MICROD_WIRE_VERSION) {
    Refuse(id, kProtocol,
           absl::StrCat("protocol version ", m.h.version, " not supported (daemon speaks ",
                        MICROD_WIRE_VERSION, ")"));
    return false;
  }
  const size_t expected = ExpectedSize(m.h.type);
  if (expected == 0) {
    Refuse(id, kProtocol, absl::StrCat("unknown message type ", m.h.type));
    return false;
  }
  if (m.h.length != static_cast<uint32_t>(n) || static_cast<size_t>(n) != expected) {
    Refuse(id, kProtocol,
           absl::StrCat("message type ", m.h.type, " has ", n, " bytes (header says ", m.h.length,
                        ", expected ", expected, ")"));
    return false;
  }
  if (!fds.empty() && m.h.type != MICROD_MSG_REGISTER && m.h.type != MICROD_MSG_STATE) {
    Refuse(id, kProtocol, "unexpected file descriptor");
    return false;
  }
  if (!c.greeted && m.h.type != MICROD_MSG_HELLO) {
    Refuse(id, kProtocol, "the first message must be hello");
    return false;
  }

  switch (m.h.type) {
    case MICROD_MSG_HELLO:
      return HandleHello(id, c, m.hello);
    case MICROD_MSG_REGISTER:
      return HandleRegister(id, c, m.reg, fds);
    case MICROD_MSG_REGISTER_CUDA:
      return HandleRegisterCuda(id, c, m.reg_cuda);
    case MICROD_MSG_SUBMIT:
      return HandleSubmit(id, c, m.submit);
    case MICROD_MSG_STATE:
      return HandleState(id, c, m.state, fds);
    case MICROD_MSG_WAITING:
      return HandleWaiting(id, c, m.waiting);
    case MICROD_MSG_GOODBYE:
      Drop(id, true, "goodbye");
      return false;
  }
  return true;
}

bool LocalServer::HandleHello(uint64_t id, Client& c, const ::microd_wire_hello& hello) {
  const int kProtocol = static_cast<int>(ClientStatus::kProtocol);
  if (c.greeted) {
    Refuse(id, kProtocol, "hello sent twice");
    return false;
  }
  if (hello.local_rank < -1) {
    Refuse(id, static_cast<int>(ClientStatus::kInvalidArgument),
           absl::StrCat("local rank ", hello.local_rank, " is negative"));
    return false;
  }
  int greeted = 0;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [other, client] : clients_) greeted += client.greeted ? 1 : 0;
  }
  if (greeted >= options_.max_clients) {
    Refuse(id, static_cast<int>(ClientStatus::kResource),
           absl::StrCat("too many processes (limit ", options_.max_clients, ")"));
    return false;
  }
  auto info = handler_->OnHello(id, hello.local_rank, c.pid);
  if (!info.ok()) {
    Refuse(id, static_cast<int>(ToClientStatus(info.status())),
           std::string(info.status().message()));
    return false;
  }
  {
    absl::MutexLock lock(&mu_);
    c.greeted = true;
    c.caps = hello.h.reserved;
    c.local_rank = info->local_rank;
  }
  microd_wire_hello_ack ack{};
  microd_wire_header_init(&ack.h, MICROD_MSG_HELLO_ACK, sizeof ack);
  // Every build answers REGISTER_CUDA (a CPU build with UNSUPPORTED).
  ack.h.reserved = MICROD_WIRE_CAP_REGISTER_CUDA | MICROD_WIRE_CAP_WAITING;
  ack.status = 0;
  ack.local_rank = info->local_rank;
  ack.local_size = info->local_size;
  ack.node_rank = info->node_rank;
  ack.node_count = info->node_count;
  ack.rank = info->rank;
  ack.world_size = info->world_size;
  ack.momentum_correction = info->momentum_correction;
  absl::MutexLock lock(&mu_);
  Send(c, &ack, sizeof ack);  // a failure: Reap() drops it
  if (info->epoch > 0 && (c.caps & MICROD_WIRE_CAP_FENCE) != 0) {
    // Its epoch (the job's membership changed before it connected).
    microd_wire_membership m = MembershipMessage(
        info->epoch, *info, absl::StrCat("the job is at membership epoch ", info->epoch));
    Send(c, &m, sizeof m);
  }
  return true;
}

bool LocalServer::HandleSubmit(uint64_t id, Client& c, const ::microd_wire_submit& submit) {
  const int kProtocol = static_cast<int>(ClientStatus::kProtocol);
  // Ticket 0 means "none" to the engine; tickets start at 1.
  const bool fenced = (c.caps & MICROD_WIRE_CAP_FENCE) != 0;
  if (submit.ticket == 0 || (!fenced && submit.reserved != 0)) {
    Refuse(id, kProtocol,
           absl::StrCat("submit of buffer id ", submit.buffer_id, " with ticket ", submit.ticket,
                        " and reserved field ", submit.reserved,
                        " (tickets start at 1, the reserved field is 0)"));
    return false;
  }
  if (c.buffers.count(submit.buffer_id) == 0) {
    Refuse(id, static_cast<int>(ClientStatus::kInvalidArgument),
           absl::StrCat("submit of unknown buffer id ", submit.buffer_id));
    return false;
  }
  absl::Status s =
      handler_->OnSubmit(id, submit.buffer_id, submit.ticket,
                         fenced ? std::optional<uint32_t>(submit.reserved) : std::nullopt);
  if (!s.ok()) Complete(id, submit.ticket, submit.buffer_id, s);
  return true;
}

bool LocalServer::HandleWaiting(uint64_t id, Client& c, const ::microd_wire_waiting& w) {
  if (w.reserved != 0 || c.buffers.count(w.buffer_id) == 0) {
    Refuse(id, static_cast<int>(ClientStatus::kInvalidArgument),
           absl::StrCat("waiting: unknown buffer id ", w.buffer_id, " or reserved field ",
                        w.reserved, " (0)"));
    return false;
  }
  microd_wire_waiting_answer a{};
  microd_wire_header_init(&a.h, MICROD_MSG_WAITING_ANSWER, sizeof a);
  a.buffer_id = w.buffer_id;
  const std::string text = handler_->OnWaiting(id, w.buffer_id);
  const size_t n = std::min(text.size(), sizeof a.text - 1);
  std::memcpy(a.text, text.data(), n);
  a.text[n] = '\0';
  absl::MutexLock lock(&mu_);
  Send(c, &a, sizeof a);  // a failure: Reap() drops it
  return true;
}

bool LocalServer::HandleState(uint64_t id, const Client& c, const ::microd_wire_state& state,
                              std::vector<int>& fds) {
  const int kProtocol = static_cast<int>(ClientStatus::kProtocol);
  const size_t len = strnlen(state.dir, MICROD_WIRE_PATH_BYTES);
  if (state.ticket == 0 || state.reserved != 0 || len == MICROD_WIRE_PATH_BYTES ||
      (state.op != MICROD_STATE_SAVE && state.op != MICROD_STATE_LOAD)) {
    Refuse(
        id, kProtocol,
        absl::StrCat("state request with op ", state.op, ", ticket ", state.ticket,
                     " and reserved field ", state.reserved,
                     " (ops: 1 save, 2 load; tickets start at 1; the directory NUL-terminated)"));
    return false;
  }
  if (fds.size() != 1) {
    Refuse(id, kProtocol,
           "a state request must carry the directory's descriptor (one, opened by the process)");
    return false;
  }
  StateDirectory dir;
  dir.path.assign(state.dir, len);
  dir.fd.reset(fds[0]);
  fds.clear();  // owned by `dir` from here on
  dir.uid = c.uid;
  dir.gid = c.gid;
  const bool save = state.op == MICROD_STATE_SAVE;
  absl::Status s = CheckStateDirectory(dir, c.groups, save);
  if (s.ok()) {
    s = handler_->OnState(id, save, std::move(dir), state.ticket);
  }
  if (!s.ok()) Complete(id, state.ticket, MICROD_WIRE_NO_BUFFER, s);
  return true;
}

}  // namespace microd::local
