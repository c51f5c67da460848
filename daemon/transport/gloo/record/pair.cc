// SPDX-License-Identifier: Apache-2.0
#include "daemon/transport/gloo/record/pair.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/common/crypto.h"
#include "daemon/transport/gloo/record/device_impl.h"

namespace microd::transport::record {
namespace {

// Notices of the peer's receives not yet matched by a send, at most (a
// round posts a few per slot ahead; the large allreduce a segment's worth).
constexpr size_t kMaxNoticesIn = size_t{1} << 16;
// What one wake-up of the loop reads from one connection at most.
constexpr size_t kReadBudget = size_t{4} << 20;

int SetNonBlocking(int fd, bool on) {
  const int flags = fcntl(fd, F_GETFL, 0);
  if (flags < 0) return -1;
  return fcntl(fd, F_SETFL, on ? (flags | O_NONBLOCK) : (flags & ~O_NONBLOCK));
}

// Waits for `events` on `fd` until `deadline`; false on timeout.
bool WaitFor(int fd, short events, absl::Time deadline) {
  for (;;) {
    const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (ms <= 0) return false;
    pollfd p{fd, events, 0};
    const int n = poll(&p, 1, static_cast<int>(std::min<int64_t>(ms, 1000)));
    if (n > 0) return true;
    if (n < 0 && errno != EINTR) return false;
  }
}

// All of `n` bytes, on a non-blocking socket, by `deadline`.
bool WriteAll(int fd, const void* data, size_t n, absl::Time deadline) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w > 0) {
      p += w;
      n -= static_cast<size_t>(w);
    } else if (w < 0 && (errno == EAGAIN || errno == EINTR)) {
      if (!WaitFor(fd, POLLOUT, deadline)) return false;
    } else {
      return false;
    }
  }
  return true;
}

bool ReadAll(int fd, void* data, size_t n, absl::Time deadline) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t r = ::read(fd, p, n);
    if (r > 0) {
      p += r;
      n -= static_cast<size_t>(r);
    } else if (r < 0 && (errno == EAGAIN || errno == EINTR)) {
      if (!WaitFor(fd, POLLIN, deadline)) return false;
    } else {
      return false;
    }
  }
  return true;
}

// The socket address of a pair's address.
socklen_t SockAddr(const PairAddress& a, sockaddr_storage* out) {
  std::memset(out, 0, sizeof *out);
  static const unsigned char kMapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  if (std::memcmp(a.ip.data(), kMapped, 12) == 0) {
    auto* in = reinterpret_cast<sockaddr_in*>(out);
    in->sin_family = AF_INET;
    in->sin_port = htons(a.port);
    std::memcpy(&in->sin_addr, a.ip.data() + 12, 4);
    return sizeof(sockaddr_in);
  }
  auto* in6 = reinterpret_cast<sockaddr_in6*>(out);
  in6->sin6_family = AF_INET6;
  in6->sin6_port = htons(a.port);
  std::memcpy(&in6->sin6_addr, a.ip.data(), 16);
  return sizeof(sockaddr_in6);
}

}  // namespace

std::string SockText(const sockaddr* sa) {
  char host[INET6_ADDRSTRLEN] = "?";
  if (sa->sa_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(sa);
    inet_ntop(AF_INET, &in->sin_addr, host, sizeof host);
    return absl::StrCat(host, ":", ntohs(in->sin_port));
  }
  const auto* in6 = reinterpret_cast<const sockaddr_in6*>(sa);
  inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof host);
  return absl::StrCat("[", host, "]:", ntohs(in6->sin6_port));
}

PairImpl::PairImpl(DeviceImpl* device, int self, int peer, const PairAddress& mine,
                   std::string text, std::string link_secret)
    : device_(device),
      self_(self),
      peer_(peer),
      mine_(mine),
      address_(mine.Encode(), std::move(text)),
      link_secret_(std::move(link_secret)),
      sealed_(device->sealed()) {}

