// SPDX-License-Identifier: Apache-2.0
// What a backend knows of its links, measured on them: the time of one
// direct round (every rank sends a few bytes to every peer at once) and the
// bytes per second one rank sends (to all its peers together). From these
// follow the cost of a direct round of any size and of the allreduce
// schedules, and so which one a collective of a given size takes. Every rank
// of a group must hold the same model (Combine), so that they all decide
// alike.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace microd::transport {

struct LinkModel {
  // A direct round of a few bytes whose receives were not posted ahead (a
  // sender waits for the receiver's notice: about a round trip), and one
  // whose receives were (Transport::Expect: about a one-way trip).
  double round_seconds = 50e-6;
  double posted_round_seconds = 25e-6;
  double bytes_per_second = 1e9;  // one rank's sending rate, to every peer together
  int ranks = 1;
  int connections = 1;  // per pair of ranks (large allreduces use them all)

  // One direct round, posted ahead: `bytes` from every rank to each peer.
  double DirectSeconds(size_t bytes) const;
  // An allreduce of `bytes` as a reduce-scatter and an allgather, every
  // transfer of a phase at once (two rounds not posted ahead, 2 (n - 1) / n
  // of the bytes).
  double TwoPhaseSeconds(size_t bytes) const;
  // A direct round of the bytes (posted ahead), summed on every rank, costs
  // no more than the two-phase allreduce.
  bool DirectCheaper(size_t bytes) const;
  // The part of a direct round's message that travels in its first
  // transfer (the rest follows in a second): about what the link carries
  // in one round's time, between 64 KiB and 4 MiB, a multiple of 4 KiB.
  size_t InlineBytes() const;
  // The slowest of each: the model every rank then uses.
  static LinkModel Combine(const std::vector<LinkModel>& models);
};

// A model given instead of measured (microd --link_model), as
// "round_ms=R,posted_ms=P,mb_per_s=B": a direct round's milliseconds, the
// same with the receives posted ahead (optional: R / 2, at most R), and one
// node's sending rate in MB/s (10^6 bytes). Where the start-up probes would
// be misled (a machine busy while the daemons start) or the link is known.
absl::StatusOr<LinkModel> ParseLinkModel(absl::string_view text);
std::string FormatLinkModel(const LinkModel& model);

}  // namespace microd::transport
