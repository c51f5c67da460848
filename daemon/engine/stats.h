// SPDX-License-Identifier: Apache-2.0
// What the engine counts: per bucket (cumulative since start, with the last
// sparse steps) and per daemon.
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "daemon/sparsify/bucket.h"

namespace microd::engine {

// Counts of observations at or below each bound (the last: all of them),
// as Prometheus histograms keep them; the bounds are fixed per kind.
struct Histogram {
  explicit Histogram(const std::vector<double>* bounds = nullptr)
      : bounds(bounds), counts(bounds != nullptr ? bounds->size() : 0, 0) {}
  void Observe(double x);

  const std::vector<double>* bounds;  // upper bounds, increasing
  std::vector<uint64_t> counts;       // not cumulative, by bound
  uint64_t count = 0;                 // observations (the +Inf bucket)
  double sum = 0;
};

// Bounds of the step-phase (seconds) and CRE histograms.
const std::vector<double>& SecondsBounds();
const std::vector<double>& CreBounds();

// The phases of a step, as the time split and the histograms name them.
enum class Phase { kWaiting, kLocalSum, kSelection, kExchange, kWriteBack };
inline constexpr int kPhases = 5;
const char* PhaseName(Phase p);

// One sparse step of one bucket.
struct StepSample {
  uint64_t step = 0;
  uint64_t selected = 0;
  uint64_t budget = 0;
  double threshold = 0;
  double cre = 0;
  uint64_t rounds = 0;
};

// Per-bucket statistics (cumulative since start).
struct BucketStats {
  std::string name;
  uint64_t count = 0;
  bool dense = false;
  uint64_t steps = 0;
  uint64_t failures = 0;
  uint64_t skipped = 0;  // steps skipped for a NaN/Inf (--nonfinite=skip)
  uint64_t last_selected = 0;
  uint64_t budget = 0;
  double last_threshold = 0;
  double last_cre = 0;
  double sum_cre = 0;        // over steps >= 2
  uint64_t last_rounds = 0;  // communication rounds of the last sparse step
  uint64_t rounds = 0;       // over every sparse step
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
  // The daemon's memory for the bucket after its last step: a sparse
  // bucket's state (BucketState::AllocatedBytes), a dense one's velocity.
  uint64_t state_bytes = 0;
  // From ready on this node (every local process submitted) to the start of
  // its step: the other nodes, the coordinator's answer, earlier batches.
  double negotiate_seconds = 0;
  double local_sum_seconds = 0;
  double select_seconds = 0;
  double exchange_seconds = 0;
  double writeback_seconds = 0;
  std::deque<StepSample> history;  // the last EngineOptions::stats_history steps
  // Per step: each phase's seconds, and the CRE of sparse steps from step 2.
  std::vector<Histogram> phase_seconds =
      std::vector<Histogram>(kPhases, Histogram(&SecondsBounds()));
  Histogram cre_histogram{&CreBounds()};

  // The wait from ready on this node to the start of a step.
  void AddWaiting(double seconds);

  // A dense step of this bucket's `count` elements, with its share of the
  // times of the fused allreduce or cycle it rode in.
  void AddDense(double local_sum, double exchange, double writeback);
  // A sparse step, as the bucket's state reported it; `history` sparse
  // steps kept at most.
  void AddSparse(const sparsify::StepStats& st, double local_sum, double writeback,
                 size_t history_limit);
};

struct EngineSnapshot {
  std::string failure;  // empty while healthy
  std::vector<BucketStats> buckets;
  uint64_t batches = 0;                  // schedule batches run
  uint64_t cache_batches = 0;            // batches of cached buckets agreed over the data plane
  uint64_t cycle_reductions = 0;         // bucket steps reduced by the cycle itself
  uint64_t transport_scratch_bytes = 0;  // the transport's working memory (not a bucket's)
  bool sealed = false;                   // the data plane's transfers are sealed
  uint64_t refused_transfers = 0;        // sealed transfers that failed verification
  uint64_t epoch = 0;                    // this node's membership epoch
  double last_recovery_seconds = 0;      // the last change of membership, start to running
};

}  // namespace microd::engine
