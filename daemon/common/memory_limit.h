// SPDX-License-Identifier: Apache-2.0
// How much memory this process may use: its cgroup's limit (v2 memory.max
// up the hierarchy, or v1 memory.limit_in_bytes), or the machine's memory,
// whichever is smaller. The daemon derives its default budgets from it.
#pragma once

#include <cstdint>
#include <string>

namespace microd {

struct MemoryLimit {
  uint64_t bytes = 0;
  std::string source;  // "the cgroup's memory.max", "the machine's memory", ...
};

MemoryLimit DetectMemoryLimit();

// Reads the limit from files under `root` (tests; "" is the real system):
// `root`/proc/self/cgroup, `root`/sys/fs/cgroup/..., `root`/proc/meminfo.
MemoryLimit DetectMemoryLimitUnder(const std::string& root);

}  // namespace microd
