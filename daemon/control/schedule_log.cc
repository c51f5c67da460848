// SPDX-License-Identifier: Apache-2.0
#include "daemon/control/schedule_log.h"

#include <algorithm>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/element_type.h"

namespace microd::control {
namespace {

// microd.v1.DataType's values, by name (the step is fp32 for every one);
// null for a value that is no bucket's type.
const char* DataTypeName(int dtype) {
  return kernels::IsBucketType(dtype)
             ? kernels::ElementTypeName(static_cast<kernels::ElementType>(dtype))
             : nullptr;
}
constexpr int64_t kMaxBucketCount = 0xFFFFFFFFll;

}  // namespace

absl::Status CheckName(const std::string& what, const std::string& name) {
  if (name.empty()) return absl::InvalidArgumentError(absl::StrCat(what, " is empty"));
  if (name.size() > kMaxNameBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " has ", name.size(), " bytes (limit ", kMaxNameBytes, ")"));
  }
  return absl::OkStatus();
}

std::string Describe(const BucketInfo& b) {
  const char* type = DataTypeName(b.dtype);
  return absl::StrCat(type != nullptr ? type : "dtype " + std::to_string(b.dtype), " x ", b.count,
                      b.dense ? " dense" : "");
}

absl::Status ScheduleLog::CheckReport(const std::vector<BucketInfo>& ready) {
  if (ready.size() > kMaxBucketsPerReport) {
    return absl::InvalidArgumentError(
        absl::StrCat(ready.size(), " buckets in one report (limit ", kMaxBucketsPerReport, ")"));
  }
  std::set<std::string> names;
  for (const BucketInfo& b : ready) {
    if (absl::Status s = CheckName("bucket name", b.name); !s.ok()) return s;
    if (DataTypeName(b.dtype) == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("bucket '", b.name, "': unsupported data type ", b.dtype));
    }
    if (b.count < 1 || b.count > kMaxBucketCount) {
      return absl::InvalidArgumentError(absl::StrCat("bucket '", b.name, "': element count ",
                                                     b.count, " out of range [1, 2^32)"));
    }
    if (!names.insert(b.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("bucket '", b.name, "' reported twice"));
    }
  }
  return absl::OkStatus();
}

absl::Status ScheduleLog::CheckNotPending(int rank, const std::vector<BucketInfo>& ready) const {
  for (const BucketInfo& b : ready) {
    auto it = pending_.find(b.name);
    if (it != pending_.end() && it->second.by_rank.count(rank) != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "bucket '", b.name, "' already reported by node ", rank, " and not scheduled yet"));
    }
  }
  return absl::OkStatus();
}

void ScheduleLog::Add(int rank, const std::vector<BucketInfo>& ready,
                      const std::vector<std::string>& names, bool hold) {
  const size_t n = names.size();
  std::vector<std::pair<uint64_t, std::string>> complete;
  for (const BucketInfo& b : ready) {
    Pending& p = pending_[b.name];
    if (p.by_rank.empty()) p.order = report_order_++;
    p.by_rank[rank] = b;
    if (p.by_rank.size() == n) complete.push_back({p.order, b.name});
  }
  if (complete.empty() || hold) return;
  // Everything this report completed is one batch, in first-report order.
  std::sort(complete.begin(), complete.end());
  ScheduleBatch batch;
  batch.index = end();
  for (const auto& [order, name] : complete) {
    const Pending& p = pending_[name];
    const BucketInfo& first = p.by_rank.begin()->second;
    bool agree = true;
    for (const auto& [r, b] : p.by_rank) {
      agree = agree && b.dtype == first.dtype && b.count == first.count && b.dense == first.dense;
    }
    if (agree) {
      batch.scheduled.push_back(first);
      layout_[name] = first;
    } else {
      std::vector<std::string> parts;
      for (const auto& [r, b] : p.by_rank) {
        parts.push_back(absl::StrCat("node ", r, " (", names[r], "): ", Describe(b)));
      }
      batch.errors.push_back({name, absl::StrCat("bucket '", name, "' differs between nodes: ",
                                                 absl::StrJoin(parts, "; "))});
    }
    pending_.erase(name);
  }
  batches_.push_back(std::move(batch));
}

const BucketInfo* ScheduleLog::Scheduled(const std::string& name) const {
  auto it = layout_.find(name);
  return it == layout_.end() ? nullptr : &it->second;
}

void ScheduleLog::Trim(uint64_t seen_by_all) {
  while (!batches_.empty() && base_ < seen_by_all) {
    batches_.pop_front();
    ++base_;
  }
}

void ScheduleLog::Restart() {
  base_ += batches_.size();
  batches_.clear();
  pending_.clear();
}

}  // namespace microd::control