PairImpl::~PairImpl() {
  device_->Unregister(this);
  int fd = -1;
  uint64_t registration = 0;
  {
    absl::MutexLock lock(&mu_);
    Fail(absl::CancelledError(absl::StrCat(Link(), ": closed")));
    fd = fd_;
    registration = registration_;
    registration_ = 0;
  }
  if (registration != 0) device_->loop().Remove(registration, fd);
  {
    absl::MutexLock read(&read_mu_);
    FailIncoming();
  }
  if (fd >= 0) ::close(fd);
}

std::string PairImpl::Link() const {
  return absl::StrCat("the data-plane link with node ", peer_, " (lane ", device_->options().lane,
                      ")");
}

std::unique_ptr<::gloo::transport::Buffer> PairImpl::createSendBuffer(int, void*, size_t) {
  Throw(absl::UnimplementedError("bound buffers: use unbound ones"));
}
std::unique_ptr<::gloo::transport::Buffer> PairImpl::createRecvBuffer(int, void*, size_t) {
  Throw(absl::UnimplementedError("bound buffers: use unbound ones"));
}

void PairImpl::send(::gloo::transport::UnboundBuffer* buf, uint64_t slot, size_t offset,
                    size_t nbytes) {
  auto* b = dynamic_cast<Buffer*>(buf);
  if (b == nullptr) Throw(absl::InvalidArgumentError("a buffer of another device"));
  b->send(peer_, slot, offset, nbytes);
}

void PairImpl::recv(::gloo::transport::UnboundBuffer* buf, uint64_t slot, size_t offset,
                    size_t nbytes) {
  auto* b = dynamic_cast<Buffer*>(buf);
  if (b == nullptr) Throw(absl::InvalidArgumentError("a buffer of another device"));
  b->recv(peer_, slot, offset, nbytes);
}

void PairImpl::connect(const std::vector<char>& bytes) {
  auto peer = PairAddress::Decode(absl::string_view(bytes.data(), bytes.size()));
  if (!peer.ok()) {
    Throw(absl::InvalidArgumentError(absl::StrCat(Link(), ": the address node ", peer_,
                                                  " published: ", peer.status().message())));
  }
  const absl::Time deadline = absl::Now() + absl::FromChrono(timeout_);
  if (self_ > peer_) {
    Dial(*peer, deadline);
    return;
  }
  absl::MutexLock lock(&mu_);
  auto up = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return connected_ || !error_.ok(); };
  mu_.AwaitWithDeadline(absl::Condition(&up), deadline);
  ThrowIfFailed();
  if (!connected_) {
    Fail(absl::DeadlineExceededError(
        absl::StrCat(Link(), ": node ", peer_, " did not connect within ",
                     absl::FormatDuration(absl::FromChrono(timeout_)))));
    ThrowIfFailed();
  }
}

