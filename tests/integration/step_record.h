// SPDX-License-Identifier: Apache-2.0
// What one node's run of a bucket produced, step by step, in a form two runs
// (in-process and over Gloo in separate processes) can compare bit for bit.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "daemon/sim/synthetic.h"
#include "daemon/sparsify/bucket.h"

namespace microd::testing {

inline uint64_t Fnv1a(const void* data, size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

struct StepRecord {
  uint64_t step = 0;
  uint64_t selected = 0;
  uint64_t threshold_bits = 0;  // the double's bits
  uint64_t update_hash = 0;
  uint64_t residual_hash = 0;

  std::string ToLine() const {
    return absl::StrFormat("%d %d %x %x %x", step, selected, threshold_bits, update_hash,
                           residual_hash);
  }
  static bool FromLine(const std::string& line, StepRecord* r) {
    unsigned long long a, b, c, d, e;
    if (std::sscanf(line.c_str(), "%llu %llu %llx %llx %llx", &a, &b, &c, &d, &e) != 5) {
      return false;
    }
    *r = {a, b, c, d, e};
    return true;
  }
  bool operator==(const StepRecord& o) const {
    return step == o.step && selected == o.selected && threshold_bits == o.threshold_bits &&
           update_hash == o.update_hash && residual_hash == o.residual_hash;
  }
};

// Runs `steps` steps of `bucket` on this node's synthetic stream.
// `before_step(t)` runs first in every step (a test hook). Stops at the first
// error and returns it with the records so far.
template <typename Hook>
absl::Status RunAndRecord(sparsify::BucketState& bucket, transport::Transport& transport,
                          const sim::SyntheticOptions& stream_options, int node, uint64_t steps,
                          absl::Duration step_timeout, Hook before_step,
                          std::vector<StepRecord>* records) {
  sim::SyntheticGradients stream(stream_options, node);
  const uint64_t d = stream_options.size;
  std::vector<float> grad(d), update(d);
  for (uint64_t t = 0; t < steps; ++t) {
    before_step(t);
    stream.Next(grad.data());
    auto s = bucket.Step(grad.data(), update.data(), transport, absl::Now() + step_timeout);
    if (!s.ok()) return s.status();
    StepRecord r;
    r.step = s->step;
    r.selected = s->selected;
    std::memcpy(&r.threshold_bits, &s->threshold, 8);
    r.update_hash = Fnv1a(update.data(), d * sizeof(float));
    const float* e = bucket.residual();
    r.residual_hash = e != nullptr ? Fnv1a(e, d * sizeof(float)) : 0;
    records->push_back(r);
  }
  return absl::OkStatus();
}

}  // namespace microd::testing
