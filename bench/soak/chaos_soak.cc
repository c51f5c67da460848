// SPDX-License-Identifier: Apache-2.0
// microd-soak: the chaos soak (issue Z). Jobs on the emulated cluster
// (deploy/netlab: 4 nodes, each in a network namespace of its own, 1 Gbit/s
// links) for a set time, one after another, under random faults:
//
//   survive   a job (non-elastic, peer timeout 10 s, a sparsifier drawn
//             at random) meets, every --fault_every seconds during its first
//             --segment_s, one of the
//             faults the design says it rides out: a daemon paused
//             (SIGSTOP) for 0.5-4 s; a node's links down (100 % loss) for
//             0.5-4 s; a burst of 5-30 % loss for 2-6 s; a trainer paused
//             for 0.5-3 s; two CPU-bound neighbours for 2-6 s. Every step
//             of every process must equal the in-process reference.
//   fail      a daemon paused for twice the peer timeout (3 s): every
//             process must fail, each naming the paused node, and every
//             daemon must still stop cleanly.
//   elastic   an elastic job (--min_nodes=2) loses a node (its daemon
//             SIGKILLed): the others go on, bit for bit with the
//             reference of the survivors; or (one time in two) the
//             data-plane connections between two of its live nodes are
//             reset at a random step (the path's RST): the next epoch of
//             the same nodes connects afresh, every result the reference's.
//
// Segments run in that order, round after round; the faults' kinds, nodes,
// lengths and times are drawn from --seed. One line a minute (and one per
// segment) says what ran and what was found; the end prints every failure
// with its cause and exits 1 if there was any. Needs root (network
// namespaces); without, it says so and exits 77 (CTest: skipped).
//
// make soak runs it by hand (SOAK_SECONDS, default 7200: faults every 1-5
// minutes); make test-long runs its short form (about 30 s: one segment
// of each kind, a fault every 2-4 s).
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_cluster.h"
#include "tests/integration/netlab.h"
#include "tests/integration/netlab_jobs.h"
#include "tests/integration/process_util.h"

ABSL_FLAG(int, seconds, 600, "how long the soak runs (a segment under way is finished)");
ABSL_FLAG(int, segment_s, 180, "a survive segment's job lasts about this long");
ABSL_FLAG(std::string, fault_every, "60-300",
          "seconds between two faults of a survive segment: MIN-MAX, drawn uniformly");
ABSL_FLAG(uint32_t, seed, 1, "the faults' draw");
ABSL_FLAG(int, nodes, 4, "nodes of every job");

namespace microd::testing {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::seconds;

const std::vector<BucketSpec> kBuckets = {{"fc", 100003}, {"b", 1000}};
constexpr int kPeerTimeoutMs = 10000;
constexpr int kFailPeerTimeoutMs = 3000;

// What the soak counted; printed a line a minute and at the end.
struct Tally {
  Clock::time_point start = Clock::now();
  Clock::time_point last_line = Clock::now();
  int segments = 0;
  long results = 0;  // (step, bucket, process) results checked against the reference
  long off = 0;      // of them, not equal to the reference
  std::map<std::string, int> faults;
  int expected_failures = 0;          // jobs that had to fail, and failed naming the node
  std::vector<std::string> failures;  // with their causes: every one is a finding
  std::string segment;                // the segment under way, for the failures' record
};
Tally tally;

// Records every failed check of the helpers (they use gtest's assertions)
// with the segment it happened in.
class Recorder : public ::testing::EmptyTestEventListener {
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed()) tally.failures.push_back(absl::StrCat(tally.segment, ": ", r.summary()));
  }
};

// Whether process p has ended (it stays to be waited for).
bool Exited(pid_t p) {
  siginfo_t si{};
  return waitid(P_PID, p, &si, WEXITED | WNOHANG | WNOWAIT) == 0 && si.si_pid == p;
}

double Elapsed() { return std::chrono::duration<double>(Clock::now() - tally.start).count(); }

