// SPDX-License-Identifier: Apache-2.0
// One node's data-plane keys (seal.h): a secret per link of its own, the
// same at both ends, another for every other link, epoch, job, salt or
// secret; none for links between other nodes.
#include "daemon/transport/seal.h"

#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace microd::transport {
namespace {

const std::string kSecret(32, 's');

// What the coordinator hands node `self` of `nodes`: one salt per peer, the
// same for both ends of a link.
std::vector<std::string> Salts(int self, int nodes, char epoch_byte = 'e') {
  std::vector<std::string> salts(nodes);
  for (int p = 0; p < nodes; ++p) {
    if (p != self) {
      salts[p] =
          std::string(SealKeys::kSaltBytes,
                      static_cast<char>(epoch_byte + std::min(self, p) * 5 + std::max(self, p)));
    }
  }
  return salts;
}

std::unique_ptr<SealKeys> Keys(int self, uint64_t epoch = 1, const std::string& secret = kSecret,
                               const std::string& job = "job", char epoch_byte = 'e') {
  auto k = SealKeys::Derive(self, Salts(self, 4, epoch_byte), secret, job, epoch);
  EXPECT_TRUE(k.ok()) << k.status();
  return std::move(k).value();
}

TEST(SealTest, EachLinkHasASecretOfItsOwnTheSameAtBothEnds) {
  std::set<std::string> seen;
  for (int x = 0; x < 4; ++x) {
    for (int y = x + 1; y < 4; ++y) {
      const std::string s = *Keys(x)->LinkSecret(x, y);
      EXPECT_EQ(s.size(), 32u);
      EXPECT_EQ(s, *Keys(x)->LinkSecret(y, x));
      EXPECT_EQ(s, *Keys(y)->LinkSecret(x, y)) << "the other end";
      EXPECT_FALSE(absl::StrContains(s, kSecret));
      seen.insert(s);
    }
  }
  EXPECT_EQ(seen.size(), 6u);
  // Another epoch, job, secret or salt: other secrets.
  const std::string mine = *Keys(0)->LinkSecret(0, 1);
  for (const auto& other : {Keys(0, 2), Keys(0, 1, kSecret, "other job"),
                            Keys(0, 1, std::string(32, 't')), Keys(0, 1, kSecret, "job", 'f')}) {
    EXPECT_NE(*other->LinkSecret(0, 1), mine);
  }
}

// Issue X, finding 8: every member held every link's key, so a member could
// pose as another node to a third. Now a node holds its own links' alone.
TEST(SealTest, ANodeHoldsNoKeyOfOtherNodesLinks) {
  auto two = Keys(2);
  for (auto [a, b] : {std::pair{0, 1}, std::pair{1, 3}, std::pair{3, 0}}) {
    auto s = two->LinkSecret(a, b);
    ASSERT_FALSE(s.ok());
    EXPECT_TRUE(absl::StrContains(s.status().message(), "holds no key")) << s.status();
  }
  EXPECT_TRUE(two->LinkSecret(2, 0).ok());
}

// An epoch's keys need its salts, however long the job's secret: keys of
// the secret alone would be the same in every run of the job (issue X,
// finding 2: a coordinator that sent no salt).
TEST(SealTest, AnEpochWithoutItsSaltsIsRefused) {
  const std::string long_token(64, 't');
  for (const std::string& salt : {std::string(), std::string(31, 'e'), std::string(33, 'e')}) {
    std::vector<std::string> salts = Salts(0, 4);
    salts[2] = salt;
    auto k = SealKeys::Derive(0, salts, long_token, "job", 0);
    ASSERT_FALSE(k.ok()) << salt.size();
    EXPECT_EQ(k.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(k.status().message(), "salt")) << k.status();
  }
  // A membership with no salts at all (an older coordinator's).
  EXPECT_FALSE(SealKeys::Derive(0, {}, long_token, "job", 0).ok());
  // A job with certificates and no token keys from the salts alone.
  EXPECT_TRUE(SealKeys::Derive(0, Salts(0, 4), "", "job", 0).ok());
}

TEST(SealTest, BadArgumentsAreRefused) {
  EXPECT_FALSE(SealKeys::Derive(4, Salts(0, 4), kSecret, "job", 1).ok());
  std::vector<std::string> own = Salts(1, 4);
  own[1] = std::string(32, 'x');  // a salt for itself
  EXPECT_FALSE(SealKeys::Derive(1, own, kSecret, "job", 1).ok());
  auto k = Keys(1);
  for (auto [a, b] : {std::pair{1, 1}, std::pair{1, 4}, std::pair{-1, 1}}) {
    EXPECT_EQ(k->LinkSecret(a, b).status().code(), absl::StatusCode::kInvalidArgument) << a << b;
  }
}

}  // namespace
}  // namespace microd::transport
