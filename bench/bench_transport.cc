// SPDX-License-Identifier: Apache-2.0
// microd-bench-transport: n nodes as processes on loopback (default 4),
// coordinated over gRPC, d = 25,557,032 fp32: the MiCRO step over Gloo, the
// `topk` step over Gloo (with its build-up), and Gloo's own dense ring
// allreduce of the same buffer, all measured in one run. Prints time per step,
// payload bytes per node, the host's waits on the device per step (each a
// round trip on a GPU) and the ratios against the ring, writes JSON.
//
// --device=cuda (a CUDA build with NCCL): the device-resident step instead,
// the CUDA kernels over the NCCL transport with every buffer on the GPU, the
// ranks processes sharing GPU 0 (each its own NCCL "host", over loopback);
// the baseline is NCCL's dense allreduce of the same buffer.
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
#include <memory>
#include <sstream>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/bench_stats.h"
#include "daemon/common/log.h"
#include "daemon/control/coordinator.h"
#include "daemon/control/coordinator_client.h"
#include "daemon/control/services.h"
#include "daemon/sim/synthetic.h"
#include "daemon/sparsify/bucket.h"
#include "daemon/transport/gloo/gloo_transport.h"
#include "daemon/transport/gloo/store_adapter.h"
#include "daemon/transport/seal.h"
#include "microd/config.h"
#if MICROD_HAVE_NCCL
#include "daemon/transport/nccl/nccl_transport.h"
#include "kernels/cuda/cuda_ops.h"
#include "tests/transport/nccl_test_env.h"
#endif

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
ABSL_FLAG(bool, seal, false,
          "seal microd's data plane (keys of a fixed test secret): what sealing costs beside "
          "the same run's unsealed Gloo ring");
ABSL_FLAG(std::string, device, "cpu",
          "cpu: the CPU kernels over Gloo; cuda: the CUDA kernels over NCCL, buffers on GPU 0");
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
  double host_waits = 0;  // per step (StepStats::host_waits)
};

// A step's buffers in the kernels' memory (the GPU's with --device=cuda).
class StepBuffers {
 public:
  StepBuffers(microd::kernels::SparseOps* ops, uint64_t d) : ops_(ops), d_(d) {}
  ~StepBuffers() {
    for (float* p : owned_) ops_->Free(p);
  }
  // A buffer of d floats holding `host` (zeros when empty); nullptr when out of memory.
  float* Make(const std::vector<float>& host = {}) {
    auto* p = static_cast<float*>(ops_->Allocate(d_ * sizeof(float)));
    if (p == nullptr) return nullptr;
    owned_.push_back(p);
    if (!host.empty() && ops_->CopyToDevice(p, host.data(), d_ * sizeof(float), nullptr) !=
                             microd::kernels::KernelStatus::kOk) {
      return nullptr;
    }
    return p;
  }

 private:
  microd::kernels::SparseOps* const ops_;
  const uint64_t d_;
  std::vector<float*> owned_;
};

struct Backend {
  std::unique_ptr<microd::kernels::SparseOps> ops;
  std::unique_ptr<microd::transport::Transport> transport;
};

