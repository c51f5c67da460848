// SPDX-License-Identifier: Apache-2.0
#include "daemon/transport/link_model.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"

namespace microd::transport {

double LinkModel::DirectSeconds(size_t bytes) const {
  return posted_round_seconds +
         static_cast<double>(ranks - 1) * static_cast<double>(bytes) / bytes_per_second;
}

double LinkModel::TwoPhaseSeconds(size_t bytes) const {
  return 2 * round_seconds +
         2.0 * (ranks - 1) / ranks * static_cast<double>(bytes) / bytes_per_second;
}

bool LinkModel::DirectCheaper(size_t bytes) const {
  return ranks <= 2 || DirectSeconds(bytes) <= TwoPhaseSeconds(bytes);
}

size_t LinkModel::InlineBytes() const {
  constexpr double kMin = 64 << 10, kMax = 4 << 20;
  const double per_round = std::clamp(posted_round_seconds * bytes_per_second, kMin, kMax);
  return static_cast<size_t>(per_round) / 4096 * 4096;
}

LinkModel LinkModel::Combine(const std::vector<LinkModel>& models) {
  LinkModel worst;
  if (models.empty()) return worst;
  worst = models[0];
  for (const LinkModel& m : models) {
    worst.round_seconds = std::max(worst.round_seconds, m.round_seconds);
    worst.posted_round_seconds = std::max(worst.posted_round_seconds, m.posted_round_seconds);
    worst.bytes_per_second = std::min(worst.bytes_per_second, m.bytes_per_second);
    worst.ranks = std::max(worst.ranks, m.ranks);
  }
  return worst;
}

absl::StatusOr<LinkModel> ParseLinkModel(absl::string_view text) {
  const auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", text, "': ", why, " (want round_ms=R,posted_ms=P,mb_per_s=B; posted_ms optional)"));
  };
  std::map<std::string, double, std::less<>> got;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    const std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(part, '=');
    if (kv.first != "round_ms" && kv.first != "posted_ms" && kv.first != "mb_per_s") {
      return bad(absl::StrCat("unknown key '", kv.first, "'"));
    }
    double v = 0;
    if (!absl::SimpleAtod(kv.second, &v) || !std::isfinite(v) || v <= 0) {
      return bad(absl::StrCat(kv.first, " must be a positive number"));
    }
    if (!got.emplace(std::string(kv.first), v).second) {
      return bad(absl::StrCat(kv.first, " given twice"));
    }
  }
  if (got.count("round_ms") == 0 || got.count("mb_per_s") == 0) {
    return bad("round_ms and mb_per_s are needed");
  }
  LinkModel m;
  m.round_seconds = got["round_ms"] / 1e3;
  m.posted_round_seconds =
      got.count("posted_ms") != 0 ? got["posted_ms"] / 1e3 : m.round_seconds / 2;
  m.bytes_per_second = got["mb_per_s"] * 1e6;
  if (m.posted_round_seconds > m.round_seconds) {
    return bad("posted_ms is at most round_ms (posting the receives ahead only saves time)");
  }
  return m;
}

std::string FormatLinkModel(const LinkModel& m) {
  return absl::StrFormat("round_ms=%g,posted_ms=%g,mb_per_s=%g", m.round_seconds * 1e3,
                         m.posted_round_seconds * 1e3, m.bytes_per_second / 1e6);
}

}  // namespace microd::transport