void PrintLine(const char* what) {
  std::string faults;
  for (const auto& [kind, count] : tally.faults) absl::StrAppend(&faults, " ", kind, "=", count);
  std::printf(
      "soak %6.0f s: %s; segments %d, results checked %ld (off the reference %ld), faults:%s, "
      "failures that had to be %d, failures %zu\n",
      Elapsed(), what, tally.segments, tally.results, tally.off,
      faults.empty() ? " none" : faults.c_str(), tally.expected_failures, tally.failures.size());
  std::fflush(stdout);
  tally.last_line = Clock::now();
}

void Sleep(double s) {
  const auto until =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
  while (Clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    if (Clock::now() - tally.last_line >= seconds(60)) PrintLine(tally.segment.c_str());
  }
}

class Soak {
 public:
  explicit Soak(uint32_t seed) : rng_(seed) {}

  double Uniform(double lo, double hi) { return std::uniform_real_distribution<>(lo, hi)(rng_); }
  int Pick(int n) { return std::uniform_int_distribution<>(0, n - 1)(rng_); }

  // A job that must ride out every fault: each step equal to the reference.
  void Survive(int n, double fault_min, double fault_max, int segment_s) {
    struct Sparsifier {
      const char* name;
      sparsify::SparsifierKind kind;
    };
    const Sparsifier kinds[] = {{"micro", sparsify::SparsifierKind::kMicro},
                                {"hard", sparsify::SparsifierKind::kHard},
                                {"topk", sparsify::SparsifierKind::kTopK}};
    const Sparsifier& sp = kinds[Pick(3)];
    // Faults come during the first segment_s seconds; the steps are about
    // 60 % of what that time holds without them.
    const long steps = std::max<long>(30, static_cast<long>(0.6 * steps_per_s_ * segment_s));
    tally.segment = absl::StrCat("segment ", tally.segments + 1, " (survive, ", sp.name, ", ",
                                 steps, " steps)");
    auto lab = MakeLab(n, {"--rate=1gbit"});
    if (lab == nullptr) return;
    ClusterOptions o;
    o.lab = lab.get();
    o.peer_timeout_ms = kPeerTimeoutMs;
    o.extra = {absl::StrCat("--sparsifier=", sp.name)};
    DaemonCluster cluster(n, 1, o);
    const auto begun = Clock::now();
    cluster.StartClients(kBuckets, steps);
    const size_t lines = steps * kBuckets.size();
    double next = Uniform(fault_min, fault_max);
    double faulted = 0;  // seconds spent in faults
    auto since = [&] { return std::chrono::duration<double>(Clock::now() - begun).count(); };
    for (;;) {
      Sleep(0.1);
      if (Progress(cluster, 0) >= lines) break;
      bool exited = false;  // a process that ended early: WaitClients below says how
      for (int r = 0; r < n && !exited; ++r) exited = Exited(cluster.clients()[r]);
      if (exited || since() > 3 * segment_s + 300) break;
      if (since() < next || since() > segment_s) continue;
      const double at = since();
      Fault(*lab, cluster, n);
      faulted += since() - at;
      next = since() + Uniform(fault_min, fault_max);
    }
    const auto codes = cluster.WaitClients(seconds(120));
    const double took = std::chrono::duration<double>(Clock::now() - begun).count();
    const auto ref = Reference(n, 1, kBuckets, steps, Options(sp.kind));
    for (int r = 0; r < n; ++r) {
      const auto out = ReadLines(cluster.outs()[r]);
      if (codes[r] != 0) {
        ADD_FAILURE() << "node " << r << "'s process exited " << codes[r] << ": "
                      << (out.empty() ? "no output" : out.back());
      }
      for (const std::string& line : out) {
        ResultLine x;
        if (!ParseResultLine(line, ref[r], &x)) continue;  // a FAILED line: counted above
        ++tally.results;
        if (x.hash != ref[r][x.step][x.bucket]) {
          ++tally.off;
          ADD_FAILURE() << "node " << r << " step " << x.step << " bucket "
                        << kBuckets[x.bucket].name << ": off the reference";
        }
      }
    }
    if (took - faulted > 1) steps_per_s_ = std::max(5.0, steps / (took - faulted));
    const auto exits = cluster.Terminate(seconds(30));
    for (int r = 0; r < n; ++r) {
      if (exits[r] != 0) ADD_FAILURE() << "node " << r << "'s daemon exited " << exits[r];
    }
  }

