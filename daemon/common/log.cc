// SPDX-License-Identifier: Apache-2.0
#include "daemon/common/log.h"

#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace microd::log {
namespace {

std::atomic<int> g_level{static_cast<int>(Level::kInfo)};

struct State {
  absl::Mutex mu;
  Format format ABSL_GUARDED_BY(mu) = Format::kText;
  std::string node ABSL_GUARDED_BY(mu);
  int rank ABSL_GUARDED_BY(mu) = -1;
  Sink sink ABSL_GUARDED_BY(mu);
};

State& state() {
  static State* s = new State;  // never destroyed: threads may log at exit
  return *s;
}

absl::string_view Basename(const char* file) {
  absl::string_view f(file);
  const size_t slash = f.rfind('/');
  return slash == absl::string_view::npos ? f : f.substr(slash + 1);
}

void AppendJsonString(std::string* out, absl::string_view s) {
  out->push_back('"');
  for (const char c : s) {
    switch (c) {
      case '"':
        out->append("\\\"");
        break;
      case '\\':
        out->append("\\\\");
        break;
      case '\n':
        out->append("\\n");
        break;
      case '\r':
        out->append("\\r");
        break;
      case '\t':
        out->append("\\t");
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          absl::StrAppendFormat(out, "\\u%04x", static_cast<unsigned char>(c));
        } else {
          out->push_back(c);
        }
    }
  }
  out->push_back('"');
}

void WriteAll(const std::string& line) {
  const char* p = line.data();
  size_t left = line.size();
  while (left > 0) {
    const ssize_t n = ::write(STDERR_FILENO, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // nowhere to report it
    p += n;
    left -= static_cast<size_t>(n);
  }
}

}  // namespace

absl::StatusOr<Level> ParseLevel(absl::string_view name) {
  const std::string n = absl::AsciiStrToLower(name);
  if (n == "debug") return Level::kDebug;
  if (n == "info") return Level::kInfo;
  if (n == "warning" || n == "warn") return Level::kWarning;
  if (n == "error") return Level::kError;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown log level '", name, "' (debug, info, warning or error)"));
}

absl::StatusOr<Format> ParseFormat(absl::string_view name) {
  if (name == "text") return Format::kText;
  if (name == "json") return Format::kJson;
  return absl::InvalidArgumentError(absl::StrCat("unknown log format '", name, "' (text or json)"));
}

absl::string_view LevelName(Level level) {
  switch (level) {
    case Level::kDebug:
      return "debug";
    case Level::kInfo:
      return "info";
    case Level::kWarning:
      return "warning";
    case Level::kError:
      return "error";
  }
  return "info";
}

void SetLevel(Level level) { g_level.store(static_cast<int>(level), std::memory_order_relaxed); }

void SetFormat(Format format) {
  absl::MutexLock lock(&state().mu);
  state().format = format;
}

void SetIdentity(std::string node, int rank) {
  absl::MutexLock lock(&state().mu);
  state().node = std::move(node);
  state().rank = rank;
}

void SetRank(int rank) {
  absl::MutexLock lock(&state().mu);
  state().rank = rank;
}

bool Enabled(Level level) {
  return static_cast<int>(level) >= g_level.load(std::memory_order_relaxed);
}

void SetSink(Sink sink) {
  absl::MutexLock lock(&state().mu);
  state().sink = std::move(sink);
}

std::string FormatLine(Format format, Level level, absl::Time when, absl::string_view node,
                       int rank, const char* file, int line, absl::string_view message) {
  const std::string source = absl::StrCat(Basename(file), ":", line);
  if (format == Format::kJson) {
    std::string out = "{\"time\":";
    AppendJsonString(&out, absl::FormatTime("%Y-%m-%dT%H:%M:%E6SZ", when, absl::UTCTimeZone()));
    out.append(",\"level\":");
    AppendJsonString(&out, LevelName(level));
    out.append(",\"node\":");
    AppendJsonString(&out, node);
    out.append(",\"rank\":");
    out.append(rank < 0 ? "null" : std::to_string(rank));
    out.append(",\"source\":");
    AppendJsonString(&out, source);
    out.append(",\"message\":");
    AppendJsonString(&out, message);
    out.push_back('}');
    return out;
  }
  std::string upper = absl::AsciiStrToUpper(LevelName(level));
  return absl::StrCat(absl::FormatTime("%Y-%m-%d %H:%M:%E6S", when, absl::UTCTimeZone()), " ",
                      upper, " ", node.empty() ? "microd" : node, "/",
                      rank < 0 ? std::string("-") : std::to_string(rank), " ", source, "] ",
                      message);
}

void Write(Level level, const char* file, int line, absl::string_view message) {
  if (!Enabled(level)) return;
  const absl::Time now = absl::Now();
  State& s = state();
  absl::MutexLock lock(&s.mu);
  std::string text = FormatLine(s.format, level, now, s.node, s.rank, file, line, message);
  if (s.sink) {
    s.sink(level, text);
    return;
  }
  text.push_back('\n');
  WriteAll(text);
}

}  // namespace microd::log
