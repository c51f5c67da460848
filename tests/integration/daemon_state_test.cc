// SPDX-License-Identifier: Apache-2.0
// Compression state across a restart (microd_state_save / microd_state_load):
// a job runs 20 steps and saves, every daemon and process is stopped, a new
// cluster loads and runs 20 more: every update equals the reference of 40
// steps straight, bit for bit, for every sparsifier and controller. A job of
// another shape, and a torn or corrupted file, are refused naming why.
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_cluster.h"
#include "tests/integration/process_util.h"
extern "C" {
#include "microd/microd.h"
}

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

INSTANTIATE_TEST_SUITE_P(Sparsifiers, StateTest,
                         ::testing::Values(Case("micro_hist", sparsify::SparsifierKind::kMicro),
                                           Case("micro_paper", sparsify::SparsifierKind::kMicro,
                                                sparsify::ControllerKind::kPaper),
                                           Case("micro_momentum", sparsify::SparsifierKind::kMicro,
                                                sparsify::ControllerKind::kHistogram, 0.9),
                                           Case("topk", sparsify::SparsifierKind::kTopK),
                                           Case("hard", sparsify::SparsifierKind::kHard),
                                           Case("dense", sparsify::SparsifierKind::kDense)),
                         [](const ::testing::TestParamInfo<StateCase>& info) {
                           return info.param.name;
                         });

// Saves 3 steps of a 2-node job into a fresh directory; its path.
std::string SaveThreeSteps(const std::vector<BucketSpec>& buckets,
                           const ClusterOptions& options = {}) {
  const std::string dir = MakeTempDir("state-bad") + "/checkpoint";
  DaemonCluster job(2, 1, options);
  job.StartClients(buckets, 3, -1, -1, -1,
                   [&](int, int) { return std::vector<std::string>{"save=" + dir}; });
  EXPECT_EQ(job.WaitClients(seconds(60)), std::vector<int>(2, 0)) << Outputs(job);
  return dir;
}

// Loads `dir` into a 2-node job with `flags` and buckets `buckets`: every
// process fails (at the load, or at its first step: a node that could not
// load ends the job); what they wrote.
std::string ExpectLoadRefused(const std::string& dir, const std::vector<BucketSpec>& buckets,
                              const ClusterOptions& options = {}) {
  DaemonCluster job(2, 1, options);
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
  const std::string out = ExpectLoadRefused(dir, kBuckets, {{"--density=0.02"}});
  EXPECT_TRUE(absl::StrContains(out, "FAILED 4 load")) << out;  // MICROD_ERR_MISMATCH
  EXPECT_TRUE(absl::StrContains(out, "was saved with --density 0.01")) << out;
}

