// SPDX-License-Identifier: Apache-2.0
// Processes of the loopback benchmarks: spawning with a log, waiting with a
// limit, the port files the daemons write, and a cluster of daemons on
// loopback (node 0 serving the coordinator).
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"

extern char** environ;

namespace microd::bench {

// `name` in the directory of the program `self`.
inline std::string Sibling(const char* self, const std::string& name) {
  std::string s = self;
  const size_t slash = s.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : s.substr(0, slash);
  return dir + "/" + name;
}

// Starts `args` with stdout and stderr to `log`; -1 when it cannot.
inline pid_t Spawn(const std::vector<std::string>& args, const std::string& log) {
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  pid_t pid = -1;
  if (posix_spawn(&pid, argv[0], &fa, nullptr, argv.data(), environ) != 0) pid = -1;
  posix_spawn_file_actions_destroy(&fa);
  return pid;
}

// True when `pid` exited 0 within `limit` (killed after it).
inline bool WaitFor(pid_t pid, std::chrono::seconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

// The port a daemon wrote to `path` (0 when none came within 20 s).
inline int ReadPort(const std::string& path) {
  for (int i = 0; i < 1000; ++i) {
    std::ifstream in(path);
    int port = 0;
    if (in >> port && port > 0) return port;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return 0;
}

// n daemons on loopback, node r's socket at DIR/nR/sock and its log at
// DIR/daemonR.log, each with `flags` (and `per_node(r)`, when given); empty
// when node 0 did not start.
inline std::vector<pid_t> StartDaemons(
    const std::string& daemon, const std::string& dir, int n, const std::vector<std::string>& flags,
    const std::function<std::vector<std::string>(int)>& per_node = nullptr) {
  std::vector<pid_t> daemons;
  int coordinator_port = 0;
  for (int r = 0; r < n; ++r) {
    std::vector<std::string> args = {daemon,
                                     absl::StrCat("--socket=", dir, "/n", r, "/sock"),
                                     absl::StrCat("--nodes=", n),
                                     absl::StrCat("--node_rank=", r),
                                     absl::StrCat("--node_name=bench", r),
                                     "--admin=127.0.0.1:0"};
    for (const std::string& f : flags) args.push_back(f);
    if (per_node) {
      for (const std::string& f : per_node(r)) args.push_back(f);
    }
    if (r == 0) {
      args.push_back("--coordinator_listen=127.0.0.1:0");
      args.push_back(absl::StrCat("--coordinator_port_file=", dir, "/coordinator"));
    } else {
      args.push_back(absl::StrCat("--coordinator=127.0.0.1:", coordinator_port));
    }
    daemons.push_back(Spawn(args, absl::StrCat(dir, "/daemon", r, ".log")));
    if (r == 0 && (coordinator_port = ReadPort(dir + "/coordinator")) == 0) {
      kill(daemons[0], SIGKILL);
      waitpid(daemons[0], nullptr, 0);
      return {};
    }
  }
  return daemons;
}

inline std::string SocketOf(const std::string& dir, int r) {
  return absl::StrCat(dir, "/n", r, "/sock");
}

}  // namespace microd::bench
