// SPDX-License-Identifier: Apache-2.0
// A local cluster of microd daemons for the end-to-end tests, with training
// processes started from a test client program, and the reference the
// processes' results are compared with. The including test defines
// MICROD_DAEMON (the microd binary) and MICROD_TEST_CLIENT (the client
// program: socket buckets steps out die_at timeout_ms local_rank [extra...],
// writing "step bucket hash" lines).
#pragma once

#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "daemon/sparsify/bucket.h"
#include "daemon/transport/inproc/inproc_transport.h"
#include "gtest/gtest.h"
#include "kernels/sparse_ops.h"
#include "microd/v1/admin.grpc.pb.h"
#include "tests/helper_path.h"
#include "tests/integration/netlab.h"
#include "tests/integration/process_util.h"
extern "C" {
#include "tests/integration/e2e_grad.h"
}

namespace microd::testing {

constexpr uint64_t kDenseFloor = 65536;

struct BucketSpec {
  std::string name;
  uint64_t count;
};

inline std::string SpecString(const std::vector<BucketSpec>& buckets) {
  std::vector<std::string> parts;
  for (const auto& b : buckets) parts.push_back(absl::StrCat(b.name, ":", b.count));
  return absl::StrJoin(parts, ",");
}

struct ClusterOptions {
  std::vector<std::string> extra;  // more daemon flags
  // Environment entries (NAME=VALUE) for node r's daemon.
  std::function<std::vector<std::string>(int)> env;
  // Every node (its daemon and its training processes) in its namespace of
  // this lab; node 0's coordinator on node 0's own address, the Admin
  // services on Unix sockets (reachable from the test's namespace).
  NetLab* lab = nullptr;
  // Node 0's --coordinator_listen host (default: the lab's node 0 address,
  // or loopback); the others still dial node 0's address.
  std::string coordinator_listen_host;
  int peer_timeout_ms = 3000;
  // A job token for every node (a coordinator other hosts reach needs TLS
  // or one): on by default in a lab, where node 0 listens on its address.
  std::optional<bool> token;
  // A daemon of its own serves the coordinator (--coordinator_only, on
  // loopback); every node dials it, node 0 too.
  bool coordinator_only = false;
};

class DaemonCluster {
 public:
  DaemonCluster(int nodes, int local, std::vector<std::string> extra = {},
                const std::function<std::vector<std::string>(int)>& env = nullptr)
      : DaemonCluster(nodes, local, ClusterOptions{std::move(extra), env}) {}

  DaemonCluster(int nodes, int local, const ClusterOptions& o)
      : n_(nodes), L_(local), dir_(MakeTempDir("e2e")), lab_(o.lab), options_(o) {
    if (o.token.value_or(lab_ != nullptr)) {
      std::ofstream(dir_ + "/token") << "the job's token " << dir_ << "\n";
    }
    if (o.coordinator_only) SpawnCoordinator();
    for (int r = 0; r < nodes; ++r) SpawnDaemon(r, r);
  }
  // Starts one more daemon, node `r` of this cluster (its socket, logs and
  // outputs), which dials the running job's coordinator and takes any rank
  // (a replacement, or a node that joins an elastic job). `r` is the next
  // node not started yet; `extra`: more flags for it alone.
  void AddNode(const std::vector<std::string>& extra = {}) {
    SpawnDaemon(static_cast<int>(pids_.size()), -1, extra);
  }
  pid_t pid(int r) const { return pids_[r]; }
  int coordinator_port() const { return coordinator_port_; }
  const std::string& admin_target(int r) const { return admin_targets_[r]; }
  // SIGTERM to every daemon; their exit codes (-1: killed by a signal, -2:
  // still running at the deadline, then killed and a test failure).
  std::vector<int> Terminate(std::chrono::seconds limit) {
    for (pid_t p : pids_) {
      if (p > 0) kill(p, SIGTERM);
    }
    auto codes = WaitAll(pids_, limit);
    for (pid_t& p : pids_) p = -1;
    return codes;
  }
  void Forget(int r) { pids_[r] = -1; }
  ~DaemonCluster() {
    for (pid_t p : pids_) {
      if (p > 0) kill(p, SIGTERM);
    }
    std::vector<pid_t> live;
    for (pid_t p : pids_) {
      if (p > 0) live.push_back(p);
    }
    if (coordinator_pid_ > 0) {
      kill(coordinator_pid_, SIGTERM);
      live.push_back(coordinator_pid_);
    }
    WaitAll(live, std::chrono::seconds(20));
    // A failed test prints the end of every daemon's log (CI keeps no files).
    if (::testing::Test::HasFailure()) PrintLogTails();
    // MICROD_TEST_KEEP=1 keeps the daemons' logs and the outputs.
    if (const char* keep = std::getenv("MICROD_TEST_KEEP"); keep != nullptr && *keep == '1') {
      std::fprintf(stderr, "kept %s\n", dir_.c_str());
      return;
    }
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }

