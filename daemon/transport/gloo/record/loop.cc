// SPDX-License-Identifier: Apache-2.0
#include "daemon/transport/gloo/record/loop.h"

#include <sys/eventfd.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace microd::transport::record {
namespace {
constexpr uint64_t kWakeId = 0;
constexpr int kTickMs = 100;
}  // namespace

absl::StatusOr<std::unique_ptr<Loop>> Loop::Start(int nice, std::function<void()> tick) {
  const int ep = epoll_create1(EPOLL_CLOEXEC);
  if (ep < 0) return absl::InternalError(absl::StrCat("epoll_create1: ", strerror(errno)));
  const int wake = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake < 0) {
    close(ep);
    return absl::InternalError(absl::StrCat("eventfd: ", strerror(errno)));
  }
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = kWakeId;
  if (epoll_ctl(ep, EPOLL_CTL_ADD, wake, &ev) != 0) {
    close(wake);
    close(ep);
    return absl::InternalError(absl::StrCat("epoll_ctl: ", strerror(errno)));
  }
  std::unique_ptr<Loop> loop(new Loop(ep, wake, std::move(tick)));
  loop->thread_ = std::thread([l = loop.get(), nice] { l->Run(nice); });
  return loop;
}

Loop::~Loop() {
  stop_ = true;
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof one);
  if (thread_.joinable()) thread_.join();
  close(wake_fd_);
  close(epoll_fd_);
}

void Loop::Run(int nice) {
  thread_id_ = std::this_thread::get_id();
  if (nice > 0) {
    const id_t tid = static_cast<id_t>(gettid());
    errno = 0;
    const int current = getpriority(PRIO_PROCESS, tid);
    if (errno == 0) (void)setpriority(PRIO_PROCESS, tid, std::min(19, current + nice));
  }
  epoll_event events[64];
  while (!stop_) {
    const int n = epoll_wait(epoll_fd_, events, 64, kTickMs);
    for (int i = 0; i < n && !stop_; ++i) {
      const uint64_t id = events[i].data.u64;
      if (id == kWakeId) {
        uint64_t v;
        (void)!read(wake_fd_, &v, sizeof v);
        continue;
      }
      Handler* h = nullptr;
      {
        absl::MutexLock lock(&mu_);
        auto it = handlers_.find(id);
        if (it == handlers_.end()) continue;  // removed after epoll_wait returned
        h = it->second;
        dispatching_ = id;
      }
      h->OnEvents(events[i].events);
      absl::MutexLock lock(&mu_);
      dispatching_ = 0;
    }
    if (tick_) tick_();
  }
}

absl::StatusOr<uint64_t> Loop::Add(int fd, uint32_t events, Handler* handler) {
  absl::MutexLock lock(&mu_);
  const uint64_t id = next_id_++;
  epoll_event ev{};
  ev.events = events;
  ev.data.u64 = id;
  if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
    return absl::InternalError(absl::StrCat("epoll_ctl ADD: ", strerror(errno)));
  }
  handlers_[id] = handler;
  return id;
}

void Loop::Modify(uint64_t id, int fd, uint32_t events) {
  absl::MutexLock lock(&mu_);
  if (handlers_.count(id) == 0) return;
  epoll_event ev{};
  ev.events = events;
  ev.data.u64 = id;
  (void)epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, fd, &ev);
}

void Loop::Remove(uint64_t id, int fd) {
  absl::MutexLock lock(&mu_);
  if (handlers_.erase(id) > 0) (void)epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);
  if (InLoop()) return;
  auto idle = [this, id]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return dispatching_ != id; };
  mu_.Await(absl::Condition(&idle));
}

}  // namespace microd::transport::record
