// SPDX-License-Identifier: Apache-2.0
// An emulated cluster for the multi-process tests: a lab of
// deploy/netlab/netlab.sh (every node in a network namespace of its own, on
// shaped links), made by Create and removed by the destructor, or by
// netlab's watcher when the test process dies first. The including target
// defines MICROD_NETLAB (netlab.sh) and MICROD_NETLAB_DELAY (the delay helper).
#pragma once

#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"

// Targets that include this only through daemon_cluster.h make no labs.
#ifndef MICROD_NETLAB
#define MICROD_NETLAB ""
#endif
#ifndef MICROD_NETLAB_DELAY
#define MICROD_NETLAB_DELAY ""
#endif

namespace microd::testing {

class NetLab {
 public:
  // Why a lab cannot be made here, "" when it can. Only a missing root is a
  // reason to skip: as root, a lab that cannot be made fails the test.
  static std::string SkipReason() {
    return geteuid() == 0 ? "" : "the emulated cluster needs root (network namespaces)";
  }

  // A lab of `nodes` nodes; `shape`: netlab.sh SHAPE options (--rate 1gbit ...).
  static absl::StatusOr<std::unique_ptr<NetLab>> Create(
      int nodes, const std::vector<std::string>& shape = {}) {
    if (std::string(MICROD_NETLAB).empty()) {
      return absl::FailedPreconditionError("this test binary was built without MICROD_NETLAB");
    }
    std::vector<std::string> args = {"up", absl::StrCat("--nodes=", nodes),
                                     absl::StrCat("--owner=", getpid())};
    args.insert(args.end(), shape.begin(), shape.end());
    auto out = Netlab(args);
    if (!out.ok()) return out.status();
    return std::unique_ptr<NetLab>(
        new NetLab(std::string(absl::StripAsciiWhitespace(*out)), nodes));
  }
  ~NetLab() { (void)Netlab({"down", name_}); }
  NetLab(const NetLab&) = delete;
  NetLab& operator=(const NetLab&) = delete;

  const std::string& name() const { return name_; }
  int nodes() const { return nodes_; }
  std::string ns(int r) const { return absl::StrCat(name_, "-n", r); }
  std::string addr(int r) const { return addrs_[r]; }
  // `args` run inside node r's namespace.
  std::vector<std::string> InNode(int r, const std::vector<std::string>& args) const {
    std::vector<std::string> wrapped = {"/usr/sbin/ip", "netns", "exec", ns(r)};
    wrapped.insert(wrapped.end(), args.begin(), args.end());
    return wrapped;
  }

  // Link changes while a job runs; node -1: every node.
  absl::Status Shape(int node, const std::vector<std::string>& shape) {
    std::vector<std::string> args = {"shape", name_, node < 0 ? "all" : std::to_string(node)};
    args.insert(args.end(), shape.begin(), shape.end());
    return Netlab(args).status();
  }
  absl::Status Cut(int node) { return Netlab({"cut", name_, std::to_string(node)}).status(); }
  absl::Status Partition(const std::vector<std::string>& groups) {
    std::vector<std::string> args = {"partition", name_};
    args.insert(args.end(), groups.begin(), groups.end());
    return Netlab(args).status();
  }
  absl::Status Heal() { return Netlab({"heal", name_}).status(); }
  // An attacker on the path into `node` (microd-netlab-tamper `options`);
  // what it did goes to `log`.
  absl::Status Tamper(int node, const std::string& log, const std::vector<std::string>& options) {
    std::vector<std::string> args = {"tamper", name_, std::to_string(node), "--log", log, "--"};
    args.insert(args.end(), options.begin(), options.end());
    return Netlab(args).status();
  }
  // tcpdump of every TCP packet crossing the switch into `pcap`, until
  // StopCapture.
  absl::Status Capture(const std::string& pcap) {
    return Netlab({"capture", name_, pcap}).status();
  }
  absl::Status StopCapture() { return Netlab({"capture", name_, "--stop"}).status(); }

 private:
  NetLab(std::string name, int nodes) : name_(std::move(name)), nodes_(nodes) {
    for (int r = 0; r < nodes; ++r) {
      auto a = Netlab({"addr", name_, std::to_string(r)});
      addrs_.push_back(a.ok() ? std::string(absl::StripAsciiWhitespace(*a)) : "");
    }
  }

  // Runs netlab.sh; its standard output, or an error with its standard error.
  static absl::StatusOr<std::string> Netlab(const std::vector<std::string>& args) {
    char err_path[] = "/tmp/microd-netlab-err-XXXXXX";
    const int err_fd = mkstemp(err_path);
    if (err_fd < 0) return absl::InternalError("mkstemp failed");
    close(err_fd);
    std::string cmd =
        absl::StrCat("NETLAB_DELAY_BIN='", MICROD_NETLAB_DELAY, "' '", MICROD_NETLAB, "'");
    for (const auto& a : args) absl::StrAppend(&cmd, " '", a, "'");
    absl::StrAppend(&cmd, " 2>'", err_path, "'");
    std::string out;
    FILE* p = popen(cmd.c_str(), "r");
    int status = -1;
    if (p != nullptr) {
      char buf[4096];
      size_t got;
      while ((got = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, got);
      status = pclose(p);
    }
    std::string err;
    if (FILE* f = fopen(err_path, "r"); f != nullptr) {
      char buf[4096];
      size_t got;
      while ((got = fread(buf, 1, sizeof buf, f)) > 0) err.append(buf, got);
      fclose(f);
    }
    unlink(err_path);
    if (status != 0) {
      return absl::UnavailableError(
          absl::StrCat("netlab.sh ", absl::StrJoin(args, " "), " failed: ", err));
    }
    return out;
  }

  const std::string name_;
  const int nodes_;
  std::vector<std::string> addrs_;
};

}  // namespace microd::testing
