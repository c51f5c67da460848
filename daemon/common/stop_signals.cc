// SPDX-License-Identifier: Apache-2.0
#include "daemon/common/stop_signals.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "daemon/common/log.h"

namespace microd {
namespace {

int g_stop_pipe[2] = {-1, -1};

const char* SignalName(int sig) { return sig == SIGTERM ? "SIGTERM" : "SIGINT"; }

// The signal handler only writes to a pipe (whichever thread the kernel
// delivers it to); this reads it.
struct Watcher {
  absl::Mutex mu;
  bool serving ABSL_GUARDED_BY(mu) = false;
  int signal ABSL_GUARDED_BY(mu) = 0;
};

Watcher& TheWatcher() {
  static Watcher* const watcher = new Watcher;  // never destroyed: its thread may outlive main
  return *watcher;
}

}  // namespace

absl::Status StopSignals::Install() {
  if (pipe2(g_stop_pipe, O_CLOEXEC) != 0) {
    return absl::InternalError(absl::StrCat("pipe2: ", std::strerror(errno)));
  }
  struct sigaction sa {};
  sa.sa_handler = [](int sig) {
    const int saved = errno;
    (void)!write(g_stop_pipe[1], &sig, sizeof sig);
    errno = saved;
  };
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);
  std::thread([] {
    int sig = 0;
    while (read(g_stop_pipe[0], &sig, sizeof sig) < 0 && errno == EINTR) {
    }
    Watcher& w = TheWatcher();
    absl::MutexLock lock(&w.mu);
    if (!w.serving) {
      MICROD_LOG(Info, "%s before the job started: exiting", SignalName(sig));
      std::fflush(stderr);
      std::_Exit(1);
    }
    w.signal = sig;
  }).detach();
  return absl::OkStatus();
}

void StopSignals::EnterServing() {
  Watcher& w = TheWatcher();
  absl::MutexLock lock(&w.mu);
  w.serving = true;
}

const char* StopSignals::Wait() {
  Watcher& w = TheWatcher();
  absl::MutexLock lock(&w.mu);
  w.mu.Await(absl::Condition(
      +[](int* s) { return *s != 0; }, &w.signal));
  return SignalName(w.signal);
}

}  // namespace microd
