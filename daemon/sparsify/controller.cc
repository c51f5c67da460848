// SPDX-License-Identifier: Apache-2.0
#include "daemon/sparsify/controller.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/common/status_macros.h"
#include "daemon/sparsify/device_buffer.h"

namespace microd::sparsify {
namespace {

constexpr float kSmallestPositive = std::numeric_limits<float>::denorm_min();

uint32_t Bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}
float FromBits(uint32_t b) {
  float x;
  std::memcpy(&x, &b, sizeof x);
  return x;
}

using HC = HistogramController;

// The coarse bin (of the window starting at `first`, kCoarseBins bins and
// the count above them in window[kCoarseBins]) that holds the k-th largest
// magnitude, and how many lie above it.
int KthCoarseBin(const std::vector<int64_t>& window, uint64_t k, uint64_t* above) {
  *above = static_cast<uint64_t>(window[HC::kCoarseBins]);
  for (int b = HC::kCoarseBins - 1; b >= 0; --b) {
    if (*above + static_cast<uint64_t>(window[b]) >= k) return b;
    *above += static_cast<uint64_t>(window[b]);
  }
  return 0;
}

// The next step's lower bound: the coarse edge with about
// kCandidateMargin * k values above it in this step's window.
float NextLowerBound(const std::vector<int64_t>& window, uint32_t first, float lower, uint64_t k) {
  uint64_t cum = static_cast<uint64_t>(window[HC::kCoarseBins]);
  float next = std::max(lower * 0.5f, kSmallestPositive);
  for (int b = HC::kCoarseBins - 1; b >= 0; --b) {
    cum += static_cast<uint64_t>(window[b]);
    if (cum >= HC::kCandidateMargin * k) {
      next = FromBits((first + b) << HC::kCoarseShift);
      break;
    }
  }
  return std::max(next, kSmallestPositive);
}

// The lower bound of the next pass when too few candidates survived: 256x
// lower, then every non-zero value.
float RescanBound(float lower, int rescans) {
  return rescans == 0 ? std::max(lower * 0x1p-8f, kSmallestPositive) : kSmallestPositive;
}

}  // namespace

uint32_t HistogramController::CoarseBinOf(float magnitude) {
  return Bits(std::fabs(magnitude)) >> kCoarseShift;
}

uint32_t HistogramController::FineBinOf(float magnitude) {
  return Bits(std::fabs(magnitude)) >> kFineShift;
}

HistogramController::FineChoice HistogramController::ChooseFine(const std::vector<int64_t>& fine,
                                                                uint64_t above, uint64_t k,
                                                                uint32_t fine_first, float lower) {
  FineChoice c;
  c.threshold = lower;
  c.sub_bin = 0;
  uint64_t cum = above;
  for (int j = kFineBins - 1; j >= 0; --j) {
    const uint64_t with_bin = cum + static_cast<uint64_t>(fine[j]);
    if (with_bin >= k) {
      // Edge below sub-bin j selects with_bin (>= k); the edge above selects cum (< k).
      const bool take_lower = with_bin - k <= k - cum;
      c.sub_bin = static_cast<uint32_t>(j) + (take_lower ? 0 : 1);
      c.threshold = FromBits((fine_first + c.sub_bin) << kFineShift);
      break;
    }
    cum = with_bin;
  }
  // Never below the pass's bound: only candidates can be selected.
  c.threshold = std::max(c.threshold, lower);
  return c;
}

HistogramController::CoarsePlan HistogramController::PlanCoarse(const std::vector<uint64_t>& global,
                                                                float lower, int rescans,
                                                                uint64_t k) {
  CoarsePlan plan;
  const uint32_t first0 = Bits(lower) >> kCoarseShift;
  auto count_at = [&](uint64_t bin) -> uint64_t {
    return bin >= first0 && bin - first0 < global.size() ? global[bin - first0] : 0;
  };
  uint64_t total = 0;
  for (uint64_t c : global) total += c;
  if (total < k) {
    if (lower <= kSmallestPositive) {
      // Fewer than k non-zero values in the whole bucket: take them all.
      pending_lower_bound_ = kSmallestPositive;
      plan.kind = CoarsePlan::kTakeAll;
      return plan;
    }
    plan.kind = CoarsePlan::kRescan;
    plan.rescan_lower = RescanBound(lower, rescans);
    return plan;
  }
  // The window of kCoarseBins bins from the bound, moved up while the k-th
  // value lies above it.
  uint32_t first = first0;
  auto overflow = [&](uint32_t from) {
    uint64_t o = 0;
    for (uint64_t b = from; b < first0 + global.size(); ++b) o += count_at(b);
    return o;
  };
  while (overflow(first + kCoarseBins) >= k) {
    if (first + kCoarseBins >= kFiniteCoarseBins) {
      plan.kind = CoarsePlan::kBadOverflow;
      return plan;
    }
    first += kCoarseBins;
  }
  std::vector<int64_t> window(kCoarseBins + 1);
  for (uint32_t b = 0; b < kCoarseBins; ++b) window[b] = static_cast<int64_t>(count_at(first + b));
  window[kCoarseBins] = static_cast<int64_t>(overflow(first + kCoarseBins));
  uint64_t above = 0;
  const int kth = KthCoarseBin(window, k, &above);
  pending_lower_bound_ = NextLowerBound(window, first, lower, k);
  plan.kind = CoarsePlan::kRefine;
  plan.kth_coarse = first + static_cast<uint32_t>(kth);
  plan.above = above;
  return plan;
}

