// SPDX-License-Identifier: Apache-2.0
#include "daemon/sparsify/options.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"

namespace microd::sparsify {

absl::StatusOr<SparsifierKind> ParseSparsifier(absl::string_view name) {
  if (name == "micro") return SparsifierKind::kMicro;
  if (name == "topk") return SparsifierKind::kTopK;
  if (name == "hard") return SparsifierKind::kHard;
  if (name == "dense") return SparsifierKind::kDense;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown sparsifier '", name, "' (expected micro, topk, hard or dense)"));
}

absl::StatusOr<ControllerKind> ParseController(absl::string_view name) {
  if (name == "paper") return ControllerKind::kPaper;
  if (name == "hist") return ControllerKind::kHistogram;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown threshold controller '", name, "' (expected hist or paper)"));
}

const char* SparsifierName(SparsifierKind kind) {
  switch (kind) {
    case SparsifierKind::kMicro:
      return "micro";
    case SparsifierKind::kTopK:
      return "topk";
    case SparsifierKind::kHard:
      return "hard";
    case SparsifierKind::kDense:
      return "dense";
  }
  return "?";
}

const char* ControllerName(ControllerKind kind) {
  switch (kind) {
    case ControllerKind::kPaper:
      return "paper";
    case ControllerKind::kHistogram:
      return "hist";
  }
  return "?";
}

absl::Status SparsifyOptions::Validate() const {
  if (!(density > 0.0 && density <= 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat("density must be in (0, 1], got ", density));
  }
  if (!(clip_norm >= 0.0) || std::isinf(clip_norm)) {
    return absl::InvalidArgumentError(
        absl::StrCat("clipping norm must be finite and >= 0, got ", clip_norm));
  }
  if (!(momentum >= 0.0 && momentum < 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("momentum correction must be in [0, 1), got ", momentum));
  }
  if (warmup_density != 0.0 &&
      !(warmup_density >= density && warmup_density <= 1.0 && warmup_decay_steps > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("warm-up density must be in [density, 1] with a positive decay length, got ",
                     warmup_density, " over ", warmup_decay_steps, " steps"));
  }
  if (warmup_density == 0.0 && warmup_decay_steps > 0) {
    // Without a start density there is nothing to decay from: the flag
    // would do nothing, and with --remedies=auto it would also have kept
    // the default warm-up off.
    return absl::InvalidArgumentError(absl::StrCat(
        "a density decay of ", warmup_decay_steps,
        " steps needs a start density (--warmup_density); without one it does nothing"));
  }
  if (!(warmup_dense_above >= 0.0 && warmup_dense_above <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--warmup_dense_above must be a density in [0, 1], got ", warmup_dense_above));
  }
  if (!(hard_threshold >= 0.0) || std::isinf(hard_threshold)) {
    return absl::InvalidArgumentError(
        absl::StrCat("hard threshold must be finite and >= 0, got ", hard_threshold));
  }
  return absl::OkStatus();
}

SparsifyOptions SparsifyOptions::ForBucket(uint64_t d) const {
  SparsifyOptions o = *this;
  if (min_k == 0 || sparsifier == SparsifierKind::kDense || d == 0 || Budget(density, d) >= min_k) {
    return o;
  }
  // The smallest density whose budget is min_k (or all of d): floor(rho d)
  // must not fall short by rounding.
  o.density = min_k >= d ? 1.0 : std::min(1.0, (static_cast<double>(min_k) + 0.5) / d);
  if (o.warmup_density > 0.0 && o.warmup_density < o.density) o.warmup_density = o.density;
  return o;
}

absl::StatusOr<RemedySet> ParseRemedies(absl::string_view text) {
  if (text == "auto") return RemedySet{};  // the floor on k only
  RemedySet set{false, false};
  if (text == "off") return set;
  for (absl::string_view item : absl::StrSplit(text, ',')) {
    if (item == "warmup") {
      set.warmup = true;
    } else if (item == "min_k") {
      set.min_k = true;
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "unknown remedy '", item, "' (expected auto, off, or a list of warmup, min_k)"));
    }
  }
  return set;
}

