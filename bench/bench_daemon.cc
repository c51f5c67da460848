// SPDX-License-Identifier: Apache-2.0
// microd-bench-daemon: 4 daemons on loopback with one training process each
// (written against the C API). (a) Round trip of a 1,024-element bucket
// through the whole path, submit to completion: median and p99. (b) A
// 25,557,032-element bucket at 0.1 %: time per step through the daemons,
// beside the raw MiCRO step over Gloo (microd-bench-transport) measured in
// the same run. Writes JSON.
//
// --compare_timeline: the cost of --timeline instead. Rounds of the same
// two measurements with the timeline off and on, alternating; the medians
// side by side, and what recording costs where it happens (the daemons'
// own count in the trace), against the round trip of (a).
//
// The program launches itself: the launcher starts the daemons and the
// client processes (--client_rank=r), which write their timings to files.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <sstream>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/bench_client.h"
#include "bench/bench_cluster.h"
#include "bench/bench_stats.h"
#include "daemon/sim/synthetic.h"
#include "microd/microd.h"

ABSL_FLAG(int, nodes, 4, "daemons (one training process each)");
ABSL_FLAG(uint64_t, size, 25557032, "large bucket size (fp32 elements)");
ABSL_FLAG(int, latency_iters, 1000, "round trips of the small bucket");
ABSL_FLAG(int, warmup, 3, "warm-up steps of the large bucket");
ABSL_FLAG(int, reps, 5, "timed steps of the large bucket");
ABSL_FLAG(std::string, json, "", "write results as JSON to this file");
ABSL_FLAG(std::vector<std::string>, daemon_flags, {},
          "more microd flags, comma-separated (e.g. --daemon_flags=--response_cache=false)");
ABSL_FLAG(int, gloo_io_nice, 0,
          "nice value for Gloo's network thread, in the daemons and in the transport-alone run "
          "(microd --gloo_io_nice; helps where the processes outnumber the cores)");
ABSL_FLAG(std::string, daemon, "", "microd binary (default: next to this one)");
ABSL_FLAG(std::string, transport_bench, "",
          "microd-bench-transport binary (default: next to this)");
ABSL_FLAG(bool, compare_timeline, false,
          "measure the cost of --timeline: (a) and (b) with it off and on, alternating");
ABSL_FLAG(int, rounds, 3, "with --compare_timeline: rounds of off and on");
// Client mode (set by the launcher).
ABSL_FLAG(int, client_rank, -1, "internal: run as the client of this node");
ABSL_FLAG(std::string, socket, "", "internal: daemon socket");
ABSL_FLAG(std::string, result, "", "internal: where to write timings");

