// SPDX-License-Identifier: Apache-2.0
// The contract suite against the Gloo transport: the ranks are threads of
// this process, connected over loopback TCP through an in-memory store.
#include "daemon/transport/gloo/gloo_transport.h"

#include <dirent.h>
#include <gloo/rendezvous/context.h>
#include <malloc.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <sstream>
#include <thread>

#include "absl/strings/match.h"
#include "daemon/common/log.h"
#include "daemon/rendezvous/kv_store.h"
#include "daemon/transport/gloo/gloo_internal.h"
#include "daemon/transport/gloo/record/device.h"
#include "daemon/transport/gloo/store_adapter.h"
#include "gtest/gtest.h"
#include "tests/transport/transport_contract.h"

namespace microd::transport::testing {
namespace {

// Keys of a sealed data plane, from a test secret (`secret_of` by rank:
// a rank with another secret cannot open what the others seal).
std::shared_ptr<const SealKeys> TestKeys(int rank, int size, char secret_byte = 's') {
  std::vector<std::string> salts(size);
  for (int p = 0; p < size; ++p) {
    if (p != rank) salts[p] = std::string(SealKeys::kSaltBytes, static_cast<char>('a' + rank + p));
  }
  auto keys = SealKeys::Derive(rank, salts, std::string(32, secret_byte), "test-job", 0);
  EXPECT_TRUE(keys.ok()) << keys.status();
  return keys.ok() ? std::shared_ptr<const SealKeys>(std::move(keys).value()) : nullptr;
}

// A long link's model (rounds of 5 ms): the large allreduce posts its
// receives ahead, as across zones.
LinkModel LongLink() {
  LinkModel m;
  m.round_seconds = 5e-3;
  m.posted_round_seconds = 2.5e-3;
  m.bytes_per_second = 1.25e8;
  return m;
}

std::vector<std::unique_ptr<Transport>> CreateGlooGroup(
    int size, int io_nice = 0, int connections = 0,
    std::optional<LinkModel> link_model = std::nullopt,
    std::function<std::shared_ptr<const SealKeys>(int rank)> seal = nullptr) {
  static rendezvous::InMemoryKeyValueStore store;
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
      o.io_nice = io_nice;
      o.connections = connections;
      o.link_model = link_model;
      if (seal) o.seal = seal(r);
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

// Nice value of every thread of this process, by thread id (field 19 of
// /proc/self/task/<tid>/stat, after the parenthesised command name).
std::map<int, int> NiceByThread() {
  std::map<int, int> nice;
  DIR* d = opendir("/proc/self/task");
  if (d == nullptr) return nice;
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] == '.') continue;
    std::ifstream in(std::string("/proc/self/task/") + e->d_name + "/stat");
    std::string line;
    std::getline(in, line);
    const size_t paren = line.rfind(')');
    if (paren == std::string::npos) continue;
    std::istringstream rest(line.substr(paren + 2));
    std::string field;
    for (int i = 3; i <= 19 && rest >> field; ++i) {
      if (i == 19) nice[std::stoi(e->d_name)] = std::stoi(field);
    }
  }
  closedir(d);
  return nice;
}

}  // namespace

TEST(GlooTransportTest, IoNiceLowersTheNetworkThreadOnly) {
  const int base = getpriority(PRIO_PROCESS, 0);
  const std::map<int, int> before = NiceByThread();
  std::vector<std::unique_ptr<Transport>> group = CreateGlooGroup(2, /*io_nice=*/7);
  ASSERT_EQ(group.size(), 2u);
  int lowered = 0;
  for (const auto& [tid, nice] : NiceByThread()) {
    if (before.count(tid) > 0) {
      EXPECT_EQ(nice, before.at(tid)) << "thread " << tid << " existed before";
    } else if (nice == std::min(19, base + 7)) {
      ++lowered;
    } else {
      ADD_FAILURE() << "new thread " << tid << " has nice " << nice;
    }
  }
  // Gloo's network thread: one per process (shared by the devices) or one
  // per device, depending on the Gloo version.
  EXPECT_GE(lowered, 1) << "no thread has the nice value";
  EXPECT_LE(lowered, 2);
  EXPECT_EQ(getpriority(PRIO_PROCESS, 0), base);
  // The transports still work.
  std::vector<std::thread> threads;
  std::vector<float> x = {2.5f, 4.0f};
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back(
        [&, r] { EXPECT_TRUE(group[r]->AllreduceSum(&x[r], 1, DataType::kFloat32, {}).ok()); });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(x[0], 6.5f);
  EXPECT_EQ(x[1], 6.5f);
}

