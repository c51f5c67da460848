// SPDX-License-Identifier: Apache-2.0
// The TLS flags of microctl and microd-health (microd has its own, with the
// same names): --tls_ca, --tls_cert, --tls_key, --tls_server_name, each
// defaulting to its MICROD_TLS_* variable, as the daemon's.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "daemon/control/tls.h"

namespace microd::control {

TlsFiles TlsFilesFromFlags();

// A channel to a daemon's Admin service at `address` with those flags:
// plaintext when none is given, or when `address` is loopback or a Unix
// socket (where the daemon serves Admin in plaintext).
std::shared_ptr<grpc::Channel> AdminChannel(const std::string& address);

}  // namespace microd::control
