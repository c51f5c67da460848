// SPDX-License-Identifier: Apache-2.0
// Runs the steps of a batch on this node: the fused dense allreduce of its
// small buckets, the sparsified step of each large one, and the write-back
// of buckets a cycle reduced itself; each Work is answered once, and the
// bucket's statistics updated.
//
// Failure model: a step that breaks the transport or the memory ends the
// job (JobControl::Fail); a NaN/Inf fails only that step (MICROD_ERR_NONFINITE
// on every node), or skips it under --nonfinite=skip (a zero update).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "daemon/control/control_plane.h"
#include "daemon/engine/engine_state.h"
#include "daemon/engine/negotiator.h"
#include "daemon/engine/options.h"
#include "daemon/engine/state_agreement.h"
#include "daemon/engine/step_memory.h"
#include "daemon/engine/timeline.h"
#include "daemon/sparsify/bucket.h"
#include "daemon/transport/transport.h"
#include "kernels/sparse_ops.h"

namespace microd::engine {

class StepRunner {
 public:
  // Everything must outlive the runner; it runs on the engine's thread.
  StepRunner(const EngineOptions& options, const control::Membership& membership,
             transport::Transport* transport, kernels::SparseOps* ops, StepMemory* memory,
             EngineState* state, JobControl* job)
      : options_(options),
        membership_(membership),
        transport_(transport),
        ops_(ops),
        memory_(memory),
        state_(state),
        job_(job) {}

  // An elastic job's next epoch: the steps to come use `transport` (engine
  // thread, between plans; the membership is read through the reference
  // given at construction, which the engine updates).
  void SetTransport(transport::Transport* transport) { transport_ = transport; }
  // A node that joined a running job: the job's state of each bucket by
  // name (its step and threshold controller), which EnsureState gives the
  // bucket's state it makes, with a zero residual. Engine thread only.
  void Adopt(std::map<std::string, BucketStated> adopted) { adopted_ = std::move(adopted); }
  // The bucket's sparsifier state, made at its first step (or when a saved
  // state is loaded into it). Engine thread only.
  absl::Status EnsureState(Bucket& bucket);
  // The dense buckets of a batch, fused into one allreduce.
  void RunFusedDense(const std::vector<Work>& works);
  // The large buckets of a batch: those whose next step can be batched in
  // one BatchStep (a few rounds for all of them), the others one at a time
  // (first, in order); one at a time on the GPU.
  // `speculation`: the passes begun during the cycle (negotiator.h).
  void RunSparse(const std::vector<Work>& works,
                 std::shared_ptr<Speculation> speculation = nullptr);
  // The local passes of these cached buckets (ids ascending) that can be
  // batched, begun before the plan that runs them (on the negotiator's
  // thread, while the engine's waits in the cycle's exchange: nothing else
  // touches the runner's scratch or these buckets' state then).
  std::shared_ptr<Speculation> Speculate(const std::vector<size_t>& ids);
  // Buckets a cycle reduced itself: node r's local sum of works[k] is at
  // in_cycle.area[r * floats + at[k]]; the sum in node order, then the average.
  void FinishInCycle(const std::vector<Work>& works, const InCycle& in_cycle);
  // Where each step goes while the timeline records (may be null).
  void SetTimeline(Timeline* timeline) { timeline_ = timeline; }

  // A step whose every transfer arrived and verified but whose Confirm
  // failed, held with its works for the next epoch (JobControl::Hold): the
  // nodes that passed Confirm committed it, so this node may have to.
  // Engine thread only, between plans: RollForward commits it (the works
  // answered with their results; it returns them), DropUnconfirmed forgets
  // it (the state as before the step; the works stay held).
  bool has_unconfirmed() const { return unconfirmed_ != nullptr; }
  std::vector<Work> RollForward();
  void DropUnconfirmed();

