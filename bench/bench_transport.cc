// microd-bench-transport: n nodes as processes on loopback (default 4),
// coordinated over gRPC, d = 25,557,032 fp32: the MiCRO step over Gloo, the
// `topk` step over Gloo (with its build-up), and Gloo's own dense ring
// allreduce of the same buffer, all measured in one run. Prints time per step,
// payload bytes per node and the ratios against the ring, writes JSON.
//
// The program launches itself: without --worker_rank it starts the
// coordinator and n workers (--worker_rank=r), then reads rank 0's results.
#include <gloo/allreduce.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/transport/tcp/device.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/bench_stats.h"
#include "daemon/control/coordinator.h"
#include "daemon/control/coordinator_client.h"
#include "daemon/control/services.h"
#include "daemon/sim/synthetic.h"
#include "daemon/sparsify/bucket.h"
#include "daemon/transport/gloo/gloo_transport.h"
#include "daemon/transport/gloo/store_adapter.h"

extern char** environ;

ABSL_FLAG(int, nodes, 4, "nodes (processes)");
ABSL_FLAG(uint64_t, size, 25557032, "bucket size d (fp32 elements)");
ABSL_FLAG(int, warmup, 3, "warm-up steps per sparse method");
ABSL_FLAG(int, reps, 5, "timed steps per sparse method");
ABSL_FLAG(int, dense_reps, 3, "timed dense allreduces");
ABSL_FLAG(int, latency_iters, 0,
          "also time this many back-to-back allreduces of 1,024 floats through microd's Gloo "
          "transport (what a small bucket's exchange costs without the daemons)");
ABSL_FLAG(std::string, json, "", "write results as JSON to this file");
ABSL_FLAG(int, gloo_io_nice, 0, "nice value for Gloo's network thread (as microd --gloo_io_nice)");
// Worker mode (set by the launcher).
ABSL_FLAG(int, worker_rank, -1, "internal: run as worker with this rank");
ABSL_FLAG(std::string, coordinator, "", "internal: coordinator address");
ABSL_FLAG(std::string, result, "", "internal: where rank 0 writes its results");

