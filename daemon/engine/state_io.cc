// SPDX-License-Identifier: Apache-2.0
// The engine's part of microd_state_save / microd_state_load: collecting the
// local processes' requests, and saving or loading every bucket's
// sparsifier state on the engine's thread between plans (no step runs then).
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "daemon/common/log.h"
#include "daemon/common/status_macros.h"
#include "daemon/common/status_map.h"
#include "daemon/engine/engine.h"
#include "microd/wire.h"

namespace microd::engine {

void Engine::AnswerStateRequest(const StateRequest& q, const absl::Status& s) {
  for (size_t r = 0; r < q.tickets.size(); ++r) {
    if (q.tickets[r] != 0 && server_ != nullptr) {
      server_->Complete(q.clients[r], q.tickets[r], MICROD_WIRE_NO_BUFFER, s);
    }
  }
}

absl::Status Engine::OnState(uint64_t client, bool save, local::StateDirectory dir,
                             uint64_t ticket) {
  StateRequest refused;  // the earlier askers of a conflicting request
  absl::Status conflict;
  {
    absl::MutexLock lock(&state_.mu);
    if (!state_.failed.ok()) return state_.failed;
    auto rank = state_.table.LocalRankOf(client);
    if (!rank.ok()) return rank.status();
    StateRequest& q = state_.state_request;
    const char* what = save ? "save the state to" : "load the state from";
    if (!state_.table.departed().empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("local process ", *state_.table.departed().begin(), " of node ",
                       membership_.node_rank, " left before asking to ", save ? "save" : "load",
                       " the state: every process of the job must ask"));
    }
    if (q.asked == 0) {
      q.save = save;
      q.dir = std::move(dir);
      q.clients.assign(options_.local_size, 0);
      q.tickets.assign(options_.local_size, 0);
    } else if (q.save != save || q.dir.dev != dir.dev || q.dir.ino != dir.ino) {
      conflict = absl::InvalidArgumentError(absl::StrCat(
          "local process ", *rank, " asks to ", what, " ", dir.path, " while another asked to ",
          q.save ? "save the state to " : "load the state from ", q.dir.path,
          ": every process of the job calls the same, at the same point"));
      refused = std::move(q);
      q = StateRequest{};
    }
    if (conflict.ok()) {
      if (q.tickets[*rank] != 0) {
        return absl::FailedPreconditionError(
            absl::StrCat("local process ", *rank, " already asked to ", what, " ", q.dir.path));
      }
      q.clients[*rank] = client;
      q.tickets[*rank] = ticket;
      if (++q.asked == options_.local_size) state_.state_request.ready = true;
      return absl::OkStatus();
    }
  }
  // Nobody waits for a request that cannot happen: all askers get the error.
  AnswerStateRequest(refused, conflict);
  return conflict;
}

void Engine::RunStateRequest() {
  StateRequest q;
  {
    absl::MutexLock lock(&state_.mu);
    if (!state_.state_request.ready) return;
    q = std::move(state_.state_request);
    state_.state_request = StateRequest{};
  }
  absl::Status s = q.save ? SaveState(q) : LoadState(q);
  if (!q.save &&
      (absl::IsFailedPrecondition(s) || absl::IsDataLoss(s) || absl::IsInvalidArgument(s))) {
    s = WithClientStatus(s, ClientStatus::kMismatch);  // the saved job is not this one
  }
  MICROD_LOG(Info, "node %d: %s %s: %s%s", membership_.node_rank,
             q.save ? "saved the state to" : "loaded the state from", q.dir.path.c_str(),
             s.ok() ? "ok" : std::string(s.message()).c_str(),
             s.ok() && options_.state_key.empty()
                 ? " (checksummed, not authenticated: no --token_file or --state_key_file)"
                 : "");
  AnswerStateRequest(q, s);
  // The other nodes may have loaded theirs: the nodes' states no longer
  // belong together, so the job cannot go on.
  if (!q.save && !s.ok()) {
    Fail(absl::AbortedError(absl::StrCat("node ", membership_.node_rank,
                                         " could not load the state: ", s.message())),
         /*report=*/true);
  }
}

microd::v1::NodeCheckpoint Engine::CheckpointShape() const {
  microd::v1::NodeCheckpoint c;
  c.set_format(1);
  c.set_job_id(options_.job_id);
  c.set_node_rank(membership_.node_rank);
  c.set_node_count(membership_.node_count);
  c.set_world_size(membership_.world_size);
  c.set_local_size(options_.local_size);
  const sparsify::SparsifyOptions& s = options_.sparsify;
  auto& o = *c.mutable_options();
  auto num = [](double x) { return absl::StrFormat("%.17g", x); };
  o["--sparsifier"] = sparsify::SparsifierName(s.sparsifier);
  o["--controller"] = sparsify::ControllerName(s.controller);
  o["--density"] = num(s.density);
  o["--hard_threshold"] = num(s.hard_threshold);
  o["--momentum_correction"] = num(s.momentum);
  o["--clip_norm"] = num(s.clip_norm);
  o["--warmup_steps"] = absl::StrCat(s.warmup_steps);
  o["--warmup_density"] = num(s.warmup_density);
  o["--warmup_decay_steps"] = absl::StrCat(s.warmup_decay_steps);
  // Only where set: states saved before the flag existed still load.
  if (s.warmup_dense_above > 0) o["--warmup_dense_above"] = num(s.warmup_dense_above);
  o["--min_k"] = absl::StrCat(s.min_k);
  o["--dense_floor"] = absl::StrCat(options_.dense_floor);
  return c;
}

