// SPDX-License-Identifier: Apache-2.0
#include "daemon/engine/step_runner.h"

#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/common/log.h"
#include "daemon/common/status_macros.h"
#include "daemon/common/status_map.h"
#include "daemon/engine/step_runner_shared.h"
#include "daemon/sparsify/batch_step.h"

namespace microd::engine {

using transport::CollectiveOptions;
using transport::MakeTag;
using transport::TagKind;

using step_runner::DenseTrace;
using step_runner::Gone;
using step_runner::Named;
using step_runner::Seconds;

absl::Status StepRunner::CopyFloats(float* dst, const float* src, uint64_t count) {
  if (count == 0) return absl::OkStatus();
  // In ops_'s memory (host or device).
  return KernelCall(src == nullptr ? ops_->ZeroFloats(dst, count, nullptr)
                                   : ops_->CopyFloats(dst, src, count, nullptr),
                    "copy");
}

absl::Status StepRunner::KernelCall(kernels::KernelStatus k, const char* what) const {
  if (k == kernels::KernelStatus::kOk) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat(what, " (", ops_->name(), "): ", kernels::KernelStatusString(k)));
}

absl::Status StepRunner::StageIn(const Work& w, absl::Time deadline) {
  // A failed job (a process died, a peer failed) ends the wait for a ready
  // event at once: the event may belong to a process that is gone.
  return memory_->StageIn(w, deadline, [this] { return state_->job_failed(); });
}

void StepRunner::MemoryFailed(const std::vector<Work>& works, const absl::Status& s) {
  std::vector<const Work*> all;
  for (const Work& w : works) all.push_back(&w);
  MemoryFailed(all, s);
}

void StepRunner::MemoryFailed(const std::vector<const Work*>& works, const absl::Status& s) {
  const absl::Status why = absl::Status(s.code(), absl::StrCat("node ", membership_.node_rank, ": ",
                                                               memory_->what(), ": ", s.message()));
  {
    absl::MutexLock lock(&state_->mu);
    for (const Work* w : works) ++w->bucket->stats.failures;
  }
  for (const Work* w : works) job_->Finish(*w, JobFailed(why));
  job_->Fail(why, /*report=*/true);
}

void StepRunner::StepFailed(const std::vector<Work>& works, absl::Status s) {
  if (job_->Hold(works, s)) return;  // an elastic job: perhaps a lost peer
  s = job_->WithRootCause(s);
  // The job first (the cause reported to the coordinator), then the
  // answers: a process that exits on its answer is no cause of its own.
  job_->Fail(s, /*report=*/true);
  for (const Work& w : works) job_->Finish(w, JobFailed(s));
}

void StepRunner::Unconfirmed(const std::vector<Work>& works, const absl::Status& s,
                             std::function<void()> commit, std::function<void()> drop) {
  if (job_->Hold(works, s)) {
    unconfirmed_ = std::make_unique<Held>(Held{works, std::move(commit), std::move(drop)});
    return;
  }
  if (drop) drop();
  StepFailed(works, s);
}

std::vector<Work> StepRunner::RollForward() {
  if (unconfirmed_ == nullptr) return {};
  const std::unique_ptr<Held> held = std::move(unconfirmed_);
  held->commit();
  return held->works;
}

void StepRunner::DropUnconfirmed() {
  const std::unique_ptr<Held> held = std::move(unconfirmed_);
  if (held != nullptr && held->drop) held->drop();
}

void StepRunner::NonFinite(const Work& w, const absl::Status& status) {
  if (!options_.skip_nonfinite) {
    {
      absl::MutexLock lock(&state_->mu);
      ++w.bucket->stats.failures;
    }
    job_->Finish(w, status);
    return;
  }
  // Skip: nothing was reduced; every process applies a zero update.
  absl::Status s;
  for (const auto& buf : w.buffers) {
    if (buf != nullptr && s.ok()) s = CopyFloats(memory_->Data(*buf), nullptr, buf->count());
  }
  if (s.ok()) s = memory_->StageOut(w, absl::Now() + options_.op_timeout);
  if (!s.ok()) {
    MemoryFailed({&w}, s);
    return;
  }
  {
    absl::MutexLock lock(&state_->mu);
    ++w.bucket->stats.skipped;
  }
  MICROD_LOG(Warning, "%s (skipped: zero update)", std::string(status.message()).c_str());
  job_->Finish(w, absl::OkStatus());
}

