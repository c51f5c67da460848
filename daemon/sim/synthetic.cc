// SPDX-License-Identifier: Apache-2.0
#include "daemon/sim/synthetic.h"

#include <algorithm>
#include <cmath>

namespace microd::sim {
namespace {

constexpr int kTableBits = 16;

uint64_t SplitMix(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

double Uniform(uint64_t& state) {  // (0, 1)
  return (static_cast<double>(SplitMix(state) >> 11) + 0.5) * 0x1p-53;
}

double Normal(uint64_t& state) {
  const double u1 = Uniform(state);
  const double u2 = Uniform(state);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

}  // namespace

SyntheticGradients::SyntheticGradients(const SyntheticOptions& options, int node)
    : options_(options),
      shared_state_(options.seed * 0x2545F4914F6CDD1Dull + 17),
      node_state_((options.seed + 1) * 0x9E3779B97F4A7C15ull ^
                  (static_cast<uint64_t>(node) << 32)) {
  const int layers = std::max(1, options_.num_layers);
  // Layer sizes: random proportions, so partitions cut across layers.
  std::vector<double> weight(layers);
  double total = 0;
  for (double& w : weight) total += (w = 0.2 + Uniform(shared_state_));
  uint64_t end = 0;
  double acc = 0;
  for (int l = 0; l < layers; ++l) {
    acc += weight[l];
    end = l + 1 == layers ? options_.size
                          : static_cast<uint64_t>(acc / total * static_cast<double>(options_.size));
    layer_end_.push_back(end);
    const double lo = std::log(options_.min_scale);
    const double hi = std::log(options_.max_scale);
    log_scale_.push_back(lo + (hi - lo) * Uniform(shared_state_));
  }
  tail_table_.resize(size_t{1} << kTableBits);
  for (float& v : tail_table_) {
    double chi2 = 0;
    for (int i = 0; i < 3; ++i) {
      const double z = Normal(shared_state_);
      chi2 += z * z;
    }
    v = static_cast<float>(Normal(shared_state_) / std::sqrt(chi2 / 3.0));
  }
  direction_.resize(options_.size);
  for (float& v : direction_) {
    v = static_cast<float>(options_.signal) *
        tail_table_[SplitMix(shared_state_) & ((1u << kTableBits) - 1)];
  }
}

void SyntheticGradients::Next(float* out) {
  const double global = options_.step_noise * Normal(shared_state_);
  uint64_t begin = 0;
  for (size_t l = 0; l < layer_end_.size(); ++l) {
    log_scale_[l] += options_.drift * Normal(shared_state_);
    const float scale = static_cast<float>(
        std::exp(log_scale_[l] + global + options_.layer_noise * Normal(shared_state_)));
    for (uint64_t i = begin; i < layer_end_[l]; ++i) {
      const uint64_t r = SplitMix(node_state_);
      out[i] = scale * (direction_[i] + tail_table_[r & ((1u << kTableBits) - 1)]);
    }
    begin = layer_end_[l];
  }
  ++step_;
}

}  // namespace microd::sim
