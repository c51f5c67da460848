// SPDX-License-Identifier: Apache-2.0
// The device's pairs, contexts and unbound buffers (device.h has the
// protocol). Internal to the device: the rest of microd sees Gloo's
// interfaces only.
#pragma once

#include <gloo/transport/address.h>
#include <gloo/transport/context.h>
#include <gloo/transport/pair.h>
#include <gloo/transport/unbound_buffer.h>
#include <sys/socket.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "daemon/transport/gloo/record/codec.h"
#include "daemon/transport/gloo/record/loop.h"

namespace microd::transport::record {

class DeviceImpl;
class ContextImpl;

// "host:port" ("[host]:port" for IPv6) of a socket address, for messages.
std::string SockText(const sockaddr* sa);

// What an unbound buffer's pending operations share with the pairs serving
// them: completions, and whether the buffer still exists (a pair writes
// into it or reads from it only under `mu`, while `alive`).
struct BufferState {
  BufferState(void* p, size_t s) : ptr(static_cast<char*>(p)), size(s) {}
  char* const ptr;
  const size_t size;
  absl::Mutex mu;
  bool alive ABSL_GUARDED_BY(mu) = true;
  // Receives, and sends: completions not waited for yet, the rank of the
  // last, and whether the next wait is to end at once (an abort).
  struct Side {
    int done = 0;
    int rank = -1;
    bool abort = false;
  };
  Side recv ABSL_GUARDED_BY(mu);
  Side send ABSL_GUARDED_BY(mu);
  absl::Status error ABSL_GUARDED_BY(mu);  // a link under a pending operation failed

  void Done(Side BufferState::*side, int rank);
  void RecvDone(int rank) { Done(&BufferState::recv, rank); }
  void SendDone(int rank) { Done(&BufferState::send, rank); }
  void Failed(const absl::Status& status);
};

// A receive posted, or a send, on one pair.
struct Op {
  std::shared_ptr<BufferState> buf;
  size_t offset = 0;
  size_t nbytes = 0;
};

class Buffer final : public ::gloo::transport::UnboundBuffer {
 public:
  Buffer(std::shared_ptr<ContextImpl> context, void* ptr, size_t size);
  ~Buffer() override;

  bool waitRecv(int* rank, std::chrono::milliseconds timeout) override;
  bool waitSend(int* rank, std::chrono::milliseconds timeout) override;
  void abortWaitRecv() override;
  void abortWaitSend() override;
  void send(int dst_rank, uint64_t slot, size_t offset, size_t nbytes) override;
  void recv(int src_rank, uint64_t slot, size_t offset, size_t nbytes) override;
  void recv(std::vector<int> src_ranks, uint64_t slot, size_t offset, size_t nbytes) override;

  const std::shared_ptr<BufferState>& state() const { return state_; }

 private:
  // One completion of `side` (true), or an abort (false).
  bool Wait(BufferState::Side BufferState::*side, int* rank, std::chrono::milliseconds timeout,
            const char* what);
  // The op's bytes checked against the buffer (kUnspecifiedByteCount: the rest).
  Op MakeOp(size_t offset, size_t nbytes) const;

  const std::shared_ptr<ContextImpl> context_;
  const std::shared_ptr<BufferState> state_;
};

class AddressImpl final : public ::gloo::transport::Address {
 public:
  AddressImpl(std::string bytes, std::string text)
      : bytes_(std::move(bytes)), text_(std::move(text)) {}
  std::string str() const override { return text_; }
  std::vector<char> bytes() const override { return {bytes_.begin(), bytes_.end()}; }

 private:
  const std::string bytes_;
  const std::string text_;
};

// One end of a connection between two ranks of a context.
class PairImpl final : public ::gloo::transport::Pair, private Loop::Handler {
 public:
  PairImpl(DeviceImpl* device, int self, int peer, const PairAddress& mine, std::string text,
           std::string link_secret);
  ~PairImpl() override;

