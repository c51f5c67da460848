// SPDX-License-Identifier: Apache-2.0
#include "daemon/engine/timeline.h"

#include <time.h>

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "daemon/common/atomic_file.h"
#include "daemon/common/log.h"
#include "daemon/common/status_macros.h"
#include "microd/config.h"

namespace microd::engine {
namespace {

int64_t MonotonicNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// A JSON string's contents.
void AppendEscaped(std::string* out, const std::string& s) {
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '"' || c == '\\') {
      out->push_back('\\');
      out->push_back(ch);
    } else if (c < 0x20) {
      absl::StrAppendFormat(out, "\\u%04x", c);
    } else {
      out->push_back(ch);
    }
  }
}

// Nanoseconds as microseconds, exactly (trace-event times are in us).
void AppendMicros(std::string* out, int64_t ns) {
  absl::StrAppendFormat(out, "%d.%03d", ns / 1000, ns % 1000);
}

void AppendSpan(std::string* out, const char* name, const char* cat, int pid, uint32_t tid,
                int64_t begin_ns, int64_t end_ns, const std::string& args) {
  absl::StrAppendFormat(
      out, ",\n{\"name\":\"%s\",\"cat\":\"%s\",\"ph\":\"X\",\"pid\":%d,\"tid\":%d,\"ts\":", name,
      cat, pid, tid);
  AppendMicros(out, begin_ns);
  out->append(",\"dur\":");
  AppendMicros(out, end_ns - begin_ns);
  if (!args.empty()) absl::StrAppend(out, ",\"args\":{", args, "}");
  out->push_back('}');
}

// A step's spans in ns since the epoch: the phases in order, each from the
// end of the one before at the earliest; the waiting from the ready time to
// the first phase. end < 0: the phase did not run. False if none ran.
struct LaidStep {
  int64_t begin_ns = 0, end_ns = 0;  // the whole step
  std::array<int64_t, kPhases> begin{}, end{};
};

bool Laid(const TraceStep& step, LaidStep* l) {
  int64_t cursor = INT64_MIN;
  int first = -1;
  for (int p = static_cast<int>(Phase::kLocalSum); p < kPhases; ++p) {
    l->end[p] = -1;
    if (step.end[p] == absl::InfinitePast()) continue;
    l->begin[p] = std::max(absl::ToUnixNanos(step.begin[p]), cursor);
    l->end[p] = std::max(absl::ToUnixNanos(step.end[p]), l->begin[p]);
    cursor = l->end[p];
    if (first < 0) first = p;
  }
  if (first < 0) return false;
  const int w = static_cast<int>(Phase::kWaiting);
  l->end[w] = -1;
  l->begin_ns = l->begin[first];
  if (step.ready != absl::InfinitePast()) {
    l->begin_ns = std::min(absl::ToUnixNanos(step.ready), l->begin[first]);
    l->begin[w] = l->begin_ns;
    l->end[w] = l->begin[first];
  }
  l->end_ns = cursor;
  return true;
}

TimelineOptions AtLeastOne(TimelineOptions o) {
  o.steps = std::max<size_t>(o.steps, 1);
  o.every = std::max<uint64_t>(o.every, 1);
  return o;
}

}  // namespace

Timeline::Timeline(TimelineOptions options) : options_(AtLeastOne(options)) {}

void Timeline::SetNode(int rank, const std::string& name) {
  absl::MutexLock lock(&mu_);
  rank_ = rank;
  node_ = name;
}

void Timeline::Record(const std::string& bucket, const TraceStep& step) {
  if (!recording() || step.step % options_.every != 0) return;
  const int64_t t0 = MonotonicNs();
  absl::MutexLock lock(&mu_);
  auto [it, added] = tracks_.try_emplace(bucket, static_cast<uint32_t>(tracks_.size() + 1));
  // Room for the ring up front (up to 64 Ki entries, ~15 MiB), not while stepping.
  if (ring_.capacity() == 0) ring_.reserve(std::min<size_t>(options_.steps, 1 << 16));
  if (ring_.size() < options_.steps) {
    ring_.push_back({it->second, step});
  } else {
    ring_[next_] = {it->second, step};
    next_ = (next_ + 1) % ring_.size();
  }
  ++recorded_;
  record_ns_ += static_cast<uint64_t>(MonotonicNs() - t0);
}

Timeline::Counts Timeline::counts() const {
  absl::MutexLock lock(&mu_);
  Counts c;
  c.recorded = recorded_;
  c.kept = ring_.size();
  c.overwritten = recorded_ - ring_.size();
  c.record_ns_per_step =
      recorded_ == 0 ? 0 : static_cast<double>(record_ns_) / static_cast<double>(recorded_);
  return c;
}

