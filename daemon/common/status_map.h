// SPDX-License-Identifier: Apache-2.0
// The one place that maps daemon statuses (absl::Status) to the C API's
// microd_status codes. A payload under kStatusPayloadUrl refines the code
// where absl has no equivalent (mismatch, non-finite gradient, job failure).
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace microd {

constexpr char kStatusPayloadUrl[] = "type.microd.dev/status";

// Values of microd_status (client/include/microd/microd.h), mirrored here so
// the daemon does not depend on the client header.
enum class ClientStatus : int {
  kOk = 0,
  kInvalidArgument = 1,
  kUnavailable = 2,
  kTimeout = 3,
  kMismatch = 4,
  kJobFailed = 5,
  kUnsupported = 6,
  kProtocol = 7,
  kResource = 8,
  kPermission = 9,
  kNonFinite = 10,
  kInternal = 11,
  kClosed = 12,
  kMembership = 13,
};

// Returns `status` with the client code it must map to attached.
absl::Status WithClientStatus(absl::Status status, ClientStatus code);
ClientStatus ToClientStatus(const absl::Status& status);
// `status` (its code and payloads: the client code kept) with `message`
// in place of its own.
absl::Status WithMessage(const absl::Status& status, absl::string_view message);

}  // namespace microd