  const ::gloo::transport::Address& address() const override { return address_; }
  // Blocks until the connection is up (the context's timeout): the lower
  // rank waits for the peer to dial it, the higher one dials.
  void connect(const std::vector<char>& bytes) override;
  void close() override;
  void setSync(bool, bool) override {}
  std::unique_ptr<::gloo::transport::Buffer> createSendBuffer(int, void*, size_t) override;
  std::unique_ptr<::gloo::transport::Buffer> createRecvBuffer(int, void*, size_t) override;
  void send(::gloo::transport::UnboundBuffer* buf, uint64_t slot, size_t offset,
            size_t nbytes) override;
  void recv(::gloo::transport::UnboundBuffer* buf, uint64_t slot, size_t offset,
            size_t nbytes) override;

  void Send(Op op, uint64_t slot);
  void Recv(Op op, uint64_t slot);

  // The listener's side of a handshake that verified (the device's loop):
  // the connection becomes this pair's. False when the pair has one already
  // (or is closed); the caller then closes `fd`.
  bool Attach(int fd, const TrafficKeys& keys, bool listener);

  int self() const { return self_; }
  int peer() const { return peer_; }
  uint64_t id() const { return mine_.pair_id; }
  const PairAddress& mine() const { return mine_; }
  const std::string& link_secret() const { return link_secret_; }
  void set_timeout(std::chrono::milliseconds t) { timeout_ = t; }

