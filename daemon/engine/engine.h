// SPDX-License-Identifier: Apache-2.0
// The daemon's engine. A bucket is ready on this node when every local
// process submitted it (process_table.h); the nodes agree on what to run
// (negotiator.h: through the coordinator's schedule log, and with the
// response cache through cycles over the transport); the engine's thread
// runs each plan (step_runner.h: the local sum, the sparsified step with
// the small buckets of a batch fused into one dense allreduce, the
// write-back into every local buffer, the completions), on host memory or
// on the GPU (step_memory.h).
//
// Small dense buckets ride in the cycle (EngineOptions::cycle_floats): each
// node puts its local sum of the ones ready here into its cycle message, so
// a bucket every node sent is reduced by the cycle's allgather itself (the
// sum in node order, the very bits of the fused dense allreduce), one round
// instead of two. A bucket ready everywhere that some node could not send
// (a NaN/Inf there, a CUDA buffer) takes the usual path (a fused dense
// allreduce after the cycle). Under --nonfinite=skip this means a NaN/Inf
// skips only its own bucket's step where the fused path would skip every
// bucket fused with it.
//
// Failure model: a process that vanishes, a step that breaks the transport,
// or a failure the coordinator reports ends the job: every pending and later
// submission completes with MICROD_ERR_JOB_FAILED and the reason. A NaN/Inf
// in a gradient fails only that step (MICROD_ERR_NONFINITE on every node).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "daemon/control/control_plane.h"
#include "daemon/engine/checkpoint.h"
#include "daemon/engine/engine_state.h"
#include "daemon/engine/negotiator.h"
#include "daemon/engine/options.h"
#include "daemon/engine/recovery.h"
#include "daemon/engine/state_agreement.h"
#include "daemon/engine/stats.h"
#include "daemon/engine/step_memory.h"
#include "daemon/engine/step_runner.h"
#include "daemon/local/local_server.h"
#include "daemon/transport/transport.h"
#include "kernels/sparse_ops.h"

namespace microd::engine {

class Engine final : public local::LocalHandler, private JobControl, private StateHolder {
 public:
  // `client` (negotiation), `transport` and `ops` must outlive the engine.
  Engine(EngineOptions options, control::Membership membership, control::ControlPlane* client,
         transport::Transport* transport, kernels::SparseOps* ops);
  ~Engine() override;

  // Where completions go; set before Start.
  void SetServer(local::LocalServer* server) { server_ = server; }
  // Where steps go while it records (timeline.h); set before Start.
  void SetTimeline(Timeline* timeline) { runner_.SetTimeline(timeline); }
  void Start();
  // Fails everything pending and stops the loop.
  void Stop(const absl::Status& reason);
  // Ends the job on this node (and tells the coordinator when `report`).
  // A failure soon after this process was held past half the peer timeout
  // says so first (WithHold).
  void Fail(const absl::Status& failure, bool report) override;
  // An elastic job's next membership epoch, as the coordinator told this
  // node (its membership there, and what changed): the engine ends what
  // runs on the old data plane and reconfigures on its thread (Reconfigure).
  void OnMembership(const control::Membership& membership, const std::string& change);

  absl::StatusOr<local::ProcessInfo> OnHello(uint64_t client, int requested_local_rank,
                                             pid_t pid) override;
  absl::Status OnRegister(uint64_t client, uint32_t buffer_id, const std::string& name, bool dense,
                          std::shared_ptr<local::ProcessBuffer> buffer) override;
  absl::Status OnSubmit(uint64_t client, uint32_t buffer_id, uint64_t ticket,
                        std::optional<uint32_t> changes_seen) override;
  void OnDisconnect(uint64_t client, bool clean, const std::string& why) override;
  // microd_state_save / microd_state_load: answered once every local
  // process asked the same, after the node's file is written or read
  // (state_io.cc).
  absl::Status OnState(uint64_t client, bool save, local::StateDirectory dir,
                       uint64_t ticket) override;
  // What a process's buffer waits for: the process table's account, and,
  // for a bucket ready here, the coordinator's report of the other nodes.
  std::string OnWaiting(uint64_t client, uint32_t buffer_id) override;

  // Statistics of every bucket; the per-step histories only if asked for.
  EngineSnapshot Snapshot(bool with_history = false) const;
  // Buckets some local process submitted at least `at_least` ago that have
  // not run, longest first (at most `limit`), with the local processes that
  // have not submitted them: what the heartbeats tell the stall inspector.
  std::vector<control::BucketWait> Waiting(absl::Duration at_least, size_t limit = 64) const;

