// SPDX-License-Identifier: Apache-2.0
// The coordinator's schedule log: the buckets each node reported ready,
// and the batches of those every node reported (numbered from the job's
// start, in first-report order), which the nodes poll and run in log
// order. A bucket the nodes reported differently is an error of its batch,
// named on every node; the job's layout (every bucket as first scheduled)
// is kept for the nodes that join later. Not thread-safe: the coordinator
// calls it under its lock.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "daemon/control/types.h"

namespace microd::control {

constexpr size_t kMaxNameBytes = 256;
constexpr size_t kMaxBucketsPerReport = 65536;

// A name (job, node, bucket) is not empty and at most kMaxNameBytes.
absl::Status CheckName(const std::string& what, const std::string& name);
// "float32 x 1024 dense": a bucket as messages show it.
std::string Describe(const BucketInfo& b);

class ScheduleLog {
 public:
  // A report's buckets, alone: names, types, counts in [1, 2^32), none
  // twice, at most kMaxBucketsPerReport.
  static absl::Status CheckReport(const std::vector<BucketInfo>& ready);
  // None of `ready` reported by node `rank` and not scheduled yet.
  absl::Status CheckNotPending(int rank, const std::vector<BucketInfo>& ready) const;
  // Node `rank`'s report: the buckets every node (`names`, by rank) has now
  // reported become one batch, unless `hold` (fewer nodes than the job's
  // minimum: nothing is scheduled).
  void Add(int rank, const std::vector<BucketInfo>& ready, const std::vector<std::string>& names,
           bool hold);
  // The bucket as the job first scheduled it (null: never).
  const BucketInfo* Scheduled(const std::string& name) const;

  uint64_t base() const { return base_; }  // the first batch still held
  uint64_t end() const { return base_ + batches_.size(); }
  const ScheduleBatch& at(uint64_t index) const { return batches_[index - base_]; }
  // A batch of the coordinator's own at end() (a change's marker).
  void Append(ScheduleBatch b) { batches_.push_back(std::move(b)); }
  // Every node has seen the batches below `seen_by_all`: dropped.
  void Trim(uint64_t seen_by_all);
  // A new epoch: the log goes on at end(), empty; what was reported and
  // not scheduled is dropped (the nodes report it again).
  void Restart();
  void DropPending() { pending_.clear(); }

 private:
  struct Pending {
    uint64_t order = 0;                 // first report, for a stable schedule
    std::map<int, BucketInfo> by_rank;  // what each node reported
  };
  uint64_t report_order_ = 0;
  std::map<std::string, Pending> pending_;
  std::deque<ScheduleBatch> batches_;
  uint64_t base_ = 0;
  std::map<std::string, BucketInfo> layout_;
};

}  // namespace microd::control
