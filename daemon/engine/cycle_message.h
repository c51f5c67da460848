// SPDX-License-Identifier: Apache-2.0
// What one node says in a response-cache cycle (engine.h): how many schedule
// batches it has received, which cached buckets are ready on it, which of
// those it sends along (their local sums in the message itself, small dense
// buckets only), and those local sums. Every node derives the same layout from
// the cached buckets (same ids, counts and density everywhere), so the message
// is a fixed number of 64-bit words for a given (ids, floats):
//
//   [batches received][ids][ready bits: bw words][sent bits: bw words]
//   [floats of the sent buckets, two per word: (floats + 1) / 2 words]
//
// with bw = ceil(ids / 64). Encoded, allgathered, decoded per node and
// intersected into what every node runs next.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace microd::engine {

struct CycleMessage {
  uint64_t batches_received = 0;
  uint64_t ids = 0;  // cached buckets this node knows
  // Bit i of word i / 64: cache id i. Size BitWords(ids) each.
  std::vector<uint64_t> ready;
  std::vector<uint64_t> sent;
  // Room of the sent buckets' local sums, `floats` of them (slots decided by
  // the caller); unused slots are zero.
  std::vector<float> area;

  // An empty message for `ids` cached buckets and `floats` of room.
  static CycleMessage Empty(uint64_t ids, uint64_t floats);
  static size_t BitWords(uint64_t ids) { return (ids + 63) / 64; }
  // Words of the encoded message.
  static size_t Words(uint64_t ids, uint64_t floats) {
    return 2 + 2 * BitWords(ids) + (floats + 1) / 2;
  }

  void SetReady(uint64_t id) { ready[id / 64] |= uint64_t{1} << (id % 64); }
  void SetSent(uint64_t id) { sent[id / 64] |= uint64_t{1} << (id % 64); }
  bool IsReady(uint64_t id) const { return (ready[id / 64] >> (id % 64)) & 1; }
  bool IsSent(uint64_t id) const { return (sent[id / 64] >> (id % 64)) & 1; }

  std::vector<uint64_t> Encode() const;
  // One node's message out of `words` (Words(ids, floats) of them); an error
  // when it says it knows another number of cached buckets than `ids` (the
  // nodes' response caches are out of step).
  static absl::StatusOr<CycleMessage> Decode(absl::Span<const uint64_t> words, uint64_t ids,
                                             uint64_t floats);
};

// What every node runs after a cycle: the schedule batches up to the fewest
// any node has received, the cached buckets ready on every node, and of
// those the ones every node sent along (reduced by the cycle itself).
struct CycleAgreement {
  uint64_t batches = 0;
  std::vector<uint64_t> ready;  // bits, as in CycleMessage
  std::vector<uint64_t> sent;
  bool IsReady(uint64_t id) const { return (ready[id / 64] >> (id % 64)) & 1; }
  bool IsSent(uint64_t id) const { return (sent[id / 64] >> (id % 64)) & 1; }
};
// The agreement of every node's message (at least one, all of the same ids).
CycleAgreement Intersect(const std::vector<CycleMessage>& messages);

}  // namespace microd::engine