  // A daemon paused for twice the peer timeout: every process fails naming it.
  void MustFail(int n) {
    const int paused = Pick(n);
    tally.segment = absl::StrCat("segment ", tally.segments + 1, " (fail: node ", paused,
                                 " paused ", 2 * kFailPeerTimeoutMs / 1000, " s)");
    const size_t before = tally.failures.size();
    auto lab = MakeLab(n, {"--rate=1gbit"});
    if (lab == nullptr) return;
    ClusterOptions o;
    o.lab = lab.get();
    o.peer_timeout_ms = kFailPeerTimeoutMs;
    DaemonCluster cluster(n, 1, o);
    cluster.StartClients(kLongJob, 100000);
    WaitForProgress(cluster, 6);
    if (::testing::Test::HasFatalFailure()) return;
    kill(cluster.pid(paused), SIGSTOP);
    ++tally.faults["long-pause"];
    Sleep(2 * kFailPeerTimeoutMs / 1000.0);
    kill(cluster.pid(paused), SIGCONT);
    const auto codes = cluster.WaitClients(seconds(60));
    for (int r = 0; r < n; ++r) {
      std::string line;
      const int status = FailedStatus(cluster.outs()[r], &line);
      EXPECT_EQ(codes[r], 3) << "node " << r << ": " << line;
      EXPECT_NE(status, -1) << "node " << r << ": " << line;
      EXPECT_TRUE(absl::StrContains(line, absl::StrCat("node ", paused)))
          << "node " << r << ": " << line;
    }
    const auto exits = cluster.Terminate(seconds(30));
    for (int r = 0; r < n; ++r) EXPECT_EQ(exits[r], 0) << "node " << r << "'s daemon";
    if (tally.failures.size() == before) ++tally.expected_failures;
  }

  // An elastic job loses a node: the others go on, exactly. Or its data
  // plane is reset between two live nodes mid-run: it goes on, exactly.
  void Elastic(int n) {
    if (Pick(2) == 1) {
      const int from = Pick(n);
      const int to = (from + 1 + Pick(n - 1)) % n;
      const long at = 5 + Pick(200);
      tally.segment = absl::StrCat("segment ", tally.segments + 1, " (elastic: node ", from,
                                   "'s connections to node ", to, " reset at step ", at, ")");
      ++tally.faults["conn-reset"];
      std::string settled;
      ExpectTheJobGoesOn(
          {}, [&](NetLab& lab, DaemonCluster& c) { ResetConnections(lab, c, from, to); },
          [](NetLab&, DaemonCluster&, const std::string& cause) {
            EXPECT_TRUE(absl::StrContains(cause, "connected afresh")) << cause;
          },
          &settled, n, /*steps=*/600, at, /*hold=*/false);
      return;
    }
    const int lost = 1 + Pick(n - 1);  // node 0 serves the coordinator
    tally.segment =
        absl::StrCat("segment ", tally.segments + 1, " (elastic: node ", lost, "'s daemon killed)");
    auto lab = MakeLab(n, {"--rate=1gbit"});
    if (lab == nullptr) return;
    ClusterOptions o;
    o.lab = lab.get();
    ++tally.faults["node-lost"];
    ExpectElasticJobGoesOn(o, n, {lost}, [](DaemonCluster& cluster, const std::vector<int>& l) {
      for (int r : l) {  // the node's daemon, then its (paused) trainer
        kill(cluster.pid(r), SIGKILL);
        waitpid(cluster.pid(r), nullptr, 0);
        cluster.Forget(r);
        kill(cluster.clients()[r], SIGKILL);
        waitpid(cluster.clients()[r], nullptr, 0);
      }
    });
  }

