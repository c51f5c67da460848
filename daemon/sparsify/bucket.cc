// SPDX-License-Identifier: Apache-2.0
#include "daemon/sparsify/bucket.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "daemon/common/log.h"
#include "daemon/common/status_macros.h"
#include "daemon/common/status_map.h"
#include "daemon/sparsify/batch_step.h"

namespace microd::sparsify {

using kernels::KernelStatus;
using transport::CollectiveOptions;
using transport::DataType;
using transport::MakeTag;
using transport::TagKind;

BucketState::BucketState(const BucketSpec& spec, const JobShape& job,
                         const SparsifyOptions& options, kernels::SparseOps* ops)
    : spec_(spec),
      job_(job),
      options_(options.ForBucket(spec.size)),
      ops_(ops),
      k_(Budget(options_.density, spec.size)) {
  if (options_.sparsifier == SparsifierKind::kMicro) {
    controller_ = CreateController(options_.controller, k_);
  }
}

absl::StatusOr<std::unique_ptr<BucketState>> BucketState::Create(const BucketSpec& spec,
                                                                 const JobShape& job,
                                                                 const SparsifyOptions& options,
                                                                 kernels::SparseOps* ops) {
  if (ops == nullptr) return absl::InvalidArgumentError("bucket: no kernel backend");
  if (spec.name.empty()) return absl::InvalidArgumentError("bucket: empty name");
  if (spec.size == 0) {
    return absl::InvalidArgumentError(absl::StrCat("bucket '", spec.name, "' has no elements"));
  }
  if (spec.size > kernels::kMaxBucketElements) {
    return absl::InvalidArgumentError(
        absl::StrCat("bucket '", spec.name, "' has ", spec.size,
                     " elements; a bucket holds fewer than 2^32 (indices are uint32): split it"));
  }
  if (spec.slot >= transport::kMaxTagSlots) {
    return absl::InvalidArgumentError(absl::StrCat("bucket slot ", spec.slot, " out of range"));
  }
  RETURN_IF_ERROR(options.Validate());
  RETURN_IF_ERROR(job.Validate());
  std::unique_ptr<BucketState> b(new BucketState(spec, job, options, ops));
  RETURN_IF_ERROR(b->Allocate());
  return b;
}

namespace {

// The most a node of a bucket of `d` elements may select in a step: its
// largest share.
uint64_t SelectionBoundOf(uint64_t d, int num_nodes, const SparsifyOptions& o) {
  switch (o.sparsifier) {
    case SparsifierKind::kMicro:
      return PartitionRange(d, num_nodes, 0).size();  // partition 0 is the largest
    case SparsifierKind::kHard:
      return d;
    case SparsifierKind::kTopK:
      // The largest budget of the schedule.
      return std::min(Budget(std::max(o.density, o.warmup_density), d), d);
    case SparsifierKind::kDense:
      break;
  }
  return 0;
}

// The candidates a bucket keeps room for at a step of `density`, sized by
// its k, not by d: the hist controller's lower bound keeps about
// kCandidateMargin * k candidates over every node, and one node may hold
// them all; twice that, and a floor for small buckets. top-k selects
// exactly k. A pass that selects more grows the room (SelectPass).
uint64_t CandidatesOf(uint64_t d, int num_nodes, const SparsifyOptions& o, double density) {
  const uint64_t bound = SelectionBoundOf(d, num_nodes, o);
  const uint64_t k = Budget(density, d);
  if (o.sparsifier == SparsifierKind::kTopK) return std::max<uint64_t>(std::min(bound, k), 1);
  constexpr uint64_t kFloor = 1024;
  return std::max<uint64_t>(
      std::min(bound, std::max(2 * HistogramController::kCandidateMargin * k, kFloor)), 1);
}

// The room at step `step`: a dense warm-up step selects nothing, so the
// first sparse step's room. The density only falls after it (the warm-up's
// decay): step 0's room is the most a bucket ever starts a step with.
uint64_t RoomOf(uint64_t d, int num_nodes, const SparsifyOptions& o, uint64_t step) {
  return CandidatesOf(d, num_nodes, o, o.DensityAt(o.SparseFrom(step)));
}

}  // namespace

uint64_t BucketState::SelectionBound() const {
  return SelectionBoundOf(spec_.size, job_.num_nodes, options_);
}

uint64_t BucketState::RoomAt(uint64_t step) const {
  return RoomOf(spec_.size, job_.num_nodes, options_, step);
}

absl::StatusOr<kernels::StepScalars> BucketState::SelectPass(kernels::FusedSelectArgs& args) {
  // Room for `room` candidates (the old contents dropped), for `wanted`.
  auto make_room = [&](uint64_t room, uint64_t wanted) -> absl::Status {
    candidate_index_.Reset(ops_, room);
    candidate_value_.Reset(ops_, room);
    if (candidate_index_.ok() && candidate_value_.ok()) return absl::OkStatus();
    return absl::ResourceExhaustedError(
        absl::StrCat("bucket '", spec_.name, "': out of memory for ", wanted, " candidates"));
  };
  // A growth that ran out of memory left no room: the first room again.
  if (!candidate_index_.ok() || !candidate_value_.ok()) {
    const uint64_t room = RoomAt(step_);
    RETURN_IF_ERROR(make_room(room, room));
  }
  for (int attempt = 0;; ++attempt) {
    args.out_index = candidate_index_.get();
    args.out_value = candidate_value_.get();
    args.out_capacity = candidate_index_.size();
    RETURN_IF_ERROR(Check(ops_->FusedAccumulateSelect(args, stream_), "fused selection"));
    ASSIGN_OR_RETURN(const kernels::StepScalars scalars, ReadScalars());
    if (scalars.nonfinite == 0) step_most_ = std::max(step_most_, scalars.count);
    if (scalars.nonfinite != 0 || scalars.count <= args.out_capacity) return scalars;
    if (attempt > 0) {
      return absl::InternalError(absl::StrCat("bucket '", spec_.name, "': the pass selected ",
                                              scalars.count, " values, then more"));
    }
    // More than there is room for: room for twice as many (the steps to
    // come select about as many; Commit gives it back once they fit the
    // first room again), and the pass again (it stores nothing).
    const uint64_t room = std::max(scalars.count, std::min(2 * scalars.count, SelectionBound()));
    RETURN_IF_ERROR(make_room(room, scalars.count));
  }
}

uint64_t BucketState::MemoryBytes(uint64_t d, int num_nodes, const SparsifyOptions& options) {
  if (options.sparsifier == SparsifierKind::kDense) return 0;
  const SparsifyOptions o = options.ForBucket(d);
  uint64_t floats = d;  // the residual
  // The velocity (a dense warm-up computes the new one into the residual's
  // buffer, all zero until the first sparse step).
  if (o.momentum > 0) floats += d;
  if (o.sparsifier == SparsifierKind::kTopK) floats += d;  // the sums top-k selects from
  const uint64_t candidates = RoomOf(d, num_nodes, o, 0);
  return floats * sizeof(float) + candidates * (sizeof(uint32_t) + sizeof(float));
}

uint64_t BucketState::AllocatedBytes() const {
  const uint64_t floats = candidate_value_.size() + values_.size() + residual_.size() +
                          velocity_.size() + topk_sums_.size() + warmup_velocity_.size();
  return floats * sizeof(float) +
         (candidate_index_.size() + global_index_.size()) * sizeof(uint32_t) +
         wire_values_.size() * sizeof(uint16_t) + scalars_.size() * sizeof(kernels::StepScalars);
}

Range BucketState::SenderRange(int r) const {
  if (options_.sparsifier != SparsifierKind::kMicro) return {0, spec_.size};
  const int n = job_.num_nodes;
  return PartitionRange(spec_.size, n, OwnedPartition(r, step_, n));
}

absl::Status BucketState::Allocate() {
  const uint64_t d = spec_.size;
  const uint64_t room = RoomAt(0);
  // One for the step's passes, then one per node for the check of its indices.
  scalars_.Reset(ops_, 1 + job_.num_nodes);
  bool ok = scalars_.ok();
  if (options_.sparsifier != SparsifierKind::kDense) {
    residual_.Reset(ops_, d);
    candidate_index_.Reset(ops_, room);
    candidate_value_.Reset(ops_, room);
    ok = ok && residual_.ok() && candidate_index_.ok() && candidate_value_.ok();
    if (options_.momentum > 0) {
      velocity_.Reset(ops_, d);
      ok = ok && velocity_.ok();
    }
    if (options_.sparsifier == SparsifierKind::kTopK) {
      topk_sums_.Reset(ops_, d);
      ok = ok && topk_sums_.ok();
    }
  }
  if (!ok) {
    return absl::ResourceExhaustedError(
        absl::StrCat("bucket '", spec_.name, "': out of memory for ", d, " elements"));
  }
  return absl::OkStatus();
}

absl::Status BucketState::SetJob(const JobShape& job) {
  if (absl::Status s = job.Validate(); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("bucket '", spec_.name, "': ", s.message()));
  }
  if (job.num_nodes != job_.num_nodes) {
    // The per-node scalars (one per node's index check) are sized by n;
    // the candidates' room follows on its own (SelectPass grows it,
    // Commit gives it back).
    DeviceBuffer<kernels::StepScalars> scalars(ops_, 1 + job.num_nodes);
    if (!scalars.ok()) {
      return absl::ResourceExhaustedError(
          absl::StrCat("bucket '", spec_.name, "': out of memory for ", job.num_nodes, " nodes"));
    }
    scalars_ = std::move(scalars);
  }
  job_ = job;
  return absl::OkStatus();
}