PaperController::PaperController(uint64_t k)
    : tau_(1.0 / (2.0 * std::sqrt(static_cast<double>(k)))) {}

void PaperController::Commit(uint64_t selected, uint64_t budget) {
  const double x = static_cast<double>(selected) / static_cast<double>(budget);
  double s;
  if (x > 1.1) {
    s = 1.005;
  } else if (x > 0.909) {
    s = 1.00125;
  } else {
    s = 0.995;
  }
  tau_ *= s;
}

namespace {

template <typename T>
void Append(std::string* out, const T& v) {
  out->append(reinterpret_cast<const char*>(&v), sizeof v);
}

}  // namespace

std::string PaperController::Save() const {
  std::string out;
  Append(&out, tau_);
  return out;
}

absl::Status PaperController::Load(const std::string& bytes) {
  if (bytes.size() != sizeof tau_) {
    return absl::InvalidArgumentError("paper controller state: wrong size");
  }
  std::memcpy(&tau_, bytes.data(), sizeof tau_);
  if (!(tau_ > 0) || !std::isfinite(tau_)) {
    return absl::InvalidArgumentError("paper controller state: threshold not positive");
  }
  return absl::OkStatus();
}

std::string HistogramController::Save() const {
  std::string out;
  Append(&out, static_cast<uint8_t>(primed_));
  Append(&out, lower_bound_);
  return out;
}

absl::Status HistogramController::Load(const std::string& bytes) {
  if (bytes.size() != 1 + sizeof lower_bound_ || static_cast<uint8_t>(bytes[0]) > 1) {
    return absl::InvalidArgumentError("hist controller state: wrong size or flag");
  }
  float lower;
  std::memcpy(&lower, bytes.data() + 1, sizeof lower);
  if (!(lower > 0) || !std::isfinite(lower)) {
    return absl::InvalidArgumentError("hist controller state: lower bound not positive");
  }
  primed_ = bytes[0] != 0;
  lower_bound_ = pending_lower_bound_ = lower;
  return absl::OkStatus();
}

HistogramController::HistogramController()
    : lower_bound_(kSmallestPositive), pending_lower_bound_(kSmallestPositive) {}

void HistogramController::Commit(uint64_t, uint64_t) {
  lower_bound_ = pending_lower_bound_;
  primed_ = true;
}

absl::Status HistogramController::Prime(const std::vector<float>& sample, double scale,
                                        const ControllerContext& ctx) {
  // Coarse bins over every finite magnitude (NaN/Inf are the step's to report).
  constexpr uint32_t kBins = (0x7f800000u >> kCoarseShift) + 1;
  std::vector<double> local(kBins, 0.0);
  for (float v : sample) {
    const uint32_t b = Bits(std::fabs(v));
    if (b < 0x7f800000u && b != 0) local[b >> kCoarseShift] += 1.0;
  }
  std::vector<int64_t> global(kBins);
  for (uint32_t b = 0; b < kBins; ++b) global[b] = std::llround(local[b] * scale);
  if (ctx.bytes_sent != nullptr) *ctx.bytes_sent += kBins * sizeof(int64_t);
  if (ctx.bytes_received != nullptr) *ctx.bytes_received += kBins * sizeof(int64_t);
  RETURN_IF_ERROR(
      ctx.transport->AllreduceSum(global.data(), kBins, transport::DataType::kInt64, ctx.options));
  // The highest bin edge with twice the usual candidate margin above it
  // (sampling error; too few after all costs one rescan).
  const uint64_t want = 2 * kCandidateMargin * ctx.k;
  uint64_t above = 0;
  float bound = kSmallestPositive;
  for (int b = static_cast<int>(kBins) - 1; b > 0; --b) {
    above += static_cast<uint64_t>(std::max<int64_t>(global[b], 0));
    if (above >= want) {
      bound = FromBits(static_cast<uint32_t>(b) << kCoarseShift);
      break;
    }
  }
  lower_bound_ = pending_lower_bound_ = std::max(bound, kSmallestPositive);
  primed_ = true;
  return absl::OkStatus();
}

std::unique_ptr<ThresholdController> CreateController(ControllerKind kind, uint64_t k) {
  switch (kind) {
    case ControllerKind::kPaper:
      return std::make_unique<PaperController>(k);
    case ControllerKind::kHistogram:
      return std::make_unique<HistogramController>();
  }
  return nullptr;
}

}  // namespace microd::sparsify
