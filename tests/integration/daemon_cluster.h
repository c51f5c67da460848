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

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/sparsify/bucket.h"
#include "daemon/transport/inproc/inproc_transport.h"
#include "gtest/gtest.h"
#include "kernels/sparse_ops.h"
#include "microd/v1/admin.grpc.pb.h"
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

class DaemonCluster {
 public:
  // `env(r)`: environment entries (NAME=VALUE) for node r's daemon.
  DaemonCluster(int nodes, int local, std::vector<std::string> extra = {},
                const std::function<std::vector<std::string>(int)>& env = nullptr)
      : n_(nodes), L_(local), dir_(MakeTempDir("e2e")) {
    for (int r = 0; r < nodes; ++r) {
      std::vector<std::string> args = {MICROD_DAEMON,
                                       "--socket=" + socket(r),
                                       absl::StrCat("--local_size=", local),
                                       absl::StrCat("--nodes=", nodes),
                                       absl::StrCat("--node_rank=", r),
                                       absl::StrCat("--node_name=node", r),
                                       "--admin=127.0.0.1:0",
                                       absl::StrCat("--admin_port_file=", dir_, "/admin", r),
                                       "--peer_timeout_ms=3000",
                                       "--timeout_ms=20000",
                                       absl::StrCat("--dense_floor=", kDenseFloor)};
      if (r == 0) {
        args.push_back("--coordinator_listen=127.0.0.1:0");
        args.push_back(absl::StrCat("--coordinator_port_file=", dir_, "/coordinator"));
      } else {
        args.push_back(absl::StrCat("--coordinator=127.0.0.1:", coordinator_port_));
      }
      for (const auto& e : extra) args.push_back(e);
      pids_.push_back(Spawn(args, absl::StrCat(dir_, "/daemon", r, ".log"),
                            env ? env(r) : std::vector<std::string>{}));
      if (r == 0) coordinator_port_ = ReadPortFile(dir_ + "/coordinator", std::chrono::seconds(20));
      admin_ports_.push_back(
          ReadPortFile(absl::StrCat(dir_, "/admin", r), std::chrono::seconds(20)));
    }
  }
  pid_t pid(int r) const { return pids_[r]; }
  void Forget(int r) { pids_[r] = -1; }
  ~DaemonCluster() {
    for (pid_t p : pids_) {
      if (p > 0) kill(p, SIGTERM);
    }
    std::vector<pid_t> live;
    for (pid_t p : pids_) {
      if (p > 0) live.push_back(p);
    }
    WaitAll(live, std::chrono::seconds(20));
    // MICROD_TEST_KEEP=1 keeps the daemons' logs and the outputs.
    if (const char* keep = std::getenv("MICROD_TEST_KEEP"); keep != nullptr && *keep == '1') {
      std::fprintf(stderr, "kept %s\n", dir_.c_str());
      return;
    }
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
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
        absl::StrCat("127.0.0.1:", admin_ports_[r]), grpc::InsecureChannelCredentials()));
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
      for (int l = 0; l < L_; ++l) {
        const std::string out = absl::StrCat(dir_, "/client", r, "_", l);
        outs_.push_back(out);
        const bool dies = r == die_node && l == die_local;
        std::vector<std::string> args = {MICROD_TEST_CLIENT,
                                         socket(r),
                                         SpecString(buckets),
                                         std::to_string(steps),
                                         out,
                                         std::to_string(dies ? die_at : -1),
                                         "20000",
                                         std::to_string(l)};
        if (extra) {
          for (auto& a : extra(r, l)) args.push_back(std::move(a));
        }
        clients_.push_back(Spawn(args, out + ".log"));
      }
    }
  }
  std::vector<int> WaitClients(std::chrono::seconds limit) { return WaitAll(clients_, limit); }
  const std::vector<std::string>& outs() const { return outs_; }
  const std::vector<pid_t>& clients() const { return clients_; }

 private:
  const int n_, L_;
  const std::string dir_;
  int coordinator_port_ = 0;
  std::vector<pid_t> pids_;
  std::vector<int> admin_ports_;
  std::vector<pid_t> clients_;
  std::vector<std::string> outs_;
};

// Reference: per node, the local sum of its processes' gradients, the step of
// issue A over the in-process transport, the hash of the update every local
// process receives. ref[node][step][bucket].
inline std::vector<std::vector<std::vector<uint64_t>>> Reference(
    int n, int L, const std::vector<BucketSpec>& buckets, long steps) {
  auto ops = kernels::CreateCpuSparseOps();
  auto group = transport::CreateInprocGroup(n);
  std::vector<std::vector<std::vector<uint64_t>>> ref(
      n, std::vector<std::vector<uint64_t>>(steps, std::vector<uint64_t>(buckets.size())));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      std::vector<std::unique_ptr<sparsify::BucketState>> state;
      for (size_t b = 0; b < buckets.size(); ++b) {
        sparsify::SparsifyOptions o;
        o.density = 0.01;
        if (buckets[b].count < kDenseFloor) o.sparsifier = sparsify::SparsifierKind::kDense;
        state.push_back(*sparsify::BucketState::Create(
            {buckets[b].name, buckets[b].count, static_cast<uint32_t>(b + 1)}, {n, r, n * L}, o,
            ops.get()));
      }
      for (long t = 0; t < steps; ++t) {
        for (size_t b = 0; b < buckets.size(); ++b) {
          const uint64_t d = buckets[b].count;
          std::vector<std::vector<float>> local(L, std::vector<float>(d));
          std::vector<const float*> ptr;
          for (int l = 0; l < L; ++l) {
            e2e_fill(local[l].data(), d, r * L + l, static_cast<int>(b), t);
            ptr.push_back(local[l].data());
          }
          std::vector<float> grad(d), update(d);
          ops->LocalSum(ptr.data(), L, d, grad.data(), nullptr, nullptr);
          auto s = state[b]->Step(grad.data(), update.data(), *group[r],
                                  absl::Now() + absl::Seconds(60));
          ASSERT_TRUE(s.ok()) << s.status();
          ref[r][t][b] = e2e_hash(update.data(), d * sizeof(float));
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  return ref;
}

}  // namespace microd::testing