// Issue J: ranks that disagree on an allgather's size (a peer out of step)
// made Gloo abort the process (a message longer than the receive posted for
// it). Now every rank's call fails by its deadline and the process lives.
TEST(GlooTransportTest, RanksDisagreeingOnAnAllgatherSizeFailByTheDeadline) {
  std::vector<std::unique_ptr<Transport>> group = CreateGlooGroup(3);
  ASSERT_EQ(group.size(), 3u);
  std::vector<absl::Status> status(3);
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      const size_t words = r == 1 ? 24 : 16;  // rank 1 is out of step
      std::vector<uint64_t> in(words, r), out(words * 3);
      CollectiveOptions o;
      o.deadline = absl::Now() + absl::Seconds(2);
      status[r] = group[r]->Allgather(in.data(), words * sizeof(uint64_t), out.data(), o);
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 3; ++r) EXPECT_FALSE(status[r].ok()) << "rank " << r;
}

// The rounds a collective waits through: a direct round is one (two when
// a message passes the inline part), whatever the number of ranks; the
// links were measured at creation, alike on every rank.
TEST(GlooTransportTest, DirectRoundsCountOneAndTheLinkModelIsShared) {
  for (int n : {2, 4}) {
    std::vector<std::unique_ptr<Transport>> group = CreateGlooGroup(n);
    ASSERT_EQ(group.size(), size_t(n));
    const LinkModel* m0 = group[0]->link_model();
    ASSERT_NE(m0, nullptr);
    EXPECT_GT(m0->round_seconds, 0);
    EXPECT_GT(m0->bytes_per_second, 0);
    EXPECT_EQ(m0->ranks, n);
    std::vector<uint64_t> small(n), spilled(n);
    RunRanks(group, [&](int r, Transport& t) {
      const LinkModel* m = t.link_model();
      EXPECT_EQ(m->round_seconds, m0->round_seconds);
      EXPECT_EQ(m->bytes_per_second, m0->bytes_per_second);
      CollectiveOptions o;
      o.deadline = absl::Now() + absl::Seconds(30);
      o.tag = 77;
      std::vector<std::string> from;
      uint64_t before = t.rounds();
      t.Expect(77);
      ASSERT_TRUE(t.ExchangeRound(std::string(1000, 'a'), &from, o).ok());
      small[r] = t.rounds() - before;
      before = t.rounds();
      ASSERT_TRUE(t.ExchangeRound(std::string(m->InlineBytes() + 1, 'b'), &from, o).ok());
      spilled[r] = t.rounds() - before;
    });
    EXPECT_EQ(small, std::vector<uint64_t>(n, 1));
    EXPECT_EQ(spilled, std::vector<uint64_t>(n, 2));
  }
}

// A large allreduce (several segments a chunk) keeps a few segments of
// the other ranks' contributions, not a chunk's worth of each: a dense
// bucket of 80 MB held 80 MB of scratch beside it, now at most 2 segments
// of 6 MiB from all peers together (in step) or 3 of 8 MiB per peer
// (receives posted ahead, on a long link); and the sums stay the
// rank-order sums, bit for bit.
TEST(GlooTransportTest, LargeSumsKeepAFewSegmentsOfScratch) {
  constexpr size_t kCount = 20000003;  // 80 MB a rank
  constexpr uint64_t kSegmentBytes = 8 << 20;
  for (const bool long_link : {false, true}) {
    for (int n : {2, 3}) {
      // Given, not measured: a model measured on a loaded machine chose
      // another schedule (issue Z, finding 4: 40 MB of scratch under ASan
      // beside other tests). The short link is LinkModel's default: 50 us.
      LinkModel model;
      if (long_link) {
        model.round_seconds = 0.01;  // posted ahead from 2 ms
        model.posted_round_seconds = 0.005;
      }
      std::vector<std::unique_ptr<Transport>> group = CreateGlooGroup(n, 0, 1, model);
      ASSERT_EQ(group.size(), size_t(n));
      auto value = [](int q, size_t i) {
        return (float(q) + 0.37f) * 1e-3f * float((i * 2654435761u) % 1000 + 1) * (q % 2 ? -1 : 1);
      };
      std::vector<uint64_t> scratch(n);
      RunRanks(group, [&](int r, Transport& t) {
        std::vector<float> f(kCount);
        for (size_t i = 0; i < kCount; ++i) f[i] = value(r, i);
        CollectiveOptions o;
        o.deadline = absl::Now() + absl::Seconds(60);
        o.tag = 5;
        ASSERT_TRUE(t.AllreduceSum(f.data(), kCount, DataType::kFloat32, o).ok());
        scratch[r] = t.scratch_bytes();
        for (size_t i = 0; i < kCount; ++i) {
          float want = value(0, i);
          for (int q = 1; q < n; ++q) want += value(q, i);
          ASSERT_EQ(0, std::memcmp(&f[i], &want, sizeof want))
              << "rank " << r << " of " << n << " element " << i;
        }
      });
      const uint64_t bound =
          long_link ? 3 * (n - 1) * (kSegmentBytes + 4) + 4 : 2 * ((6 << 20) + (n - 1) * 4) + 4;
      for (int r = 0; r < n; ++r) {
        SCOPED_TRACE(::testing::Message()
                     << n << " ranks, rank " << r << (long_link ? ", long link" : ", short link"));
        EXPECT_GT(scratch[r], 0u);
        EXPECT_LE(scratch[r], bound);
        EXPECT_LE(scratch[r], kCount * sizeof(float) / 2 + 16);  // was kCount * 4
      }
    }
  }
}

