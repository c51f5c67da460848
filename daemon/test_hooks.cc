// SPDX-License-Identifier: Apache-2.0
#include "daemon/test_hooks.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>

namespace microd {

std::function<void(uint32_t tag, int peers)> ExitAtFromEnvironment() {
  const char* v = std::getenv("MICROD_TEST_EXIT_AT");
  long kind = -1, n = 0, at = 0;
  if (v == nullptr || std::sscanf(v, "%ld:%ld:%ld", &kind, &n, &at) < 2 || kind < 0 || n < 1 ||
      at < 0) {
    return nullptr;
  }
  // The collectives of KIND begun so far: the N-th is the one (the
  // collectives of a kind run one after another).
  auto seen = std::make_shared<std::atomic<long>>(0);
  return [kind, n, at, seen](uint32_t tag, int peers) {
    if (static_cast<long>(kind > 0xff ? tag : tag & 0xffu) != kind) return;
    if (peers == 0 && seen->fetch_add(1) + 1 != n) return;
    if (seen->load() != n || peers != at) return;
    std::fprintf(stderr,
                 "MICROD_TEST_EXIT_AT=%ld:%ld:%ld: exiting in the collective of tag %u, its "
                 "message sent to %d peer(s)\n",
                 kind, n, at, tag, peers);
    std::fflush(stderr);
    std::_Exit(137);
  };
}

}  // namespace microd
