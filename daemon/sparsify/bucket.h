// SPDX-License-Identifier: Apache-2.0
// The per-bucket state of a node (residual e, threshold controller, step
// counter t) and the step of docs/design.md section 1 for every sparsifier,
// written against kernels/sparse_ops.h and daemon/transport/transport.h.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "daemon/sparsify/controller.h"
#include "daemon/sparsify/device_buffer.h"
#include "daemon/sparsify/options.h"
#include "daemon/transport/transport.h"
#include "kernels/sparse_ops.h"

namespace microd::sparsify {

struct BucketSpec {
  std::string name;   // for messages
  uint64_t size = 0;  // d, fp32 elements, 1 <= d < 2^32
  uint32_t slot = 0;  // distinguishes this bucket's collectives (transport tag)
  // The selected values' type on the wire (--wire_dtype=bucket: a bf16/fp16
  // bucket's own): each node's values rounded to it (what the rounding drops
  // stays in the residual), summed in fp32 and rounded once by the
  // transport. fp32: as computed.
  kernels::ElementType wire = kernels::ElementType::kFloat32;
};

// What one step did, as this node saw it.
struct StepStats {
  uint64_t step = 0;            // t of the step that ran
  uint64_t budget = 0;          // k
  uint64_t selected = 0;        // K_t: indices reduced (the union for topk/hard)
  uint64_t local_selected = 0;  // |I_r|
  uint64_t sum_of_counts = 0;   // sum over nodes of |I_r| (> K means build-up)
  std::vector<uint64_t> node_counts;
  double threshold = 0.0;       // threshold the selection used (0 for topk, dense)
  double cre = 0.0;             // |K / k - 1|
  uint64_t bytes_sent = 0;      // payload bytes this node handed to collectives
  uint64_t bytes_received = 0;  // payload bytes the collectives delivered from other nodes
  int rescans = 0;              // `hist` controller: extra passes over the partition
  // Communication rounds the step waited through (Transport::rounds); a
  // batched step's are shared by every bucket of the batch.
  uint64_t rounds = 0;
  // Times the host waited for the device during the step: the kernel
  // backend's waits (SparseOps::host_waits) and the transport's.
  uint64_t host_waits = 0;
  bool clipped = false;  // local clipping scaled this node's gradient
  bool dense = false;
  // Where the time went: selection (fused pass, threshold control, trim),
  // exchange (index allgather, gather, value allreduce or the dense
  // allreduce), apply (scatter-average into the update, residual zeroing).
  double select_seconds = 0;
  double exchange_seconds = 0;
  double apply_seconds = 0;
};

// A bucket's state between two steps, as a checkpoint keeps it: a state
// loaded from it continues exactly (to the bit) as the saved one would.
struct BucketCheckpoint {
  uint64_t step = 0;
  std::vector<float> residual;  // d elements; empty for the dense sparsifier
  std::vector<float> velocity;  // d elements with momentum correction, else empty
  std::string controller;       // the threshold controller's state (micro), else empty
};

class BucketState {
 public:
  // The memory Create allocates for a bucket of `d` elements among
  // `num_nodes` nodes (residuals, velocities, candidates; the
  // step's small per-step buffers aside).
  static uint64_t MemoryBytes(uint64_t d, int num_nodes, const SparsifyOptions& options);
  // The memory this bucket holds now, every buffer counted (host or device,
  // wherever its backend allocates): what `microctl buckets` reports.
  uint64_t AllocatedBytes() const;
  // Validates everything and allocates the state (residual zero). `ops` must
  // outlive the bucket.
  static absl::StatusOr<std::unique_ptr<BucketState>> Create(const BucketSpec& spec,
                                                             const JobShape& job,
                                                             const SparsifyOptions& options,
                                                             kernels::SparseOps* ops);

