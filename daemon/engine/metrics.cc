// SPDX-License-Identifier: Apache-2.0
#include "daemon/engine/metrics.h"

#include <prometheus/exposer.h>
#include <prometheus/metric_family.h>

#include <exception>
#include <limits>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "microd/config.h"

namespace microd::engine {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

MetricFamily Family(const std::string& name, const std::string& help, MetricType type) {
  MetricFamily f;
  f.name = name;
  f.help = help;
  f.type = type;
  return f;
}

ClientMetric Value(MetricType type, double v, std::vector<ClientMetric::Label> labels = {}) {
  ClientMetric m;
  m.label = std::move(labels);
  if (type == MetricType::Counter)
    m.counter.value = v;
  else
    m.gauge.value = v;
  return m;
}

ClientMetric HistogramMetric(const Histogram& h, std::vector<ClientMetric::Label> labels) {
  ClientMetric m;
  m.label = std::move(labels);
  m.histogram.sample_count = h.count;
  m.histogram.sample_sum = h.sum;
  uint64_t cumulative = 0;
  for (size_t i = 0; i < h.counts.size(); ++i) {
    cumulative += h.counts[i];
    m.histogram.bucket.push_back({cumulative, (*h.bounds)[i]});
  }
  m.histogram.bucket.push_back({h.count, std::numeric_limits<double>::infinity()});
  return m;
}

// "running" for JOB_STATE_RUNNING, and so on.
std::string StateName(microd::v1::JobState s) {
  return absl::AsciiStrToLower(absl::StripPrefix(microd::v1::JobState_Name(s), "JOB_STATE_"));
}

// The job's and the node's families.
void AddJobFamilies(const microd::v1::GetStatusResponse& st, std::vector<MetricFamily>* families) {
  std::vector<MetricFamily>& out = *families;
  auto gauge = [&](const std::string& name, const std::string& help, double v) {
    MetricFamily f = Family(name, help, MetricType::Gauge);
    f.metric.push_back(Value(MetricType::Gauge, v));
    out.push_back(std::move(f));
  };
  {
    MetricFamily f =
        Family("microd_build_info", "microd's version and step options", MetricType::Gauge);
    f.metric.push_back(Value(MetricType::Gauge, 1,
                             {{"version", st.version()},
                              {"transport", st.transport()},
                              {"sparsifier", st.sparsifier()},
                              {"controller", st.controller()}}));
    out.push_back(std::move(f));
  }
  {
    MetricFamily f = Family("microd_job_state", "1 for the job's current state", MetricType::Gauge);
    for (auto s : {microd::v1::JOB_STATE_FORMING, microd::v1::JOB_STATE_RUNNING,
                   microd::v1::JOB_STATE_FAILED, microd::v1::JOB_STATE_FINISHED}) {
      f.metric.push_back(
          Value(MetricType::Gauge, st.job_state() == s ? 1 : 0, {{"state", StateName(s)}}));
    }
    out.push_back(std::move(f));
  }
  gauge("microd_nodes", "nodes in the job", st.node_count());
  gauge("microd_world_size", "training processes in the job", st.world_size());
  gauge("microd_node_rank", "this node's rank (-1 before joining)", st.node_rank());
  gauge("microd_processes", "training processes connected to this daemon", st.processes_size());
  gauge("microd_stalls", "buckets the stall inspector reports", st.stalls_size());
  gauge("microd_uptime_seconds", "seconds since the daemon started", st.uptime_seconds());
  gauge("microd_membership_epoch",
        "this node's membership epoch (elastic jobs: one more at each change)",
        static_cast<double>(st.membership_epoch()));
  gauge("microd_membership_last_recovery_seconds",
        "the last change of membership, from its first sign to the new epoch running",
        st.last_recovery_seconds());
  gauge("microd_data_plane_sealed",
        "1 when every transfer between daemons is authenticated and encrypted (--seal)",
        st.data_plane_sealed() ? 1 : 0);
  {
    MetricFamily f = Family("microd_sealed_transfers_refused_total",
                            "transfers from peers that failed verification (altered, replayed or "
                            "not sealed with this job's keys); each failed its step",
                            MetricType::Counter);
    f.metric.push_back(Value(MetricType::Counter, static_cast<double>(st.refused_transfers())));
    out.push_back(std::move(f));
  }
  gauge("microd_transport_scratch_bytes",
        "the transport's working memory beside the buckets' state (allreduce scratch)",
        static_cast<double>(st.transport_scratch_bytes()));
  {
    MetricFamily f =
        Family("microd_batches_total", "batches run, by how they were agreed", MetricType::Counter);
    f.metric.push_back(Value(MetricType::Counter, st.batches(), {{"kind", "schedule"}}));
    f.metric.push_back(Value(MetricType::Counter, st.cache_batches(), {{"kind", "cache"}}));
    out.push_back(std::move(f));
  }
  {
    MetricFamily f =
        Family("microd_cycle_reductions_total",
               "bucket steps reduced by the response cache's cycle itself", MetricType::Counter);
    f.metric.push_back(Value(MetricType::Counter, st.cycle_reductions()));
    out.push_back(std::move(f));
  }
}

// Each bucket's families.
void AddBucketFamilies(const microd::v1::GetStatusResponse& st,
                       const std::vector<BucketStats>& buckets,
                       std::vector<MetricFamily>* families) {
  std::vector<MetricFamily>& out = *families;
  struct PerBucket {
    const char* name;
    const char* help;
    MetricType type;
    std::function<double(const microd::v1::BucketStatus&)> value;
  };
  const std::vector<PerBucket> per_bucket = {
      {"microd_bucket_elements", "elements of the bucket", MetricType::Gauge,
       [](const auto& b) { return static_cast<double>(b.count()); }},
      {"microd_bucket_selected", "K: elements selected across the nodes in the last step",
       MetricType::Gauge, [](const auto& b) { return static_cast<double>(b.last_selected()); }},
      {"microd_bucket_budget", "k: the selection's target in the last step", MetricType::Gauge,
       [](const auto& b) { return static_cast<double>(b.budget()); }},
      {"microd_bucket_threshold", "the selection threshold of the last step", MetricType::Gauge,
       [](const auto& b) { return b.last_threshold(); }},
      {"microd_bucket_last_cre", "|K - k| / k of the last step", MetricType::Gauge,
       [](const auto& b) { return b.last_cre(); }},
      {"microd_bucket_last_rounds",
       "communication rounds of the last sparse step (a batched step's are its buckets')",
       MetricType::Gauge, [](const auto& b) { return static_cast<double>(b.last_rounds()); }},
      {"microd_bucket_rounds_total", "communication rounds over every sparse step",
       MetricType::Counter, [](const auto& b) { return static_cast<double>(b.rounds()); }},
      {"microd_bucket_steps_total", "steps run", MetricType::Counter,
       [](const auto& b) { return static_cast<double>(b.steps()); }},
      {"microd_bucket_sent_bytes_total", "bytes this node sent for the bucket", MetricType::Counter,
       [](const auto& b) { return static_cast<double>(b.bytes_sent()); }},
      {"microd_bucket_received_bytes_total", "bytes this node received for the bucket",
       MetricType::Counter, [](const auto& b) { return static_cast<double>(b.bytes_received()); }},
      {"microd_bucket_state_bytes",
       "the daemon's memory for the bucket (residuals, velocities, scratch) after its last step",
       MetricType::Gauge, [](const auto& b) { return static_cast<double>(b.state_bytes()); }},
  };
  for (const PerBucket& p : per_bucket) {
    MetricFamily f = Family(p.name, p.help, p.type);
    for (const auto& b : st.buckets())
      f.metric.push_back(Value(p.type, p.value(b), {{"bucket", b.name()}}));
    out.push_back(std::move(f));
  }
  {
    MetricFamily f = Family("microd_bucket_failures_total",
                            "steps that failed, by cause (a failed step; a NaN/Inf step skipped)",
                            MetricType::Counter);
    for (const auto& b : st.buckets()) {
      f.metric.push_back(
          Value(MetricType::Counter, b.failures(), {{"bucket", b.name()}, {"cause", "step"}}));
      f.metric.push_back(Value(MetricType::Counter, b.skipped_steps(),
                               {{"bucket", b.name()}, {"cause", "nonfinite_skipped"}}));
    }
    out.push_back(std::move(f));
  }
  MetricFamily cre = Family("microd_bucket_cre", "|K - k| / k per sparse step, from step 2",
                            MetricType::Histogram);
  MetricFamily phases =
      Family("microd_bucket_step_seconds", "seconds per step, by phase", MetricType::Histogram);
  for (const BucketStats& b : buckets) {
    cre.metric.push_back(HistogramMetric(b.cre_histogram, {{"bucket", b.name}}));
    for (int p = 0; p < kPhases; ++p) {
      phases.metric.push_back(HistogramMetric(
          b.phase_seconds[p], {{"bucket", b.name}, {"phase", PhaseName(static_cast<Phase>(p))}}));
    }
  }
  out.push_back(std::move(cre));
  out.push_back(std::move(phases));
}

}  // namespace

