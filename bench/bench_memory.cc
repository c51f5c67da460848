// microd-bench-memory: the daemon's own memory per gradient element, for
// each configuration of a sparse bucket, beside the target of issue W (the
// residual plus O(k): 1.15x the fp32 gradient; with momentum correction
// 2.15x; clipping adds O(k)). `--nodes` buckets step over the in-process
// transport with synthetic gradients; each reports the bytes it holds after
// `--steps` steps (BucketState::AllocatedBytes: what `microctl buckets`
// shows as "state"). Several local processes add the node's shared
// local-sum buffers (2 x 4 bytes an element of the largest bucket when
// --local_size > 1), not counted here.
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "daemon/sim/synthetic.h"
#include "daemon/sparsify/bucket.h"
#include "daemon/transport/inproc/inproc_transport.h"
#include "kernels/sparse_ops.h"

ABSL_FLAG(uint64_t, size, 4000000, "bucket size d (fp32 elements)");
ABSL_FLAG(int, nodes, 4, "nodes (one bucket state each, stepping together)");
ABSL_FLAG(double, density, 0.001, "target density");
ABSL_FLAG(int, steps, 6, "steps before the bytes are read");

namespace {

using microd::sparsify::BucketSpec;
using microd::sparsify::BucketState;
using microd::sparsify::SparsifyOptions;

struct Config {
  std::string name;
  double momentum = 0;
  double clip_norm = 0;
  microd::kernels::ElementType wire = microd::kernels::ElementType::kFloat32;
  double target;  // bytes per element / 4 (x the fp32 gradient)
};

// Bytes node 0's bucket holds after the steps, or -1 on a failure.
double BytesPerElement(const Config& c, uint64_t d, int n, double density, int steps) {
  SparsifyOptions o;
  o.density = density;
  o.momentum = c.momentum;
  o.clip_norm = c.clip_norm;
  auto group = microd::transport::CreateInprocGroup(n);
  std::vector<std::unique_ptr<microd::kernels::SparseOps>> ops;
  std::vector<std::unique_ptr<BucketState>> state;
  for (int r = 0; r < n; ++r) {
    ops.push_back(microd::kernels::CreateCpuSparseOps());
    BucketSpec spec{"bench", d, 1};
    spec.wire = c.wire;
    auto s = BucketState::Create(spec, {n, r, n}, o, ops.back().get());
    if (!s.ok()) {
      std::fprintf(stderr, "bench-memory: %s\n", s.status().ToString().c_str());
      return -1;
    }
    state.push_back(*std::move(s));
  }
  bool ok = true;
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      microd::sim::SyntheticOptions so;
      so.size = d;
      microd::sim::SyntheticGradients gradients(so, r);
      std::vector<float> grad(d), update(d);
      for (int t = 0; t < steps; ++t) {
        gradients.Next(grad.data());
        auto st =
            state[r]->Step(grad.data(), update.data(), *group[r], absl::Now() + absl::Seconds(120));
        if (!st.ok()) {
          std::fprintf(stderr, "bench-memory: node %d: %s\n", r, st.status().ToString().c_str());
          ok = false;
          return;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  if (!ok) return -1;
  return static_cast<double>(state[0]->AllocatedBytes()) / static_cast<double>(d);
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const uint64_t d = absl::GetFlag(FLAGS_size);
  const int n = absl::GetFlag(FLAGS_nodes);
  const double density = absl::GetFlag(FLAGS_density);
  const int steps = absl::GetFlag(FLAGS_steps);
  const std::vector<Config> configs = {
      {"defaults", 0, 0, microd::kernels::ElementType::kFloat32, 1.15},
      {"momentum correction 0.9", 0.9, 0, microd::kernels::ElementType::kFloat32, 2.15},
      {"clipping 1.0", 0, 1.0, microd::kernels::ElementType::kFloat32, 1.15},
      {"momentum correction + clipping", 0.9, 1.0, microd::kernels::ElementType::kFloat32, 2.15},
      {"bf16 wire (--wire_dtype=bucket)", 0, 0, microd::kernels::ElementType::kBFloat16, 1.15},
  };
  std::printf(
      "microd-bench-memory: one sparse bucket of %llu elements, %d nodes, density %g, "
      "after %d steps (node 0)\n",
      static_cast<unsigned long long>(d), n, density, steps);
  std::printf("%-34s %12s %14s %10s %s\n", "configuration", "bytes/elem", "x fp32 gradient",
              "target", "");
  int missed = 0;
  for (const Config& c : configs) {
    const double b = BytesPerElement(c, d, n, density, steps);
    if (b < 0) return 1;
    const bool met = b / 4.0 <= c.target;
    missed += met ? 0 : 1;
    std::printf("%-34s %12.2f %13.2fx %9.2fx %s\n", c.name.c_str(), b, b / 4.0, c.target,
                met ? "met" : "MISSED");
  }
  std::printf("%d of %zu configurations within their target\n",
              static_cast<int>(configs.size()) - missed, configs.size());
  return 0;
}