// The kernels and the transport --device asks for; prints why not on failure.
bool MakeBackend(int rank, int n, microd::rendezvous::KeyValueStore* store, Backend* b) {
  const std::string device = absl::GetFlag(FLAGS_device);
  if (device == "cpu") {
    microd::transport::GlooOptions go;
    go.rank = rank;
    go.size = n;
    go.store = store;
    go.timeout = absl::Seconds(300);
    go.io_nice = absl::GetFlag(FLAGS_gloo_io_nice);
    if (absl::GetFlag(FLAGS_seal)) {
      std::vector<std::string> salts(n);
      for (int p = 0; p < n; ++p) {
        if (p != rank) salts[p] = std::string(32, static_cast<char>('a' + std::min(p, rank)));
      }
      auto keys = microd::transport::SealKeys::Derive(rank, salts, "bench", "bench", 0);
      if (!keys.ok()) return false;
      go.seal = std::move(keys).value();
    }
    auto transport = microd::transport::CreateGlooTransport(go);
    if (!transport.ok()) {
      std::fprintf(stderr, "worker %d: %s\n", rank, transport.status().ToString().c_str());
      return false;
    }
    b->transport = std::move(transport).value();
    b->ops = microd::kernels::CreateCpuSparseOps();
    return true;
  }
#if MICROD_HAVE_NCCL
  if (device == "cuda") {
    std::string reason;
    b->ops = microd::kernels::CreateCudaSparseOps(0, &reason);
    if (b->ops == nullptr) {
      std::fprintf(stderr, "worker %d: no CUDA kernels: %s\n", rank, reason.c_str());
      return false;
    }
    microd::transport::NcclOptions no;
    no.rank = rank;
    no.size = n;
    no.store = store;
    no.prefix = "bench-nccl";
    no.timeout = absl::Seconds(300);
    auto transport = microd::transport::CreateNcclTransport(no);
    if (!transport.ok()) {
      std::fprintf(stderr, "worker %d: %s\n", rank, transport.status().ToString().c_str());
      return false;
    }
    b->transport = std::move(transport).value();
    return true;
  }
#endif
  std::fprintf(stderr, "worker %d: --device=%s is not one this build has (cpu%s)\n", rank,
               device.c_str(), MICROD_HAVE_NCCL ? ", cuda" : "");
  return false;
}

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
  const bool cuda = absl::GetFlag(FLAGS_device) == "cuda";
  Backend backend;
  if (!MakeBackend(rank, n, client->get(), &backend)) return 2;
  microd::transport::Transport& t = *backend.transport;
  microd::kernels::SparseOps* const ops = backend.ops.get();
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
  // Two training-like gradients, alternated (generating one costs more than a step).
  microd::sim::SyntheticOptions so;
  so.size = d;
  microd::sim::SyntheticGradients stream(so, rank);
  std::vector<float> h0(d), h1(d);
  stream.Next(h0.data());
  stream.Next(h1.data());
  StepBuffers buffers(ops, d);
  float* const g0 = buffers.Make(h0);
  float* const g1 = buffers.Make(h1);
  float* const update = buffers.Make();
  float* const e = buffers.Make();
  if (g0 == nullptr || g1 == nullptr || update == nullptr || e == nullptr) {
    std::fprintf(stderr, "worker %d: out of memory for 4 x %llu floats on %s\n", rank,
                 static_cast<unsigned long long>(d), ops->name());
    return 2;
  }
  std::vector<Result> results;
  microd::transport::CollectiveOptions barrier;
  barrier.tag = 1;

  for (double density : {0.01, 0.001}) {
    for (auto sp :
         {microd::sparsify::SparsifierKind::kMicro, microd::sparsify::SparsifierKind::kTopK}) {
      microd::sparsify::SparsifyOptions opts;
      opts.sparsifier = sp;
      opts.density = density;
      auto bucket = microd::sparsify::BucketState::Create({"bench", d, 2}, {n, rank, n}, opts, ops);
      if (!bucket.ok()) return 2;
      std::vector<double> times, bytes, selected, sel, exch, app, waits;
      const int warmup = absl::GetFlag(FLAGS_warmup), reps = absl::GetFlag(FLAGS_reps);
      for (int s = 0; s < warmup + reps; ++s) {
        barrier.deadline = absl::Now() + absl::Seconds(300);
        if (!t.Barrier(barrier).ok()) return 3;
        const auto t0 = Clock::now();
        auto st = (*bucket)->Step(s % 2 ? g1 : g0, update, t, absl::Now() + absl::Seconds(300));
        // On a GPU the step returns with its last kernels queued (the
        // update's scatter, the residual's zeroing): the time includes them.
        if (cuda && ops->Synchronize(nullptr) != microd::kernels::KernelStatus::kOk) return 3;
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
          waits.push_back(static_cast<double>(st->host_waits));
        }
      }
      results.push_back({sp == microd::sparsify::SparsifierKind::kMicro ? "micro (hist)" : "topk",
                         density, Median(times), Median(bytes), Median(selected), Median(sel),
                         Median(exch), Median(app), Median(waits)});
    }
  }
  // The local memory floor in this setting: `e += g` on every node at once
  // (the nodes share this machine's cores and memory bandwidth, or the GPU).
  {
    std::vector<double> floor_ms;
    for (int s = 0; s < absl::GetFlag(FLAGS_reps) + 1; ++s) {
      barrier.deadline = absl::Now() + absl::Seconds(300);
      if (!t.Barrier(barrier).ok()) return 3;
      const auto t0 = Clock::now();
      if (cuda) {
        const float* in[2] = {e, g0};
        if (ops->LocalSum(in, 2, d, e, nullptr, nullptr) != microd::kernels::KernelStatus::kOk ||
            ops->Synchronize(nullptr) != microd::kernels::KernelStatus::kOk) {
          return 3;
        }
      } else {
        AddInPlace(e, g0, d);
      }
      if (s > 0) {
        floor_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
      }
    }
    results.push_back({"e += g floor, all nodes at once", 0.0, Median(floor_ms), 0, 0});
  }
  // Baseline: the dense allreduce of the same buffer, Gloo's ring (a raw Gloo
  // context) or NCCL's (through the transport).
  std::unique_ptr<microd::transport::GlooStoreAdapter> store;
  std::shared_ptr<gloo::rendezvous::Context> ring;
  if (!cuda) {
    store = std::make_unique<microd::transport::GlooStoreAdapter>(client->get(), "ring",
                                                                  absl::Seconds(300));
    gloo::transport::tcp::attr attr;
    attr.hostname = "127.0.0.1";
    ring = std::make_shared<gloo::rendezvous::Context>(rank, n);
    ring->setTimeout(std::chrono::seconds(300));
    auto device = gloo::transport::tcp::CreateDevice(attr);
    ring->connectFullMesh(*store, device);
  }
  std::vector<double> ring_ms;
  for (int s = 0; s < absl::GetFlag(FLAGS_dense_reps) + 1; ++s) {
    if (ops->CopyFloats(update, g0, d, nullptr) != microd::kernels::KernelStatus::kOk) return 3;
    barrier.deadline = absl::Now() + absl::Seconds(300);
    if (!t.Barrier(barrier).ok()) return 3;
    const auto t0 = Clock::now();
    if (cuda) {
      microd::transport::CollectiveOptions o;
      o.tag = 7;
      o.deadline = absl::Now() + absl::Seconds(300);
      o.shape_agreed = true;  // NCCL's allreduce alone, without microd's descriptor round
      if (!t.AllreduceSum(update, d, microd::transport::DataType::kFloat32, o).ok()) return 3;
    } else {
      gloo::AllreduceOptions opts(ring);
      opts.setOutput(update, d);
      opts.setReduceFunction(
          static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<float>));
      opts.setAlgorithm(gloo::AllreduceOptions::Algorithm::RING);
      opts.setTag(7);
      gloo::allreduce(opts);
    }
    if (s > 0) {
      ring_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    }
  }
  // The same dense allreduce through microd's transport (its own device:
  // records, sealed with --seal), beside Gloo's ring over Gloo's TCP device.
  if (!cuda) {
    std::vector<double> ours_ms;
    for (int s = 0; s < absl::GetFlag(FLAGS_dense_reps) + 1; ++s) {
      if (ops->CopyFloats(update, g0, d, nullptr) != microd::kernels::KernelStatus::kOk) return 3;
      barrier.deadline = absl::Now() + absl::Seconds(300);
      if (!t.Barrier(barrier).ok()) return 3;
      const auto t0 = Clock::now();
      microd::transport::CollectiveOptions o;
      o.tag = 8;
      o.deadline = absl::Now() + absl::Seconds(300);
      if (!t.AllreduceSum(update, d, microd::transport::DataType::kFloat32, o).ok()) return 3;
      if (s > 0) {
        ours_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
      }
    }
    results.push_back({absl::GetFlag(FLAGS_seal) ? "dense allreduce (microd, sealed)"
                                                 : "dense allreduce (microd)",
                       1.0, Median(ours_ms), 4.0 * d, double(d)});
  }
  results.push_back({cuda ? "dense allreduce (nccl)" : "dense ring allreduce (gloo)", 1.0,
                     Median(ring_ms), 4.0 * d, double(d)});
  if (rank == 0) {
    std::ofstream out(absl::GetFlag(FLAGS_result));
    for (const Result& r : results) {
      out << r.method << "\t" << r.density << "\t" << r.ms << "\t" << r.bytes << "\t" << r.selected
          << "\t" << r.select_ms << "\t" << r.exchange_ms << "\t" << r.apply_ms << "\t"
          << r.host_waits << "\n";
    }
  }
  barrier.deadline = absl::Now() + absl::Seconds(60);
  (void)t.Barrier(barrier);
  (void)(*client)->Leave();
  return 0;
}

