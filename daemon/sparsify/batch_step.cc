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

}  // namespace

struct BatchStep::Item {
  BucketState* b = nullptr;
  bool hist = false;    // micro with the hist controller: candidates, then a threshold
  bool absent = false;  // this node has no gradient for it
  absl::Status failed;  // its own failure, the same on every node
  StepStats stats;
  absl::Time start;
  // The bucket's read-only pass (its gradient, scale and velocity): the
  // values of round 3 and the commit in Finish read through it.
  kernels::FusedSelectArgs pass;
  uint64_t count = 0;  // this node's selected indices (hist: candidates)
  uint64_t nonfinite = 0;
  float lower = 0;  // hist: the bound the candidates were selected with
  int rescans = 0;
  // This node's selection (hist: its candidates' indices and values), read
  // on the host: the bucket's own buffers on the CPU backend, else copies.
  absl::Span<const uint32_t> my_index;
  absl::Span<const float> my_value;  // hist only
  std::vector<uint32_t> host_index;
  std::vector<float> host_value;
  std::vector<uint32_t> my_bins, my_counts;  // hist: sparse coarse histogram
  std::vector<BucketState::Header> headers;  // every node's
  // hist: every node's sparse coarse histogram (from round 1 or a rescan).
  std::vector<std::vector<uint32_t>> bins, counts;
  HC::CoarsePlan plan;
  std::vector<uint32_t> index;  // I, every node's selection in rank order (until round 3)
  uint64_t selected = 0;        // |I|
  uint64_t values_at = 0;       // where v at I, summed over nodes, is in BatchStep::sums_
  double threshold = 0;

  bool alive() const { return failed.ok(); }
};

bool BatchStep::Batchable(const BucketState& b) {
  const SparsifyOptions& o = b.options_;
  if (o.DenseAt(b.step_) || b.spec_.wire != kernels::ElementType::kFloat32) return false;
  switch (o.sparsifier) {
    case SparsifierKind::kMicro:
      return !b.controller_->WantsPrime();
    case SparsifierKind::kTopK:
    case SparsifierKind::kHard:
      return true;
    case SparsifierKind::kDense:
      break;
  }
  return false;
}

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

absl::Status BatchStep::CopyCandidates(Item& it) {
  BucketState& b = *it.b;
  if (b.ops_->device() == kernels::Device::kCpu) {
    // Host memory already: read in place (nothing writes the candidates
    // before round 3, a rescan's pass aside, which comes back here).
    it.my_index = absl::MakeConstSpan(b.candidate_index_.get(), it.count);
    if (it.hist) it.my_value = absl::MakeConstSpan(b.candidate_value_.get(), it.count);
    return absl::OkStatus();
  }
  it.host_index.resize(it.count);
  RETURN_IF_ERROR(b.Check(b.ops_->CopyToHost(it.host_index.data(), b.candidate_index_.get(),
                                             it.count * sizeof(uint32_t), b.stream_),
                          "copy"));
  it.my_index = it.host_index;
  if (!it.hist) return absl::OkStatus();
  it.host_value.resize(it.count);
  RETURN_IF_ERROR(b.Check(b.ops_->CopyToHost(it.host_value.data(), b.candidate_value_.get(),
                                             it.count * sizeof(float), b.stream_),
                          "copy"));
  it.my_value = it.host_value;
  return absl::OkStatus();
}

