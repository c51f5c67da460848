// SPDX-License-Identifier: Apache-2.0
// microd end to end: daemons on loopback, training processes written against
// the C API, every result compared with the reference of issue A computed in
// this process; and the faults a deployment meets.
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "microd/v1/admin.grpc.pb.h"
#include "microd/wire.h"
#include "tests/integration/daemon_cluster.h"
#include "tests/integration/process_util.h"

namespace microd::testing {
namespace {

std::vector<std::string> CacheFlags(bool response_cache) {
  return {response_cache ? "--response_cache=true" : "--response_cache=false"};
}

// `cache`: the response cache on or off; unset: microd's default (on).
// `reverse_nodes`: nodes whose processes submit the buckets last first, 2 ms apart.
// `extra`: more daemon flags.
void RunAndCompare(int n, int L, std::optional<bool> cache = std::nullopt, int reverse_nodes = 0,
                   const std::vector<std::string>& extra = {}) {
  const bool response_cache = cache.value_or(true);
  SCOPED_TRACE(absl::StrCat(n, " daemons x ", L, " processes",
                            response_cache ? ", response cache" : ", coordinator only"));
  const std::vector<BucketSpec> buckets = {{"embed", 1000}, {"conv", 70001}, {"fc", 200003}};
  const long steps = 50;
  std::vector<std::string> flags = cache ? CacheFlags(*cache) : std::vector<std::string>{};
  flags.insert(flags.end(), extra.begin(), extra.end());
  const bool in_cycle = response_cache && extra.empty();  // the default --cycle_floats
  DaemonCluster cluster(n, L, flags);
  cluster.StartClients(buckets, steps, -1, -1, -1, [&](int r, int) {
    return r < reverse_nodes ? std::vector<std::string>{"reverse"} : std::vector<std::string>{};
  });
  const auto codes = cluster.WaitClients(std::chrono::seconds(240));
  const auto ref = Reference(n, L, buckets, steps);
  ExpectMatchesReference(cluster, codes, ref, n, L, buckets, steps);
  if (::testing::Test::HasFatalFailure()) return;
  // The daemons report what they did.
  auto status = cluster.Status(0);
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->job_state(), microd::v1::JOB_STATE_RUNNING);
  EXPECT_EQ(status->response_cache(), response_cache);
  if (response_cache) {
    // The coordinator scheduled each bucket once; every later step was
    // agreed between the daemons.
    EXPECT_LE(status->batches(), buckets.size());
    EXPECT_GE(status->cache_batches(), static_cast<uint64_t>(steps - 1));
  } else {
    EXPECT_EQ(status->cache_batches(), 0u);
    EXPECT_GE(status->batches(), static_cast<uint64_t>(steps));
  }
  // The small dense bucket ("embed") rode in the cycle at every step after
  // the first (the coordinator's), unless that is off.
  EXPECT_EQ(status->cycle_reductions(), in_cycle ? static_cast<uint64_t>(steps - 1) : 0u);
  ASSERT_EQ(status->buckets_size(), 3);
  for (const auto& b : status->buckets()) {
    EXPECT_EQ(b.steps(), static_cast<uint64_t>(steps)) << b.name();
    EXPECT_EQ(b.dense(), b.count() < kDenseFloor) << b.name();
    if (!b.dense()) {
      EXPECT_LE(b.mean_cre(), 0.05) << b.name();
      // The daemon's memory for it: one residual (4 B an element) and O(k);
      // several processes on a node are summed in place, adding nothing
      // (before: a local sum of 4 B an element per bucket).
      EXPECT_LE(static_cast<double>(b.state_bytes()) / static_cast<double>(b.count()), 5.5)
          << b.name();
    }
    EXPECT_EQ(b.history_size(), 0) << "history only when asked for";
  }
  // The per-step history: every sparse step in order, consistent with the totals.
  auto with_history = cluster.Status(n - 1, /*history=*/true);
  ASSERT_TRUE(with_history.ok()) << with_history.status();
  for (const auto& b : with_history->buckets()) {
    if (b.dense()) {
      EXPECT_EQ(b.history_size(), 0) << b.name();
      continue;
    }
    ASSERT_EQ(b.history_size(), steps) << b.name();
    double sum_cre = 0;
    for (int i = 0; i < b.history_size(); ++i) {
      const auto& h = b.history(i);
      EXPECT_EQ(h.step(), static_cast<uint64_t>(i)) << b.name();
      EXPECT_EQ(h.budget(), b.budget()) << b.name();
      EXPECT_GT(h.selected(), 0u) << b.name() << " step " << h.step();
      if (h.step() >= 2) sum_cre += h.cre();
    }
    EXPECT_EQ(b.history(steps - 1).selected(), b.last_selected()) << b.name();
    EXPECT_DOUBLE_EQ(b.history(steps - 1).threshold(), b.last_threshold()) << b.name();
    EXPECT_NEAR(sum_cre / (steps - 2), b.mean_cre(), 1e-9) << b.name();
  }
}

// With microd's defaults (the response cache on).
TEST(DaemonEndToEnd, ThreeDaemonsOneProcessEach) { RunAndCompare(3, 1); }

// The buckets of a batch step together: every step of every sparse bucket
// takes the rounds of one, whatever their number (before: each bucket 4-6
// collectives of its own, one bucket after another). Eight sparse buckets
// on 4 nodes, every sparsifier; each bucket's steps equal the reference.
struct RoundsCase {
  std::string name;
  std::vector<std::string> flags;
  sparsify::SparsifyOptions options;
  uint64_t most;  // rounds per step, from the second on (hist primes at the first)
};
void PrintTo(const RoundsCase& c, std::ostream* os) { *os << c.name; }

class BatchedRounds : public ::testing::TestWithParam<RoundsCase> {};

TEST_P(BatchedRounds, EveryBucketsStepTakesTheRoundsOfOne) {
  const RoundsCase& c = GetParam();
  const int n = 4, L = 1;
  const long steps = 5;
  std::vector<BucketSpec> buckets;
  for (int b = 0; b < 8; ++b)
    buckets.push_back({absl::StrCat("layer", b), 70001 + 1000 * uint64_t(b)});
  DaemonCluster cluster(n, L, c.flags);
  cluster.StartClients(buckets, steps);
  ExpectMatchesReference(cluster, cluster.WaitClients(std::chrono::seconds(120)),
                         Reference(n, L, buckets, steps, c.options), n, L, buckets, steps);
  for (int r = 0; r < n; ++r) {
    auto status = cluster.Status(r, /*history=*/true);
    ASSERT_TRUE(status.ok()) << status.status();
    ASSERT_EQ(status->buckets_size(), 8);
    for (const auto& b : status->buckets()) {
      ASSERT_EQ(b.history_size(), steps) << b.name();
      for (int i = 1; i < b.history_size(); ++i) {
        EXPECT_GE(b.history(i).rounds(), 1u) << b.name() << " step " << i;
        EXPECT_LE(b.history(i).rounds(), c.most) << b.name() << " step " << i << " node " << r;
      }
      EXPECT_EQ(b.last_rounds(), b.history(steps - 1).rounds());
    }
  }
}

RoundsCase Rounds(const std::string& name, sparsify::SparsifierKind kind,
                  sparsify::ControllerKind controller, uint64_t most, double hard_threshold = 0) {
  RoundsCase c;
  c.name = name;
  c.options.sparsifier = kind;
  c.options.controller = controller;
  c.options.hard_threshold = hard_threshold;
  // 0.1 %: what a node sends stays well under the crossover of any link
  // this machine gives (round 3 a direct round, each message one transfer).
  c.options.density = 0.001;
  // The links given, not measured: the probes of a machine busy with other
  // tests could make the values' round an allreduce (a round more) or
  // cut a node's indices into two transfers. These are a near link's, with
  // an inline part of 1 MB.
  c.flags = {"--density=0.001",
             "--remedies=off",
             "--link_model=round_ms=1.5,posted_ms=1,mb_per_s=1000",
             absl::StrCat("--sparsifier=", sparsify::SparsifierName(kind)),
             absl::StrCat("--controller=", sparsify::ControllerName(controller)),
             absl::StrCat("--hard_threshold=", hard_threshold)};
  c.most = most;
  return c;
}

INSTANTIATE_TEST_SUITE_P(
    Sparsifiers, BatchedRounds,
    ::testing::Values(Rounds("micro_hist", sparsify::SparsifierKind::kMicro,
                             sparsify::ControllerKind::kHistogram, 3),
                      Rounds("micro_paper", sparsify::SparsifierKind::kMicro,
                             sparsify::ControllerKind::kPaper, 2),
                      Rounds("topk", sparsify::SparsifierKind::kTopK,
                             sparsify::ControllerKind::kHistogram, 2),
                      // (a threshold that selects about as much as the others: a node's
                      // indices then fit the first transfer of a round, under the crossover)
                      Rounds("hard", sparsify::SparsifierKind::kHard,
                             sparsify::ControllerKind::kHistogram, 2, 0.03)),
    [](const ::testing::TestParamInfo<RoundsCase>& info) { return info.param.name; });
TEST(DaemonEndToEnd, ThreeDaemonsTwoProcessesEach) { RunAndCompare(3, 2); }
TEST(DaemonEndToEnd, FourDaemonsOneProcessEach) { RunAndCompare(4, 1); }
TEST(DaemonEndToEnd, FourDaemonsTwoProcessesEach) { RunAndCompare(4, 2); }
// Every step through the coordinator (--response_cache=false).
TEST(DaemonEndToEnd, CoordinatorOnlyThreeDaemonsTwoProcessesEach) { RunAndCompare(3, 2, false); }
TEST(DaemonEndToEnd, CoordinatorOnlyFourDaemonsOneProcessEach) { RunAndCompare(4, 1, false); }
// Half the nodes submit in the other order and later: the cycles agree on
// partial sets and run the rest in later cycles, with the same results.
TEST(DaemonEndToEnd, ResponseCacheNodesSubmittingInOtherOrders) { RunAndCompare(4, 1, true, 2); }
// The same with two processes a node: passes begun during a cycle and
// dropped leave the local sum (made in place, once) for the step's own.
TEST(DaemonEndToEnd, ResponseCacheTwoProcessesSubmittingInOtherOrders) {
  RunAndCompare(4, 2, true, 2);
}
// Small dense buckets not reduced by the cycle: a fused allreduce after it.
TEST(DaemonEndToEnd, ResponseCacheWithoutCycleReductions) {
  RunAndCompare(3, 2, true, 1, {"--cycle_floats=0"});
}

// Last line of a client's output, and its status code when it failed.
int FailedStatus(const std::string& out, std::string* line) {
  const auto lines = ReadLines(out);
  *line = lines.empty() ? "" : lines.back();
  int code = -1;
  if (std::sscanf(line->c_str(), "FAILED %d", &code) != 1) return -1;
  return code;
}

void KilledTrainingProcess(bool response_cache) {
  DaemonCluster cluster(3, 2, CacheFlags(response_cache));
  cluster.StartClients({{"fc", 100003}}, 100000, /*die_at=*/3, /*node=*/1, /*local=*/1);
  const auto start = std::chrono::steady_clock::now();
  const auto codes = cluster.WaitClients(std::chrono::seconds(60));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(40));
  for (size_t i = 0; i < codes.size(); ++i) {
    if (i == 3) {
      EXPECT_EQ(codes[i], -1);  // the one that was killed
      continue;
    }
    std::string line;
    EXPECT_EQ(codes[i], 3) << line;
    EXPECT_EQ(FailedStatus(cluster.outs()[i], &line), 5) << line;  // MICROD_ERR_JOB_FAILED
    EXPECT_TRUE(absl::StrContains(line, "local process 1")) << line;
  }
  for (int r = 0; r < 3; ++r) {
    auto status = cluster.Status(r);
    ASSERT_TRUE(status.ok()) << "node " << r << ": " << status.status();
    EXPECT_EQ(status->job_state(), microd::v1::JOB_STATE_FAILED) << "node " << r;
  }
}