absl::Status BucketState::Check(KernelStatus status, const char* what) const {
  if (status == KernelStatus::kOk) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("bucket '", spec_.name, "': ", what, " kernel failed (",
                                          ops_->name(),
                                          "): ", kernels::KernelStatusString(status)));
}

absl::StatusOr<kernels::StepScalars> BucketState::ReadScalars() const {
  kernels::StepScalars s;
  RETURN_IF_ERROR(Check(ops_->CopyToHost(&s, scalars_.get(), sizeof s, stream_), "copy"));
  return s;
}

absl::StatusOr<StepStats> BucketState::Step(const float* grad, float* update,
                                            transport::Transport& transport, absl::Time deadline) {
  if (grad == nullptr || update == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("bucket '", spec_.name, "': null buffer"));
  }
  if (transport.size() != job_.num_nodes || transport.rank() != job_.node_rank) {
    return absl::FailedPreconditionError(absl::StrCat(
        "bucket '", spec_.name, "': transport is rank ", transport.rank(), " of ", transport.size(),
        " but the job says node ", job_.node_rank, " of ", job_.num_nodes));
  }
  DropPending();  // a step kept from an epoch before, not taken up
  const uint64_t waits_before = ops_->host_waits() + transport.host_waits();
  const uint64_t rounds_before = transport.rounds();
  // The warm-up's second velocity is not needed past it.
  const bool dense = options_.sparsifier == SparsifierKind::kDense || options_.DenseAt(step_);
  if (!dense && warmup_velocity_.ok()) warmup_velocity_ = DeviceBuffer<float>();
  absl::StatusOr<StepStats> stats = dense ? StepDense(grad, update, transport, deadline)
                                          : StepSparse(grad, update, transport, deadline);
  if (stats.ok()) {
    stats->host_waits = ops_->host_waits() + transport.host_waits() - waits_before;
    stats->rounds = transport.rounds() - rounds_before;
    if (dense) LogStep(*stats);  // Apply logs a sparse step's
  }
  return stats;
}

