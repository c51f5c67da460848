// SPDX-License-Identifier: Apache-2.0
// Order statistics of the benchmark programs' timings.
#pragma once

#include <algorithm>
#include <vector>

namespace microd::bench {

// The middle element (the upper one of an even count); 0 for none.
inline double Median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The element at fraction p of the sorted values (nearest rank); 0 for none.
inline double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5))];
}

}  // namespace microd::bench
