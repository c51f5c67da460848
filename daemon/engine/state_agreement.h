// SPDX-License-Identifier: Apache-2.0
// The first rounds on a new membership epoch's data plane, before any step:
// every node states the state it holds (each bucket's step and threshold
// controller, the steps it confirmed), and the nodes that were in the job
// must hold the same; a node that joins takes it. A step left unconfirmed
// somewhere (--seal_failure=step: a Confirm refused) is settled first,
// alike on every node: committed where another node committed it (rolled
// forward), else dropped everywhere; then the nodes state again.
//
// The engine is the StateHolder; the rounds are ExchangeRounds on the
// epoch's transport, so the agreement runs as well on the in-process one
// (tests/engine/state_agreement_test.cc).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "daemon/control/types.h"
#include "daemon/transport/transport.h"

namespace microd::engine {

// A bucket's state as a node states it.
struct BucketStated {
  std::string name;
  uint64_t step = 0;
  std::string controller;  // the threshold controller's bytes
};

// What the agreement reads of this node's state and changes in it.
class StateHolder {
 public:
  virtual ~StateHolder() = default;
  // The buckets this node holds a state of (any order).
  virtual std::vector<BucketStated> Buckets() = 0;
  // The steps this node confirmed (Transport::confirmed, every epoch's).
  virtual uint64_t Confirmed() = 0;
  // Whether it holds a step whose Confirm failed here.
  virtual bool HasUnconfirmed() = 0;
  // That step committed (another node committed it: confirmed one more)
  // or dropped (no node did).
  virtual void Settle(bool commit) = 0;
  // A joining node: the job's state of each bucket by name, and the steps
  // the job confirmed.
  virtual void Adopt(std::map<std::string, BucketStated> buckets, uint64_t confirmed) = 0;
};

// The agreement on `t` (the epoch `m`'s data plane; this node joins when
// `joining`). Errors: FailedPrecondition when the nodes of the job hold
// different states (naming the node and both states) or no node holds
// the job's state for a joining one; DataLoss for a statement that does
// not parse (naming its node); the transport's own.
absl::Status AgreeOnState(transport::Transport& t, const control::Membership& m, bool joining,
                          absl::Duration timeout, StateHolder& holder);

}  // namespace microd::engine