absl::StatusOr<StepStats> BucketState::StepSparse(const float* grad, float* update,
                                                  transport::Transport& transport,
                                                  absl::Time deadline) {
  StepStats prime;
  if (controller_ != nullptr && controller_->WantsPrime()) {
    const int n = job_.num_nodes;
    const Range part = PartitionRange(spec_.size, n, OwnedPartition(job_.node_rank, step_, n));
    ASSIGN_OR_RETURN(const float grad_scale, ClipScale(grad, prime));
    CollectiveOptions options;
    options.deadline = deadline;
    prime.budget = Budget(options_.DensityAt(step_), spec_.size);
    RETURN_IF_ERROR(PrimeController(grad, grad_scale, part, transport, options, prime));
  }
  auto batch = std::make_shared<BatchStep>(transport, deadline);
  RETURN_IF_ERROR(batch->Add(this, grad));
  if (absl::Status s = batch->Run(); !s.ok()) {
    if (batch->unconfirmed()) {
      pending_ = std::make_unique<Pending>(Pending{
          [batch, update](absl::Time) { return batch->Finish(0, update); }, nullptr, absl::Now()});
    }
    return s;
  }
  ASSIGN_OR_RETURN(StepStats stats, batch->Finish(0, update));
  stats.bytes_sent += prime.bytes_sent;
  stats.bytes_received += prime.bytes_received;
  return stats;
}

bool BucketState::Batchable() const {
  if (options_.sparsifier == SparsifierKind::kDense || options_.DenseAt(step_)) return false;
  return controller_ == nullptr || !controller_->WantsPrime();
}

HistogramController* BucketState::hist() const {
  if (controller_ == nullptr || !controller_->Refines()) return nullptr;
  return static_cast<HistogramController*>(controller_.get());
}

