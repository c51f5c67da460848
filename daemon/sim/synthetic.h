// SPDX-License-Identifier: Apache-2.0
// Seeded synthetic gradient streams that look like training: a bucket made
// of layers whose scales span orders of magnitude, heavy-tailed values
// (Student-t, 3 degrees of freedom), a persistent per-element direction, slow
// drift of the layer scales and step-to-step noise of the overall and
// per-layer magnitude (which is what makes a threshold from the previous step
// miss: K/k swings by about 2x from one step to the next at a fixed
// threshold, as on real gradients).
#pragma once

#include <cstdint>
#include <vector>

namespace microd::sim {

struct SyntheticOptions {
  uint64_t size = 1 << 20;
  int num_layers = 16;
  uint64_t seed = 1;
  double min_scale = 3e-7;   // smallest layer scale
  double max_scale = 3e-3;   // largest layer scale (gradients are small)
  double step_noise = 0.25;  // sigma of the per-step log magnitude, shared by all layers
  double layer_noise = 0.2;  // sigma of the per-step log magnitude of each layer
  double drift = 0.02;       // sigma of the random walk of each layer's log scale
  double signal = 0.3;       // weight of the persistent direction against the noise
};

class SyntheticGradients {
 public:
  // Every node of one simulation uses the same options (same layers, scales
  // and direction); `node` seeds the node's own noise.
  SyntheticGradients(const SyntheticOptions& options, int node);

  // Writes the next step's gradient (options.size values).
  void Next(float* out);

  uint64_t step() const { return step_; }

 private:
  SyntheticOptions options_;
  std::vector<uint64_t> layer_end_;  // exclusive end of each layer
  std::vector<double> log_scale_;    // current log scale of each layer
  std::vector<float> direction_;     // persistent per-element mean
  std::vector<float> tail_table_;    // Student-t(3) samples, unit scale
  uint64_t shared_state_;            // RNG shared by all nodes (scales)
  uint64_t node_state_;              // this node's RNG (element noise)
  uint64_t step_ = 0;
};

}  // namespace microd::sim
