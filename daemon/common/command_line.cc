// SPDX-License-Identifier: Apache-2.0
#include "daemon/common/command_line.h"

#include <cstdlib>
#include <iostream>

#include "absl/flags/internal/parse.h"
#include "absl/flags/internal/usage.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "microd/config.h"

namespace microd {

std::vector<char*> ParseCommandLine(int argc, char** argv) {
  namespace fi = absl::flags_internal;
  // --help lists the program's own flags (its main and the project's
  // libraries, e.g. the TLS flags), whatever its main file is called.
  absl::FlagsUsageConfig config;
  config.contains_help_flags = [](absl::string_view file) {
    return absl::StrContains(file, "daemon/");
  };
  config.contains_helpshort_flags = config.contains_help_flags;
  config.version_string = [] { return std::string("microd " MICROD_VERSION_STRING "\n"); };
  absl::SetFlagsUsageConfig(config);
  std::vector<char*> rest = fi::ParseCommandLineImpl(
      argc, argv, fi::ArgvListAction::kRemoveParsedArgs, fi::UsageFlagsAction::kIgnoreUsage,
      fi::OnUndefinedFlag::kAbortIfUndefined);
  // -1: no usage flag given; 0 or 1: one was, and was answered.
  if (fi::HandleUsageFlags(std::cout, absl::ProgramUsageMessage()) >= 0) {
    std::cout.flush();
    std::exit(0);
  }
  return rest;
}

}  // namespace microd
