// SPDX-License-Identifier: Apache-2.0
// Fuzz target: what a peer sends during a sparse step. Three nodes over the
// in-process transport run steps of one bucket; node 1's transport replaces
// what node 1 sends in the step's headers (the selected counts) and index
// allgathers with bytes of the input. Every node must finish each step, with
// its update or with an error (never a crash, an out-of-bounds access under
// ASan, or a hang), and all nodes must agree on which.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "daemon/sparsify/bucket.h"
#include "daemon/transport/inproc/inproc_transport.h"
#include "kernels/sparse_ops.h"
#include "tests/fuzz/input.h"
#include "tests/transport/forwarding.h"

namespace {

using microd::fuzz::Input;
using microd::transport::CollectiveOptions;
using microd::transport::DataType;
using microd::transport::Transport;

// Node 1's transport: the messages of its step's rounds (headers, indices,
// histograms, values) begin with bytes from the input.
class LyingTransport final : public microd::transport::Forwarding {
 public:
  LyingTransport(Transport* inner, Input* input) : Forwarding(inner), input_(input) {}
  const char* name() const override { return "lying"; }
  absl::Status ExchangeRound(std::string_view mine, std::vector<std::string>* from,
                             const CollectiveOptions& o) override {
    std::string lie(mine);
    const std::vector<uint8_t> bytes = input_->Bytes(lie.size());
    if (!bytes.empty()) std::memcpy(lie.data(), bytes.data(), bytes.size());
    return inner_->ExchangeRound(lie, from, o);
  }
  void Abort(const absl::Status& reason) override { inner_->Abort(reason); }

 private:
  Input* const input_;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace microd::sparsify;
  Input input(data, size);
  constexpr int n = 3;
  const uint64_t d = 1 + input.Below(5000);
  SparsifyOptions o;
  switch (static_cast<int>(input.Below(4))) {
    case 0:
      o.sparsifier = SparsifierKind::kMicro;
      o.controller = ControllerKind::kHistogram;
      break;
    case 1:
      o.sparsifier = SparsifierKind::kMicro;
      o.controller = ControllerKind::kPaper;
      break;
    case 2:
      o.sparsifier = SparsifierKind::kTopK;
      break;
    default:
      o.sparsifier = SparsifierKind::kHard;
      break;
  }
  o.density = 0.05;
  static auto ops = microd::kernels::CreateCpuSparseOps();
  auto group = microd::transport::CreateInprocGroup(n);
  LyingTransport liar(group[1].get(), &input);
  std::vector<std::unique_ptr<BucketState>> buckets;
  for (int r = 0; r < n; ++r) {
    auto b = BucketState::Create({"fuzz", d, 1}, {n, r, n}, o, ops.get());
    if (!b.ok()) std::abort();
    buckets.push_back(std::move(b).value());
  }
  const int steps = 1 + static_cast<int>(input.Below(3));
  for (int t = 0; t < steps; ++t) {
    std::vector<std::vector<float>> grad(n, std::vector<float>(d)),
        update(n, std::vector<float>(d));
    for (int r = 0; r < n; ++r) {
      for (uint64_t i = 0; i < d; ++i)
        grad[r][i] = static_cast<float>((i * 7919 + r * 31 + t) % 97) - 48;
    }
    std::vector<absl::Status> status(n);
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) {
      threads.emplace_back([&, r] {
        Transport& tr = r == 1 ? static_cast<Transport&>(liar) : *group[r];
        status[r] =
            buckets[r]
                ->Step(grad[r].data(), update[r].data(), tr, absl::Now() + absl::Seconds(10))
                .status();
      });
    }
    for (auto& th : threads) th.join();
    for (int r = 1; r < n; ++r) {
      if (status[r].ok() != status[0].ok()) {
        std::fprintf(stderr, "node 0: %s; node %d: %s\n", status[0].ToString().c_str(), r,
                     status[r].ToString().c_str());
        std::abort();
      }
    }
    if (!status[0].ok()) break;  // the job would end here
  }
  return 0;
}
