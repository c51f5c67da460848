// SPDX-License-Identifier: Apache-2.0
// Prometheus metrics of one daemon (--metrics=HOST:PORT serves /metrics in
// the text format, with prometheus-cpp): built at each scrape from the same
// status the Admin service answers (microctl --json) and the engine's
// per-step histograms, so the two never disagree.
//
//   microd_build_info{version,transport,sparsifier,controller}   gauge 1
//   microd_job_state{state}                   gauge, 1 for the current state
//   microd_nodes, microd_world_size, microd_node_rank, microd_processes,
//   microd_stalls, microd_uptime_seconds       gauges
//   microd_batches_total{kind="schedule"|"cache"}, microd_cycle_reductions_total
//   per bucket (label bucket):
//     microd_bucket_elements, microd_bucket_selected (K), microd_bucket_budget (k),
//     microd_bucket_threshold, microd_bucket_last_cre            gauges
//     microd_bucket_steps_total, microd_bucket_sent_bytes_total,
//     microd_bucket_received_bytes_total,
//     microd_bucket_failures_total{cause="step"|"nonfinite_skipped"} counters
//     microd_bucket_cre                  histogram (sparse steps from step 2)
//     microd_bucket_step_seconds{phase}  histogram (waiting, local_sum,
//                                        selection, exchange, write_back)
#pragma once

#include <prometheus/collectable.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/engine/stats.h"
#include "microd/v1/admin.pb.h"

namespace prometheus {
class Exposer;
}

namespace microd::engine {

class MetricsCollector final : public prometheus::Collectable {
 public:
  // Fills the Admin status and the engine's per-bucket statistics (their
  // histograms), from one snapshot.
  using Source = std::function<void(microd::v1::GetStatusResponse*, std::vector<BucketStats>*)>;
  explicit MetricsCollector(Source source) : source_(std::move(source)) {}

  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  const Source source_;
};

// Serves `collector` at http://address/metrics; the port bound (address may
// give port 0).
class MetricsServer {
 public:
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(
      const std::string& address, std::shared_ptr<MetricsCollector> collector);
  ~MetricsServer();
  int port() const { return port_; }

 private:
  MetricsServer() = default;
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::shared_ptr<MetricsCollector> collector_;
  int port_ = 0;
};

}  // namespace microd::engine
