// SPDX-License-Identifier: Apache-2.0
#include "daemon/common/log.h"

#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"

namespace microd::log {
namespace {

const absl::Time kWhen = absl::FromUnixMicros(1796223051123456);  // 2026-12-02 14:50:51.123456

class LogTest : public ::testing::Test {
 protected:
  void SetUp() override {
    SetSink([this](Level level, const std::string& line) {
      levels_.push_back(level);
      lines_.push_back(line);
    });
    SetLevel(Level::kInfo);
    SetFormat(Format::kText);
    SetIdentity("node-a", 2);
  }
  void TearDown() override {
    SetSink(nullptr);
    SetLevel(Level::kInfo);
    SetFormat(Format::kText);
    SetIdentity("", -1);
  }
  std::vector<Level> levels_;
  std::vector<std::string> lines_;
};

TEST(LogFormat, TextHasTimeToTheMicrosecondLevelNodeRankAndSource) {
  EXPECT_EQ(FormatLine(Format::kText, Level::kWarning, kWhen, "node0", 3,
                       "/src/daemon/engine/step_runner.cc", 185, "bucket 'b': slow"),
            "2026-12-02 14:50:51.123456 WARNING node0/3 step_runner.cc:185] bucket 'b': slow");
  // Before the node knows its rank (and its name), the line says so.
  EXPECT_EQ(FormatLine(Format::kText, Level::kInfo, kWhen, "", -1, "x.cc", 1, "starting"),
            "2026-12-02 14:50:51.123456 INFO microd/- x.cc:1] starting");
}

TEST(LogFormat, JsonIsOneEscapedObjectPerLine) {
  EXPECT_EQ(FormatLine(Format::kJson, Level::kError, kWhen, "n\"1", 0, "a/b.cc", 7,
                       "line one\nsaid \"no\"\t\\ \x01"),
            "{\"time\":\"2026-12-02T14:50:51.123456Z\",\"level\":\"error\",\"node\":\"n\\\"1\","
            "\"rank\":0,\"source\":\"b.cc:7\",\"message\":\"line one\\nsaid \\\"no\\\"\\t\\\\ "
            "\\u0001\"}");
  EXPECT_TRUE(absl::StrContains(
      FormatLine(Format::kJson, Level::kInfo, kWhen, "n", -1, "b.cc", 7, "m"), "\"rank\":null"));
}

TEST(LogParse, LevelsAndFormatsByName) {
  EXPECT_EQ(*ParseLevel("debug"), Level::kDebug);
  EXPECT_EQ(*ParseLevel("INFO"), Level::kInfo);
  EXPECT_EQ(*ParseLevel("warning"), Level::kWarning);
  EXPECT_EQ(*ParseLevel("error"), Level::kError);
  const auto bad = ParseLevel("verbose");
  ASSERT_FALSE(bad.ok());
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "'verbose'")) << bad.status();
  EXPECT_EQ(*ParseFormat("json"), Format::kJson);
  EXPECT_FALSE(ParseFormat("xml").ok());
}

TEST_F(LogTest, MessagesBelowTheLevelAreDropped) {
  MICROD_LOG(Debug, "not shown %d", 1);
  MICROD_LOG(Info, "shown %d", 2);
  SetLevel(Level::kWarning);
  MICROD_LOG(Info, "not shown %d", 3);
  MICROD_LOG(Warning, "shown %d", 4);
  MICROD_LOG(Error, "shown %d", 5);
  SetLevel(Level::kDebug);
  MICROD_LOG(Debug, "shown %d", 6);
  ASSERT_EQ(lines_.size(), 4u);
  EXPECT_TRUE(absl::EndsWith(lines_[0], "] shown 2"));
  EXPECT_TRUE(absl::EndsWith(lines_[3], "] shown 6"));
  EXPECT_EQ(levels_[1], Level::kWarning);
  EXPECT_TRUE(absl::StrContains(lines_[1], " WARNING node-a/2 log_test.cc:"));
}

TEST_F(LogTest, ArgumentsOfADroppedMessageAreNotEvaluated) {
  int calls = 0;
  auto count = [&calls] { return ++calls; };
  MICROD_LOG(Debug, "%d", count());
  EXPECT_EQ(calls, 0);
  MICROD_LOG(Info, "%d", count());
  EXPECT_EQ(calls, 1);
}

TEST_F(LogTest, IdentityAndFormatApplyToLaterLines) {
  MICROD_LOG(Info, "before");
  SetRank(5);
  SetFormat(Format::kJson);
  MICROD_LOG(Info, "after");
  ASSERT_EQ(lines_.size(), 2u);
  EXPECT_TRUE(absl::StrContains(lines_[0], " node-a/2 "));
  EXPECT_TRUE(absl::StartsWith(lines_[1], "{\"time\":\""));
  EXPECT_TRUE(absl::StrContains(lines_[1], "\"node\":\"node-a\",\"rank\":5,"));
}

TEST_F(LogTest, LinesFromManyThreadsStayWhole) {
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([t] {
      for (int i = 0; i < 200; ++i) MICROD_LOG(Info, "thread %d message %d", t, i);
    });
  }
  for (auto& th : threads) th.join();
  ASSERT_EQ(lines_.size(), 800u);
  for (const std::string& l : lines_) {
    ASSERT_TRUE(absl::StrContains(l, "] thread ")) << l;
    ASSERT_EQ(std::vector<std::string>(absl::StrSplit(l, "] ")).size(), 2u) << l;
  }
}

}  // namespace
}  // namespace microd::log
