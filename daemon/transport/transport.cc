// SPDX-License-Identifier: Apache-2.0
// Shared helpers of the transport interface.
#include "daemon/transport/transport.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "daemon/common/status_macros.h"

namespace microd::transport {

absl::Status CheckAllgatherV(int rank, int size, const void* in,
                             absl::Span<const size_t> recv_bytes, const void* out) {
  if (recv_bytes.size() != static_cast<size_t>(size)) {
    return absl::InvalidArgumentError(
        absl::StrCat("AllgatherV: ", recv_bytes.size(), " counts for ", size, " ranks"));
  }
  size_t total = 0;
  for (size_t b : recv_bytes) total += b;
  if ((recv_bytes[rank] > 0 && in == nullptr) || (total > 0 && out == nullptr)) {
    return absl::InvalidArgumentError("AllgatherV: null buffer");
  }
  return absl::OkStatus();
}

absl::Status Transport::ExchangeRound(std::string_view mine, std::vector<std::string>* from,
                                      const CollectiveOptions& options) {
  if (from == nullptr) return absl::InvalidArgumentError("ExchangeRound: no output");
  const int n = size();
  std::vector<uint64_t> sizes(n);
  const uint64_t my_size = mine.size();
  CollectiveOptions o = options;
  RETURN_IF_ERROR(Allgather(&my_size, sizeof my_size, sizes.data(), o));
  for (int p = 0; p < n; ++p) RETURN_IF_ERROR(CheckRoundLength(sizes[p], options, p));
  std::vector<size_t> bytes(sizes.begin(), sizes.end());
  size_t total = 0;
  for (size_t b : bytes) total += b;
  std::string all(total, '\0');
  o.shape_agreed = true;  // the sizes every rank just received
  RETURN_IF_ERROR(AllgatherV(mine.data(), bytes, all.data(), o));
  from->assign(n, std::string());
  size_t at = 0;
  for (int p = 0; p < n; ++p) {
    (*from)[p] = all.substr(at, bytes[p]);
    at += bytes[p];
  }
  return absl::OkStatus();
}

absl::Status CheckRoundLength(uint64_t length, const CollectiveOptions& options, int sender) {
  const size_t most =
      options.max_bytes > 0 ? std::min(options.max_bytes, kMaxRoundBytes) : kMaxRoundBytes;
  if (length <= most) return absl::OkStatus();
  return absl::DataLossError(
      absl::StrCat("node ", sender, " says its round message (tag ", options.tag, ") has ", length,
                   " bytes, more than the round takes (", most, "): nothing was allocated for it"));
}

absl::Status CheckBuffers(const char* op, size_t bytes, const void* in, const void* out) {
  if (bytes > 0 && (in == nullptr || out == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": null buffer"));
  }
  return absl::OkStatus();
}

}  // namespace microd::transport