absl::StatusOr<BucketState::Selection> BucketState::Select(const float* grad) {
  Selection s;
  s.stats.step = step_;
  s.stats.budget = Budget(options_.DensityAt(step_), spec_.size);
  s.hist = hist() != nullptr;
  ASSIGN_OR_RETURN(const float grad_scale, ClipScale(grad, s.stats));
  s.pass = PassArgs(grad, grad_scale);
  switch (options_.sparsifier) {
    case SparsifierKind::kMicro: {
      const Range part = SenderRange(job_.node_rank);
      s.pass.select_begin = part.begin;
      s.pass.select_end = part.end;
      s.pass.threshold = s.lower = controller_->PassThreshold();
      break;
    }
    case SparsifierKind::kHard:
      s.pass.select_begin = 0;
      s.pass.select_end = spec_.size;
      s.pass.threshold = static_cast<float>(options_.hard_threshold > 0
                                                ? options_.hard_threshold
                                                : 1.0 / (2.0 * std::sqrt(static_cast<double>(k_))));
      break;
    case SparsifierKind::kTopK:
      s.pass.select_begin = s.pass.select_end = 0;  // top-k selects afterwards
      break;
    case SparsifierKind::kDense:
      return absl::InternalError(absl::StrCat("bucket '", spec_.name, "': not sparse"));
  }
  s.stats.threshold = s.pass.threshold;
  ASSIGN_OR_RETURN(kernels::StepScalars scalars, SelectPass(s.pass));
  s.nonfinite = scalars.nonfinite;
  if (s.nonfinite != 0) return s;
  if (options_.sparsifier == SparsifierKind::kTopK) {
    RETURN_IF_ERROR(Check(ops_->TopK(s.pass.acc, spec_.size, s.stats.budget, candidate_index_.get(),
                                     candidate_value_.get(), scalars_.get(), stream_),
                          "top-k"));
    ASSIGN_OR_RETURN(scalars, ReadScalars());
  }
  s.count = scalars.count;
  RETURN_IF_ERROR(CopySelection(s));
  return s;
}

absl::Status BucketState::Rescan(Selection& s, float lower) {
  // The pass again with the lower bound (nothing is stored: the sums are
  // recomputed; rescans are rare).
  kernels::FusedSelectArgs again = s.pass;
  again.threshold = s.lower = lower;
  ASSIGN_OR_RETURN(const kernels::StepScalars scalars, SelectPass(again));
  s.count = scalars.count;
  ++s.stats.rescans;
  return CopySelection(s);
}

absl::Status BucketState::CopySelection(Selection& s) {
  if (ops_->device() == kernels::Device::kCpu) {
    // Host memory already: read in place (nothing writes the candidates
    // before Values but a rescan, which comes back here).
    s.index = absl::MakeConstSpan(candidate_index_.get(), s.count);
    if (s.hist) s.value = absl::MakeConstSpan(candidate_value_.get(), s.count);
    return absl::OkStatus();
  }
  s.host_index.resize(s.count);
  RETURN_IF_ERROR(Check(ops_->CopyToHost(s.host_index.data(), candidate_index_.get(),
                                         s.count * sizeof(uint32_t), stream_),
                        "copy"));
  s.index = s.host_index;
  if (!s.hist) return absl::OkStatus();
  s.host_value.resize(s.count);
  RETURN_IF_ERROR(Check(ops_->CopyToHost(s.host_value.data(), candidate_value_.get(),
                                         s.count * sizeof(float), stream_),
                        "copy"));
  s.value = s.host_value;
  return absl::OkStatus();
}

absl::Status BucketState::Values(const Selection& s, absl::Span<const uint32_t> index, void* out) {
  const uint64_t K = index.size();
  const uint64_t room = std::max<uint64_t>(K, 1);
  const bool half = spec_.wire != kernels::ElementType::kFloat32;
  if (!global_index_.Fit(ops_, room) || !values_.Fit(ops_, room) ||
      (half && !wire_values_.Fit(ops_, room))) {
    return absl::ResourceExhaustedError(
        absl::StrCat("bucket '", spec_.name, "': out of memory for ", K, " values"));
  }
  RETURN_IF_ERROR(
      Check(ops_->CopyToDevice(global_index_.get(), index.data(), K * sizeof(uint32_t), stream_),
            "copy"));
  RETURN_IF_ERROR(
      Check(ops_->GatherSum(s.pass, global_index_.get(), K, values_.get(), stream_), "gather"));
  if (!half) {
    return Check(ops_->CopyToHost(out, values_.get(), K * sizeof(float), stream_), "copy");
  }
  // Rounded to the wire's type (Commit keeps what rounding drops).
  RETURN_IF_ERROR(Check(
      ops_->FloatToHalf(values_.get(), spec_.wire, K, wire_values_.get(), stream_), "rounding"));
  return Check(ops_->CopyToHost(out, wire_values_.get(), K * sizeof(uint16_t), stream_), "copy");
}

