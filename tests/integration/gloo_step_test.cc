// SPDX-License-Identifier: Apache-2.0
// Nodes as separate processes on loopback, coordinated over gRPC, reducing
// over Gloo: every node's outputs, residuals and thresholds equal, bit for
// bit, those of the same nodes over the in-process transport. A node killed
// mid-run makes every other node fail within the peer timeout.
#include <chrono>
#include <fstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "daemon/control/coordinator.h"
#include "daemon/control/services.h"
#include "daemon/transport/inproc/inproc_transport.h"
#include "gtest/gtest.h"
#include "tests/integration/process_util.h"
#include "tests/integration/step_record.h"

namespace microd::testing {
namespace {

struct Config {
  std::string sparsifier = "micro";
  std::string controller = "hist";
  double density = 0.01;
  uint64_t size = 20011;
  uint64_t steps = 25;
};

struct Cluster {
  std::unique_ptr<control::Coordinator> coordinator;
  std::unique_ptr<control::CoordinatorService> service;
  std::unique_ptr<control::ControlServer> server;

  explicit Cluster(int nodes, absl::Duration peer_timeout = absl::Seconds(10)) {
    control::CoordinatorOptions o;
    o.job_id = "job";
    o.token = *control::JobToken::FromToken("secret");
    o.expected_nodes = nodes;
    o.peer_timeout = peer_timeout;
    coordinator = *control::Coordinator::Create(o);
    service = std::make_unique<control::CoordinatorService>(coordinator.get());
    server = *control::ControlServer::Start("127.0.0.1:0", {service.get()});
  }
};

std::string TempPath(const std::string& name) {
  const char* dir = std::getenv("TMPDIR");
  return absl::StrCat(dir ? dir : "/tmp", "/microd-", getpid(), "-", name);
}

std::vector<std::vector<StepRecord>> RunInproc(int n, const Config& c) {
  auto ops = kernels::CreateCpuSparseOps();
  auto group = transport::CreateInprocGroup(n);
  sparsify::SparsifyOptions so;
  so.sparsifier = *sparsify::ParseSparsifier(c.sparsifier);
  so.controller = *sparsify::ParseController(c.controller);
  so.density = c.density;
  sim::SyntheticOptions stream;
  stream.size = c.size;
  stream.seed = 3;
  std::vector<std::vector<StepRecord>> records(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      auto b = sparsify::BucketState::Create({"grads", c.size, 1}, {n, r, n}, so, ops.get());
      ASSERT_TRUE(b.ok()) << b.status();
      absl::Status s = RunAndRecord(
          **b, *group[r], stream, r, c.steps, absl::Seconds(60), [](uint64_t) {}, &records[r]);
      EXPECT_TRUE(s.ok()) << s;
    });
  }
  for (auto& t : threads) t.join();
  return records;
}

std::vector<std::string> WorkerArgs(const Cluster& cluster, int rank, const Config& c,
                                    const std::string& out) {
  return {MICROD_STEP_WORKER,
          "--coordinator=" + cluster.server->address(),
          "--rank=" + std::to_string(rank),
          "--sparsifier=" + c.sparsifier,
          "--controller=" + c.controller,
          "--density=" + std::to_string(c.density),
          "--size=" + std::to_string(c.size),
          "--steps=" + std::to_string(c.steps),
          "--out=" + out};
}

void ExpectGlooEqualsInproc(int n, const Config& c) {
  SCOPED_TRACE(absl::StrCat(n, " nodes, ", c.sparsifier, "/", c.controller));
  Cluster cluster(n);
  std::vector<pid_t> pids;
  std::vector<std::string> outs;
  for (int r = 0; r < n; ++r) {
    outs.push_back(TempPath(absl::StrCat("step-", n, "-", r)));
    pids.push_back(Spawn(WorkerArgs(cluster, r, c, outs.back())));
  }
  const auto codes = WaitAll(pids, std::chrono::seconds(120));
  const auto want = RunInproc(n, c);
  for (int r = 0; r < n; ++r) {
    const auto lines = ReadLines(outs[r]);
    std::remove(outs[r].c_str());
    ASSERT_EQ(codes[r], 0) << "node " << r << ": " << (lines.empty() ? "" : lines.back());
    ASSERT_EQ(lines.size(), c.steps) << "node " << r;
    for (uint64_t t = 0; t < c.steps; ++t) {
      StepRecord got;
      ASSERT_TRUE(StepRecord::FromLine(lines[t], &got)) << lines[t];
      EXPECT_EQ(got, want[r][t]) << "node " << r << " step " << t << ": gloo " << got.ToLine()
                                 << " vs inproc " << want[r][t].ToLine();
    }
  }
}

TEST(GlooStep, MicroHistMatchesInprocBitForBit) {
  for (int n : {1, 2, 3, 4}) ExpectGlooEqualsInproc(n, Config{});
}

TEST(GlooStep, MicroPaperMatchesInprocBitForBit) {
  Config c;
  c.controller = "paper";
  for (int n : {2, 3}) ExpectGlooEqualsInproc(n, c);
}

TEST(GlooStep, TopKAndDenseMatchInprocBitForBit) {
  Config c;
  c.sparsifier = "topk";
  ExpectGlooEqualsInproc(3, c);
  c.sparsifier = "dense";
  ExpectGlooEqualsInproc(3, c);
}

TEST(GlooStep, KilledNodeFailsEveryOtherNodeWithinThePeerTimeout) {
  const int n = 3;
  const absl::Duration peer_timeout = absl::Seconds(3);
  Cluster cluster(n, peer_timeout);
  Config c;
  c.steps = 1000;  // far more than run before the kill
  std::vector<pid_t> pids;
  std::vector<std::string> outs;
  for (int r = 0; r < n; ++r) {
    outs.push_back(TempPath(absl::StrCat("kill-", r)));
    auto args = WorkerArgs(cluster, r, c, outs.back());
    args.push_back("--peer_timeout_ms=3000");
    if (r == 2) args.push_back("--die_at_step=5");
    pids.push_back(Spawn(args));
  }
  const auto start = std::chrono::steady_clock::now();
  const auto codes = WaitAll(pids, std::chrono::seconds(60));
  EXPECT_EQ(codes[2], -1);  // killed
  for (int r = 0; r < 2; ++r) {
    const auto lines = ReadLines(outs[r]);
    ASSERT_FALSE(lines.empty()) << "node " << r << " exit code " << codes[r];
    EXPECT_EQ(codes[r], 3) << "node " << r << ": " << lines.back();
    EXPECT_TRUE(absl::StartsWith(lines.back(), "FAILED")) << lines.back();
    EXPECT_LE(lines.size(), 8u) << "node " << r << " kept running after the kill";
  }
  for (const auto& o : outs) std::remove(o.c_str());
  // Everyone is done well within start-up + the peer timeout.
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
}

}  // namespace
}  // namespace microd::testing
