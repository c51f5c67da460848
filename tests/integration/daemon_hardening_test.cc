// SPDX-License-Identifier: Apache-2.0
// What must not end a job: a trainer that reads its completions late, a
// daemon paused for less than the peer timeout; and what must be refused
// without harm: ticket 0, a connection that never says hello. Daemons on
// loopback, trainers written against the C API in this process (one thread
// per node).
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "microd/wire.h"
#include "tests/integration/daemon_cluster.h"
extern "C" {
#include "microd/microd.h"
}

namespace microd::testing {
namespace {

// A training process of node `node`: `buckets` host buffers of `count`
// floats each, filled with node + 1 before every step, so that the average
// over n nodes is exactly (n + 1) / 2.
class Trainer {
 public:
  Trainer(const std::string& socket, int node, int buckets, uint64_t count)
      : node_(node), count_(count) {
    microd_options o;
    microd_options_init(&o);
    o.socket_path = socket.c_str();
    o.timeout_ms = 20000;
    status_ = microd_connect(&o, &c_);
    if (status_ != MICROD_OK) {
      error_ = microd_last_error(nullptr);
      return;
    }
    for (int b = 0; b < buckets && status_ == MICROD_OK; ++b) {
      float* data = nullptr;
      int32_t id = -1;
      status_ = microd_register_host_buffer(c_, absl::StrCat("b", b).c_str(), count, &data, &id);
      data_.push_back(data);
      ids_.push_back(id);
    }
    if (status_ != MICROD_OK) error_ = microd_last_error(c_);
  }
  ~Trainer() { microd_close(c_); }

  // Submits every bucket, sleeps `late`, then waits for each (up to
  // `wait_ms`): the first failure's text, or "" when every bucket holds the
  // exact average.
  std::string Step(int nodes, std::chrono::milliseconds late = std::chrono::milliseconds(0),
                   int wait_ms = 30000) {
    if (status_ != MICROD_OK) return absl::StrCat("set-up failed: ", error_);
    std::vector<uint64_t> tickets(ids_.size());
    for (size_t b = 0; b < ids_.size(); ++b) {
      std::fill(data_[b], data_[b] + count_, static_cast<float>(node_ + 1));
      if (microd_allreduce_async(c_, ids_[b], &tickets[b]) != MICROD_OK) {
        return absl::StrCat("submit of b", b, ": ", microd_last_error(c_));
      }
    }
    std::this_thread::sleep_for(late);
    const float want = (nodes + 1) / 2.0f;
    for (size_t b = 0; b < ids_.size(); ++b) {
      if (microd_wait(c_, tickets[b], wait_ms) != MICROD_OK) {
        return absl::StrCat("wait for b", b, ": ", microd_last_error(c_));
      }
      for (uint64_t i = 0; i < count_; ++i) {
        if (data_[b][i] != want) {
          return absl::StrCat("b", b, "[", i, "] = ", data_[b][i], ", want ", want);
        }
      }
    }
    return "";
  }

