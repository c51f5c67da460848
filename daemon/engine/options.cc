// SPDX-License-Identifier: Apache-2.0
#include "daemon/engine/options.h"

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "daemon/common/status_macros.h"

namespace microd::engine {

namespace {

// One option every node must share: its flag, its value as bits (a double's
// bits) and as text.
struct SharedOption {
  const char* flag;
  uint64_t bits;
  std::string text;
};

std::vector<SharedOption> SharedOptions(const EngineOptions& o) {
  const sparsify::SparsifyOptions& s = o.sparsify;
  auto real = [](const char* flag, double x) {
    uint64_t b;
    std::memcpy(&b, &x, sizeof b);
    return SharedOption{flag, b, absl::StrFormat("%.17g", x)};
  };
  auto whole = [](const char* flag, uint64_t x) { return SharedOption{flag, x, absl::StrCat(x)}; };
  // In a fixed order.
  return {
      whole("--sparsifier", static_cast<uint64_t>(s.sparsifier)),
      whole("--controller", static_cast<uint64_t>(s.controller)),
      real("--density", s.density),
      real("--hard_threshold", s.hard_threshold),
      real("--momentum_correction", s.momentum),
      real("--clip_norm", s.clip_norm),
      whole("--warmup_steps", s.warmup_steps),
      real("--warmup_density", s.warmup_density),
      whole("--warmup_decay_steps", s.warmup_decay_steps),
      real("--warmup_dense_above", s.warmup_dense_above),
      whole("--min_k", s.min_k),
      whole("--dense_floor", o.dense_floor),
      whole("--nonfinite", o.skip_nonfinite ? 1u : 0u),
      whole("--response_cache", o.response_cache ? 1u : 0u),
      whole("--cycle_floats", o.cycle_floats),
      whole("--transport", o.device_resident ? 1u : 0u),
      whole("--wire_dtype", o.wire_bucket_dtype ? 1u : 0u),
      // Elastic or not (node 0 holds the numbers).
      whole("--min_nodes", o.elastic ? 1u : 0u),
      whole("--seal_failure", o.seal_failure_step ? 1u : 0u),
  };
}

}  // namespace

std::string OptionsText(const EngineOptions& o) {
  std::string out;
  for (const SharedOption& x : SharedOptions(o)) absl::StrAppend(&out, x.flag, "=", x.text, "\n");
  return out;
}

absl::Status CheckOptionsAgree(transport::Transport& transport, const EngineOptions& o,
                               absl::Time deadline) {
  const std::vector<SharedOption> mine = SharedOptions(o);
  const size_t k = mine.size();
  std::vector<uint64_t> values(k), all(k * transport.size());
  for (size_t i = 0; i < k; ++i) values[i] = mine[i].bits;
  transport::CollectiveOptions co;
  co.tag = transport::MakeTag(0, transport::TagKind::kControl);
  co.deadline = deadline;
  RETURN_IF_ERROR(transport.Allgather(values.data(), k * sizeof(uint64_t), all.data(), co));
  for (size_t i = 0; i < k; ++i) {
    for (int r = 1; r < transport.size(); ++r) {
      if (all[r * k + i] != all[i]) {
        return absl::InvalidArgumentError(
            absl::StrCat(mine[i].flag, " differs between node 0 and node ", r,
                         ": every node's microd must run with the same value"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace microd::engine
