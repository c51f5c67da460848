// SPDX-License-Identifier: Apache-2.0
// HoldMonitor: a process stopped for a while knows it, whether its monitor
// ticked since (the hold recorded) or not yet (the hold under way), and a
// process not stopped reports less. Each case in a child process, which
// the test stops and continues.
#include "daemon/common/hold_monitor.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <thread>

#include "gtest/gtest.h"

namespace microd {
namespace {

// A child that starts its monitor, says so, waits `before_ms` after the
// parent's go (the monitor may tick meanwhile), and writes what
// HeldWithin(10 s) says (ms). The parent stops it for `stop_ms` before the
// go (0: not at all). Returns the child's figure, -1 on failure.
int64_t HeldInChild(int stop_ms, int before_ms) {
  int up[2], down[2];
  if (pipe(up) != 0 || pipe(down) != 0) return -1;
  const pid_t child = fork();
  if (child == 0) {
    HoldMonitor::Process();
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    char c = 'r';
    if (write(up[1], &c, 1) != 1 || read(down[0], &c, 1) != 1) _exit(1);
    std::this_thread::sleep_for(std::chrono::milliseconds(before_ms));
    const int64_t ms =
        absl::ToInt64Milliseconds(HoldMonitor::Process().HeldWithin(absl::Seconds(10)));
    _exit(write(up[1], &ms, sizeof ms) == sizeof ms ? 0 : 1);
  }
  char c;
  int64_t ms = -1;
  if (child > 0 && read(up[0], &c, 1) == 1) {
    if (stop_ms > 0) {
      kill(child, SIGSTOP);
      std::this_thread::sleep_for(std::chrono::milliseconds(stop_ms));
      kill(child, SIGCONT);
    }
    if (write(down[1], &c, 1) != 1 || read(up[0], &ms, sizeof ms) != sizeof ms) ms = -1;
  }
  if (child > 0) waitpid(child, nullptr, 0);
  for (int fd : {up[0], up[1], down[0], down[1]}) close(fd);
  return ms;
}

TEST(HoldMonitor, AStoppedProcessKnowsHowLong) {
  // Asked at once (the monitor's thread may not have run yet) and after it
  // ticked (the hold recorded).
  for (int before_ms : {0, 400}) {
    const int64_t ms = HeldInChild(1500, before_ms);
    EXPECT_GE(ms, 1300) << "asked " << before_ms << " ms after";
    EXPECT_LE(ms, 5000) << "asked " << before_ms << " ms after";
  }
}

// Not stopped: nothing like the stopped child's hold. (A machine under load
// may starve it past the monitor's half second: that is a hold too, so the
// bound is below the stop, not zero.)
TEST(HoldMonitor, AProcessNotStoppedSaysLess) {
  const int64_t ms = HeldInChild(0, 300);
  EXPECT_GE(ms, 0);
  EXPECT_LT(ms, 1000);
}

}  // namespace
}  // namespace microd