void PairImpl::Dial(const PairAddress& peer, absl::Time deadline) {
  sockaddr_storage sa;
  const socklen_t sa_len = SockAddr(peer, &sa);
  const std::string peer_text = SockText(reinterpret_cast<const sockaddr*>(&sa));
  std::string last = "no attempt";
  // A reply that did not verify says more than whatever came after it
  // (the peer may have given up and closed its port by the last attempt).
  std::string refused;
  for (int attempt = 0; absl::Now() < deadline; ++attempt) {
    if (attempt > 0) absl::SleepFor(absl::Milliseconds(std::min(10 * attempt, 200)));
    const int fd = socket(sa.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) Throw(absl::InternalError(absl::StrCat("socket: ", strerror(errno))));
    // What went wrong, for the error: running out of time in the last
    // attempt does not hide why the ones before failed.
    auto give_up = [&](std::string why) {
      if (absl::Now() < deadline || attempt == 0) last = std::move(why);
      ::close(fd);
    };
    if (::connect(fd, reinterpret_cast<const sockaddr*>(&sa), sa_len) != 0 &&
        errno != EINPROGRESS) {
      give_up(absl::StrCat("connect: ", strerror(errno)));
      continue;
    }
    int err = 0;
    socklen_t len = sizeof err;
    if (!WaitFor(fd, POLLOUT, deadline) || getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0 ||
        err != 0) {
      give_up(absl::StrCat("connect: ", err != 0 ? strerror(err) : "timed out"));
      continue;
    }
    const int one = 1;
    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    Hello hello;
    hello.pair_id = peer.pair_id;
    hello.dialer_rank = static_cast<uint32_t>(self_);
    hello.listener_rank = static_cast<uint32_t>(peer_);
    hello.lane = static_cast<uint32_t>(device_->options().lane);
    hello.sealed = sealed_;
    auto nonce = crypto::RandomBytes(kNonceBytes);
    if (!nonce.ok()) Throw(nonce.status());
    std::memcpy(hello.nonce.data(), nonce->data(), kNonceBytes);
    const std::string hello_bytes = hello.Encode();
    unsigned char reply[kReplyBytes];
    if (!WriteAll(fd, hello_bytes.data(), hello_bytes.size(), deadline) ||
        !ReadAll(fd, reply, sizeof reply, deadline)) {
      give_up("the handshake: no reply");
      continue;
    }
    const std::string transcript =
        absl::StrCat(hello_bytes, absl::string_view(reinterpret_cast<char*>(reply), kNonceBytes));
    auto auth = AuthKey(link_secret_, peer, hello);
    if (!auth.ok()) Throw(auth.status());
    auto theirs = HandshakeMac(*auth, transcript, /*listener=*/true);
    auto ours = HandshakeMac(*auth, transcript, /*listener=*/false);
    if (!theirs.ok() || !ours.ok()) Throw(absl::InternalError("the handshake's MAC failed"));
    if (!crypto::SameBytes(*theirs, absl::string_view(reinterpret_cast<char*>(reply) + kNonceBytes,
                                                      kReplyBytes - kNonceBytes))) {
      // Not node `peer_` with this epoch's secret: someone else answered.
      device_->Refused(absl::StrCat("node ", peer_, " at ", peer_text),
                       "its reply did not prove the link's secret (it holds other keys: another "
                       "epoch's or job's?)");
      refused = "the handshake: the reply did not verify";
      give_up(refused);
      continue;
    }
    if (!WriteAll(fd, ours->data(), ours->size(), deadline)) {
      give_up("the handshake: the finish could not be sent");
      continue;
    }
    auto keys = DeriveTrafficKeys(*auth, transcript);
    if (!keys.ok()) Throw(keys.status());
    if (!Attach(fd, *keys, /*listener=*/false)) {
      ::close(fd);
      absl::MutexLock lock(&mu_);
      ThrowIfFailed();
      Throw(absl::InternalError(absl::StrCat(Link(), ": connected twice")));
    }
    return;
  }
  const std::string why =
      refused.empty() || refused == last ? last : absl::StrCat(refused, "; at last: ", last);
  absl::MutexLock lock(&mu_);
  Fail(absl::DeadlineExceededError(absl::StrCat(Link(), ": could not connect to node ", peer_,
                                                " at ", peer_text, " in time (", why, ")")));
  ThrowIfFailed();
}

bool PairImpl::Attach(int fd, const TrafficKeys& keys, bool listener) {
  absl::MutexLock read(&read_mu_);
  absl::MutexLock lock(&mu_);
  if (connected_ || !error_.ok()) return false;
  if (sealed_) {
    auto send = RecordCipher::Create(listener ? keys.listener_to_dialer : keys.dialer_to_listener);
    auto recv = RecordCipher::Create(listener ? keys.dialer_to_listener : keys.listener_to_dialer);
    if (!send.ok() || !recv.ok()) return false;
    send_cipher_ = *std::move(send);
    recv_cipher_ = *std::move(recv);
  }
  if (SetNonBlocking(fd, true) != 0) return false;
  // Sealed, whole records are staged (sealed before they go, verified
  // before they are used); open, only their length and header are: the
  // payload goes from and to its buffer directly.
  out_.resize(kLengthBytes + (sealed_ ? kMaxRecordBytes : kHeaderBytes));
  in_.resize(sealed_ ? kMaxRecordBytes : kHeaderBytes + 4096);
  if (sealed_) plain_.resize(kMaxRecordBytes);
  auto registration = device_->loop().Add(fd, EPOLLIN, this);
  if (!registration.ok()) return false;
  fd_ = fd;
  registration_ = *registration;
  connected_ = true;
  return true;
}

