// SPDX-License-Identifier: Apache-2.0
// The timeline: what it keeps (only while held, sampled, the last N steps),
// and the trace it writes: valid JSON, phases laid in order and nested in
// their step even when the clock steps back, names escaped.
#include "daemon/engine/timeline.h"

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace microd::engine {
namespace {

using google::protobuf::Struct;
using google::protobuf::Value;

const absl::Time kT0 = absl::FromUnixSeconds(1800000000);

absl::Time At(int64_t us) { return kT0 + absl::Microseconds(us); }

// A sparse step of 100 us per phase after 50 us of waiting, from `start`.
TraceStep Sparse(uint64_t step, int64_t start) {
  TraceStep t;
  t.step = step;
  t.selected = 10 + step;
  t.budget = 10;
  t.cre = 0.01;
  t.threshold = 1.5;
  t.ready = At(start);
  t.Span(Phase::kLocalSum, At(start + 50), At(start + 150));
  t.Span(Phase::kSelection, At(start + 150), At(start + 250));
  t.Span(Phase::kExchange, At(start + 250), At(start + 350));
  t.Span(Phase::kWriteBack, At(start + 350), At(start + 450));
  return t;
}

Struct Parse(const std::string& json) {
  Struct s;
  const auto status = google::protobuf::util::JsonStringToMessage(json, &s);
  EXPECT_TRUE(status.ok()) << status.ToString() << "\n" << json;
  return s;
}

// The "X" events, in trace order.
std::vector<Struct> Spans(const Struct& trace) {
  std::vector<Struct> out;
  for (const Value& v : trace.fields().at("traceEvents").list_value().values()) {
    if (v.struct_value().fields().at("ph").string_value() == "X") out.push_back(v.struct_value());
  }
  return out;
}

double Num(const Struct& s, const std::string& key) { return s.fields().at(key).number_value(); }
std::string Str(const Struct& s, const std::string& key) {
  return s.fields().at(key).string_value();
}

TEST(Timeline, KeepsNothingUnlessHeld) {
  Timeline tl({});
  tl.Record("b", Sparse(0, 0));
  EXPECT_EQ(tl.counts().recorded, 0u);
  tl.Hold();
  tl.Record("b", Sparse(1, 1000));
  tl.Release();
  tl.Record("b", Sparse(2, 2000));
  EXPECT_EQ(tl.counts().recorded, 1u);
  uint64_t steps = 0;
  const Struct trace = Parse(tl.ChromeJson(absl::InfinitePast(), &steps));
  EXPECT_EQ(steps, 1u);
  const std::vector<Struct> spans = Spans(trace);
  ASSERT_EQ(spans.size(), 6u);  // the step and its five phases
  EXPECT_EQ(Str(spans[0], "name"), "step");
  EXPECT_EQ(Num(spans[0].fields().at("args").struct_value(), "step"), 1);
  EXPECT_EQ(Num(spans[0].fields().at("args").struct_value(), "K"), 11);
  const char* phases[] = {"waiting", "local_sum", "selection", "exchange", "write_back"};
  for (int p = 0; p < 5; ++p) EXPECT_EQ(Str(spans[1 + p], "name"), phases[p]);
  // Microseconds since the epoch, exactly as recorded.
  EXPECT_EQ(Num(spans[0], "ts"), absl::ToUnixMicros(At(1000)));
  EXPECT_EQ(Num(spans[0], "dur"), 450);
  EXPECT_EQ(Num(spans[1], "dur"), 50);
}

TEST(Timeline, SamplesEveryNthStepAndKeepsTheLastOnesOldestFirst) {
  Timeline tl({/*steps=*/3, /*every=*/2});
  tl.Hold();
  for (uint64_t s = 0; s < 10; ++s) tl.Record("b", Sparse(s, 1000 * static_cast<int64_t>(s)));
  const Timeline::Counts c = tl.counts();
  EXPECT_EQ(c.recorded, 5u);  // 0, 2, 4, 6, 8
  EXPECT_EQ(c.kept, 3u);
  EXPECT_EQ(c.overwritten, 2u);
  std::vector<double> got;
  for (const Struct& s : Spans(Parse(tl.ChromeJson()))) {
    if (Str(s, "name") == "step") got.push_back(Num(s.fields().at("args").struct_value(), "step"));
  }
  EXPECT_EQ(got, (std::vector<double>{4, 6, 8}));
}

TEST(Timeline, ASinceTimeKeepsOnlyTheStepsThatBeganAfterIt) {
  Timeline tl({});
  tl.Hold();
  for (uint64_t s = 0; s < 4; ++s) tl.Record("b", Sparse(s, 1000 * static_cast<int64_t>(s)));
  uint64_t steps = 0;
  tl.ChromeJson(At(1500), &steps);
  EXPECT_EQ(steps, 2u);
}

TEST(Timeline, PhasesStayInOrderAndInsideTheirStepWhenTheClockStepsBack) {
  Timeline tl({});
  tl.Hold();
  TraceStep t = Sparse(0, 0);
  // The exchange measured as starting before the selection ended.
  t.Span(Phase::kExchange, At(100), At(120));
  tl.Record("b", t);
  const std::vector<Struct> spans = Spans(Parse(tl.ChromeJson()));
  ASSERT_EQ(spans.size(), 6u);
  const double step_end = Num(spans[0], "ts") + Num(spans[0], "dur");
  double cursor = Num(spans[0], "ts");
  for (size_t i = 1; i < spans.size(); ++i) {
    EXPECT_GE(Num(spans[i], "ts"), cursor) << Str(spans[i], "name");
    cursor = Num(spans[i], "ts") + Num(spans[i], "dur");
    EXPECT_LE(cursor, step_end) << Str(spans[i], "name");
  }
}

TEST(Timeline, BucketsGetTheirOwnNamedTracksAndNamesAreEscaped) {
  Timeline tl({});
  tl.SetNode(3, "host \"a\"");
  tl.Hold();
  TraceStep dense;
  dense.step = 0;
  dense.dense = true;
  dense.selected = dense.budget = 7;
  dense.Span(Phase::kLocalSum, At(0), At(10));
  dense.Span(Phase::kExchange, At(10), At(20));
  dense.Span(Phase::kWriteBack, At(20), At(30));
  tl.Record("layer\n\"1\"\\", dense);
  tl.Record("layer2", Sparse(0, 100));
  const Struct trace = Parse(tl.ChromeJson());
  std::vector<std::string> tracks;
  std::string process;
  for (const Value& v : trace.fields().at("traceEvents").list_value().values()) {
    const Struct& e = v.struct_value();
    EXPECT_EQ(Num(e, "pid"), 3);
    if (Str(e, "name") == "thread_name")
      tracks.push_back(Str(e.fields().at("args").struct_value(), "name"));
    if (Str(e, "name") == "process_name")
      process = Str(e.fields().at("args").struct_value(), "name");
  }
  EXPECT_EQ(tracks, (std::vector<std::string>{"layer\n\"1\"\\", "layer2"}));
  EXPECT_EQ(process, "microd node 3 (host \"a\")");
  // The dense step: no waiting (its ready time unknown) and no selection.
  const std::vector<Struct> spans = Spans(trace);
  ASSERT_EQ(spans.size(), 4u + 6u);
  EXPECT_EQ(Str(spans[0], "cat"), "dense");
  EXPECT_EQ(Str(spans[1], "name"), "local_sum");
  EXPECT_EQ(Num(spans[0].fields().at("args").struct_value(), "elements"), 7);
  EXPECT_NE(Num(spans[0], "tid"), Num(spans[4], "tid"));
}

}  // namespace
}  // namespace microd::engine
