#include "daemon/engine/options.h"

#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/common/status_macros.h"

namespace microd::engine {

absl::Status CheckOptionsAgree(transport::Transport& transport, const EngineOptions& o,
                               absl::Time deadline) {
  const sparsify::SparsifyOptions& s = o.sparsify;
  // (flag, value) in a fixed order; doubles by their bits.
  auto bits = [](double x) {
    uint64_t b;
    std::memcpy(&b, &x, sizeof b);
    return b;
  };
  const std::vector<std::pair<const char*, uint64_t>> mine = {
      {"--sparsifier", static_cast<uint64_t>(s.sparsifier)},
      {"--controller", static_cast<uint64_t>(s.controller)},
      {"--density", bits(s.density)},
      {"--hard_threshold", bits(s.hard_threshold)},
      {"--momentum_correction", bits(s.momentum)},
      {"--clip_norm", bits(s.clip_norm)},
      {"--warmup_steps", s.warmup_steps},
      {"--warmup_density", bits(s.warmup_density)},
      {"--warmup_decay_steps", s.warmup_decay_steps},
      {"--warmup_dense_above", bits(s.warmup_dense_above)},
      {"--min_k", s.min_k},
      {"--dense_floor", o.dense_floor},
      {"--nonfinite", o.skip_nonfinite ? 1u : 0u},
      {"--response_cache", o.response_cache ? 1u : 0u},
      {"--cycle_floats", o.cycle_floats},
      {"--transport", o.device_resident ? 1u : 0u},
      {"--wire_dtype", o.wire_bucket_dtype ? 1u : 0u},
      {"--min_nodes", o.elastic ? 1u : 0u},  // elastic or not (node 0 holds the number)
  };
  const size_t k = mine.size();
  std::vector<uint64_t> values(k), all(k * transport.size());
  for (size_t i = 0; i < k; ++i) values[i] = mine[i].second;
  transport::CollectiveOptions co;
  co.tag = transport::MakeTag(0, transport::TagKind::kControl);
  co.deadline = deadline;
  RETURN_IF_ERROR(transport.Allgather(values.data(), k * sizeof(uint64_t), all.data(), co));
  for (size_t i = 0; i < k; ++i) {
    for (int r = 1; r < transport.size(); ++r) {
      if (all[r * k + i] != all[i]) {
        return absl::InvalidArgumentError(
            absl::StrCat(mine[i].first, " differs between node 0 and node ", r,
                         ": every node's microd must run with the same value"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace microd::engine