absl::StatusOr<StepStats> BucketState::Apply(Selection& s, uint64_t K, const void* sums,
                                             float* update) {
  const absl::Time start = absl::Now();
  if (spec_.wire == kernels::ElementType::kFloat32) {
    RETURN_IF_ERROR(
        Check(ops_->CopyToDevice(values_.get(), sums, K * sizeof(float), stream_), "copy"));
  } else {
    RETURN_IF_ERROR(
        Check(ops_->CopyToDevice(wire_values_.get(), sums, K * sizeof(uint16_t), stream_), "copy"));
    RETURN_IF_ERROR(Check(
        ops_->HalfToFloat(wire_values_.get(), spec_.wire, K, values_.get(), stream_), "widen"));
    // A sum past the type's range (fp16: 65504) is Inf on every node alike.
    RETURN_IF_ERROR(
        Check(ops_->CountNonFinite(values_.get(), K, scalars_.get(), stream_), "overflow check"));
    ASSIGN_OR_RETURN(const kernels::StepScalars overflow, ReadScalars());
    if (overflow.nonfinite != 0) {
      return absl::OutOfRangeError(
          absl::StrCat("bucket '", spec_.name, "' step ", step_, ": ", overflow.nonfinite,
                       " selected values overflow ", kernels::ElementTypeName(spec_.wire),
                       " on the wire (--wire_dtype=bucket); run with --wire_dtype=fp32"));
    }
  }
  // The state committed (e += g, zeroed at I), then the update: v / W at
  // I, zero elsewhere (it may be the gradient's buffer: after the commit).
  RETURN_IF_ERROR(Commit(s.pass, K, update));
  RETURN_IF_ERROR(Check(ops_->ScatterAverage(values_.get(), global_index_.get(), K,
                                             static_cast<float>(job_.world_size), update,
                                             spec_.size, /*out_zeroed=*/true, stream_),
                        "scatter"));
  ++step_;
  if (controller_ != nullptr) controller_->Commit(K, s.stats.budget);
  s.stats.selected = K;
  s.stats.cre = std::fabs(static_cast<double>(K) / static_cast<double>(s.stats.budget) - 1.0);
  s.stats.apply_seconds = absl::ToDoubleSeconds(absl::Now() - start);
  LogStep(s.stats);
  return s.stats;
}

void BucketState::LogStep(const StepStats& s) const {
  // Off by default (--log_level=debug): one relaxed load when off.
  MICROD_LOG(
      Debug,
      "bucket '%s' step %llu on node %d of %d: k %llu, selected %llu (%llu here), "
      "%llu round(s), %llu bytes sent, %llu received; select %.3f ms, exchange %.3f ms, "
      "apply %.3f ms",
      spec_.name.c_str(), static_cast<unsigned long long>(s.step), job_.node_rank, job_.num_nodes,
      static_cast<unsigned long long>(s.budget), static_cast<unsigned long long>(s.selected),
      static_cast<unsigned long long>(s.local_selected), static_cast<unsigned long long>(s.rounds),
      static_cast<unsigned long long>(s.bytes_sent),
      static_cast<unsigned long long>(s.bytes_received), s.select_seconds * 1e3,
      s.exchange_seconds * 1e3, s.apply_seconds * 1e3);
}

BucketState::Header BucketState::MakeHeader(uint64_t count, uint64_t nonfinite) const {
  const float threshold = controller_ != nullptr ? controller_->PassThreshold() : 0.0f;
  uint32_t bits;
  std::memcpy(&bits, &threshold, sizeof bits);
  return {count, nonfinite, step_, bits};
}

absl::StatusOr<std::vector<BucketState::Header>> BucketState::ExchangeHeaders(
    uint64_t count, uint64_t nonfinite, transport::Transport& transport,
    const CollectiveOptions& options, StepStats& stats) {
  const Header mine = MakeHeader(count, nonfinite);
  std::vector<Header> headers(job_.num_nodes);
  stats.bytes_sent += sizeof(Header);
  stats.bytes_received += (job_.num_nodes - 1) * sizeof(Header);
  RETURN_IF_ERROR(transport.Allgather(&mine, sizeof(Header), headers.data(), options));
  RETURN_IF_ERROR(CheckHeaders(headers));
  return headers;
}