absl::Status StepRunner::EnsureState(Bucket& b) {
  if (b.state != nullptr) return absl::OkStatus();
  sparsify::BucketSpec spec{b.name, b.count, next_slot_++};
  if (options_.wire_bucket_dtype) spec.wire = static_cast<kernels::ElementType>(b.dtype);
  auto state = sparsify::BucketState::Create(
      spec, {membership_.node_count, membership_.node_rank, membership_.world_size},
      options_.sparsify, ops_);
  if (!state.ok()) return state.status();
  if (auto it = adopted_.find(b.name); it != adopted_.end()) {
    // Joined a running job: the job's step and threshold, a zero residual.
    ASSIGN_OR_RETURN(sparsify::BucketCheckpoint c, (*state)->Save());
    c.step = it->second.step;
    c.controller = it->second.controller;
    if (absl::Status s = (*state)->Load(c); !s.ok()) {
      return absl::Status(
          s.code(), absl::StrCat("bucket '", b.name,
                                 "': the job's state, as this node joined it: ", s.message()));
    }
    adopted_.erase(it);
  }
  b.state = std::move(state).value();
  const sparsify::SparsifyOptions& o = options_.sparsify;
  if (const double raised = o.ForBucket(b.count).density; raised != o.density) {
    // Said once, when the bucket's state is made (its first sparse step).
    MICROD_LOG(Warning,
               "bucket '%s' (%llu values): k = %llu at density %g is below --min_k = "
               "%llu (too few to train on); it steps at density %.4g (k = %llu)",
               b.name.c_str(), static_cast<unsigned long long>(b.count),
               static_cast<unsigned long long>(sparsify::Budget(o.density, b.count)), o.density,
               static_cast<unsigned long long>(o.min_k), raised,
               static_cast<unsigned long long>(sparsify::Budget(raised, b.count)));
  }
  return absl::OkStatus();
}

absl::Status StepRunner::GradientOf(const Work& w, const float** grad, double* local_sum) {
  Bucket& b = *w.bucket;
  const int L = options_.local_size;
  // The update is written over the first process's buffer (the step reads
  // the gradient completely first) and, with several, copied into the
  // others. With several the first one's buffer takes the local sum too, in
  // place, once a round (a second call, after passes begun during a cycle
  // were dropped, finds it there): no bucket-sized buffer of the daemon.
  const absl::Time t0 = absl::Now();
  *grad = memory_->Data(*w.buffers[0]);
  if (L > 1 && b.summed == w.round + 1) {
    *local_sum = 0;
    return absl::OkStatus();
  }
  // Step 1: the node's gradient. With one local process its buffer is g itself.
  RETURN_IF_ERROR(StageIn(w, t0 + options_.op_timeout));
  if (L > 1) {
    std::vector<const float*> inputs;
    for (const auto& buf : w.buffers) inputs.push_back(memory_->Data(*buf));
    if (absl::Status s = KernelCall(ops_->LocalSum(inputs.data(), L, b.count,
                                                   memory_->Data(*w.buffers[0]), nullptr, nullptr),
                                    "local sum");
        !s.ok()) {
      return absl::InternalError(absl::StrCat("bucket '", b.name, "': ", s.message()));
    }
    b.summed = w.round + 1;
  }
  *local_sum = Seconds(t0);
  return absl::OkStatus();
}

bool StepRunner::Gradient(const Work& w, const float** grad, double* local_sum) {
  const absl::Status s = GradientOf(w, grad, local_sum);
  if (s.ok()) return true;
  if (ToClientStatus(s) == ClientStatus::kResource) {
    job_->Finish(w, s);
    job_->Fail(s, /*report=*/true);
  } else {
    MemoryFailed({&w}, s);
  }
  return false;
}

std::shared_ptr<Speculation> StepRunner::Speculate(const std::vector<size_t>& ids) {
  auto spec = std::make_shared<Speculation>();
  spec->step =
      std::make_unique<sparsify::BatchStep>(*transport_, absl::Now() + options_.op_timeout);
  for (size_t id : ids) {
    // A view of the bucket's submissions: not taken from the table, so not
    // answered here (the plan takes them once every node has them ready).
    Work w;
    {
      absl::MutexLock lock(&state_->mu);
      if (id >= state_->table.cached_count() || !state_->table.cached_ready(id)) continue;
      w.bucket = &state_->table.cached(id);
      w.buffers = w.bucket->buffers;
      w.round = w.bucket->rounds;  // the Work that takes them will be this round
    }
    Bucket& b = *w.bucket;
    if (absl::Status s = EnsureState(b); !s.ok()) {
      spec->status = s;
      return spec;
    }
    if (!sparsify::BatchStep::Batchable(*b.state)) continue;
    const absl::Time started = absl::Now();
    const float* grad = nullptr;
    double local_sum = 0;
    if (!w.missing_buffer()) {
      if (absl::Status s = GradientOf(w, &grad, &local_sum); !s.ok()) {
        spec->status = s;
        return spec;
      }
    }
    if (absl::Status s = spec->step->Add(b.state.get(), grad); !s.ok()) {
      spec->status = s;
      return spec;
    }
    spec->ids.push_back(id);
    spec->local_sum.push_back(local_sum);
    spec->started.push_back(started);
  }
  return spec;
}

