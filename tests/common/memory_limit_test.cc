// SPDX-License-Identifier: Apache-2.0
// The memory limit the daemon's default budgets come from, read from a
// made-up /proc and /sys/fs/cgroup: cgroup v2 up the hierarchy, v1, and the
// machine's memory when no cgroup limits the process.
#include "daemon/common/memory_limit.h"

#include <stdlib.h>

#include <filesystem>
#include <fstream>

#include "gtest/gtest.h"

namespace microd {
namespace {

class MemoryLimitTest : public ::testing::Test {
 protected:
  void Write(const std::string& path, const std::string& text) {
    std::filesystem::create_directories(std::filesystem::path(root_ + path).parent_path());
    std::ofstream(root_ + path) << text;
  }
  void TearDown() override { std::filesystem::remove_all(root_); }
  std::string root_ = [] {
    std::string t = std::filesystem::temp_directory_path().string() + "/microd-memlimit-XXXXXX";
    return std::string(mkdtemp(t.data()));
  }();
};

TEST_F(MemoryLimitTest, CgroupV2TakesTheSmallestLimitUpTheHierarchy) {
  Write("/proc/meminfo", "MemTotal:       24000000 kB\nMemFree:        1000 kB\n");
  Write("/proc/self/cgroup", "0::/kubepods/pod1/sidecar\n");
  Write("/sys/fs/cgroup/memory.max", "max\n");
  Write("/sys/fs/cgroup/kubepods/memory.max", "max\n");
  Write("/sys/fs/cgroup/kubepods/pod1/memory.max", "8589934592\n");
  Write("/sys/fs/cgroup/kubepods/pod1/sidecar/memory.max", "4294967296\n");
  const MemoryLimit l = DetectMemoryLimitUnder(root_);
  EXPECT_EQ(l.bytes, 4294967296u);
  EXPECT_EQ(l.source, "the memory.max of cgroup /kubepods/pod1/sidecar");
}

TEST_F(MemoryLimitTest, CgroupV1AndNoLimitFallBackToTheMachine) {
  Write("/proc/meminfo", "MemTotal:       1000 kB\n");
  Write("/proc/self/cgroup", "12:cpu,cpuacct:/x\n11:memory:/\n0::/\n");
  Write("/sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n");  // none
  MemoryLimit l = DetectMemoryLimitUnder(root_);
  EXPECT_EQ(l.bytes, 1024000u);
  EXPECT_EQ(l.source, "the machine's memory");
  Write("/sys/fs/cgroup/memory/memory.limit_in_bytes", "512000\n");
  l = DetectMemoryLimitUnder(root_);
  EXPECT_EQ(l.bytes, 512000u);
  EXPECT_EQ(l.source, "the cgroup's memory.limit_in_bytes");
}

}  // namespace
}  // namespace microd
