// SPDX-License-Identifier: Apache-2.0
// The one place that maps absl::Status to and from grpc::Status (codes share
// their numbering; messages pass through).
#pragma once

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace microd {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace microd