void PairImpl::close() {
  absl::MutexLock lock(&mu_);
  Fail(absl::UnavailableError(absl::StrCat(Link(), ": closed by this node")));
  // The peer learns it now (a failure of the link itself leaves that to
  // this node's engine, which first tells the coordinator why).
  if (fd_ >= 0) (void)shutdown(fd_, SHUT_RDWR);
}

void PairImpl::ThrowIfFailed() {
  if (!error_.ok()) Throw(error_);
}

void PairImpl::Fail(absl::Status status) {
  if (!error_.ok()) return;
  error_ = std::move(status);
  failed_ = true;
  // Nothing more is read or written; the socket stays open until this
  // node's engine aborts the transport (close), so that the peers' calls
  // fail once the coordinator knows the cause from this node, not before.
  // Off the loop's thread, a shutdown of the reading side alone (nothing
  // reaches the peer) wakes it to fail the message it was receiving.
  if (registration_ != 0 && device_->loop().InLoop()) {
    device_->loop().Remove(registration_, fd_);
    registration_ = 0;
  } else if (fd_ >= 0) {
    (void)shutdown(fd_, SHUT_RD);
  }
  auto fail_all = [this](std::map<uint64_t, std::deque<Op>>& ops) {
    for (auto& [slot, q] : ops) {
      for (Op& op : q) op.buf->Failed(error_);
    }
    ops.clear();
  };
  fail_all(posted_);
  fail_all(waiting_);
  for (Outgoing& o : outgoing_) o.op.buf->Failed(error_);
  outgoing_.clear();
  notices_in_.clear();
  notices_out_.clear();
}

void PairImpl::Send(Op op, uint64_t slot) {
  absl::MutexLock lock(&mu_);
  ThrowIfFailed();
  if (!connected_) Throw(absl::FailedPreconditionError(absl::StrCat(Link(), ": not connected")));
  waiting_[slot].push_back(std::move(op));
  Match(slot);
  Flush();
  ThrowIfFailed();
}

void PairImpl::Recv(Op op, uint64_t slot) {
  absl::MutexLock lock(&mu_);
  ThrowIfFailed();
  if (!connected_) Throw(absl::FailedPreconditionError(absl::StrCat(Link(), ": not connected")));
  Header notice;
  notice.type = RecordType::kRecvReady;
  notice.slot = slot;
  notice.total = op.nbytes;
  posted_[slot].push_back(std::move(op));
  notices_out_.push_back(notice);
  Flush();
  ThrowIfFailed();
}

void PairImpl::Match(uint64_t slot) {
  auto w = waiting_.find(slot);
  auto n = notices_in_.find(slot);
  while (w != waiting_.end() && n != notices_in_.end() && !w->second.empty() &&
         !n->second.empty()) {
    Op op = std::move(w->second.front());
    w->second.pop_front();
    const uint64_t room = n->second.front();
    n->second.pop_front();
    --notices_in_count_;
    if (op.nbytes > room) {
      w->second.push_front(std::move(op));  // failed with the rest
      Fail(absl::DataLossError(absl::StrCat(Link(), ": node ", peer_, " posted ", room,
                                            " bytes for slot ", slot, " and this node sends ",
                                            op.nbytes, " (the ranks disagree on a size)")));
      return;
    }
    outgoing_.push_back(Outgoing{std::move(op), slot, 0});
  }
  if (w != waiting_.end() && w->second.empty()) waiting_.erase(w);
  if (n != notices_in_.end() && n->second.empty()) notices_in_.erase(n);
}

void PairImpl::WantWrite(bool want) {
  if (want == want_write_ || registration_ == 0) return;
  want_write_ = want;
  device_->loop().Modify(registration_, fd_, EPOLLIN | (want ? EPOLLOUT : 0u));
}

