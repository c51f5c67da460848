// SPDX-License-Identifier: Apache-2.0
// microd-bench-soak: a long run that must change nothing but the step count.
// 4 daemons on loopback; node r < 3 has one training process, node 3 two
// (5 in all). Every process registers --buckets buckets (the first
// --sparse_buckets of --sparse_count elements, reduced by MiCRO; the others
// of --count elements, dense) and runs --steps steps. Node 1's process reads
// its completions late (it sleeps --slow_ms after submitting, every
// --slow_every steps); node 3's local process 0 speaks the wire protocol
// itself and floods: after submitting the last bucket it sends --flood more
// SUBMITs of it while it is in flight (each must be refused with an error
// completion, and counted), and only then lets its partner process submit.
// Checked every step: each dense bucket holds exactly the average; each
// sparse bucket's update hashes the same on every process. Printed: each
// daemon's RSS and open descriptors after the warm-up and at the end,
// beside the target (growth < 5 %), the refusals, and whether the job ever
// failed. A benchmark, not a test: run it by hand or from scripts/bench.sh.
//
// The program launches itself: the launcher starts the daemons and the
// trainer processes (--trainer_node=r), which report progress in files.
#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "bench/bench_cluster.h"
#include "microd/microd.h"
#include "microd/wire.h"

ABSL_FLAG(int, buckets, 1000, "buckets per process");
ABSL_FLAG(uint64_t, count, 256, "elements of each dense bucket");
ABSL_FLAG(int, sparse_buckets, 2, "of the buckets, how many are large and sparsified");
ABSL_FLAG(uint64_t, sparse_count, 70001, "elements of each sparse bucket");
ABSL_FLAG(long, steps, 10000, "steps");
ABSL_FLAG(long, warmup, 200, "steps before the first sample of the daemons");
ABSL_FLAG(int, slow_every, 10, "node 1 reads its completions late every this many steps");
ABSL_FLAG(int, slow_ms, 50, "how late");
ABSL_FLAG(int, flood, 8, "extra SUBMITs of an in-flight bucket per step from node 3");
ABSL_FLAG(std::string, daemon, "", "microd binary (default: next to this one)");
ABSL_FLAG(std::string, daemon_flags, "", "more microd flags, comma-separated");
// Trainer mode (set by the launcher).
ABSL_FLAG(int, trainer_node, -1, "internal: run the training processes of this node");
ABSL_FLAG(std::string, dir, "", "internal: the run's directory");

