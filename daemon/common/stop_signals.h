// SPDX-License-Identifier: Apache-2.0
// SIGTERM and SIGINT for a daemon: before it serves (joining a job can wait
// minutes for the other nodes) a stop signal ends the process at once, there
// being no work to finish and no socket yet; afterwards Wait() returns it for
// the orderly shutdown. SIGPIPE is ignored.
#pragma once

#include "absl/status/status.h"

namespace microd {

class StopSignals {
 public:
  // Installs the handlers and starts the thread that reads them (once per
  // process).
  static absl::Status Install();
  // From now on a stop signal waits for Wait().
  static void EnterServing();
  // Blocks until a stop signal arrives; returns its name ("SIGTERM").
  static const char* Wait();
};

}  // namespace microd