  // The last lines of each log of this cluster's folder, on stderr.
  void PrintLogTails() const {
    constexpr size_t kLines = 25;
    std::error_code ec;
    std::vector<std::string> logs;
    for (const auto& e : std::filesystem::directory_iterator(dir_, ec)) {
      if (e.path().extension() == ".log") logs.push_back(e.path().string());
    }
    std::sort(logs.begin(), logs.end());
    for (const std::string& path : logs) {
      std::ifstream in(path);
      std::vector<std::string> lines;
      for (std::string line; std::getline(in, line);) {
        lines.push_back(std::move(line));
        if (lines.size() > 4 * kLines) lines.erase(lines.begin(), lines.end() - kLines);
      }
      if (lines.size() > kLines) lines.erase(lines.begin(), lines.end() - kLines);
      std::fprintf(stderr, "--- the end of %s\n%s\n", path.c_str(),
                   absl::StrJoin(lines, "\n").c_str());
    }
  }

  std::string socket(int r) const { return absl::StrCat(dir_, "/node", r, "/microd.sock"); }
  const std::string& dir() const { return dir_; }
  void Kill(int r) {
    kill(pids_[r], SIGKILL);
    waitpid(pids_[r], nullptr, 0);
    pids_[r] = -1;
  }

  absl::StatusOr<microd::v1::GetStatusResponse> Status(int r, bool history = false) {
    auto stub = microd::v1::Admin::NewStub(grpc::CreateChannel(
        r < 0 ? coordinator_admin_ : admin_targets_[r], grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    microd::v1::GetStatusResponse resp;
    microd::v1::GetStatusRequest req;
    req.set_include_history(history);
    grpc::Status s = stub->GetStatus(&ctx, req, &resp);
    if (!s.ok()) return absl::UnavailableError(s.error_message());
    return resp;
  }

  // Starts one training process per (node, local rank); returns pids and output files.
  // `extra` (optional): more arguments for the process (node, local rank).
  void StartClients(const std::vector<BucketSpec>& buckets, long steps, long die_at = -1,
                    int die_node = -1, int die_local = -1,
                    const std::function<std::vector<std::string>(int, int)>& extra = nullptr) {
    for (int r = 0; r < n_; ++r) {
      StartNodeClients(r, buckets, steps, extra, r == die_node ? die_at : -1, die_local);
    }
  }
  // Node r's processes alone (one started by AddNode); local rank `die_local`
  // dies at step `die_at`.
  void StartNodeClients(int r, const std::vector<BucketSpec>& buckets, long steps,
                        const std::function<std::vector<std::string>(int, int)>& extra = nullptr,
                        long die_at = -1, int die_local = -1) {
    for (int l = 0; l < L_; ++l) {
      const std::string out = absl::StrCat(dir_, "/client", r, "_", l);
      outs_.push_back(out);
      std::vector<std::string> args = {HelperPath(MICROD_TEST_CLIENT),
                                       socket(r),
                                       SpecString(buckets),
                                       std::to_string(steps),
                                       out,
                                       std::to_string(l == die_local ? die_at : -1),
                                       "20000",
                                       std::to_string(l)};
      if (extra) {
        for (auto& a : extra(r, l)) args.push_back(std::move(a));
      }
      if (lab_ != nullptr) args = lab_->InNode(r, args);
      clients_.push_back(Spawn(args, out + ".log"));
    }
  }
  std::vector<int> WaitClients(std::chrono::seconds limit) { return WaitAll(clients_, limit); }
  const std::vector<std::string>& outs() const { return outs_; }
  const std::vector<pid_t>& clients() const { return clients_; }

 private:
  // The daemon that serves the coordinator alone (its log: coordinator.log;
  // Status(-1) asks it).
  void SpawnCoordinator() {
    std::vector<std::string> args = {HelperPath(MICROD_DAEMON),
                                     "--coordinator_only",
                                     "--coordinator_listen=127.0.0.1:0",
                                     absl::StrCat("--coordinator_port_file=", dir_, "/coordinator"),
                                     absl::StrCat("--nodes=", n_),
                                     "--node_name=coordinator",
                                     "--admin=127.0.0.1:0",
                                     absl::StrCat("--admin_port_file=", dir_, "/admin_coordinator"),
                                     absl::StrCat("--peer_timeout_ms=", options_.peer_timeout_ms)};
    if (options_.token.value_or(lab_ != nullptr)) args.push_back("--token_file=" + dir_ + "/token");
    for (const auto& e : options_.extra) args.push_back(e);
    coordinator_pid_ = Spawn(args, dir_ + "/coordinator.log");
    coordinator_port_ = ReadPortFile(dir_ + "/coordinator", std::chrono::seconds(20));
    coordinator_admin_ = absl::StrCat(
        "127.0.0.1:", ReadPortFile(dir_ + "/admin_coordinator", std::chrono::seconds(20)));
  }

  // Node r's daemon, asking for node rank `rank` (-1: any).
  void SpawnDaemon(int r, int rank, const std::vector<std::string>& extra = {}) {
    const ClusterOptions& o = options_;
    const std::string admin =
        lab_ != nullptr ? absl::StrCat("unix:", dir_, "/admin", r, ".sock") : "127.0.0.1:0";
    std::vector<std::string> args = {HelperPath(MICROD_DAEMON),
                                     "--socket=" + socket(r),
                                     absl::StrCat("--local_size=", L_),
                                     absl::StrCat("--nodes=", n_),
                                     absl::StrCat("--node_rank=", rank),
                                     absl::StrCat("--node_name=node", r),
                                     "--admin=" + admin,
                                     absl::StrCat("--peer_timeout_ms=", o.peer_timeout_ms),
                                     "--timeout_ms=20000",
                                     absl::StrCat("--dense_floor=", kDenseFloor)};
    if (lab_ == nullptr) {
      args.push_back(absl::StrCat("--admin_port_file=", dir_, "/admin", r));
    }
    const std::string host = lab_ != nullptr ? lab_->addr(0) : "127.0.0.1";
    if (r == 0 && !o.coordinator_only) {
      args.push_back(
          absl::StrCat("--coordinator_listen=",
                       o.coordinator_listen_host.empty() ? host : o.coordinator_listen_host, ":0"));
      args.push_back(absl::StrCat("--coordinator_port_file=", dir_, "/coordinator"));
    } else {
      args.push_back(absl::StrCat("--coordinator=", host, ":", coordinator_port_));
    }
    if (o.token.value_or(lab_ != nullptr)) args.push_back("--token_file=" + dir_ + "/token");
    for (const auto& e : o.extra) args.push_back(e);
    for (const auto& e : extra) args.push_back(e);
    if (lab_ != nullptr) args = lab_->InNode(r, args);
    pids_.push_back(Spawn(args, absl::StrCat(dir_, "/daemon", r, ".log"),
                          o.env ? o.env(r) : std::vector<std::string>{}));
    if (r == 0 && !o.coordinator_only) {
      coordinator_port_ = ReadPortFile(dir_ + "/coordinator", std::chrono::seconds(20));
    }
    if (lab_ == nullptr) {
      admin_targets_.push_back(absl::StrCat(
          "127.0.0.1:", ReadPortFile(absl::StrCat(dir_, "/admin", r), std::chrono::seconds(20))));
    } else {
      admin_targets_.push_back(admin);
    }
  }

  const int n_, L_;
  const std::string dir_;
  NetLab* const lab_;
  const ClusterOptions options_;
  pid_t coordinator_pid_ = -1;  // --coordinator_only's daemon, if any
  std::string coordinator_admin_;
  int coordinator_port_ = 0;
  std::vector<pid_t> pids_;
  std::vector<std::string> admin_targets_;  // gRPC targets of the Admin services
  std::vector<pid_t> clients_;
  std::vector<std::string> outs_;
};

// Reference: per node, the local sum of its processes' gradients, the step of
// issue A over the in-process transport (with momentum correction, a dense
// bucket's average becomes the velocity beta * u + average), the hash of the
// update every local process receives. ref[node][step][bucket]. `base`: the sparsifier of the
// buckets at or above kDenseFloor (the daemons' flags must say the same).
// `dtype` (2 bf16, 3 fp16): each process's gradient is that type's rounding of
// its fp32 one, widened for the step; the update is rounded to it again and
// hashed as 2-byte elements. `wire_bucket` (--wire_dtype=bucket): the sparse
// buckets' selected values travel in `dtype`.
using ReferenceHashes = std::vector<std::vector<std::vector<uint64_t>>>;
// An elastic job's membership from a step on: `nodes` (indices into the
// reference's nodes) in the order of their ranks, from step `from[b]` of
// bucket b on (one step for all if `from` has one entry). A node not in the
// phase before joins with a zero residual and the step and threshold state
// of the phase's first node that was there.
struct ReferencePhase {
  std::vector<int> nodes;
  std::vector<long> from;
};

// The reference of a job whose membership changes: `phases` in order (the
// first from step 0). Each process's gradient is seeded by `seeds[node]`
// (default: the node's index) times L plus its local rank: the global rank
// it started with.
inline ReferenceHashes PhasedReference(int n, int L, const std::vector<BucketSpec>& buckets,
                                       long steps, const std::vector<ReferencePhase>& phases,
                                       const sparsify::SparsifyOptions& base = {}, int dtype = 1,
                                       bool wire_bucket = false, std::vector<int> seeds = {}) {
  auto ops = kernels::CreateCpuSparseOps();
  if (seeds.empty()) {
    for (int r = 0; r < n; ++r) seeds.push_back(r);
  }
  std::vector<std::vector<std::vector<uint64_t>>> ref(
      n, std::vector<std::vector<uint64_t>>(steps, std::vector<uint64_t>(buckets.size())));
  std::vector<std::vector<std::unique_ptr<sparsify::BucketState>>> state(n);
  std::vector<std::vector<std::vector<float>>> velocity(
      n, std::vector<std::vector<float>>(buckets.size()));
  const int n0 = static_cast<int>(phases[0].nodes.size());
  for (int r = 0; r < n; ++r) {
    for (size_t b = 0; b < buckets.size(); ++b) {
      sparsify::SparsifyOptions o = base;
      if (buckets[b].count < kDenseFloor) o.sparsifier = sparsify::SparsifierKind::kDense;
      sparsify::BucketSpec spec{buckets[b].name, buckets[b].count, static_cast<uint32_t>(b + 1)};
      if (wire_bucket) spec.wire = static_cast<kernels::ElementType>(dtype);
      state[r].push_back(*sparsify::BucketState::Create(spec, {n0, 0, n0 * L}, o, ops.get()));
    }
  }
  auto from_of = [&](size_t p, size_t b) -> long {
    if (p >= phases.size()) return steps;
    if (p == 0) return 0;
    const auto& f = phases[p].from;
    return f.size() == 1 ? f[0] : f[b];
  };
  std::vector<bool> in(n, false);
  for (size_t p = 0; p < phases.size(); ++p) {
    const std::vector<int>& nodes = phases[p].nodes;
    const int m = static_cast<int>(nodes.size());
    // Joiners: a zero residual, the job's step and threshold state.
    for (int r : nodes) {
      if (p == 0 || in[r]) continue;
      int source = -1;
      for (int q : nodes) {
        if (in[q] && source < 0) source = q;
      }
      EXPECT_GE(source, 0) << "phase " << p << " has no node of the one before";
      if (source < 0) return ref;
      for (size_t b = 0; b < buckets.size(); ++b) {
        auto mine = state[r][b]->Save();
        auto theirs = state[source][b]->Save();
        EXPECT_TRUE(mine.ok() && theirs.ok());
        if (!mine.ok() || !theirs.ok()) return ref;
        mine->step = theirs->step;
        mine->controller = theirs->controller;
        const absl::Status loaded = state[r][b]->Load(*mine);
        EXPECT_TRUE(loaded.ok()) << loaded;
      }
    }
    std::fill(in.begin(), in.end(), false);
    for (int r : nodes) in[r] = true;
    long lo = steps, hi = 0;
    for (size_t b = 0; b < buckets.size(); ++b) {
      lo = std::min(lo, from_of(p, b));
      hi = std::max(hi, from_of(p + 1, b));
    }
    auto group = transport::CreateInprocGroup(m);
    std::vector<std::thread> threads;
    for (int i = 0; i < m; ++i) {
      threads.emplace_back([&, i] {
        const int r = nodes[i];
        for (auto& st : state[r]) ASSERT_TRUE(st->SetJob({m, i, m * L}).ok());
        for (long t = lo; t < hi; ++t) {
          for (size_t b = 0; b < buckets.size(); ++b) {
            if (t < from_of(p, b) || t >= from_of(p + 1, b)) continue;
            const uint64_t d = buckets[b].count;
            std::vector<std::vector<float>> local(L, std::vector<float>(d));
            std::vector<const float*> ptr;
            std::vector<uint16_t> half(dtype == 1 ? 0 : d);
            for (int l = 0; l < L; ++l) {
              e2e_fill(local[l].data(), d, seeds[r] * L + l, static_cast<int>(b), t);
              if (dtype != 1) {
                e2e_narrow(local[l].data(), d, dtype, half.data());
                e2e_widen(half.data(), d, dtype, local[l].data());
              }
              ptr.push_back(local[l].data());
            }
            std::vector<float> grad(d), update(d);
            ops->LocalSum(ptr.data(), L, d, grad.data(), nullptr, nullptr);
            auto s = state[r][b]->Step(grad.data(), update.data(), *group[i],
                                       absl::Now() + absl::Seconds(60));
            ASSERT_TRUE(s.ok()) << s.status();
            if (d < kDenseFloor && base.momentum > 0 &&
                base.sparsifier != sparsify::SparsifierKind::kDense) {
              // Momentum correction of a dense bucket: momentum SGD on the average.
              std::vector<float>& u = velocity[r][b];
              u.resize(d, 0.0f);
              const float beta = static_cast<float>(base.momentum);
              for (uint64_t k = 0; k < d; ++k) update[k] = u[k] = beta * u[k] + update[k];
            }
            if (dtype != 1) {
              e2e_narrow(update.data(), d, dtype, half.data());
              ref[r][t][b] = e2e_hash(half.data(), d * sizeof(uint16_t));
            } else {
              ref[r][t][b] = e2e_hash(update.data(), d * sizeof(float));
            }
          }
        }
      });
    }
    for (auto& t : threads) t.join();
  }
  return ref;
}

// `lost` not empty (an elastic job): those nodes leave before step
// `change_at`; from that step on the others go on as a job of their number
// (renumbered in order, their state kept: BucketState::SetJob), each
// process's gradient still seeded by the global rank it started with; the
// lost nodes' hashes stop there.
inline ReferenceHashes Reference(int n, int L, const std::vector<BucketSpec>& buckets, long steps,
                                 const sparsify::SparsifyOptions& base = {}, int dtype = 1,
                                 bool wire_bucket = false, const std::vector<int>& lost = {},
                                 long change_at = -1) {
  std::vector<ReferencePhase> phases(1);
  std::vector<int> survivors;
  for (int r = 0; r < n; ++r) {
    phases[0].nodes.push_back(r);
    if (std::find(lost.begin(), lost.end(), r) == lost.end()) survivors.push_back(r);
  }
  if (!lost.empty()) phases.push_back({survivors, {change_at}});
  return PhasedReference(n, L, buckets, steps, phases, base, dtype, wire_bucket);
}

// A process's output in an elastic job ("step bucket hash" lines, and an
// "EPOCH ..." line for each step answered MICROD_ERR_MEMBERSHIP) against
// the reference of its node r: every result bit for bit. `results` and
// `epochs` get the results and the EPOCH lines.
// One result line of a test client ("STEP BUCKET HASH", the hash in hex)
// whose step and bucket index `ref` of `buckets` buckets (a node's
// reference: ref[r]); false for any other line (FAILED, EPOCH).
struct ResultLine {
  long step = 0;
  int bucket = 0;
  uint64_t hash = 0;
};
inline bool ParseResultLine(const std::string& line, const std::vector<std::vector<uint64_t>>& ref,
                            ResultLine* out) {
  std::vector<std::string> f = absl::StrSplit(line, ' ');
  return f.size() == 3 && absl::SimpleAtoi(f[0], &out->step) &&
         absl::SimpleAtoi(f[1], &out->bucket) && absl::SimpleHexAtoi(f[2], &out->hash) &&
         out->step >= 0 && out->step < static_cast<long>(ref.size()) && out->bucket >= 0 &&
         out->bucket < static_cast<int>(ref[out->step].size());
}

inline void CheckElasticOutput(const std::vector<std::string>& lines, const ReferenceHashes& ref,
                               const std::vector<BucketSpec>& buckets, int r, size_t* results,
                               std::vector<std::string>* epochs) {
  for (const std::string& line : lines) {
    if (absl::StartsWith(line, "EPOCH ")) {
      epochs->push_back(line);
      continue;
    }
    ResultLine x;
    ASSERT_TRUE(ParseResultLine(line, ref[r], &x)) << "node " << r << ": " << line;
    ASSERT_EQ(x.hash, ref[r][x.step][x.bucket])
        << "node " << r << " step " << x.step << " bucket " << buckets[x.bucket].name;
    ++*results;
  }
}

// Each node's processes' output against an elastic job's reference (node r
// the r-th process started): every result bit for bit; `results[r]` of
// them on node r, and `epochs[r]` steps answered MICROD_ERR_MEMBERSHIP;
// `codes[r]` its exit code, 0.
inline void ExpectElasticOutputs(const DaemonCluster& cluster, const ReferenceHashes& ref,
                                 const std::vector<BucketSpec>& buckets,
                                 const std::vector<int>& codes, const std::vector<size_t>& results,
                                 const std::vector<int>& epochs) {
  for (size_t r = 0; r < results.size(); ++r) {
    const auto lines = ReadLines(cluster.outs()[r]);
    EXPECT_EQ(codes[r], 0) << "node " << r << ": " << (lines.empty() ? "" : lines.back());
    size_t seen = 0;
    std::vector<std::string> epoch_lines;
    CheckElasticOutput(lines, ref, buckets, static_cast<int>(r), &seen, &epoch_lines);
    EXPECT_EQ(seen, results[r]) << "node " << r;
    EXPECT_EQ(static_cast<int>(epoch_lines.size()), epochs[r]) << "node " << r;
  }
}

// Elastic membership (--min_nodes=2): nodes `lost` of `n` are lost between
// two steps (their processes stop before step 6, then `lose` takes their
// daemons: killed, or their links cut). After the peer timeout the others go on as a job of their
// number: their step 6 is answered MICROD_ERR_MEMBERSHIP, with the new
// epoch, rank and world size read before it; they submit it again; every
// step, before the change and after it, is bit for bit the reference of
// such a job (the survivors' residuals kept, the partitions re-cut).
// `epochs`: the changes of membership that loss makes (nodes found lost
// apart make one each); 0: one or two, as the coordinator found them (nodes
// lost at once may be found a watchdog tick apart), the same everywhere.
// `cause`: what the coordinator says of each lost node ("(nodeN) <cause>").
// `took`: the seconds from the loss to the survivors' last step.
inline void ExpectElasticJobGoesOn(
    ClusterOptions o, int n, const std::vector<int>& lost,
    const std::function<void(DaemonCluster&, const std::vector<int>&)>& lose, int epochs = 1,
    const std::string& cause = "silent", double* took = nullptr) {
  const std::vector<BucketSpec> buckets = {{"fc", 100003}, {"b", 1000}};
  const long steps = 12, change_at = 6;
  o.extra.push_back("--min_nodes=2");
  DaemonCluster cluster(n, 1, o);
  auto is_lost = [&](int r) { return std::find(lost.begin(), lost.end(), r) != lost.end(); };
  cluster.StartClients(buckets, steps, -1, -1, -1, [&](int r, int) {
    std::vector<std::string> a = {"elastic"};
    if (is_lost(r)) a.push_back(absl::StrCat("pause_at=", change_at));
    return a;
  });
  for (int r : lost) {
    for (int i = 0; i < 1500 && ReadLines(cluster.outs()[r]).size() < change_at * buckets.size();
         ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    ASSERT_EQ(ReadLines(cluster.outs()[r]).size(), change_at * buckets.size());
  }
  const auto start = std::chrono::steady_clock::now();
  lose(cluster, lost);
  // The lost nodes' processes stay stopped: only the others finish.
  std::vector<pid_t> others;
  for (int r = 0; r < n; ++r) {
    if (!is_lost(r)) others.push_back(cluster.clients()[r]);
  }
  const std::vector<int> survivors_codes = WaitAll(others, std::chrono::seconds(90));
  if (took != nullptr) {
    *took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  std::vector<int> codes(n, -1);
  for (int r = 0, i = 0; r < n; ++r) {
    if (!is_lost(r)) codes[r] = survivors_codes[i++];
  }
  // The peer timeout (3 s), then the new data plane and the steps left.
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
  const auto ref = Reference(n, 1, buckets, steps, {}, 1, false, lost, change_at);
  const int m = n - static_cast<int>(lost.size());
  if (epochs == 0) {
    auto status = cluster.Status(0);
    ASSERT_TRUE(status.ok()) << status.status();
    epochs = static_cast<int>(status->membership_epoch());
    EXPECT_TRUE(epochs == 1 || epochs == 2) << epochs;
  }
  int new_rank = 0;
  int m_first_survivor = 0;  // the coordinator's account is checked once, with it
  while (is_lost(m_first_survivor)) ++m_first_survivor;
  for (int r = 0; r < n; ++r) {
    const auto lines = ReadLines(cluster.outs()[r]);
    std::vector<std::string> epoch_lines;
    size_t results = 0;
    CheckElasticOutput(lines, ref, buckets, r, &results, &epoch_lines);
    for (const std::string& line : epoch_lines) {
      // step, epoch, rank, world size, node rank, node count
      EXPECT_EQ(line, absl::StrCat("EPOCH ", change_at, " ", epochs, " ", new_rank, " ", m, " ",
                                   new_rank, " ", m))
          << "node " << r;
    }
    if (is_lost(r)) {
      EXPECT_EQ(results, change_at * buckets.size());
      continue;
    }
    ++new_rank;
    EXPECT_EQ(codes[r], 0) << "node " << r << ": " << (lines.empty() ? "" : lines.back());
    EXPECT_EQ(epoch_lines.size(), 1u) << "node " << r;  // one MICROD_ERR_MEMBERSHIP
    EXPECT_EQ(results, steps * buckets.size()) << "node " << r;
    // Seen from outside: the epoch, and how long the change took here.
    auto status = cluster.Status(r);
    ASSERT_TRUE(status.ok()) << status.status();
    EXPECT_EQ(status->membership_epoch(), static_cast<uint64_t>(epochs)) << "node " << r;
    EXPECT_EQ(status->node_count(), m) << "node " << r;
    EXPECT_GT(status->last_recovery_seconds(), 0) << "node " << r;
    EXPECT_LT(status->last_recovery_seconds(), 20) << "node " << r;
    if (o.coordinator_only ? r == m_first_survivor : r == 0) {
      if (o.coordinator_only) {
        status = cluster.Status(-1);  // the coordinator's own daemon
        ASSERT_TRUE(status.ok()) << status.status();
      }
      EXPECT_EQ(status->min_nodes(), 2);
      ASSERT_EQ(status->membership_changes_size(), epochs);
      EXPECT_EQ(status->membership_changes(epochs - 1).epoch(), static_cast<uint64_t>(epochs));
      EXPECT_EQ(status->membership_changes(epochs - 1).nodes(), m);
      std::string causes;
      for (const auto& c : status->membership_changes()) causes += c.cause();
      for (int l : lost) {
        EXPECT_TRUE(absl::StrContains(causes, absl::StrCat("(node", l, ") ", cause))) << causes;
      }
    }
  }
}

// Every process's output ("step bucket hash" lines) against the reference:
// all steps, bit for bit. `codes`: the processes' exit codes (node-major).
inline void ExpectMatchesReference(const DaemonCluster& cluster, const std::vector<int>& codes,
                                   const ReferenceHashes& ref, int n, int L,
                                   const std::vector<BucketSpec>& buckets, long steps) {
  for (int r = 0; r < n; ++r) {
    for (int l = 0; l < L; ++l) {
      const auto lines = ReadLines(cluster.outs()[r * L + l]);
      ASSERT_EQ(codes[r * L + l], 0)
          << "node " << r << " local " << l << ": " << (lines.empty() ? "no output" : lines.back());
      ASSERT_EQ(lines.size(), steps * buckets.size());
      for (const std::string& line : lines) {
        ResultLine x;
        ASSERT_TRUE(ParseResultLine(line, ref[r], &x)) << "node " << r << ": " << line;
        ASSERT_EQ(x.hash, ref[r][x.step][x.bucket])
            << "node " << r << " local " << l << " step " << x.step << " bucket "
            << buckets[x.bucket].name;
      }
    }
  }
}

}  // namespace microd::testing