  // One step: `grad` is this node's local sum g (d elements, device memory);
  // the averaged sparse update u is written to `update` (d elements; it may
  // be grad itself: grad is read completely before update is written).
  // Every node of the job must call Step for this bucket in the
  // same order. Blocks until done or `deadline`. On any error (including a
  // NaN/Inf in some node's gradient, reported on every node) the residual,
  // the threshold and t are unchanged and `update` is unspecified.
  absl::StatusOr<StepStats> Step(const float* grad, float* update, transport::Transport& transport,
                                 absl::Time deadline);

  // A step whose every transfer arrived and verified but whose last round,
  // the transport's Confirm, failed (a sealed data plane whose refusals fail
  // the step: other nodes may have committed it, or none): Step returned
  // Confirm's error and kept the rest of the step here, the state as
  // before it. `grad` and `update` must stay as they were until one of
  // these: RollForward commits it exactly as Step would have, writing
  // `update`; DropPending forgets it (the next Step does too).
  bool has_pending() const { return pending_ != nullptr; }
  absl::StatusOr<StepStats> RollForward();
  void DropPending();

  // A new membership (an elastic job's next epoch): the state this node
  // holds goes on unchanged (e, the velocity, t, the threshold, k), and
  // from the next step the partitions are cut for job.num_nodes and this
  // node owns ((t + job.node_rank) mod n). Between steps only. An error
  // (a bad shape, no memory) changes nothing.
  absl::Status SetJob(const JobShape& job);
  const JobShape& job() const { return job_; }

  const BucketSpec& spec() const { return spec_; }
  uint64_t step() const { return step_; }
  uint64_t budget() const { return k_; }
  // The residual e (device memory, d elements; null for dense).
  const float* residual() const { return residual_.get(); }
  // Between steps only (not while Step runs).
  absl::StatusOr<BucketCheckpoint> Save() const;
  // Replaces this state's (before its first step or between steps); an
  // error naming what does not fit (sizes, what the options keep).
  absl::Status Load(const BucketCheckpoint& checkpoint);
  // Whether Load would take it (changes nothing).
  absl::Status CheckCheckpoint(const BucketCheckpoint& checkpoint) const;
  // Threshold the next `micro` step's pass will use.
  double pass_threshold() const { return controller_ ? controller_->PassThreshold() : 0.0; }
  // The threshold controller's state (Save's `controller`), without the
  // residual's copy.
  std::string controller_state() const { return controller_ ? controller_->Save() : ""; }
  const SparsifyOptions& options() const { return options_; }

