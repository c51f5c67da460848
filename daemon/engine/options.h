// SPDX-License-Identifier: Apache-2.0
// The engine's options, and the check that every node runs with the same.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/control/types.h"
#include "daemon/sparsify/bucket.h"
#include "daemon/transport/transport.h"

namespace microd::engine {

struct EngineOptions {
  std::string job_id = "microd";  // recorded in saved state (checkpoint.h)
  // Authenticates saved state (checkpoint.h: DeriveStateKey of the job's
  // secret); empty: the files are checksummed, not authenticated.
  std::string state_key;
  // The most the buckets' state may take on this node (process_table.h:
  // StateBudget; 0: no limit), and where that figure comes from.
  uint64_t state_budget = 0;
  std::string state_budget_source;
  int local_size = 1;
  sparsify::SparsifyOptions sparsify;
  // Buckets with fewer elements go dense, fused into one allreduce per batch.
  uint64_t dense_floor = 65536;
  absl::Duration op_timeout = absl::Seconds(60);
  // A node silent this long is lost (--peer_timeout_ms).
  absl::Duration peer_timeout = absl::Seconds(10);
  // How long a response-cache cycle waits for the other nodes to enter it
  // (a node enters only with work pending: its trainer may be busy, e.g.
  // saving a checkpoint). The stall inspector reports such waits long before.
  absl::Duration peer_wait = absl::Minutes(30);
  // A NaN/Inf in some node's gradient: fail the step (MICROD_ERR_NONFINITE on
  // every node) or skip it (every process gets a zero update, counted).
  bool skip_nonfinite = false;
  // Sparse steps kept per bucket for the per-step history (0: none).
  size_t stats_history = 1024;
  // Negotiate buckets scheduled once over the data plane (engine.h).
  bool response_cache = true;
  // Response cache: room in a cycle's message for small dense buckets, in
  // floats per node (0: none). The cached dense buckets, in cache id order,
  // that fit in it ride in the cycle (engine.h).
  uint64_t cycle_floats = 4096;
  // The step runs on the GPU (ops are a GPU backend on CUDA ordinal
  // `device`, the transport takes device memory): CUDA buffers are read and
  // written in place (no host staging), after their ready event; every
  // buffer must be a CUDA buffer on that GPU (others are refused at
  // registration). Off: the step runs on host memory and CUDA buffers are
  // staged through it (step_memory.h).
  bool device_resident = false;
  int device = 0;
  // --wire_dtype=bucket: the selected values of a bf16/fp16 sparse bucket
  // travel in its own type (half the value bytes; sparsify::BucketSpec::wire).
  bool wire_bucket_dtype = false;
  // Elastic membership (--min_nodes below --nodes): a step that fails on
  // the data plane holds its submissions for up to `membership_wait`,
  // waiting for the coordinator's verdict: the next membership epoch (the
  // engine then connects the survivors' data plane with `new_transport`,
  // re-cuts the partitions and completes every pending submission with
  // MICROD_ERR_MEMBERSHIP) or the job's failure.
  bool elastic = false;
  absl::Duration membership_wait = absl::Seconds(30);
  // --seal_failure=step (elastic jobs, a sealed data plane): a transfer that
  // fails verification fails the step on every node, which the coordinator
  // answers with the next epoch (the same members, fresh keys and
  // connections); else it fails the job.
  bool seal_failure_step = false;
  std::function<absl::StatusOr<std::unique_ptr<transport::Transport>>(const control::Membership&)>
      new_transport;
};

// Every node must run with the same step options (the collectives' sizes
// and the results depend on them): one fixed-size allgather of this node's
// options over `transport`; InvalidArgument naming the first option that
// differs and the nodes it differs on. Call before the engine starts (it
// uses the control tag), on every node.
absl::Status CheckOptionsAgree(transport::Transport& transport, const EngineOptions& options,
                               absl::Time deadline);
// The same options as "--flag=value" lines (what a node that joins a running
// job presents to the coordinator; enumerations by their number).
std::string OptionsText(const EngineOptions& options);

}  // namespace microd::engine