TEST(GlooTransportTest, IoNiceOutOfRangeIsRefused) {
  rendezvous::InMemoryKeyValueStore store;
  for (int bad : {-1, 20}) {
    GlooOptions o;
    o.store = &store;
    o.io_nice = bad;
    auto t = CreateGlooTransport(o);
    ASSERT_FALSE(t.ok());
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(t.status().message().find("io_nice"), std::string::npos) << t.status();
  }
}

// A rank whose keys are not the group's (another job's or epoch's secret)
// cannot take part: it never gets through a handshake (neither side proves
// the link's secret to the other), nothing connects, and the errors name
// the links; nothing it sent was read as data. Node 0 gives up first (as
// it did under load in CI): the dialer's later attempts find its port
// closed, and the error still says why the ones before failed.
TEST(GlooTransportTest, ARankWithOtherKeysIsRefusedNamingTheLink) {
  static rendezvous::InMemoryKeyValueStore store;
  std::vector<absl::Status> status(3);
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      GlooOptions o;
      o.rank = r;
      o.size = 3;
      o.store = &store;
      o.prefix = "other-keys";
      o.timeout = r == 0 ? absl::Seconds(2) : absl::Seconds(5);
      o.seal = TestKeys(r, 3, r == 2 ? 'x' : 's');
      auto t = CreateGlooTransport(o);
      status[r] = t.status();
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 3; ++r) ASSERT_FALSE(status[r].ok()) << "rank " << r;
  // Node 2 dials nodes 0 and 1, whose replies it cannot verify.
  const std::string two(status[2].message());
  EXPECT_TRUE(absl::StrContains(two, "could not connect to node 0")) << two;
  EXPECT_TRUE(absl::StrContains(two, "the reply did not verify")) << two;
  // Node 1 waits for node 2 in vain (node 0 may fail first on either link).
  const std::string one(status[1].message());
  EXPECT_TRUE(absl::StrContains(one, "node 2 did not connect")) << one;
}

// Sealed transfers: every transfer counted, none refused, and the group
// says it is sealed.
TEST(GlooTransportTest, SealedGroupSaysSoAndRefusesNothing) {
  auto group = CreateGlooGroup(3, 0, 0, std::nullopt, [](int r) { return TestKeys(r, 3); });
  ASSERT_EQ(group.size(), 3u);
  RunRanks(group, [&](int r, Transport& t) {
    std::vector<float> v(100000, static_cast<float>(r + 1));
    CollectiveOptions o;
    o.tag = 7;
    ASSERT_TRUE(t.AllreduceSum(v.data(), v.size(), DataType::kFloat32, o).ok());
    EXPECT_EQ(v[0], 6.0f);
    EXPECT_EQ(v.back(), 6.0f);
    EXPECT_TRUE(t.sealed());
    EXPECT_EQ(t.refused_transfers(), 0u);
  });
}