TEST(DaemonFaults, KilledTrainingProcessFailsTheOthersAndTheDaemonStaysUp) {
  KilledTrainingProcess(false);
}
// With the response cache the other nodes wait in a cycle, not on the
// coordinator: the failure must end it as well.
TEST(DaemonFaults, KilledTrainingProcessWithTheResponseCache) { KilledTrainingProcess(true); }

void KilledDaemon(bool response_cache) {
  DaemonCluster cluster(3, 1, CacheFlags(response_cache));
  cluster.StartClients({{"fc", 100003}, {"b", 1000}}, 100000);
  // Let them run a few steps, then kill node 2's daemon.
  for (int i = 0; i < 500 && ReadLines(cluster.outs()[0]).size() < 6; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_GE(ReadLines(cluster.outs()[0]).size(), 6u);
  const auto start = std::chrono::steady_clock::now();
  cluster.Kill(2);
  const auto codes = cluster.WaitClients(std::chrono::seconds(60));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(15));
  for (int r = 0; r < 3; ++r) {
    std::string line;
    const int status = FailedStatus(cluster.outs()[r], &line);
    EXPECT_EQ(codes[r], 3) << "node " << r << ": " << line;
    // Its own daemon gone: UNAVAILABLE; the others: the job failed.
    EXPECT_EQ(status, r == 2 ? 2 : 5) << "node " << r << ": " << line;
  }
}

TEST(DaemonFaults, KilledDaemonFailsEveryOtherNode) { KilledDaemon(false); }
TEST(DaemonFaults, KilledDaemonWithTheResponseCache) { KilledDaemon(true); }

// Killed daemons (SIGKILL), and their stopped processes.
void KillNodes(DaemonCluster& cluster, const std::vector<int>& lost) {
  for (int r : lost) {
    cluster.Kill(r);
    kill(cluster.clients()[r], SIGKILL);
    waitpid(cluster.clients()[r], nullptr, 0);
  }
}

TEST(DaemonElastic, ALostNodeLeavesAndTheOthersGoOn) {
  ClusterOptions o{CacheFlags(false)};
  ExpectElasticJobGoesOn(o, 3, {2}, KillNodes);
}
TEST(DaemonElastic, ALostNodeLeavesAndTheOthersGoOnWithTheResponseCache) {
  ClusterOptions o{CacheFlags(true)};
  ExpectElasticJobGoesOn(o, 3, {2}, KillNodes);
}
// Two at once, one of them in the middle: ranks move down.
TEST(DaemonElastic, TwoNodesLostAtOnce) {
  ClusterOptions o{CacheFlags(true)};
  ExpectElasticJobGoesOn(o, 4, {1, 3}, KillNodes, /*epochs=*/0);
}
// A node whose daemon is stopped (SIGTERM, as a preempted pod's is) leaves
// at once: the others go on without waiting for the peer timeout (20 s here).
TEST(DaemonElastic, ANodeThatLeavesIsLetGoAtOnce) {
  ClusterOptions o{CacheFlags(true)};
  o.peer_timeout_ms = 20000;
  double took = 0;
  ExpectElasticJobGoesOn(
      o, 3, {2},
      [](DaemonCluster& cluster, const std::vector<int>& lost) {
        for (int r : lost) {
          kill(cluster.pid(r), SIGTERM);
          EXPECT_EQ(WaitAll({cluster.pid(r)}, std::chrono::seconds(20))[0], 0);
          cluster.Forget(r);
          kill(cluster.clients()[r], SIGKILL);
          waitpid(cluster.clients()[r], nullptr, 0);
        }
      },
      1, "left the job", &took);
  EXPECT_LT(took, 10) << "waited for the peer timeout";
  std::printf("the survivors finished %.2f s after node 2's daemon was stopped\n", took);
}
// A coordinator of its own (--coordinator_only): node 0 is a training node
// like the others, and an elastic job goes on without it, the others
// renumbered 0 and 1.
TEST(DaemonElastic, WithACoordinatorOfItsOwnNodeZeroCanBeLost) {
  ClusterOptions o{CacheFlags(true)};
  o.coordinator_only = true;
  ExpectElasticJobGoesOn(o, 3, {0}, KillNodes);
}
// Two lost 1 s apart: the first change's data plane cannot connect (its
// other lost node is in it); the second change's does, and the survivors go
// on from there, once.
TEST(DaemonElastic, TwoNodesLostOneSecondApart) {
  ClusterOptions o{CacheFlags(true)};
  ExpectElasticJobGoesOn(
      o, 4, {1, 3},
      [](DaemonCluster& cluster, const std::vector<int>& lost) {
        KillNodes(cluster, {lost[0]});
        std::this_thread::sleep_for(std::chrono::seconds(1));
        KillNodes(cluster, {lost[1]});
      },
      /*epochs=*/2);
}

