// SPDX-License-Identifier: Apache-2.0
// The event loop of microd's Gloo device: one thread, epoll, level-triggered.
// Handlers are called on the loop's thread, never two at once.
#pragma once

#include <sys/epoll.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace microd::transport::record {

class Loop {
 public:
  class Handler {
   public:
    virtual ~Handler() = default;
    // `events`: what epoll reported (EPOLLIN, EPOLLOUT, EPOLLHUP, ...).
    virtual void OnEvents(uint32_t events) = 0;
  };

  // Starts the thread; `tick` runs on it about every 100 ms (deadlines);
  // `nice` (0 to 19) is added to the thread's nice value.
  static absl::StatusOr<std::unique_ptr<Loop>> Start(int nice, std::function<void()> tick);
  // Stops and joins the thread; every handler must have been removed.
  ~Loop();

  // Watches `fd` for `events` with `handler` (not owned; it must stay until
  // Remove returned). Returns the registration's id.
  absl::StatusOr<uint64_t> Add(int fd, uint32_t events, Handler* handler);
  void Modify(uint64_t id, int fd, uint32_t events);
  // After it returns the handler is not called again, and no call of it is
  // running, unless Remove runs on the loop's own thread (then the call in
  // progress is the caller's). Never call it off the loop's thread while
  // holding a lock the handler takes.
  void Remove(uint64_t id, int fd);
  bool InLoop() const { return std::this_thread::get_id() == thread_id_.load(); }

 private:
  Loop(int epoll_fd, int wake_fd, std::function<void()> tick)
      : epoll_fd_(epoll_fd), wake_fd_(wake_fd), tick_(std::move(tick)) {}
  void Run(int nice);

  const int epoll_fd_;
  const int wake_fd_;
  const std::function<void()> tick_;
  std::thread thread_;
  std::atomic<std::thread::id> thread_id_{};
  std::atomic<bool> stop_{false};
  absl::Mutex mu_;
  std::map<uint64_t, Handler*> handlers_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t dispatching_ ABSL_GUARDED_BY(mu_) = 0;  // the registration being called
};

}  // namespace microd::transport::record