// Threads of this process, and its resident memory in bytes.
int Threads() {
  int n = 0;
  DIR* d = opendir("/proc/self/task");
  while (d != nullptr && readdir(d) != nullptr) ++n;
  if (d != nullptr) closedir(d);
  return n - 2;  // . and ..
}
// Each thread's id, name and state ("1234 (name) S"), for a failure message.
std::string ThreadList() {
  std::string out;
  DIR* d = opendir("/proc/self/task");
  while (d != nullptr) {
    const dirent* e = readdir(d);
    if (e == nullptr) break;
    if (e->d_name[0] == '.') continue;
    std::ifstream in(std::string("/proc/self/task/") + e->d_name + "/stat");
    std::string line;
    std::getline(in, line);
    out += line.substr(0, line.find(' ', line.rfind(')') + 2)) + "\n";
  }
  if (d != nullptr) closedir(d);
  return out;
}
// Bytes the heap holds for the program (allocated and not freed): what a
// leak grows, unlike the resident size, which keeps what the allocator's
// arenas hold for reuse.
uint64_t HeapInUse() {
  const struct mallinfo2 m = mallinfo2();
  return m.uordblks + m.hblkhd;
}

// Issue X, finding 4: each epoch's data plane stayed, with its threads,
// connections and scratch, as long as the daemon (a few dozen epochs ran a
// node out of memory). An epoch's sealed data plane released gives all of
// it back: 50 epochs later (the engine keeps the current one and the one
// before) the threads are those of two, and the memory is what it was.
// Issue Y: nothing below Info was logged in transport/. At the debug level
// each collective says what it moved, between whom and how long it took;
// at the default level, nothing.
TEST(GlooTransportTest, EachCollectiveIsLoggedAtTheDebugLevelOnly) {
  std::vector<std::string> lines;
  absl::Mutex mu;
  log::SetSink([&](log::Level, const std::string& line) {
    absl::MutexLock lock(&mu);
    lines.push_back(line);
  });
  auto group = CreateGlooGroup(2);
  auto allreduce = [&] {
    RunRanks(group, [&](int r, Transport& t) {
      std::vector<float> v(1000, 1.0f);
      CollectiveOptions o;
      o.tag = MakeTag(5, TagKind::kRound3);
      ASSERT_TRUE(t.AllreduceSum(v.data(), v.size(), DataType::kFloat32, o).ok());
    });
  };
  allreduce();
  {
    absl::MutexLock lock(&mu);
    for (const std::string& l : lines) EXPECT_FALSE(absl::StrContains(l, "AllreduceSum")) << l;
  }
  log::SetLevel(log::Level::kDebug);
  allreduce();
  log::SetLevel(log::Level::kInfo);
  log::SetSink(nullptr);
  int found = 0;
  for (const std::string& l : lines) {
    if (absl::StrContains(l,
                          "gloo AllreduceSum tag 1290 (slot 5, kind 10): 4000 bytes from rank ") &&
        absl::StrContains(l, " of 2, ")) {
      ++found;
    }
  }
  EXPECT_EQ(found, 2) << "one line a rank";
}

TEST(GlooTransportTest, FiftyEpochsOfDataPlanesLeaveNothingBehind) {
  constexpr int n = 3;
  constexpr size_t kCount = 1 << 20;  // 4 MB a rank: the large allreduce's scratch
  auto epoch = [&]() {
    auto group = CreateGlooGroup(n, 0, 0, std::nullopt, [](int r) { return TestKeys(r, 3); });
    EXPECT_EQ(group.size(), size_t(n));
    RunRanks(group, [&](int r, Transport& t) {
      std::vector<float> v(kCount, static_cast<float>(r + 1));
      CollectiveOptions o;
      o.tag = 9;
      ASSERT_TRUE(t.AllreduceSum(v.data(), v.size(), DataType::kFloat32, o).ok());
      EXPECT_EQ(v[kCount - 1], 6.0f);
    });
    return group;
  };
  std::vector<std::unique_ptr<Transport>> previous = epoch();
  std::vector<std::unique_ptr<Transport>> current = epoch();
  const int threads = Threads();
  const uint64_t heap = HeapInUse();
  for (int e = 0; e < 50; ++e) {
    previous = std::move(current);
    current = epoch();
  }
  EXPECT_LE(SettledThreads(threads), threads) << "threads of earlier epochs' data planes:\n"
                                              << ThreadList();
  const uint64_t now = HeapInUse();
  EXPECT_LE(now, heap + heap / 20) << "in use " << now << " bytes, was " << heap;
}

