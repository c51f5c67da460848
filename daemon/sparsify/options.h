// SPDX-License-Identifier: Apache-2.0
// Per-job sparsification settings and the small pure functions of the
// algorithm (docs/design.md section 1): partitions, their cyclic assignment and
// the budget k.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace microd::sparsify {

enum class SparsifierKind : int { kMicro = 0, kTopK = 1, kHard = 2, kDense = 3 };
enum class ControllerKind : int {
  kPaper = 0,      // MiCRO as published
  kHistogram = 1,  // ours: same-step global histogram of candidates (default)
};

absl::StatusOr<SparsifierKind> ParseSparsifier(absl::string_view name);
absl::StatusOr<ControllerKind> ParseController(absl::string_view name);
const char* SparsifierName(SparsifierKind kind);
const char* ControllerName(ControllerKind kind);

struct SparsifyOptions {
  SparsifierKind sparsifier = SparsifierKind::kMicro;
  ControllerKind controller = ControllerKind::kHistogram;
  // Target density rho in (0, 1].
  double density = 0.01;
  // `hard` sparsifier's constant threshold; 0 means 1 / (2 sqrt(k)).
  double hard_threshold = 0.0;
  // Momentum correction (Deep Gradient Compression): a velocity
  // m = momentum * m + g per bucket is accumulated instead of g, and zeroed
  // where selected. 0 turns it off; the training side then must not apply
  // momentum again. Not used by `dense`.
  double momentum = 0.0;
  // Warm-up (identical on every node: it depends only on the bucket's step
  // counter). The first `warmup_steps` steps of a bucket are dense. Then, if
  // warmup_density > 0, the density decays exponentially from it to
  // `density` over `warmup_decay_steps` steps (as Deep Gradient Compression).
  // Local gradient clipping before accumulation (Deep Gradient Compression):
  // when the L2 norm of this node's gradient of the bucket exceeds
  // clip_norm / sqrt(n), it is scaled down to that norm. 0: off. Per bucket.
  double clip_norm = 0.0;
  uint64_t warmup_steps = 0;
  double warmup_density = 0.0;
  uint64_t warmup_decay_steps = 0;
  // During the decay, a step whose density is above this runs dense: a
  // sparse step at density x holds its selection (candidates, indices and
  // values: O(x d) bytes beside the residual), a dense one a fixed tile,
  // at the cost of a dense step's bytes on the wire. 0: off.
  double warmup_dense_above = 0.0;
  // A bucket whose budget at `density` would be below min_k elements is
  // sparsified at the density that gives it min_k (all of it if smaller):
  // at a few dozen values per step error feedback holds back most of the
  // gradient for too long to train. 0: off.
  uint64_t min_k = 0;

  // Target density at step t of a bucket (before `warmup_steps`: 1).
  double DensityAt(uint64_t t) const;
  // Whether step t is a dense step of the warm-up (before `warmup_steps`,
  // or in the decay above `warmup_dense_above`).
  bool DenseAt(uint64_t t) const;
  // The first step at or after t that is not (the density only falls).
  uint64_t SparseFrom(uint64_t t) const;
  // These options for a bucket of d elements: `density` (and a warm-up
  // density below it) raised where min_k asks for it.
  SparsifyOptions ForBucket(uint64_t d) const;

  absl::Status Validate() const;
};

// The remedies the daemon applies by itself for a low density (--remedies):
// each only where its own flags are left at their defaults, so any of them
// is tuned by its flag and switched off by leaving it out of the set.
struct RemedySet {
  // Dense steps, then an exponential decay of the density (Deep Gradient
  // Compression's warm-up). Not in "auto": once k has its floor, the
  // sweeps measured no gain from it (the demo's CNN, 5 seeds; the MLP) for
  // 6-190x the bytes (docs/benchmarks.md, "Which densities train").
  bool warmup = false;
  bool min_k = true;  // a floor on each bucket's budget
};
// "auto" (min_k), "off" (none) or a comma-separated subset of warmup, min_k.
absl::StatusOr<RemedySet> ParseRemedies(absl::string_view text);
// The density below which the daemon's remedies apply (at and above it the
// job runs as configured: measured in docs/benchmarks.md).
inline constexpr double kRemedyDensity = 0.005;
// The warm-up's schedule: dense steps, the density it starts from, and the
// steps per 4x decrease of the density.
inline constexpr uint64_t kWarmupDenseSteps = 50;
inline constexpr double kWarmupStartDensity = 0.25;
inline constexpr double kWarmupStageSteps = 100;
// The floor on a bucket's budget.
inline constexpr uint64_t kMinK = 2000;
// Fills in the remedies of `set` that `o`'s density needs where `o` leaves
// them unset; returns one line per remedy applied, for the log and status.
std::vector<std::string> ApplyRemedies(const RemedySet& set, SparsifyOptions* o);

// The shape of the job as one node sees it.
struct JobShape {
  int num_nodes = 1;   // n: MiCRO workers (one daemon each)
  int node_rank = 0;   // r in [0, n)
  int world_size = 1;  // W: training processes in the job (sum of local sizes)

  absl::Status Validate() const;
};

// Partition i of a bucket of d elements split into n: [begin, end).
struct Range {
  uint64_t begin = 0;
  uint64_t end = 0;
  uint64_t size() const { return end - begin; }
};
Range PartitionRange(uint64_t d, int n, int i);
// Partition owned by node r at step t: (t + r) mod n.
int OwnedPartition(int r, uint64_t t, int n);
// k = max(1, floor(rho * d)).
uint64_t Budget(double density, uint64_t d);

}  // namespace microd::sparsify
