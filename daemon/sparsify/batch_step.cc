// SPDX-License-Identifier: Apache-2.0
#include "daemon/sparsify/batch_step.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/types/span.h"
#include "daemon/common/status_macros.h"
#include "daemon/common/status_map.h"
#include "daemon/sparsify/round_message.h"
#include "kernels/convert.h"

namespace microd::sparsify {

using kernels::KernelStatus;
using transport::CollectiveOptions;
using transport::TagKind;
using HC = HistogramController;

namespace {

constexpr uint32_t kAbsent = 1;  // header flag: this node has no gradient for the bucket

// A bad peer's message: the batch fails on every node alike.
absl::Status BadMessage(int node, const char* round, const std::string& bucket) {
  return absl::DataLossError(absl::StrCat("batched step: node ", node, "'s ", round,
                                          " message does not parse at bucket '", bucket,
                                          "'; a bad peer, batch failed on every node"));
}

// Node r's indices against the elements it selects from: every node checks
// them alike, before any is used.
absl::Status CheckIndices(const BucketState& b, int r, absl::Span<const uint32_t> index) {
  const Range range = b.SenderRange(r);
  uint64_t outside = 0;
  for (uint32_t x : index) outside += x < range.begin || x >= range.end;
  if (outside == 0) return absl::OkStatus();
  return absl::DataLossError(
      absl::StrCat("bucket '", b.spec().name, "' step ", b.step(), ": node ", r, " sent ", outside,
                   " of ", index.size(), " indices outside [", range.begin, ", ", range.end,
                   "), the elements it selects from; a bad peer, step failed on every node"));
}

}  // namespace

struct BatchStep::Item {
  BucketState* b = nullptr;
  bool absent = false;  // this node has no gradient for it
  absl::Status failed;  // its own failure, the same on every node
  absl::Time start;
  BucketState::Selection sel;                // this node's pass and selection (stats included)
  std::vector<uint32_t> my_bins, my_counts;  // hist: sparse coarse histogram
  std::vector<BucketState::Header> headers;  // every node's
  // hist: every node's sparse coarse histogram (from round 1 or a rescan).
  std::vector<std::vector<uint32_t>> bins, counts;
  HC::CoarsePlan plan;
  std::vector<uint32_t> index;  // I, every node's selection in rank order (until round 3)
  uint64_t selected = 0;        // |I|
  size_t values_at = 0;         // where the sums at I are in BatchStep::sums_ (bytes)

