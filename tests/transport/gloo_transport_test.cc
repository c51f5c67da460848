// The contract suite against the Gloo transport: the ranks are threads of
// this process, connected over loopback TCP through an in-memory store.
#include <atomic>
#include <thread>

#include "daemon/control/kv_store.h"
#include "daemon/transport/gloo/gloo_transport.h"
#include "tests/transport/transport_contract.h"

namespace microd::transport::testing {
namespace {

std::vector<std::unique_ptr<Transport>> CreateGlooGroup(int size) {
  static control::InMemoryKeyValueStore store;
  static std::atomic<int> group_id{0};
  const std::string prefix = "group" + std::to_string(group_id++);
  std::vector<std::unique_ptr<Transport>> group(size);
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      GlooOptions o;
      o.rank = r;
      o.size = size;
      o.store = &store;
      o.prefix = prefix;
      o.timeout = absl::Seconds(30);
      auto t = CreateGlooTransport(o);
      EXPECT_TRUE(t.ok()) << t.status();
      if (t.ok()) group[r] = std::move(t).value();
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& t : group) {
    if (t == nullptr) return {};
  }
  return group;
}

}  // namespace

INSTANTIATE_TEST_SUITE_P(Gloo, TransportContractTest,
                         ::testing::Values(TransportBackend{"gloo", CreateGlooGroup}),
                         [](const auto& info) { return info.param.name; });

}  // namespace microd::transport::testing