bool PairImpl::NextRecord() {
  out_pos_ = 0;
  out_payload_len_ = 0;
  out_ends_message_ = false;
  out_is_data_ = false;
  Header h;
  const unsigned char* payload = nullptr;
  std::shared_ptr<BufferState> buf;
  if (!notices_out_.empty()) {
    h = notices_out_.front();
    notices_out_.pop_front();
  } else if (!outgoing_.empty()) {
    Outgoing& o = outgoing_.front();
    h.type = RecordType::kData;
    h.slot = o.slot;
    h.total = o.op.nbytes;
    h.offset = o.sent;
    h.payload = static_cast<uint32_t>(std::min<uint64_t>(kMaxPayload, o.op.nbytes - o.sent));
    o.sent += h.payload;
    out_ends_message_ = o.sent == o.op.nbytes;
    out_is_data_ = true;
    buf = o.op.buf;
    payload = reinterpret_cast<const unsigned char*>(buf->ptr) + o.op.offset + h.offset;
  } else {
    out_len_ = 0;
    return false;
  }
  const size_t length = RecordLength(h.payload, sealed_);
  EncodeLength(static_cast<uint32_t>(length), out_.data());
  unsigned char header[kHeaderBytes];
  EncodeHeader(h, header);
  if (!sealed_) {
    std::memcpy(out_.data() + kLengthBytes, header, kHeaderBytes);
    out_len_ = kLengthBytes + kHeaderBytes;
    out_payload_len_ = h.payload;
    out_payload_at_ = h.offset;
    return true;
  }
  absl::Status sealed;
  if (buf != nullptr) {
    absl::ReleasableMutexLock lock(&buf->mu);
    if (!buf->alive) {
      lock.Release();
      Fail(absl::CancelledError(
          absl::StrCat(Link(), ": a send's buffer went away while it was being sent")));
      return false;
    }
    sealed =
        send_cipher_->Seal(out_.data(), header, payload, h.payload, out_.data() + kLengthBytes);
  } else {
    sealed = send_cipher_->Seal(out_.data(), header, nullptr, 0, out_.data() + kLengthBytes);
  }
  if (!sealed.ok()) {
    Fail(sealed);
    return false;
  }
  out_len_ = kLengthBytes + length;
  return true;
}

void PairImpl::Flush() {
  if (fd_ < 0 || !error_.ok()) return;
  for (;;) {
    const size_t total = out_len_ + out_payload_len_;
    if (out_pos_ < total) {
      iovec iov[2];
      int count = 0;
      if (out_pos_ < out_len_) iov[count++] = {out_.data() + out_pos_, out_len_ - out_pos_};
      std::shared_ptr<BufferState> buf;
      if (out_payload_len_ > 0) {
        const Outgoing& o = outgoing_.front();
        buf = o.op.buf;
        const size_t done = out_pos_ > out_len_ ? out_pos_ - out_len_ : 0;
        iov[count++] = {buf->ptr + o.op.offset + out_payload_at_ + done, out_payload_len_ - done};
      }
      msghdr msg{};
      msg.msg_iov = iov;
      msg.msg_iovlen = count;
      ssize_t n;
      if (buf != nullptr) {
        absl::ReleasableMutexLock lock(&buf->mu);
        if (!buf->alive) {
          lock.Release();
          Fail(absl::CancelledError(
              absl::StrCat(Link(), ": a send's buffer went away while it was being sent")));
          return;
        }
        n = sendmsg(fd_, &msg, MSG_NOSIGNAL);
      } else {
        n = sendmsg(fd_, &msg, MSG_NOSIGNAL);
      }
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN) {
          WantWrite(true);
          return;
        }
        Fail(absl::UnavailableError(absl::StrCat(Link(), ": sending failed: ", strerror(errno))));
        return;
      }
      out_pos_ += static_cast<size_t>(n);
      continue;
    }
    if (total > 0 && out_is_data_ && out_ends_message_) {
      Outgoing done = std::move(outgoing_.front());
      outgoing_.pop_front();
      done.op.buf->SendDone(peer_);
    }
    if (!NextRecord()) {
      if (error_.ok()) WantWrite(false);
      return;
    }
  }
}

