// SPDX-License-Identifier: Apache-2.0
// The keys of one node's links in an epoch of the sealed data plane
// (issues V, X). The coordinator draws a secret per epoch and hands each
// node, over the control plane's TLS, a salt per link of its own (never
// the epoch's secret, never another node's links'); each link's secret is
// HKDF-SHA256 of its salt and the job's secret (what the token derives),
// with the job id, the epoch and both nodes. A node therefore holds only
// the secrets of its own links: no member can pose as another to a third.
// A link's secret never travels either: the two ends prove it to each
// other when they connect, and each connection derives its record keys
// from it and both ends' fresh nonces (record/codec.h), so no key and
// nonce repeat however often an epoch connects.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace microd::transport {

class SealKeys {
 public:
  // A link's salt: exactly this many bytes.
  static constexpr size_t kSaltBytes = 32;

  // Node `self`'s keys in `epoch`, from its `link_salts` (by peer rank: one
  // per node, kSaltBytes each but its own, which is empty; else refused:
  // keys of the job's secret alone would repeat from one run of a job to
  // the next) and the job's `secret` (the token's data-plane secret; empty
  // where TLS with certificates alone keeps the salts secret).
  static absl::StatusOr<std::unique_ptr<SealKeys>> Derive(
      int self, const std::vector<std::string>& link_salts, absl::string_view secret,
      absl::string_view job_id, uint64_t epoch);

  // The secret of the link between nodes `a` and `b` (the same at both
  // ends; 32 bytes). InvalidArgument unless one of them is this node.
  absl::StatusOr<std::string> LinkSecret(int a, int b) const;

  int self() const { return self_; }
  int nodes() const { return static_cast<int>(links_.size()); }
  uint64_t epoch() const { return epoch_; }

 private:
  SealKeys(int self, uint64_t epoch) : self_(self), epoch_(epoch) {}

  const int self_;
  const uint64_t epoch_;
  std::vector<std::string> links_;  // by peer rank
};

}  // namespace microd::transport
