// SPDX-License-Identifier: Apache-2.0
// How the nodes agree on what to run next: a plan of schedule batches from
// the coordinator's log, and (with the response cache) cached buckets ready
// on every node, some of them reduced by the agreement itself.
//
// Through the coordinator (no response cache): buckets newly ready here are
// reported; the schedule log's batches run in log order.
//
// Through cycles (the response cache): a bucket the coordinator scheduled
// once has a cache id, the same on every node (ids follow the schedule log).
// Later submissions of it skip the coordinator: each cycle is an allgather
// over the transport of a CycleMessage (cycle_message.h: how many schedule
// batches this node has received, its ready cached buckets, and its local
// sums of the small dense ones); every node then runs the schedule batches
// up to the least received, then the cached buckets ready everywhere, in id
// order. Buckets not cached yet are reported to the coordinator by a thread
// of the negotiator's own. A node enters a cycle only with work pending; a
// cycle waits for the other nodes up to EngineOptions::peer_wait (peer
// failures end it through JobControl::Fail).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "daemon/control/control_plane.h"
#include "daemon/engine/engine_state.h"
#include "daemon/engine/options.h"
#include "daemon/sparsify/batch_step.h"
#include "daemon/sparsify/bucket.h"
#include "daemon/transport/transport.h"
#include "kernels/sparse_ops.h"

namespace microd::engine {

// Cached buckets the cycle reduced itself (cache ids, in order): node r's
// local sum of bucket ids[k] is at area[r * floats + at[k]].
struct InCycle {
  std::vector<size_t> ids;
  std::vector<uint64_t> at;
  std::vector<float> area;
  uint64_t floats = 0;
  absl::Time local_sum_start;
  double local_sum_seconds = 0;
  absl::Time exchange_start;
  double exchange_seconds = 0;
};

// A batched step begun while its cycle was on the wire: the local passes
// of the cached sparse buckets ready on this node, run beside the cycle's
// exchange (StepRunner::Speculate). The plan's step keeps those every node
// has ready (BatchStep::KeepOnly); a cycle then costs no time of its own
// where the passes take longer than its round.
struct Speculation {
  std::unique_ptr<sparsify::BatchStep> step;
  std::vector<size_t> ids;        // cache ids, in the step's order
  std::vector<double> local_sum;  // seconds, by position in `ids`
  std::vector<absl::Time> started;
  absl::Status status;  // the passes failed: the plan runs without them
};
// Begins the batched step of these cached buckets (ids ascending).
using Speculator = std::function<std::shared_ptr<Speculation>(const std::vector<size_t>& ids)>;

// What to run, in this order.
struct Plan {
  std::vector<control::ScheduleBatch> batches;  // from the schedule log, in log order
  InCycle in_cycle;
  control::ScheduleBatch cached;             // cached buckets ready everywhere, not reduced yet
  std::shared_ptr<Speculation> speculation;  // the passes of `cached`'s buckets, if begun
  bool empty() const { return batches.empty() && in_cycle.ids.empty() && cached.scheduled.empty(); }
};

class Negotiator {
 public:
  virtual ~Negotiator() = default;
  // Waits (a second at most) for work here and agrees with the other nodes
  // on what to run; nullopt once the engine stops. An empty plan: nothing
  // now (idle, or the job failed: JobControl::Fail was told).
  virtual std::optional<Plan> Next() = 0;
  // Ends the negotiator's own threads (after EngineState::stop is set, or
  // before an elastic job's next epoch replaces the negotiator).
  virtual void Join() {}
};

// `client`, `transport`, `ops`, `state` and `job` must outlive it.
// `speculate` (optional): begins a cycle's batched step beside its exchange.
std::unique_ptr<Negotiator> MakeNegotiator(const EngineOptions& options,
                                           const control::Membership& membership,
                                           control::ControlPlane* client,
                                           transport::Transport* transport, kernels::SparseOps* ops,
                                           EngineState* state, JobControl* job,
                                           Speculator speculate = nullptr);

}  // namespace microd::engine