namespace {

constexpr int kNodes = 4;
constexpr int kWorld = 5;  // nodes 0-2: one process each; node 3: two

using microd::bench::SocketOf;

// Global rank of (node, local rank).
int GlobalRank(int node, int local) { return node < 3 ? node : 3 + local; }

// What process p holds in element i of bucket b at step t. Dense buckets:
// (p + 1) * (1 + t % 4), so that the average over the 5 processes is exactly
// 3 * (1 + t % 4). Sparse buckets: small integers that differ by element.
float Value(int p, int b, long t, uint64_t i, bool sparse) {
  if (!sparse) return static_cast<float>((p + 1) * (1 + t % 4));
  const uint64_t h = (i * 2654435761u + static_cast<uint64_t>(p) * 97 + b * 7 + t * 131) % 2001;
  return (static_cast<float>(h) - 1000.0f) / 256.0f;
}

uint64_t Hash(const float* x, uint64_t n) {
  uint64_t h = 1469598103934665603ull;
  const unsigned char* p = reinterpret_cast<const unsigned char*>(x);
  for (uint64_t i = 0; i < n * sizeof(float); ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

struct Layout {
  int buckets;
  int sparse;
  uint64_t count, sparse_count;
  uint64_t Count(int b) const { return b < sparse ? sparse_count : count; }
};

Layout TheLayout() {
  return {absl::GetFlag(FLAGS_buckets), absl::GetFlag(FLAGS_sparse_buckets),
          absl::GetFlag(FLAGS_count), absl::GetFlag(FLAGS_sparse_count)};
}

// Fills, checks and records one process's buckets; shared by both kinds of
// trainer. A failure's text, or "".
class Steps {
 public:
  Steps(const std::string& dir, int p) : p_(p), hashes_(absl::StrCat(dir, "/hashes", p)) {}
  void Fill(const Layout& l, long t, const std::vector<float*>& data) const {
    for (int b = 0; b < l.buckets; ++b) {
      const bool sparse = b < l.sparse;
      for (uint64_t i = 0; i < l.Count(b); ++i) data[b][i] = Value(p_, b, t, i, sparse);
    }
  }
  std::string Check(const Layout& l, long t, const std::vector<float*>& data) {
    const float want = static_cast<float>(3 * (1 + t % 4));
    for (int b = l.sparse; b < l.buckets; ++b) {
      for (uint64_t i = 0; i < l.count; ++i) {
        if (data[b][i] != want) {
          return absl::StrCat("step ", t, " bucket ", b, "[", i, "] = ", data[b][i], ", want ",
                              want);
        }
      }
    }
    hashes_ << t;
    for (int b = 0; b < l.sparse; ++b) hashes_ << " " << Hash(data[b], l.sparse_count);
    hashes_ << "\n";
    return "";
  }

 private:
  const int p_;
  std::ofstream hashes_;
};

void Progress(const std::string& dir, int p, long t) {
  std::ofstream(absl::StrCat(dir, "/progress", p, ".tmp")) << t << "\n";
  std::rename(absl::StrCat(dir, "/progress", p, ".tmp").c_str(),
              absl::StrCat(dir, "/progress", p).c_str());
}

// A trainer on the C API. `before_submit(t)` runs before each step's
// submissions (node 3's partner waits there for the flooder).
std::string ApiTrainer(const std::string& dir, int node, int local,
                       const std::function<void(long)>& before_submit) {
  const Layout l = TheLayout();
  const int p = GlobalRank(node, local);
  microd_options o;
  microd_options_init(&o);
  const std::string socket = SocketOf(dir, node);
  o.socket_path = socket.c_str();
  o.local_rank = local;
  o.timeout_ms = 60000;
  microd_client* c = nullptr;
  if (microd_connect(&o, &c) != MICROD_OK) return microd_last_error(nullptr);
  std::vector<float*> data(l.buckets);
  std::vector<int32_t> ids(l.buckets);
  for (int b = 0; b < l.buckets; ++b) {
    if (microd_register_host_buffer(c, absl::StrCat("b", b).c_str(), l.Count(b), &data[b],
                                    &ids[b]) != MICROD_OK) {
      return microd_last_error(c);
    }
  }
  Steps steps(dir, p);
  const bool slow = node == 1;
  std::vector<uint64_t> tickets(l.buckets);
  for (long t = 0; t < absl::GetFlag(FLAGS_steps); ++t) {
    steps.Fill(l, t, data);
    if (before_submit) before_submit(t);
    for (int b = 0; b < l.buckets; ++b) {
      if (microd_allreduce_async(c, ids[b], &tickets[b]) != MICROD_OK) return microd_last_error(c);
    }
    if (slow && t % absl::GetFlag(FLAGS_slow_every) == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(absl::GetFlag(FLAGS_slow_ms)));
    }
    for (int b = 0; b < l.buckets; ++b) {
      if (microd_wait(c, tickets[b], 120000) != MICROD_OK) {
        return absl::StrCat("step ", t, " bucket ", b, ": ", microd_last_error(c));
      }
    }
    if (std::string e = steps.Check(l, t, data); !e.empty()) return e;
    if (t % 50 == 0 || t + 1 == absl::GetFlag(FLAGS_steps)) Progress(dir, p, t + 1);
  }
  // Keep everything registered until the launcher took its last sample.
  for (int i = 0; i < 6000 && access((dir + "/done").c_str(), F_OK) != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  microd_close(c);
  return "";
}

// The flooder: node 3's local process 0 on the wire protocol itself.
class Flooder {
 public:
  explicit Flooder(const std::string& dir) : dir_(dir) {}
  std::string Run(const std::function<void(long)>& release_partner, long* refused) {
    const Layout l = TheLayout();
    if (std::string e = Connect(l); !e.empty()) return e;
    Steps steps(dir_, GlobalRank(3, 0));
    const int flood = absl::GetFlag(FLAGS_flood);
    const int x = l.buckets - 1;  // the bucket flooded
    for (long t = 0; t < absl::GetFlag(FLAGS_steps); ++t) {
      steps.Fill(l, t, data_);
      std::set<uint64_t> real, extra;
      for (int b = 0; b < l.buckets; ++b) {
        real.insert(Submit(b));
        if (b == x) {
          for (int k = 0; k < flood; ++k) extra.insert(Submit(b));
        }
      }
      // Every extra SUBMIT is refused while the real one waits for the
      // partner (which has not submitted yet); then the partner goes.
      long errors = 0;
      while (!extra.empty()) {
        microd_wire_completion m;
        if (std::string e = Read(&m); !e.empty()) return e;
        if (extra.erase(m.ticket) == 1) {
          if (m.status == 0) return absl::StrCat("step ", t, ": an extra SUBMIT was accepted");
          ++errors;
        } else if (real.erase(m.ticket) != 1 || m.status != 0) {
          return absl::StrCat("step ", t, ": completion of ticket ", m.ticket, " status ", m.status,
                              ": ", m.message);
        }
      }
      *refused += errors;
      release_partner(t);
      while (!real.empty()) {
        microd_wire_completion m;
        if (std::string e = Read(&m); !e.empty()) return e;
        if (real.erase(m.ticket) != 1 || m.status != 0) {
          return absl::StrCat("step ", t, ": completion of ticket ", m.ticket, " status ", m.status,
                              ": ", m.message);
        }
      }
      if (std::string e = steps.Check(l, t, data_); !e.empty()) return e;
      if (t % 50 == 0 || t + 1 == absl::GetFlag(FLAGS_steps))
        Progress(dir_, GlobalRank(3, 0), t + 1);
    }
    for (int i = 0; i < 6000 && access((dir_ + "/done").c_str(), F_OK) != 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    microd_wire_goodbye bye{};
    microd_wire_header_init(&bye.h, MICROD_MSG_GOODBYE, sizeof bye);
    send(fd_, &bye, sizeof bye, MSG_NOSIGNAL);
    close(fd_);
    return "";
  }

 private:
  std::string Connect(const Layout& l) {
    fd_ = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strcpy(addr.sun_path, SocketOf(dir_, 3).c_str());
    bool connected = false;
    for (int i = 0; i < 600 && !connected; ++i) {
      connected = connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
      if (!connected) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    if (!connected) return "cannot connect to node 3's daemon";
    microd_wire_hello hello{};
    microd_wire_header_init(&hello.h, MICROD_MSG_HELLO, sizeof hello);
    hello.local_rank = 0;
    hello.pid = static_cast<uint32_t>(getpid());
    send(fd_, &hello, sizeof hello, MSG_NOSIGNAL);
    microd_wire_hello_ack ack{};
    if (recv(fd_, &ack, sizeof ack, 0) != static_cast<ssize_t>(sizeof ack) || ack.status != 0) {
      return "hello refused";
    }
    for (int b = 0; b < l.buckets; ++b) {
      const uint64_t bytes = l.Count(b) * sizeof(float);
      const int mfd = memfd_create("soak", MFD_CLOEXEC | MFD_ALLOW_SEALING);
      if (mfd < 0 || ftruncate(mfd, static_cast<off_t>(bytes)) != 0 ||
          fcntl(mfd, F_ADD_SEALS, F_SEAL_SHRINK) != 0) {
        return "memfd";
      }
      void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, mfd, 0);
      if (p == MAP_FAILED) return "mmap";
      data_.push_back(static_cast<float*>(p));
      microd_wire_register reg{};
      microd_wire_header_init(&reg.h, MICROD_MSG_REGISTER, sizeof reg);
      reg.buffer_id = static_cast<uint32_t>(b);
      reg.kind = MICROD_BUFFER_HOST;
      reg.dtype = MICROD_WIRE_DTYPE_FLOAT32;
      reg.count = l.Count(b);
      std::snprintf(reg.name, sizeof reg.name, "b%d", b);
      if (microd_wire_send(fd_, &reg, sizeof reg, mfd) != 0) return "register";
      close(mfd);
      microd_wire_register_ack rack{};
      if (recv(fd_, &rack, sizeof rack, 0) != static_cast<ssize_t>(sizeof rack) ||
          rack.status != 0) {
        return absl::StrCat("register of b", b, " refused: ", rack.message);
      }
    }
    return "";
  }
  uint64_t Submit(int b) {
    microd_wire_submit s{};
    microd_wire_header_init(&s.h, MICROD_MSG_SUBMIT, sizeof s);
    s.buffer_id = static_cast<uint32_t>(b);
    s.ticket = ++ticket_;
    send(fd_, &s, sizeof s, MSG_NOSIGNAL);
    return s.ticket;
  }
  std::string Read(microd_wire_completion* m) {
    timeval tv{120, 0};
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    const ssize_t n = recv(fd_, m, sizeof *m, 0);
    if (n != static_cast<ssize_t>(sizeof *m) || m->h.type != MICROD_MSG_COMPLETION) {
      return n == 0 ? "the daemon closed the connection" : "no completion within 120 s";
    }
    m->message[sizeof m->message - 1] = '\0';
    return "";
  }

  const std::string dir_;
  int fd_ = -1;
  uint64_t ticket_ = 0;
  std::vector<float*> data_;
};

int Trainer() {
  const std::string dir = absl::GetFlag(FLAGS_dir);
  const int node = absl::GetFlag(FLAGS_trainer_node);
  std::string error;
  if (node < 3) {
    error = ApiTrainer(dir, node, 0, nullptr);
  } else {
    // Node 3: the flooder releases its partner each step once its extra
    // SUBMITs were refused.
    std::mutex mu;
    std::condition_variable cv;
    long released = -1;
    std::atomic<bool> flooder_failed{false};
    long refused = 0;
    std::string partner_error;
    std::thread partner([&] {
      partner_error = ApiTrainer(dir, 3, 1, [&](long t) {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait_for(lock, std::chrono::seconds(120),
                    [&] { return released >= t || flooder_failed; });
      });
    });
    Flooder flooder(dir);
    error = flooder.Run(
        [&](long t) {
          std::lock_guard<std::mutex> lock(mu);
          released = t;
          cv.notify_all();
        },
        &refused);
    if (!error.empty()) {
      flooder_failed = true;
      cv.notify_all();
    }
    partner.join();
    if (error.empty()) error = partner_error;
    std::ofstream(dir + "/refused") << refused << "\n";
  }
  if (!error.empty()) {
    std::fprintf(stderr, "trainer of node %d: %s\n", node, error.c_str());
    return 3;
  }
  return 0;
}

// Resident memory (kB) and open descriptors of a process.
std::pair<long, long> Usage(pid_t pid) {
  long rss = 0;
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmRSS:", 0) == 0) rss = std::atol(line.c_str() + 6);
  }
  long fds = 0;
  if (DIR* d = opendir(absl::StrCat("/proc/", pid, "/fd").c_str())) {
    while (dirent* e = readdir(d)) fds += e->d_name[0] != '.';
    closedir(d);
  }
  return {rss, fds};
}

long MinProgress(const std::string& dir) {
  long least = -1;
  for (int p = 0; p < kWorld; ++p) {
    long t = 0;
    std::ifstream(absl::StrCat(dir, "/progress", p)) >> t;
    least = least < 0 ? t : std::min(least, t);
  }
  return least;
}

int Launcher(char* self) {
  std::string tmpl = "/tmp/microd-bench-soak-XXXXXX";
  const std::string dir = mkdtemp(tmpl.data());
  const std::string daemon = absl::GetFlag(FLAGS_daemon).empty()
                                 ? microd::bench::Sibling(self, "../daemon/microd")
                                 : absl::GetFlag(FLAGS_daemon);
  const long steps = absl::GetFlag(FLAGS_steps);
  std::vector<std::string> flags = {"--timeout_ms=120000", "--density=0.01"};
  for (absl::string_view f :
       absl::StrSplit(absl::GetFlag(FLAGS_daemon_flags), ',', absl::SkipEmpty())) {
    flags.emplace_back(f);
  }
  // Node 3 has two local processes.
  const std::vector<pid_t> daemons =
      microd::bench::StartDaemons(daemon, dir, kNodes, flags, [](int r) {
        return std::vector<std::string>{absl::StrCat("--local_size=", r == 3 ? 2 : 1)};
      });
  if (daemons.empty()) {
    std::fprintf(stderr, "microd-bench-soak: node 0 did not start (see %s)\n", dir.c_str());
    return 1;
  }
  std::vector<pid_t> trainers;
  for (int r = 0; r < kNodes; ++r) {
    trainers.push_back(microd::bench::Spawn(
        {self, absl::StrCat("--trainer_node=", r), "--dir=" + dir,
         absl::StrCat("--buckets=", absl::GetFlag(FLAGS_buckets)),
         absl::StrCat("--count=", absl::GetFlag(FLAGS_count)),
         absl::StrCat("--sparse_buckets=", absl::GetFlag(FLAGS_sparse_buckets)),
         absl::StrCat("--sparse_count=", absl::GetFlag(FLAGS_sparse_count)),
         absl::StrCat("--steps=", steps),
         absl::StrCat("--slow_every=", absl::GetFlag(FLAGS_slow_every)),
         absl::StrCat("--slow_ms=", absl::GetFlag(FLAGS_slow_ms)),
         absl::StrCat("--flood=", absl::GetFlag(FLAGS_flood))},
        absl::StrCat(dir, "/trainer", r, ".log")));
  }
  std::printf(
      "microd-bench-soak: %d daemons on loopback, %d processes (node 3: two, one flooding), "
      "%d buckets (%d sparse), %ld steps; logs in %s\n",
      kNodes, kWorld, absl::GetFlag(FLAGS_buckets), absl::GetFlag(FLAGS_sparse_buckets), steps,
      dir.c_str());
  std::fflush(stdout);
  // Samples: after the warm-up, and once every process finished its steps
  // (they keep their buffers registered until `done`).
  auto alive = [&] {
    for (pid_t p : trainers) {
      if (waitpid(p, nullptr, WNOHANG) != 0) return false;
    }
    return true;
  };
  std::vector<std::pair<long, long>> first, last;
  const auto start = std::chrono::steady_clock::now();
  const long warmup = std::min(absl::GetFlag(FLAGS_warmup), steps);
  double first_at = 0;
  while (alive() && MinProgress(dir) < steps) {
    if (first.empty() && MinProgress(dir) >= warmup) {
      for (pid_t d : daemons) first.push_back(Usage(d));
      first_at = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const bool finished = MinProgress(dir) >= steps;
  if (finished) {
    if (first.empty()) {
      for (pid_t d : daemons) first.push_back(Usage(d));
    }
    for (pid_t d : daemons) last.push_back(Usage(d));
  }
  std::ofstream(dir + "/done") << "1\n";
  bool ok = finished;
  for (pid_t p : trainers) ok = microd::bench::WaitFor(p, std::chrono::minutes(2)) && ok;
  for (pid_t d : daemons) kill(d, SIGTERM);
  for (pid_t d : daemons) microd::bench::WaitFor(d, std::chrono::seconds(20));
  // Every process saw the same sparse updates.
  bool same = finished;
  std::string reference;
  for (int p = 0; p < kWorld && finished; ++p) {
    std::stringstream ss;
    ss << std::ifstream(absl::StrCat(dir, "/hashes", p)).rdbuf();
    if (p == 0) reference = ss.str();
    same = same && ss.str() == reference && !reference.empty();
  }
  long refused = 0;
  std::ifstream(dir + "/refused") >> refused;
  std::printf("\n%ld steps in %.0f s (%.1f ms per step); job %s\n",
              finished ? steps : MinProgress(dir), seconds,
              1000 * seconds / std::max<long>(1, finished ? steps : MinProgress(dir)),
              ok ? "never failed" : "FAILED (see the trainer logs)");
  std::printf(
      "results: dense buckets exactly the average every step: %s; sparse updates identical on "
      "all %d processes: %s\n",
      ok ? "yes" : "no", kWorld, same ? "yes" : "no");
  std::printf("node 3's extra SUBMITs refused: %ld (of %ld sent)\n", refused,
              static_cast<long>(absl::GetFlag(FLAGS_flood)) * steps);
  if (finished) {
    std::printf(
        "\n%-6s %12s %12s %8s %10s %10s   target: growth < 5 %% (first sample at %.0f s, "
        "after %ld steps)\n",
        "daemon", "RSS first", "RSS last", "growth", "fds first", "fds last", first_at, warmup);
    bool met = true;
    for (int r = 0; r < kNodes; ++r) {
      const double growth = 100.0 * (last[r].first - first[r].first) / std::max(1L, first[r].first);
      met = met && growth < 5 && last[r].second <= first[r].second;
      std::printf("node %d %9ld kB %9ld kB %7.1f%% %10ld %10ld\n", r, first[r].first, last[r].first,
                  growth, first[r].second, last[r].second);
    }
    std::printf("target %s\n", met ? "met" : "MISSED");
  }
  return ok && same ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (absl::GetFlag(FLAGS_trainer_node) >= 0) return Trainer();
  return Launcher(argv[0]);
}
