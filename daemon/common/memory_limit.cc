// SPDX-License-Identifier: Apache-2.0
#include "daemon/common/memory_limit.h"

#include <fstream>
#include <limits>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace microd {
namespace {

std::string Slurp(const std::string& path) {
  std::ifstream in(path);
  if (!in) return "";
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A limit file's number; 0 for "max", a missing file or anything else.
uint64_t LimitIn(const std::string& path) {
  uint64_t v = 0;
  const std::string text(absl::StripAsciiWhitespace(Slurp(path)));
  return absl::SimpleAtoi(text, &v) ? v : 0;
}

}  // namespace

MemoryLimit DetectMemoryLimitUnder(const std::string& root) {
  MemoryLimit best;
  best.bytes = std::numeric_limits<uint64_t>::max();
  auto consider = [&](uint64_t bytes, const std::string& source) {
    if (bytes > 0 && bytes < best.bytes) {
      best.bytes = bytes;
      best.source = source;
    }
  };
  // The machine's memory.
  for (absl::string_view line : absl::StrSplit(Slurp(root + "/proc/meminfo"), '\n')) {
    if (!absl::StartsWith(line, "MemTotal:")) continue;
    std::vector<absl::string_view> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
    uint64_t kib = 0;
    if (f.size() >= 2 && absl::SimpleAtoi(f[1], &kib)) consider(kib * 1024, "the machine's memory");
  }
  // cgroup v2: "0::/path"; the limit of every level up to the root applies.
  // cgroup v1: the memory controller's line, "N:memory:/path" (or a line
  // naming it among others).
  for (absl::string_view line : absl::StrSplit(Slurp(root + "/proc/self/cgroup"), '\n')) {
    std::vector<std::string> f = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (f.size() != 3) continue;
    if (f[0] == "0" && f[1].empty()) {
      for (std::string path = f[2];;) {
        const std::string dir = absl::StrCat(root, "/sys/fs/cgroup", path == "/" ? "" : path);
        consider(LimitIn(dir + "/memory.max"), absl::StrCat("the memory.max of cgroup ", path));
        if (path == "/" || path.empty()) break;
        const size_t slash = path.rfind('/');
        path = slash == 0 ? "/" : path.substr(0, slash);
      }
    } else if (absl::StrContains(absl::StrCat(",", f[1], ","), ",memory,")) {
      const std::string dir = absl::StrCat(root, "/sys/fs/cgroup/memory", f[2] == "/" ? "" : f[2]);
      uint64_t v = LimitIn(dir + "/memory.limit_in_bytes");
      if (v == 0) v = LimitIn(root + "/sys/fs/cgroup/memory/memory.limit_in_bytes");
      // v1 says "no limit" with a huge number (close to 2^63).
      if (v < (uint64_t{1} << 60)) consider(v, "the cgroup's memory.limit_in_bytes");
    }
  }
  if (best.bytes == std::numeric_limits<uint64_t>::max()) {
    best.bytes = 0;
    best.source = "nothing (no /proc/meminfo)";
  }
  return best;
}

MemoryLimit DetectMemoryLimit() { return DetectMemoryLimitUnder(""); }

}  // namespace microd
