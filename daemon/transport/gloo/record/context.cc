// SPDX-License-Identifier: Apache-2.0
// The record transport's context and unbound buffers (pair.h): a buffer's
// sends and receives go to its context's pairs, and its waits end on the
// pair's completions, a failure or Gloo's timeout.
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "daemon/transport/gloo/record/device_impl.h"
#include "daemon/transport/gloo/record/pair.h"

namespace microd::transport::record {

void BufferState::Done(Side BufferState::*side, int rank) {
  absl::MutexLock lock(&mu);
  ++(this->*side).done;
  (this->*side).rank = rank;
}

void BufferState::Failed(const absl::Status& status) {
  absl::MutexLock lock(&mu);
  if (error.ok()) error = status;
}

Buffer::Buffer(std::shared_ptr<ContextImpl> context, void* ptr, size_t size)
    : ::gloo::transport::UnboundBuffer(ptr, size),
      context_(std::move(context)),
      state_(std::make_shared<BufferState>(ptr, size)) {}

Buffer::~Buffer() {
  absl::MutexLock lock(&state_->mu);
  state_->alive = false;
}

namespace {
// Gloo's wording, which the transport maps to DeadlineExceeded.
[[noreturn]] void TimedOut(std::chrono::milliseconds timeout, const char* what) {
  throw ::gloo::IoException(absl::StrCat("Timed out waiting ", timeout.count(), "ms for ", what,
                                         " operation to complete"));
}
}  // namespace

bool Buffer::Wait(BufferState::Side BufferState::*side, int* rank,
                  std::chrono::milliseconds timeout, const char* what) {
  if (timeout == ::gloo::transport::kUnsetTimeout) timeout = context_->getTimeout();
  BufferState& s = *state_;
  absl::MutexLock lock(&s.mu);
  auto ready = [&s, side]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(s.mu) {
    return (s.*side).done > 0 || (s.*side).abort || !s.error.ok();
  };
  if (!s.mu.AwaitWithTimeout(absl::Condition(&ready), absl::FromChrono(timeout))) {
    TimedOut(timeout, what);
  }
  if (!s.error.ok()) Throw(s.error);
  if ((s.*side).abort) {
    (s.*side).abort = false;
    return false;
  }
  --(s.*side).done;
  if (rank != nullptr) *rank = (s.*side).rank;
  return true;
}

bool Buffer::waitRecv(int* rank, std::chrono::milliseconds timeout) {
  return Wait(&BufferState::recv, rank, timeout, "recv");
}

bool Buffer::waitSend(int* rank, std::chrono::milliseconds timeout) {
  return Wait(&BufferState::send, rank, timeout, "send");
}

void Buffer::abortWaitRecv() {
  absl::MutexLock lock(&state_->mu);
  state_->recv.abort = true;
}

void Buffer::abortWaitSend() {
  absl::MutexLock lock(&state_->mu);
  state_->send.abort = true;
}

Op Buffer::MakeOp(size_t offset, size_t nbytes) const {
  if (nbytes == kUnspecifiedByteCount) nbytes = offset <= size ? size - offset : 0;
  if (offset > size || nbytes > size - offset) {
    Throw(absl::InvalidArgumentError(absl::StrCat("an operation on bytes [", offset, ", ",
                                                  offset + nbytes, ") of a buffer of ", size)));
  }
  return Op{state_, offset, nbytes};
}

void Buffer::send(int dst_rank, uint64_t slot, size_t offset, size_t nbytes) {
  context_->pair(dst_rank)->Send(MakeOp(offset, nbytes), slot);
}

void Buffer::recv(int src_rank, uint64_t slot, size_t offset, size_t nbytes) {
  context_->pair(src_rank)->Recv(MakeOp(offset, nbytes), slot);
}

void Buffer::recv(std::vector<int> src_ranks, uint64_t slot, size_t offset, size_t nbytes) {
  if (src_ranks.size() != 1) {
    Throw(absl::UnimplementedError("a receive from any of several ranks"));
  }
  recv(src_ranks[0], slot, offset, nbytes);
}

ContextImpl::ContextImpl(std::shared_ptr<DeviceImpl> device, int rank, int size)
    : ::gloo::transport::Context(rank, size), device_(std::move(device)) {}

ContextImpl::~ContextImpl() {
  for (auto& p : pairs_) p.reset();  // before the device they use
}

std::unique_ptr<::gloo::transport::Pair>& ContextImpl::createPair(int peer) {
  if (peer < 0 || peer >= size || peer == rank) {
    Throw(absl::InvalidArgumentError(absl::StrCat("no pair of rank ", rank, " with rank ", peer)));
  }
  auto address = device_->NewAddress();
  if (!address.ok()) Throw(address.status());
  std::string secret;
  if (device_->sealed()) {
    auto s = device_->options().link_secret(rank, peer);
    if (!s.ok()) Throw(s.status());
    secret = *std::move(s);
  }
  auto pair = std::make_unique<PairImpl>(device_.get(), rank, peer, *address,
                                         absl::StrCat(device_->str(), " pair ", rank, "-", peer),
                                         std::move(secret));
  pair->set_timeout(getTimeout());
  device_->Register(pair.get());
  pairs_[peer] = std::move(pair);
  return pairs_[peer];
}

std::unique_ptr<::gloo::transport::UnboundBuffer> ContextImpl::createUnboundBuffer(void* ptr,
                                                                                   size_t size) {
  return std::make_unique<Buffer>(shared_from_this(), ptr, size);
}

PairImpl* ContextImpl::pair(int rank) {
  if (rank < 0 || rank >= size || pairs_[rank] == nullptr) {
    Throw(absl::InvalidArgumentError(absl::StrCat("no connection to node ", rank)));
  }
  return static_cast<PairImpl*>(pairs_[rank].get());
}

}  // namespace microd::transport::record
