// SPDX-License-Identifier: Apache-2.0
// Whether this process was held: stopped (SIGSTOP, a debugger, a frozen
// container) or not scheduled (a starved machine). A thread of its own
// ticks every 100 ms; a tick that comes late by more than half a second is
// a hold. A failure that follows one says so: the other nodes judge this
// node by its silence, and a node held past the peer timeout was given up
// on, whatever error reaches it first once it runs again (issue Z's soak:
// node 0 paused 6 s failed saying only that node 1 closed a connection).
#pragma once

#include <atomic>
#include <cstdint>

#include "absl/time/time.h"

namespace microd {

class HoldMonitor {
 public:
  // The process's monitor, its thread started on the first call (the
  // daemon calls it as it starts; never stopped).
  static HoldMonitor& Process();

  // The longest hold that ended within `within` before now, or the one
  // under way (the thread has not ticked since); zero if none.
  absl::Duration HeldWithin(absl::Duration within) const;

  HoldMonitor(const HoldMonitor&) = delete;
  HoldMonitor& operator=(const HoldMonitor&) = delete;

 private:
  HoldMonitor();
  void Run();

  // Monotonic microseconds (steady clock): the last tick, and the last
  // hold's end and length. A torn read of the hold's two figures is
  // harmless: a failure's text is all they feed.
  std::atomic<int64_t> last_tick_us_;
  std::atomic<int64_t> hold_end_us_{0};
  std::atomic<int64_t> hold_us_{0};
};

}  // namespace microd
