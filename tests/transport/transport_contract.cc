// SPDX-License-Identifier: Apache-2.0
#include "tests/transport/transport_contract.h"

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <numeric>

#include "absl/time/clock.h"

namespace microd::transport::testing {
namespace {

const size_t kCounts[] = {0, 1, 17, 20011, 100003};

CollectiveOptions Opts(uint32_t tag, absl::Duration timeout = absl::Seconds(30)) {
  CollectiveOptions o;
  o.tag = tag;
  o.deadline = absl::Now() + timeout;
  return o;
}

TEST_P(TransportContractTest, AllgatherFixed) {
  for (int n : GetParam().ranks) {
    auto group = GetParam().create(n);
    ASSERT_EQ(group.size(), size_t(n));
    for (size_t count : kCounts) {
      RunRanks(group, [&](int r, Transport& t) {
        EXPECT_EQ(t.rank(), r);
        EXPECT_EQ(t.size(), n);
        std::vector<uint32_t> in(count);
        for (size_t i = 0; i < count; ++i) in[i] = uint32_t(r * 1000003 + i);
        std::vector<uint32_t> out(count * n, 0xFFFFFFFF);
        ASSERT_TRUE(t.Allgather(in.data(), count * 4, out.data(), Opts(1)).ok());
        for (int q = 0; q < n; ++q) {
          for (size_t i = 0; i < count; ++i)
            ASSERT_EQ(out[q * count + i], uint32_t(q * 1000003 + i));
        }
      });
    }
  }
}

TEST_P(TransportContractTest, AllgatherVUnequalCounts) {
  for (int n : GetParam().ranks) {
    auto group = GetParam().create(n);
    for (size_t base : kCounts) {
      std::vector<size_t> bytes(n);
      // Unequal and some empty contributions, as per-node selections are.
      for (int q = 0; q < n; ++q) bytes[q] = 4 * ((q % 3 == 1) ? 0 : base + q * (base % 7 + 1));
      const size_t total = std::accumulate(bytes.begin(), bytes.end(), size_t{0});
      RunRanks(group, [&](int r, Transport& t) {
        std::vector<uint32_t> in(bytes[r] / 4);
        for (size_t i = 0; i < in.size(); ++i) in[i] = uint32_t(r << 24 | i);
        std::vector<uint32_t> out(total / 4 + 1);
        ASSERT_TRUE(t.AllgatherV(in.data(), bytes, out.data(), Opts(2)).ok());
        size_t off = 0;
        for (int q = 0; q < n; ++q) {
          for (size_t i = 0; i < bytes[q] / 4; ++i) ASSERT_EQ(out[off + i], uint32_t(q << 24 | i));
          off += bytes[q] / 4;
        }
      });
    }
  }
}

TEST_P(TransportContractTest, AllreduceSumAllTypesIdenticalOnEveryRank) {
  for (int n : GetParam().ranks) {
    auto group = GetParam().create(n);
    for (size_t count : kCounts) {
      std::vector<std::vector<float>> results(n);
      RunRanks(group, [&](int r, Transport& t) {
        std::vector<float> f(count);
        std::vector<int32_t> i32(count);
        std::vector<int64_t> i64(count);
        for (size_t i = 0; i < count; ++i) {
          f[i] = 0.1f * float(r + 1) + 1e-7f * float(i);
          i32[i] = int32_t(r + i);
          i64[i] = (int64_t(1) << 40) + r;
        }
        ASSERT_TRUE(t.AllreduceSum(f.data(), count, DataType::kFloat32, Opts(3)).ok());
        ASSERT_TRUE(t.AllreduceSum(i32.data(), count, DataType::kInt32, Opts(4)).ok());
        ASSERT_TRUE(t.AllreduceSum(i64.data(), count, DataType::kInt64, Opts(5)).ok());
        for (size_t i = 0; i < count; ++i) {
          float want = 0;
          for (int q = 0; q < n; ++q) want += 0.1f * float(q + 1) + 1e-7f * float(i);
          ASSERT_NEAR(f[i], want, 1e-5f * n);
          ASSERT_EQ(i32[i], int32_t(n * i + n * (n - 1) / 2));
          ASSERT_EQ(i64[i], n * (int64_t(1) << 40) + n * (n - 1) / 2);
        }
        results[r] = f;
      });
      for (int q = 1; q < n && count > 0; ++q) {
        ASSERT_EQ(0, std::memcmp(results[q].data(), results[0].data(), count * 4));
      }
    }
  }
}

// Float sums of every size (on the Gloo backend: all in one round, all at
// once, and segmented in step; chunks of unequal size) are the rank-order
// sums, bit for bit, where the backend promises it.
TEST_P(TransportContractTest, FloatSumsAreTheRankOrderSumsBitForBit) {
  if (!GetParam().rank_order_sums) GTEST_SKIP() << GetParam().name << " sums in its own order";
  for (const auto& [n, count] : std::vector<std::pair<int, size_t>>{
           {2, 3000017}, {3, 3000017}, {4, 3000017}, {3, 4001}, {4, 20011}, {7, 20011}}) {
    auto group = GetParam().create(n);
    auto value = [](int q, size_t i) {
      return (float(q) + 0.37f) * 1e-3f * float((i * 2654435761u) % 1000 + 1) * (q % 2 ? -1 : 1);
    };
    RunRanks(group, [&](int r, Transport& t) {
      std::vector<float> f(count);
      for (size_t i = 0; i < count; ++i) f[i] = value(r, i);
      ASSERT_TRUE(t.AllreduceSum(f.data(), count, DataType::kFloat32, Opts(21)).ok());
      for (size_t i = 0; i < count; ++i) {
        float want = value(0, i);
        for (int q = 1; q < n; ++q) want += value(q, i);
        ASSERT_EQ(0, std::memcmp(&f[i], &want, sizeof want))
            << "rank " << r << " of " << n << " element " << i << ": " << f[i] << " vs " << want;
      }
    });
  }
}

// bf16 and fp16 sums (the host backends): every rank's 2-byte values widened,
// summed in rank order in fp32, rounded once to nearest-even; every path
// (small, burst, segmented large). NCCL refuses them with a clear error.
TEST_P(TransportContractTest, HalfSumsAreWidenedSummedInRankOrderAndRoundedOnce) {
  auto bits_of = [](float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    return u;
  };
  // Reference roundings, from the definition (not the backends' code):
  // bf16 by the nearer of the two truncations, ties to even; fp16 by GCC's
  // _Float16.
  auto bf16 = [&](float x) -> uint16_t {
    const uint32_t lo = bits_of(x) & 0xffff0000u, hi = lo + 0x10000u;
    float flo, fhi;
    std::memcpy(&flo, &lo, sizeof flo);
    std::memcpy(&fhi, &hi, sizeof fhi);
    const double a = std::fabs(double(x) - flo), b = std::fabs(double(fhi) - x);
    return static_cast<uint16_t>((a < b || (a == b && ((lo >> 16) & 1u) == 0) ? lo : hi) >> 16);
  };
  auto f16 = [](float x) -> uint16_t {
    const _Float16 h = static_cast<_Float16>(x);
    uint16_t u;
    std::memcpy(&u, &h, sizeof u);
    return u;
  };
  auto widen = [](bool is_bf16, uint16_t h) {
    if (is_bf16) {
      const uint32_t u = uint32_t{h} << 16;
      float f;
      std::memcpy(&f, &u, sizeof f);
      return f;
    }
    _Float16 x;
    std::memcpy(&x, &h, sizeof x);
    return static_cast<float>(x);
  };
  for (const bool is_bf16 : {true, false}) {
    const DataType type = is_bf16 ? DataType::kBFloat16 : DataType::kFloat16;
    for (const auto& [n, count] :
         std::vector<std::pair<int, size_t>>{{2, 17}, {3, 20011}, {4, 100003}, {3, 3000017}}) {
      auto group = GetParam().create(n);
      auto value = [&](int q, size_t i) {
        const float v =
            (float(q) + 0.37f) * 1e-2f * float((i * 2654435761u) % 1000 + 1) * (q % 2 ? -1 : 1);
        return is_bf16 ? bf16(v) : f16(v);
      };
      RunRanks(group, [&](int r, Transport& t) {
        std::vector<uint16_t> h(count);
        for (size_t i = 0; i < count; ++i) h[i] = value(r, i);
        const absl::Status s = t.AllreduceSum(h.data(), count, type, Opts(41));
        if (!GetParam().rank_order_sums) {
          EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
          return;
        }
        ASSERT_TRUE(s.ok()) << s;
        for (size_t i = 0; i < count; ++i) {
          float sum = widen(is_bf16, value(0, i));
          for (int q = 1; q < n; ++q) sum += widen(is_bf16, value(q, i));
          const uint16_t want = is_bf16 ? bf16(sum) : f16(sum);
          ASSERT_EQ(h[i], want) << kernels::ElementTypeName(type) << " rank " << r << " of " << n
                                << " element " << i;
        }
      });
    }
  }
}

// AllreduceAverage: the bits of AllreduceSum, then a division, on every
// rank; or, where the backend cannot fold the division in, kUnimplemented
// with the data untouched and the transport still usable.
TEST_P(TransportContractTest, AllreduceAverageIsTheSumDividedOrUnimplemented) {
  for (int n : GetParam().ranks) {
    auto group = GetParam().create(n);
    for (size_t count : {size_t{0}, size_t{5}, size_t{100003}, size_t{3000017}}) {
      if (count > 1000000 && n > 4) continue;  // the lanes' split: n <= 4 suffice
      RunRanks(group, [&](int r, Transport& t) {
        std::vector<float> sum(count), avg(count);
        for (size_t i = 0; i < count; ++i) {
          sum[i] = avg[i] = (float(r) - 1.3f) * 1e-3f * float(i % 977 + 1);
        }
        const std::vector<float> mine = avg;
        ASSERT_TRUE(t.AllreduceSum(sum.data(), count, DataType::kFloat32, Opts(31)).ok());
        absl::Status s = t.AllreduceAverage(avg.data(), count, 7.0f, Opts(32));
        if (s.code() == absl::StatusCode::kUnimplemented) {
          ASSERT_TRUE(count == 0 ||
                      std::memcmp(avg.data(), mine.data(), count * sizeof(float)) == 0);
        } else {
          ASSERT_TRUE(s.ok()) << s;
          for (size_t i = 0; i < count; ++i) {
            const float want = sum[i] / 7.0f;
            ASSERT_EQ(0, std::memcmp(&avg[i], &want, sizeof want)) << "element " << i;
          }
        }
        int64_t v = 1;
        ASSERT_TRUE(t.AllreduceSum(&v, 1, DataType::kInt64, Opts(33)).ok());
        ASSERT_EQ(v, n);
      });
    }
  }
}

// A direct round: messages of any size (empty, a few bytes, past a
// backend's inline part), different from every rank, each delivered whole
// to every peer; with the receives posted ahead (Expect) or not.
TEST_P(TransportContractTest, ExchangeRoundDeliversEveryMessageWhole) {
  for (int n : GetParam().ranks) {
    auto group = GetParam().create(n);
    for (size_t base : {size_t{0}, size_t{1}, size_t{17}, size_t{20011}, size_t{300007}}) {
      auto message = [&](int q) {
        std::string m(base + (q % 3 == 1 ? 0 : 5 * q), '\0');
        for (size_t i = 0; i < m.size(); ++i) m[i] = static_cast<char>(q * 31 + i * 7);
        return m;
      };
      for (bool expect : {false, true}) {
        RunRanks(group, [&](int r, Transport& t) {
          const uint32_t tag = 40 + (expect ? 1 : 0);
          if (expect) t.Expect(tag, 128 << 10);
          std::vector<std::string> from;
          const absl::Status s = t.ExchangeRound(message(r), &from, Opts(tag));
          ASSERT_TRUE(s.ok()) << s;
          ASSERT_EQ(from.size(), size_t(n));
          for (int q = 0; q < n; ++q) ASSERT_EQ(from[q], message(q)) << "from rank " << q;
        });
      }
    }
  }
}

TEST_P(TransportContractTest, BarrierAndManyCollectivesInOrder) {
  for (int n : GetParam().ranks) {
    auto group = GetParam().create(n);
    RunRanks(group, [&](int r, Transport& t) {
      for (int i = 0; i < 50; ++i) {
        ASSERT_TRUE(t.Barrier(Opts(6)).ok());
        int64_t v = r;
        ASSERT_TRUE(t.AllreduceSum(&v, 1, DataType::kInt64, Opts(7)).ok());
        ASSERT_EQ(v, n * (n - 1) / 2);
      }
    });
  }
}

// A step's pattern: a checked header allgather, then calls whose shapes follow
// from the headers (shape_agreed), then checked calls again; every result as
// without the promise.
TEST_P(TransportContractTest, ShapeAgreedCallsBetweenCheckedOnes) {
  for (int n : GetParam().ranks) {
    auto group = GetParam().create(n);
    RunRanks(group, [&](int r, Transport& t) {
      for (int step = 0; step < 5; ++step) {
        const uint64_t mine = (r * 7 + step) % 5;  // this rank's count, 0 included
        std::vector<uint64_t> counts(n);
        ASSERT_TRUE(t.Allgather(&mine, sizeof mine, counts.data(), Opts(11)).ok());
        CollectiveOptions agreed = Opts(12);
        agreed.shape_agreed = true;
        std::vector<size_t> bytes(n);
        size_t total = 0;
        for (int q = 0; q < n; ++q) total += bytes[q] = counts[q] * sizeof(uint32_t);
        std::vector<uint32_t> in(mine, uint32_t(r << 16 | step));
        std::vector<uint32_t> out(total / sizeof(uint32_t) + 1, 0xFFFFFFFF);
        ASSERT_TRUE(t.AllgatherV(in.data(), bytes, out.data(), agreed).ok());
        size_t at = 0;
        for (int q = 0; q < n; ++q) {
          for (uint64_t i = 0; i < counts[q]; ++i) ASSERT_EQ(out[at++], uint32_t(q << 16 | step));
        }
        int64_t sum = static_cast<int64_t>(mine);
        ASSERT_TRUE(t.AllreduceSum(&sum, 1, DataType::kInt64, agreed).ok());
        int64_t want = 0;
        for (uint64_t c : counts) want += static_cast<int64_t>(c);
        ASSERT_EQ(sum, want);
        ASSERT_TRUE(t.Barrier(Opts(13)).ok());
      }
    });
  }
}

TEST_P(TransportContractTest, MissingRankFailsEveryoneByTheDeadline) {
  for (int n : {2, 4}) {
    auto group = GetParam().create(n);
    std::atomic<int> failed{0};
    const auto start = std::chrono::steady_clock::now();
    RunRanks(group, [&](int r, Transport& t) {
      if (r == n - 1) return;  // never calls
      int64_t v = 1;
      absl::Status s = t.AllreduceSum(&v, 1, DataType::kInt64, Opts(8, absl::Milliseconds(300)));
      EXPECT_FALSE(s.ok());
      failed += !s.ok();
      // Broken afterwards: later calls fail at once.
      EXPECT_FALSE(t.Barrier(Opts(9, absl::Seconds(30))).ok());
    });
    EXPECT_EQ(failed.load(), n - 1);
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  }
}

TEST_P(TransportContractTest, MismatchedCollectivesAreAnError) {
  auto group = GetParam().create(3);
  RunRanks(group, [&](int r, Transport& t) {
    int64_t v = 1;
    // A deadline of 1 s: a backend that cannot tell the calls apart fails
    // there (5 s cost the suite 20 s of waiting over its backends).
    absl::Status s = r == 1 ? t.Barrier(Opts(10, absl::Seconds(1)))
                            : t.AllreduceSum(&v, 1, DataType::kInt64, Opts(10, absl::Seconds(1)));
    EXPECT_FALSE(s.ok()) << "rank " << r;
  });
}

TEST_P(TransportContractTest, AbortEndsPendingCalls) {
  auto group = GetParam().create(3);
  RunRanks(group, [&](int r, Transport& t) {
    if (r == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      t.Abort(absl::CancelledError("test abort"));
      return;
    }
    absl::Status s = t.Barrier(Opts(11, absl::Seconds(30)));
    EXPECT_FALSE(s.ok());
  });
}

TEST_P(TransportContractTest, AbortEndsThisRanksCallInFlight) {
  auto group = GetParam().create(2);
  // Rank 0 waits in a barrier rank 1 never enters; another thread aborts it.
  absl::Status in_flight;
  const absl::Time start = absl::Now();
  std::thread caller([&] { in_flight = group[0]->Barrier(Opts(13, absl::Seconds(30))); });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  group[0]->Abort(absl::CancelledError("test abort"));
  caller.join();
  EXPECT_FALSE(in_flight.ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(10)) << "the abort did not end the call";
  // The transport is broken: the next call fails at once.
  const absl::Time next = absl::Now();
  int64_t v = 1;
  EXPECT_FALSE(group[0]->AllreduceSum(&v, 1, DataType::kInt64, Opts(14, absl::Seconds(30))).ok());
  EXPECT_LT(absl::Now() - next, absl::Seconds(2));
}

// Entries of /proc/self/<dir>: the process's descriptors or threads.
size_t CountEntries(const char* dir) {
  std::error_code ec;
  size_t n = 0;
  for (auto it = std::filesystem::directory_iterator(dir, ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    ++n;
  }
  return n;
}

// An elastic job's next epoch, as the transport sees it: one rank is lost
// (its endpoint destroyed, as a killed daemon's sockets close) while the
// others call a collective; they fail by the deadline, abort and are
// destroyed, and the survivors connect a new group among themselves in the
// same process, whose sums are theirs. Epoch after epoch, nothing leaks:
// no descriptor, no thread.
TEST_P(TransportContractTest, SurvivorsOfALostRankConnectANewGroup) {
  size_t fds = 0, threads = 0;
  for (int epoch = 0; epoch < 3; ++epoch) {
    SCOPED_TRACE(::testing::Message() << "epoch " << epoch);
    auto group = GetParam().create(3);
    ASSERT_EQ(group.size(), 3u);
    group[2].reset();  // lost
    const auto start = std::chrono::steady_clock::now();
    std::vector<std::thread> survivors;
    for (int r = 0; r < 2; ++r) {
      survivors.emplace_back([&, r] {
        int64_t v = 1;
        const absl::Status s =
            group[r]->AllreduceSum(&v, 1, DataType::kInt64, Opts(20, absl::Milliseconds(500)));
        EXPECT_FALSE(s.ok()) << "rank " << r;
        group[r]->Abort(absl::UnavailableError("rank 2 lost"));
      });
    }
    for (auto& t : survivors) t.join();
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
    group.clear();

    auto next = GetParam().create(2);
    ASSERT_EQ(next.size(), 2u);
    RunRanks(next, [&](int r, Transport& t) {
      std::vector<float> x(1001, float(r + 1));
      ASSERT_TRUE(t.AllreduceSum(x.data(), x.size(), DataType::kFloat32, Opts(21)).ok());
      for (float v : x) ASSERT_EQ(v, 3.0f);
    });
    next.clear();
    // The first epoch may set up what a backend keeps for the process.
    if (epoch == 0) {
      fds = CountEntries("/proc/self/fd");
      threads = CountEntries("/proc/self/task");
    } else {
      EXPECT_LE(CountEntries("/proc/self/fd"), fds);
      EXPECT_LE(SettledThreads(static_cast<int>(threads)), static_cast<int>(threads));
    }
  }
}

TEST_P(TransportContractTest, NullBuffersAreRefused) {
  auto group = GetParam().create(1);
  Transport& t = *group[0];
  EXPECT_EQ(t.AllreduceSum(nullptr, 4, DataType::kFloat32, Opts(12)).code(),
            absl::StatusCode::kInvalidArgument);
  const size_t wrong_len[] = {4, 4};
  uint32_t x = 0, y[2];
  EXPECT_EQ(t.AllgatherV(&x, wrong_len, y, Opts(13)).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
int SettledThreads(int at_most, absl::Duration settle) {
  const absl::Time deadline = absl::Now() + settle;
  int n = static_cast<int>(CountEntries("/proc/self/task"));
  while (n > at_most && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
    n = static_cast<int>(CountEntries("/proc/self/task"));
  }
  return n;
}

}  // namespace microd::transport::testing
