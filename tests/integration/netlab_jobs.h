// SPDX-License-Identifier: Apache-2.0
// Jobs on the emulated cluster (netlab.h) and the faults they meet: shared
// by the emulated network's tests and the chaos soak (bench/soak).
#pragma once

#include <stdio.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_cluster.h"
#include "tests/integration/netlab.h"
#include "tests/integration/process_util.h"

namespace microd::testing {

inline std::unique_ptr<NetLab> MakeLab(int nodes, const std::vector<std::string>& shape) {
  auto lab = NetLab::Create(nodes, shape);
  EXPECT_TRUE(lab.ok()) << lab.status();
  return lab.ok() ? std::move(lab).value() : nullptr;
}

// Lines of output of client i so far.
inline size_t Progress(const DaemonCluster& cluster, size_t i) {
  return ReadLines(cluster.outs()[i]).size();
}

inline void WaitForProgress(const DaemonCluster& cluster, size_t lines) {
  for (int i = 0; i < 1500 && Progress(cluster, 0) < lines; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_GE(Progress(cluster, 0), lines) << "the job did not get going";
}

// Last line of a client's output and the status in it ("FAILED <status> ...").
inline int FailedStatus(const std::string& out, std::string* line) {
  const auto lines = ReadLines(out);
  *line = lines.empty() ? "" : lines.back();
  int code = -1;
  if (std::sscanf(line->c_str(), "FAILED %d", &code) != 1) return -1;
  return code;
}

// The buckets of ExpectEveryProcessFails' job.
inline const std::vector<BucketSpec> kLongJob = {{"fc", 100003}, {"b", 1000}};

// A long job on n nodes (one process each, kLongJob; peer timeout 3 s)
// whose network `fault` breaks once it is going: every training process
// gets an error within the peer timeout + 5 s, naming what `must_name(r)`
// lists for node r; `then` looks at the cluster before the daemons stop;
// nothing hangs, and the daemons still stop cleanly.
inline void ExpectEveryProcessFails(
    int n, const std::function<absl::Status(NetLab&, DaemonCluster&)>& fault,
    const std::function<std::vector<std::string>(int)>& must_name,
    const std::function<void(DaemonCluster&)>& then = nullptr) {
  const int L = 1;
  auto lab = MakeLab(n, {"--rate=1gbit"});
  ASSERT_NE(lab, nullptr);
  ClusterOptions o;
  o.lab = lab.get();
  o.peer_timeout_ms = 3000;
  DaemonCluster cluster(n, L, o);
  cluster.StartClients(kLongJob, 100000);
  WaitForProgress(cluster, 6);
  if (::testing::Test::HasFatalFailure()) return;
  const auto broken = std::chrono::steady_clock::now();
  ASSERT_TRUE(fault(*lab, cluster).ok());
  const auto codes = cluster.WaitClients(std::chrono::seconds(60));
  EXPECT_LT(std::chrono::steady_clock::now() - broken, std::chrono::seconds(3 + 5));
  for (int r = 0; r < n; ++r) {
    std::string line;
    const int status = FailedStatus(cluster.outs()[r], &line);
    EXPECT_EQ(codes[r], 3) << "node " << r << ": " << line;
    EXPECT_NE(status, -1) << "node " << r << ": " << line;
    for (const std::string& name : must_name(r)) {
      EXPECT_TRUE(absl::StrContains(line, name)) << "node " << r << ": " << line;
    }
  }
  if (then) then(cluster);
  const auto exits = cluster.Terminate(std::chrono::seconds(15));
  for (int r = 0; r < n; ++r) EXPECT_EQ(exits[r], 0) << "node " << r << "'s daemon";
}

}  // namespace microd::testing