absl::Status BucketState::CheckHeaders(const std::vector<Header>& headers) const {
  const Header mine = MakeHeader(0, 0);
  std::vector<std::string> apart;
  for (int r = 0; r < job_.num_nodes; ++r) {
    if (headers[r].step != mine.step || headers[r].threshold_bits != mine.threshold_bits) {
      apart.push_back(absl::StrCat("node ", r, " is at step ", headers[r].step,
                                   " (threshold bits 0x", absl::Hex(headers[r].threshold_bits),
                                   ")"));
    }
  }
  if (!apart.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "bucket '", spec_.name, "': this node (", job_.node_rank, ") is at step ", step_,
        " (threshold bits 0x", absl::Hex(mine.threshold_bits), "), ", absl::StrJoin(apart, ", "),
        "; the nodes' states differ (restored from checkpoints of different steps?), step "
        "failed on every node"));
  }
  std::vector<std::string> bad;
  for (int r = 0; r < job_.num_nodes; ++r) {
    if (headers[r].nonfinite != 0) {
      bad.push_back(absl::StrCat("node ", r, " (", headers[r].nonfinite, " values)"));
    }
  }
  if (!bad.empty()) {
    return WithClientStatus(
        absl::InvalidArgumentError(absl::StrCat(
            "bucket '", spec_.name, "' step ", step_, ": NaN or Inf in the gradient on ",
            absl::StrJoin(bad, ", "), "; step skipped, residual unchanged")),
        ClientStatus::kNonFinite);
  }
  return absl::OkStatus();
}

absl::StatusOr<float> BucketState::ClipScale(const float* grad, StepStats& stats) {
  if (options_.clip_norm <= 0) return 1.0f;
  double sum = 0.0;
  RETURN_IF_ERROR(Check(ops_->SumOfSquares(grad, spec_.size, &sum, stream_), "norm"));
  const double limit = options_.clip_norm / std::sqrt(static_cast<double>(job_.num_nodes));
  const double norm = std::sqrt(sum);
  // A NaN norm is left to the step's non-finite check.
  if (!(norm > limit)) return 1.0f;
  stats.clipped = true;
  return static_cast<float>(limit / norm);
}

kernels::FusedSelectArgs BucketState::PassArgs(const float* grad, float grad_scale) {
  kernels::FusedSelectArgs args;
  args.grad = grad;
  args.grad_scale = grad_scale;
  args.residual = residual_.get();
  args.acc = topk_sums_.get();  // null but for top-k: nothing stored
  args.size = spec_.size;
  if (options_.momentum > 0) {
    // Momentum correction in the same pass: u = beta * u + g, then e + u.
    args.velocity_in = velocity_.get();
    args.beta = static_cast<float>(options_.momentum);
  }
  args.out_index = candidate_index_.get();
  args.out_value = candidate_value_.get();
  args.scalars = scalars_.get();
  return args;
}

absl::Status BucketState::Commit(const kernels::FusedSelectArgs& pass, uint64_t K, float* update) {
  // Room grown for steps that selected more (momentum correction's first
  // steps, whose sums grow past the controller's last bound; a rescan), or
  // kept for a denser step than the next (the warm-up's decay), goes back to
  // the next step's room once this step's passes fit it. The candidates are
  // scratch by now.
  const uint64_t next = RoomAt(step_ + 1);
  if (candidate_index_.size() > 2 * next && step_most_ <= next) {
    DeviceBuffer<uint32_t> index(ops_, next);
    DeviceBuffer<float> value(ops_, next);
    if (index.ok() && value.ok()) {  // else the larger room stays
      candidate_index_ = std::move(index);
      candidate_value_ = std::move(value);
    }
  }
  step_most_ = 0;
  residual_zero_ = false;
  kernels::FusedSelectArgs commit = pass;
  commit.acc = residual_.get();  // in place
  commit.velocity_out = velocity_.get();
  commit.select_begin = commit.select_end = 0;
  commit.out_index = nullptr;
  commit.out_value = nullptr;
  commit.zero_out = update;
  commit.scalars = scalars_.get();
  RETURN_IF_ERROR(Check(ops_->FusedAccumulateSelect(commit, stream_), "accumulate"));
  if (spec_.wire != kernels::ElementType::kFloat32) {
    // The residual keeps what rounding the values drops; wire_values_ (the
    // values sent, already widened) is scratch by now.
    RETURN_IF_ERROR(Check(ops_->GatherRounded(residual_.get(), global_index_.get(), K, spec_.wire,
                                              wire_values_.get(), stream_),
                          "rounding"));
  } else {
    RETURN_IF_ERROR(
        Check(ops_->ZeroAt(residual_.get(), global_index_.get(), K, stream_), "zeroing"));
  }
  if (!velocity_.ok()) return absl::OkStatus();
  // Momentum factor masking.
  return Check(ops_->ZeroAt(velocity_.get(), global_index_.get(), K, stream_), "velocity masking");
}