void PairImpl::OnEvents(uint32_t events) {
  absl::MutexLock read(&read_mu_);
  int fd;
  {
    absl::MutexLock lock(&mu_);
    fd = fd_;
    if (!error_.ok() || fd_ < 0) {
      if (registration_ != 0) {
        device_->loop().Remove(registration_, fd_);
        registration_ = 0;
      }
      fd = -1;
    } else if ((events & EPOLLOUT) != 0) {
      Flush();
    }
  }
  if (fd < 0) {
    FailIncoming();
    return;
  }
  if ((events & (EPOLLIN | EPOLLHUP | EPOLLERR)) != 0) ReadSome(fd);
  absl::MutexLock lock(&mu_);
  Flush();  // notices that came in may have matched sends
}

void PairImpl::FailIncoming() {
  if (!in_msg_) return;
  absl::Status why;
  {
    absl::MutexLock lock(&mu_);
    why = error_.ok() ? absl::CancelledError(absl::StrCat(Link(), ": closed")) : error_;
  }
  in_op_.buf->Failed(why);
  in_msg_ = false;
  in_op_ = Op{};
}

void PairImpl::FailReading(absl::Status status) {
  {
    absl::MutexLock lock(&mu_);
    Fail(std::move(status));
  }
  FailIncoming();
}

bool PairImpl::LengthRead() {
  const uint32_t length = DecodeLength(length_);
  if (absl::Status s = CheckRecordLength(length, sealed_); !s.ok()) {
    FailReading(absl::DataLossError(absl::StrCat(Link(), ": node ", peer_, " sent ", s.message())));
    return false;
  }
  stage_ = ReadStage::kRecord;
  in_need_ = sealed_ ? length : kHeaderBytes;
  in_have_ = 0;
  // Open records: the payload's length, from the record's.
  in_payload_left_ = sealed_ ? 0 : length - kHeaderBytes;
  return true;
}

bool PairImpl::RecordRead() {
  const unsigned char* header = in_.data();
  if (sealed_) {
    const uint64_t number = recv_cipher_->records();
    if (!recv_cipher_->Open(length_, in_.data(), in_need_, plain_.data())) {
      device_->CountRefusedRecord();
      FailReading(absl::DataLossError(absl::StrCat(
          "the sealed transfer from node ", peer_, " to node ", self_, " (record ", number,
          " on lane ", device_->options().lane,
          ") failed verification (altered, replayed, reordered, or not sealed by that node "
          "on this connection): nothing of it was used; the link is closed")));
      return false;
    }
    header = plain_.data();
  }
  auto h = DecodeHeader(header);
  const size_t payload = sealed_ ? in_need_ - kHeaderBytes - kTagBytes : in_payload_left_;
  absl::Status s = h.ok() ? absl::OkStatus() : h.status();
  if (s.ok() && h->payload != payload) {
    s = absl::DataLossError(absl::StrCat("a record whose header says ", h->payload,
                                         " payload bytes and whose length ", payload));
  }
  if (s.ok()) s = OnHeader(*h);
  if (!s.ok()) {
    FailReading(absl::DataLossError(
        absl::StrCat(Link(), ": node ", peer_, " broke the data-plane protocol: ", s.message())));
    return false;
  }
  stage_ = ReadStage::kLength;
  in_have_ = 0;
  if (h->type != RecordType::kData) return true;
  if (sealed_) {
    Deliver(plain_.data() + kHeaderBytes, h->payload);
    if (in_received_ == in_total_) FinishIncoming();
  } else if (h->payload > 0) {
    stage_ = ReadStage::kPayload;
    in_payload_left_ = h->payload;
  } else if (in_received_ == in_total_) {
    FinishIncoming();
  }
  return true;
}