absl::Status BatchStep::LocalCoarse(Item& it) {
  // Every finite coarse bin from the pass's bound up (the candidates are at
  // or above it), counted on the host copy of the candidates' values.
  const uint32_t first = HC::CoarseBinOf(it.lower);
  std::vector<uint32_t> dense(first < HC::kFiniteCoarseBins ? HC::kFiniteCoarseBins - first : 0);
  for (float v : it.my_value) {
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
  BucketState& b = *bucket;
  const SparsifyOptions& o = b.options_;
  it.hist = o.sparsifier == SparsifierKind::kMicro && b.controller_->Refines();
  it.start = absl::Now();
  it.stats.step = b.step_;
  it.stats.budget = Budget(o.DensityAt(b.step_), b.spec_.size);
  if (grad == nullptr) {
    it.absent = true;
    items_.push_back(std::move(it));
    return absl::OkStatus();
  }
  const uint64_t d = b.spec_.size;
  const int n = b.job_.num_nodes;
  ASSIGN_OR_RETURN(const float grad_scale, b.ClipScale(grad, it.stats));
  kernels::FusedSelectArgs args = b.PassArgs(grad, grad_scale);
  float lambda = 0;
  switch (o.sparsifier) {
    case SparsifierKind::kMicro: {
      const Range part = PartitionRange(d, n, OwnedPartition(b.job_.node_rank, b.step_, n));
      args.select_begin = part.begin;
      args.select_end = part.end;
      args.threshold = it.lower = b.controller_->PassThreshold();
      it.stats.threshold = args.threshold;
      break;
    }
    case SparsifierKind::kHard:
      lambda = static_cast<float>(o.hard_threshold > 0
                                      ? o.hard_threshold
                                      : 1.0 / (2.0 * std::sqrt(static_cast<double>(b.k_))));
      args.select_begin = 0;
      args.select_end = d;
      args.threshold = lambda;
      it.stats.threshold = lambda;
      break;
    case SparsifierKind::kTopK:
      args.select_begin = args.select_end = 0;  // top-k selects afterwards
      break;
    case SparsifierKind::kDense:
      return absl::InternalError(absl::StrCat("bucket '", b.spec_.name, "': not batchable"));
  }
  ASSIGN_OR_RETURN(kernels::StepScalars scalars, b.SelectPass(args));
  it.pass = args;
  it.nonfinite = scalars.nonfinite;
  it.count = scalars.nonfinite == 0 ? scalars.count : 0;
  if (o.sparsifier == SparsifierKind::kTopK && it.nonfinite == 0) {
    RETURN_IF_ERROR(b.Check(b.ops_->TopK(args.acc, d, it.stats.budget, b.candidate_index_.get(),
                                         b.candidate_value_.get(), b.scalars_.get(), b.stream_),
                            "top-k"));
    ASSIGN_OR_RETURN(scalars, b.ReadScalars());
    it.count = scalars.count;
  }
  if (it.nonfinite == 0) {
    RETURN_IF_ERROR(CopyCandidates(it));
    if (it.hist) RETURN_IF_ERROR(LocalCoarse(it));
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
    const BucketState::Header h = it.b->MakeHeader(it.count, it.nonfinite);
    w.Put(h);
    w.Put(it.absent ? kAbsent : 0u);
    if (!it.absent && it.nonfinite == 0) {
      if (it.hist) {
        w.Put(static_cast<uint32_t>(it.my_bins.size()));
        w.PutArray(it.my_bins.data(), it.my_bins.size());
        w.PutArray(it.my_counts.data(), it.my_counts.size());
      } else {
        w.PutArray(it.my_index.data(), it.my_index.size());
      }
    }
    it.stats.bytes_sent += w.size() - before;
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
    for (size_t i = 0; i < items_.size(); ++i) {
      Item& it = items_[i];
      BucketState& b = *it.b;
      BucketState::Header& h = it.headers[r];
      uint32_t flags = 0;
      if (!in.Get(&h) || !in.Get(&flags) || (flags & ~kAbsent) != 0) {
        return BadMessage(r, "round 1", b.spec_.name);
      }
      absent[i][r] = (flags & kAbsent) != 0;
      if (absent[i][r] || h.nonfinite != 0) continue;
      // A node's count against what it can select from (its partition this
      // step under MiCRO, its candidate capacity otherwise).
      const Range range = b.SenderRange(r);
      const uint64_t most = std::min(b.SelectionBound(), range.size());
      if (h.count > most) {
        return absl::DataLossError(
            absl::StrCat("bucket '", b.spec_.name, "' step ", b.step_, ": node ", r,
                         " says it selected ", h.count, " values, more than the ", most,
                         " it can select from; a bad peer, step failed on every node"));
      }
      if (it.hist) {
        if (!ReadCoarse(in, h.count, HC::CoarseBinOf(it.lower), &it.bins[r], &it.counts[r])) {
          return BadMessage(r, "round 1", b.spec_.name);
        }
      } else if (!in.GetArray(h.count, &lists[i][r])) {
        return BadMessage(r, "round 1", b.spec_.name);
      }
      if (r != transport_.rank()) it.stats.bytes_received += sizeof(h) + sizeof(flags);
    }
    if (in.left() != 0) return BadMessage(r, "round 1", "(after the last)");
  }
  for (size_t i = 0; i < items_.size(); ++i) {
    Item& it = items_[i];
    BucketState& b = *it.b;
    for (int r = 0; r < n && it.alive(); ++r) {
      if (absent[i][r]) {
        it.failed = absl::UnavailableError(absl::StrCat(
            "bucket '", b.spec_.name, "' step ", b.step_, ": node ", r,
            " has no gradient for it (a local process left); not reduced on any node"));
      }
    }
    if (!it.alive()) continue;
    if (absl::Status s = b.CheckHeaders(it.headers); !s.ok()) {
      if (ToClientStatus(s) != ClientStatus::kNonFinite) return s;  // the nodes' states differ
      it.failed = s;
      continue;
    }
    it.stats.node_counts.assign(n, 0);
    for (int r = 0; r < n; ++r) it.stats.node_counts[r] = it.headers[r].count;
    it.stats.local_selected = it.headers[transport_.rank()].count;
    if (it.hist) {
      for (int r = 0; r < n; ++r) {
        if (r != transport_.rank()) it.stats.bytes_received += it.bins[r].size() * 8 + 4;
      }
      continue;  // planned from the global histogram below
    }
    // Every node's indices in its range, then I: in rank order (MiCRO's
    // sets are disjoint), the sorted union for top-k and hard.
    uint64_t total = 0;
    for (int r = 0; r < n; ++r) {
      const Range range = b.SenderRange(r);
      uint64_t outside = 0;
      for (uint32_t x : lists[i][r]) outside += x < range.begin || x >= range.end;
      if (outside != 0) {
        return absl::DataLossError(absl::StrCat(
            "bucket '", b.spec_.name, "' step ", b.step_, ": node ", r, " sent ", outside, " of ",
            lists[i][r].size(), " indices outside [", range.begin, ", ", range.end,
            "), the elements it selects from; a bad peer, step failed on every node"));
      }
      if (r != transport_.rank()) it.stats.bytes_received += lists[i][r].size() * sizeof(uint32_t);
      total += lists[i][r].size();
      it.index.insert(it.index.end(), lists[i][r].begin(), lists[i][r].end());
    }
    it.stats.sum_of_counts = total;
    if (b.options_.sparsifier != SparsifierKind::kMicro) {
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
      if (!it.hist || !it.alive()) continue;
      const uint32_t first = HC::CoarseBinOf(it.lower);
      std::vector<uint64_t> global(first < HC::kFiniteCoarseBins ? HC::kFiniteCoarseBins - first
                                                                 : 0);
      for (int r = 0; r < n; ++r) {
        for (size_t j = 0; j < it.bins[r].size(); ++j)
          global[it.bins[r][j] - first] += it.counts[r][j];
      }
      auto* controller = static_cast<HC*>(it.b->controller_.get());
      it.plan = controller->PlanCoarse(global, it.lower, it.rescans, it.stats.budget);
      if (it.plan.kind == HC::CoarsePlan::kBadOverflow) {
        return absl::DataLossError(absl::StrCat("bucket '", it.b->spec_.name, "' step ",
                                                it.b->step_,
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
      BucketState& b = *it->b;
      it->lower = it->plan.rescan_lower;
      ++it->rescans;
      it->stats.rescans = it->rescans;
      // The read-only pass again (its range: this node's partition).
      kernels::FusedSelectArgs again = it->pass;
      again.threshold = it->lower;
      ASSIGN_OR_RETURN(const kernels::StepScalars s, b.SelectPass(again));
      it->count = s.count;
      RETURN_IF_ERROR(CopyCandidates(*it));
      RETURN_IF_ERROR(LocalCoarse(*it));
      w.Put(it->count);
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
            !ReadCoarse(in, count, HC::CoarseBinOf(it->lower), &it->bins[r], &it->counts[r])) {
          return BadMessage(r, "rescan", it->b->spec_.name);
        }
        it->headers[r].count = count;
        it->stats.node_counts[r] = count;
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
    if (!it.hist || !it.alive()) continue;
    Lists& l = lists[i];
    const bool all = it.plan.kind == HC::CoarsePlan::kTakeAll;
    const uint32_t fine_first = it.plan.kth_coarse << (HC::kCoarseShift - HC::kFineShift);
    for (uint64_t j = 0; j < it.count; ++j) {
      const uint32_t bin = HC::CoarseBinOf(it.my_value[j]);
      if (all || bin > it.plan.kth_coarse) {
        ++l.above;
      } else if (bin == it.plan.kth_coarse) {
        l.in_bin.push_back(it.my_index[j]);
        l.sub.push_back(static_cast<uint8_t>(HC::FineBinOf(it.my_value[j]) - fine_first));
      }
    }
    bytes += 8 + l.above * sizeof(uint32_t) + l.in_bin.size() * (sizeof(uint32_t) + 1);
  }
  RoundWriter w;
  w.Reserve(bytes);
  for (size_t i = 0; i < items_.size(); ++i) {
    Item& it = items_[i];
    if (!it.hist || !it.alive()) continue;
    const Lists& l = lists[i];
    const bool all = it.plan.kind == HC::CoarsePlan::kTakeAll;
    const size_t before = w.size();
    w.Put(static_cast<uint32_t>(l.above));
    for (uint64_t j = 0; j < it.count; ++j) {
      if (all || HC::CoarseBinOf(it.my_value[j]) > it.plan.kth_coarse) w.Put(it.my_index[j]);
    }
    w.Put(static_cast<uint32_t>(l.in_bin.size()));
    w.PutArray(l.in_bin.data(), l.in_bin.size());
    w.PutArray(l.sub.data(), l.sub.size());
    it.stats.bytes_sent += w.size() - before;
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
      if (!it.hist || !it.alive()) continue;
      Lists& l = got[i][r];
      uint32_t a = 0, m = 0;
      if (!in.Get(&a) || !in.GetView(a, &l.above) || !in.Get(&m) || !in.GetView(m, &l.in_bin) ||
          !in.GetView(m, &l.sub)) {
        return BadMessage(r, "round 2", it.b->spec_.name);
      }
      // What node r sent agrees with the histogram it sent in round 1.
      uint64_t want_above = 0, want_in = 0;
      const bool all = it.plan.kind == HC::CoarsePlan::kTakeAll;
      for (size_t j = 0; j < it.bins[r].size(); ++j) {
        if (all || it.bins[r][j] > it.plan.kth_coarse) want_above += it.counts[r][j];
        if (!all && it.bins[r][j] == it.plan.kth_coarse) want_in += it.counts[r][j];
      }
      if (a != want_above || m != want_in) return BadMessage(r, "round 2", it.b->spec_.name);
      if (r != transport_.rank()) it.stats.bytes_received += 8 + 4 * (a + m) + m;
    }
    if (in.left() != 0) return BadMessage(r, "round 2", "(after the last)");
  }
  for (size_t i = 0; i < items_.size(); ++i) {
    Item& it = items_[i];
    if (!it.hist || !it.alive()) continue;
    BucketState& b = *it.b;
    uint32_t sub_bin = 0;
    if (it.plan.kind == HC::CoarsePlan::kTakeAll) {
      it.threshold = std::numeric_limits<float>::denorm_min();
    } else {
      std::vector<int64_t> fine(HC::kFineBins + 1, 0);
      uint64_t above = 0;
      for (int r = 0; r < n; ++r) {
        above += got[i][r].above.n;
        const ArrayView<uint8_t>& sub = got[i][r].sub;
        for (uint64_t j = 0; j < sub.n; ++j) ++fine[sub.Get(j)];
      }
      const uint32_t fine_first = it.plan.kth_coarse << (HC::kCoarseShift - HC::kFineShift);
      const HC::FineChoice c = HC::ChooseFine(fine, above, it.stats.budget, fine_first, it.lower);
      it.threshold = c.threshold;
      sub_bin = c.sub_bin;
    }
    it.stats.threshold = it.threshold;
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
      const Range range = b.SenderRange(r);
      uint64_t outside = 0;
      for (size_t j = before; j < it.index.size(); ++j) {
        outside += it.index[j] < range.begin || it.index[j] >= range.end;
      }
      if (outside != 0) {
        return absl::DataLossError(absl::StrCat(
            "bucket '", b.spec_.name, "' step ", b.step_, ": node ", r, " sent ", outside, " of ",
            it.index.size() - before, " indices outside [", range.begin, ", ", range.end,
            "), the elements it selects from; a bad peer, step failed on every node"));
      }
      it.stats.node_counts[r] = it.index.size() - before;
      total += it.index.size() - before;
    }
    it.stats.local_selected = it.stats.node_counts[transport_.rank()];
    it.stats.sum_of_counts = total;
  }
  return absl::OkStatus();
}

absl::Status BatchStep::ReduceValues() {
  // This node's accumulated values at every selected index of every live
  // bucket, one after another; summed in place. The host copies of the
  // candidates and of I are dropped as I goes to the backend: at a high
  // density (the warm-up's decay) each is a sizeable part of the bucket.
  uint64_t total = 0;
  for (Item& it : items_) {
    it.my_index = {};
    it.my_value = {};
    std::vector<uint32_t>().swap(it.host_index);
    std::vector<float>().swap(it.host_value);
    if (it.alive()) total += it.index.size();
  }
  sums_.assign(total, 0.0f);
  uint64_t at = 0;
  for (Item& it : items_) {
    if (!it.alive()) continue;
    BucketState& b = *it.b;
    const uint64_t K = it.index.size();
    if (!b.global_index_.Fit(b.ops_, std::max<uint64_t>(K, 1)) ||
        !b.values_.Fit(b.ops_, std::max<uint64_t>(K, 1))) {
      return absl::ResourceExhaustedError(
          absl::StrCat("bucket '", b.spec_.name, "': out of memory for ", K, " values"));
    }
    RETURN_IF_ERROR(b.Check(b.ops_->CopyToDevice(b.global_index_.get(), it.index.data(),
                                                 K * sizeof(uint32_t), b.stream_),
                            "copy"));
    std::vector<uint32_t>().swap(it.index);
    it.selected = K;
    it.values_at = at;
    RETURN_IF_ERROR(
        b.Check(b.ops_->GatherSum(it.pass, b.global_index_.get(), K, b.values_.get(), b.stream_),
                "gather"));
    RETURN_IF_ERROR(b.Check(
        b.ops_->CopyToHost(sums_.data() + at, b.values_.get(), K * sizeof(float), b.stream_),
        "copy"));
    it.stats.bytes_sent += K * sizeof(float);
    it.stats.bytes_received += K * sizeof(float);
    at += K;
  }
  const int n = transport_.size();
  if (direct_values_) {
    // Every node's values to every peer, summed here in rank order: the
    // bits of the allreduce.
    std::vector<std::string> from;
    const std::string_view bytes(reinterpret_cast<const char*>(sums_.data()),
                                 sums_.size() * sizeof(float));
    RETURN_IF_ERROR(Exchange(TagKind::kRound3, bytes, &from));
    for (int r = 0; r < n; ++r) {
      if (from[r].size() != total * sizeof(float)) {
        return BadMessage(r, "round 3", "(its values)");
      }
    }
    if (total > 0) std::memcpy(sums_.data(), from[0].data(), total * sizeof(float));
    constexpr uint64_t kTile = 1024;  // the messages' bytes, read a tile at a time
    float theirs[kTile];
    for (int r = 1; r < n; ++r) {
      for (uint64_t j = 0; j < total; j += kTile) {
        const uint64_t m = std::min(kTile, total - j);
        std::memcpy(theirs, from[r].data() + j * sizeof(float), m * sizeof(float));
        for (uint64_t i = 0; i < m; ++i) sums_[j + i] += theirs[i];
      }
    }
  } else {
    CollectiveOptions o = Options(TagKind::kRound3);
    o.shape_agreed = true;  // the sizes follow from what every node received
    RETURN_IF_ERROR(transport_.AllreduceSum(sums_.data(), total, transport::DataType::kFloat32, o));
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
    any_hist = any_hist || it.hist;
    // What round 3 will carry, from the budgets alone (the same on every
    // node before anything is exchanged): top-k and hard may send n times k.
    const SparsifierKind kind = it.b->options_.sparsifier;
    expected_values += it.stats.budget * (kind == SparsifierKind::kMicro ? 2 : transport_.size());
  }
  direct_values_ = transport_.DirectCheaper(expected_values * sizeof(float));
  // What each round's messages may take, from the budgets (the same on
  // every node): the receives of the rounds not posted yet are posted now
  // with room for them, so that rounds 2 and 3 cost one trip.
  size_t round1 = 0, round2 = 0;
  for (const Item& it : items_) {
    round1 +=
        sizeof(BucketState::Header) + 4 + (it.hist ? 2048 : 2 * it.stats.budget * sizeof(uint32_t));
    if (it.hist) round2 += 8 + 2 * it.stats.budget * (sizeof(uint32_t) + 1);
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
    it.stats.select_seconds = absl::ToDoubleSeconds(selected - it.start);
  }
  RETURN_IF_ERROR(ReduceValues());
  reduced_ = true;
  const absl::Status confirmed = transport_.Confirm(deadline_);  // every node got every transfer
  confirmed_ = confirmed.ok();
  rounds_ = transport_.rounds() - rounds_before;
  const absl::Time reduced = absl::Now();
  for (Item& it : items_) {
    it.stats.exchange_seconds = absl::ToDoubleSeconds(reduced - selected);
    it.stats.rounds = rounds_;
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
  BucketState& b = *it.b;
  const absl::Time start = absl::Now();
  const uint64_t K = it.selected;
  // The state committed (e += g, zeroed at I), then the update: v / W at
  // I, zero elsewhere (it may be the gradient's buffer: after the commit).
  RETURN_IF_ERROR(b.Commit(it.pass, K, update));
  RETURN_IF_ERROR(b.Check(b.ops_->CopyToDevice(b.values_.get(), sums_.data() + it.values_at,
                                               K * sizeof(float), b.stream_),
                          "copy"));
  RETURN_IF_ERROR(b.Check(b.ops_->ScatterAverage(b.values_.get(), b.global_index_.get(), K,
                                                 static_cast<float>(b.job_.world_size), update,
                                                 b.spec_.size, /*out_zeroed=*/true, b.stream_),
                          "scatter"));
  ++b.step_;
  if (b.controller_ != nullptr) b.controller_->Commit(K, it.stats.budget);
  it.stats.selected = K;
  it.stats.cre = std::fabs(static_cast<double>(K) / static_cast<double>(it.stats.budget) - 1.0);
  it.stats.apply_seconds = absl::ToDoubleSeconds(absl::Now() - start);
  b.LogStep(it.stats);
  return it.stats;
}

}  // namespace microd::sparsify
