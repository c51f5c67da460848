// SPDX-License-Identifier: Apache-2.0
// Hooks the end-to-end tests drive the real daemon through, from the
// environment: unset (production), each is null and costs nothing.
#pragma once

#include <cstdint>
#include <functional>

namespace microd {

// MICROD_TEST_EXIT_AT="KIND:N[:P]": ends this process at once (a SIGKILL's
// effect: no goodbye, the kernel closes the connections) in its N-th
// data-plane collective whose tag is of kind KIND (above 255: whose tag is
// KIND, the kind and the slot: transport::MakeTag), counted over every
// epoch's data plane (GlooOptions::on_collective): as it enters it, or,
// with P > 0, once a direct round's message went to P peers (the first in
// rank order) and not to the others. Null when unset.
std::function<void(uint32_t tag, int peers)> ExitAtFromEnvironment();

}  // namespace microd