  bool alive() const { return failed.ok(); }
  bool hist() const { return sel.hist; }
  StepStats& stats() { return sel.stats; }
  size_t wire_bytes() const { return kernels::ElementBytes(b->spec().wire); }
};

bool BatchStep::Batchable(const BucketState& b) { return b.Batchable(); }

BatchStep::BatchStep(transport::Transport& transport, absl::Time deadline)
    : transport_(transport), deadline_(deadline) {}

BatchStep::~BatchStep() = default;

size_t BatchStep::size() const { return items_.size(); }

CollectiveOptions BatchStep::Options(TagKind kind) const {
  CollectiveOptions o;
  o.deadline = deadline_;
  // One tag per kind of round for every batch: batches run one after
  // another, in the same order on every node.
  o.tag = transport::MakeTag(0, kind);
  return o;
}

absl::Status BatchStep::Exchange(TagKind kind, std::string_view mine,
                                 std::vector<std::string>* from) {
  const CollectiveOptions o = Options(kind);
  RETURN_IF_ERROR(transport_.ExchangeRound(mine, from, o));
  // The next batch's round of this kind, posted now (so that even its first
  // round costs one trip), with room for twice the longest message of this
  // one: every node saw the same messages, so every node posts alike.
  size_t longest = 0;
  for (const std::string& m : *from) longest = std::max(longest, m.size());
  transport_.Expect(o.tag, 2 * longest);
  return absl::OkStatus();
}

absl::Status BatchStep::LocalCoarse(Item& it) {
  // Every finite coarse bin from the pass's bound up (the candidates are at
  // or above it), counted on the host copy of the candidates' values.
  const uint32_t first = HC::CoarseBinOf(it.sel.lower);
  std::vector<uint32_t> dense(first < HC::kFiniteCoarseBins ? HC::kFiniteCoarseBins - first : 0);
  for (float v : it.sel.value) {
    const uint32_t bin = HC::CoarseBinOf(v);
    if (bin >= first && bin < HC::kFiniteCoarseBins) ++dense[bin - first];
  }
  it.my_bins.clear();
  it.my_counts.clear();
  for (uint32_t j = 0; j < dense.size(); ++j) {
    if (dense[j] == 0) continue;
    it.my_bins.push_back(first + j);
    it.my_counts.push_back(dense[j]);
  }
  return absl::OkStatus();
}

absl::Status BatchStep::Add(BucketState* bucket, const float* grad) {
  Item it;
  it.b = bucket;
  it.start = absl::Now();
  if (grad == nullptr) {
    it.absent = true;
    it.sel.stats.step = bucket->step();
    it.sel.stats.budget = Budget(bucket->options().DensityAt(bucket->step()), bucket->spec().size);
    it.sel.hist = bucket->hist() != nullptr;
  } else {
    ASSIGN_OR_RETURN(it.sel, bucket->Select(grad));
    if (it.hist() && it.sel.nonfinite == 0) RETURN_IF_ERROR(LocalCoarse(it));
  }
  items_.push_back(std::move(it));
  return absl::OkStatus();
}

void BatchStep::KeepOnly(const std::vector<size_t>& indices) {
  std::vector<Item> kept;
  for (size_t i : indices) {
    if (i < items_.size()) kept.push_back(std::move(items_[i]));
  }
  items_ = std::move(kept);
}

std::string BatchStep::RoundOne() {
  RoundWriter w;
  for (Item& it : items_) {
    const size_t before = w.size();
    const BucketState::Header h = it.b->MakeHeader(it.sel.count, it.sel.nonfinite);
    w.Put(h);
    w.Put(it.absent ? kAbsent : 0u);
    if (!it.absent && it.sel.nonfinite == 0) {
      if (it.hist()) {
        w.Put(static_cast<uint32_t>(it.my_bins.size()));
        w.PutArray(it.my_bins.data(), it.my_bins.size());
        w.PutArray(it.my_counts.data(), it.my_counts.size());
      } else {
        w.PutArray(it.sel.index.data(), it.sel.index.size());
      }
    }
    it.sel.stats.bytes_sent += w.size() - before;
  }
  return w.Take();
}

namespace {

// Node r's sparse coarse histogram: ascending finite bins from `first`,
// summing to its candidate count. False when it is not one.
bool ReadCoarse(RoundReader& in, uint64_t count, uint32_t first, std::vector<uint32_t>* bins,
                std::vector<uint32_t>* counts) {
  uint32_t m = 0;
  if (!in.Get(&m) || !in.GetArray(m, bins) || !in.GetArray(m, counts)) return false;
  uint64_t sum = 0;
  for (uint32_t j = 0; j < m; ++j) {
    if ((*bins)[j] < first || (*bins)[j] >= HC::kFiniteCoarseBins ||
        (j > 0 && (*bins)[j] <= (*bins)[j - 1])) {
      return false;
    }
    sum += (*counts)[j];
  }
  return sum == count;
}

}  // namespace

absl::Status BatchStep::ReadRoundOne(const std::vector<std::string>& from) {
  const int n = transport_.size();
  for (Item& it : items_) {
    it.headers.assign(n, {});
    it.bins.assign(n, {});
    it.counts.assign(n, {});
  }
  std::vector<std::vector<std::vector<uint32_t>>> lists(items_.size(),
                                                        std::vector<std::vector<uint32_t>>(n));
  std::vector<std::vector<bool>> absent(items_.size(), std::vector<bool>(n, false));
  for (int r = 0; r < n; ++r) {
    RoundReader in(from[r]);
    bool apart = false;  // node r's state differs: CheckHeaders names it below
    for (size_t i = 0; i < items_.size() && !apart; ++i) {
      Item& it = items_[i];
      BucketState& b = *it.b;
      BucketState::Header& h = it.headers[r];
      uint32_t flags = 0;
      if (!in.Get(&h) || !in.Get(&flags) || (flags & ~kAbsent) != 0) {
        return BadMessage(r, "round 1", b.spec().name);
      }
      // Another step or threshold: what follows was cut for another state
      // (partitions, bounds), so the rest of the message is not read.
      const BucketState::Header mine = b.MakeHeader(0, 0);
      apart = h.step != mine.step || h.threshold_bits != mine.threshold_bits;
      absent[i][r] = (flags & kAbsent) != 0;
      if (apart || absent[i][r] || h.nonfinite != 0) continue;
      // A node's count against what it can select from (its partition this
      // step under MiCRO, its candidate capacity otherwise).
      const Range range = b.SenderRange(r);
      const uint64_t most = std::min(b.SelectionBound(), range.size());
      if (h.count > most) {
        return absl::DataLossError(
            absl::StrCat("bucket '", b.spec().name, "' step ", b.step(), ": node ", r,
                         " says it selected ", h.count, " values, more than the ", most,
                         " it can select from; a bad peer, step failed on every node"));
      }
      if (it.hist()) {
        if (!ReadCoarse(in, h.count, HC::CoarseBinOf(it.sel.lower), &it.bins[r], &it.counts[r])) {
          return BadMessage(r, "round 1", b.spec().name);
        }
      } else if (!in.GetArray(h.count, &lists[i][r])) {
        return BadMessage(r, "round 1", b.spec().name);
      }
      if (r != transport_.rank()) it.sel.stats.bytes_received += sizeof(h) + sizeof(flags);
    }
    if (!apart && in.left() != 0) return BadMessage(r, "round 1", "(after the last)");
  }
  for (size_t i = 0; i < items_.size(); ++i) {
    Item& it = items_[i];
    BucketState& b = *it.b;
    // The nodes' states differ: the batch fails (before any node is
    // named absent, whose header says so all the same).
    const absl::Status checked = b.CheckHeaders(it.headers);
    if (!checked.ok() && ToClientStatus(checked) != ClientStatus::kNonFinite) return checked;
    for (int r = 0; r < n && it.alive(); ++r) {
      if (absent[i][r]) {
        it.failed = absl::UnavailableError(absl::StrCat(
            "bucket '", b.spec().name, "' step ", b.step(), ": node ", r,
            " has no gradient for it (a local process left); not reduced on any node"));
      }
    }
    if (it.alive()) it.failed = checked;  // a NaN/Inf somewhere
    if (!it.alive()) continue;
    it.sel.stats.node_counts.assign(n, 0);
    for (int r = 0; r < n; ++r) it.sel.stats.node_counts[r] = it.headers[r].count;
    it.sel.stats.local_selected = it.headers[transport_.rank()].count;
    if (it.hist()) {
      for (int r = 0; r < n; ++r) {
        if (r != transport_.rank()) it.sel.stats.bytes_received += it.bins[r].size() * 8 + 4;
      }
      continue;  // planned from the global histogram below
    }
    // Every node's indices in its range, then I: in rank order (MiCRO's
    // sets are disjoint), the sorted union for top-k and hard.
    uint64_t total = 0;
    for (int r = 0; r < n; ++r) {
      RETURN_IF_ERROR(CheckIndices(b, r, lists[i][r]));
      if (r != transport_.rank())
        it.sel.stats.bytes_received += lists[i][r].size() * sizeof(uint32_t);
      total += lists[i][r].size();
      it.index.insert(it.index.end(), lists[i][r].begin(), lists[i][r].end());
    }
    it.sel.stats.sum_of_counts = total;
    if (b.options().sparsifier != SparsifierKind::kMicro) {
      std::sort(it.index.begin(), it.index.end());
      it.index.erase(std::unique(it.index.begin(), it.index.end()), it.index.end());
    }
  }
  return absl::OkStatus();
}

absl::Status BatchStep::Rescans() {
  const int n = transport_.size();
  for (int attempt = 0;; ++attempt) {
    // Plan every live hist bucket from the global coarse histogram.
    std::vector<Item*> again;
    for (Item& it : items_) {
      if (!it.hist() || !it.alive()) continue;
      const uint32_t first = HC::CoarseBinOf(it.sel.lower);
      std::vector<uint64_t> global(first < HC::kFiniteCoarseBins ? HC::kFiniteCoarseBins - first
                                                                 : 0);
      for (int r = 0; r < n; ++r) {
        for (size_t j = 0; j < it.bins[r].size(); ++j)
          global[it.bins[r][j] - first] += it.counts[r][j];
      }
      HC* controller = it.b->hist();
      it.plan =
          controller->PlanCoarse(global, it.sel.lower, it.sel.stats.rescans, it.sel.stats.budget);
      if (it.plan.kind == HC::CoarsePlan::kBadOverflow) {
        return absl::DataLossError(absl::StrCat("bucket '", it.b->spec().name, "' step ",
                                                it.b->step(),
                                                ": the candidates' histogram places the k-th "
                                                "value above every finite magnitude; a bad peer"));
      }
      if (it.plan.kind == HC::CoarsePlan::kRescan) again.push_back(&it);
    }
    if (again.empty()) return absl::OkStatus();
    if (attempt >= 2) {
      return absl::InternalError("batched step: the hist controller asked for a third rescan");
    }
    // Too few candidates: every node rescans its partition with the lower
    // bound and sends its new coarse histogram (a round of its own; rare).
    RoundWriter w;
    for (Item* it : again) {
      RETURN_IF_ERROR(it->b->Rescan(it->sel, it->plan.rescan_lower));
      RETURN_IF_ERROR(LocalCoarse(*it));
      w.Put(it->sel.count);
      w.Put(static_cast<uint32_t>(it->my_bins.size()));
      w.PutArray(it->my_bins.data(), it->my_bins.size());
      w.PutArray(it->my_counts.data(), it->my_counts.size());
    }
    std::vector<std::string> from;
    RETURN_IF_ERROR(transport_.ExchangeRound(w.Take(), &from, Options(TagKind::kRescan)));
    for (int r = 0; r < n; ++r) {
      RoundReader in(from[r]);
      for (Item* it : again) {
        uint64_t count = 0;
        if (!in.Get(&count) || count > it->b->SenderRange(r).size() ||
            !ReadCoarse(in, count, HC::CoarseBinOf(it->sel.lower), &it->bins[r], &it->counts[r])) {
          return BadMessage(r, "rescan", it->b->spec().name);
        }
        it->headers[r].count = count;
        it->sel.stats.node_counts[r] = count;
      }
      if (in.left() != 0) return BadMessage(r, "rescan", "(after the last)");
    }
  }
}

std::string BatchStep::RoundTwo() {
  // This node's candidates above the k-th value's coarse bin (all of them
  // when every candidate is taken), then those in it with their fine
  // sub-bin, each list in candidate order. The few in the bin are gathered
  // first; those above (at a high density, most of the partition) are
  // counted, then written straight into the message, sized exactly.
  struct Lists {
    uint64_t above = 0;
    std::vector<uint32_t> in_bin;
    std::vector<uint8_t> sub;
  };
  std::vector<Lists> lists(items_.size());
  size_t bytes = 0;
  for (size_t i = 0; i < items_.size(); ++i) {
    Item& it = items_[i];
    if (!it.hist() || !it.alive()) continue;
    Lists& l = lists[i];
    const bool all = it.plan.kind == HC::CoarsePlan::kTakeAll;
    const uint32_t fine_first = it.plan.kth_coarse << (HC::kCoarseShift - HC::kFineShift);
    for (uint64_t j = 0; j < it.sel.count; ++j) {
      const uint32_t bin = HC::CoarseBinOf(it.sel.value[j]);
      if (all || bin > it.plan.kth_coarse) {
        ++l.above;
      } else if (bin == it.plan.kth_coarse) {
        l.in_bin.push_back(it.sel.index[j]);
        l.sub.push_back(static_cast<uint8_t>(HC::FineBinOf(it.sel.value[j]) - fine_first));
      }
    }
    bytes += 8 + l.above * sizeof(uint32_t) + l.in_bin.size() * (sizeof(uint32_t) + 1);
  }
  RoundWriter w;
  w.Reserve(bytes);
  for (size_t i = 0; i < items_.size(); ++i) {
    Item& it = items_[i];
    if (!it.hist() || !it.alive()) continue;
    const Lists& l = lists[i];
    const bool all = it.plan.kind == HC::CoarsePlan::kTakeAll;
    const size_t before = w.size();
    w.Put(static_cast<uint32_t>(l.above));
    for (uint64_t j = 0; j < it.sel.count; ++j) {
      if (all || HC::CoarseBinOf(it.sel.value[j]) > it.plan.kth_coarse) w.Put(it.sel.index[j]);
    }
    w.Put(static_cast<uint32_t>(l.in_bin.size()));
    w.PutArray(l.in_bin.data(), l.in_bin.size());
    w.PutArray(l.sub.data(), l.sub.size());
    it.sel.stats.bytes_sent += w.size() - before;
  }
  return w.Take();
}

absl::Status BatchStep::ReadRoundTwo(const std::vector<std::string>& from) {
  const int n = transport_.size();
  // Node r's lists, read in place in its message.
  struct Lists {
    ArrayView<uint32_t> above, in_bin;
    ArrayView<uint8_t> sub;
  };
  std::vector<std::vector<Lists>> got(items_.size(), std::vector<Lists>(n));
  for (int r = 0; r < n; ++r) {
    RoundReader in(from[r]);
    for (size_t i = 0; i < items_.size(); ++i) {
      Item& it = items_[i];
      if (!it.hist() || !it.alive()) continue;
      Lists& l = got[i][r];
      uint32_t a = 0, m = 0;
      if (!in.Get(&a) || !in.GetView(a, &l.above) || !in.Get(&m) || !in.GetView(m, &l.in_bin) ||
          !in.GetView(m, &l.sub)) {
        return BadMessage(r, "round 2", it.b->spec().name);
      }
      // What node r sent agrees with the histogram it sent in round 1.
      uint64_t want_above = 0, want_in = 0;
      const bool all = it.plan.kind == HC::CoarsePlan::kTakeAll;
      for (size_t j = 0; j < it.bins[r].size(); ++j) {
        if (all || it.bins[r][j] > it.plan.kth_coarse) want_above += it.counts[r][j];
        if (!all && it.bins[r][j] == it.plan.kth_coarse) want_in += it.counts[r][j];
      }
      if (a != want_above || m != want_in) return BadMessage(r, "round 2", it.b->spec().name);
      if (r != transport_.rank()) it.sel.stats.bytes_received += 8 + 4 * (a + m) + m;
    }
    if (in.left() != 0) return BadMessage(r, "round 2", "(after the last)");
  }
  for (size_t i = 0; i < items_.size(); ++i) {
    Item& it = items_[i];
    if (!it.hist() || !it.alive()) continue;
    BucketState& b = *it.b;
    uint32_t sub_bin = 0;
    if (it.plan.kind == HC::CoarsePlan::kTakeAll) {
      it.stats().threshold = std::numeric_limits<float>::denorm_min();
    } else {
      std::vector<int64_t> fine(HC::kFineBins + 1, 0);
      uint64_t above = 0;
      for (int r = 0; r < n; ++r) {
        above += got[i][r].above.n;
        const ArrayView<uint8_t>& sub = got[i][r].sub;
        for (uint64_t j = 0; j < sub.n; ++j) ++fine[sub.Get(j)];
      }
      const uint32_t fine_first = it.plan.kth_coarse << (HC::kCoarseShift - HC::kFineShift);
      const HC::FineChoice c =
          HC::ChooseFine(fine, above, it.sel.stats.budget, fine_first, it.sel.lower);
      it.stats().threshold = c.threshold;
      sub_bin = c.sub_bin;
    }
    uint64_t total = 0;
    uint64_t most = it.index.size();
    for (int r = 0; r < n; ++r) most += got[i][r].above.n + got[i][r].in_bin.n;
    it.index.reserve(most);
    for (int r = 0; r < n; ++r) {
      const Lists& l = got[i][r];
      const size_t before = it.index.size();
      it.index.resize(before + l.above.n);
      l.above.CopyTo(it.index.data() + before);
      for (uint64_t j = 0; j < l.in_bin.n; ++j) {
        if (l.sub.Get(j) >= sub_bin) it.index.push_back(l.in_bin.Get(j));
      }
      RETURN_IF_ERROR(CheckIndices(b, r, absl::MakeConstSpan(it.index).subspan(before)));
      it.sel.stats.node_counts[r] = it.index.size() - before;
      total += it.index.size() - before;
    }
    it.sel.stats.local_selected = it.sel.stats.node_counts[transport_.rank()];
    it.sel.stats.sum_of_counts = total;
  }
  return absl::OkStatus();
}

namespace {

constexpr kernels::ElementType kWireTypes[] = {kernels::ElementType::kFloat32,
                                               kernels::ElementType::kBFloat16,
                                               kernels::ElementType::kFloat16};

// K values of `type` at byte `at` of every node's message, summed in rank
// order into `out`: halves widened, summed in fp32 and rounded once (the
// transports' sums, so the bits of their allreduce). Read a tile at a time
// (the messages' bytes are unaligned).
void SumInRankOrder(const std::vector<std::string>& from, size_t at, uint64_t K,
                    kernels::ElementType type, char* out) {
  namespace cv = kernels::convert;
  const bool bf16 = type == kernels::ElementType::kBFloat16;
  const size_t w = kernels::ElementBytes(type);
  constexpr uint64_t kTile = 1024;
  float acc[kTile], theirs[kTile];
  uint16_t half[kTile];
  for (uint64_t j = 0; j < K; j += kTile) {
    const uint64_t m = std::min(kTile, K - j);
    for (size_t r = 0; r < from.size(); ++r) {
      const char* p = from[r].data() + at + j * w;
      float* to = r == 0 ? acc : theirs;
      if (w == sizeof(float)) {
        std::memcpy(to, p, m * sizeof(float));
      } else {
        std::memcpy(half, p, m * w);
        for (uint64_t i = 0; i < m; ++i)
          to[i] = bf16 ? cv::Bf16ToFloat(half[i]) : cv::F16ToFloat(half[i]);
      }
      if (r > 0) {
        for (uint64_t i = 0; i < m; ++i) acc[i] += theirs[i];
      }
    }
    if (w == sizeof(float)) {
      std::memcpy(out + j * w, acc, m * w);
      continue;
    }
    for (uint64_t i = 0; i < m; ++i)
      half[i] = bf16 ? cv::FloatToBf16(acc[i]) : cv::FloatToF16(acc[i]);
    std::memcpy(out + j * w, half, m * w);
  }
}

}  // namespace

absl::Status BatchStep::ReduceValues() {
  // This node's values at every selected index of every live bucket in its
  // wire's type, the fp32 buckets first, then bf16, then fp16 (an allreduce
  // per type when the backend's is cheaper); summed in place. The host
  // copies of the candidates and of I are dropped as I goes to the backend:
  // at a high density (the warm-up's decay) each is a sizeable part of the
  // bucket.
  size_t bytes = 0;
  std::vector<size_t> type_end;  // the types' parts of sums_, one after another
  for (kernels::ElementType type : kWireTypes) {
    for (Item& it : items_) {
      if (!it.alive() || it.b->spec().wire != type) continue;
      it.values_at = bytes;
      it.selected = it.index.size();
      bytes += it.selected * it.wire_bytes();
    }
    type_end.push_back(bytes);
  }
  sums_.assign(bytes, '\0');
  for (Item& it : items_) {
    it.sel.index = {};
    it.sel.value = {};
    std::vector<uint32_t>().swap(it.sel.host_index);
    std::vector<float>().swap(it.sel.host_value);
    if (!it.alive()) continue;
    RETURN_IF_ERROR(it.b->Values(it.sel, it.index, sums_.data() + it.values_at));
    std::vector<uint32_t>().swap(it.index);
    it.stats().bytes_sent += it.selected * it.wire_bytes();
    it.stats().bytes_received += it.selected * it.wire_bytes();
  }
  if (direct_values_) {
    // Every node's values to every peer, summed here in rank order: the
    // bits of the allreduce.
    std::vector<std::string> from;
    RETURN_IF_ERROR(Exchange(TagKind::kRound3, sums_, &from));
    for (int r = 0; r < transport_.size(); ++r) {
      if (from[r].size() != bytes) return BadMessage(r, "round 3", "(its values)");
    }
    for (Item& it : items_) {
      if (!it.alive()) continue;
      SumInRankOrder(from, it.values_at, it.selected, it.b->spec().wire,
                     sums_.data() + it.values_at);
    }
    return absl::OkStatus();
  }
  CollectiveOptions o = Options(TagKind::kRound3);
  o.shape_agreed = true;  // the sizes follow from what every node received
  size_t begin = 0;
  for (size_t t = 0; t < type_end.size(); ++t) {
    const size_t w = kernels::ElementBytes(kWireTypes[t]);
    if (type_end[t] > begin) {
      RETURN_IF_ERROR(transport_.AllreduceSum(sums_.data() + begin, (type_end[t] - begin) / w,
                                              kWireTypes[t], o));
    }
    begin = type_end[t];
  }
  return absl::OkStatus();
}

absl::Status BatchStep::Run() {
  if (ran_) return absl::FailedPreconditionError("batched step: Run called twice");
  ran_ = true;
  const uint64_t rounds_before = transport_.rounds();
  bool any_hist = false;
  uint64_t expected_values = 0;
  for (const Item& it : items_) {
    any_hist = any_hist || it.hist();
    // What round 3 will carry, from the budgets alone (the same on every
    // node before anything is exchanged): top-k and hard may send n times k.
    const SparsifierKind kind = it.b->options().sparsifier;
    expected_values +=
        it.sel.stats.budget * (kind == SparsifierKind::kMicro ? 2 : transport_.size());
  }
  direct_values_ = transport_.DirectCheaper(expected_values * sizeof(float));
  // What each round's messages may take, from the budgets (the same on
  // every node): the receives of the rounds not posted yet are posted now
  // with room for them, so that rounds 2 and 3 cost one trip.
  size_t round1 = 0, round2 = 0;
  for (const Item& it : items_) {
    round1 += sizeof(BucketState::Header) + 4 +
              (it.hist() ? 2048 : 2 * it.sel.stats.budget * sizeof(uint32_t));
    if (it.hist()) round2 += 8 + 2 * it.sel.stats.budget * (sizeof(uint32_t) + 1);
  }
  transport_.Expect(Options(TagKind::kRound1).tag, round1);
  if (any_hist) transport_.Expect(Options(TagKind::kRound2).tag, round2);
  if (direct_values_) {
    transport_.Expect(Options(TagKind::kRound3).tag, expected_values * sizeof(float));
  }

  std::vector<std::string> from;
  RETURN_IF_ERROR(Exchange(TagKind::kRound1, RoundOne(), &from));
  RETURN_IF_ERROR(ReadRoundOne(from));
  if (any_hist) {
    RETURN_IF_ERROR(Rescans());
    RETURN_IF_ERROR(Exchange(TagKind::kRound2, RoundTwo(), &from));
    RETURN_IF_ERROR(ReadRoundTwo(from));
  }
  const absl::Time selected = absl::Now();
  for (Item& it : items_) {
    it.sel.stats.select_seconds = absl::ToDoubleSeconds(selected - it.start);
  }
  RETURN_IF_ERROR(ReduceValues());
  reduced_ = true;
  const absl::Status confirmed = transport_.Confirm(deadline_);  // every node got every transfer
  confirmed_ = confirmed.ok();
  rounds_ = transport_.rounds() - rounds_before;
  const absl::Time reduced = absl::Now();
  for (Item& it : items_) {
    it.sel.stats.exchange_seconds = absl::ToDoubleSeconds(reduced - selected);
    it.sel.stats.rounds = rounds_;
  }
  return confirmed;
}

absl::StatusOr<StepStats> BatchStep::Finish(size_t i, float* update) {
  if (!ran_ || i >= items_.size() || !reduced_) {
    return absl::FailedPreconditionError(
        "batched step: Finish before Run brought every transfer, or no such bucket");
  }
  Item& it = items_[i];
  if (!it.alive()) return it.failed;
  if (update == nullptr) return absl::InvalidArgumentError("batched step: null update");
  return it.b->Apply(it.sel, it.selected, sums_.data() + it.values_at, update);
}

}  // namespace microd::sparsify
