// SPDX-License-Identifier: Apache-2.0
// Hooks the end-to-end tests drive the real daemon through, from the
// environment: unset (production), each is null and costs nothing.
#pragma once

#include <cstdint>
#include <functional>

namespace microd {

// MICROD_TEST_EXIT_AT="KIND:N": ends this process at once (a SIGKILL's
// effect: no goodbye, the kernel closes the connections) when it enters its
// N-th data-plane collective whose tag is of kind KIND, counted over every
// epoch's data plane (GlooOptions::on_collective). Null when unset.
std::function<void(uint32_t tag)> ExitAtFromEnvironment();

}  // namespace microd