// A job of 2 nodes that takes up to 3 (--max_nodes=3), its processes
// elastic; those of the nodes `held` wait before step `at` until the file
// dir()/go exists.
std::unique_ptr<DaemonCluster> TwoNodesOfThree(const std::vector<BucketSpec>& buckets, long steps,
                                               long at, const std::vector<int>& held,
                                               bool sealed = false) {
  ClusterOptions o{CacheFlags(true)};
  o.extra.push_back("--max_nodes=3");
  o.token = sealed;  // a job token: the data plane sealed (--seal=auto)
  auto cluster = std::make_unique<DaemonCluster>(2, 1, o);
  const std::string go = cluster->dir() + "/go";
  cluster->StartClients(buckets, steps, -1, -1, -1, [&](int r, int) {
    std::vector<std::string> a = {"elastic"};
    if (std::find(held.begin(), held.end(), r) != held.end()) {
      a.push_back(absl::StrCat("hold_at=", at, ":", go));
    }
    return a;
  });
  return cluster;
}

// Waits (20 s at most) until node r's engine runs in membership epoch `epoch`.
void AwaitEpoch(DaemonCluster& cluster, int r, uint64_t epoch) {
  for (int i = 0; i < 1000; ++i) {
    auto status = cluster.Status(r);
    if (status.ok() && status->membership_epoch() >= epoch) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ADD_FAILURE() << "node " << r << " did not reach membership epoch " << epoch;
}

// Waits (30 s at most) until node r's processes wrote `lines` lines.
void AwaitLines(const DaemonCluster& cluster, int r, size_t lines) {
  for (int i = 0; i < 1500 && ReadLines(cluster.outs()[r]).size() < lines; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_EQ(ReadLines(cluster.outs()[r]).size(), lines) << "node " << r;
}

// A job of 2 nodes that takes up to 3 (--max_nodes=3): a third daemon,
// started while node 1's processes wait before step 6, joins the running job
// and takes part from that step on, with a zero residual and the job's step
// and threshold state; every step on every node is bit for bit the
// reference of a job of 2 and then of 3 such nodes. Each process of the two
// sees the change once: its step 6 is answered MICROD_ERR_MEMBERSHIP with
// the new rank and world size, and done again; `in_flight`: node 0's
// processes had submitted it before the join (it was pending, and dropped),
// else they submit it after, not having read the change yet (the fence).
// With a job token (the in-flight case) the data plane is sealed: the
// joiner's epoch has its keys from its join, the others' from the change.
void ExpectANodeJoins(bool in_flight) {
  const std::vector<BucketSpec> buckets = {{"fc", 100003}, {"b", 1000}};
  const long steps = 12, join_at = 6;
  const bool sealed = in_flight;
  auto held = TwoNodesOfThree(buckets, steps, join_at,
                              in_flight ? std::vector<int>{1} : std::vector<int>{0, 1}, sealed);
  DaemonCluster& cluster = *held;
  const std::string go = cluster.dir() + "/go";
  AwaitLines(cluster, 1, join_at * buckets.size());
  // Node 0's step 6 submitted (in_flight), or node 0 waiting too.
  AwaitLines(cluster, 0, join_at * buckets.size());
  std::this_thread::sleep_for(std::chrono::seconds(1));
  const auto start = std::chrono::steady_clock::now();
  cluster.AddNode();
  cluster.StartNodeClients(2, buckets, steps - join_at, [&](int, int) {
    return std::vector<std::string>{"elastic", absl::StrCat("first=", join_at)};
  });
  for (int r = 0; r < 3; ++r) AwaitEpoch(cluster, r, 1);
  std::printf("the third node took part %.2f s after its daemon's start\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  std::ofstream(go) << "go\n";
  const std::vector<int> codes = cluster.WaitClients(std::chrono::seconds(90));
  const auto ref = PhasedReference(3, 1, buckets, steps, {{{0, 1}, {0}}, {{0, 1, 2}, {join_at}}});
  ExpectElasticOutputs(
      cluster, ref, buckets, codes,
      {steps * buckets.size(), steps * buckets.size(), (steps - join_at) * buckets.size()},
      {1, 1, 0});
  for (int r = 0; r < 2; ++r) {
    // step, epoch, rank, world size, node rank, node count
    EXPECT_EQ(ReadLines(cluster.outs()[r])[join_at * buckets.size()],
              absl::StrCat("EPOCH 6 1 ", r, " 3 ", r, " 3"));
  }
  for (int r = 0; r < 3; ++r) {
    auto status = cluster.Status(r);
    ASSERT_TRUE(status.ok()) << status.status();
    EXPECT_EQ(status->membership_epoch(), 1u) << "node " << r;
    EXPECT_EQ(status->node_count(), 3) << "node " << r;
    EXPECT_EQ(status->node_rank(), r) << "node " << r;
    EXPECT_EQ(status->data_plane_sealed(), sealed) << "node " << r;
  }
  auto status = cluster.Status(0);
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->max_nodes(), 3);
  ASSERT_EQ(status->membership_changes_size(), 1);
  EXPECT_TRUE(absl::StrContains(status->membership_changes(0).cause(), "'node2' joined as node 2"))
      << status->membership_changes(0).cause();
}

TEST(DaemonElastic, ANodeStartedLaterJoinsTheRunningJob) { ExpectANodeJoins(false); }
TEST(DaemonElastic, ANodeJoinsWhileAStepIsInFlight) { ExpectANodeJoins(true); }

// What a running job refuses, and is not changed by: a node started with
// other options (its daemon exits naming each), and a node whose buckets
// are not the job's (its processes fail naming the bucket and both shapes,
// and it is dropped); the two nodes of the job go on, every step bit for bit
// a job of 2.
TEST(DaemonElastic, ANodeThatDiffersIsRefusedAndTheJobGoesOn) {
  const std::vector<BucketSpec> buckets = {{"fc", 100003}, {"b", 1000}};
  const long steps = 12, join_at = 6;
  auto held = TwoNodesOfThree(buckets, steps, join_at, {0, 1});
  DaemonCluster& cluster = *held;
  const std::string go = cluster.dir() + "/go";
  for (int r = 0; r < 2; ++r) AwaitLines(cluster, r, join_at * buckets.size());
  cluster.AddNode({"--density=0.02"});
  const std::vector<int> refused = WaitAll({cluster.pid(2)}, std::chrono::seconds(30));
  cluster.Forget(2);
  EXPECT_NE(refused[0], 0);
  const std::string log = ReadFile(cluster.dir() + "/daemon2.log");
  EXPECT_TRUE(absl::StrContains(log, "--density is 0.02 there, 0.01 in the job")) << log;
  // Its buckets another shape: admitted, refused at its first report.
  cluster.AddNode();
  cluster.StartNodeClients(3, {{"fc", 100004}, {"b", 1000}}, steps - join_at, [&](int, int) {
    return std::vector<std::string>{absl::StrCat("first=", join_at)};
  });
  for (int r = 0; r < 2; ++r) AwaitEpoch(cluster, r, 2);
  std::ofstream(go) << "go\n";
  std::vector<pid_t> job = {cluster.clients()[0], cluster.clients()[1]};
  std::vector<int> codes = WaitAll(job, std::chrono::seconds(90));
  const std::vector<int> joiner = WaitAll({cluster.clients()[2]}, std::chrono::seconds(30));
  std::string line;
  FailedStatus(cluster.outs()[2], &line);
  EXPECT_EQ(joiner[0], 3) << line;
  EXPECT_TRUE(absl::StrContains(line,
                                "has bucket 'fc' as float32 x 100004, and the job has it "
                                "as float32 x 100003"))
      << line;
  const auto ref = Reference(2, 1, buckets, steps);
  // Each process read both changes (the join, then the drop) before its
  // step 6 was answered MICROD_ERR_MEMBERSHIP once.
  ExpectElasticOutputs(cluster, ref, buckets, codes,
                       {steps * buckets.size(), steps * buckets.size()}, {1, 1});
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(ReadLines(cluster.outs()[r])[join_at * buckets.size()],
              absl::StrCat("EPOCH 6 2 ", r, " 2 ", r, " 2"));
  }
  auto status = cluster.Status(0);
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->node_count(), 2);
  ASSERT_EQ(status->membership_changes_size(), 2);
  EXPECT_TRUE(absl::StrContains(status->membership_changes(1).cause(), "refused, and dropped"))
      << status->membership_changes(1).cause();
}

