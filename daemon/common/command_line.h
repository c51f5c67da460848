// SPDX-License-Identifier: Apache-2.0
// The command line of microd's programs: absl's flags, with --help (and
// --helpfull, --helpshort, ...) printed to stdout and ending the program
// with 0, as command-line tools do (absl alone ends it with 1, which
// container runtimes and scripts read as a failure). --version prints the
// version.
#pragma once

#include <vector>

namespace microd {

// Parses the flags (an unknown flag ends the program with absl's message);
// returns the positional arguments, argv[0] first.
std::vector<char*> ParseCommandLine(int argc, char** argv);

}  // namespace microd
