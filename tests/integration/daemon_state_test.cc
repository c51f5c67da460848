// Compression state across a restart (microd_state_save / microd_state_load):
// a job runs 20 steps and saves, every daemon and process is stopped, a new
// cluster loads and runs 20 more: every update equals the reference of 40
// steps straight, bit for bit, for every sparsifier and controller. A job of
// another shape, and a torn or corrupted file, are refused naming why.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_cluster.h"
#include "tests/integration/process_util.h"

namespace microd::testing {
namespace {

using std::chrono::seconds;

const std::vector<BucketSpec> kBuckets = {{"embed", 1000}, {"conv", 70001}, {"fc", 200003}};

struct StateCase {
  std::string name;
  std::vector<std::string> flags;
  sparsify::SparsifyOptions options;
};
void PrintTo(const StateCase& c, std::ostream* os) { *os << c.name; }

StateCase Case(const std::string& name, sparsify::SparsifierKind kind,
               sparsify::ControllerKind controller = sparsify::ControllerKind::kHistogram,
               double momentum = 0.0) {
  StateCase c;
  c.name = name;
  c.options.sparsifier = kind;
  c.options.controller = controller;
  c.options.momentum = momentum;
  c.flags = {absl::StrCat("--sparsifier=", sparsify::SparsifierName(kind)),
             absl::StrCat("--controller=", sparsify::ControllerName(controller)),
             absl::StrCat("--momentum_correction=", momentum)};
  return c;
}

// What every process of one run writes ("FAILED ..." lines included).
std::string Outputs(const DaemonCluster& cluster) {
  std::string all;
  for (const auto& out : cluster.outs()) {
    for (const auto& line : ReadLines(out)) all += line + "\n";
  }
  return all;
}

class StateTest : public ::testing::TestWithParam<StateCase> {};

TEST_P(StateTest, SavedAfter20StepsAndLoadedByANewClusterEquals40Straight) {
  const StateCase& c = GetParam();
  const int n = 3, L = 2;
  const std::string dir = MakeTempDir("state") + "/checkpoint";
  const auto ref = Reference(n, L, kBuckets, 40, c.options);
  {
    DaemonCluster first(n, L, c.flags);
    first.StartClients(kBuckets, 20, -1, -1, -1,
                       [&](int, int) { return std::vector<std::string>{"save=" + dir}; });
    ExpectMatchesReference(first, first.WaitClients(seconds(120)), ref, n, L, kBuckets, 20);
  }
  for (int r = 0; r < n; ++r) {
    EXPECT_TRUE(std::filesystem::exists(absl::StrCat(dir, "/microd-state-node", r, ".bin")));
  }
  DaemonCluster second(n, L, c.flags);
  second.StartClients(kBuckets, 20, -1, -1, -1, [&](int, int) {
    return std::vector<std::string>{"first=20", "load=" + dir};
  });
  ExpectMatchesReference(second, second.WaitClients(seconds(120)), ref, n, L, kBuckets, 20);
}

INSTANTIATE_TEST_SUITE_P(
    Sparsifiers, StateTest,
    ::testing::Values(Case("micro_hist", sparsify::SparsifierKind::kMicro),
                      Case("micro_paper", sparsify::SparsifierKind::kMicro,
                           sparsify::ControllerKind::kPaper),
                      Case("micro_momentum", sparsify::SparsifierKind::kMicro,
                           sparsify::ControllerKind::kHistogram, 0.9),
                      Case("topk", sparsify::SparsifierKind::kTopK),
                      Case("hard", sparsify::SparsifierKind::kHard),
                      Case("dense", sparsify::SparsifierKind::kDense)),
    [](const ::testing::TestParamInfo<StateCase>& info) { return info.param.name; });

// Saves 3 steps of a 2-node job into a fresh directory; its path.
std::string SaveThreeSteps(const std::vector<BucketSpec>& buckets) {
  const std::string dir = MakeTempDir("state-bad") + "/checkpoint";
  DaemonCluster job(2, 1);
  job.StartClients(buckets, 3, -1, -1, -1,
                   [&](int, int) { return std::vector<std::string>{"save=" + dir}; });
  EXPECT_EQ(job.WaitClients(seconds(60)), std::vector<int>(2, 0)) << Outputs(job);
  return dir;
}

// Loads `dir` into a 2-node job with `flags` and buckets `buckets`: every
// process fails (at the load, or at its first step: a node that could not
// load ends the job); what they wrote.
std::string ExpectLoadRefused(const std::string& dir, const std::vector<BucketSpec>& buckets,
                              const std::vector<std::string>& flags = {}) {
  DaemonCluster job(2, 1, flags);
  job.StartClients(buckets, 3, -1, -1, -1, [&](int, int) {
    return std::vector<std::string>{"first=3", "load=" + dir};
  });
  const auto codes = job.WaitClients(seconds(60));
  const std::string out = Outputs(job);
  EXPECT_EQ(codes, std::vector<int>(2, 3)) << out;
  return out;
}

TEST(StateRefused, AnotherDensityIsNamed) {
  const std::string dir = SaveThreeSteps(kBuckets);
  const std::string out = ExpectLoadRefused(dir, kBuckets, {"--density=0.02"});
  EXPECT_TRUE(absl::StrContains(out, "FAILED 4 load")) << out;  // MICROD_ERR_MISMATCH
  EXPECT_TRUE(absl::StrContains(out, "was saved with --density 0.01")) << out;
}

TEST(StateRefused, ABucketOfAnotherSizeIsNamed) {
  const std::string dir = SaveThreeSteps(kBuckets);
  const std::string out = ExpectLoadRefused(dir, {{"embed", 1000}, {"conv", 70001}, {"fc", 200004}});
  EXPECT_TRUE(absl::StrContains(out, "has bucket 'fc' of 200003 elements; here it has 200004"))
      << out;
}

TEST(StateRefused, ACorruptedOrTornFileIsNeverLoaded) {
  const std::string dir = SaveThreeSteps(kBuckets);
  const std::string file = dir + "/microd-state-node0.bin";
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    f.put('\x5a');
  }
  std::string out = ExpectLoadRefused(dir, kBuckets);
  EXPECT_TRUE(absl::StrContains(out, "is corrupted: its checksum does not match")) << out;
  std::filesystem::resize_file(file, std::filesystem::file_size(file) / 2);
  out = ExpectLoadRefused(dir, kBuckets);
  EXPECT_TRUE(absl::StrContains(out, "is torn")) << out;
}

TEST(StateRefused, ProcessesOfANodeAskingDifferentThingsAreRefused) {
  const std::string dir = MakeTempDir("state-mixed");
  DaemonCluster job(1, 2);
  job.StartClients(kBuckets, 2, -1, -1, -1, [&](int, int l) {
    return std::vector<std::string>{absl::StrCat("save=", dir, "/d", l)};
  });
  const auto codes = job.WaitClients(seconds(60));
  const std::string out = Outputs(job);
  EXPECT_TRUE(absl::StrContains(out, "every process of the job calls the same")) << out;
  EXPECT_EQ(codes, std::vector<int>(2, 3)) << out;  // both told at once, neither waits
}

// A process that leaves without asking (it finished its steps and closed)
// ends the wait of the others: they are told at once.
TEST(StateRefused, AProcessThatLeavesWithoutAskingEndsTheWait) {
  const std::string dir = MakeTempDir("state-left");
  DaemonCluster job(1, 2);
  const auto start = std::chrono::steady_clock::now();
  job.StartClients(kBuckets, 2, -1, -1, -1, [&](int, int l) {
    return l == 0 ? std::vector<std::string>{"save=" + dir + "/ckpt"} : std::vector<std::string>{};
  });
  const auto codes = job.WaitClients(seconds(60));
  const std::string out = Outputs(job);
  EXPECT_EQ(codes, (std::vector<int>{3, 0})) << out;
  // Whichever came first: it left while the other waited, or before it asked.
  EXPECT_TRUE(absl::StrContains(out, "left before asking to save the state")) << out;
  EXPECT_LT(std::chrono::steady_clock::now() - start, seconds(15));  // not the 20 s wait timeout
}

}  // namespace
}  // namespace microd::testing
