// SPDX-License-Identifier: Apache-2.0
// What a node's options ("--flag=value" lines, sent with its join) must
// share with the job's: the daemon's rule, which the coordinator calls
// (CoordinatorOptions::check_options) without reading the lines itself.
#pragma once

#include <string>

#include "absl/status/status.h"

namespace microd {

// `node` (its `options`) joining the job whose first node is `first`
// (`first_options`): at the start every node seals its data plane or none
// does; joining a `running` job every option must be the job's
// (InvalidArgument naming each that differs).
absl::Status CheckJoinOptions(const std::string& node, const std::string& options,
                              const std::string& first, const std::string& first_options,
                              bool running);

}  // namespace microd
