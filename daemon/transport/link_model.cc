#include "daemon/transport/link_model.h"

#include <algorithm>

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

}  // namespace microd::transport
