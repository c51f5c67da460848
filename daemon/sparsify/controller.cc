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

}  // namespace

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
  RETURN_IF_ERROR(ctx.transport->AllreduceSum(global.data(), kBins, transport::DataType::kInt64,
                                              ctx.options));
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

absl::Status HistogramController::BadOverflow(int64_t local, int64_t global,
                                              const ControllerContext& ctx) {
  // Who claimed the values: every node's own count, gathered once.
  const int n = ctx.transport->size();
  std::vector<int64_t> counts(n);
  RETURN_IF_ERROR(ctx.transport->Allgather(&local, sizeof local, counts.data(), ctx.options));
  std::vector<std::string> claims;
  for (int r = 0; r < n; ++r) {
    if (counts[r] != 0) claims.push_back(absl::StrCat("node ", r, " (", counts[r], ")"));
  }
  return absl::DataLossError(absl::StrCat(
      "histogram: ", global, " candidates above the largest finite magnitude, where there can "
      "be none: a bad peer; ",
      claims.empty() ? std::string("every node reports none of them, so a peer altered the sum")
                     : absl::StrCat("claimed by ", absl::StrJoin(claims, ", "))));
}

absl::StatusOr<float> HistogramController::Resolve(CandidateSet& candidates,
                                                   const ControllerContext& ctx) {
  kernels::SparseOps& ops = *ctx.ops;
  const uint64_t k = ctx.k;
  if (!device_bins_.Reserve(&ops, std::max(kCoarseBins, kFineBins) + 1)) {
    return absl::ResourceExhaustedError("histogram: out of device memory");
  }
  std::vector<int64_t> coarse(kCoarseBins + 1);
  std::vector<int64_t> fine(kFineBins + 1);
  int64_t local_overflow = 0;  // this node's count above the last window, before the sum

  // Runs LogHistogram on the candidates and sums it across nodes.
  auto global_histogram = [&](uint32_t shift, uint32_t first, uint32_t num,
                              std::vector<int64_t>& out) -> absl::Status {
    const kernels::KernelStatus ks = ops.LogHistogram(
        candidates.values(), candidates.count(), shift, first, num, device_bins_.get(), ctx.stream);
    if (ks != kernels::KernelStatus::kOk) {
      return absl::InternalError(
          absl::StrCat("histogram kernel: ", kernels::KernelStatusString(ks)));
    }
    // The allreduce runs on a host copy: the histograms are tiny.
    if (ops.CopyToHost(out.data(), device_bins_.get(), (num + 1) * sizeof(int64_t), ctx.stream) !=
        kernels::KernelStatus::kOk) {
      return absl::InternalError("histogram: copy to host failed");
    }
    local_overflow = out[num];
    if (ctx.bytes_sent != nullptr) *ctx.bytes_sent += (num + 1) * sizeof(int64_t);
    if (ctx.bytes_received != nullptr) *ctx.bytes_received += (num + 1) * sizeof(int64_t);
    return ctx.transport->AllreduceSum(out.data(), num + 1, transport::DataType::kInt64,
                                       ctx.options);
  };

  float lower = lower_bound_;
  int rescans = 0;
  uint32_t first = Bits(lower) >> kCoarseShift;
  for (;;) {
    RETURN_IF_ERROR(global_histogram(kCoarseShift, first, kCoarseBins, coarse));
    int64_t total = 0;
    for (int64_t c : coarse) total += c;
    if (static_cast<uint64_t>(total) < k) {
      if (lower <= kSmallestPositive) {
        // Fewer than k non-zero values in the whole bucket: take them all.
        pending_lower_bound_ = kSmallestPositive;
        if (ctx.rescans != nullptr) *ctx.rescans = rescans;
        return kSmallestPositive;
      }
      // Too few candidates: lower the bound 256x, then to every non-zero value.
      lower = rescans == 0 ? std::max(lower * 0x1p-8f, kSmallestPositive) : kSmallestPositive;
      ++rescans;
      RETURN_IF_ERROR(candidates.Rescan(lower));
      first = Bits(lower) >> kCoarseShift;
      continue;
    }
    if (static_cast<uint64_t>(coarse[kCoarseBins]) >= k) {
      // The k-th value lies above the window: move it up, at most to the
      // largest finite magnitude. Past it only a peer that adds to the sum
      // what it does not hold keeps the count up (every node sees the same
      // sum, so every node stops here together).
      if (first + kCoarseBins >= kFiniteCoarseBins) {
        return BadOverflow(local_overflow, coarse[kCoarseBins], ctx);
      }
      first += kCoarseBins;
      continue;
    }
    break;
  }
  if (ctx.rescans != nullptr) *ctx.rescans = rescans;

  // Coarse bin holding the k-th largest magnitude, and the count above it.
  uint64_t above = static_cast<uint64_t>(coarse[kCoarseBins]);
  int kth_bin = 0;
  for (int b = kCoarseBins - 1; b >= 0; --b) {
    if (above + static_cast<uint64_t>(coarse[b]) >= k) {
      kth_bin = b;
      break;
    }
    above += static_cast<uint64_t>(coarse[b]);
  }

  // Next step's lower bound: the coarse edge with about kCandidateMargin * k
  // values above it in this step.
  {
    uint64_t cum = static_cast<uint64_t>(coarse[kCoarseBins]);
    float next = std::max(lower * 0.5f, kSmallestPositive);
    for (int b = kCoarseBins - 1; b >= 0; --b) {
      cum += static_cast<uint64_t>(coarse[b]);
      if (cum >= kCandidateMargin * k) {
        next = FromBits((first + b) << kCoarseShift);
        break;
      }
    }
    pending_lower_bound_ = std::max(next, kSmallestPositive);
  }

  // Refine the k-th bin.
  const uint32_t fine_first = (first + kth_bin) << (kCoarseShift - kFineShift);
  RETURN_IF_ERROR(global_histogram(kFineShift, fine_first, kFineBins, fine));
  uint64_t cum = above;
  float threshold = lower;
  for (int j = kFineBins - 1; j >= 0; --j) {
    const uint64_t with_bin = cum + static_cast<uint64_t>(fine[j]);
    if (with_bin >= k) {
      // Edge below sub-bin j selects with_bin (>= k); the edge above selects cum (< k).
      const bool take_lower = with_bin - k <= k - cum;
      const uint32_t edge = (fine_first + j + (take_lower ? 0 : 1)) << kFineShift;
      threshold = FromBits(edge);
      break;
    }
    cum = with_bin;
  }
  // Never below the pass's bound: only candidates can be selected.
  return std::max(threshold, lower);
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