absl::Status Engine::SaveState(const StateRequest& q) {
  std::vector<Bucket*> buckets;
  {
    absl::MutexLock lock(&state_.mu);
    buckets = state_.table.WithState();  // states change on this thread only
  }
  microd::v1::NodeCheckpoint c = CheckpointShape();
  for (Bucket* b : buckets) {
    sparsify::BucketCheckpoint saved;
    if (b->state != nullptr) {
      ASSIGN_OR_RETURN(saved, b->state->Save());
    } else {
      // A dense bucket's velocity (momentum correction): all it keeps.
      saved.velocity.resize(b->count);
      if (ops_->CopyToHost(saved.velocity.data(), b->velocity.get(), b->count * sizeof(float),
                           nullptr) != kernels::KernelStatus::kOk) {
        return absl::InternalError(absl::StrCat("bucket '", b->name, "': copy of its velocity"));
      }
    }
    *c.add_buckets() = ToProto(b->name, b->count, saved);
  }
  const std::string name = CheckpointName(membership_.node_rank);
  return WriteCheckpoint(q.dir.fd.get(), name, absl::StrCat(q.dir.path, "/", name), c,
                         options_.state_key, FileOwner{q.dir.uid, q.dir.gid});
}

absl::Status Engine::LoadState(const StateRequest& q) {
  const std::string name = CheckpointName(membership_.node_rank);
  const std::string path = absl::StrCat(q.dir.path, "/", name);
  // The most this job's state can take: every bucket's residual (and
  // velocity), its name and its controller's few bytes, and the shape.
  uint64_t max_bytes = 1 << 20;
  {
    absl::MutexLock lock(&state_.mu);
    const uint64_t vectors = options_.sparsify.momentum > 0 ? 2 : 1;
    max_bytes += vectors * state_.table.total_elements() * sizeof(float) +
                 1024 * state_.table.bucket_count();
  }
  auto saved = ReadCheckpoint(q.dir.fd.get(), name, path, max_bytes, options_.state_key);
  if (!saved.ok()) return saved.status();
  RETURN_IF_ERROR(CheckSameShape(*saved, CheckpointShape(), path));
  // Everything is checked before anything is loaded.
  std::vector<std::pair<Bucket*, sparsify::BucketCheckpoint>> loads, dense_loads;
  for (const microd::v1::CheckpointBucket& p : saved->buckets()) {
    Bucket* b = nullptr;
    {
      absl::MutexLock lock(&state_.mu);
      b = state_.table.find(p.name());
    }
    // A dense bucket keeps only a velocity (momentum correction).
    const bool dense_mismatch = b != nullptr && b->dense && !p.residual().empty();
    if (b == nullptr || b->count != p.count() || dense_mismatch) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the state in ", path, " has bucket '", p.name(), "' of ", p.count(), " elements; ",
          b == nullptr ? "no process registered it here (register every buffer first)"
                       : absl::StrCat("here it has ", b->count, " elements",
                                      b->dense ? " and is reduced dense" : "")));
    }
    auto c = FromProto(p);
    if (!c.ok()) return absl::DataLossError(absl::StrCat(path, ": ", c.status().message()));
    if (b->dense) {
      dense_loads.emplace_back(b, std::move(c).value());
      continue;
    }
    RETURN_IF_ERROR(runner_.EnsureState(*b));
    RETURN_IF_ERROR(b->state->CheckCheckpoint(*c));
    loads.emplace_back(b, std::move(c).value());
  }
  for (auto& [b, c] : loads) RETURN_IF_ERROR(b->state->Load(c));
  for (auto& [b, c] : dense_loads) {
    if (c.velocity.empty()) continue;
    if (!b->velocity.ok()) b->velocity.Reset(ops_, b->count);
    if (!b->velocity.ok() ||
        ops_->CopyToDevice(b->velocity.get(), c.velocity.data(), b->count * sizeof(float),
                           nullptr) != kernels::KernelStatus::kOk) {
      return absl::ResourceExhaustedError(
          absl::StrCat("bucket '", b->name, "': cannot load its velocity"));
    }
  }
  return absl::OkStatus();
}

}  // namespace microd::engine
