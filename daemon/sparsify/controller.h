// SPDX-License-Identifier: Apache-2.0
// Threshold controllers of the `micro` sparsifier.
//
// Life cycle, once per step and in this order on every node:
//   1. PassThreshold(): the threshold the fused pass selects with: the final
//      one for `paper`, a lower bound that keeps a few candidates for `hist`
//      (Refines), whose final threshold the step finds from the candidates'
//      global histogram (PlanCoarse, then ChooseFine; PlanCoarse may ask for
//      a rescan of the owned partition with a lower bound).
//   2. Commit(K): the step succeeded with K selected globally; advance.
// A failed step never reaches Commit, so the controller is as it was.
// Before the first step's pass, a controller that WantsPrime() gets a sample
// of the step's accumulated gradient (Prime, a collective).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/sparsify/device_buffer.h"
#include "daemon/sparsify/options.h"
#include "daemon/transport/transport.h"
#include "kernels/sparse_ops.h"

namespace microd::sparsify {

// What Prime's collective needs.
struct ControllerContext {
  transport::Transport* transport = nullptr;
  transport::CollectiveOptions options;  // deadline and the controller's tag
  uint64_t k = 1;                        // budget of the whole bucket
  uint64_t* bytes_sent = nullptr;        // payload accounting of the step
  uint64_t* bytes_received = nullptr;
};

class ThresholdController {
 public:
  virtual ~ThresholdController() = default;
  virtual float PassThreshold() const = 0;
  // `budget`: the step's k (it changes during a density warm-up).
  virtual void Commit(uint64_t selected, uint64_t budget) = 0;
  // True when the step finds the threshold above PassThreshold from the
  // candidates' global histogram (HistogramController's plan functions).
  virtual bool Refines() const = 0;
  // True before the first step when PassThreshold would otherwise come from
  // no information at all.
  virtual bool WantsPrime() const { return false; }
  // The controller's state between steps, as bytes (a checkpoint), and back:
  // a controller loaded from Save() continues exactly as this one would.
  virtual std::string Save() const = 0;
  virtual absl::Status Load(const std::string& bytes) = 0;
  // `sample`: magnitudes of this node's accumulated gradient at evenly spread
  // positions of its owned partition (host memory); `scale`: the partition's
  // size over the sample's. Sets the first PassThreshold.
  virtual absl::Status Prime(const std::vector<float>& sample, double scale,
                             const ControllerContext& ctx) {
    return absl::OkStatus();
  }
};

// `paper`: tau_0 = 1 / (2 sqrt(k)); tau_t = tau_{t-1} * s(K_{t-1} / k) with
// s = 1.005 above 1.1, 1.00125 above 0.909, 0.995 otherwise. Kept in double,
// compared in float.
class PaperController final : public ThresholdController {
 public:
  explicit PaperController(uint64_t k);  // tau_0 from the target budget
  float PassThreshold() const override { return static_cast<float>(tau_); }
  void Commit(uint64_t selected, uint64_t budget) override;
  bool Refines() const override { return false; }
  std::string Save() const override;
  absl::Status Load(const std::string& bytes) override;
  double tau() const { return tau_; }

 private:
  double tau_;
};

// `hist` (ours): exact density from a same-step global histogram.
// The fused pass keeps candidates above a lower bound tau_lo (chosen from the
// previous step's histogram so that about kCandidateMargin * k survive). The
// candidates' magnitudes are binned by their float bit patterns (1/8 octave
// bins), summed across nodes with one small allreduce, and the bin holding the
// k-th largest magnitude is refined into 256 sub-bins (1/2048 octave) with a
// second one. The threshold is the sub-bin edge whose global count is closest
// to k, so K differs from k only by the population of one sub-bin. When fewer
// than k candidates survive, every node rescans its partition with a lower
// bound (rare; at most two rescans, the last one keeps every non-zero value).
// The first step's lower bound comes from a sample of that step (Prime: a
// coarse histogram of every node's sample, scaled to the partitions and
// summed, read off for 2 * kCandidateMargin * k), not from "every non-zero
// value": that made the first pass keep the whole partition as candidates
// (0.6 s instead of 30 ms for 25.6 M floats).
class HistogramController final : public ThresholdController {
 public:
  static constexpr uint32_t kCoarseShift = 20;  // 3 mantissa bits: 8 bins per octave
  static constexpr uint32_t kCoarseBins = 128;  // 16 octaves above the lower bound
  static constexpr uint32_t kFineShift = 12;    // 11 mantissa bits
  static constexpr uint32_t kFineBins = 1u << (kCoarseShift - kFineShift);
  static constexpr uint64_t kCandidateMargin = 4;
  // Coarse bins of finite magnitudes: bin 0x7f8 holds Inf and NaN.
  static constexpr uint32_t kFiniteCoarseBins = 0x7f800000u >> kCoarseShift;

  HistogramController();
  float PassThreshold() const override { return lower_bound_; }
  void Commit(uint64_t selected, uint64_t budget) override;
  bool Refines() const override { return true; }
  bool WantsPrime() const override { return !primed_; }
  absl::Status Prime(const std::vector<float>& sample, double scale,
                     const ControllerContext& ctx) override;
  std::string Save() const override;
  absl::Status Load(const std::string& bytes) override;

  // The step (batch_step.h) finds the threshold from the global histograms
  // its rounds deliver, with these functions.
  //
  // What the global coarse histogram of a step's candidates says:
  // `global[b - first]` counts the candidates in coarse bin b, for every
  // finite bin b from first = bits(lower) >> kCoarseShift. Sets the next
  // step's lower bound unless a rescan is needed.
  struct CoarsePlan {
    enum Kind {
      kRefine,       // the k-th value lies in bin kth_coarse; `above` lie above it
      kTakeAll,      // fewer than k non-zero values in all: every candidate
      kRescan,       // too few candidates: rescan with rescan_lower, plan again
      kBadOverflow,  // the k-th value lies above every finite magnitude
    } kind = kRefine;
    uint32_t kth_coarse = 0;
    uint64_t above = 0;
    float rescan_lower = 0;
  };
  CoarsePlan PlanCoarse(const std::vector<uint64_t>& global, float lower, int rescans, uint64_t k);
  // The threshold from the fine histogram of the k-th coarse bin (fine[j]:
  // sub-bin j of the bin whose first fine bin is fine_first, over every
  // node), `above` candidates lying above the bin: the sub-bin edge whose
  // count is closest to k; candidates in the bin are selected from sub-bin
  // `sub_bin` up (kFineBins: none of them). `threshold` is never below
  // `lower`.
  struct FineChoice {
    float threshold = 0;
    uint32_t sub_bin = 0;
  };
  static FineChoice ChooseFine(const std::vector<int64_t>& fine, uint64_t above, uint64_t k,
                               uint32_t fine_first, float lower);
  static uint32_t CoarseBinOf(float magnitude);
  static uint32_t FineBinOf(float magnitude);

 private:
  bool primed_ = false;        // a lower bound was set (by Prime or a step)
  float lower_bound_;          // tau_lo of the coming step
  float pending_lower_bound_;  // set by PlanCoarse, taken by Commit
};

std::unique_ptr<ThresholdController> CreateController(ControllerKind kind, uint64_t k);

}  // namespace microd::sparsify