  // The phases of a sparse step, which BatchStep (batch_step.h) runs for
  // one bucket or many, and Step for this one alone (a batch of one): the
  // step written once. Select, then (hist) Rescan until the candidates
  // suffice, then Values at the indices every node's selection gave, then
  // Apply with the values summed over the nodes. Nothing before Apply
  // changes the state.
  //
  // Whether the next step can run in a batch: a sparse step (past the
  // warm-up) whose threshold controller, if any, is primed.
  bool Batchable() const;
  // This node's part of a step so far.
  struct Selection {
    StepStats stats;  // step, budget, clipped; the threshold (hist: the bound)
    // The read-only pass (gradient, scale, velocity): Values and Apply read
    // the accumulated values through it.
    kernels::FusedSelectArgs pass;
    uint64_t count = 0;      // indices selected (hist: candidates); 0 with a NaN/Inf
    uint64_t nonfinite = 0;  // NaN/Inf values the pass saw
    bool hist = false;       // candidates above `lower`; the threshold still to find
    float lower = 0;
    // The selection on the host, ascending: the bucket's own buffers on the
    // CPU backend (until the next phase), else the copies below.
    absl::Span<const uint32_t> index;
    absl::Span<const float> value;  // hist only
    std::vector<uint32_t> host_index;
    std::vector<float> host_value;
  };
  // The pass over `grad` (this node's gradient, which must hold the same
  // values until Apply). A kernel failure is returned.
  absl::StatusOr<Selection> Select(const float* grad);
  // hist: the pass again with a lower bound (too few candidates on all nodes).
  absl::Status Rescan(Selection& s, float lower);
  // What every node sends first: what decides the step's later rounds (the
  // step and the bits of the pass's threshold, which must agree on every
  // node) and its counts.
  struct Header {
    uint64_t count;
    uint64_t nonfinite;
    uint64_t step;
    uint64_t threshold_bits;
  };
  Header MakeHeader(uint64_t count, uint64_t nonfinite) const;
  // FailedPrecondition when the nodes are at different steps or thresholds
  // (states restored from checkpoints of different steps), a non-finite
  // error (ClientStatus kNonFinite) naming the nodes that saw a NaN/Inf.
  absl::Status CheckHeaders(const std::vector<Header>& headers) const;
  // What node r may send this step: the indices it selects from (its
  // partition under MiCRO, the whole bucket otherwise) and how many at most
  // (its largest share: any partition, the bucket, top-k's budget).
  Range SenderRange(int r) const;
  uint64_t SelectionBound() const;
  // The `hist` controller (null for any other).
  HistogramController* hist() const;
  // This node's values at `index` (I: every node's selection in rank order,
  // the sorted union for top-k and hard; K entries) written to `out` (host,
  // K elements of spec().wire: fp32, or rounded to bf16/fp16); I is kept
  // for Apply.
  absl::Status Values(const Selection& s, absl::Span<const uint32_t> index, void* out);
  // With `sums` (K elements of the wire's type: every node's values summed
  // in rank order, halves in fp32 and rounded once): the state committed,
  // the averaged update written to `update` (d elements; it may be the
  // gradient's buffer), the step advanced. An error changes nothing.
  absl::StatusOr<StepStats> Apply(Selection& s, uint64_t K, const void* sums, float* update);

 private:
  BucketState(const BucketSpec& spec, const JobShape& job, const SparsifyOptions& options,
              kernels::SparseOps* ops);
  absl::Status Allocate();
  absl::Status Check(kernels::KernelStatus status, const char* what) const;
  absl::StatusOr<kernels::StepScalars> ReadScalars() const;
  absl::StatusOr<std::vector<Header>> ExchangeHeaders(uint64_t count, uint64_t nonfinite,
                                                      transport::Transport& transport,
                                                      const transport::CollectiveOptions& options,
                                                      StepStats& stats);
  // The candidates' room for step `step` (by its density: O(k)).
  uint64_t RoomAt(uint64_t step) const;
  // The pass (`args` as PassArgs gave them, range and threshold set) with
  // the candidate buffers as its outputs; when it selects more than they
  // hold, they grow to hold it all and the pass runs again. `args` keeps
  // the outputs it ran with.
  absl::StatusOr<kernels::StepScalars> SelectPass(kernels::FusedSelectArgs& args);
  // A step's figures at the debug level (--log_level=debug).
  void LogStep(const StepStats& stats) const;
  // The rest of a step once Confirm passed (`confirmed`: when), or what a
  // failed Confirm leaves pending (`drop`: undoes what the step did before
  // it, if anything).
  using Rest = std::function<absl::StatusOr<StepStats>(absl::Time confirmed)>;
  absl::StatusOr<StepStats> Confirmed(transport::Transport& transport, absl::Time deadline,
                                      Rest rest, std::function<void()> drop = nullptr);

