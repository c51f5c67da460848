// SPDX-License-Identifier: Apache-2.0
#include "daemon/test_hooks.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>

namespace microd {

std::function<void(uint32_t tag)> ExitAtFromEnvironment() {
  const char* v = std::getenv("MICROD_TEST_EXIT_AT");
  long kind = -1, n = 0;
  if (v == nullptr || std::sscanf(v, "%ld:%ld", &kind, &n) != 2 || kind < 0 || n < 1) {
    return nullptr;
  }
  auto seen = std::make_shared<std::atomic<long>>(0);
  return [kind, n, seen](uint32_t tag) {
    if (static_cast<long>(tag & 0xffu) != kind || seen->fetch_add(1) + 1 != n) return;
    std::fprintf(stderr, "MICROD_TEST_EXIT_AT=%ld:%ld: exiting in the collective of tag %u\n", kind,
                 n, tag);
    std::fflush(stderr);
    std::_Exit(137);
  };
}

}  // namespace microd