namespace {

using Clock = std::chrono::steady_clock;

using microd::bench::Median;
using microd::bench::Percentile;

constexpr uint64_t kSmallElements = 1024;

__attribute__((target("avx2"), noinline)) void AddInPlace(float* e, const float* g, uint64_t n) {
  for (uint64_t i = 0; i < n; ++i) e[i] += g[i];
}

struct Result {
  std::string method;
  double density = 0;
  double ms = 0;
  double bytes = 0;
  double selected = 0;
  double select_ms = 0, exchange_ms = 0, apply_ms = 0;
};

int Worker() {
  const int rank = absl::GetFlag(FLAGS_worker_rank);
  const uint64_t d = absl::GetFlag(FLAGS_size);
  microd::control::CoordinatorClientOptions co;
  co.address = absl::GetFlag(FLAGS_coordinator);
  co.job_id = "bench";
  co.node_name = absl::StrCat("bench", rank);
  co.requested_rank = rank;
  auto client = microd::control::CoordinatorClient::Create(co);
  if (!client.ok()) return 2;
  auto m = (*client)->Join(absl::Now() + absl::Seconds(60));
  if (!m.ok()) {
    std::fprintf(stderr, "worker %d: %s\n", rank, m.status().ToString().c_str());
    return 2;
  }
  const int n = m->node_count;
  microd::transport::GlooOptions go;
  go.rank = rank;
  go.size = n;
  go.store = client->get();
  go.timeout = absl::Seconds(300);
  go.io_nice = absl::GetFlag(FLAGS_gloo_io_nice);
  auto transport = microd::transport::CreateGlooTransport(go);
  if (!transport.ok()) {
    std::fprintf(stderr, "worker %d: %s\n", rank, transport.status().ToString().c_str());
    return 2;
  }
  microd::transport::Transport& t = **transport;
  // Small-bucket latency: what one allreduce of 1,024 floats costs on this
  // transport, back to back as a training loop would submit them.
  if (const int iters = absl::GetFlag(FLAGS_latency_iters); iters > 0) {
    std::vector<float> small(kSmallElements, 1.0f);
    std::vector<double> us;
    microd::transport::CollectiveOptions o;
    o.tag = 3;
    for (int i = 0; i < iters + 10; ++i) {  // 10 warm-up rounds
      o.deadline = absl::Now() + absl::Seconds(60);
      const auto t0 = Clock::now();
      if (!t.AllreduceSum(small.data(), kSmallElements, microd::transport::DataType::kFloat32, o)
               .ok()) {
        return 3;
      }
      if (i >= 10) {
        us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
      }
    }
    if (rank == 0) {
      std::ofstream(absl::GetFlag(FLAGS_result) + ".latency")
          << Percentile(us, 0.5) << " " << Percentile(us, 0.99) << "\n";
    }
  }
  // A raw Gloo context for the baseline ring allreduce.
  microd::transport::GlooStoreAdapter store(client->get(), "ring", absl::Seconds(300));
  gloo::transport::tcp::attr attr;
  attr.hostname = "127.0.0.1";
  auto ring = std::make_shared<gloo::rendezvous::Context>(rank, n);
  ring->setTimeout(std::chrono::seconds(300));
  auto device = gloo::transport::tcp::CreateDevice(attr);
  ring->connectFullMesh(store, device);

  // Two training-like gradients, alternated (generating one costs more than a step).
  microd::sim::SyntheticOptions so;
  so.size = d;
  microd::sim::SyntheticGradients stream(so, rank);
  std::vector<float> g0(d), g1(d), update(d);
  stream.Next(g0.data());
  stream.Next(g1.data());
  auto ops = microd::kernels::CreateCpuSparseOps();
  std::vector<Result> results;
  microd::transport::CollectiveOptions barrier;
  barrier.tag = 1;

  for (double density : {0.01, 0.001}) {
    for (auto sp : {microd::sparsify::SparsifierKind::kMicro, microd::sparsify::SparsifierKind::kTopK}) {
      microd::sparsify::SparsifyOptions opts;
      opts.sparsifier = sp;
      opts.density = density;
      auto bucket = microd::sparsify::BucketState::Create({"bench", d, 2}, {n, rank, n}, opts,
                                                         ops.get());
      if (!bucket.ok()) return 2;
      std::vector<double> times, bytes, selected, sel, exch, app;
      const int warmup = absl::GetFlag(FLAGS_warmup), reps = absl::GetFlag(FLAGS_reps);
      for (int s = 0; s < warmup + reps; ++s) {
        barrier.deadline = absl::Now() + absl::Seconds(300);
        if (!t.Barrier(barrier).ok()) return 3;
        const auto t0 = Clock::now();
        auto st = (*bucket)->Step(s % 2 ? g1.data() : g0.data(), update.data(), t,
                                  absl::Now() + absl::Seconds(300));
        const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
        if (!st.ok()) {
          std::fprintf(stderr, "worker %d: %s\n", rank, st.status().ToString().c_str());
          return 3;
        }
        if (s >= warmup) {
          times.push_back(ms);
          bytes.push_back(static_cast<double>(st->bytes_sent));
          selected.push_back(static_cast<double>(st->selected));
          sel.push_back(1e3 * st->select_seconds);
          exch.push_back(1e3 * st->exchange_seconds);
          app.push_back(1e3 * st->apply_seconds);
        }
      }
      results.push_back({sp == microd::sparsify::SparsifierKind::kMicro ? "micro (hist)" : "topk",
                         density, Median(times), Median(bytes), Median(selected), Median(sel),
                         Median(exch), Median(app)});
    }
  }
  // The local memory floor in this setting: `e += g` on every node at once
  // (the nodes share this machine's cores and memory bandwidth).
  {
    std::vector<float> e(d, 0.0f);
    std::vector<double> floor_ms;
    for (int s = 0; s < absl::GetFlag(FLAGS_reps) + 1; ++s) {
      barrier.deadline = absl::Now() + absl::Seconds(300);
      if (!t.Barrier(barrier).ok()) return 3;
      const auto t0 = Clock::now();
      AddInPlace(e.data(), g0.data(), d);
      if (s > 0) {
        floor_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
      }
    }
    results.push_back({"e += g floor, all nodes at once", 0.0, Median(floor_ms), 0, 0});
  }
  // Baseline: Gloo's dense ring allreduce of the same buffer.
  std::vector<double> ring_ms;
  for (int s = 0; s < absl::GetFlag(FLAGS_dense_reps) + 1; ++s) {
    std::copy(g0.begin(), g0.end(), update.begin());
    barrier.deadline = absl::Now() + absl::Seconds(300);
    if (!t.Barrier(barrier).ok()) return 3;
    const auto t0 = Clock::now();
    gloo::AllreduceOptions opts(ring);
    opts.setOutput(update.data(), d);
    opts.setReduceFunction(
        static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<float>));
    opts.setAlgorithm(gloo::AllreduceOptions::Algorithm::RING);
    opts.setTag(7);
    gloo::allreduce(opts);
    if (s > 0) {
      ring_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    }
  }
  results.push_back({"dense ring allreduce (gloo)", 1.0, Median(ring_ms), 4.0 * d, double(d)});
  if (rank == 0) {
    std::ofstream out(absl::GetFlag(FLAGS_result));
    for (const Result& r : results) {
      out << r.method << "\t" << r.density << "\t" << r.ms << "\t" << r.bytes << "\t" << r.selected
          << "\t" << r.select_ms << "\t" << r.exchange_ms << "\t" << r.apply_ms << "\n";
    }
  }
  barrier.deadline = absl::Now() + absl::Seconds(60);
  (void)t.Barrier(barrier);
  (void)(*client)->Leave();
  return 0;
}