  // What the controller's collectives need: this step's transport, deadline,
  // budget and byte accounting, under the bucket's histogram tag.
  ControllerContext ControllerContextFor(transport::Transport& transport,
                                         const transport::CollectiveOptions& options,
                                         StepStats& stats) const;
  // The controller's first lower bound, from a sample of this step.
  absl::Status PrimeController(const float* grad, float grad_scale, Range part,
                               transport::Transport& transport,
                               const transport::CollectiveOptions& options, StepStats& stats);
  // A sparse step: the controller primed if it asks, then a batch of one.
  absl::StatusOr<StepStats> StepSparse(const float* grad, float* update, transport::Transport& t,
                                       absl::Time deadline);
  // The candidates (or selection) on the host, as Selection holds them.
  absl::Status CopySelection(Selection& s);
  // Local clipping: the factor the pass scales g by (1 unless its norm is too
  // large), folded into the pass: no clipped copy.
  absl::StatusOr<float> ClipScale(const float* grad, StepStats& stats);
  // Arguments of the step's read-only pass over `grad`: e + g (g scaled,
  // momentum correction folded in) selected and checked with nothing stored
  // (top-k: the sums stored into its scratch, which it selects from), so
  // that a step that fails leaves the state as it was; the caller sets the
  // selection range and threshold. The same arguments give the values
  // (GatherSum) and, once every node has agreed the step, Commit.
  kernels::FusedSelectArgs PassArgs(const float* grad, float grad_scale);
  // The step agreed (every collective done): e = e + g and the velocity
  // updated in place (the bits of the read-only pass), then e zeroed at
  // global_index_[0..K) (a bf16/fp16 wire: what rounding drops kept) and,
  // momentum factor masking, the velocity zeroed there. `pass.grad` must
  // still hold the gradient the pass read. The same pass zeroes `update`
  // (d elements; it may be the gradient's buffer): ScatterAverage then
  // only places the values.
  absl::Status Commit(const kernels::FusedSelectArgs& pass, uint64_t K, float* update);
  absl::StatusOr<StepStats> StepDense(const float* grad, float* update, transport::Transport& t,
                                      absl::Time deadline);
  // A dense step's exchange of `input` (the gradient, or the new velocity)
  // into `update`: the copy, the checked headers, the averaging allreduce.
  // `divided`: the backend averaged (else the sum is left to divide).
  absl::Status ReduceDense(const float* input, float* update, transport::Transport& transport,
                           absl::Time deadline, StepStats& stats, bool* divided);

  const BucketSpec spec_;
  JobShape job_;
  const SparsifyOptions options_;
  kernels::SparseOps* const ops_;
  void* const stream_ = nullptr;
  const uint64_t k_;
  std::unique_ptr<ThresholdController> controller_;  // micro only

  uint64_t step_ = 0;
  // One residual and one velocity (momentum correction): a step reads them
  // and writes them only in Commit, once every node has agreed the step.
  DeviceBuffer<float> residual_;
  DeviceBuffer<float> velocity_;
  // top-k only: the step's sums e + g, which the exact top-k selects from.
  DeviceBuffer<float> topk_sums_;
  // True while every bit of the residual is zero: no sparse step committed
  // (and no checkpoint loaded a nonzero one). The dense warm-up with
  // momentum correction then computes the new velocity into the residual's
  // buffer, which it does not use, and zeroes it again.
  bool residual_zero_ = true;
  // Else the warm-up's new velocity goes here, kept once the step succeeds
  // (swapped with velocity_); freed after the warm-up.
  DeviceBuffer<float> warmup_velocity_;
  // A pass's selection: room for O(k) (RoomAt), grown by
  // SelectPass when a pass selects more, back to the next step's (RoomAt) by
  // Commit once a step's passes (step_most_: the most one selected) fit it.
  DeviceBuffer<uint32_t> candidate_index_;
  DeviceBuffer<float> candidate_value_;
  uint64_t step_most_ = 0;
  DeviceBuffer<uint32_t> global_index_;
  DeviceBuffer<float> values_;
  DeviceBuffer<uint16_t> wire_values_;  // the values as sent, with a bf16/fp16 wire
  DeviceBuffer<kernels::StepScalars> scalars_;
  struct Pending {
    Rest rest;
    std::function<void()> drop;
    absl::Time confirm_failed;
  };
  std::unique_ptr<Pending> pending_;
};

}  // namespace microd::sparsify