 private:
  static sparsify::SparsifyOptions Options(sparsify::SparsifierKind kind) {
    sparsify::SparsifyOptions s;
    s.sparsifier = kind;
    return s;
  }

  // One fault the design rides out, on a node drawn at random; returns
  // once it is over.
  void Fault(NetLab& lab, DaemonCluster& cluster, int n) {
    const int r = Pick(n);
    switch (Pick(5)) {
      case 0: {
        ++tally.faults["pause"];
        kill(cluster.pid(r), SIGSTOP);
        Sleep(Uniform(0.5, 4));
        kill(cluster.pid(r), SIGCONT);
        break;
      }
      case 1: {
        ++tally.faults["link-down"];
        EXPECT_TRUE(lab.Shape(r, {"--loss=100"}).ok());
        Sleep(Uniform(0.5, 4));
        EXPECT_TRUE(lab.Shape(r, {"--loss=0"}).ok());
        break;
      }
      case 2: {
        ++tally.faults["loss-burst"];
        EXPECT_TRUE(lab.Shape(r, {absl::StrCat("--loss=", 5 + Pick(26))}).ok());
        Sleep(Uniform(2, 6));
        EXPECT_TRUE(lab.Shape(r, {"--loss=0"}).ok());
        break;
      }
      case 3: {
        ++tally.faults["trainer-pause"];
        kill(cluster.clients()[r], SIGSTOP);
        Sleep(Uniform(0.5, 3));
        kill(cluster.clients()[r], SIGCONT);
        break;
      }
      default: {
        ++tally.faults["cpu-starved"];
        std::vector<pid_t> hogs;
        for (int i = 0; i < 2; ++i) {
          const pid_t p = fork();
          if (p == 0) {
            for (volatile unsigned long x = 0;; x = x + 1) {
            }
          }
          if (p > 0) hogs.push_back(p);
        }
        Sleep(Uniform(2, 6));
        for (pid_t p : hogs) {
          kill(p, SIGKILL);
          waitpid(p, nullptr, 0);
        }
      }
    }
  }

  std::mt19937 rng_;
  double steps_per_s_ = 150;  // without faults; measured by each survive segment
};

bool ParseRange(const std::string& text, double* lo, double* hi) {
  std::vector<std::string> f = absl::StrSplit(text, '-');
  return f.size() == 2 && absl::SimpleAtod(f[0], lo) && absl::SimpleAtod(f[1], hi) && *lo > 0 &&
         *hi >= *lo;
}

TEST(ChaosSoak, RunsForItsTime) {
  double fault_min = 0, fault_max = 0;
  ASSERT_TRUE(ParseRange(absl::GetFlag(FLAGS_fault_every), &fault_min, &fault_max))
      << "--fault_every wants MIN-MAX seconds, e.g. 60-300";
  const int n = absl::GetFlag(FLAGS_nodes);
  ASSERT_GE(n, 3) << "--nodes: at least 3 (an elastic job goes on with 2)";
  Soak soak(absl::GetFlag(FLAGS_seed));
  const double until = absl::GetFlag(FLAGS_seconds);
  for (int i = 0; Elapsed() < until; ++i) {
    switch (i % 3) {
      case 0:
        soak.Survive(n, fault_min, fault_max, absl::GetFlag(FLAGS_segment_s));
        break;
      case 1:
        soak.Elastic(n);
        break;
      default:
        soak.MustFail(n);
    }
    ++tally.segments;
    PrintLine(absl::StrCat("after ", tally.segment).c_str());
  }
  for (const std::string& f : tally.failures) std::printf("FAILURE %s\n", f.c_str());
}

}  // namespace
}  // namespace microd::testing

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  absl::ParseCommandLine(argc, argv);
  if (const std::string why = microd::testing::NetLab::SkipReason(); !why.empty()) {
    std::printf("microd-soak: skipped: %s\n", why.c_str());
    return 77;
  }
  ::testing::UnitTest::GetInstance()->listeners().Append(new microd::testing::Recorder);
  return RUN_ALL_TESTS();
}