namespace {

using Clock = std::chrono::steady_clock;

using microd::bench::Percentile;
using microd::bench::Sibling;
using microd::bench::SocketOf;
using microd::bench::Spawn;
using microd::bench::StartDaemons;
using microd::bench::WaitFor;

int Client() {
  const uint64_t d = absl::GetFlag(FLAGS_size);
  microd::bench::BenchClient bc;
  if (!microd::bench::ConnectWithBuckets(absl::GetFlag(FLAGS_socket), "client", 1024, d, &bc)) {
    return 2;
  }
  microd_client* const c = bc.client;
  float* const small = bc.small;
  float* const big = bc.big;
  const int32_t small_id = bc.small_id, big_id = bc.big_id;
  std::vector<double> latency_us;
  for (int i = 0; i < absl::GetFlag(FLAGS_latency_iters) + 20; ++i) {
    for (int j = 0; j < 1024; ++j) small[j] = static_cast<float>(j);
    const auto t0 = Clock::now();
    if (microd_allreduce(c, small_id, 60000) != MICROD_OK) {
      std::fprintf(stderr, "client: %s\n", microd_last_error(c));
      return 3;
    }
    if (i >= 20) {
      latency_us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
  }
  microd::sim::SyntheticOptions so;
  so.size = d;
  microd::sim::SyntheticGradients stream(so, absl::GetFlag(FLAGS_client_rank));
  std::vector<float> g0(d), g1(d);
  stream.Next(g0.data());
  stream.Next(g1.data());
  std::vector<double> step_ms;
  for (int s = 0; s < absl::GetFlag(FLAGS_warmup) + absl::GetFlag(FLAGS_reps); ++s) {
    std::copy((s % 2 ? g1 : g0).begin(), (s % 2 ? g1 : g0).end(), big);
    // Line the processes up with a small-bucket round trip before timing.
    if (microd_allreduce(c, small_id, 60000) != MICROD_OK) return 3;
    const auto t0 = Clock::now();
    if (microd_allreduce(c, big_id, 120000) != MICROD_OK) {
      std::fprintf(stderr, "client: %s\n", microd_last_error(c));
      return 3;
    }
    if (s >= absl::GetFlag(FLAGS_warmup)) {
      step_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    }
  }
  std::ofstream out(absl::GetFlag(FLAGS_result));
  out << Percentile(latency_us, 0.5) << " " << Percentile(latency_us, 0.99) << " "
      << Percentile(step_ms, 0.5) << "\n";
  microd_close(c);
  return 0;
}

struct Measured {
  double p50_us = 0, p99_us = 0, step_ms = 0;
};

// One run in a new directory under `dir`: the daemons (with `extra` flags
// and `per_node(r)`), one client each; node 0's client's figures.
bool RunOnce(char* self, const std::string& dir, const std::vector<std::string>& extra,
             const std::function<std::vector<std::string>(int)>& per_node, Measured* m) {
  const int n = absl::GetFlag(FLAGS_nodes);
  const uint64_t d = absl::GetFlag(FLAGS_size);
  const std::string daemon = absl::GetFlag(FLAGS_daemon).empty() ? Sibling(self, "../daemon/microd")
                                                                 : absl::GetFlag(FLAGS_daemon);
  std::vector<pid_t> clients;
  const std::vector<pid_t> daemons = [&] {
    std::vector<std::string> flags = {
        "--density=0.001", "--remedies=off", "--timeout_ms=120000",
        absl::StrCat("--gloo_io_nice=", absl::GetFlag(FLAGS_gloo_io_nice))};
    for (const std::string& f : absl::GetFlag(FLAGS_daemon_flags)) flags.push_back(f);
    for (const std::string& f : extra) flags.push_back(f);
    return StartDaemons(daemon, dir, n, flags, per_node);
  }();
  if (daemons.empty()) {
    std::fprintf(stderr, "microd-bench-daemon: node 0 did not start (see %s)\n", dir.c_str());
    return false;
  }
  for (int r = 0; r < n; ++r) {
    clients.push_back(
        Spawn({self, absl::StrCat("--client_rank=", r), absl::StrCat("--socket=", SocketOf(dir, r)),
               absl::StrCat("--result=", dir, "/client", r), absl::StrCat("--size=", d),
               absl::StrCat("--latency_iters=", absl::GetFlag(FLAGS_latency_iters)),
               absl::StrCat("--warmup=", absl::GetFlag(FLAGS_warmup)),
               absl::StrCat("--reps=", absl::GetFlag(FLAGS_reps))},
              absl::StrCat(dir, "/client", r, ".log")));
  }
  bool ok = true;
  for (pid_t p : clients) ok = WaitFor(p, std::chrono::minutes(8)) && ok;
  for (pid_t p : daemons) kill(p, SIGTERM);
  for (pid_t p : daemons) WaitFor(p, std::chrono::seconds(20));
  if (!ok) {
    std::fprintf(stderr, "microd-bench-daemon: a client failed (see %s)\n", dir.c_str());
    return false;
  }
  std::ifstream(dir + "/client0") >> m->p50_us >> m->p99_us >> m->step_ms;
  return true;
}

double Median(std::vector<double> v) { return Percentile(v, 0.5); }

// The number after `key` in the file at `path` (0 when absent).
double NumberIn(const std::string& path, const std::string& key) {
  std::stringstream ss;
  ss << std::ifstream(path).rdbuf();
  const std::string s = ss.str();
  const size_t at = s.find(key);
  return at == std::string::npos ? 0.0 : std::atof(s.c_str() + at + key.size());
}

int CompareTimeline(char* self, const std::string& dir) {
  const int n = absl::GetFlag(FLAGS_nodes), rounds = absl::GetFlag(FLAGS_rounds);
  std::vector<double> p50[2], step[2], record_ns;
  std::printf(
      "microd-bench-daemon: the cost of --timeline, %d daemons x 1 process on loopback, "
      "%d rounds off/on (logs in %s)\n",
      n, rounds, dir.c_str());
  for (int round = 0; round < rounds; ++round) {
    for (int on = 0; on < 2; ++on) {
      const std::string run = absl::StrCat(dir, "/round", round, on ? "-on" : "-off");
      mkdir(run.c_str(), 0700);
      auto per_node = [&](int r) {
        return on ? std::vector<std::string>{absl::StrCat("--timeline=", run, "/timeline", r,
                                                          ".json")}
                  : std::vector<std::string>{};
      };
      Measured m;
      if (!RunOnce(self, run, {}, per_node, &m)) return 1;
      p50[on].push_back(m.p50_us);
      step[on].push_back(m.step_ms);
      if (on) record_ns.push_back(NumberIn(run + "/timeline0.json", "\"record_ns_per_step\":"));
      std::printf("  round %d, timeline %-3s  (a) median %6.0f us  (b) %7.1f ms\n", round,
                  on ? "on" : "off", m.p50_us, m.step_ms);
    }
  }
  const double a0 = Median(p50[0]), a1 = Median(p50[1]), b0 = Median(step[0]), b1 = Median(step[1]),
               rec = Median(record_ns);
  std::printf(
      "\n(a) 1,024-element round trip, median of rounds: off %6.0f us, on %6.0f us (%+.1f %%)\n",
      a0, a1, 100 * (a1 / a0 - 1));
  std::printf("(b) %llu-element step at 0.1 %%:        off %6.1f ms, on %6.1f ms (%+.1f %%)\n",
              static_cast<unsigned long long>(absl::GetFlag(FLAGS_size)), b0, b1,
              100 * (b1 / b0 - 1));
  std::printf(
      "recording, timed in the daemon: %.0f ns per bucket step = %.3f %% of (a)'s round "
      "trip   target <= 1 %%\n",
      rec, 100 * rec / (a0 * 1000));
  if (const std::string path = absl::GetFlag(FLAGS_json); !path.empty()) {
    std::ofstream(path) << absl::StrFormat(
        "{\"nodes\":%d,\"rounds\":%d,\"latency_1024_median_us_off\":%.1f,"
        "\"latency_1024_median_us_on\":%.1f,\"size\":%d,\"step_ms_off\":%.3f,"
        "\"step_ms_on\":%.3f,\"record_ns_per_step\":%.1f}\n",
        n, rounds, a0, a1, absl::GetFlag(FLAGS_size), b0, b1, rec);
    std::printf("JSON: %s\n", path.c_str());
  }
  return 0;
}

int Launcher(char* self) {
  const int n = absl::GetFlag(FLAGS_nodes);
  const uint64_t d = absl::GetFlag(FLAGS_size);
  std::string tmpl = "/tmp/microd-bench-daemon-XXXXXX";
  const std::string dir = mkdtemp(tmpl.data());
  if (absl::GetFlag(FLAGS_compare_timeline)) return CompareTimeline(self, dir);
  std::printf(
      "microd-bench-daemon: %d daemons x 1 process on loopback, gloo_io_nice %d (logs in %s)\n", n,
      absl::GetFlag(FLAGS_gloo_io_nice), dir.c_str());
  Measured m;
  if (!RunOnce(self, dir, {}, nullptr, &m)) return 1;
  const double p50 = m.p50_us, p99 = m.p99_us, step = m.step_ms;

  // The raw transport step, same machine, same run.
  const std::string tb = absl::GetFlag(FLAGS_transport_bench).empty()
                             ? Sibling(self, "microd-bench-transport")
                             : absl::GetFlag(FLAGS_transport_bench);
  const std::string tjson = dir + "/transport.json";
  const pid_t t =
      Spawn({tb, absl::StrCat("--nodes=", n), absl::StrCat("--size=", d),
             absl::StrCat("--reps=", absl::GetFlag(FLAGS_reps)),
             absl::StrCat("--warmup=", absl::GetFlag(FLAGS_warmup)),
             absl::StrCat("--latency_iters=", absl::GetFlag(FLAGS_latency_iters)),
             absl::StrCat("--gloo_io_nice=", absl::GetFlag(FLAGS_gloo_io_nice)), "--json=" + tjson},
            dir + "/transport.log");
  double raw = 0, alone_p50 = 0, alone_p99 = 0;
  if (WaitFor(t, std::chrono::minutes(9))) {
    std::stringstream ss;
    ss << std::ifstream(tjson).rdbuf();
    const std::string js = ss.str();
    // The value after `key` at or after `from` (0 when absent).
    auto number = [&js](size_t from, const std::string& key) {
      const size_t at = from == std::string::npos ? from : js.find(key, from);
      return at == std::string::npos ? 0.0 : std::stod(js.substr(at + key.size()));
    };
    // The "micro (hist)" entry at density 0.001.
    raw = number(js.find("\"method\":\"micro (hist)\",\"density\":0.001"), "\"ms_per_step\":");
    const size_t small = js.find("\"small_allreduce\":");
    alone_p50 = number(small, "\"median_us\":");
    alone_p99 = number(small, "\"p99_us\":");
  }
  std::printf("\n(a) 1,024-element bucket, submit to completion (%d round trips)\n",
              absl::GetFlag(FLAGS_latency_iters));
  std::printf("    through the daemons  median %8.0f us   p99 %8.0f us   target median <= 200 us\n",
              p50, p99);
  if (alone_p50 > 0) {
    std::printf(
        "    transport alone      median %8.0f us   p99 %8.0f us   (back-to-back allreduces "
        "of the same 1,024 floats over microd's Gloo transport, no daemon)\n",
        alone_p50, alone_p99);
  }
  std::printf("(b) %llu elements at 0.1 %%, time per step\n", static_cast<unsigned long long>(d));
  std::printf("    through the daemons %8.1f ms\n", step);
  if (raw > 0) {
    std::printf("    raw MiCRO step      %8.1f ms   overhead %+.0f %%   target <= 10 %%\n", raw,
                100 * (step / raw - 1));
  } else {
    std::printf("    raw MiCRO step: microd-bench-transport failed (see %s)\n", dir.c_str());
  }
  if (const std::string path = absl::GetFlag(FLAGS_json); !path.empty()) {
    std::ofstream(path) << absl::StrFormat(
        "{\"nodes\":%d,\"gloo_io_nice\":%d,\"latency_1024_median_us\":%.1f,\"latency_1024_p99_us\":"
        "%.1f,"
        "\"transport_1024_median_us\":%.1f,\"transport_1024_p99_us\":%.1f,"
        "\"size\":%d,\"daemon_step_ms\":%.3f,\"raw_step_ms\":%.3f,\"overhead\":%.4f}\n",
        n, absl::GetFlag(FLAGS_gloo_io_nice), p50, p99, alone_p50, alone_p99, d, step, raw,
        raw > 0 ? step / raw - 1 : 0.0);
    std::printf("JSON: %s\n", path.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (absl::GetFlag(FLAGS_client_rank) >= 0) return Client();
  return Launcher(argv[0]);
}