std::vector<std::string> ApplyRemedies(const RemedySet& set, SparsifyOptions* o) {
  std::vector<std::string> applied;
  if (o->sparsifier == SparsifierKind::kDense || o->density >= kRemedyDensity) return applied;
  if (set.warmup && o->warmup_steps == 0 && o->warmup_density == 0.0 &&
      o->warmup_decay_steps == 0) {
    // Deep Gradient Compression's schedule, in steps: a few dense steps,
    // then from 25 % down by 4x per stage to the target.
    o->warmup_steps = kWarmupDenseSteps;
    o->warmup_density = kWarmupStartDensity;
    const double stages = std::log(kWarmupStartDensity / o->density) / std::log(4.0);
    o->warmup_decay_steps = static_cast<uint64_t>(std::ceil(stages * kWarmupStageSteps));
    applied.push_back(absl::StrFormat(
        "warm-up: %llu dense steps, then the density decays from %g to %g over %llu steps "
        "(--warmup_steps, --warmup_density, --warmup_decay_steps)",
        static_cast<unsigned long long>(o->warmup_steps), o->warmup_density, o->density,
        static_cast<unsigned long long>(o->warmup_decay_steps)));
    if (o->warmup_dense_above > 0.0) {
      applied.back() += absl::StrFormat(
          "; its steps above density %g run dense, the first sparse one is step %llu "
          "(--warmup_dense_above)",
          o->warmup_dense_above, static_cast<unsigned long long>(o->SparseFrom(0)));
    }
  }
  if (set.min_k && o->min_k == 0) {
    o->min_k = kMinK;
    applied.push_back(absl::StrFormat(
        "minimum k: a bucket with fewer than %llu values per step at density %g is sparsified "
        "at the density that gives it %llu (--min_k)",
        static_cast<unsigned long long>(kMinK), o->density,
        static_cast<unsigned long long>(kMinK)));
  }
  return applied;
}

double SparsifyOptions::DensityAt(uint64_t t) const {
  if (t < warmup_steps) return 1.0;
  const uint64_t since = t - warmup_steps;
  if (warmup_density <= 0.0 || since >= warmup_decay_steps) return density;
  const double f = static_cast<double>(since) / static_cast<double>(warmup_decay_steps);
  return warmup_density * std::pow(density / warmup_density, f);
}

bool SparsifyOptions::DenseAt(uint64_t t) const {
  if (t < warmup_steps) return true;
  if (warmup_dense_above <= 0.0 || t - warmup_steps >= warmup_decay_steps) return false;
  return DensityAt(t) > warmup_dense_above;
}

uint64_t SparsifyOptions::SparseFrom(uint64_t t) const {
  if (!DenseAt(t)) return t;
  // Dense steps are a prefix of the schedule: the first sparse one lies in
  // (max(t, warmup_steps) - 1, the decay's end].
  uint64_t lo = std::max(t, warmup_steps), hi = warmup_steps + warmup_decay_steps;
  if (!DenseAt(lo)) return lo;
  while (hi - lo > 1) {  // DenseAt(lo), !DenseAt(hi)
    const uint64_t mid = lo + (hi - lo) / 2;
    (DenseAt(mid) ? lo : hi) = mid;
  }
  return hi;
}

absl::Status JobShape::Validate() const {
  if (num_nodes < 1) {
    return absl::InvalidArgumentError(absl::StrCat("node count must be >= 1, got ", num_nodes));
  }
  if (node_rank < 0 || node_rank >= num_nodes) {
    return absl::InvalidArgumentError(
        absl::StrCat("node rank ", node_rank, " out of range [0, ", num_nodes, ")"));
  }
  if (world_size < num_nodes) {
    return absl::InvalidArgumentError(
        absl::StrCat("world size ", world_size, " smaller than the node count ", num_nodes));
  }
  return absl::OkStatus();
}

Range PartitionRange(uint64_t d, int n, int i) {
  const uint64_t q = d / n;
  const uint64_t rem = d % n;
  const uint64_t ui = static_cast<uint64_t>(i);
  Range r;
  r.begin = ui * q + (ui < rem ? ui : rem);
  r.end = r.begin + q + (ui < rem ? 1 : 0);
  return r;
}

int OwnedPartition(int r, uint64_t t, int n) {
  return static_cast<int>((t % static_cast<uint64_t>(n) + static_cast<uint64_t>(r)) %
                          static_cast<uint64_t>(n));
}

uint64_t Budget(double density, uint64_t d) {
  const double k = std::floor(density * static_cast<double>(d));
  return k < 1.0 ? 1 : static_cast<uint64_t>(k);
}

}  // namespace microd::sparsify