// A replacement: a job of 3 (--min_nodes=2 --max_nodes=3) loses node 2
// (killed) before step 6, goes on with 2, and a new node started while they
// wait before step 10 joins as node 2; every step bit for bit the reference
// of 3, then 2, then 3 nodes (the new one with a zero residual).
TEST(DaemonElastic, AReplacementJoinsAfterALoss) {
  const std::vector<BucketSpec> buckets = {{"fc", 100003}, {"b", 1000}};
  const long steps = 14, lost_at = 6, join_at = 10;
  ClusterOptions o{CacheFlags(true)};
  o.extra = {"--min_nodes=2", "--max_nodes=3"};
  DaemonCluster cluster(3, 1, o);
  const std::string go = cluster.dir() + "/go";
  cluster.StartClients(buckets, steps, -1, -1, -1, [&](int r, int) {
    std::vector<std::string> a = {"elastic"};
    a.push_back(r == 2 ? absl::StrCat("pause_at=", lost_at)
                       : absl::StrCat("hold_at=", join_at, ":", go));
    return a;
  });
  AwaitLines(cluster, 2, lost_at * buckets.size());
  KillNodes(cluster, {2});
  // The survivors: step 6 answered MICROD_ERR_MEMBERSHIP, then on to step 10.
  for (int r = 0; r < 2; ++r) AwaitLines(cluster, r, join_at * buckets.size() + 1);
  const auto start = std::chrono::steady_clock::now();
  cluster.AddNode();
  cluster.StartNodeClients(3, buckets, steps - join_at, [&](int, int) {
    return std::vector<std::string>{"elastic", absl::StrCat("first=", join_at)};
  });
  for (int r : {0, 1, 3}) AwaitEpoch(cluster, r, 2);
  std::printf("the replacement took part %.2f s after its daemon's start\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  std::ofstream(go) << "go\n";
  std::vector<pid_t> live = {cluster.clients()[0], cluster.clients()[1], cluster.clients()[3]};
  std::vector<int> codes = WaitAll(live, std::chrono::seconds(90));
  codes.insert(codes.begin() + 2, 0);  // node 2's, killed
  const auto ref = PhasedReference(4, 1, buckets, steps,
                                   {{{0, 1, 2}, {0}}, {{0, 1}, {lost_at}}, {{0, 1, 3}, {join_at}}},
                                   {}, 1, false, /*seeds=*/{0, 1, 2, 2});
  ExpectElasticOutputs(cluster, ref, buckets, codes,
                       {steps * buckets.size(), steps * buckets.size(), lost_at * buckets.size(),
                        (steps - join_at) * buckets.size()},
                       {2, 2, 0, 0});
  for (int r : {0, 1, 3}) {
    auto status = cluster.Status(r);
    ASSERT_TRUE(status.ok()) << status.status();
    EXPECT_EQ(status->membership_epoch(), 2u) << "node " << r;
    EXPECT_EQ(status->node_count(), 3) << "node " << r;
    EXPECT_EQ(status->node_rank(), r == 3 ? 2 : r) << "node " << r;
  }
  auto status = cluster.Status(0);
  ASSERT_TRUE(status.ok()) << status.status();
  ASSERT_EQ(status->membership_changes_size(), 2);
  EXPECT_TRUE(absl::StrContains(status->membership_changes(0).cause(), "(node2) silent"))
      << status->membership_changes(0).cause();
  EXPECT_TRUE(absl::StrContains(status->membership_changes(1).cause(), "'node3' joined as node 2"))
      << status->membership_changes(1).cause();
}

// Below --min_nodes: a job of 3 (--min_nodes=2, --elastic_timeout_s=3)
// loses nodes 1 and 2 before step 6; node 0 goes on alone and runs nothing.
// `join`: a replacement started then joins as node 1, and the job runs as
// a job of 2 from step 6 (node 0's step 6 answered MICROD_ERR_MEMBERSHIP
// twice, once per change), bit for bit; else node 0's process fails with the
// reason within the peer timeout, the elastic timeout and 5 s.
void ExpectBelowTheMinimum(bool join) {
  const std::vector<BucketSpec> buckets = {{"fc", 100003}, {"b", 1000}};
  const long steps = 10, lost_at = 6;
  ClusterOptions o{CacheFlags(true)};
  o.extra = {"--min_nodes=2", "--elastic_timeout_s=3"};
  DaemonCluster cluster(3, 1, o);
  cluster.StartClients(buckets, steps, -1, -1, -1, [&](int r, int) {
    std::vector<std::string> a = {"elastic"};
    if (r > 0) a.push_back(absl::StrCat("pause_at=", lost_at));
    return a;
  });
  for (int r = 1; r < 3; ++r) AwaitLines(cluster, r, lost_at * buckets.size());
  const auto start = std::chrono::steady_clock::now();
  KillNodes(cluster, {1, 2});
  if (!join) {
    const std::vector<int> codes = WaitAll({cluster.clients()[0]}, std::chrono::seconds(60));
    const double took =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::string line;
    FailedStatus(cluster.outs()[0], &line);
    EXPECT_EQ(codes[0], 3) << line;
    EXPECT_TRUE(absl::StrContains(line, "waited 3s (--elastic_timeout_s) for nodes to join"))
        << line;
    EXPECT_TRUE(absl::StrContains(line, "fewer than its minimum of 2 (--min_nodes)")) << line;
    EXPECT_LT(took, 3 + 3 + 5) << line;
    std::printf("node 0's process failed %.2f s after the loss\n", took);
    return;
  }
  // Node 0 alone: its step 6 answered once, and waiting.
  AwaitLines(cluster, 0, lost_at * buckets.size() + 1);
  cluster.AddNode();
  cluster.StartNodeClients(3, buckets, steps - lost_at, [&](int, int) {
    return std::vector<std::string>{"elastic", absl::StrCat("first=", lost_at)};
  });
  std::vector<pid_t> live = {cluster.clients()[0], cluster.clients()[3]};
  std::vector<int> codes = WaitAll(live, std::chrono::seconds(60));
  const auto ref = PhasedReference(4, 1, buckets, steps, {{{0, 1, 2}, {0}}, {{0, 3}, {lost_at}}},
                                   {}, 1, false, /*seeds=*/{0, 1, 2, 1});
  ExpectElasticOutputs(cluster, ref, buckets, {codes[0], 0, 0, codes[1]},
                       {steps * buckets.size(), lost_at * buckets.size(), lost_at * buckets.size(),
                        (steps - lost_at) * buckets.size()},
                       {2, 0, 0, 0});
  auto status = cluster.Status(0);
  ASSERT_TRUE(status.ok()) << status.status();
  // The two losses form one epoch, or two when the coordinator's watchdog
  // finds the nodes silent one tick apart (their last heartbeats a moment
  // apart; seen under ASan and load): then the join forms the third.
  EXPECT_GE(status->membership_epoch(), 2u);
  EXPECT_LE(status->membership_epoch(), 3u);
  EXPECT_EQ(status->node_count(), 2);
  EXPECT_EQ(status->job_state(), microd::v1::JOB_STATE_RUNNING) << status->failure();
}

TEST(DaemonElastic, BelowTheMinimumAReplacementBringsTheJobBack) { ExpectBelowTheMinimum(true); }
TEST(DaemonElastic, BelowTheMinimumTheJobFailsAfterTheElasticTimeout) {
  ExpectBelowTheMinimum(false);
}

// A node lost in a given phase of a step: node 2's daemon exits (as a
// SIGKILL would: MICROD_TEST_EXIT_AT) in its `nth` collective of `kind`, a
// few steps in: as it enters it, or (`peers` 1) once that round's message
// reached node 0 and not node 1. The others end that step the same way
// (both apply it, or neither and every bucket it had not completed is
// answered MICROD_ERR_MEMBERSHIP on both), go on as a job of 2, and every
// step is bit for bit the reference of 3 nodes, then 2 from where each
// bucket changed. `sparsifier`: the daemons' flags and the reference's
// options.
struct Sparsifier {
  std::vector<std::string> flags;
  sparsify::SparsifyOptions options;
};
Sparsifier SparsifierOf(sparsify::SparsifierKind kind) {
  Sparsifier s;
  s.options.sparsifier = kind;
  s.flags = {absl::StrCat("--sparsifier=", sparsify::SparsifierName(kind))};
  return s;
}

// `kind`: MICROD_TEST_EXIT_AT's, a tag kind or (above 255) a whole tag.
void ExpectLossAt(uint32_t kind, int peers, const Sparsifier& sparsifier, int nth) {
  const std::vector<BucketSpec> buckets = {{"fc", 100003}, {"b", 1000}};
  const long steps = 12;
  ClusterOptions o{CacheFlags(true)};
  o.extra.push_back("--min_nodes=2");
  o.extra.insert(o.extra.end(), sparsifier.flags.begin(), sparsifier.flags.end());
  o.env = [kind, peers, nth](int r) {
    return r == 2 ? std::vector<std::string>{absl::StrCat("MICROD_TEST_EXIT_AT=", kind, ":", nth,
                                                          ":", peers)}
                  : std::vector<std::string>{};
  };
  DaemonCluster cluster(3, 1, o);
  cluster.StartClients(buckets, steps, -1, -1, -1,
                       [](int, int) { return std::vector<std::string>{"elastic"}; });
  const std::vector<int> codes =
      WaitAll({cluster.clients()[0], cluster.clients()[1]}, std::chrono::seconds(90));
  const std::vector<int> lost = WaitAll({cluster.clients()[2]}, std::chrono::seconds(30));
  EXPECT_EQ(lost[0], 3) << "node 2's process: its daemon is gone";
  EXPECT_TRUE(absl::StrContains(ReadFile(cluster.dir() + "/daemon2.log"),
                                absl::StrCat("message sent to ", peers, " peer(s)")));
  cluster.Forget(2);
  // Where each bucket changed: its first result after the survivors' EPOCH
  // line (the same on both).
  std::vector<long> from(buckets.size(), steps);
  for (int r = 0; r < 2; ++r) {
    const auto lines = ReadLines(cluster.outs()[r]);
    bool after = false;
    std::vector<long> mine(buckets.size(), steps);
    for (const std::string& line : lines) {
      std::vector<std::string> f = absl::StrSplit(line, ' ');
      if (f[0] == "EPOCH") {
        after = true;
        continue;
      }
      if (f.size() != 3 || !after) continue;
      const size_t b = std::stoul(f[1]);
      mine[b] = std::min(mine[b], std::stol(f[0]));
    }
    if (r == 0) from = mine;
    EXPECT_EQ(mine, from) << "node " << r << " ended the step in flight otherwise";
  }
  // Lost in the middle of the job (which step the 7th such collective is
  // in depends on how the first steps were batched).
  const long at = *std::min_element(from.begin(), from.end());
  EXPECT_GE(at, 1);
  EXPECT_LT(at, steps - 1);
  std::printf("node 2 lost in step %ld (buckets changed at %s)\n", at,
              absl::StrJoin(from, ", ").c_str());
  const auto ref =
      PhasedReference(3, 1, buckets, steps, {{{0, 1, 2}, {0}}, {{0, 1}, from}}, sparsifier.options);
  std::vector<size_t> results = {steps * buckets.size(), steps * buckets.size()};
  ExpectElasticOutputs(cluster, ref, buckets, codes, results, {1, 1});
  // What node 2 had completed is the job's too.
  for (const std::string& line : ReadLines(cluster.outs()[2])) {
    std::vector<std::string> f = absl::StrSplit(line, ' ');
    if (f.size() != 3 || f[0] == "FAILED") continue;
    const long t = std::stol(f[0]);
    const int b = std::stoi(f[1]);
    EXPECT_LT(t, from[b]);
    EXPECT_EQ(std::stoull(f[2], nullptr, 16), ref[2][t][b]) << "node 2 step " << t;
  }
}

void ExpectLossInPhase(
    transport::TagKind kind, int peers = 0,
    const Sparsifier& sparsifier = SparsifierOf(sparsify::SparsifierKind::kMicro)) {
  ExpectLossAt(static_cast<uint32_t>(kind), peers, sparsifier, 7);
}

TEST(DaemonElastic, ANodeLostBeforeTheFirstExchangeOfAStep) {
  ExpectLossInPhase(transport::TagKind::kRound1);
}
TEST(DaemonElastic, ANodeLostDuringTheIndexExchange) {
  ExpectLossInPhase(transport::TagKind::kRound2);
}
TEST(DaemonElastic, ANodeLostDuringTheValueExchange) {
  ExpectLossInPhase(transport::TagKind::kRound3);
}

// Issue Z, "the split": a node killed after its last round reached some
// peers and not others left one survivor a step ahead, and the elastic job
// failed naming the steps. Every step of an elastic job now ends with a
// Confirm round: nobody applies a step until every node got every transfer,
// and the next epoch settles a step some node confirmed (it rolls forward
// on the others). For each sparsifier, node 2 dies once its last round of a
// step (the values; dense: the cycle, the buckets' sums in it) went to
// node 0 and not node 1; and, with micro, once its selection's rounds did,
// and its Confirm.
class LossAfterOnePeer : public ::testing::TestWithParam<sparsify::SparsifierKind> {};
TEST_P(LossAfterOnePeer, TheSurvivorsApplyTheStepAlike) {
  const sparsify::SparsifierKind kind = GetParam();
  ExpectLossInPhase(kind == sparsify::SparsifierKind::kDense ? transport::TagKind::kCycle
                                                             : transport::TagKind::kRound3,
                    1, SparsifierOf(kind));
}
INSTANTIATE_TEST_SUITE_P(Sparsifiers, LossAfterOnePeer,
                         ::testing::Values(sparsify::SparsifierKind::kMicro,
                                           sparsify::SparsifierKind::kHard,
                                           sparsify::SparsifierKind::kTopK,
                                           sparsify::SparsifierKind::kDense),
                         [](const ::testing::TestParamInfo<sparsify::SparsifierKind>& info) {
                           return std::string(sparsify::SparsifierName(info.param));
                         });
TEST(DaemonElastic, ANodeLostAfterItsHeadersReachedOnePeer) {
  ExpectLossInPhase(transport::TagKind::kRound1, 1);
}
TEST(DaemonElastic, ANodeLostAfterItsHistogramsReachedOnePeer) {
  ExpectLossInPhase(transport::TagKind::kRound2, 1);
}
// Node 0 got every Confirm and applies the step; node 1 holds it and rolls
// it forward in the next epoch. (Confirm's whole tag: slot 6 of the control
// kind, whose other slots measure the links.)
TEST(DaemonElastic, ANodeLostAfterItsConfirmReachedOnePeer) {
  ExpectLossAt(transport::MakeTag(6, transport::TagKind::kControl), 1,
               SparsifierOf(sparsify::SparsifierKind::kMicro), 7);
}

TEST(DaemonFaults, SizeMismatchBetweenNodesIsReportedEverywhere) {
  DaemonCluster cluster(2, 1);
  // Different counts for the same bucket name on the two nodes.
  const std::string out0 = cluster.dir() + "/m0", out1 = cluster.dir() + "/m1";
  std::vector<pid_t> pids = {Spawn({MICROD_TEST_CLIENT, cluster.socket(0), "w:1000", "3", out0}),
                             Spawn({MICROD_TEST_CLIENT, cluster.socket(1), "w:2000", "3", out1})};
  const auto codes = WaitAll(pids, std::chrono::seconds(60));
  for (const std::string& out : {out0, out1}) {
    std::string line;
    EXPECT_EQ(FailedStatus(out, &line), 4) << line;  // MICROD_ERR_MISMATCH
    EXPECT_TRUE(absl::StrContains(line, "'w'")) << line;
  }
  EXPECT_EQ(codes, (std::vector<int>{3, 3}));
}

// bf16 and fp16 buckets through the daemons: each process's gradient
// rounded to the type, widened exactly, the step in fp32 (the residual too),
// the update rounded to nearest-even, bit for bit the reference of these
// rules; dense (fused and in the cycle) and sparse buckets, n in {1..4}.
struct HalfCase {
  int dtype;  // 2 bf16, 3 fp16
  int nodes, local;
  bool wire = false;  // --wire_dtype=bucket
};

class HalfPrecision : public ::testing::TestWithParam<HalfCase> {};

TEST_P(HalfPrecision, BucketsMatchTheReference) {
  const HalfCase c = GetParam();
  const std::vector<BucketSpec> buckets = {{"embed", 1000}, {"bias", 3001}, {"fc", 200003}};
  const long steps = 12;
  DaemonCluster cluster(
      c.nodes, c.local,
      c.wire ? std::vector<std::string>{"--wire_dtype=bucket"} : std::vector<std::string>{});
  const std::string dtype = c.dtype == 2 ? "dtype=bf16" : "dtype=fp16";
  cluster.StartClients(buckets, steps, -1, -1, -1,
                       [&](int, int) { return std::vector<std::string>{dtype}; });
  const auto codes = cluster.WaitClients(std::chrono::seconds(240));
  const auto ref = Reference(c.nodes, c.local, buckets, steps, {}, c.dtype, c.wire);
  ExpectMatchesReference(cluster, codes, ref, c.nodes, c.local, buckets, steps);
  auto status = cluster.Status(0);
  ASSERT_TRUE(status.ok()) << status.status();
  for (const auto& b : status->buckets()) {
    EXPECT_EQ(b.steps(), static_cast<uint64_t>(steps));
    if (b.name() == "fc" && c.nodes > 1) {
      // A value is 2 bytes on a half wire, 4 otherwise; an index 4 (each
      // node sends its own): sent bytes per selected value.
      const double per_value =
          static_cast<double>(b.bytes_sent()) / static_cast<double>(b.last_selected() * steps);
      if (c.wire) {
        EXPECT_LT(per_value, 6.5) << b.bytes_sent();
      } else {
        EXPECT_GT(per_value, 4.0 + 3.0 / c.nodes) << b.bytes_sent();
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Types, HalfPrecision,
    ::testing::Values(HalfCase{2, 1, 1}, HalfCase{2, 2, 2}, HalfCase{2, 3, 1}, HalfCase{2, 4, 1},
                      HalfCase{3, 1, 2}, HalfCase{3, 2, 1}, HalfCase{3, 3, 1}, HalfCase{3, 4, 1},
                      HalfCase{2, 2, 1, true}, HalfCase{3, 3, 2, true}, HalfCase{2, 4, 1, true}),
    [](const auto& info) {
      return absl::StrCat(info.param.dtype == 2 ? "Bf16" : "Fp16", "_", info.param.nodes, "x",
                          info.param.local, info.param.wire ? "_WireBucket" : "");
    });

// A bucket registered as bf16 on one node and fp16 (or fp32) on another can
// never run: MICROD_ERR_MISMATCH on every node, naming the types.
TEST(DaemonFaults, DtypeMismatchBetweenNodesIsReportedEverywhere) {
  DaemonCluster cluster(2, 1);
  const std::string out0 = cluster.dir() + "/m0", out1 = cluster.dir() + "/m1";
  std::vector<pid_t> pids = {Spawn({MICROD_TEST_CLIENT, cluster.socket(0), "w:100000", "3", out0,
                                    "-1", "20000", "0", "dtype=bf16"}),
                             Spawn({MICROD_TEST_CLIENT, cluster.socket(1), "w:100000", "3", out1,
                                    "-1", "20000", "0", "dtype=fp16"})};
  const auto codes = WaitAll(pids, std::chrono::seconds(60));
  for (const std::string& out : {out0, out1}) {
    std::string line;
    EXPECT_EQ(FailedStatus(out, &line), 4) << line;  // MICROD_ERR_MISMATCH
    EXPECT_TRUE(absl::StrContains(line, "'w'")) << line;
    EXPECT_TRUE(absl::StrContains(line, "bfloat16")) << line;
    EXPECT_TRUE(absl::StrContains(line, "float16 x")) << line;
  }
  EXPECT_EQ(codes, (std::vector<int>{3, 3}));
}

TEST(DaemonFaults, DtypeMismatchWithinANodeIsReportedToBothProcesses) {
  DaemonCluster cluster(1, 2);
  const std::string out0 = cluster.dir() + "/m0", out1 = cluster.dir() + "/m1";
  std::vector<pid_t> pids = {
      Spawn({MICROD_TEST_CLIENT, cluster.socket(0), "w:1000", "3", out0, "-1", "20000", "0",
             "dtype=bf16"}),
      Spawn({MICROD_TEST_CLIENT, cluster.socket(0), "w:1000", "3", out1, "-1", "20000", "1"})};
  const auto codes = WaitAll(pids, std::chrono::seconds(60));
  for (const std::string& out : {out0, out1}) {
    std::string line;
    EXPECT_EQ(FailedStatus(out, &line), 4) << line;
    EXPECT_TRUE(absl::StrContains(line, "bfloat16") && absl::StrContains(line, "float32")) << line;
  }
  EXPECT_EQ(codes, (std::vector<int>{3, 3}));
}

TEST(DaemonFaults, SizeMismatchWithinANodeIsReportedToBothProcesses) {
  DaemonCluster cluster(1, 2);
  const std::string out0 = cluster.dir() + "/m0", out1 = cluster.dir() + "/m1";
  std::vector<pid_t> pids = {
      Spawn({MICROD_TEST_CLIENT, cluster.socket(0), "w:1000", "3", out0, "-1", "20000", "0"}),
      Spawn({MICROD_TEST_CLIENT, cluster.socket(0), "w:1001", "3", out1, "-1", "20000", "1"})};
  const auto codes = WaitAll(pids, std::chrono::seconds(60));
  for (const std::string& out : {out0, out1}) {
    std::string line;
    EXPECT_EQ(FailedStatus(out, &line), 4) << line;
  }
  EXPECT_EQ(codes, (std::vector<int>{3, 3}));
}

// Sends `bytes`; returns the status of the ERROR reply, or 0 when the daemon
// just closed the connection, or -1 when it answered nothing within 5 s.
int SendAndExpectRefusal(const std::string& path, const void* bytes, size_t len) {
  const int fd = RawConnect(path);
  EXPECT_GE(fd, 0);
  if (fd < 0) return -1;
  EXPECT_EQ(send(fd, bytes, len, MSG_NOSIGNAL), static_cast<ssize_t>(len));
  timeval tv{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  microd_wire_error e{};
  const ssize_t n = recv(fd, &e, sizeof e, 0);
  close(fd);
  if (n == static_cast<ssize_t>(sizeof e) && e.h.type == MICROD_MSG_ERROR) return e.status;
  return n == 0 ? 0 : -1;
}

TEST(DaemonFaults, MalformedMessagesLeaveTheDaemonServing) {
  DaemonCluster cluster(1, 1);
  const std::string path = cluster.socket(0);
  constexpr int kProtocol = 7;
  const char garbage[] = "this is not a microd message at all";
  EXPECT_EQ(SendAndExpectRefusal(path, garbage, sizeof garbage), kProtocol);
  const char truncated[8] = {'M', 'C', 'R', 'D'};
  EXPECT_EQ(SendAndExpectRefusal(path, truncated, sizeof truncated), kProtocol);
  std::vector<char> oversized(4096, 0);
  microd_wire_header h;
  microd_wire_header_init(&h, MICROD_MSG_HELLO, 4096);
  std::memcpy(oversized.data(), &h, sizeof h);
  EXPECT_EQ(SendAndExpectRefusal(path, oversized.data(), oversized.size()), kProtocol);
  microd_wire_submit early{};
  microd_wire_header_init(&early.h, MICROD_MSG_SUBMIT, sizeof early);
  EXPECT_EQ(SendAndExpectRefusal(path, &early, sizeof early), kProtocol);  // before hello
  microd_wire_hello hello{};
  microd_wire_header_init(&hello.h, MICROD_MSG_HELLO, sizeof hello);
  hello.h.version = 99;
  EXPECT_EQ(SendAndExpectRefusal(path, &hello, sizeof hello), kProtocol);
  microd_wire_header_init(&hello.h, MICROD_MSG_HELLO, sizeof hello + 4);  // length lies
  EXPECT_EQ(SendAndExpectRefusal(path, &hello, sizeof hello), kProtocol);
  microd_wire_header_init(&hello.h, 42, sizeof hello);  // unknown type
  EXPECT_EQ(SendAndExpectRefusal(path, &hello, sizeof hello), kProtocol);
  {
    // Hello, then a register without its memfd, then a second hello.
    const int fd = RawConnect(path);
    ASSERT_GE(fd, 0);
    microd_wire_header_init(&hello.h, MICROD_MSG_HELLO, sizeof hello);
    hello.local_rank = -1;
    ASSERT_EQ(send(fd, &hello, sizeof hello, 0), static_cast<ssize_t>(sizeof hello));
    microd_wire_hello_ack ack{};
    ASSERT_EQ(recv(fd, &ack, sizeof ack, 0), static_cast<ssize_t>(sizeof ack));
    EXPECT_EQ(ack.status, 0);
    microd_wire_register reg{};
    microd_wire_header_init(&reg.h, MICROD_MSG_REGISTER, sizeof reg);
    reg.kind = MICROD_BUFFER_HOST;
    reg.dtype = MICROD_WIRE_DTYPE_FLOAT32;
    reg.count = 10;
    std::strcpy(reg.name, "x");
    ASSERT_EQ(send(fd, &reg, sizeof reg, 0), static_cast<ssize_t>(sizeof reg));
    microd_wire_error e{};
    ASSERT_EQ(recv(fd, &e, sizeof e, 0), static_cast<ssize_t>(sizeof e));
    EXPECT_EQ(e.h.type, MICROD_MSG_ERROR);
    EXPECT_EQ(e.status, kProtocol);
    close(fd);
  }
  // Still serving: a real training process runs its steps.
  const std::string out = cluster.dir() + "/ok";
  auto codes = WaitAll({Spawn({MICROD_TEST_CLIENT, path, "w:70001,v:100", "5", out})},
                       std::chrono::seconds(60));
  EXPECT_EQ(codes[0], 0) << ReadLines(out).back();
  EXPECT_EQ(ReadLines(out).size(), 10u);
  auto status = cluster.Status(0);
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(status->job_state(), microd::v1::JOB_STATE_RUNNING);
}

// A register of a CUDA buffer is answered, never a reason to drop the
// process: by the field checks, or UNSUPPORTED where the daemon cannot take
// it (a CPU build, no GPU, or, with a GPU, a device it does not see: the
// all-zero UUID below names none). Runs without a GPU.
TEST(DaemonFaults, CudaRegistrationIsAnsweredAndTheProcessStays) {
  DaemonCluster cluster(1, 1);
  const int fd = RawConnect(cluster.socket(0));
  ASSERT_GE(fd, 0);
  timeval tv{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  microd_wire_hello hello{};
  microd_wire_header_init(&hello.h, MICROD_MSG_HELLO, sizeof hello);
  hello.local_rank = -1;
  ASSERT_EQ(send(fd, &hello, sizeof hello, 0), static_cast<ssize_t>(sizeof hello));
  microd_wire_hello_ack ack{};
  ASSERT_EQ(recv(fd, &ack, sizeof ack, 0), static_cast<ssize_t>(sizeof ack));
  ASSERT_EQ(ack.status, 0);
  EXPECT_EQ(ack.h.reserved & MICROD_WIRE_CAP_REGISTER_CUDA, MICROD_WIRE_CAP_REGISTER_CUDA);

  auto registered = [&](const void* msg, size_t len, int pass_fd, std::string* message) {
    EXPECT_EQ(microd_wire_send(fd, msg, len, pass_fd), 0);
    microd_wire_register_ack reply{};
    const ssize_t n = recv(fd, &reply, sizeof reply, 0);
    EXPECT_EQ(n, static_cast<ssize_t>(sizeof reply));
    EXPECT_EQ(reply.h.type, MICROD_MSG_REGISTER_ACK);
    reply.message[MICROD_WIRE_MESSAGE_BYTES - 1] = '\0';
    *message = reply.message;
    return n == static_cast<ssize_t>(sizeof reply) ? reply.status : -1;
  };
  constexpr int kInvalid = 1, kUnsupported = 6;
  microd_wire_register_cuda reg{};
  microd_wire_header_init(&reg.h, MICROD_MSG_REGISTER_CUDA, sizeof reg);
  reg.buffer_id = 0;
  reg.dtype = MICROD_WIRE_DTYPE_FLOAT32;
  reg.count = 1000;
  std::strcpy(reg.name, "g");
  reg.alloc_bytes = 4096;
  reg.offset = 256;  // 4000 bytes from 256 do not fit in 4096
  std::string message;
  EXPECT_EQ(registered(&reg, sizeof reg, -1, &message), kInvalid) << message;
  EXPECT_TRUE(absl::StrContains(message, "do not fit")) << message;
  reg.offset = 2;  // not a multiple of 4
  EXPECT_EQ(registered(&reg, sizeof reg, -1, &message), kInvalid) << message;
  reg.offset = 64;
  reg.count = 0;
  EXPECT_EQ(registered(&reg, sizeof reg, -1, &message), kInvalid) << message;
  reg.count = 1000;
  EXPECT_EQ(registered(&reg, sizeof reg, -1, &message), kUnsupported) << message;
  EXPECT_TRUE(absl::StrContains(message, "'g'")) << message;
  // The old REGISTER with kind CUDA: answered too.
  microd_wire_register old{};
  microd_wire_header_init(&old.h, MICROD_MSG_REGISTER, sizeof old);
  old.buffer_id = 0;
  old.kind = MICROD_BUFFER_CUDA;
  old.dtype = MICROD_WIRE_DTYPE_FLOAT32;
  old.count = 1000;
  std::strcpy(old.name, "g");
  EXPECT_EQ(registered(&old, sizeof old, -1, &message), kUnsupported) << message;
  EXPECT_TRUE(absl::StrContains(message, "REGISTER_CUDA")) << message;

  // Still connected: a host buffer registers.
  const int mfd = memfd_create("g", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_GE(mfd, 0);
  ASSERT_EQ(ftruncate(mfd, 4000), 0);
  ASSERT_EQ(fcntl(mfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  old.kind = MICROD_BUFFER_HOST;
  EXPECT_EQ(registered(&old, sizeof old, mfd, &message), 0) << message;
  close(mfd);
  microd_wire_goodbye bye{};
  microd_wire_header_init(&bye.h, MICROD_MSG_GOODBYE, sizeof bye);
  EXPECT_EQ(send(fd, &bye, sizeof bye, 0), static_cast<ssize_t>(sizeof bye));
  close(fd);
  auto status = cluster.Status(0);
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->job_state(), microd::v1::JOB_STATE_RUNNING);
}

TEST(DaemonFaults, ProcessOfAnotherUidIsRefused) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run a process as another uid";
  DaemonCluster cluster(1, 1);
  const std::string path = cluster.socket(0);
  ASSERT_GE(RawConnect(path), 0);  // the daemon is up
  // Open the path's permissions so that only the daemon's peer check stands
  // between the other user and the daemon.
  chmod(cluster.dir().c_str(), 0755);
  chmod((cluster.dir() + "/node0").c_str(), 0755);
  chmod(path.c_str(), 0666);
  const std::string out = cluster.dir() + "/nobody";
  int fd = open(out.c_str(), O_CREAT | O_WRONLY, 0666);
  close(fd);
  chmod(out.c_str(), 0666);
  // The other user runs copies of the client and its library from the
  // test's own directory: the build tree may sit in a directory that only
  // root can enter (a clone under a private temporary directory).
  namespace fs = std::filesystem;
  const fs::path client = HelperPath(MICROD_TEST_CLIENT);
  const std::string bin = cluster.dir() + "/bin";
  fs::create_directory(bin);
  fs::copy_file(client, bin + "/microd-test-client");
  for (const auto& entry : fs::directory_iterator(client.parent_path().parent_path() / "client")) {
    if (absl::StartsWith(entry.path().filename().string(), "libmicrod.so")) {
      fs::copy_file(entry.path(), bin + "/" + entry.path().filename().string(),
                    fs::copy_options::copy_symlinks);
    }
  }
  chmod(bin.c_str(), 0755);
  const std::vector<std::string> as_nobody = {"/usr/bin/setpriv", "--reuid=65534",
                                              "--regid=65534",    "--clear-groups",
                                              "/usr/bin/env",     "LD_LIBRARY_PATH=" + bin};
  auto with = [&](std::vector<std::string> args) {
    args.insert(args.begin(), as_nobody.begin(), as_nobody.end());
    return args;
  };
  ASSERT_EQ(WaitAll({Spawn(with({"/usr/bin/test", "-x", bin + "/microd-test-client"}))},
                    std::chrono::seconds(10))[0],
            0)
      << "uid 65534 cannot reach " << bin << ": put TMPDIR in a directory others may enter";
  auto codes = WaitAll({Spawn(with({bin + "/microd-test-client", path, "w:10", "1", out}))},
                       std::chrono::seconds(30));
  std::string line;
  EXPECT_EQ(codes[0], 3);
  EXPECT_EQ(FailedStatus(out, &line), 9) << line;  // MICROD_ERR_PERMISSION
  EXPECT_TRUE(absl::StrContains(line, "uid 65534")) << line;
}

// SIGTERMs node 0's daemon while `client` (writing to `out`) waits on it:
// the daemon exits 0 without leaving its socket file, and the client fails
// within 10 s with the job ended or the daemon gone.
void ExpectSigtermEndsTheWait(DaemonCluster& cluster, pid_t client, const std::string& out) {
  const auto start = std::chrono::steady_clock::now();
  kill(cluster.pid(0), SIGTERM);
  const auto daemon_code = WaitAll({cluster.pid(0)}, std::chrono::seconds(20));
  cluster.Forget(0);
  EXPECT_EQ(daemon_code[0], 0);
  struct stat st;
  EXPECT_NE(stat(cluster.socket(0).c_str(), &st), 0) << "socket file left behind";
  const auto codes = WaitAll({client}, std::chrono::seconds(20));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  std::string line;
  const int status = FailedStatus(out, &line);
  EXPECT_EQ(codes[0], 3);
  EXPECT_TRUE(status == 5 || status == 2) << line;  // the job ended, or the daemon went away
}

TEST(DaemonFaults, SigtermEndsPendingWorkCleanlyAndRemovesTheSocket) {
  DaemonCluster cluster(2, 1, CacheFlags(false));
  // Only node 0 has a training process: its bucket can never complete.
  const std::string out = cluster.dir() + "/pending";
  const pid_t client = Spawn({MICROD_TEST_CLIENT, cluster.socket(0), "w:1000", "1", out});
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // it submitted and waits
  ExpectSigtermEndsTheWait(cluster, client, out);
}

// With the response cache a bucket cached by a first step waits for the
// other nodes in a cycle over the transport: SIGTERM still ends it at once.
TEST(DaemonFaults, SigtermEndsACycleWaitingForTheOtherNodes) {
  DaemonCluster cluster(2, 1, CacheFlags(true));
  const std::string out0 = cluster.dir() + "/two_steps", out1 = cluster.dir() + "/one_step";
  // Node 1's process leaves cleanly after one step; node 0's submits again.
  const pid_t c0 = Spawn({MICROD_TEST_CLIENT, cluster.socket(0), "w:1000", "2", out0});
  const pid_t c1 = Spawn({MICROD_TEST_CLIENT, cluster.socket(1), "w:1000", "1", out1});
  EXPECT_EQ(WaitAll({c1}, std::chrono::seconds(20))[0], 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // node 0 waits in a cycle
  auto status = cluster.Status(0);
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->batches(), 1u);  // the first step, through the coordinator
  ExpectSigtermEndsTheWait(cluster, c0, out0);
  EXPECT_EQ(ReadLines(out0).size(), 2u) << "the first step completed, then the failure";
}

// A node whose step options differ (here through the environment) stops
// every daemon at start, each naming the option, instead of a crash or a
// hang at the first step.
TEST(DaemonFaults, DifferentOptionsOnOneNodeStopEveryDaemonNamingTheOption) {
  DaemonCluster cluster(2, 1, {}, [](int r) {
    return r == 1 ? std::vector<std::string>{"MICROD_CYCLE_FLOATS=0"} : std::vector<std::string>{};
  });
  const auto codes = WaitAll({cluster.pid(0), cluster.pid(1)}, std::chrono::seconds(30));
  for (int r = 0; r < 2; ++r) {
    cluster.Forget(r);
    EXPECT_NE(codes[r], 0) << "node " << r << " kept running";
    const auto log = ReadLines(absl::StrCat(cluster.dir(), "/daemon", r, ".log"));
    const std::string all = absl::StrJoin(log, "\n");
    EXPECT_TRUE(absl::StrContains(all, "--cycle_floats differs between node 0 and node 1")) << all;
  }
}

TEST(DaemonFaults, SigtermWhileWaitingForTheOtherNodesExitsAtOnce) {
  const std::string dir = MakeTempDir("e2e-join");
  // Node 0 of a 2-node job whose second node never comes: it waits to join.
  const pid_t daemon =
      Spawn({MICROD_DAEMON, "--socket=" + dir + "/sock", "--nodes=2", "--node_rank=0",
             "--admin=127.0.0.1:0", "--coordinator_listen=127.0.0.1:0",
             "--coordinator_port_file=" + dir + "/coordinator", "--join_timeout_ms=120000"},
            dir + "/daemon.log");
  ReadPortFile(dir + "/coordinator", std::chrono::seconds(20));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // in Join now
  const auto start = std::chrono::steady_clock::now();
  kill(daemon, SIGTERM);
  const auto codes = WaitAll({daemon}, std::chrono::seconds(20));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  EXPECT_EQ(codes[0], 1);
  const auto lines = ReadLines(dir + "/daemon.log");
  ASSERT_FALSE(lines.empty());
  EXPECT_TRUE(absl::StrContains(lines.back(), "SIGTERM before the job started")) << lines.back();
}

}  // namespace
}  // namespace microd::testing
