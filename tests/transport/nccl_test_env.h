// SPDX-License-Identifier: Apache-2.0
// Environment for NCCL ranks that are processes of one machine sharing one
// GPU (tests): each its own "host" (NCCL refuses two ranks of a
// communicator on one GPU of one host), talking over loopback sockets.
#pragma once

#include <unistd.h>  // environ

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace microd::testing {

// NAME=VALUE entries to add to a rank's environment: NCCL_HOSTID, and
// loopback, no InfiniBand, no NVLink SHARP, quiet logs unless this process's
// environment already sets them.
inline std::vector<std::string> NcclLoopbackVariables(const std::string& host_id) {
  std::vector<std::string> vars = {"NCCL_HOSTID=" + host_id};
  for (const char* kv :
       {"NCCL_SOCKET_IFNAME=lo", "NCCL_IB_DISABLE=1", "NCCL_NVLS_ENABLE=0", "NCCL_DEBUG=WARN"}) {
    const std::string name(kv, std::strchr(kv, '=') - kv);
    if (std::getenv(name.c_str()) == nullptr) vars.push_back(kv);
  }
  return vars;
}

// A rank process's whole environment: this process's, plus the above
// (variables already set win, except NCCL_HOSTID).
inline std::vector<std::string> NcclRankEnvironment(const std::string& host_id) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    if (std::strncmp(*e, "NCCL_HOSTID=", 12) != 0) env.push_back(*e);
  }
  for (std::string& v : NcclLoopbackVariables(host_id)) env.push_back(std::move(v));
  return env;
}

}  // namespace microd::testing