 private:
  void OnEvents(uint32_t events) override;
  // The dialer's side: connects to `peer`, runs the handshake; Attach.
  void Dial(const PairAddress& peer, absl::Time deadline);
  // The link fails: every operation on it fails with `status` (the one
  // being received too, by the loop's thread, which it wakes).
  void Fail(absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The message being received fails with the link's error.
  void FailIncoming() ABSL_EXCLUSIVE_LOCKS_REQUIRED(read_mu_) ABSL_LOCKS_EXCLUDED(mu_);
  void ThrowIfFailed() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The peer's notice or this rank's send may complete a match.
  void Match(uint64_t slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Writes what is queued until the socket takes no more.
  void Flush() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The next record to write; false when nothing is queued.
  bool NextRecord() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void WantWrite(bool want) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Reads what arrived (at most a budget), record by record.
  void ReadSome(int fd) ABSL_EXCLUSIVE_LOCKS_REQUIRED(read_mu_) ABSL_LOCKS_EXCLUDED(mu_);
  // ReadSome's stages complete: a record's length (checked), a record
  // (opened if sealed, its header checked and taken). False: the read
  // failed (FailReading called).
  bool LengthRead() ABSL_EXCLUSIVE_LOCKS_REQUIRED(read_mu_) ABSL_LOCKS_EXCLUDED(mu_);
  bool RecordRead() ABSL_EXCLUSIVE_LOCKS_REQUIRED(read_mu_) ABSL_LOCKS_EXCLUDED(mu_);
  // Fails the link from the reading side (the loop's thread).
  void FailReading(absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(read_mu_)
      ABSL_LOCKS_EXCLUDED(mu_);
  // A record's header (and, sealed, its payload, already opened).
  absl::Status OnHeader(const Header& h) ABSL_EXCLUSIVE_LOCKS_REQUIRED(read_mu_)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Payload bytes of the message in progress, into its receive.
  void Deliver(const unsigned char* bytes, size_t n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(read_mu_);
  void FinishIncoming() ABSL_EXCLUSIVE_LOCKS_REQUIRED(read_mu_);
  std::string Link() const;

  DeviceImpl* const device_;
  const int self_;
  const int peer_;
  const PairAddress mine_;
  const AddressImpl address_;
  const std::string link_secret_;  // empty: records go unsealed
  const bool sealed_;
  std::chrono::milliseconds timeout_{60000};

  // Two locks, so that a pair sends and receives at once: `read_mu_` (the
  // loop's thread, reading) before `mu_` (matching and writing, any
  // thread); a buffer's lock after both.
  absl::Mutex read_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  absl::Mutex mu_;
  std::atomic<bool> failed_{false};  // error_ is set
  int fd_ ABSL_GUARDED_BY(mu_) = -1;
  uint64_t registration_ ABSL_GUARDED_BY(mu_) = 0;
  bool connected_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<RecordCipher> send_cipher_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<RecordCipher> recv_cipher_ ABSL_GUARDED_BY(read_mu_);

  // Matching, by slot: receives posted here, the peer's notices, sends
  // waiting for a notice; then what goes out, in order.
  std::map<uint64_t, std::deque<Op>> posted_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, std::deque<uint64_t>> notices_in_ ABSL_GUARDED_BY(mu_);
  size_t notices_in_count_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<uint64_t, std::deque<Op>> waiting_ ABSL_GUARDED_BY(mu_);
  std::deque<Header> notices_out_ ABSL_GUARDED_BY(mu_);
  struct Outgoing {
    Op op;
    uint64_t slot = 0;
    uint64_t sent = 0;  // payload bytes made into records so far
  };
  std::deque<Outgoing> outgoing_ ABSL_GUARDED_BY(mu_);

  // The record being written: out_[0, out_len_) (length, header and, sealed,
  // payload and tag), then, open, `out_payload_len_` bytes straight from the
  // send's buffer.
  std::vector<unsigned char> out_ ABSL_GUARDED_BY(mu_);
  size_t out_len_ ABSL_GUARDED_BY(mu_) = 0;
  size_t out_pos_ ABSL_GUARDED_BY(mu_) = 0;
  size_t out_payload_len_ ABSL_GUARDED_BY(mu_) = 0;
  size_t out_payload_at_ ABSL_GUARDED_BY(mu_) = 0;  // offset in the message
  bool out_ends_message_ ABSL_GUARDED_BY(mu_) = false;
  bool out_is_data_ ABSL_GUARDED_BY(mu_) = false;
  bool want_write_ ABSL_GUARDED_BY(mu_) = false;

  // Reading: the length, then (sealed) the record, or (open) the header and
  // its payload straight into place.
  enum class ReadStage { kLength, kRecord, kPayload };
  ReadStage stage_ ABSL_GUARDED_BY(read_mu_) = ReadStage::kLength;
  unsigned char length_[kLengthBytes] ABSL_GUARDED_BY(read_mu_) = {};
  std::vector<unsigned char> in_ ABSL_GUARDED_BY(read_mu_);
  size_t in_need_ ABSL_GUARDED_BY(read_mu_) = kLengthBytes;
  size_t in_have_ ABSL_GUARDED_BY(read_mu_) = 0;
  std::vector<unsigned char> plain_ ABSL_GUARDED_BY(read_mu_);
  // The message in progress.
  bool in_msg_ ABSL_GUARDED_BY(read_mu_) = false;
  uint64_t in_slot_ ABSL_GUARDED_BY(read_mu_) = 0;
  uint64_t in_total_ ABSL_GUARDED_BY(read_mu_) = 0;
  uint64_t in_received_ ABSL_GUARDED_BY(read_mu_) = 0;
  uint64_t in_payload_left_ ABSL_GUARDED_BY(read_mu_) = 0;  // open: of the record being read
  Op in_op_ ABSL_GUARDED_BY(read_mu_);
};

class ContextImpl final : public ::gloo::transport::Context,
                          public std::enable_shared_from_this<ContextImpl> {
 public:
  ContextImpl(std::shared_ptr<DeviceImpl> device, int rank, int size);
  ~ContextImpl() override;

  std::unique_ptr<::gloo::transport::Pair>& createPair(int rank) override;
  std::unique_ptr<::gloo::transport::UnboundBuffer> createUnboundBuffer(void* ptr,
                                                                        size_t size) override;
  PairImpl* pair(int rank);

 private:
  const std::shared_ptr<DeviceImpl> device_;
};

}  // namespace microd::transport::record