absl::Status BucketState::PrimeController(const float* grad, float grad_scale, Range part,
                                          transport::Transport& transport,
                                          const CollectiveOptions& options, StepStats& stats) {
  // This step's accumulated gradient (e + g, g clipped as the pass clips it;
  // the velocity of momentum correction, which a dense warm-up leaves
  // nonzero, is not sampled: the prime is only the controller's first lower
  // bound, which a rescan lowers when too few candidates pass it) at up to
  // kPrimeSamples evenly spread positions of the owned partition.
  constexpr uint64_t kPrimeSamples = 1 << 16;
  const uint64_t p = part.end - part.begin;
  const uint64_t m = std::min(p, kPrimeSamples);
  std::vector<float> sample(m), residual(m);
  if (m > 0) {
    std::vector<uint32_t> at(m);
    for (uint64_t j = 0; j < m; ++j) at[j] = static_cast<uint32_t>(part.begin + j * p / m);
    DeviceBuffer<uint32_t> index(ops_, m);
    DeviceBuffer<float> values(ops_, m);
    if (!index.ok() || !values.ok()) {
      return absl::ResourceExhaustedError(
          absl::StrCat("bucket '", spec_.name, "': out of memory for the threshold sample"));
    }
    RETURN_IF_ERROR(Check(ops_->CopyToDevice(index.get(), at.data(), m * sizeof(uint32_t), stream_),
                          "sample copy"));
    RETURN_IF_ERROR(Check(ops_->Gather(grad, index.get(), m, values.get(), stream_), "sample"));
    RETURN_IF_ERROR(Check(ops_->CopyToHost(sample.data(), values.get(), m * sizeof(float), stream_),
                          "sample copy"));
    RETURN_IF_ERROR(
        Check(ops_->Gather(residual_.get(), index.get(), m, values.get(), stream_), "sample"));
    RETURN_IF_ERROR(
        Check(ops_->CopyToHost(residual.data(), values.get(), m * sizeof(float), stream_),
              "sample copy"));
    for (uint64_t j = 0; j < m; ++j) {
      const float g = sample[j] * grad_scale;  // clipped as the pass clips it
      sample[j] = g + residual[j];
    }
  }
  return controller_->Prime(sample, m > 0 ? static_cast<double>(p) / static_cast<double>(m) : 0.0,
                            ControllerContextFor(transport, options, stats));
}

ControllerContext BucketState::ControllerContextFor(transport::Transport& transport,
                                                    const CollectiveOptions& options,
                                                    StepStats& stats) const {
  ControllerContext ctx;
  ctx.transport = &transport;
  ctx.options = options;
  ctx.options.tag = MakeTag(spec_.slot, TagKind::kHistogram);
  ctx.k = stats.budget;
  ctx.bytes_sent = &stats.bytes_sent;
  ctx.bytes_received = &stats.bytes_received;
  return ctx;
}