 private:
  // `reason`, preceded by this node's hold if it was held (HoldMonitor)
  // past half the peer timeout within the peer timeout and 5 s: the other
  // nodes then gave up on it, whatever error came first here.
  absl::Status WithHold(const absl::Status& reason) const;
  // JobControl.
  absl::Status WithRootCause(const absl::Status& local) override;
  void Finish(const Work& work, const absl::Status& status) override;
  bool Hold(const std::vector<Work>& works, const absl::Status& why) override;
  bool recovering() const override { return recovery_.recovering(); }
  // Elastic: on the engine's thread, once recovering: waits for the next
  // epoch's membership (or the job's failure, or recover_until), connects
  // its data plane, checks that every node holds its buckets at the same
  // step, re-cuts the partitions (BucketState::SetJob), starts the schedule
  // afresh and completes every pending submission with
  // MICROD_ERR_MEMBERSHIP, each process told its place first.
  void Reconfigure();
  // What a local process is told of its place in the current membership.
  // A submission refused by the fence (MICROD_WIRE_CAP_FENCE).
  absl::Status FencedStatus(const std::string& bucket) const;
  local::ProcessInfo InfoOf(int local_rank) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_.mu);
  // The negotiator of the current epoch's membership and data plane.
  std::unique_ptr<Negotiator> NewNegotiator();
  // The current epoch's data plane (kept alive until the engine goes).
  transport::Transport* CurrentTransport() const;

 public:
  // The engine owns the data plane it was given from now on (`t` is it):
  // released once two later epochs run.
  void AdoptTransport(std::unique_ptr<transport::Transport> t);
  // Data planes this engine holds now (the current one, and the one before
  // it after a change): at most 2.
  int transports_held() const;

 private:
  absl::Status Reconfigured(const control::Membership& next, const std::string& change,
                            std::vector<Work>* pending);
  // The epoch running: every local process told its place (`change`: what
  // changed), then the fenced submissions and the `pending` ones answered.
  void Announce(const std::string& change, const std::vector<Work>& pending);
  // StateHolder: what the first rounds of an epoch (AgreeOnState) read
  // of this node's state and change in it. Engine thread, between plans.
  std::vector<BucketStated> Buckets() override;
  uint64_t Confirmed() override;
  bool HasUnconfirmed() override;
  void Settle(bool commit) override;
  void Adopt(std::map<std::string, BucketStated> buckets, uint64_t confirmed) override;

  // Answers the work's submissions (once).
  void Complete(const Work& w, const absl::Status& status);
  // The engine's thread: takes plans and runs them.
  void Loop();
  void Run(Plan& plan);
  // `cached`: a batch of cached buckets agreed in a cycle, not from the log.
  // `speculation`: the passes of its buckets begun during the cycle.
  void RunBatch(const control::ScheduleBatch& batch, bool cached,
                std::shared_ptr<Speculation> speculation = nullptr);
  void RunInCycle(const InCycle& in_cycle, bool count_batch);
  // Reads the coordinator's schedule log into EngineState::schedule, from
  // batch `next` on.
  void PollLoop(uint64_t next);
  // A state request every local process made, run between plans
  // (state_io.cc); the answer for each process.
  void RunStateRequest();
  void AnswerStateRequest(const StateRequest& request, const absl::Status& status);
  absl::Status SaveState(const StateRequest& q);
  absl::Status LoadState(const StateRequest& q);
  // What saved state records of this job (checkpoint.h), buckets aside.
  microd::v1::NodeCheckpoint CheckpointShape() const;

  const EngineOptions options_;
  // This node's membership: changed (under state_.mu) only on the engine's
  // thread, between plans, when an elastic job's epoch changes.
  control::Membership membership_;
  control::ControlPlane* const client_;
  transport::Transport* transport_;  // the current epoch's data plane
  // Owners of the current epoch's data plane and the one before (whose
  // pointer a thread may still hold in its last Abort); an older one is
  // released when an epoch begins: its connections, threads and memory go,
  // however many epochs a job goes through. The first is the caller's
  // unless it hands it over (AdoptTransport). Under state_.mu.
  std::shared_ptr<transport::Transport> current_;
  std::shared_ptr<transport::Transport> previous_;
  // The next epoch's data plane while its first rounds run (Reconfigured):
  // Fail aborts it too, so a stop does not wait out their deadline on
  // peers that are gone.
  std::shared_ptr<transport::Transport> connecting_ ABSL_GUARDED_BY(state_.mu);
  // What the current data plane's owner is, for a thread that calls into it
  // outside state_.mu (an abort).
  std::shared_ptr<transport::Transport> CurrentOwner() const;
  kernels::SparseOps* const ops_;
  local::LocalServer* server_ = nullptr;
  // This node joined the running job: its first data plane is its epoch's,
  // where it takes the job's state before any step.
  const bool joining_;
  bool adopted_ = false;  // ...and took it (engine thread only)

  EngineState state_;
  // Sealed transfers refused on the data planes of earlier epochs.
  uint64_t refused_before_ ABSL_GUARDED_BY(state_.mu) = 0;
  // Steps confirmed before the current data plane's (Transport::confirmed):
  // on the earlier ones, adopted when joining, or rolled forward.
  uint64_t confirmed_before_ ABSL_GUARDED_BY(state_.mu) = 0;
  Recovery recovery_;  // its own lock, taken after state_.mu if both
  const std::unique_ptr<StepMemory> memory_;
  StepRunner runner_;
  std::unique_ptr<Negotiator> negotiator_;  // made at Start
  std::thread thread_;
  std::thread poll_thread_;
};

}  // namespace microd::engine