TEST(StateRefused, ABucketOfAnotherSizeIsNamed) {
  const std::string dir = SaveThreeSteps(kBuckets);
  const std::string out =
      ExpectLoadRefused(dir, {{"embed", 1000}, {"conv", 70001}, {"fc", 200004}});
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

std::string Contents(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// A symbolic link planted where the daemon writes: at the temporary name it
// used to use (the target's name, ".tmp." and the daemon's pid, which a
// client learns from SO_PEERCRED) and at the target's name. Before: the
// daemon truncated and overwrote the first link's target.
TEST(StateFiles, LinksPlantedWhereTheDaemonWritesAreNeverFollowed) {
  const std::string dir = MakeTempDir("state-links");
  const std::string victim = dir + "/victim", other = dir + "/other-victim";
  std::ofstream(victim) << "precious\n";
  std::ofstream(other) << "also precious\n";
  const std::string target = dir + "/ckpt/microd-state-node0.bin";
  std::filesystem::create_directory(dir + "/ckpt");
  DaemonCluster job(1, 1);
  std::filesystem::create_symlink(victim, absl::StrCat(target, ".tmp.", job.pid(0)));
  std::filesystem::create_symlink(other, target);
  job.StartClients(kBuckets, 2, -1, -1, -1,
                   [&](int, int) { return std::vector<std::string>{"save=" + dir + "/ckpt"}; });
  EXPECT_EQ(job.WaitClients(seconds(60)), std::vector<int>{0}) << Outputs(job);
  EXPECT_EQ(Contents(victim), "precious\n");
  EXPECT_EQ(Contents(other), "also precious\n");
  EXPECT_FALSE(std::filesystem::is_symlink(target));  // the link was replaced by the file
  EXPECT_TRUE(std::filesystem::is_regular_file(target));
}

// What a load finds at the file's name is not trusted: a FIFO used to block
// the engine's thread in open() (and SIGTERM then hung), a link to
// /dev/zero or a huge file was read whole.
TEST(StateFiles, ALoadReadsOnlyARegularFileOfTheJobsSize) {
  const std::string dir = SaveThreeSteps(kBuckets);
  const std::string file = dir + "/microd-state-node0.bin";
  std::filesystem::remove(file);
  ASSERT_EQ(mkfifo(file.c_str(), 0600), 0);
  const auto start = std::chrono::steady_clock::now();
  std::string out = ExpectLoadRefused(dir, kBuckets);
  EXPECT_TRUE(absl::StrContains(out, "microd-state-node0.bin is not a regular file")) << out;
  EXPECT_LT(std::chrono::steady_clock::now() - start, seconds(30));
  std::filesystem::remove(file);
  std::filesystem::create_symlink("/dev/zero", file);
  out = ExpectLoadRefused(dir, kBuckets);
  EXPECT_TRUE(absl::StrContains(out, "microd-state-node0.bin is a symbolic link")) << out;
  std::filesystem::remove(file);
  { std::ofstream(file) << "x"; }
  std::filesystem::resize_file(file, uint64_t{64} << 30);  // sparse: no disk used
  out = ExpectLoadRefused(dir, kBuckets);
  EXPECT_TRUE(absl::StrContains(out, "has 68719476736 bytes, more than the")) << out;
}

// The daemons of a FIFO's load still stop at SIGTERM (before: the engine's
// thread sat in open() and Engine::Stop joined it).
TEST(StateFiles, ADaemonLoadingFromAFifoStopsAtSigterm) {
  const std::string dir = MakeTempDir("state-fifo");
  ASSERT_EQ(mkfifo((dir + "/microd-state-node0.bin").c_str(), 0600), 0);
  DaemonCluster job(1, 1);
  job.StartClients(kBuckets, 1, -1, -1, -1, [&](int, int) {
    return std::vector<std::string>{"first=1", "load=" + dir};
  });
  EXPECT_EQ(job.WaitClients(seconds(30)), std::vector<int>{3}) << Outputs(job);
  EXPECT_TRUE(absl::StrContains(Outputs(job), "is not a regular file")) << Outputs(job);
  EXPECT_EQ(job.Terminate(seconds(20)), std::vector<int>{0});
}

// State files are authenticated with the job's secret (the token, or
// --state_key_file): another job's file, or one saved without a secret, is
// refused. Before: a CRC was all, and anyone who could write the directory
// could forge the residuals every node then applied.
TEST(StateFiles, AnotherJobsFileIsRefusedAndTheSameKeyLoads) {
  ClusterOptions tokened;
  tokened.token = true;  // each cluster its own token
  std::string dir = SaveThreeSteps(kBuckets, tokened);
  std::string out = ExpectLoadRefused(dir, kBuckets, tokened);
  EXPECT_TRUE(absl::StrContains(out, "is not authenticated by this job's key")) << out;
  // Saved without a secret: nothing says who wrote it.
  dir = SaveThreeSteps(kBuckets);
  out = ExpectLoadRefused(dir, kBuckets, tokened);
  EXPECT_TRUE(absl::StrContains(out, "was saved by a job without a secret")) << out;
  // The same --state_key_file in both jobs (their tokens differ): it loads.
  const std::string key = MakeTempDir("state-key") + "/key";
  std::ofstream(key) << "the checkpoints' secret\n";
  ClusterOptions keyed = tokened;
  keyed.extra = {"--state_key_file=" + key};
  dir = SaveThreeSteps(kBuckets, keyed);
  DaemonCluster job(2, 1, keyed);
  job.StartClients(kBuckets, 3, -1, -1, -1, [&](int, int) {
    return std::vector<std::string>{"first=3", "load=" + dir};
  });
  EXPECT_EQ(job.WaitClients(seconds(60)), std::vector<int>(2, 0)) << Outputs(job);
}

// A process of another uid (admitted by --allow_gid) may save only where it
// could write itself. Before: the daemon, as root, made and wrote any
// directory the process named. As root; the process runs as nobody.
TEST(StateFiles, AProcessOfAnotherUidSavesOnlyWhereItCouldWrite) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run a process as another uid";
  const gid_t group = 65534;
  DaemonCluster job(1, 1, {absl::StrCat("--allow_gid=", group)});
  for (int i = 0; i < 400 && !std::filesystem::exists(job.socket(0)); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  chmod(job.dir().c_str(), 0711);
  chmod((job.dir() + "/node0").c_str(), 0711);
  const std::string closed = MakeTempDir("state-root");  // root's, 0700
  chmod(closed.c_str(), 0755);
  const std::string own = MakeTempDir("state-nobody");
  ASSERT_EQ(chown(own.c_str(), 65534, group), 0);
  // Saves into each directory as uid 65534; the two statuses and messages.
  int out[2];
  ASSERT_EQ(pipe(out), 0);
  const std::string socket = job.socket(0);
  const pid_t child = fork();
  if (child == 0) {
    if (setgroups(0, nullptr) != 0 || setgid(group) != 0 || setuid(65534) != 0) _exit(1);
    microd_options o;
    microd_options_init(&o);
    o.socket_path = socket.c_str();
    o.timeout_ms = 10000;
    microd_client* c = nullptr;
    std::string report;
    if (microd_connect(&o, &c) != MICROD_OK) {
      report = absl::StrCat("connect: ", microd_last_error(nullptr));
    } else {
      for (const std::string& d : {closed, own}) {
        const microd_status s = microd_state_save(c, d.c_str(), 10000);
        absl::StrAppend(&report, s, " ", s == MICROD_OK ? "" : microd_last_error(c), "\n");
      }
      microd_close(c);
    }
    (void)!write(out[1], report.data(), report.size());
    _exit(0);
  }
  close(out[1]);
  std::string report;
  char buf[1024];
  for (ssize_t n; (n = read(out[0], buf, sizeof buf)) > 0;) report.append(buf, n);
  close(out[0]);
  waitpid(child, nullptr, 0);
  const std::vector<std::string> lines = absl::StrSplit(report, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 2u) << report;
  EXPECT_TRUE(absl::StartsWith(lines[0], "9 ")) << report;  // MICROD_ERR_PERMISSION
  EXPECT_TRUE(absl::StrContains(lines[0], "may not write the state directory")) << report;
  EXPECT_FALSE(std::filesystem::exists(closed + "/microd-state-node0.bin"));
  EXPECT_EQ(lines[1], "0 ") << report;
  struct stat st;
  ASSERT_EQ(stat((own + "/microd-state-node0.bin").c_str(), &st), 0);
  EXPECT_EQ(st.st_uid, 65534u);  // the file is the asking process's
}

}  // namespace
}  // namespace microd::testing
