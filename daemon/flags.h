// SPDX-License-Identifier: Apache-2.0
// microd's command line: its flags, each also read from MICROD_<FLAG> in the
// environment (the command line wins), mapped onto a DaemonConfig.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/daemon.h"

namespace microd {

// Sets every microd flag whose MICROD_<NAME IN UPPER CASE> variable is set
// (call before parsing the command line, which then wins). The flags of
// the libraries (absl's --flagfile, --help, ...) have none.
absl::Status ApplyEnvironment();

// --log_level and --log_format.
absl::Status ConfigureLog();

// The flags as a DaemonConfig (the secrets read from their files), checked.
absl::StatusOr<DaemonConfig> DaemonConfigFromFlags();

}  // namespace microd
