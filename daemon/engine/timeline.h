// SPDX-License-Identifier: Apache-2.0
// The timeline (--timeline=FILE, microctl timeline): for each bucket step,
// when it waited, summed locally, selected, exchanged and wrote back, with
// K, k and CRE, as Chrome trace-event JSON (Perfetto, chrome://tracing): one
// process per node, one track per bucket, a "step" span per step with its
// phases nested inside it, in order, never overlapping.
//
// Bounded so it can stay on: a ring of the last TimelineOptions::steps
// bucket steps (a fixed-size entry each, ~230 bytes), optionally a sample of
// every Nth step of each bucket. Recording copies a few numbers under a
// mutex on the engine's thread, and only while something holds the timeline
// on (the file, or a microctl capture); laying the spans out and the JSON
// are done off that thread.
// What recording costs is measured where it happens and written into the
// trace ("otherData": record_ns_per_step).
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "daemon/engine/stats.h"

namespace microd::engine {

struct TimelineOptions {
  size_t steps = 10000;  // ring capacity in bucket steps (>= 1)
  uint64_t every = 1;    // step s of a bucket is kept when s % every == 0
};

// One bucket step as the step runner measured it. A phase that did not run
// keeps an infinite-past begin. The waiting phase is the time from `ready`
// to the first phase that ran (Record fills it).
struct TraceStep {
  // The bucket's step, from 0: a sparse bucket's is its sparsifier's (as
  // microctl history shows it; a loaded state goes on counting).
  uint64_t step = 0;
  bool dense = false;
  uint64_t selected = 0;
  uint64_t budget = 0;
  double cre = 0;
  double threshold = 0;
  absl::Time ready = absl::InfinitePast();  // every local process had submitted
  std::array<absl::Time, kPhases> begin;
  std::array<absl::Time, kPhases> end;

  TraceStep() {
    begin.fill(absl::InfinitePast());
    end.fill(absl::InfinitePast());
  }
  void Span(Phase p, absl::Time b, absl::Time e) {
    begin[static_cast<int>(p)] = b;
    end[static_cast<int>(p)] = e;
  }
  void Span(Phase p, absl::Time b, double seconds) { Span(p, b, b + absl::Seconds(seconds)); }
};

class Timeline {
 public:
  explicit Timeline(TimelineOptions options);

  // Cheap: true while something holds the timeline on.
  bool recording() const { return holds_.load(std::memory_order_relaxed) > 0; }
  // On for as long as one hold is (the file holds it from the start, a
  // capture for its window).
  void Hold() { holds_.fetch_add(1, std::memory_order_relaxed); }
  void Release() { holds_.fetch_sub(1, std::memory_order_relaxed); }

  // The node's name in the trace (its process); set once the node has its rank.
  void SetNode(int rank, const std::string& name);

  // Keeps `step` of `bucket` if recording and sampled. The phases are laid
  // in order as measured; a begin before the previous phase's end (a clock
  // step) is moved to it, so the spans nest and never overlap.
  void Record(const std::string& bucket, const TraceStep& step);

  // The kept steps whose span began at or after `since`, as a Chrome trace
  // (a JSON object). `steps`, if given: how many went in.
  std::string ChromeJson(absl::Time since = absl::InfinitePast(), uint64_t* steps = nullptr) const;

  struct Counts {
    uint64_t recorded = 0;          // steps kept since start
    uint64_t overwritten = 0;       // the oldest, dropped from the full ring
    uint64_t kept = 0;              // in the ring now
    double record_ns_per_step = 0;  // mean time spent in Record
  };
  Counts counts() const;

 private:
  struct Entry {
    uint32_t track = 0;
    TraceStep step;  // as recorded; laid out (Laid) when written
  };

  const TimelineOptions options_;
  std::atomic<int> holds_{0};
  mutable absl::Mutex mu_;
  int rank_ ABSL_GUARDED_BY(mu_) = 0;
  std::string node_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, uint32_t> tracks_
      ABSL_GUARDED_BY(mu_);  // bucket -> track (from 1)
  std::vector<Entry> ring_ ABSL_GUARDED_BY(mu_);
  size_t next_ ABSL_GUARDED_BY(mu_) = 0;  // where the next entry goes once full
  uint64_t recorded_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t record_ns_ ABSL_GUARDED_BY(mu_) = 0;
};

// --timeline=FILE: holds the timeline on and rewrites FILE (atomically: a
// reader finds a whole trace) every `interval` when steps were recorded
// since, and once more when destroyed.
class TimelineFile {
 public:
  // Writes the (empty) trace once first: an error if FILE cannot be written.
  static absl::StatusOr<std::unique_ptr<TimelineFile>> Start(Timeline* timeline, std::string path,
                                                             absl::Duration interval);
  ~TimelineFile();

  absl::Status Write();

 private:
  TimelineFile(Timeline* timeline, std::string path, absl::Duration interval)
      : timeline_(timeline), path_(std::move(path)), interval_(interval) {}

  Timeline* const timeline_;
  const std::string path_;
  const absl::Duration interval_;
  uint64_t written_ = 0;  // steps recorded at the last write
  absl::Notification stop_;
  std::thread thread_;
};

}  // namespace microd::engine
