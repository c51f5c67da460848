// SPDX-License-Identifier: Apache-2.0
// The transport contract suite, written once and instantiated per backend
// (in-process now; Gloo and NCCL register their own factory). One thread per
// rank; sizes {0, 1, odd, large}; ranks {1, 2, 3, 4, 7} (a backend may ask
// for fewer).
#pragma once

#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "daemon/transport/transport.h"
#include "gtest/gtest.h"

namespace microd::transport::testing {

struct TransportBackend {
  std::string name;
  // Creates a connected group of `size` endpoints, rank i at index i.
  std::function<std::vector<std::unique_ptr<Transport>>(int size)> create;
  // Optional: a non-empty reason skips every test (e.g. no GPU for NCCL).
  std::function<std::string()> skip_reason;
  // Float sums are in rank order (((x0 + x1) + x2) + ...): the same bits on
  // every such backend (in-process, Gloo), so results do not depend on the
  // backend. NCCL sums in its own order.
  bool rank_order_sums = true;
  // The group sizes each test runs (NCCL's ranks are processes with a GPU
  // context each: fewer of them keep the suite within minutes).
  std::vector<int> ranks = {1, 2, 3, 4, 7};
};

inline void PrintTo(const TransportBackend& b, std::ostream* os) { *os << b.name; }

// Runs body(rank, transport) on one thread per rank and joins them.
inline void RunRanks(std::vector<std::unique_ptr<Transport>>& group,
                     const std::function<void(int, Transport&)>& body) {
  std::vector<std::thread> threads;
  for (size_t r = 0; r < group.size(); ++r) {
    threads.emplace_back([&, r] { body(static_cast<int>(r), *group[r]); });
  }
  for (auto& t : threads) t.join();
}

// Threads of this process once those joined have left it: a joined thread
// may stay listed in /proc/self/task for a moment (the kernel wakes the
// joiner before it removes the task; under load, long enough to count it).
// Waits up to `settle` for the count to fall to `at_most`, and returns it.
int SettledThreads(int at_most, absl::Duration settle = absl::Seconds(10));

class TransportContractTest : public ::testing::TestWithParam<TransportBackend> {
 protected:
  void SetUp() override {
    if (GetParam().skip_reason) {
      const std::string reason = GetParam().skip_reason();
      if (!reason.empty()) GTEST_SKIP() << reason;
    }
  }
};

}  // namespace microd::transport::testing
