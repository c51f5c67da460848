// SPDX-License-Identifier: Apache-2.0
// microd: the per-node sidecar. Joins the job through the coordinator (and
// serves it on node 0), connects the data plane, serves the training
// processes of this node on a Unix socket and the Admin service over gRPC
// (daemon.h). Every flag can also come from MICROD_<FLAG> in the environment
// (flags.h; the command line wins).
#include <malloc.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/flags/usage.h"
#include "daemon/common/command_line.h"
#include "daemon/common/log.h"
#include "daemon/common/stop_signals.h"
#include "daemon/daemon.h"
#include "daemon/flags.h"

namespace {

int Fatal(const absl::Status& s, int code = 1) {
  MICROD_LOG(Error, "%s", std::string(s.message()).c_str());
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "microd: sidecar daemon averaging gradients with MiCRO sparsification.\n"
      "  node 0: microd --coordinator_listen=0.0.0.0:7470 --nodes=4 --local_size=1\n"
      "  others: microd --coordinator=node0:7470 --local_size=1");
  // Large buffers (a step's indices and values, the transport's scratch)
  // come and go with k, which changes step by step (the warm-up's decay):
  // mapped from the system and returned on free, not kept in the heap,
  // where glibc's rising threshold would hold the largest ever seen (2.5x
  // the daemon's peak over a warm-up, docs/benchmarks.md). A user's
  // MALLOC_MMAP_THRESHOLD_ wins.
  if (std::getenv("MALLOC_MMAP_THRESHOLD_") == nullptr) mallopt(M_MMAP_THRESHOLD, 1 << 20);
  if (absl::Status s = microd::ApplyEnvironment(); !s.ok()) return Fatal(s, 2);
  microd::ParseCommandLine(argc, argv);
  if (absl::Status s = microd::ConfigureLog(); !s.ok()) {
    std::fprintf(stderr, "microd: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  if (absl::Status s = microd::StopSignals::Install(); !s.ok()) return Fatal(s);
  auto config = microd::DaemonConfigFromFlags();
  if (!config.ok()) return Fatal(config.status());
  auto daemon = microd::Daemon::Create(*std::move(config));
  if (!daemon.ok()) return Fatal(daemon.status());
  if (absl::Status s = (*daemon)->Start(microd::StopSignals::EnterServing); !s.ok())
    return Fatal(s);
  (*daemon)->Stop(microd::StopSignals::Wait());
  return 0;
}
