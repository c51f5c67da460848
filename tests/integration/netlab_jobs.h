// SPDX-License-Identifier: Apache-2.0
// Jobs on the emulated cluster (netlab.h) and the faults they meet: shared
// by the emulated network's tests and the chaos soak (bench/soak).
#pragma once

#include <stdio.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
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

// Resets every TCP connection between nodes `from` and `to` of `cluster`'s
// job but the control plane's, as the path would (`ss -K` in node
// `from`'s namespace: the socket closed there, an RST to the other end).
inline void ResetConnections(const NetLab& lab, const DaemonCluster& cluster, int from, int to) {
  const std::string port = std::to_string(cluster.coordinator_port());
  const std::string killed = cluster.dir() + "/killed";
  std::string cmd;
  for (const auto& a :
       lab.InNode(from, {"/usr/bin/ss", "-K", "-t", "dst", lab.addr(to), "and", "not", "dport", "=",
                         ":" + port, "and", "not", "sport", "=", ":" + port})) {
    absl::StrAppend(&cmd, " '", a, "'");
  }
  ASSERT_EQ(std::system(absl::StrCat(cmd, " >'", killed, "'").c_str()), 0) << cmd;
  // ss lists the sockets it closed: at least one of the data plane.
  ASSERT_TRUE(absl::StrContains(ReadFile(killed), lab.addr(to) + ":")) << ReadFile(killed);
}

// An elastic job of `n` nodes (`steps` steps) on the emulated cluster
// meets `fault` (run once step `fault_at` began; with `hold`, while every
// process waits at that step) that fails a step on every node but
// loses none; the coordinator answers with the next epoch of the same
// nodes (fresh keys and connections). Every process is told once
// (MICROD_ERR_MEMBERSHIP), and every result of the job is the reference's,
// bit for bit: the step is applied once on every node. `check` then gets
// the change's cause as the coordinator recorded it; `settled`: how node
// 2's log says it settled a step it held ("rolled forward", "dropped", "").
inline void ExpectTheJobGoesOn(
    const std::vector<std::string>& extra,
    const std::function<void(NetLab&, DaemonCluster&)>& fault,
    const std::function<void(NetLab&, DaemonCluster&, const std::string&)>& check,
    std::string* settled, int n = 3, long steps = 60, long fault_at = 5, bool hold = true) {
  const int L = 1;
  const std::vector<BucketSpec> buckets = {{"fc", 100003}, {"b", 1000}};
  auto lab = MakeLab(n, {"--rate=1gbit"});
  ASSERT_NE(lab, nullptr);
  ClusterOptions o;
  o.lab = lab.get();
  o.peer_timeout_ms = 3000;
  o.extra = {"--min_nodes=2"};
  o.extra.insert(o.extra.end(), extra.begin(), extra.end());
  DaemonCluster cluster(n, L, o);
  // The processes wait for the fault to be in place: under load the 60
  // steps could end before it is (a flake loop's failure).
  const std::string go = cluster.dir() + "/go";
  cluster.StartClients(buckets, steps, -1, -1, -1, [&](int, int) {
    std::vector<std::string> a = {"elastic"};
    if (hold) a.push_back(absl::StrCat("hold_at=", fault_at, ":", go));
    return a;
  });
  WaitForProgress(cluster, fault_at * buckets.size());
  if (::testing::Test::HasFatalFailure()) return;
  fault(*lab, cluster);
  if (::testing::Test::HasFatalFailure()) return;
  std::ofstream(go).put('\n');
  const auto codes = cluster.WaitClients(std::chrono::seconds(120));
  const ReferenceHashes ref = Reference(n, L, buckets, steps);
  for (int r = 0; r < n; ++r) {
    const auto lines = ReadLines(cluster.outs()[r]);
    EXPECT_EQ(codes[r], 0) << "node " << r << ": " << (lines.empty() ? "" : lines.back());
    size_t results = 0;
    std::vector<std::string> epochs;
    CheckElasticOutput(lines, ref, buckets, r, &results, &epochs);
    EXPECT_EQ(results, steps * buckets.size()) << "node " << r;
    ASSERT_EQ(epochs.size(), 1u) << "node " << r;
    // step, epoch, rank, world size, node rank, node count: the same job.
    EXPECT_TRUE(absl::EndsWith(epochs[0], absl::StrCat(" 1 ", r, " ", n, " ", r, " ", n)))
        << "node " << r << ": " << epochs[0];
  }
  auto status = cluster.Status(0);
  ASSERT_TRUE(status.ok()) << status.status();
  ASSERT_EQ(status->membership_changes_size(), 1);
  check(*lab, cluster, status->membership_changes(0).cause());
  const std::string log2 = ReadFile(cluster.dir() + "/daemon2.log");
  for (const char* how : {"rolled forward", "dropped"}) {
    if (absl::StrContains(log2, how)) *settled = how;
  }
}

}  // namespace microd::testing
