// SPDX-License-Identifier: Apache-2.0
// The daemon's log: one line per message on stderr, each with a timestamp
// (UTC, microseconds), a level, the node's name and rank, and where in the
// source it was written; or one JSON object per line for log collectors.
//
//   MICROD_LOG(Info, "coordinator listening on %s", address);
//   MICROD_LOG(Warning, "bucket '%s': %s", name, why);
//
// Text:  2026-12-02 14:50:51.123456 INFO node0/0 coordinator.cc:112] job 'x' failed: ...
// JSON:  {"time":"2026-12-02T14:50:51.123456Z","level":"info","node":"node0","rank":0,
//         "source":"coordinator.cc:112","message":"job 'x' failed: ..."}
//
// Messages below the level (--log_level) are not formatted at all. Thread
// safe: each line is written whole, by one write.
#pragma once

#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace microd::log {

enum class Level { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };
enum class Format { kText, kJson };

// "debug", "info", "warning" or "error"; "text" or "json".
absl::StatusOr<Level> ParseLevel(absl::string_view name);
absl::StatusOr<Format> ParseFormat(absl::string_view name);
absl::string_view LevelName(Level level);

void SetLevel(Level level);
void SetFormat(Format format);
// The node's name and rank on every line from now on (rank < 0: not known
// yet, shown as "-").
void SetIdentity(std::string node, int rank);
void SetRank(int rank);

// Whether a message at `level` is written.
bool Enabled(Level level);
// Writes one message (the macro below calls it).
void Write(Level level, const char* file, int line, absl::string_view message);

// Tests: lines go to `sink` (the line without its newline) instead of
// stderr; an empty sink restores stderr.
using Sink = std::function<void(Level level, const std::string& line)>;
void SetSink(Sink sink);

// One line as Write formats it (without the newline).
std::string FormatLine(Format format, Level level, absl::Time when, absl::string_view node,
                       int rank, const char* file, int line, absl::string_view message);

}  // namespace microd::log

#define MICROD_LOG(severity, ...)                                                 \
  do {                                                                            \
    if (::microd::log::Enabled(::microd::log::Level::k##severity)) {              \
      ::microd::log::Write(::microd::log::Level::k##severity, __FILE__, __LINE__, \
                           ::absl::StrFormat(__VA_ARGS__));                       \
    }                                                                             \
  } while (0)