std::string Timeline::ChromeJson(absl::Time since, uint64_t* steps) const {
  std::vector<Entry> entries;
  std::vector<std::string> names;  // by track - 1
  int rank;
  std::string node;
  {
    absl::MutexLock lock(&mu_);
    entries.reserve(ring_.size());
    // Oldest first.
    for (size_t i = 0; i < ring_.size(); ++i) entries.push_back(ring_[(next_ + i) % ring_.size()]);
    names.resize(tracks_.size());
    for (const auto& [name, track] : tracks_) names[track - 1] = name;
    rank = rank_;
    node = node_;
  }
  const Counts c = counts();
  const int64_t since_ns = since == absl::InfinitePast() ? INT64_MIN : absl::ToUnixNanos(since);
  std::string out =
      "{\"displayTimeUnit\":\"ms\",\"otherData\":{\"version\":\"" MICROD_VERSION_STRING
      "\",\"node\":\"";
  AppendEscaped(&out, node);
  absl::StrAppendFormat(&out,
                        "\",\"node_rank\":%d,\"every\":%d,\"ring_steps\":%d,\"steps_recorded\":%d,"
                        "\"steps_overwritten\":%d,\"record_ns_per_step\":%.1f},\n\"traceEvents\":[",
                        rank, options_.every, options_.steps, c.recorded, c.overwritten,
                        c.record_ns_per_step);
  out.append("\n{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":");
  absl::StrAppend(&out, rank, ",\"tid\":0,\"args\":{\"name\":\"microd node ", rank);
  if (!node.empty()) {
    out.append(" (");
    AppendEscaped(&out, node);
    out.append(")");
  }
  absl::StrAppend(&out, "\"}},\n{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":", rank,
                  ",\"tid\":0,\"args\":{\"sort_index\":", rank, "}}");
  std::vector<bool> named(names.size(), false);
  uint64_t n = 0;
  for (const Entry& e : entries) {
    LaidStep l;
    if (!Laid(e.step, &l) || l.begin_ns < since_ns) continue;
    ++n;
    if (!named[e.track - 1]) {
      named[e.track - 1] = true;
      absl::StrAppend(&out, ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":", rank,
                      ",\"tid\":", e.track, ",\"args\":{\"name\":\"");
      AppendEscaped(&out, names[e.track - 1]);
      absl::StrAppend(&out, "\"}},\n{\"name\":\"thread_sort_index\",\"ph\":\"M\",\"pid\":", rank,
                      ",\"tid\":", e.track, ",\"args\":{\"sort_index\":", e.track, "}}");
    }
    const TraceStep& t = e.step;
    const char* cat = t.dense ? "dense" : "sparse";
    const std::string args =
        t.dense ? absl::StrFormat("\"step\":%d,\"elements\":%d", t.step, t.selected)
                : absl::StrFormat("\"step\":%d,\"K\":%d,\"k\":%d,\"cre\":%.6g,\"threshold\":%.6g",
                                  t.step, t.selected, t.budget, t.cre, t.threshold);
    AppendSpan(&out, "step", cat, rank, e.track, l.begin_ns, l.end_ns, args);
    for (int p = 0; p < kPhases; ++p) {
      if (l.end[p] < 0) continue;
      AppendSpan(&out, PhaseName(static_cast<Phase>(p)), cat, rank, e.track, l.begin[p], l.end[p],
                 "");
    }
  }
  out.append("\n]}\n");
  if (steps != nullptr) *steps = n;
  return out;
}

absl::StatusOr<std::unique_ptr<TimelineFile>> TimelineFile::Start(Timeline* timeline,
                                                                  std::string path,
                                                                  absl::Duration interval) {
  std::unique_ptr<TimelineFile> f(new TimelineFile(timeline, std::move(path), interval));
  if (absl::Status s = f->Write(); !s.ok()) return s;
  timeline->Hold();
  f->thread_ = std::thread([p = f.get()] {
    bool reported = false;
    while (!p->stop_.WaitForNotificationWithTimeout(p->interval_)) {
      if (p->timeline_->counts().recorded == p->written_) continue;
      if (absl::Status s = p->Write(); !s.ok() && !reported) {
        MICROD_LOG(Warning, "--timeline: %s (will retry)", std::string(s.message()).c_str());
        reported = true;
      }
    }
  });
  return f;
}

TimelineFile::~TimelineFile() {
  stop_.Notify();
  if (thread_.joinable()) {
    thread_.join();
    timeline_->Release();
    if (absl::Status s = Write(); !s.ok()) {
      MICROD_LOG(Warning, "--timeline: %s", std::string(s.message()).c_str());
    }
  }
}

absl::Status TimelineFile::Write() {
  const uint64_t recorded = timeline_->counts().recorded;
  const std::string json = timeline_->ChromeJson();
  RETURN_IF_ERROR(WriteFileAtomically(path_, {json}));
  written_ = recorded;
  return absl::OkStatus();
}

}  // namespace microd::engine