int Launcher(char* self) {
  const int n = absl::GetFlag(FLAGS_nodes);
  const uint64_t d = absl::GetFlag(FLAGS_size);
  microd::control::CoordinatorOptions o;
  o.job_id = "bench";
  o.expected_nodes = n;
  o.peer_timeout = absl::Seconds(60);
  auto coordinator = microd::control::Coordinator::Create(o);
  if (!coordinator.ok()) return 2;
  microd::control::CoordinatorService service(coordinator->get());
  auto server = microd::control::ControlServer::Start("127.0.0.1:0", {&service});
  if (!server.ok()) return 2;
  const std::string result = absl::StrCat("/tmp/microd-bench-transport-", getpid());
  std::vector<pid_t> pids;
  std::vector<std::string> keep;
  for (int r = 0; r < n; ++r) {
    std::vector<std::string> args = {
        self,
        absl::StrCat("--worker_rank=", r),
        absl::StrCat("--coordinator=", (*server)->address()),
        absl::StrCat("--result=", result),
        absl::StrCat("--size=", d),
        absl::StrCat("--warmup=", absl::GetFlag(FLAGS_warmup)),
        absl::StrCat("--reps=", absl::GetFlag(FLAGS_reps)),
        absl::StrCat("--dense_reps=", absl::GetFlag(FLAGS_dense_reps)),
        absl::StrCat("--latency_iters=", absl::GetFlag(FLAGS_latency_iters)),
        absl::StrCat("--gloo_io_nice=", absl::GetFlag(FLAGS_gloo_io_nice))};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid;
    if (posix_spawn(&pid, self, nullptr, nullptr, argv.data(), environ) != 0) return 2;
    pids.push_back(pid);
  }
  std::printf("microd-bench-transport: %d nodes (processes) on loopback, d = %llu\n", n,
              static_cast<unsigned long long>(d));
  int failed = 0;
  const auto deadline = Clock::now() + std::chrono::minutes(9);
  for (pid_t pid : pids) {
    int status = 0;
    while (waitpid(pid, &status, WNOHANG) == 0) {
      if (Clock::now() > deadline) {
        for (pid_t p : pids) kill(p, SIGKILL);
        std::fprintf(stderr, "microd-bench-transport: workers did not finish in time\n");
        return 1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    failed += !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  if (failed) {
    std::fprintf(stderr, "microd-bench-transport: %d workers failed\n", failed);
    return 1;
  }
  std::ifstream in(result);
  std::vector<Result> rows;
  for (std::string line; std::getline(in, line);) {
    std::istringstream ls(line);
    Result r;
    std::getline(ls, r.method, '\t');
    ls >> r.density >> r.ms >> r.bytes >> r.selected >> r.select_ms >> r.exchange_ms >> r.apply_ms;
    rows.push_back(r);
  }
  std::remove(result.c_str());
  if (rows.empty()) return 1;
  double small_median_us = 0, small_p99_us = 0;
  if (absl::GetFlag(FLAGS_latency_iters) > 0) {
    std::ifstream lat(result + ".latency");
    if (!(lat >> small_median_us >> small_p99_us)) return 1;
    std::remove((result + ".latency").c_str());
  }
  const Result& dense = rows.back();
  std::printf("%-28s %7s %9s %25s %13s %10s %12s %8s\n", "method", "density", "ms/step",
              "select/exchange/apply ms", "bytes/node", "K", "faster than", "fewer");
  std::printf("%-28s %7s %9s %25s %13s %10s %12s %8s\n", "", "", "", "", "(payload)", "",
              "dense ring", "bytes");
  std::string json = absl::StrFormat("{\"nodes\":%d,\"size\":%d,\"results\":[", n, d);
  for (size_t i = 0; i < rows.size(); ++i) {
    const Result& r = rows[i];
    const std::string split =
        r.select_ms + r.exchange_ms + r.apply_ms > 0
            ? absl::StrFormat("%.1f / %.1f / %.1f", r.select_ms, r.exchange_ms, r.apply_ms)
            : "";
    if (r.bytes == 0) {  // the local floor: no traffic
      std::printf("%-28s %7s %9.2f %25s %13s %10s %11.1fx %8s\n", r.method.c_str(), "", r.ms, "",
                  "0", "", dense.ms / r.ms, "");
    } else {
      std::printf("%-28s %6.2g%% %9.2f %25s %13.0f %10.0f %11.1fx %7.0fx\n", r.method.c_str(),
                  100 * r.density, r.ms, split.c_str(), r.bytes, r.selected, dense.ms / r.ms,
                  dense.bytes / r.bytes);
    }
    absl::StrAppendFormat(&json,
                          "%s{\"method\":\"%s\",\"density\":%g,\"ms_per_step\":%.3f,"
                          "\"payload_bytes_per_node\":%.0f,\"selected\":%.0f,"
                          "\"speedup_vs_dense_ring\":%.3f,\"bytes_ratio_vs_dense\":%.3f,"
                          "\"select_ms\":%.3f,\"exchange_ms\":%.3f,\"apply_ms\":%.3f}",
                          i ? "," : "", r.method, r.density, r.ms, r.bytes, r.selected,
                          dense.ms / r.ms, r.bytes > 0 ? dense.bytes / r.bytes : 0.0,
                          r.select_ms, r.exchange_ms,
                          r.apply_ms);
  }
  json += "]";
  if (absl::GetFlag(FLAGS_latency_iters) > 0) {
    std::printf("allreduce of %llu floats, back to back (%d): median %.0f us, p99 %.0f us\n",
                static_cast<unsigned long long>(kSmallElements), absl::GetFlag(FLAGS_latency_iters),
                small_median_us, small_p99_us);
    absl::StrAppendFormat(&json,
                          ",\"small_allreduce\":{\"elements\":%d,\"iterations\":%d,"
                          "\"median_us\":%.1f,\"p99_us\":%.1f}",
                          kSmallElements, absl::GetFlag(FLAGS_latency_iters), small_median_us,
                          small_p99_us);
  }
  json += "}\n";
  std::printf("target at 0.1%%: micro >= 25x faster than the dense ring allreduce\n");
  if (const std::string path = absl::GetFlag(FLAGS_json); !path.empty()) {
    std::ofstream(path) << json;
    std::printf("JSON: %s\n", path.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (absl::GetFlag(FLAGS_worker_rank) >= 0) return Worker();
  return Launcher(argv[0]);
}