// Issue X, finding 7: a peer's round message could say it had up to 4 GiB,
// and every node allocated (and zeroed) that much for it before anything
// else. A lying rank 1 (Gloo's API over microd's device, speaking the
// round's framing by hand) says 3 GiB, in a process that may use 1 GiB:
// rank 0's call fails with DataLoss naming it, nothing allocated, and the
// process lives. In a child process (the address-space limit).
void LyingRoundLengthAndExit() {
#if !defined(__SANITIZE_ADDRESS__)  // ASan's shadow takes terabytes of address space
  const rlimit limit{rlim_t{1} << 30, rlim_t{1} << 30};
  if (setrlimit(RLIMIT_AS, &limit) != 0) std::_Exit(10);
#endif
  rendezvous::InMemoryKeyValueStore store;
  const LinkModel model = LongLink();
  std::unique_ptr<Transport> victim;
  std::thread honest([&] {
    GlooOptions o;
    o.rank = 0;
    o.size = 2;
    o.store = &store;
    o.prefix = "lie";
    o.timeout = absl::Seconds(20);
    o.connections = 1;
    o.link_model = model;
    auto t = CreateGlooTransport(o);
    if (t.ok()) victim = *std::move(t);
  });
  // Rank 1: a device and a context of its own; the links' model shared
  // (the allgather CreateGlooTransport makes of it), then the lie.
  auto device = record::CreateDevice(record::DeviceOptions{});
  if (!device.ok()) std::_Exit(11);
  auto liar = std::make_shared<::gloo::rendezvous::Context>(1, 2);
  liar->setTimeout(std::chrono::seconds(20));
  GlooStoreAdapter adapter(&store, "lie", absl::Seconds(20));
  std::shared_ptr<::gloo::transport::Device> base = *device;
  liar->connectFullMesh(adapter, base);
  LinkModel mine = model, theirs;
  mine.ranks = 2;
  const uint64_t share = ::gloo::Slot::build(
      gloo_backend::kDirectAllgatherSlotPrefix,
      gloo_backend::GlooTag(MakeTag(0, TagKind::kControl), gloo_backend::GlooKind::kAllgather));
  auto in = liar->createUnboundBuffer(&theirs, sizeof theirs);
  auto out = liar->createUnboundBuffer(&mine, sizeof mine);
  in->recv(0, share + sizeof theirs);
  out->send(0, share + sizeof mine);
  in->waitRecv(std::chrono::seconds(20));
  out->waitSend(std::chrono::seconds(20));
  honest.join();
  if (victim == nullptr) std::_Exit(12);
  // The round's first transfer: its length (3 GiB), then a few bytes.
  const size_t inline_bytes = (victim->link_model()->InlineBytes() + 4095) / 4096 * 4096;
  std::string lie(64, 'x');
  const uint64_t claimed = uint64_t{3} << 30;
  std::memcpy(lie.data(), &claimed, sizeof claimed);
  auto forged = liar->createUnboundBuffer(lie.data(), lie.size());
  forged->send(0, static_cast<uint64_t>(::gloo::Slot::build(gloo_backend::kRoundSlotPrefix, 77)) +
                      (inline_bytes >> 12));
  CollectiveOptions o;
  o.tag = 77;
  o.deadline = absl::Now() + absl::Seconds(20);
  std::vector<std::string> from;
  const absl::Status s = victim->ExchangeRound("hello", &from, o);
  std::fprintf(stderr, "%s\n", s.ToString().c_str());
  std::_Exit(absl::IsDataLoss(s) && absl::StrContains(s.message(), "node 1") &&
                     absl::StrContains(s.message(), "nothing was allocated")
                 ? 0
                 : 13);
}

TEST(GlooTransportTest, APeersRoundLengthIsBoundedBeforeAnythingIsAllocated) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(LyingRoundLengthAndExit(), ::testing::ExitedWithCode(0), "");
}

// Three connections per pair: large allreduces go in parts over all of
// them, with the same bits (the contract suite's rank-order sums). Sealed:
// the whole suite again with every transfer sealed, on a short link (in
// step) and a long one (receives posted ahead, several connections).
INSTANTIATE_TEST_SUITE_P(
    Gloo, TransportContractTest,
    ::testing::Values(TransportBackend{"gloo", [](int size) { return CreateGlooGroup(size); }},
                      TransportBackend{"gloo_3_connections",
                                       [](int size) { return CreateGlooGroup(size, 0, 3); }},
                      TransportBackend{"gloo_sealed",
                                       [](int size) {
                                         return CreateGlooGroup(
                                             size, 0, 0, std::nullopt,
                                             [size](int r) { return TestKeys(r, size); });
                                       }},
                      TransportBackend{"gloo_sealed_long_link_3_connections",
                                       [](int size) {
                                         return CreateGlooGroup(
                                             size, 0, 3, LongLink(),
                                             [size](int r) { return TestKeys(r, size); });
                                       }}),
    [](const auto& info) { return info.param.name; });

}  // namespace microd::transport::testing
