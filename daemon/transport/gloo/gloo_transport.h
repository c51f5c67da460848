// SPDX-License-Identifier: Apache-2.0
// Gloo backend of transport.h (CPU, TCP): Gloo's API over microd's own
// device (record/device.h), which authenticates every connection and, with
// keys, seals every byte. Only the factory is public.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/rendezvous/kv_store.h"
#include "daemon/transport/link_model.h"
#include "daemon/transport/seal.h"
#include "daemon/transport/transport.h"

namespace microd::transport {

struct GlooOptions {
  int rank = 0;
  int size = 1;
  // Rendezvous medium (the coordinator's key-value store); must outlive the
  // transport's creation.
  rendezvous::KeyValueStore* store = nullptr;
  // Keys are prefixed with this, so several groups can rendezvous at once.
  // The coordinator takes the data plane's keys of its current epoch only
  // ("gloo/e<epoch>"): epoch 0's by default.
  std::string prefix = "gloo/e0";
  // Address to listen on for peers (this node's address as others reach it).
  std::string hostname = "127.0.0.1";
  // Bound for creating the full mesh, and for calls made without a deadline.
  absl::Duration timeout = absl::Seconds(60);
  // Nice value added to the data plane's network threads (0 to 19; 0
  // leaves them): where processes outnumber cores (several daemons on one
  // machine) a positive value lets the thread a collective waits for run
  // first. Leave it at 0 where training processes keep every core busy:
  // the network threads would then get little CPU.
  int io_nice = 0;
  // Connections per pair of ranks, each a full mesh of its own: large
  // allreduces are cut into one part per connection, all at once (on long
  // links one connection cannot fill the link). 0: 4 where a round takes
  // 2 ms or more (measured at creation), else 1.
  int connections = 0;
  // The link model every rank's choices follow, given instead of measured
  // at creation (each rank still takes the slowest of all ranks' models).
  std::optional<LinkModel> link_model;
  // How long connecting (the rendezvous, the links' measure) may take;
  // zero: `timeout`. An elastic job's next data plane waits no longer than
  // a lost member takes to be found (then the next epoch's is connected).
  absl::Duration connect_timeout = absl::ZeroDuration();
  // Keys of this epoch's data plane: every connection authenticated by its
  // link's secret and every byte on it, from the links' measure on, sealed
  // (record/codec.h); a record that fails verification fails the call with
  // DataLoss naming the link (and breaks the transport). Null: connections
  // are authenticated by the rendezvous alone and records go unsealed.
  std::shared_ptr<const SealKeys> seal;
  // Transport::Confirm takes a round (elastic jobs, --seal_failure=step);
  // else nothing.
  bool confirm = false;
  // Called on the calling thread as each collective begins, with its tag
  // and `peers` 0, and in a direct round (ExchangeRound) again after its
  // message went to each peer, with how many have it (null: nothing). The
  // seam the end-to-end tests lose a node through (daemon/test_hooks.h);
  // while it is set, a direct round sends to one peer at a time.
  std::function<void(uint32_t tag, int peers)> on_collective;
};

// Connects the full mesh (blocking until every rank arrived or the timeout).
// Sets SIGPIPE to ignored if it still has its default action, so that a peer
// that died makes calls fail instead of killing this process.
absl::StatusOr<std::unique_ptr<Transport>> CreateGlooTransport(const GlooOptions& options);

}  // namespace microd::transport
