// SPDX-License-Identifier: Apache-2.0
// The contract suite against the in-process transport.
#include "daemon/transport/inproc/inproc_transport.h"

#include "tests/transport/transport_contract.h"

namespace microd::transport::testing {

INSTANTIATE_TEST_SUITE_P(Inproc, TransportContractTest,
                         ::testing::Values(TransportBackend{"inproc", CreateInprocGroup}),
                         [](const auto& info) { return info.param.name; });

}  // namespace microd::transport::testing
