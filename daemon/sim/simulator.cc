// SPDX-License-Identifier: Apache-2.0
#include "daemon/sim/simulator.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <thread>

#include "absl/strings/str_cat.h"
#include "daemon/sparsify/bucket.h"
#include "daemon/transport/inproc/inproc_transport.h"
#include "kernels/sparse_ops.h"

namespace microd::sim {

absl::StatusOr<SimResult> RunSimulation(const SimOptions& o) {
  if (o.nodes < 1) return absl::InvalidArgumentError("simulation needs at least one node");
  if (o.processes_per_node < 1) {
    return absl::InvalidArgumentError("simulation needs at least one process per node");
  }
  std::unique_ptr<kernels::SparseOps> ops = kernels::CreateCpuSparseOps();
  auto group = transport::CreateInprocGroup(o.nodes);
  sparsify::BucketSpec spec{"sim", o.stream.size, 0};

  std::vector<std::unique_ptr<sparsify::BucketState>> buckets(o.nodes);
  for (int r = 0; r < o.nodes; ++r) {
    sparsify::JobShape job{o.nodes, r, o.nodes * o.processes_per_node};
    auto b = sparsify::BucketState::Create(spec, job, o.sparsify, ops.get());
    if (!b.ok()) return b.status();
    buckets[r] = std::move(b).value();
  }

  std::vector<std::vector<sparsify::StepStats>> stats(o.nodes);
  std::vector<std::vector<double>> seconds(o.nodes);
  std::vector<absl::Status> status(o.nodes);
  std::vector<double> max_residual(o.nodes, 0.0);
  std::vector<std::thread> threads;
  for (int r = 0; r < o.nodes; ++r) {
    threads.emplace_back([&, r] {
      SyntheticGradients stream(o.stream, r);
      std::vector<float> grad(o.stream.size), update(o.stream.size);
      for (uint64_t t = 0; t < o.steps; ++t) {
        stream.Next(grad.data());
        const auto start = std::chrono::steady_clock::now();
        auto s = buckets[r]->Step(grad.data(), update.data(), *group[r],
                                  absl::Now() + absl::Seconds(120));
        seconds[r].push_back(
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
        if (!s.ok()) {
          status[r] = s.status();
          group[r]->Abort(s.status());
          return;
        }
        stats[r].push_back(*s);
      }
      if (const float* e = buckets[r]->residual()) {
        for (uint64_t i = 0; i < o.stream.size; ++i) {
          max_residual[r] = std::max<double>(max_residual[r], std::fabs(e[i]));
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& s : status) {
    if (!s.ok()) return s;
  }

  SimResult res;
  res.budget = buckets[0]->budget();
  res.dense_bytes_per_node = 4.0 * static_cast<double>(o.stream.size);
  double cre_sum = 0, cre_half = 0, within = 0, density = 0, bytes = 0;
  uint64_t n_from_2 = 0, n_half = 0;
  for (uint64_t t = 0; t < o.steps; ++t) {
    const sparsify::StepStats& s0 = stats[0][t];
    SimStep st;
    st.step = t;
    st.selected = s0.selected;
    st.sum_of_counts = s0.sum_of_counts;
    for (uint64_t c : s0.node_counts) st.max_count = std::max(st.max_count, c);
    st.cre = s0.cre;
    st.threshold = s0.threshold;
    st.rescans = s0.rescans;
    for (int r = 0; r < o.nodes; ++r) {
      st.bytes_per_node += static_cast<double>(stats[r][t].bytes_sent) / o.nodes;
      st.seconds = std::max(st.seconds, seconds[r][t]);
    }
    if (t >= 2) {
      cre_sum += st.cre;
      within += st.cre <= 0.10;
      ++n_from_2;
    }
    if (t >= o.steps / 2) {
      cre_half += st.cre;
      ++n_half;
    }
    if (res.first_within_10pct < 0 && st.cre <= 0.10) res.first_within_10pct = t;
    density += static_cast<double>(st.selected) / static_cast<double>(o.stream.size);
    bytes += st.bytes_per_node;
    res.steps.push_back(st);
  }
  res.mean_cre_from_2 = n_from_2 ? cre_sum / n_from_2 : 0;
  res.mean_cre_last_half = n_half ? cre_half / n_half : 0;
  res.within_10pct = n_from_2 ? within / n_from_2 : 0;
  res.mean_density = o.steps ? density / o.steps : 0;
  res.mean_bytes_per_node = o.steps ? bytes / o.steps : 0;
  res.max_residual = *std::max_element(max_residual.begin(), max_residual.end());
  return res;
}

}  // namespace microd::sim
