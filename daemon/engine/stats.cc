// SPDX-License-Identifier: Apache-2.0
#include "daemon/engine/stats.h"

namespace microd::engine {

void Histogram::Observe(double x) {
  for (size_t i = 0; i < counts.size(); ++i) {
    if (x <= (*bounds)[i]) {
      ++counts[i];
      break;
    }
  }
  ++count;
  sum += x;
}

const std::vector<double>& SecondsBounds() {
  static const std::vector<double> b = {1e-5, 1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2,
                                        5e-2, 0.1,  0.25, 0.5,  1,      2.5,  5,    10};
  return b;
}

const std::vector<double>& CreBounds() {
  static const std::vector<double> b = {1e-4,   5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2,
                                        2.5e-2, 5e-2, 0.1,  0.25,   0.5,  1};
  return b;
}

const char* PhaseName(Phase p) {
  switch (p) {
    case Phase::kWaiting:
      return "waiting";
    case Phase::kLocalSum:
      return "local_sum";
    case Phase::kSelection:
      return "selection";
    case Phase::kExchange:
      return "exchange";
    case Phase::kWriteBack:
      return "write_back";
  }
  return "?";
}

void BucketStats::AddWaiting(double seconds) {
  negotiate_seconds += seconds;
  phase_seconds[static_cast<int>(Phase::kWaiting)].Observe(seconds);
}

void BucketStats::AddDense(double local_sum, double exchange, double writeback) {
  ++steps;
  budget = last_selected = count;
  bytes_sent += count * sizeof(float);
  bytes_received += count * sizeof(float);
  local_sum_seconds += local_sum;
  exchange_seconds += exchange;
  writeback_seconds += writeback;
  phase_seconds[static_cast<int>(Phase::kLocalSum)].Observe(local_sum);
  phase_seconds[static_cast<int>(Phase::kExchange)].Observe(exchange);
  phase_seconds[static_cast<int>(Phase::kWriteBack)].Observe(writeback);
}

void BucketStats::AddSparse(const sparsify::StepStats& st, double local_sum, double writeback,
                            size_t history_limit) {
  ++steps;
  budget = st.budget;
  last_selected = st.selected;
  last_threshold = st.threshold;
  last_cre = st.cre;
  last_rounds = st.rounds;
  rounds += st.rounds;
  if (st.step >= 2) sum_cre += st.cre;
  bytes_sent += st.bytes_sent;
  bytes_received += st.bytes_received;
  local_sum_seconds += local_sum;
  select_seconds += st.select_seconds;
  exchange_seconds += st.exchange_seconds;
  writeback_seconds += st.apply_seconds + writeback;
  phase_seconds[static_cast<int>(Phase::kLocalSum)].Observe(local_sum);
  phase_seconds[static_cast<int>(Phase::kSelection)].Observe(st.select_seconds);
  phase_seconds[static_cast<int>(Phase::kExchange)].Observe(st.exchange_seconds);
  phase_seconds[static_cast<int>(Phase::kWriteBack)].Observe(st.apply_seconds + writeback);
  if (st.step >= 2) cre_histogram.Observe(st.cre);
  if (history_limit > 0) {
    if (history.size() >= history_limit) history.pop_front();
    history.push_back({st.step, st.selected, st.budget, st.threshold, st.cre, st.rounds});
  }
}

}  // namespace microd::engine