void PairImpl::ReadSome(int fd) {
  size_t budget = kReadBudget;
  while (budget > 0 && !failed_) {
    unsigned char* into = nullptr;
    size_t want = 0;
    std::shared_ptr<BufferState> dest;
    switch (stage_) {
      case ReadStage::kLength:
        into = length_ + in_have_;
        want = kLengthBytes - in_have_;
        break;
      case ReadStage::kRecord:
        into = in_.data() + in_have_;
        want = in_need_ - in_have_;
        break;
      case ReadStage::kPayload:
        dest = in_op_.buf;
        want = in_payload_left_;
        break;
    }
    ssize_t n;
    if (dest != nullptr) {
      absl::MutexLock lock(&dest->mu);
      if (dest->alive) {
        n = ::read(fd, dest->ptr + in_op_.offset + in_received_, want);
      } else {
        n = ::read(fd, in_.data(), std::min(want, in_.size()));  // dropped
      }
    } else {
      n = ::read(fd, into, want);
    }
    if (n == 0) {
      FailReading(
          absl::UnavailableError(absl::StrCat(Link(), ": node ", peer_, " closed the connection")));
      return;
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN) {
        FailReading(
            absl::UnavailableError(absl::StrCat(Link(), ": receiving failed: ", strerror(errno))));
      }
      return;
    }
    budget -= std::min(budget, static_cast<size_t>(n));
    switch (stage_) {
      case ReadStage::kLength:
        in_have_ += static_cast<size_t>(n);
        if (in_have_ == kLengthBytes && !LengthRead()) return;
        break;
      case ReadStage::kRecord:
        in_have_ += static_cast<size_t>(n);
        if (in_have_ == in_need_ && !RecordRead()) return;
        break;
      case ReadStage::kPayload:
        in_received_ += static_cast<uint64_t>(n);
        in_payload_left_ -= static_cast<uint64_t>(n);
        if (in_payload_left_ > 0) break;
        stage_ = ReadStage::kLength;
        in_have_ = 0;
        if (in_received_ == in_total_) FinishIncoming();
        break;
    }
  }
  if (failed_) FailIncoming();
}

absl::Status PairImpl::OnHeader(const Header& h) {
  if (h.type == RecordType::kRecvReady) {
    absl::MutexLock lock(&mu_);
    if (notices_in_count_ >= kMaxNoticesIn) {
      return absl::DataLossError(
          absl::StrCat("more than ", kMaxNoticesIn, " receives posted ahead"));
    }
    notices_in_[h.slot].push_back(h.total);
    ++notices_in_count_;
    Match(h.slot);
    return absl::OkStatus();
  }
  if (h.payload == 0 && h.total != 0) {
    return absl::DataLossError("an empty data record of a message that is not");
  }
  if (!in_msg_) {
    if (h.offset != 0) {
      return absl::DataLossError(
          absl::StrCat("a message's record at offset ", h.offset, " without its beginning"));
    }
    absl::MutexLock lock(&mu_);
    auto it = posted_.find(h.slot);
    if (it == posted_.end() || it->second.empty()) {
      return absl::DataLossError(absl::StrCat("a message of ", h.total, " bytes for slot ", h.slot,
                                              ", for which no receive is posted"));
    }
    Op& op = it->second.front();
    if (h.total > op.nbytes) {
      return absl::DataLossError(absl::StrCat("a message of ", h.total, " bytes for slot ", h.slot,
                                              ", whose receive holds ", op.nbytes));
    }
    in_msg_ = true;
    in_op_ = std::move(op);
    it->second.pop_front();
    if (it->second.empty()) posted_.erase(it);
    in_slot_ = h.slot;
    in_total_ = h.total;
    in_received_ = 0;
    return absl::OkStatus();
  }
  if (h.slot != in_slot_ || h.total != in_total_ || h.offset != in_received_) {
    return absl::DataLossError(absl::StrCat("a record of slot ", h.slot, " at ", h.offset,
                                            " inside the message of slot ", in_slot_, " at ",
                                            in_received_));
  }
  return absl::OkStatus();
}

void PairImpl::Deliver(const unsigned char* bytes, size_t n) {
  if (n > 0) {
    absl::MutexLock lock(&in_op_.buf->mu);
    if (in_op_.buf->alive) std::memcpy(in_op_.buf->ptr + in_op_.offset + in_received_, bytes, n);
  }
  in_received_ += n;
}

void PairImpl::FinishIncoming() {
  in_op_.buf->RecvDone(peer_);
  in_msg_ = false;
  in_op_ = Op{};
}

}  // namespace microd::transport::record
