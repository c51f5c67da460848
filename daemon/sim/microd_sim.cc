// SPDX-License-Identifier: Apache-2.0
// microd-sim: runs the MiCRO step (or another sparsifier) on n simulated
// nodes over the in-process transport with synthetic gradient streams, and
// prints per-step K, CRE and bytes per node plus a summary. Several
// controllers (or sparsifiers) given as a comma list run one after the other
// on the same streams and are compared side by side.
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "daemon/sim/simulator.h"

ABSL_FLAG(int, nodes, 4, "simulated nodes (MiCRO workers)");
ABSL_FLAG(int, processes_per_node, 1, "training processes per node (sets W)");
ABSL_FLAG(uint64_t, size, 1 << 20, "bucket size d in fp32 elements");
ABSL_FLAG(double, density, 0.01, "target density rho in (0, 1]");
ABSL_FLAG(std::string, sparsifier, "micro", "micro, topk, hard or dense (comma list to compare)");
ABSL_FLAG(std::string, controller, "hist", "hist or paper (comma list to compare)");
ABSL_FLAG(uint64_t, steps, 200, "steps to simulate");
ABSL_FLAG(uint64_t, seed, 1, "seed of the synthetic gradient streams");
ABSL_FLAG(int, layers, 16, "layers in the synthetic bucket");
ABSL_FLAG(int, every, 1, "print every N-th step (0: summary only)");
ABSL_FLAG(std::string, json, "", "write the results as JSON to this file ('-' for stdout)");

namespace {

using microd::sim::SimOptions;
using microd::sim::SimResult;

struct Run {
  std::string label;
  SimOptions options;
  SimResult result;
};

std::string Json(const std::vector<Run>& runs) {
  std::string out = "{\"runs\":[";
  for (size_t i = 0; i < runs.size(); ++i) {
    const Run& r = runs[i];
    const SimResult& s = r.result;
    absl::StrAppendFormat(
        &out,
        "%s{\"label\":\"%s\",\"sparsifier\":\"%s\",\"controller\":\"%s\",\"nodes\":%d,"
        "\"size\":%d,\"density\":%.6g,\"budget\":%d,\"steps\":%d,\"mean_cre_from_step_2\":%.6g,"
        "\"mean_cre_last_half\":%.6g,\"within_10pct\":%.6g,\"first_step_within_10pct\":%d,"
        "\"mean_density\":%.6g,\"mean_bytes_per_node\":%.6g,\"dense_bytes_per_node\":%.6g,"
        "\"per_step\":[",
        i ? "," : "", r.label, microd::sparsify::SparsifierName(r.options.sparsify.sparsifier),
        microd::sparsify::ControllerName(r.options.sparsify.controller), r.options.nodes,
        r.options.stream.size, r.options.sparsify.density, s.budget, r.options.steps,
        s.mean_cre_from_2, s.mean_cre_last_half, s.within_10pct, s.first_within_10pct,
        s.mean_density, s.mean_bytes_per_node, s.dense_bytes_per_node);
    for (size_t t = 0; t < s.steps.size(); ++t) {
      const auto& st = s.steps[t];
      absl::StrAppendFormat(&out,
                            "%s{\"step\":%d,\"K\":%d,\"sum_counts\":%d,\"max_count\":%d,"
                            "\"cre\":%.6g,\"threshold\":%.9g,\"bytes_per_node\":%.6g,"
                            "\"rescans\":%d,\"seconds\":%.6g}",
                            t ? "," : "", st.step, st.selected, st.sum_of_counts, st.max_count,
                            st.cre, st.threshold, st.bytes_per_node, st.rescans, st.seconds);
    }
    out += "]}";
  }
  out += "]}\n";
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "microd-sim: MiCRO on simulated nodes.\n  microd-sim --nodes=4 --size=1048576 "
      "--density=0.01 --controller=hist,paper");
  absl::ParseCommandLine(argc, argv);

  SimOptions base;
  base.nodes = absl::GetFlag(FLAGS_nodes);
  base.processes_per_node = absl::GetFlag(FLAGS_processes_per_node);
  base.steps = absl::GetFlag(FLAGS_steps);
  base.sparsify.density = absl::GetFlag(FLAGS_density);
  base.stream.size = absl::GetFlag(FLAGS_size);
  base.stream.seed = absl::GetFlag(FLAGS_seed);
  base.stream.num_layers = absl::GetFlag(FLAGS_layers);
  const int every = absl::GetFlag(FLAGS_every);
  const std::string json_path = absl::GetFlag(FLAGS_json);
  FILE* text = json_path == "-" ? stderr : stdout;

