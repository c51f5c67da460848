// SPDX-License-Identifier: Apache-2.0
// n simulated nodes in one process (one thread each) over the in-process
// transport, each feeding its own synthetic gradient stream into a
// BucketState. Used by microd-sim, `make demo` and the controller tests.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/sim/synthetic.h"
#include "daemon/sparsify/options.h"

namespace microd::sim {

struct SimOptions {
  int nodes = 4;
  int processes_per_node = 1;  // only sets W = nodes * processes_per_node
  uint64_t steps = 200;
  sparsify::SparsifyOptions sparsify;
  SyntheticOptions stream;
};

struct SimStep {
  uint64_t step = 0;
  uint64_t selected = 0;       // K_t
  uint64_t sum_of_counts = 0;  // sum_r |I_r|
  uint64_t max_count = 0;      // max_r |I_r|
  double cre = 0;
  double threshold = 0;
  double bytes_per_node = 0;  // mean payload bytes a node sent
  int rescans = 0;
  double seconds = 0;  // wall time of the step (slowest node)
};

struct SimResult {
  uint64_t budget = 0;  // k
  std::vector<SimStep> steps;
  // Mean CRE over steps t >= 2.
  double mean_cre_from_2 = 0;
  // Mean CRE over the second half of the steps.
  double mean_cre_last_half = 0;
  // Fraction of steps (t >= 2) with CRE <= 10 %.
  double within_10pct = 0;
  // First step t with CRE <= 10 %, or -1 if none.
  int64_t first_within_10pct = -1;
  double mean_density = 0;          // mean K / d
  double mean_bytes_per_node = 0;   // mean payload bytes per node per step
  double dense_bytes_per_node = 0;  // what a dense allreduce would hand over: 4 d
  // Largest residual magnitude at the end, over all nodes (stability check).
  double max_residual = 0;
};

absl::StatusOr<SimResult> RunSimulation(const SimOptions& options);

}  // namespace microd::sim
