// SPDX-License-Identifier: Apache-2.0
#include "daemon/transport/seal.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "daemon/common/crypto.h"

namespace microd::transport {

absl::StatusOr<std::unique_ptr<SealKeys>> SealKeys::Derive(
    int self, const std::vector<std::string>& link_salts, absl::string_view secret,
    absl::string_view job_id, uint64_t epoch) {
  const int nodes = static_cast<int>(link_salts.size());
  if (self < 0 || self >= nodes) {
    return absl::InvalidArgumentError(
        absl::StrCat("seal: node ", self, " of ", nodes, " (the membership has no salts for it)"));
  }
  std::unique_ptr<SealKeys> k(new SealKeys(self, epoch));
  k->links_.resize(nodes);
  for (int p = 0; p < nodes; ++p) {
    const std::string& salt = link_salts[p];
    if (p == self) {
      if (!salt.empty()) return absl::InvalidArgumentError("seal: a salt for a node's own link");
      continue;
    }
    if (salt.size() != kSaltBytes) {
      return absl::InvalidArgumentError(absl::StrCat("seal: the salt of the link with node ", p,
                                                     " has ", salt.size(), " bytes, not ",
                                                     kSaltBytes));
    }
    auto link = crypto::Hkdf(absl::StrCat(salt, secret),
                             absl::StrCat("microd seal v2\n", job_id, "\n", epoch),
                             absl::StrCat("link\n", std::min(self, p), "\n", std::max(self, p)));
    if (!link.ok()) return link.status();
    k->links_[p] = *std::move(link);
  }
  return k;
}

absl::StatusOr<std::string> SealKeys::LinkSecret(int a, int b) const {
  const int peer = a == self_ ? b : b == self_ ? a : -1;
  if (peer < 0 || peer >= nodes() || peer == self_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "seal: node ", self_, " holds no key of the link between node ", a, " and node ", b));
  }
  return links_[peer];
}

}  // namespace microd::transport