  std::vector<Run> runs;
  for (absl::string_view sp : absl::StrSplit(absl::GetFlag(FLAGS_sparsifier), ',')) {
    auto sparsifier = microd::sparsify::ParseSparsifier(sp);
    if (!sparsifier.ok()) {
      std::fprintf(stderr, "microd-sim: %s\n", std::string(sparsifier.status().message()).c_str());
      return 2;
    }
    std::vector<std::string> controllers =
        *sparsifier == microd::sparsify::SparsifierKind::kMicro
            ? absl::StrSplit(absl::GetFlag(FLAGS_controller), ',')
            : std::vector<std::string>{"hist"};
    for (const std::string& c : controllers) {
      auto controller = microd::sparsify::ParseController(c);
      if (!controller.ok()) {
        std::fprintf(stderr, "microd-sim: %s\n",
                     std::string(controller.status().message()).c_str());
        return 2;
      }
      Run run;
      run.options = base;
      run.options.sparsify.sparsifier = *sparsifier;
      run.options.sparsify.controller = *controller;
      run.label = *sparsifier == microd::sparsify::SparsifierKind::kMicro ? absl::StrCat(sp, "/", c)
                                                                          : std::string(sp);
      runs.push_back(run);
    }
  }

  for (Run& run : runs) {
    std::fprintf(text, "== %s: %d nodes, d = %llu, density %g, %llu steps\n", run.label.c_str(),
                 run.options.nodes, static_cast<unsigned long long>(run.options.stream.size),
                 run.options.sparsify.density, static_cast<unsigned long long>(run.options.steps));
    auto result = microd::sim::RunSimulation(run.options);
    if (!result.ok()) {
      std::fprintf(stderr, "microd-sim: %s: %s\n", run.label.c_str(),
                   std::string(result.status().message()).c_str());
      return 1;
    }
    run.result = *result;
    const SimResult& s = run.result;
    if (every > 0) {
      std::fprintf(text, "%6s %10s %8s %8s %12s %14s %7s\n", "step", "K", "K/k", "CRE", "threshold",
                   "bytes/node", "rescan");
      for (const auto& st : s.steps) {
        if (st.step % every != 0 && st.step + 1 != s.steps.size()) continue;
        std::fprintf(text, "%6llu %10llu %8.3f %7.2f%% %12.4g %14.0f %7d\n",
                     static_cast<unsigned long long>(st.step),
                     static_cast<unsigned long long>(st.selected),
                     static_cast<double>(st.selected) / s.budget, 100 * st.cre, st.threshold,
                     st.bytes_per_node, st.rescans);
      }
    }
  }

  std::fprintf(text, "\nSummary (k = %llu per step)\n",
               static_cast<unsigned long long>(runs[0].result.budget));
  std::fprintf(text, "%-14s %12s %12s %10s %12s %10s %14s %12s\n", "run", "CRE from t=2",
               "CRE 2nd half", "in +-10%", "first <=10%", "density", "bytes/node", "vs dense");
  for (const Run& run : runs) {
    const SimResult& s = run.result;
    std::fprintf(text, "%-14s %11.2f%% %11.2f%% %9.0f%% %12lld %9.4f%% %14.0f %11.0fx\n",
                 run.label.c_str(), 100 * s.mean_cre_from_2, 100 * s.mean_cre_last_half,
                 100 * s.within_10pct, static_cast<long long>(s.first_within_10pct),
                 100 * s.mean_density, s.mean_bytes_per_node,
                 s.mean_bytes_per_node > 0 ? s.dense_bytes_per_node / s.mean_bytes_per_node : 0);
  }
  if (!json_path.empty()) {
    const std::string json = Json(runs);
    if (json_path == "-") {
      std::fputs(json.c_str(), stdout);
    } else {
      FILE* f = std::fopen(json_path.c_str(), "w");
      if (f == nullptr || std::fputs(json.c_str(), f) < 0 || std::fclose(f) != 0) {
        std::fprintf(stderr, "microd-sim: cannot write %s\n", json_path.c_str());
        return 1;
      }
    }
  }
  return 0;
}
