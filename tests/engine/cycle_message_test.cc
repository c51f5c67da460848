// SPDX-License-Identifier: Apache-2.0
// The response-cache cycle's message on its own (no transport): encode /
// decode round trips for layouts with bit words to spare and an odd number
// of floats, refusals of a message out of step, and the intersection.
#include "daemon/engine/cycle_message.h"

#include <cstring>

#include "gtest/gtest.h"

namespace microd::engine {
namespace {

TEST(CycleMessage, EncodeDecodeRoundTrips) {
  for (uint64_t ids : {0, 1, 63, 64, 65, 130}) {
    for (uint64_t floats : {0, 1, 7, 8}) {
      CycleMessage m = CycleMessage::Empty(ids, floats);
      m.batches_received = 1234567 + ids;
      for (uint64_t i = 0; i < ids; i += 3) m.SetReady(i);
      for (uint64_t i = 0; i < ids; i += 6) m.SetSent(i);
      for (uint64_t f = 0; f < floats; ++f) m.area[f] = 0.5f * f - 1.25f;
      const std::vector<uint64_t> words = m.Encode();
      ASSERT_EQ(words.size(), CycleMessage::Words(ids, floats));
      auto back = CycleMessage::Decode(words, ids, floats);
      ASSERT_TRUE(back.ok()) << back.status();
      EXPECT_EQ(back->batches_received, m.batches_received);
      EXPECT_EQ(back->ids, ids);
      for (uint64_t i = 0; i < ids; ++i) {
        EXPECT_EQ(back->IsReady(i), i % 3 == 0) << i;
        EXPECT_EQ(back->IsSent(i), i % 6 == 0) << i;
      }
      ASSERT_EQ(back->area.size(), floats);
      EXPECT_EQ(0, floats == 0 ? 0 : std::memcmp(back->area.data(), m.area.data(), floats * 4));
    }
  }
}

TEST(CycleMessage, AMessageOutOfStepIsRefused) {
  CycleMessage m = CycleMessage::Empty(70, 3);
  std::vector<uint64_t> words = m.Encode();
  // Another node knows 71 cached buckets (same number of words here).
  words[1] = 71;
  auto s = CycleMessage::Decode(words, 70, 3);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInternal);
  EXPECT_NE(s.status().message().find("out of step"), std::string::npos) << s.status();
  // A message of the wrong size.
  words.push_back(0);
  EXPECT_EQ(CycleMessage::Decode(words, 70, 3).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CycleMessage, IntersectAgreesOnWhatEveryNodeHas) {
  const uint64_t ids = 100;
  std::vector<CycleMessage> nodes;
  for (int r = 0; r < 3; ++r) {
    CycleMessage m = CycleMessage::Empty(ids, 4);
    m.batches_received = 10 - r;  // node 2 has received the fewest
    for (uint64_t i = 0; i < ids; ++i) {
      if (i % (r + 2) == 0) m.SetReady(i);               // ready here
      if (i % (r + 2) == 0 && i % 5 == 0) m.SetSent(i);  // sent along
    }
    nodes.push_back(m);
  }
  // A bucket one node sent but another has not ready is not reduced.
  nodes[0].SetSent(1);
  const CycleAgreement a = Intersect(nodes);
  EXPECT_EQ(a.batches, 8u);
  for (uint64_t i = 0; i < ids; ++i) {
    const bool everywhere = i % 2 == 0 && i % 3 == 0 && i % 4 == 0;
    EXPECT_EQ(a.IsReady(i), everywhere) << i;
    EXPECT_EQ(a.IsSent(i), everywhere && i % 5 == 0) << i;
  }
  EXPECT_FALSE(a.IsSent(1));
}

}  // namespace
}  // namespace microd::engine