 private:
  const int node_;
  const uint64_t count_;
  microd_client* c_ = nullptr;
  microd_status status_ = MICROD_OK;
  std::string error_;
  std::vector<float*> data_;
  std::vector<int32_t> ids_;
};

// One thread per node, each running `body(node)`; their results by node.
std::vector<std::string> OnEveryNode(int n, const std::function<std::string(int)>& body) {
  std::vector<std::string> out(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back([&, r] { out[r] = body(r); });
  for (auto& t : threads) t.join();
  return out;
}

// Issue J: 400 buckets submitted at once and their completions read a
// second later (a trainer busy in backward) filled the daemon's socket
// buffer after about 167 completions, and the daemon dropped the trainer,
// failing the job on every node.
TEST(Hardening, ATrainerReadingItsCompletionsLateKeepsTheJob) {
  constexpr int kNodes = 2;
  DaemonCluster cluster(kNodes, 1);
  const auto results = OnEveryNode(kNodes, [&](int r) {
    Trainer t(cluster.socket(r), r, 400, 1000);
    for (int step = 0; step < 3; ++step) {
      if (std::string e = t.Step(kNodes, std::chrono::milliseconds(1000)); !e.empty()) {
        return absl::StrCat("step ", step, ": ", e);
      }
    }
    return std::string();
  });
  for (int r = 0; r < kNodes; ++r) EXPECT_EQ(results[r], "") << "node " << r;
  auto status = cluster.Status(0);
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->job_state(), microd::v1::JOB_STATE_RUNNING) << status->failure();
}

// Runs steps on every node until step `stop_at` (or 100,000 steps),
// counting them; each node's first failure, and when it came.
struct Steady {
  std::atomic<int> stop_at{100000};
  std::vector<std::atomic<int>> steps;
  std::vector<std::atomic<int64_t>> failed_at_ms;
  explicit Steady(int n) : steps(n), failed_at_ms(n) {}
  // Every node stops at the same step, one no node has started yet. (A
  // flag each node read after its own step let one node start a step the
  // others never submitted, and its trainer waited 30 s for it: the flake
  // CI saw, reproduced under load in 3 runs.) A node can have started
  // the step its count names, never the one after: every node has to
  // submit a step before any completes it.
  void StopSoon() {
    int most = 0;
    for (const auto& c : steps) most = std::max(most, c.load());
    stop_at = most + 2;
  }
};

std::vector<std::string> RunUntilStopped(DaemonCluster& cluster, int n, Steady& s) {
  return OnEveryNode(n, [&](int r) {
    Trainer t(cluster.socket(r), r, 3, 1000);
    for (int i = 0; i < s.stop_at; ++i) {
      if (std::string e = t.Step(n); !e.empty()) {
        s.failed_at_ms[r] = absl::ToUnixMillis(absl::Now());
        return e;
      }
      ++s.steps[r];
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return std::string();
  });
}

// Issue J: node 0's daemon stopped for 4 s (peer timeout 10 s) failed every
// process with "Deadline Exceeded", naming nothing: its poll of the
// coordinator failed once and that ended the job.
TEST(Hardening, Node0PausedShorterThanThePeerTimeoutKeepsTheJob) {
  constexpr int kNodes = 3;
  ClusterOptions o;
  o.peer_timeout_ms = 10000;
  DaemonCluster cluster(kNodes, 1, o);
  Steady s(kNodes);
  std::thread pauser([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    const int before = s.steps[1];
    kill(cluster.pid(0), SIGSTOP);
    std::this_thread::sleep_for(std::chrono::seconds(4));
    kill(cluster.pid(0), SIGCONT);
    // Steps go on after the pause.
    for (int i = 0; i < 100 && s.steps[1] < before + 20; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    s.StopSoon();
  });
  const auto results = RunUntilStopped(cluster, kNodes, s);
  pauser.join();
  for (int r = 0; r < kNodes; ++r) EXPECT_EQ(results[r], "") << "node " << r;
  EXPECT_GE(s.steps[1], 40) << "the job did not go on after the pause";
  auto status = cluster.Status(1);
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->job_state(), microd::v1::JOB_STATE_RUNNING) << status->failure();
}

// Paused for twice the peer timeout, node 0 is lost: every process gets an
// error naming node 0, within the peer timeout and a few seconds. Node 0's
// own process too (issue Z's soak: 4 of 7 such pauses failed it naming only
// node 1, whose connection it found closed when it ran again): its daemon
// says it was held.
TEST(Hardening, Node0PausedTwiceThePeerTimeoutFailsEveryProcessNamingIt) {
  constexpr int kNodes = 3;
  ClusterOptions o;
  o.peer_timeout_ms = 3000;
  DaemonCluster cluster(kNodes, 1, o);
  Steady s(kNodes);
  std::atomic<int64_t> paused_at_ms{0};
  std::thread pauser([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    paused_at_ms = absl::ToUnixMillis(absl::Now());
    kill(cluster.pid(0), SIGSTOP);
    std::this_thread::sleep_for(std::chrono::seconds(6));
    kill(cluster.pid(0), SIGCONT);
  });
  // Every node steps until it fails; node 0's trainer waits on a stopped
  // daemon meanwhile.
  const auto results = RunUntilStopped(cluster, kNodes, s);
  pauser.join();
  for (int r = 1; r < kNodes; ++r) {
    EXPECT_TRUE(absl::StrContains(results[r], "node 0")) << "node " << r << ": " << results[r];
    EXPECT_LE(s.failed_at_ms[r] - paused_at_ms, 3000 + 5000) << "node " << r;
  }
  EXPECT_TRUE(absl::StrContains(results[0], "node 0")) << "node 0: " << results[0];
}

// Issue Z: a failure on one node reached two others only through the
// coordinator's watchdog, 22 s later (docs/runs/2026-12-03-dense-stall.md).
// A node that fails locally reports it at once, and the others hear it
// with their next heartbeat (a tenth of the peer timeout: 1 s by default)
// or from the data plane. Node 2's process leaves with a submission
// pending (that fails the job there) while nodes 0 and 1 wait on a step:
// both get the error, naming node 2, within a heartbeat and a second.
TEST(Hardening, ALocalFailureReachesEveryNodeWithinAHeartbeat) {
  constexpr int kNodes = 3;
  ClusterOptions o;
  o.peer_timeout_ms = 10000;  // heartbeats 1 s apart, as by default
  DaemonCluster cluster(kNodes, 1, o);
  std::atomic<int64_t> left_at_ms{0};
  std::thread leaver([&] {
    microd_options opt;
    microd_options_init(&opt);
    const std::string socket = cluster.socket(2);
    opt.socket_path = socket.c_str();
    opt.timeout_ms = 20000;
    microd_client* c = nullptr;
    ASSERT_EQ(microd_connect(&opt, &c), MICROD_OK) << microd_last_error(nullptr);
    float* data = nullptr;
    int32_t b0 = -1, b1 = -1;
    uint64_t ticket = 0;
    EXPECT_EQ(microd_register_host_buffer(c, "b0", 1000, &data, &b0), MICROD_OK);
    EXPECT_EQ(microd_register_host_buffer(c, "b1", 1000, &data, &b1), MICROD_OK);
    EXPECT_EQ(microd_allreduce_async(c, b1, &ticket), MICROD_OK) << microd_last_error(c);
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // the others wait on b0
    left_at_ms = absl::ToUnixMillis(absl::Now());
    microd_close(c);
  });
  std::vector<int64_t> failed_at_ms(2, 0);
  const auto errors = OnEveryNode(2, [&](int r) {
    Trainer t(cluster.socket(r), r, 1, 1000);
    std::string e = t.Step(kNodes);
    failed_at_ms[r] = absl::ToUnixMillis(absl::Now());
    return e;
  });
  leaver.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(absl::StrContains(errors[r], "node 2")) << "node " << r << ": " << errors[r];
    EXPECT_TRUE(absl::StrContains(errors[r], "disconnected with work pending"))
        << "node " << r << ": " << errors[r];
    const int64_t took = failed_at_ms[r] - left_at_ms;
    std::printf("node %d had node 2's failure after %lld ms\n", r, static_cast<long long>(took));
    EXPECT_LE(took, 1000 + 1000) << "node " << r;
  }
}

// The next message on `fd` within 15 s: an ERROR's status and text, or
// why there was none.
std::pair<int, std::string> ReadError(int fd) {
  timeval tv{15, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  microd_wire_error e{};
  const ssize_t n = recv(fd, &e, sizeof e, 0);
  if (n != static_cast<ssize_t>(sizeof e) || e.h.type != MICROD_MSG_ERROR) {
    return {-1, n == 0 ? "closed without an error" : "no error within 15 s"};
  }
  e.message[sizeof e.message - 1] = '\0';
  return {e.status, e.message};
}

// A raw connection's hello as local rank 0, and the daemon's answer.
microd_wire_hello_ack SayHello(int fd) {
  microd_wire_hello hello{};
  microd_wire_header_init(&hello.h, MICROD_MSG_HELLO, sizeof hello);
  hello.local_rank = 0;
  microd_wire_hello_ack ack{};
  EXPECT_EQ(send(fd, &hello, sizeof hello, 0), static_cast<ssize_t>(sizeof hello));
  EXPECT_EQ(recv(fd, &ack, sizeof ack, 0), static_cast<ssize_t>(sizeof ack));
  return ack;
}

// Issue J: a SUBMIT with ticket 0 ("none" inside the engine) was accepted;
// sent twice it was counted twice. Now a protocol error, and the daemon
// serves the others as before.
TEST(Hardening, TicketZeroIsAProtocolError) {
  DaemonCluster cluster(1, 2);
  const int fd = RawConnect(cluster.socket(0));
  ASSERT_GE(fd, 0);
  ASSERT_EQ(SayHello(fd).status, 0);
  microd_wire_submit sub{};
  microd_wire_header_init(&sub.h, MICROD_MSG_SUBMIT, sizeof sub);
  sub.buffer_id = 0;
  sub.ticket = 0;
  ASSERT_EQ(send(fd, &sub, sizeof sub, 0), static_cast<ssize_t>(sizeof sub));
  const auto [status, message] = ReadError(fd);
  close(fd);
  EXPECT_EQ(status, MICROD_ERR_PROTOCOL) << message;
  EXPECT_TRUE(absl::StrContains(message, "ticket 0")) << message;
  // Both local ranks are free again and a job of two processes runs.
  const std::string path = cluster.socket(0);
  const auto results = OnEveryNode(2, [&](int l) {
    microd_options o;
    microd_options_init(&o);
    o.socket_path = path.c_str();
    o.local_rank = l;
    o.timeout_ms = 20000;
    microd_client* c = nullptr;
    if (microd_connect(&o, &c) != MICROD_OK) return std::string(microd_last_error(nullptr));
    float* data = nullptr;
    int32_t id = -1;
    std::string out;
    if (microd_register_host_buffer(c, "w", 100, &data, &id) != MICROD_OK) {
      out = microd_last_error(c);
    } else {
      std::fill(data, data + 100, static_cast<float>(l));
      if (microd_allreduce(c, id, 20000) != MICROD_OK) {
        out = microd_last_error(c);
      } else if (data[0] != 0.5f) {
        out = absl::StrCat("got ", data[0]);
      }
    }
    microd_close(c);
    return out;
  });
  EXPECT_EQ(results, (std::vector<std::string>{"", ""}));
}

// A hugetlbfs memfd (its pages can be punched out after registration, and
// the daemon's next touch of them would be SIGBUS) is refused at
// registration; the connection stays usable.
TEST(Hardening, AHugetlbfsMemfdIsRefused) {
  const int huge = memfd_create("huge", MFD_HUGETLB | MFD_ALLOW_SEALING);
  if (huge < 0) GTEST_SKIP() << "this kernel makes no hugetlbfs memfd: " << std::strerror(errno);
  ASSERT_EQ(ftruncate(huge, 2 << 20), 0);
  ASSERT_EQ(fcntl(huge, F_ADD_SEALS, F_SEAL_SHRINK), 0);
  DaemonCluster cluster(1, 1);
  const int fd = RawConnect(cluster.socket(0));
  ASSERT_GE(fd, 0);
  SayHello(fd);
  microd_wire_register reg{};
  microd_wire_header_init(&reg.h, MICROD_MSG_REGISTER, sizeof reg);
  reg.buffer_id = 0;
  reg.kind = MICROD_BUFFER_HOST;
  reg.dtype = MICROD_WIRE_DTYPE_FLOAT32;
  reg.count = 1000;
  std::strcpy(reg.name, "w");
  ASSERT_EQ(microd_wire_send(fd, &reg, sizeof reg, huge), 0);
  close(huge);
  microd_wire_register_ack answer{};
  ASSERT_EQ(recv(fd, &answer, sizeof answer, 0), static_cast<ssize_t>(sizeof answer));
  close(fd);
  EXPECT_EQ(answer.status, MICROD_ERR_INVALID_ARGUMENT) << answer.message;
  EXPECT_TRUE(absl::StrContains(answer.message, "not hugetlbfs")) << answer.message;
}

// Admin defaults to a Unix socket that only the daemon's uid may connect
// to. Before: 127.0.0.1:7471, which every local user reaches (status with
// pids and bucket names, the timeline, captures holding threads for hours).
TEST(Hardening, AdminIsAUnixSocketOnlyTheDaemonsUidReaches) {
  const std::string help = ReadFile([] {
    const std::string dir = MakeTempDir("admin-help");
    WaitAll({Spawn({HelperPath(MICROD_DAEMON), "--help"}, dir + "/help")},
            std::chrono::seconds(20));
    return dir + "/help";
  }());
  EXPECT_TRUE(absl::StrContains(help, "default: \"unix:/run/microd/admin.sock\"")) << help;
  if (geteuid() != 0) GTEST_SKIP() << "needs root to connect as another uid";
  const std::string dir = MakeTempDir("admin-unix");
  const std::string admin = dir + "/s/admin.sock";
  const pid_t daemon =
      Spawn({HelperPath(MICROD_DAEMON), "--socket=" + dir + "/s/microd.sock", "--nodes=1",
             "--coordinator_listen=127.0.0.1:0", "--admin=unix:" + admin},
            dir + "/daemon.log");
  struct stat st {};
  for (int i = 0; i < 200 && stat(admin.c_str(), &st) != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_EQ(stat(admin.c_str(), &st), 0) << ReadFile(dir + "/daemon.log");
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  chmod((dir + "/s").c_str(), 0755);
  chmod(dir.c_str(), 0755);  // so that only the socket's own mode decides
  auto connect_as = [&](uid_t uid) {
    const pid_t child = fork();
    if (child == 0) {
      if (uid != 0 && (setgid(uid) != 0 || setuid(uid) != 0)) _exit(2);
      const int fd = socket(AF_UNIX, SOCK_STREAM, 0);
      sockaddr_un addr{};
      addr.sun_family = AF_UNIX;
      std::strcpy(addr.sun_path, admin.c_str());
      _exit(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0
                ? 0
                : (errno == EACCES ? 13 : 1));
    }
    int status = 0;
    waitpid(child, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  };
  EXPECT_EQ(connect_as(0), 0);
  EXPECT_EQ(connect_as(65534), 13);  // EACCES
  // Stopped once it serves (its processes' socket is there): a stop signal
  // while it still joins ends the process at once, with status 1.
  for (int i = 0; i < 400 && !std::filesystem::exists(dir + "/s/microd.sock"); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_TRUE(std::filesystem::exists(dir + "/s/microd.sock")) << ReadFile(dir + "/daemon.log");
  kill(daemon, SIGTERM);
  EXPECT_EQ(WaitAll({daemon}, std::chrono::seconds(20))[0], 0);
  EXPECT_FALSE(std::filesystem::exists(admin));  // removed at exit
}

// One timeline capture at a time: each holds a server thread for its
// window (before: thousands of hour-long captures held thousands of threads
// and the health checks stopped answering).
TEST(Hardening, OneTimelineCaptureAtATime) {
  DaemonCluster cluster(1, 1);
  auto capture = [&](int seconds) {
    auto stub = microd::v1::Admin::NewStub(
        grpc::CreateChannel(cluster.admin_target(0), grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds + 10));
    microd::v1::GetTimelineRequest req;
    req.set_seconds(seconds);
    microd::v1::GetTimelineResponse resp;
    return stub->GetTimeline(&ctx, req, &resp);
  };
  grpc::Status first;
  std::thread long_one([&] { first = capture(3); });
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const grpc::Status second = capture(1);
  long_one.join();
  EXPECT_TRUE(first.ok()) << first.error_message();
  EXPECT_EQ(second.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << second.error_message();
  EXPECT_TRUE(absl::StrContains(second.error_message(), "one at a time")) << second.error_message();
  EXPECT_TRUE(capture(1).ok());  // and the next one, once it ended
}

// The daemon's state for a bucket counts against its memory budget at
// registration: a buffer that would take it past is refused with the
// numbers, the daemon unharmed (before: the per-process check counted 4
// bytes an element against 1 TiB, and one process could exhaust the
// sidecar's memory limit).
TEST(Hardening, ABucketOverTheStateBudgetIsRefusedAtRegistration) {
  DaemonCluster cluster(1, 1, {"--max_state_bytes=400000", "--max_bytes_per_process=100000000"});
  {
    Trainer big(cluster.socket(0), 0, 1, 1000000);  // 4 MB of residual alone
    EXPECT_TRUE(absl::StrContains(big.Step(1), "over its budget of 400000 bytes")) << big.Step(1);
  }
  // Below the dense floor: 240 KB of the fused dense buffer; exact averages.
  Trainer small(cluster.socket(0), 0, 1, 60000);
  EXPECT_EQ(small.Step(1), "");
}

// Connections that never said hello do not count as processes: with
// --max_processes=1, one such connection used to refuse the real process.
TEST(Hardening, ConnectionsWithoutHelloTakeNoProcessesPlace) {
  DaemonCluster cluster(1, 1, {"--max_processes=1"});
  const int idle = RawConnect(cluster.socket(0));
  ASSERT_GE(idle, 0);
  Trainer t(cluster.socket(0), 0, 1, 10);
  EXPECT_EQ(t.Step(1), "");
  close(idle);
}

// Issue J: a connection that never sends HELLO held its slot forever.
TEST(Hardening, AConnectionThatNeverSaysHelloIsClosed) {
  DaemonCluster cluster(1, 1, {"--hello_timeout_ms=1500"});
  const int fd = RawConnect(cluster.socket(0));
  ASSERT_GE(fd, 0);
  const auto start = std::chrono::steady_clock::now();
  const auto [status, message] = ReadError(fd);
  const auto waited = std::chrono::steady_clock::now() - start;
  close(fd);
  EXPECT_EQ(status, MICROD_ERR_PROTOCOL) << message;
  EXPECT_TRUE(absl::StrContains(message, "no hello")) << message;
  EXPECT_LT(waited, std::chrono::seconds(10));
  // A real process is served.
  Trainer t(cluster.socket(0), 0, 1, 10);
  EXPECT_EQ(t.Step(1), "");
}

// Whoever can write the socket's directory could serve a socket there; the
// client checks who serves it before handing over any memory (before: it
// sent its hello, then its buffers, to whoever listened). As root: the
// impostor runs as nobody (65534).
TEST(Hardening, AClientRefusesADaemonOfAnotherUid) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to serve a socket as another uid";
  const std::string dir = MakeTempDir("impostor");
  const std::string path = dir + "/microd.sock";
  chmod(dir.c_str(), 0777);  // the impostor's bind needs the directory
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  const pid_t impostor = fork();
  if (impostor == 0) {
    if (setgid(65534) != 0 || setuid(65534) != 0) _exit(1);
    const int fd = socket(AF_UNIX, SOCK_SEQPACKET, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strcpy(addr.sun_path, path.c_str());
    if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || listen(fd, 4) != 0) {
      _exit(2);
    }
    (void)!write(ready[1], "x", 1);
    pause();
    _exit(0);
  }
  close(ready[1]);
  char x;
  ASSERT_EQ(read(ready[0], &x, 1), 1) << "the impostor did not start";
  close(ready[0]);
  microd_options o;
  microd_options_init(&o);
  o.socket_path = path.c_str();
  o.timeout_ms = 2000;
  microd_client* c = nullptr;
  EXPECT_EQ(microd_connect(&o, &c), MICROD_ERR_PERMISSION);
  const std::string message = microd_last_error(nullptr);
  EXPECT_TRUE(absl::StrContains(message, "runs as uid 65534")) << message;
  // Named in MICROD_DAEMON_UID it is trusted: the hello goes out (and the
  // impostor never answers it).
  setenv("MICROD_DAEMON_UID", "65534", 1);
  EXPECT_EQ(microd_connect(&o, &c), MICROD_ERR_TIMEOUT) << microd_last_error(nullptr);
  unsetenv("MICROD_DAEMON_UID");
  kill(impostor, SIGKILL);
  waitpid(impostor, nullptr, 0);
}

// Issue J: a bucket one process never submits left every node waiting with
// nothing said. The stall inspector names the bucket, the node and the
// local process (with its pid) it waits for, on every node's Admin status.
// 2 nodes x 2 processes; node 1's local process 0 (the first to connect)
// registers and does not submit.
struct StallRun {
  std::vector<std::string> results;  // the three submitting trainers
  std::string report;                // a stall as node 1's Admin saw it
};

StallRun RunWithOneLateProcess(DaemonCluster& cluster, bool submit_late) {
  StallRun run;
  run.results.resize(3);
  Trainer late(cluster.socket(1), 1, 1, 100);
  std::vector<std::thread> threads;
  for (int i = 0; i < 3; ++i) {
    threads.emplace_back([&, i] {
      Trainer t(cluster.socket(i < 2 ? 0 : 1), i < 2 ? 0 : 1, 1, 100);
      run.results[i] = t.Step(2);
    });
  }
  for (int i = 0; i < 100 && run.report.empty(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    auto status = cluster.Status(1);
    if (status.ok() && status->stalls_size() > 0) run.report = status->stalls(0);
  }
  std::string late_result;
  if (submit_late) late_result = late.Step(2);
  for (auto& t : threads) t.join();
  if (!late_result.empty()) run.results.push_back("late: " + late_result);
  return run;
}

TEST(Hardening, AMissingSubmissionIsReportedNamingTheNodeProcessAndBucket) {
  DaemonCluster cluster(2, 2, {"--stall_warning_s=1"});
  const StallRun run = RunWithOneLateProcess(cluster, /*submit_late=*/true);
  EXPECT_TRUE(absl::StrContains(run.report, "bucket 'b0'")) << run.report;
  EXPECT_TRUE(absl::StrContains(
      run.report, "node 1 (node1): local process(es) 0 (pid " + std::to_string(getpid())))
      << run.report;
  EXPECT_TRUE(absl::StrContains(run.report, "ready on node 0 (node0)")) << run.report;
  // Once it came, the step ran for everyone (the values are exact).
  EXPECT_EQ(run.results, (std::vector<std::string>{"", "", ""}));
  // The coordinator logged it.
  const auto log = ReadLines(cluster.dir() + "/daemon0.log");
  bool logged = false;
  for (const auto& line : log) logged = logged || absl::StrContains(line, "stall: bucket 'b0'");
  EXPECT_TRUE(logged);
  // And the report is gone.
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  auto status = cluster.Status(0);
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->stalls_size(), 0) << status->stalls(0);
}

// Issue Z: a trainer's wait that timed out said "ticket 145 not complete
// after 30000 ms" and nothing of what it waited for (the stall inspector
// speaks after 60 s, on the Admin status only). Its error now names the
// bucket and what it waits for: on node 0, where the bucket is ready, the
// coordinator's account (node 1's local process 0, with its pid); on node
// 1, its own node's process. 2 nodes x 2 processes, default stall warning.
TEST(Hardening, ATimedOutWaitSaysWhatItWaitsFor) {
  DaemonCluster cluster(2, 2);
  Trainer late(cluster.socket(1), 1, 1, 100);  // local process 0 of node 1: never submits
  std::vector<std::string> results(3);
  std::vector<std::thread> threads;
  // Each keeps its connection until all three have their answer (the first
  // to leave with work pending would fail the job for the others).
  std::atomic<int> answered{0};
  for (int i = 0; i < 3; ++i) {
    threads.emplace_back([&, i] {
      Trainer t(cluster.socket(i < 2 ? 0 : 1), i < 2 ? 0 : 1, 1, 100);
      results[i] = t.Step(2, std::chrono::milliseconds(0), /*wait_ms=*/5000);
      ++answered;
      for (int k = 0; k < 1000 && answered < 3; ++k) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    });
  }
  for (auto& t : threads) t.join();
  const std::string pid = std::to_string(getpid());
  for (int i = 0; i < 2; ++i) {
    EXPECT_TRUE(absl::StrContains(results[i],
                                  "(bucket 'b0') not complete after 5000 ms: "
                                  "bucket 'b0' is ready on node 0 (node0)"))
        << results[i];
    EXPECT_TRUE(absl::StrContains(
        results[i], "node 1 (node1): local process(es) 0 (pid " + pid + ") did not submit it"))
        << results[i];
  }
  EXPECT_TRUE(absl::StrContains(results[2], "bucket 'b0' was submitted on node 1 (node1)"))
      << results[2];
  EXPECT_TRUE(absl::StrContains(results[2], "waiting for local process(es) 0 (pid " + pid + ")"))
      << results[2];
}

TEST(Hardening, StallAbortFailsTheJobWithTheReport) {
  DaemonCluster cluster(2, 2, {"--stall_warning_s=1", "--stall_abort_s=2"});
  const StallRun run = RunWithOneLateProcess(cluster, /*submit_late=*/false);
  for (const std::string& r : run.results) {
    EXPECT_TRUE(absl::StrContains(r, "bucket 'b0' stalled")) << r;
    EXPECT_TRUE(absl::StrContains(r, "node 1 (node1): local process(es) 0 (pid")) << r;
  }
}

}  // namespace
}  // namespace microd::testing
