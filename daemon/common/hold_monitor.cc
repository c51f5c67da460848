// SPDX-License-Identifier: Apache-2.0
#include "daemon/common/hold_monitor.h"

#include <algorithm>
#include <chrono>
#include <thread>

namespace microd {
namespace {

constexpr int64_t kTickUs = 100'000;
constexpr int64_t kLateUs = 500'000;  // a tick this late is a hold

int64_t NowUs() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

HoldMonitor& HoldMonitor::Process() {
  static HoldMonitor* const monitor = [] {
    auto* m = new HoldMonitor();
    std::thread([m] { m->Run(); }).detach();
    return m;
  }();
  return *monitor;
}

HoldMonitor::HoldMonitor() : last_tick_us_(NowUs()) {}

void HoldMonitor::Run() {
  for (;;) {
    std::this_thread::sleep_for(std::chrono::microseconds(kTickUs));
    const int64_t now = NowUs();
    const int64_t gap = now - last_tick_us_.load(std::memory_order_relaxed) - kTickUs;
    if (gap > kLateUs) {
      hold_us_.store(gap, std::memory_order_relaxed);
      hold_end_us_.store(now, std::memory_order_relaxed);
    }
    last_tick_us_.store(now, std::memory_order_relaxed);
  }
}

absl::Duration HoldMonitor::HeldWithin(absl::Duration within) const {
  const int64_t now = NowUs();
  int64_t held = 0;
  const int64_t under_way = now - last_tick_us_.load(std::memory_order_relaxed) - kTickUs;
  if (under_way > kLateUs) held = under_way;
  if (now - hold_end_us_.load(std::memory_order_relaxed) <= absl::ToInt64Microseconds(within)) {
    held = std::max(held, hold_us_.load(std::memory_order_relaxed));
  }
  return absl::Microseconds(held);
}

}  // namespace microd
