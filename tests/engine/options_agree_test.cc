// SPDX-License-Identifier: Apache-2.0
// CheckOptionsAgree: every node of a job must step with the same options
// (the sizes of the cycle's allgather and the results depend on them). The
// nodes are threads over the in-process transport.
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "daemon/engine/engine.h"
#include "daemon/transport/inproc/inproc_transport.h"
#include "gtest/gtest.h"

namespace microd::engine {
namespace {

// Runs the check on n nodes, node r with options(r); returns each status.
std::vector<absl::Status> Check(int n, const std::function<EngineOptions(int)>& options) {
  auto group = transport::CreateInprocGroup(n);
  std::vector<absl::Status> out(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      out[r] = CheckOptionsAgree(*group[r], options(r), absl::Now() + absl::Seconds(20));
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

TEST(OptionsAgree, SameOptionsPass) {
  for (const absl::Status& s : Check(3, [](int) { return EngineOptions{}; })) {
    EXPECT_TRUE(s.ok()) << s;
  }
}

TEST(OptionsAgree, EveryNodeNamesTheFirstOptionThatDiffers) {
  struct Case {
    const char* flag;
    std::function<void(EngineOptions&)> change;
  };
  const std::vector<Case> cases = {
      {"--cycle_floats", [](EngineOptions& o) { o.cycle_floats = 0; }},
      {"--density", [](EngineOptions& o) { o.sparsify.density = 0.001; }},
      {"--dense_floor", [](EngineOptions& o) { o.dense_floor = 1000; }},
      {"--response_cache", [](EngineOptions& o) { o.response_cache = false; }},
      {"--nonfinite", [](EngineOptions& o) { o.skip_nonfinite = true; }},
      {"--momentum_correction", [](EngineOptions& o) { o.sparsify.momentum = 0.9; }},
      {"--min_k", [](EngineOptions& o) { o.sparsify.min_k = 1000; }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.flag);
    const auto statuses = Check(4, [&](int r) {
      EngineOptions o;
      if (r == 2) c.change(o);
      return o;
    });
    for (const absl::Status& s : statuses) {
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
      EXPECT_TRUE(absl::StrContains(s.message(), c.flag)) << s;
      EXPECT_TRUE(absl::StrContains(s.message(), "node 2")) << s;
    }
  }
}

}  // namespace
}  // namespace microd::engine
