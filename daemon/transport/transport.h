// SPDX-License-Identifier: Apache-2.0
// The data-plane interface a sparsifier step is written against: allgather
// (fixed and variable size), allreduce-sum and barrier among the nodes of one
// job. Backends (in-process, Gloo, NCCL) live in sub-folders and expose only a
// factory.
//
// Contract for every backend:
// - Collectives are called by every rank in the same order with the same tag
//   and the same kind; a rank that calls a different one gets an error.
//   Tags are built with MakeTag (what a tag means is written down there).
// - Each call blocks until it is complete on this rank or its deadline passes.
//   On a deadline, an abort or a peer failure it returns an error
//   (kDeadlineExceeded, kAborted, kUnavailable) and the transport is broken:
//   every later call fails at once with the same status. Nothing hangs.
// - One collective at a time per Transport object (not thread-safe); the
//   memory passed in must stay valid until the call returns.
// - Buffers are memory the backend can read: host memory for in-process and
//   Gloo, device memory for NCCL (same memory space as the kernels' device).
// - AllreduceSum leaves the identical result on every rank. The host
//   backends (in-process, Gloo) sum floats in rank order (((x0 + x1) + x2)
//   + ...), so their results are the same bits; NCCL sums in its own order.
//   bf16 and fp16 data (2-byte elements) travel as they are and are summed
//   widened to fp32, in rank order, the sum rounded once to the type
//   (kernels/convert.h); only the host backends take them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "daemon/transport/link_model.h"
#include "kernels/element_type.h"

namespace microd::transport {

// What the collectives move: kernels' one numbering of element types.
using DataType = kernels::ElementType;

// What a collective belongs to. A tag is (bucket slot << 8) | kind, so that
// the collectives of different buckets can never be matched with each other.
enum class TagKind : uint32_t {
  kControl = 0,    // barriers and set-up
  kHeader = 1,     // per-node header of a dense step: status flags
  kHistogram = 4,  // the hist controller's prime
  kDense = 5,      // dense allreduce of a whole bucket
  // The rounds of a sparse step (sparsify/batch_step.h), slot 0: the
  // batches of a transport run one after another.
  kRound1 = 8,   // headers, and indices or coarse histograms
  kRound2 = 9,   // candidates near the threshold (hist)
  kRound3 = 10,  // values
  kRescan = 11,  // coarse histograms again after a rescan (hist, rare)
  kCycle = 12,   // the response cache's cycle (slot 0): what every node has ready
};
// Bucket slots are below this (tags stay unique in 32 bits in every backend).
constexpr uint32_t kMaxTagSlots = 1u << 20;
constexpr uint32_t MakeTag(uint32_t bucket_slot, TagKind kind) {
  return (bucket_slot << 8) | static_cast<uint32_t>(kind);
}

struct CollectiveOptions {
  absl::Time deadline = absl::InfiniteFuture();
  uint32_t tag = 0;
  // The caller's promise that every rank makes this call next, with this tag
  // and the same sizes: they follow from what an earlier checked collective
  // delivered to every rank (a step's headers), and a rank that fails in
  // between fails the job, which aborts the transport. A backend that checks
  // each call's shape with a round of its own (NCCL) skips that round.
  bool shape_agreed = false;
  // ExchangeRound: the longest message a peer may send (0: kMaxRoundBytes).
  // A peer that says it sends more fails the call (DataLoss naming it)
  // before anything is allocated for it.
  size_t max_bytes = 0;
};
// The longest round message any call takes.
constexpr size_t kMaxRoundBytes = size_t{1} << 30;

// Argument checks every backend makes before a collective.
absl::Status CheckAllgatherV(int rank, int size, const void* in,
                             absl::Span<const size_t> recv_bytes, const void* out);
absl::Status CheckBuffers(const char* op, size_t bytes, const void* in, const void* out);
// A round message's length, as `sender` says it, against what the call takes.
absl::Status CheckRoundLength(uint64_t length, const CollectiveOptions& options, int sender);

class Transport {
 public:
  virtual ~Transport() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Backend name for logs and statistics ("inproc", "gloo", "nccl").
  virtual const char* name() const = 0;
  // How many times so far a call waited on the host for device work of its
  // own (NCCL: each collective's completion, each descriptor round); 0 for
  // the host backends.
  virtual uint64_t host_waits() const { return 0; }
  // Working memory the backend keeps between calls, in bytes (the Gloo
  // backend's allreduce scratch); safe to read from any thread.
  virtual uint64_t scratch_bytes() const { return 0; }
  // Whether every transfer between ranks is sealed (authenticated and
  // encrypted), and how many transfers so far failed verification (each
  // failed its call with DataLoss naming the link); safe from any thread.
  virtual bool sealed() const { return false; }
  virtual uint64_t refused_transfers() const { return 0; }