float* StepRunner::UpdateBuffer(const Work& w) { return memory_->Data(*w.buffers[0]); }

void StepRunner::Deliver(const Work& w, const sparsify::StepStats& st, const float* update,
                         double local_sum, absl::Time t0) {
  Bucket& b = *w.bucket;
  const absl::Time t1 = absl::Now();
  if (state_->job_failed()) return;  // Fail() answered this work
  absl::Status written;
  for (size_t i = 1; i < w.buffers.size() && written.ok(); ++i) {
    written = CopyFloats(memory_->Data(*w.buffers[i]), update, b.count);
  }
  if (written.ok()) written = memory_->StageOut(w, absl::Now() + options_.op_timeout);
  if (!written.ok()) {
    MemoryFailed({&w}, written);
    return;
  }
  const absl::Time t2 = absl::Now();
  {
    absl::MutexLock lock(&state_->mu);
    b.stats.AddSparse(st, local_sum, absl::ToDoubleSeconds(t2 - t1), options_.stats_history);
    b.stats.state_bytes = b.state->AllocatedBytes();
  }
  if (tracing()) {
    TraceStep t;
    t.step = st.step;
    t.selected = st.selected;
    t.budget = st.budget;
    t.cre = st.cre;
    t.threshold = st.threshold;
    t.ready = w.ready_at;
    // Inside the step: the selection, the exchange, then the update applied
    // (its end, then the copies into the buffers: the write-back).
    const absl::Time ts = t0 + absl::Seconds(local_sum);
    t.Span(Phase::kLocalSum, t0, ts);
    t.Span(Phase::kSelection, ts, st.select_seconds);
    t.Span(Phase::kExchange, t.end[static_cast<int>(Phase::kSelection)], st.exchange_seconds);
    t.Span(Phase::kWriteBack, t1 - absl::Seconds(st.apply_seconds), t2);
    timeline_->Record(b.name, t);
  }
  job_->Finish(w, absl::OkStatus());
}

bool StepRunner::StepError(const Work& w, const absl::Status& s) {
  if (ToClientStatus(s) == ClientStatus::kNonFinite) {
    NonFinite(w, s);  // this step only; the job goes on
    return true;
  }
  {
    absl::MutexLock lock(&state_->mu);
    ++w.bucket->stats.failures;
  }
  return false;
}

std::unique_ptr<sparsify::BatchStep> StepRunner::Begun(const std::vector<const Work*>& batched,
                                                       Speculation* speculation,
                                                       std::vector<double>* local_sum,
                                                       std::vector<absl::Time>* started) {
  if (speculation == nullptr || !speculation->status.ok() || speculation->step == nullptr) {
    return nullptr;
  }
  std::vector<size_t> keep;
  size_t at = 0;
  for (const Work* w : batched) {
    const int64_t id = w->bucket->cache_id;
    while (at < speculation->ids.size() && static_cast<int64_t>(speculation->ids[at]) < id) ++at;
    if (at == speculation->ids.size() || static_cast<int64_t>(speculation->ids[at]) != id) {
      return nullptr;  // a bucket the passes did not cover: do them all again
    }
    keep.push_back(at);
    (*local_sum)[keep.size() - 1] = speculation->local_sum[at];
    (*started)[keep.size() - 1] = speculation->started[at];
    ++at;
  }
  std::unique_ptr<sparsify::BatchStep> step = std::move(speculation->step);
  step->KeepOnly(keep);
  return step;
}

