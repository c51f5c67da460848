// SPDX-License-Identifier: Apache-2.0
#include "daemon/engine/engine_status.h"

namespace microd::engine {

void FillEngineStatus(const EngineSnapshot& snap, microd::v1::GetStatusResponse* r) {
  r->set_batches(snap.batches);
  r->set_cache_batches(snap.cache_batches);
  r->set_cycle_reductions(snap.cycle_reductions);
  r->set_transport_scratch_bytes(snap.transport_scratch_bytes);
  r->set_data_plane_sealed(snap.sealed);
  r->set_refused_transfers(snap.refused_transfers);
  r->set_membership_epoch(snap.epoch);
  r->set_last_recovery_seconds(snap.last_recovery_seconds);
  if (!snap.failure.empty()) {
    r->set_job_state(microd::v1::JOB_STATE_FAILED);
    if (r->failure().empty()) r->set_failure(snap.failure);
  }
  for (const BucketStats& b : snap.buckets) {
    auto* s = r->add_buckets();
    s->set_name(b.name);
    s->set_count(b.count);
    s->set_dense(b.dense);
    s->set_steps(b.steps);
    s->set_failures(b.failures);
    s->set_skipped_steps(b.skipped);
    s->set_last_selected(b.last_selected);
    s->set_budget(b.budget);
    s->set_last_threshold(b.last_threshold);
    s->set_last_cre(b.last_cre);
    s->set_mean_cre(b.steps > 2 ? b.sum_cre / static_cast<double>(b.steps - 2) : 0.0);
    s->set_bytes_sent(b.bytes_sent);
    s->set_bytes_received(b.bytes_received);
    s->set_local_sum_seconds(b.local_sum_seconds);
    s->set_select_seconds(b.select_seconds);
    s->set_exchange_seconds(b.exchange_seconds);
    s->set_writeback_seconds(b.writeback_seconds);
    s->set_negotiate_seconds(b.negotiate_seconds);
    s->set_last_rounds(b.last_rounds);
    s->set_rounds(b.rounds);
    s->set_state_bytes(b.state_bytes);
    for (const StepSample& h : b.history) {
      auto* p = s->add_history();
      p->set_step(h.step);
      p->set_selected(h.selected);
      p->set_budget(h.budget);
      p->set_threshold(h.threshold);
      p->set_cre(h.cre);
      p->set_rounds(h.rounds);
    }
  }
}

}  // namespace microd::engine
