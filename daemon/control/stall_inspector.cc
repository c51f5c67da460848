// SPDX-License-Identifier: Apache-2.0
#include "daemon/control/stall_inspector.h"

#include <algorithm>
#include <cstdint>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/common/log.h"

namespace microd::control {

void StallInspector::Short(std::string why) {
  reports_ = {std::move(why)};
  waits_.clear();
  logged_.clear();
}

void StallInspector::Clear() {
  reports_.clear();
  waits_.clear();
  logged_.clear();
}

std::string StallInspector::Inspect(absl::Time now, const std::vector<NodeWaits>& nodes) {
  // By bucket: the longest wait any node reports, and what each node says.
  struct Seen {
    double seconds = 0;
    std::map<int, const BucketWait*> by_rank;
  };
  std::map<std::string, Seen> seen;
  for (const NodeWaits& n : nodes) {
    for (const BucketWait& w : *n.waiting) {
      Seen& s = seen[w.name];
      s.seconds = std::max(s.seconds, w.seconds);
      s.by_rank[n.rank] = &w;
    }
  }
  std::vector<std::string> stalls, waits;
  std::string abort;
  std::map<std::string, absl::Time> logged;
  for (const auto& [name, s] : seen) {
    const bool stalled = s.seconds >= absl::ToDoubleSeconds(warning_);
    std::vector<std::string> ready, missing;
    for (const NodeWaits& n : nodes) {
      const std::string who = absl::StrCat("node ", n.rank, " (", n.name, ")");
      auto it = s.by_rank.find(n.rank);
      if (it == s.by_rank.end()) {
        missing.push_back(absl::StrCat(who, ": no local process submitted it"));
      } else if (it->second->missing.empty()) {
        ready.push_back(who);
      } else {
        missing.push_back(absl::StrCat(who, ": local process(es) ",
                                       ProcessList(it->second->missing), " did not submit it"));
      }
    }
    // Ready everywhere and still not run: what runs before it is stuck, or
    // the nodes disagree on what runs next.
    const std::string head = absl::StrCat("bucket '", name, "' ", stalled ? "stalled" : "waiting",
                                          " for ", static_cast<int64_t>(s.seconds), " s: ");
    const std::string text =
        missing.empty()
            ? absl::StrCat(head,
                           "ready on every node and not run (a step before it is stuck, or "
                           "the nodes disagree on what runs next)")
            : absl::StrCat(head, "ready on ",
                           ready.empty() ? "no node" : absl::StrJoin(ready, ", "), "; waiting for ",
                           absl::StrJoin(missing, "; "));
    if (!stalled) {
      waits.push_back(text);
      continue;
    }
    stalls.push_back(text);
    auto it = logged_.find(name);
    const bool log = it == logged_.end() || now - it->second >= warning_;
    logged[name] = log ? now : it->second;
    if (log) MICROD_LOG(Warning, "coordinator: stall: %s", text.c_str());
    if (abort_ > absl::ZeroDuration() && s.seconds >= absl::ToDoubleSeconds(abort_) &&
        abort.empty()) {
      abort = text;
    }
  }
  waits_ = std::move(waits);
  reports_ = std::move(stalls);
  logged_ = std::move(logged);
  if (abort.empty()) return "";
  return absl::StrCat(abort, " (--stall_abort_s ", absl::ToInt64Seconds(abort_), ")");
}

}  // namespace microd::control