void StepRunner::RunSparse(const Work& w) {
  Bucket& b = *w.bucket;
  if (w.missing_buffer()) {
    job_->Finish(w, Gone(b.name));
    return;
  }
  if (absl::Status s = EnsureState(b); !s.ok()) {
    job_->Finish(w, s);
    job_->Fail(s, /*report=*/true);
    return;
  }
  const absl::Time t0 = absl::Now();
  const float* grad = nullptr;
  double local_sum = 0;
  if (!Gradient(w, &grad, &local_sum)) return;
  float* update = UpdateBuffer(w);
  auto st = b.state->Step(grad, update, *transport_, absl::Now() + options_.op_timeout);
  if (!st.ok() && b.state->has_pending()) {
    Unconfirmed(
        {w}, st.status(),
        [this, w, update, local_sum, t0] {
          auto rolled = w.bucket->state->RollForward();
          if (!rolled.ok()) {
            if (!StepError(w, rolled.status())) job_->Finish(w, JobFailed(rolled.status()));
            return;
          }
          Deliver(w, *rolled, update, local_sum, t0);
        },
        [state = b.state.get()] { state->DropPending(); });
    return;
  }
  if (!st.ok()) {
    if (!StepError(w, st.status())) StepFailed({w}, st.status());
    return;
  }
  Deliver(w, *st, update, local_sum, t0);
}

void StepRunner::RunSparse(const std::vector<Work>& works,
                           std::shared_ptr<Speculation> speculation) {
  if (options_.device_resident) {
    // On the GPU every round trip is a kernel's wait: one bucket at a time.
    for (const Work& w : works) {
      if (state_->job_failed()) return;
      RunSparse(w);
    }
    return;
  }
  // Buckets whose next step cannot be batched (the hist controller's first
  // step primes it, the dense warm-up, a bf16/fp16 wire) run alone first,
  // in the batch's order: every node decides alike.
  std::vector<const Work*> batched;
  for (const Work& w : works) {
    if (state_->job_failed()) return;
    Bucket& b = *w.bucket;
    if (absl::Status s = EnsureState(b); !s.ok()) {
      job_->Finish(w, s);
      job_->Fail(s, /*report=*/true);
      return;
    }
    if (sparsify::BatchStep::Batchable(*b.state)) {
      batched.push_back(&w);
    } else {
      RunSparse(w);
    }
  }
  if (batched.empty() || state_->job_failed()) return;
  std::vector<double> local_sum(batched.size(), 0.0);
  std::vector<absl::Time> started(batched.size());
  std::vector<Work> all;
  for (const Work* w : batched) all.push_back(*w);
  // The passes begun during the cycle, when they cover every bucket here:
  // those every node has ready are kept (in id order, as the works are).
  std::unique_ptr<sparsify::BatchStep> begun =
      Begun(batched, speculation.get(), &local_sum, &started);
  std::unique_ptr<sparsify::BatchStep> fresh;
  if (begun == nullptr) {
    fresh = std::make_unique<sparsify::BatchStep>(*transport_, absl::Now() + options_.op_timeout);
    for (size_t i = 0; i < batched.size(); ++i) {
      const Work& w = *batched[i];
      started[i] = absl::Now();
      const float* grad = nullptr;
      // A bucket a local process has left: every node fails it, naming this one.
      if (!w.missing_buffer() && !Gradient(w, &grad, &local_sum[i])) return;
      if (absl::Status s = fresh->Add(w.bucket->state.get(), grad); !s.ok()) {
        StepFailed(all, s);
        return;
      }
    }
  }
  std::shared_ptr<sparsify::BatchStep> step(begun != nullptr ? std::move(begun) : std::move(fresh));
  if (absl::Status s = step->Run(); !s.ok()) {
    if (step->unconfirmed()) {
      Unconfirmed(
          all, s,
          [this, step, all, local_sum, started] { FinishBatch(*step, all, local_sum, started); },
          nullptr);
      return;
    }
    {
      absl::MutexLock lock(&state_->mu);
      for (const Work* w : batched) ++w->bucket->stats.failures;
    }
    StepFailed(all, s);
    return;
  }
  FinishBatch(*step, all, local_sum, started);
}

void StepRunner::FinishBatch(sparsify::BatchStep& step, const std::vector<Work>& works,
                             const std::vector<double>& local_sum,
                             const std::vector<absl::Time>& started) {
  for (size_t i = 0; i < works.size(); ++i) {
    const Work& w = works[i];
    if (state_->job_failed()) return;
    if (w.missing_buffer()) {
      (void)step.Finish(i, nullptr);
      job_->Finish(w, Gone(w.bucket->name));
      continue;
    }
    float* update = UpdateBuffer(w);
    auto st = step.Finish(i, update);
    if (!st.ok()) {
      if (!StepError(w, st.status())) job_->Finish(w, JobFailed(st.status()));
      continue;
    }
    Deliver(w, *st, update, local_sum[i], started[i]);
  }
}

}  // namespace microd::engine