  // Every rank contributes `bytes` bytes; `out` (size() * bytes) receives rank
  // r's contribution at offset r * bytes.
  virtual absl::Status Allgather(const void* in, size_t bytes, void* out,
                                 const CollectiveOptions& options) = 0;

  // Rank r contributes recv_bytes[r] bytes (every rank passes the same
  // recv_bytes, of length size(); this rank sends recv_bytes[rank()] bytes from
  // `in`); `out` receives the contributions concatenated in rank order.
  virtual absl::Status AllgatherV(const void* in, absl::Span<const size_t> recv_bytes, void* out,
                                  const CollectiveOptions& options) = 0;

  // In-place element-wise sum of `count` elements across ranks.
  virtual absl::Status AllreduceSum(void* data, size_t count, DataType type,
                                    const CollectiveOptions& options) = 0;

  // AllreduceSum of floats, then every sum divided by `divisor`: the same
  // bits as AllreduceSum followed by a division on every rank. Host backends
  // fold the division into the collective (a chunk's owner divides it once,
  // before sending it on: no extra pass over the buffer). The default, for
  // backends that cannot (NCCL: device memory), is kUnimplemented without
  // touching `data` or breaking the transport: divide with the kernels then.
  virtual absl::Status AllreduceAverage(float* data, size_t count, float divisor,
                                        const CollectiveOptions& options) {
    return absl::UnimplementedError(absl::StrCat(name(), ": no AllreduceAverage"));
  }

  virtual absl::Status Barrier(const CollectiveOptions& options) = 0;

  // One direct round: this rank's message `mine` goes to every peer and
  // every peer's message arrives in from[p] (from[rank()] is `mine`),
  // whatever their sizes: one transfer per pair and direction (two for a
  // message past the backend's inline size), all at once. Every rank calls
  // it with the same tag. The default is two allgathers (the sizes, then
  // the bytes); messages are host memory in every backend.
  virtual absl::Status ExchangeRound(std::string_view mine, std::vector<std::string>* from,
                                     const CollectiveOptions& options);
  // ExchangeRounds with `tag` come later on every rank (rounds of one tag
  // run in the same order everywhere): a backend may post their receives
  // now, so that a round then costs one trip instead of two, and messages
  // up to `inline_bytes` (0: the backend's choice) go in one transfer.
  // Every rank makes the same calls. Gloo keeps the next two rounds of a
  // tag posted (a receive's notice needs a one-way trip to reach the
  // sender); receives of rounds that never come stay posted until the
  // transport's end.
  virtual void Expect(uint32_t tag, size_t inline_bytes = 0) {}
  // Communication rounds so far: transfers that each wait for the ones
  // before them (a direct exchange is 1, a ring allgather n - 1, a ring
  // allreduce 2 (n - 1)). What a step's latency is made of.
  uint64_t rounds() const { return rounds_; }
  // Whether one direct round carrying `bytes` from every rank to every
  // peer, summed on each rank, costs less than the backend's
  // bandwidth-optimal allreduce of `bytes` (from what the backend knows of
  // its links' latency and bandwidth). A host backend's results are the same
  // bits either way.
  virtual bool DirectCheaper(size_t bytes) const { return true; }
  // What the backend measured of its links (null: nothing).
  virtual const LinkModel* link_model() const { return nullptr; }

  // Before a rank commits what the calls so far brought (a step's state, its
  // result): every rank got through every transfer of them. One round where
  // the backend was asked for it (GlooOptions::confirm: a sealed data plane
  // whose refused transfers fail the step, not the job), else nothing. A
  // rank that failed a transfer never arrives, so every rank's Confirm
  // fails: no rank commits a step another could not.
  virtual absl::Status Confirm(absl::Time deadline) { return absl::OkStatus(); }
  // The Confirm rounds that succeeded on this rank (0 where Confirm is
  // nothing): ranks that committed the same steps count alike.
  virtual uint64_t confirmed() const { return 0; }

  // Makes pending and later calls on every rank of the group fail with
  // `reason` where the backend can reach them (at least on this rank).
  virtual void Abort(const absl::Status& reason) = 0;

 protected:
  void CountRounds(uint64_t n) { rounds_ += n; }

 private:
  uint64_t rounds_ = 0;
};

}  // namespace microd::transport
