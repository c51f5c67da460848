// SPDX-License-Identifier: Apache-2.0
// How a host thread paces its polls of device work it waits for with a
// deadline (a CUDA event, NCCL's asynchronous state): the waits of a step are
// mostly tens to hundreds of microseconds, so the first kSpin of a wait only
// yields between polls (a sleep costs the wake-up latency of the timer,
// ~50 us or more, each time); a longer wait naps kNap between polls, at most
// that late when the work completes. A doubling back-off would be up to its
// cap late on every long wait.
#pragma once

#include <chrono>
#include <thread>

namespace microd::kernels {

class PollPacer {
 public:
  static constexpr std::chrono::microseconds kSpin{2000};
  static constexpr std::chrono::microseconds kNap{50};

  // The pause before the next poll, `waited` into the wait: zero (a yield)
  // within kSpin, kNap after.
  static constexpr std::chrono::microseconds PauseAfter(std::chrono::nanoseconds waited) {
    return waited < kSpin ? std::chrono::microseconds{0} : kNap;
  }

  // Pauses as PauseAfter says for the time since this pacer was made.
  void Pause() const {
    const auto pause = PauseAfter(std::chrono::steady_clock::now() - start_);
    if (pause.count() == 0) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(pause);
    }
  }

 private:
  const std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

}  // namespace microd::kernels
