// SPDX-License-Identifier: Apache-2.0
#include "daemon/join_options.h"

#include <map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"

namespace microd {
namespace {

// "--flag=value" lines, by flag.
std::map<std::string, std::string> OptionLines(const std::string& text) {
  std::map<std::string, std::string> out;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    const size_t eq = line.find('=');
    out[std::string(line.substr(0, eq))] =
        eq == absl::string_view::npos ? "" : std::string(line.substr(eq + 1));
  }
  return out;
}

// Whether a node seals its data plane, from its options ("--seal=on").
bool SealsDataPlane(const std::map<std::string, std::string>& options) {
  auto it = options.find("--seal");
  return it != options.end() && it->second == "on";
}

// Each option that differs between a joining node's and the job's.
std::vector<std::string> OptionsThatDiffer(const std::string& mine, const std::string& job) {
  const auto a = OptionLines(mine), b = OptionLines(job);
  std::vector<std::string> out;
  for (const auto& [flag, value] : a) {
    auto it = b.find(flag);
    const std::string theirs = it == b.end() ? "not set" : it->second;
    if (theirs != value)
      out.push_back(absl::StrCat(flag, " is ", value, " there, ", theirs, " in the job"));
  }
  for (const auto& [flag, value] : b) {
    if (a.count(flag) == 0)
      out.push_back(absl::StrCat(flag, " is not set there, ", value, " in the job"));
  }
  return out;
}

}  // namespace

absl::Status CheckJoinOptions(const std::string& node, const std::string& options,
                              const std::string& first, const std::string& first_options,
                              bool running) {
  if (running) {
    const std::vector<std::string> differ = OptionsThatDiffer(options, first_options);
    if (differ.empty()) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat("node '", node,
                                                   "' may not join: its options differ from "
                                                   "the job's: ",
                                                   absl::StrJoin(differ, "; ")));
  }
  // Every node seals its data plane or none does (else nothing of it
  // would connect): said at the join, naming both.
  const bool mine = SealsDataPlane(OptionLines(options));
  if (mine == SealsDataPlane(OptionLines(first_options))) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "node '", node, "' may not join: it ", mine ? "seals" : "does not seal",
      " its data plane and node '", first, "' ", mine ? "does not" : "does",
      ": give every node the same --seal (with --seal=auto, the same TLS and --token_file)"));
}

}  // namespace microd