std::vector<MetricFamily> MetricsCollector::Collect() const {
  microd::v1::GetStatusResponse st;
  std::vector<BucketStats> buckets;
  source_(&st, &buckets);
  std::vector<MetricFamily> out;
  AddJobFamilies(st, &out);
  AddBucketFamilies(st, buckets, &out);
  return out;
}

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    const std::string& address, std::shared_ptr<MetricsCollector> collector) {
  auto server = std::unique_ptr<MetricsServer>(new MetricsServer());
  try {
    // Several threads and a short request timeout: a connection that sends
    // nothing holds one thread for 2 s at most (civetweb's default is 30 s,
    // and with one thread a single idle connection stopped every scrape).
    server->exposer_ = std::make_unique<prometheus::Exposer>(std::vector<std::string>{
        "listening_ports", address, "num_threads", "4", "request_timeout_ms", "2000"});
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve metrics on ", address, ": ", e.what()));
  }
  const auto ports = server->exposer_->GetListeningPorts();
  if (ports.empty()) return absl::UnavailableError(absl::StrCat("cannot listen on ", address));
  server->port_ = ports[0];
  server->collector_ = std::move(collector);
  server->exposer_->RegisterCollectable(server->collector_);
  return server;
}

MetricsServer::~MetricsServer() = default;

}  // namespace microd::engine