 private:
  bool tracing() const { return timeline_ != nullptr && timeline_->recording(); }
  // One bucket's step on its own.
  void RunSparse(const Work& work);
  // The node's gradient of the work: staged in and summed over the local
  // processes (the process's buffer itself when there is one). False when
  // the memory failed (the work is answered and the job ends).
  bool Gradient(const Work& w, const float** grad, double* local_sum);
  absl::Status GradientOf(const Work& w, const float** grad, double* local_sum);
  // The speculation's step with only the batch's buckets, when it covers
  // them all (their times into local_sum and started); else null.
  std::unique_ptr<sparsify::BatchStep> Begun(const std::vector<const Work*>& batched,
                                             Speculation* speculation,
                                             std::vector<double>* local_sum,
                                             std::vector<absl::Time>* started);
  // Where the step writes the work's update (the process's buffer itself
  // when there is one).
  float* UpdateBuffer(const Work& w);
  // A step that succeeded: the update into every process's buffer, the
  // statistics, the timeline, the answer.
  void Deliver(const Work& w, const sparsify::StepStats& st, const float* update, double local_sum,
               absl::Time t0);
  // A step's error: true when it is the work's alone (a NaN/Inf, answered
  // here); false when it fails the job (counted; the caller answers).
  bool StepError(const Work& w, const absl::Status& s);
  // A step hit a NaN/Inf: answers the work per --nonfinite (fail or skip).
  void NonFinite(const Work& w, const absl::Status& status);
  // A memory failure fails the job (the other nodes are in the step).
  void MemoryFailed(const std::vector<const Work*>& works, const absl::Status& s);
  void MemoryFailed(const std::vector<Work>& works, const absl::Status& s);
  // A failure of the step (the transport, the state): the job ends.
  void StepFailed(const std::vector<Work>& works, absl::Status s);
  // The step's Confirm failed (`s`) after every transfer verified: held
  // (has_unconfirmed) when the job goes on, `commit` its rest and `drop`
  // what undoes the step's part done (may be null); else StepFailed.
  void Unconfirmed(const std::vector<Work>& works, const absl::Status& s,
                   std::function<void()> commit, std::function<void()> drop);
  // A batched step's buckets once it ran: each one's update delivered.
  void FinishBatch(sparsify::BatchStep& step, const std::vector<Work>& works,
                   const std::vector<double>& local_sum, const std::vector<absl::Time>& started);
  // The rest of a fused dense step once Confirm passed: `skipped` the
  // NaN/Inf verdict (ok: none), t0/t1 when the local sums began and ended.
  void FinishFusedDense(const std::vector<Work>& works, uint64_t total, const absl::Status& skipped,
                        absl::Time t0, absl::Time t1);
  void FinishInCycleConfirmed(const std::vector<Work>& works, const InCycle& in_cycle);
  // Copies `count` floats in ops_'s memory; fills with zeros when `src` is null.
  absl::Status CopyFloats(float* dst, const float* src, uint64_t count);
  absl::Status KernelCall(kernels::KernelStatus k, const char* what) const;
  absl::Status StageIn(const Work& w, absl::Time deadline);
  // Sums the local gradients of `works` into fusion_ (and counts NaN/Inf).
  absl::Status LocalSums(const std::vector<Work>& works, absl::Time deadline, uint64_t* nonfinite);
  // Sums one fused allreduce of `total` floats (+ the NaN/Inf flag), then
  // Confirm (`*confirming`: every transfer before it arrived); `*skipped`
  // the NaN/Inf error naming the nodes when some node saw one.
  absl::Status ReduceFused(const std::vector<Work>& works, uint64_t total, uint64_t nonfinite,
                           absl::Status* skipped, bool* confirming);
  // Which nodes saw a NaN/Inf (one allgather): `*verdict` names them.
  absl::Status NamedNonFinite(const std::vector<Work>& works, uint64_t nonfinite,
                              transport::CollectiveOptions o, absl::Status* verdict);
  // The average back into every process's buffer.
  absl::Status WriteBackFused(const std::vector<Work>& works, uint64_t total);
  // Momentum correction of a dense bucket: `average` (its `count` floats in
  // ops_'s memory) becomes the new velocity beta * u + average, the update
  // momentum SGD would make. Nothing with the correction off, or for a
  // bucket registered MICROD_BUFFER_DENSE (averaged exactly, as asked).
  absl::Status DenseMomentum(Bucket& b, float* average);

  const EngineOptions& options_;
  const control::Membership& membership_;
  transport::Transport* transport_;  // the current epoch's (SetTransport)
  std::map<std::string, BucketStated> adopted_;
  kernels::SparseOps* const ops_;
  StepMemory* const memory_;
  EngineState* const state_;
  JobControl* const job_;
  Timeline* timeline_ = nullptr;
  uint32_t next_slot_ = 1;  // transport tag slots; 0 is the fused dense buffer
  // Scratch buffers (device memory of ops_).
  sparsify::DeviceBuffer<float> fusion_;
  sparsify::DeviceBuffer<kernels::StepScalars> scalars_;
  struct Held {
    std::vector<Work> works;
    std::function<void()> commit;
    std::function<void()> drop;
  };
  std::unique_ptr<Held> unconfirmed_;
};

}  // namespace microd::engine