absl::StatusOr<StepStats> BucketState::StepDense(const float* grad, float* update,
                                                 transport::Transport& transport,
                                                 absl::Time deadline) {
  const absl::Time start = absl::Now();
  StepStats stats;
  stats.step = step_;
  stats.budget = spec_.size;  // dense reduces every element: no compression error
  stats.dense = true;
  // Momentum correction during a dense warm-up: the nodes' velocities are
  // reduced instead of their gradients, which is momentum SGD on the average
  // gradient; nothing was left behind to mask. The new velocity is kept only
  // once the step succeeds (as a sparse step's): it goes into the residual's
  // buffer while the residual is all zero (a warm-up step neither reads nor
  // writes it), which is zeroed again after, else into a second buffer.
  const bool momentum = options_.momentum > 0 && velocity_.ok();
  const bool borrow = momentum && residual_zero_ && residual_.ok();
  const float* inputs[1] = {grad};
  if (momentum) {
    if (!borrow && !warmup_velocity_.ok()) {
      warmup_velocity_.Reset(ops_, spec_.size);
      if (!warmup_velocity_.ok()) {
        return absl::ResourceExhaustedError(absl::StrCat("bucket '", spec_.name,
                                                         "': out of memory for the warm-up's ",
                                                         spec_.size, " velocities"));
      }
    }
    float* next = borrow ? residual_.get() : warmup_velocity_.get();
    RETURN_IF_ERROR(
        Check(ops_->Momentum(grad, velocity_.get(), static_cast<float>(options_.momentum), next,
                             spec_.size, stream_),
              "momentum"));
    inputs[0] = next;
  }
  // The new velocity is kept (`kept`) or not.
  auto settle = [this, borrow, momentum](bool kept) -> absl::Status {
    if (borrow) {
      // The new velocity becomes the current one and the residual's buffer
      // (then holding the old one, or the failed step's) zero again.
      if (kept) std::swap(velocity_, residual_);
      return Check(ops_->ZeroFloats(residual_.get(), spec_.size, stream_), "zeroing");
    }
    if (momentum && kept) std::swap(velocity_, warmup_velocity_);
    return absl::OkStatus();
  };
  bool divided = false;
  if (absl::Status s = ReduceDense(inputs[0], update, transport, deadline, stats, &divided);
      !s.ok()) {
    (void)settle(false);
    return s;
  }
  return Confirmed(
      transport, deadline,
      [this, update, divided, settle, stats,
       start](absl::Time confirmed) mutable -> absl::StatusOr<StepStats> {
        stats.exchange_seconds = absl::ToDoubleSeconds(confirmed - start);
        const absl::Time apply_start = absl::Now();
        absl::Status s;
        if (!divided) {
          s = Check(ops_->Divide(update, spec_.size, static_cast<float>(job_.world_size), nullptr,
                                 stream_),
                    "divide");
        }
        const absl::Status settled = settle(s.ok());
        RETURN_IF_ERROR(s);
        RETURN_IF_ERROR(settled);
        stats.selected = spec_.size;
        stats.sum_of_counts = spec_.size;
        stats.local_selected = spec_.size;
        stats.apply_seconds = absl::ToDoubleSeconds(absl::Now() - apply_start);
        ++step_;
        return stats;
      },
      [settle] { (void)settle(false); });
}

absl::StatusOr<StepStats> BucketState::Confirmed(transport::Transport& transport,
                                                 absl::Time deadline, Rest rest,
                                                 std::function<void()> drop) {
  // Every node got every transfer before any commits (a no-op unless asked).
  const absl::Status s = transport.Confirm(deadline);
  if (s.ok()) return rest(absl::Now());
  pending_ = std::make_unique<Pending>(Pending{std::move(rest), std::move(drop), absl::Now()});
  return s;
}

absl::StatusOr<StepStats> BucketState::RollForward() {
  if (pending_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("bucket '", spec_.name, "': no step to roll forward"));
  }
  const std::unique_ptr<Pending> p = std::move(pending_);
  return p->rest(p->confirm_failed);
}

void BucketState::DropPending() {
  const std::unique_ptr<Pending> p = std::move(pending_);
  if (p != nullptr && p->drop) p->drop();
}

absl::Status BucketState::ReduceDense(const float* input, float* update,
                                      transport::Transport& transport, absl::Time deadline,
                                      StepStats& stats, bool* divided) {
  RETURN_IF_ERROR(
      Check(ops_->LocalSum(&input, 1, spec_.size, update, scalars_.get(), stream_), "copy"));
  ASSIGN_OR_RETURN(const kernels::StepScalars scalars, ReadScalars());
  CollectiveOptions options;
  options.deadline = deadline;
  options.tag = MakeTag(spec_.slot, TagKind::kHeader);
  RETURN_IF_ERROR(ExchangeHeaders(0, scalars.nonfinite, transport, options, stats).status());
  options.tag = MakeTag(spec_.slot, TagKind::kDense);
  options.shape_agreed = true;  // the bucket's size, after the checked header exchange
  stats.bytes_sent += spec_.size * sizeof(float);
  stats.bytes_received += spec_.size * sizeof(float);
  const float divisor = static_cast<float>(job_.world_size);
  // The division folded into the collective where the backend can (host
  // memory); the same bits as dividing afterwards.
  absl::Status averaged = transport.AllreduceAverage(update, spec_.size, divisor, options);
  *divided = averaged.code() != absl::StatusCode::kUnimplemented;
  if (*divided) return averaged;
  return transport.AllreduceSum(update, spec_.size, DataType::kFloat32, options);
}

}  // namespace microd::sparsify
