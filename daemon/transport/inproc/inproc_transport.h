// SPDX-License-Identifier: Apache-2.0
// In-process transport: the ranks of a group are threads of one process
// (tests and the simulator). Sums are computed in rank order, so results are
// deterministic and identical on every rank.
#pragma once

#include <memory>
#include <vector>

#include "daemon/transport/transport.h"

namespace microd::transport {

// Creates `size` connected endpoints, rank i at index i; each is used by one
// thread. Returns an empty vector when size < 1.
std::vector<std::unique_ptr<Transport>> CreateInprocGroup(int size);

}  // namespace microd::transport
