// SPDX-License-Identifier: Apache-2.0
// The step runner's dense paths: the small buckets of a batch fused into one
// allreduce, and the buckets a cycle reduced itself (step_runner.h).
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "daemon/common/status_macros.h"
#include "daemon/common/status_map.h"
#include "daemon/engine/step_runner.h"
#include "daemon/engine/step_runner_shared.h"

namespace microd::engine {

using step_runner::DenseTrace;
using step_runner::Gone;
using step_runner::Named;
using step_runner::Seconds;
using transport::CollectiveOptions;
using transport::MakeTag;
using transport::TagKind;

void StepRunner::FinishInCycle(const std::vector<Work>& works, const InCycle& in_cycle) {
  // The cycle brought every node's values: none is delivered before every
  // node got every transfer (a no-op unless asked).
  if (absl::Status s = transport_->Confirm(absl::Now() + options_.op_timeout); !s.ok()) {
    Unconfirmed(
        works, s, [this, works, in_cycle] { FinishInCycleConfirmed(works, in_cycle); }, nullptr);
    return;
  }
  FinishInCycleConfirmed(works, in_cycle);
}

void StepRunner::FinishInCycleConfirmed(const std::vector<Work>& works, const InCycle& in_cycle) {
  const std::vector<uint64_t>& at = in_cycle.at;
  const std::vector<float>& area = in_cycle.area;
  const uint64_t floats = in_cycle.floats;
  const int n = membership_.node_count;
  uint64_t total = 0;
  for (const Work& w : works) total += w.bucket->count;
  for (size_t k = 0; k < works.size(); ++k) {
    const Work& w = works[k];
    const absl::Time t0 = absl::Now();
    const uint64_t d = w.bucket->count;
    if (w.missing_buffer()) {
      job_->Finish(w, Gone(w.bucket->name));  // its disconnect fails the job
      continue;
    }
    // The sum in node order, then the average: what the fused dense
    // allreduce computes, to the bit.
    std::vector<float> sum(area.begin() + at[k], area.begin() + at[k] + d);
    for (int r = 1; r < n; ++r) {
      const float* in = area.data() + r * floats + at[k];
      for (uint64_t j = 0; j < d; ++j) sum[j] += in[j];
    }
    absl::Status s = KernelCall(
        ops_->Divide(sum.data(), d, static_cast<float>(membership_.world_size), nullptr, nullptr),
        "divide");
    if (s.ok()) s = DenseMomentum(*w.bucket, sum.data());
    if (state_->job_failed()) return;  // Fail() answered this work
    for (const auto& buf : w.buffers) {
      if (s.ok()) s = CopyFloats(buf->data(), sum.data(), d);
    }
    if (s.ok()) s = memory_->StageOut(w, t0 + options_.op_timeout);  // bf16/fp16: rounded
    if (!s.ok()) {
      MemoryFailed({&w}, absl::InternalError(absl::StrCat("bucket '", w.bucket->name,
                                                          "': write-back: ", s.message())));
      return;
    }
    const absl::Time t1 = absl::Now();
    uint64_t step;
    {
      absl::MutexLock lock(&state_->mu);
      const double share = static_cast<double>(d) / static_cast<double>(total);
      ++state_->counts.cycle_reductions;
      w.bucket->stats.state_bytes = w.bucket->velocity.size() * sizeof(float);
      w.bucket->stats.AddDense(in_cycle.local_sum_seconds * share,
                               in_cycle.exchange_seconds * share, absl::ToDoubleSeconds(t1 - t0));
      step = w.bucket->stats.steps - 1;
    }
    if (tracing()) {
      TraceStep t = DenseTrace(w, step);
      t.Span(Phase::kLocalSum, in_cycle.local_sum_start, in_cycle.local_sum_seconds);
      t.Span(Phase::kExchange, in_cycle.exchange_start, in_cycle.exchange_seconds);
      t.Span(Phase::kWriteBack, t0, t1);
      timeline_->Record(w.bucket->name, t);
    }
    job_->Finish(w, absl::OkStatus());
  }
}

absl::Status StepRunner::LocalSums(const std::vector<Work>& works, absl::Time deadline,
                                   uint64_t* nonfinite) {
  uint64_t offset = 0;
  for (const Work& w : works) {
    RETURN_IF_ERROR(StageIn(w, deadline));
    std::vector<const float*> inputs;
    for (const auto& buf : w.buffers) inputs.push_back(memory_->Data(*buf));
    kernels::StepScalars sc;
    absl::Status s = KernelCall(ops_->LocalSum(inputs.data(), options_.local_size, w.bucket->count,
                                               fusion_.get() + offset, scalars_.get(), nullptr),
                                "local sum");
    if (s.ok()) s = KernelCall(ops_->CopyToHost(&sc, scalars_.get(), sizeof sc, nullptr), "copy");
    if (!s.ok()) return Named(s, w.bucket->name);
    *nonfinite += sc.nonfinite;
    offset += w.bucket->count;
  }
  return absl::OkStatus();
}

absl::Status StepRunner::ReduceFused(const std::vector<Work>& works, uint64_t total,
                                     uint64_t nonfinite, absl::Status* skipped, bool* confirming) {
  // One allreduce carries the values and, in a last element, how many nodes
  // saw a NaN/Inf; only then does a second collective name them.
  const float flag = nonfinite != 0 ? 1.0f : 0.0f;
  CollectiveOptions o;
  o.deadline = absl::Now() + options_.op_timeout;
  o.tag = MakeTag(0, TagKind::kDense);
  RETURN_IF_ERROR(
      KernelCall(ops_->CopyToDevice(fusion_.get() + total, &flag, sizeof flag, nullptr), "copy"));
  RETURN_IF_ERROR(
      transport_->AllreduceSum(fusion_.get(), total + 1, transport::DataType::kFloat32, o));
  float flags_sum = 0.0f;
  RETURN_IF_ERROR(KernelCall(
      ops_->CopyToHost(&flags_sum, fusion_.get() + total, sizeof flags_sum, nullptr), "copy"));
  *skipped = absl::OkStatus();
  if (flags_sum != 0.0f) RETURN_IF_ERROR(NamedNonFinite(works, nonfinite, o, skipped));
  *confirming = true;
  return transport_->Confirm(o.deadline);  // every node got every transfer
}

absl::Status StepRunner::NamedNonFinite(const std::vector<Work>& works, uint64_t nonfinite,
                                        transport::CollectiveOptions o, absl::Status* verdict) {
  o.tag = MakeTag(0, TagKind::kHeader);
  std::vector<uint64_t> flags(membership_.node_count);
  RETURN_IF_ERROR(transport_->Allgather(&nonfinite, sizeof nonfinite, flags.data(), o));
  std::vector<std::string> bad, names;
  for (int r = 0; r < membership_.node_count; ++r) {
    if (flags[r] != 0) bad.push_back(absl::StrCat("node ", r));
  }
  for (const Work& w : works) names.push_back(w.bucket->name);
  *verdict = WithClientStatus(
      absl::InvalidArgumentError(absl::StrCat("buckets '", absl::StrJoin(names, "', '"),
                                              "': NaN or Inf in the gradient on ",
                                              absl::StrJoin(bad, ", "), "; step skipped")),
      ClientStatus::kNonFinite);
  return absl::OkStatus();
}

absl::Status StepRunner::DenseMomentum(Bucket& b, float* average) {
  const double beta = options_.sparsify.momentum;
  // A buffer registered MICROD_BUFFER_DENSE is averaged exactly, as asked:
  // it may hold what is no gradient (the Python broadcast reuses one for
  // every chunk of the parameters), so no momentum goes into it.
  if (beta <= 0 || b.requested_dense) return absl::OkStatus();
  if (!b.velocity.ok()) {
    b.velocity.Reset(ops_, b.count);
    if (!b.velocity.ok()) {
      return absl::ResourceExhaustedError(
          absl::StrCat("bucket '", b.name, "': out of memory for its velocity"));
    }
  }
  RETURN_IF_ERROR(KernelCall(ops_->Momentum(average, b.velocity.get(), static_cast<float>(beta),
                                            b.velocity.get(), b.count, nullptr),
                             "momentum"));
  return CopyFloats(average, b.velocity.get(), b.count);
}

absl::Status StepRunner::WriteBackFused(const std::vector<Work>& works, uint64_t total) {
  if (const auto k = ops_->Divide(fusion_.get(), total, static_cast<float>(membership_.world_size),
                                  nullptr, nullptr);
      k != kernels::KernelStatus::kOk) {
    return absl::InternalError(
        absl::StrCat("fused dense buffer: divide: ", kernels::KernelStatusString(k)));
  }
  uint64_t offset = 0;
  for (const Work& w : works) {
    RETURN_IF_ERROR(DenseMomentum(*w.bucket, fusion_.get() + offset));
    for (const auto& buf : w.buffers) {
      RETURN_IF_ERROR(CopyFloats(memory_->Data(*buf), fusion_.get() + offset, w.bucket->count));
    }
    offset += w.bucket->count;
  }
  for (const Work& w : works)
    RETURN_IF_ERROR(memory_->StageOut(w, absl::Now() + options_.op_timeout));
  return absl::OkStatus();
}

void StepRunner::RunFusedDense(const std::vector<Work>& works) {
  uint64_t total = 0;
  for (const Work& w : works) total += w.bucket->count;
  if (!fusion_.Reserve(ops_, total + 1) || !scalars_.Reserve(ops_, 1)) {
    const absl::Status s = WithClientStatus(
        absl::ResourceExhaustedError("fused dense buffer: out of memory"), ClientStatus::kResource);
    for (const Work& w : works) job_->Finish(w, s);
    job_->Fail(s, /*report=*/true);
    return;
  }
  for (const Work& w : works) {
    if (w.missing_buffer()) {
      for (const Work& x : works) job_->Finish(x, Gone(""));
      return;
    }
  }
  const absl::Time t0 = absl::Now();
  uint64_t nonfinite = 0;
  if (absl::Status s = LocalSums(works, t0 + options_.op_timeout, &nonfinite); !s.ok()) {
    MemoryFailed(works, s);
    return;
  }
  const absl::Time t1 = absl::Now();
  absl::Status skipped;
  bool confirming = false;
  if (absl::Status s = ReduceFused(works, total, nonfinite, &skipped, &confirming); !s.ok()) {
    if (confirming) {
      Unconfirmed(
          works, s,
          [this, works, total, skipped, t0, t1] {
            FinishFusedDense(works, total, skipped, t0, t1);
          },
          nullptr);
    } else {
      StepFailed(works, s);
    }
    return;
  }
  FinishFusedDense(works, total, skipped, t0, t1);
}

void StepRunner::FinishFusedDense(const std::vector<Work>& works, uint64_t total,
                                  const absl::Status& skipped, absl::Time t0, absl::Time t1) {
  if (!skipped.ok()) {
    for (const Work& w : works) NonFinite(w, skipped);
    return;
  }
  const double local_sum = absl::ToDoubleSeconds(t1 - t0);
  const double exchange = Seconds(t1);
  const absl::Time t2 = absl::Now();
  if (state_->job_failed()) return;  // Fail() answered this work
  if (absl::Status s = WriteBackFused(works, total); !s.ok()) {
    MemoryFailed(works, s);
    return;
  }
  const absl::Time t3 = absl::Now();
  const double writeback = absl::ToDoubleSeconds(t3 - t2);
  std::vector<uint64_t> steps;
  {
    absl::MutexLock lock(&state_->mu);
    for (const Work& w : works) {
      const double share = static_cast<double>(w.bucket->count) / static_cast<double>(total);
      w.bucket->stats.AddDense(local_sum * share, exchange * share, writeback * share);
      w.bucket->stats.state_bytes = w.bucket->velocity.size() * sizeof(float);
      steps.push_back(w.bucket->stats.steps - 1);
    }
  }
  if (tracing()) {
    // Every bucket's track shows the fused collective's whole phases.
    for (size_t i = 0; i < works.size(); ++i) {
      TraceStep t = DenseTrace(works[i], steps[i]);
      t.Span(Phase::kLocalSum, t0, t1);
      t.Span(Phase::kExchange, t1, exchange);
      t.Span(Phase::kWriteBack, t2, t3);
      timeline_->Record(works[i].bucket->name, t);
    }
  }
  for (const Work& w : works) job_->Finish(w, absl::OkStatus());
}

}  // namespace microd::engine
