// SPDX-License-Identifier: Apache-2.0
// The link model's arithmetic: a direct round against the two-phase
// allreduce, the crossover between them, the inline size, and the model
// every rank shares.
#include "daemon/transport/link_model.h"

#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace microd::transport {
namespace {

TEST(LinkModel, DirectWinsWhileItsExtraBytesCostLessThanARound) {
  LinkModel m;
  m.ranks = 4;
  m.round_seconds = 0.050;         // a 50 ms round trip
  m.posted_round_seconds = 0.025;  // a one-way trip, the receives posted ahead
  m.bytes_per_second = 125e6;      // 1 Gbit/s
  // Direct: L/2 + 3 B / BW; two-phase: 2 L + 1.5 B / BW; equal at B = 1.5 L BW / 1.5.
  const double crossover = 0.075 * 125e6 / 1.5;
  EXPECT_TRUE(m.DirectCheaper(static_cast<size_t>(crossover * 0.99)));
  EXPECT_FALSE(m.DirectCheaper(static_cast<size_t>(crossover * 1.01)));
  EXPECT_NEAR(m.DirectSeconds(1 << 20), 0.025 + 3.0 * (1 << 20) / 125e6, 1e-12);
  EXPECT_NEAR(m.TwoPhaseSeconds(1 << 20), 0.100 + 1.5 * (1 << 20) / 125e6, 1e-12);
  // On a fast, near link the crossover is a few tens of KiB.
  m.round_seconds = 50e-6;
  m.posted_round_seconds = 25e-6;
  m.bytes_per_second = 2e9;
  EXPECT_TRUE(m.DirectCheaper(16 << 10));
  EXPECT_FALSE(m.DirectCheaper(256 << 10));
  // Two ranks: direct moves no more bytes than the two phases.
  m.ranks = 2;
  EXPECT_TRUE(m.DirectCheaper(size_t{1} << 30));
}

TEST(LinkModel, InlineBytesFollowWhatARoundCarries) {
  LinkModel m;
  m.posted_round_seconds = 0.050;
  m.bytes_per_second = 125e6;
  EXPECT_EQ(m.InlineBytes(), size_t{4} << 20);  // 6.25 MB, capped
  m.posted_round_seconds = 0.002;
  EXPECT_EQ(m.InlineBytes(), 250000u / 4096 * 4096);
  m.posted_round_seconds = 50e-6;
  EXPECT_EQ(m.InlineBytes(), size_t{64} << 10);  // floor
}

TEST(LinkModel, CombineTakesTheSlowestOfEach) {
  LinkModel a, b;
  a.round_seconds = 0.010;
  a.posted_round_seconds = 0.001;
  a.bytes_per_second = 1e9;
  a.ranks = 3;
  b.round_seconds = 0.002;
  b.posted_round_seconds = 0.002;
  b.bytes_per_second = 1e8;
  b.ranks = 3;
  const LinkModel c = LinkModel::Combine({a, b});
  EXPECT_EQ(c.round_seconds, 0.010);
  EXPECT_EQ(c.posted_round_seconds, 0.002);
  EXPECT_EQ(c.bytes_per_second, 1e8);
  EXPECT_EQ(c.ranks, 3);
}

// --link_model: the model given instead of measured, and each way to get
// it wrong named.
TEST(LinkModel, AGivenModelParsesAndPrintsBack) {
  auto m = ParseLinkModel("round_ms=1.5,posted_ms=1,mb_per_s=1000");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_DOUBLE_EQ(m->round_seconds, 0.0015);
  EXPECT_DOUBLE_EQ(m->posted_round_seconds, 0.001);
  EXPECT_DOUBLE_EQ(m->bytes_per_second, 1e9);
  EXPECT_EQ(FormatLinkModel(*m), "round_ms=1.5,posted_ms=1,mb_per_s=1000");
  // posted_ms is optional: half a round.
  m = ParseLinkModel("mb_per_s=125,round_ms=50");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_DOUBLE_EQ(m->posted_round_seconds, 0.025);
  for (const auto& [text, why] : std::vector<std::pair<std::string, std::string>>{
           {"round_ms=1", "round_ms and mb_per_s are needed"},
           {"round_ms=1,mb_per_s=-3", "mb_per_s must be a positive number"},
           {"round_ms=inf,mb_per_s=3", "round_ms must be a positive number"},
           {"round_ms=1,round_ms=2,mb_per_s=3", "round_ms given twice"},
           {"round_ms=1,mb_per_s=3,gbps=1", "unknown key 'gbps'"},
           {"round_ms=1,posted_ms=2,mb_per_s=3", "posted_ms is at most round_ms"},
           {"", "unknown key ''"}}) {
    auto bad = ParseLinkModel(text);
    ASSERT_FALSE(bad.ok()) << text;
    EXPECT_NE(bad.status().message().find(why), std::string::npos) << bad.status();
  }
}

}  // namespace
}  // namespace microd::transport
