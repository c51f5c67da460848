// SPDX-License-Identifier: Apache-2.0
// Where a test finds the programs it starts: the build tree's path, compiled
// in; or, where MICROD_BUILD_DIR names another folder with the build tree's
// layout (the GPU bundle of scripts/gpu-bundle.sh carries the tests away from
// this machine), the same file under that folder. MICROD_BUILD_ROOT is the
// build tree the paths were compiled in (tests/CMakeLists.txt).
#pragma once

#include <cstdlib>
#include <string>

namespace microd::testing {

inline std::string HelperPath(const std::string& built) {
  const char* moved = std::getenv("MICROD_BUILD_DIR");
  const std::string root = MICROD_BUILD_ROOT;
  if (moved == nullptr || *moved == '\0' || built.compare(0, root.size(), root) != 0) return built;
  return std::string(moved) + built.substr(root.size());
}

}  // namespace microd::testing
