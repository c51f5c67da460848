// SPDX-License-Identifier: Apache-2.0
// Helpers for the multi-process tests: spawn programs, wait for them with a
// deadline (killing stragglers), read their output files.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

extern char** environ;

namespace microd::testing {

// A fresh directory under $TMPDIR (or /tmp) for this test's files.
inline std::string MakeTempDir(const std::string& name) {
  const char* base = std::getenv("TMPDIR");
  std::string tmpl = absl::StrCat(base ? base : "/tmp", "/microd-", name, "-XXXXXX");
  char* dir = mkdtemp(tmpl.data());
  EXPECT_NE(dir, nullptr);
  return tmpl;
}

// Starts argv[0] with the given arguments; output to `log` when given.
// `env`: NAME=VALUE entries added to (and overriding) this process's environment.
inline pid_t Spawn(const std::vector<std::string>& args, const std::string& log = "",
                   const std::vector<std::string>& env = {}) {
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::vector<char*> envp;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry = *e;
    const std::string name = entry.substr(0, entry.find('='));
    bool overridden = false;
    for (const auto& x : env) overridden = overridden || x.substr(0, x.find('=')) == name;
    if (!overridden) envp.push_back(*e);
  }
  for (const auto& x : env) envp.push_back(const_cast<char*>(x.c_str()));
  envp.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  if (!log.empty()) {
    posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    posix_spawn_file_actions_adddup2(&actions, 1, 2);
  }
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  EXPECT_EQ(rc, 0) << "cannot start " << args[0];
  return pid;
}

// Exit code of each process (-1 when killed by a signal). Processes still
// running at the deadline are killed and reported as a test failure.
inline std::vector<int> WaitAll(const std::vector<pid_t>& pids, std::chrono::seconds limit) {
  std::vector<int> codes(pids.size(), -2);
  const auto deadline = std::chrono::steady_clock::now() + limit;
  size_t left = pids.size();
  while (left > 0 && std::chrono::steady_clock::now() < deadline) {
    for (size_t i = 0; i < pids.size(); ++i) {
      if (codes[i] != -2) continue;
      int status = 0;
      if (waitpid(pids[i], &status, WNOHANG) == pids[i]) {
        codes[i] = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
        --left;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (size_t i = 0; i < pids.size(); ++i) {
    if (codes[i] == -2) {
      kill(pids[i], SIGKILL);
      waitpid(pids[i], nullptr, 0);
      ADD_FAILURE() << "process " << i << " did not finish in time (killed)";
    }
  }
  return codes;
}

// The whole file (empty when it cannot be read).
inline std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline std::vector<std::string> ReadLines(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string l; std::getline(in, l);) lines.push_back(l);
  return lines;
}

// Waits until `path` holds a number (a port written by a daemon).
inline int ReadPortFile(const std::string& path, std::chrono::seconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    std::ifstream in(path);
    int port = 0;
    if (in >> port && port > 0) return port;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ADD_FAILURE() << "no port in " << path;
  return 0;
}

// A raw connection to a daemon's socket (for speaking the wire protocol
// directly), retried for 5 s while the daemon starts; -1 when none.
inline int RawConnect(const std::string& path) {
  const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof addr.sun_path - 1);
  for (int i = 0; i < 200; ++i) {
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) return fd;
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  close(fd);
  return -1;
}

}  // namespace microd::testing