int Launcher(char* self) {
  const int n = absl::GetFlag(FLAGS_nodes);
  const bool cuda = absl::GetFlag(FLAGS_device) == "cuda";
  if (!cuda && absl::GetFlag(FLAGS_device) != "cpu") {
    std::fprintf(stderr, "microd-bench-transport: --device is cpu or cuda, not '%s'\n",
                 absl::GetFlag(FLAGS_device).c_str());
    return 2;
  }
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
        absl::StrCat("--gloo_io_nice=", absl::GetFlag(FLAGS_gloo_io_nice)),
        absl::StrCat("--seal=", absl::GetFlag(FLAGS_seal) ? "true" : "false"),
        absl::StrCat("--device=", absl::GetFlag(FLAGS_device))};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    // With --device=cuda every rank is its own NCCL "host" sharing GPU 0.
    std::vector<std::string> env;
#if MICROD_HAVE_NCCL
    if (cuda) env = microd::testing::NcclRankEnvironment(absl::StrCat("bench-", r));
#endif
    std::vector<char*> envp;
    for (auto& v : env) envp.push_back(v.data());
    envp.push_back(nullptr);
    pid_t pid;
    if (posix_spawn(&pid, self, nullptr, nullptr, argv.data(), cuda ? envp.data() : environ) != 0) {
      return 2;
    }
    pids.push_back(pid);
  }
  std::printf(
      "microd-bench-transport: %d nodes (processes) on loopback, d = %llu, %s\n", n,
      static_cast<unsigned long long>(d),
      cuda ? "CUDA kernels over NCCL on GPU 0 (device-resident step)" : "CPU kernels over Gloo");
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
    ls >> r.density >> r.ms >> r.bytes >> r.selected >> r.select_ms >> r.exchange_ms >>
        r.apply_ms >> r.host_waits;
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
  std::printf("%-28s %7s %9s %25s %13s %10s %6s %12s %8s\n", "method", "density", "ms/step",
              "select/exchange/apply ms", "bytes/node", "K", "host", "faster than", "fewer");
  std::printf("%-28s %7s %9s %25s %13s %10s %6s %12s %8s\n", "", "", "", "", "(payload)", "",
              "waits", "the dense", "bytes");
  std::string json = absl::StrFormat("{\"nodes\":%d,\"size\":%d,\"device\":\"%s\",\"results\":[", n,
                                     d, absl::GetFlag(FLAGS_device));
  for (size_t i = 0; i < rows.size(); ++i) {
    const Result& r = rows[i];
    const std::string split =
        r.select_ms + r.exchange_ms + r.apply_ms > 0
            ? absl::StrFormat("%.1f / %.1f / %.1f", r.select_ms, r.exchange_ms, r.apply_ms)
            : "";
    const bool step = !split.empty();  // a sparse step (the others: floor, dense)
    const std::string waits = step ? absl::StrFormat("%.0f", r.host_waits) : "";
    if (r.bytes == 0) {  // the local floor: no traffic
      std::printf("%-28s %7s %9.2f %25s %13s %10s %6s %11.1fx %8s\n", r.method.c_str(), "", r.ms,
                  "", "0", "", "", dense.ms / r.ms, "");
    } else {
      std::printf("%-28s %6.2g%% %9.2f %25s %13.0f %10.0f %6s %11.1fx %7.0fx\n", r.method.c_str(),
                  100 * r.density, r.ms, split.c_str(), r.bytes, r.selected, waits.c_str(),
                  dense.ms / r.ms, dense.bytes / r.bytes);
    }
    absl::StrAppendFormat(&json,
                          "%s{\"method\":\"%s\",\"density\":%g,\"ms_per_step\":%.3f,"
                          "\"payload_bytes_per_node\":%.0f,\"selected\":%.0f,"
                          "\"speedup_vs_dense_ring\":%.3f,\"bytes_ratio_vs_dense\":%.3f,"
                          "\"select_ms\":%.3f,\"exchange_ms\":%.3f,\"apply_ms\":%.3f,"
                          "\"host_waits_per_step\":%.0f}",
                          i ? "," : "", r.method, r.density, r.ms, r.bytes, r.selected,
                          dense.ms / r.ms, r.bytes > 0 ? dense.bytes / r.bytes : 0.0, r.select_ms,
                          r.exchange_ms, r.apply_ms, r.host_waits);
  }
  json += "]";
  if (absl::GetFlag(FLAGS_latency_iters) > 0) {
    std::printf("allreduce of %llu floats, back to back (%d): median %.0f us, p99 %.0f us\n",
                static_cast<unsigned long long>(kSmallElements), absl::GetFlag(FLAGS_latency_iters),
                small_median_us, small_p99_us);
    // What the debug-level lines each collective and step would write
    // (transport/, sparsify/) cost at the default level, where they are
    // off: the check alone, per line, beside the collective it follows.
    constexpr int kChecks = 100000000;
    const auto c0 = Clock::now();
    for (int i = 0; i < kChecks; ++i) {
      MICROD_LOG(Debug, "gloo %s tag %u: %zu bytes, %.3f ms", "AllreduceSum", 3u,
                 static_cast<size_t>(i), 0.0);
    }
    const double check_ns =
        std::chrono::duration<double, std::nano>(Clock::now() - c0).count() / kChecks;
    std::printf("a debug line, off (--log_level=info): %.2f ns, %.5f %% of that allreduce\n",
                check_ns, 100 * check_ns / (small_median_us * 1e3));
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
