// SPDX-License-Identifier: Apache-2.0
// What the step runner's two files share (step_runner.cc: the sparse steps;
// step_runner_dense.cc: the fused dense allreduce and the buckets a cycle
// reduced).
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/engine/engine_state.h"
#include "daemon/engine/timeline.h"

namespace microd::engine {
namespace step_runner {

inline double Seconds(absl::Time since) { return absl::ToDoubleSeconds(absl::Now() - since); }

inline absl::Status Gone(const std::string& bucket) {
  return JobFailed(absl::AbortedError(
      bucket.empty() ? "a local process is gone"
                     : absl::StrCat("bucket '", bucket, "': a local process is gone")));
}

inline absl::Status Named(const absl::Status& s, const std::string& bucket) {
  return absl::Status(s.code(), absl::StrCat("bucket '", bucket, "': ", s.message()));
}

inline TraceStep DenseTrace(const Work& w, uint64_t step) {
  TraceStep t;
  t.step = step;
  t.dense = true;
  t.selected = t.budget = w.bucket->count;
  t.ready = w.ready_at;
  return t;
}

}  // namespace step_runner

}  // namespace microd::engine
