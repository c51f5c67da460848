// SPDX-License-Identifier: Apache-2.0
#include "daemon/common/status_map.h"

#include "absl/strings/cord.h"

namespace microd {

absl::Status WithClientStatus(absl::Status status, ClientStatus code) {
  status.SetPayload(kStatusPayloadUrl, absl::Cord(std::to_string(static_cast<int>(code))));
  return status;
}

ClientStatus ToClientStatus(const absl::Status& status) {
  if (status.ok()) return ClientStatus::kOk;
  if (auto payload = status.GetPayload(kStatusPayloadUrl)) {
    const std::string s(*payload);
    if (!s.empty() && s.size() <= 2) {
      const int v = std::stoi(s);
      if (v > 0 && v <= static_cast<int>(ClientStatus::kMembership))
        return static_cast<ClientStatus>(v);
    }
  }
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kAlreadyExists:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kOutOfRange:
      return ClientStatus::kInvalidArgument;
    case absl::StatusCode::kDeadlineExceeded:
      return ClientStatus::kTimeout;
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kAborted:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kCancelled:
      return ClientStatus::kJobFailed;
    case absl::StatusCode::kResourceExhausted:
      return ClientStatus::kResource;
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kUnauthenticated:
      return ClientStatus::kPermission;
    case absl::StatusCode::kUnimplemented:
      return ClientStatus::kUnsupported;
    default:
      return ClientStatus::kInternal;
  }
}

absl::Status WithMessage(const absl::Status& status, absl::string_view message) {
  absl::Status out(status.code(), message);
  status.ForEachPayload(
      [&out](absl::string_view url, const absl::Cord& payload) { out.SetPayload(url, payload); });
  return out;
}

}  // namespace microd
