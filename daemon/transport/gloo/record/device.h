// SPDX-License-Identifier: Apache-2.0
// microd's Gloo transport device: TCP connections whose every byte, from
// the first, goes through a record layer (codec.h). Gloo's collectives and
// microd's own run over it through Gloo's API (contexts, pairs, unbound
// buffers) without a branch for it; only the factory is public.
//
// Why a device of our own: Debian's Gloo has no TLS device, and its TCP
// device parses what arrives unauthenticated and aborts the process on a
// header it does not expect (an operation for a slot with no receive
// posted, or longer than the receive): one flipped byte, one bad member or
// one stranger who connects first to a pair's port stopped the daemon. Here
// a connection is authenticated before any byte of it is parsed (the
// handshake, codec.h), sealed records are verified before their header is
// read, every field is checked before it is used, and whatever fails ends
// that link with an error naming it (LinkError), never the process.
//
// Protocol between the two ends of a pair, as Gloo's unbound buffers need
// it: a receive posted for a slot sends a notice (its size); a send waits
// for the peer's notice of that slot and then goes (in records of at most
// kMaxPayload bytes), the n-th send of a slot into the n-th receive posted
// for it. Notices travel between a message's records. A message longer
// than its receive, one for a slot with nothing posted, or a record out of
// order is the peer's fault: the link ends, named.
#pragma once

#include <gloo/common/error.h>
#include <gloo/transport/device.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace microd::transport::record {

struct DeviceOptions {
  // The address to listen on (this node's, as its peers reach it).
  std::string hostname = "127.0.0.1";
  // Named in errors and bound into each connection's handshake: the
  // connection of a transport this device serves (0: the first).
  int lane = 0;
  // The secret of the link between ranks `self` and `peer` (both ends
  // derive the same; 32 bytes): records are sealed under keys each
  // connection derives from it. Null: records are not sealed, and a
  // connection is authenticated by the pair's rendezvous ticket alone.
  std::function<absl::StatusOr<std::string>(int self, int peer)> link_secret;
  // How long an accepted connection may take to finish its handshake.
  absl::Duration handshake_timeout = absl::Seconds(10);
  // Accepted connections still in their handshake at most (beyond, the
  // oldest is dropped: a stranger holding connections open cannot crowd
  // out a peer).
  int max_handshakes = 64;
  // Nice value added to the device's thread (0 to 19).
  int io_nice = 0;
};

// What a call on a failed link throws: Gloo's exception, with the status
// (DataLoss for a record that did not verify or a peer that broke the
// protocol; Unavailable for a closed connection; DeadlineExceeded).
class LinkError : public ::gloo::IoException {
 public:
  explicit LinkError(absl::Status status)
      : ::gloo::IoException(std::string(status.message())), status_(std::move(status)) {}
  const absl::Status& status() const { return status_; }

 private:
  absl::Status status_;
};

// Throws `s` as a LinkError (how the transport's calls report to Gloo).
[[noreturn]] inline void Throw(absl::Status s) { throw LinkError(std::move(s)); }

class Device : public ::gloo::transport::Device {
 public:
  // Records that failed verification, and connections refused at the
  // handshake, so far (any thread).
  virtual uint64_t refused_records() const = 0;
  virtual uint64_t refused_connections() const = 0;
  // Closes the listening socket (every pair connected: nothing more to accept).
  virtual void StopListening() = 0;
};

absl::StatusOr<std::shared_ptr<Device>> CreateDevice(const DeviceOptions& options);

}  // namespace microd::transport::record
