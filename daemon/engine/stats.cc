#include "daemon/engine/stats.h"

namespace microd::engine {

void BucketStats::AddDense(double local_sum, double exchange, double writeback) {
  ++steps;
  budget = last_selected = count;
  bytes_sent += count * sizeof(float);
  bytes_received += count * sizeof(float);
  local_sum_seconds += local_sum;
  exchange_seconds += exchange;
  writeback_seconds += writeback;
}

void BucketStats::AddSparse(const sparsify::StepStats& st, double local_sum, double writeback,
                            size_t history_limit) {
  ++steps;
  budget = st.budget;
  last_selected = st.selected;
  last_threshold = st.threshold;
  last_cre = st.cre;
  if (st.step >= 2) sum_cre += st.cre;
  bytes_sent += st.bytes_sent;
  bytes_received += st.bytes_received;
  local_sum_seconds += local_sum;
  select_seconds += st.select_seconds;
  exchange_seconds += st.exchange_seconds;
  writeback_seconds += st.apply_seconds + writeback;
  if (history_limit > 0) {
    if (history.size() >= history_limit) history.pop_front();
    history.push_back({st.step, st.selected, st.budget, st.threshold, st.cre});
  }
}

}  // namespace microd::engine
