// SPDX-License-Identifier: Apache-2.0
#include "daemon/engine/state_agreement.h"

#include <algorithm>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "daemon/common/log.h"
#include "daemon/common/status_macros.h"

namespace microd::engine {
namespace {

// What a node states: "J" (a node that joins), or "S" (a node of the job),
// the steps it confirmed, a tab, 1 if it holds one more unconfirmed (else
// 0), a newline, then each bucket's name, step and controller state, one
// line each, sorted.
struct Stated {
  char kind = 0;  // 'S', 'J', or 0: nothing
  uint64_t confirmed = 0;
  bool unconfirmed = false;
  std::string lines;
};

std::string Statement(StateHolder& holder, bool joining) {
  if (joining) return "J";
  std::vector<std::string> lines;
  for (const BucketStated& b : holder.Buckets()) {
    lines.push_back(absl::StrCat(absl::CEscape(b.name), "\t", b.step, "\t",
                                 absl::BytesToHexString(b.controller)));
  }
  std::sort(lines.begin(), lines.end());
  return absl::StrCat("S", holder.Confirmed(), "\t", holder.HasUnconfirmed() ? 1 : 0, "\n",
                      absl::StrJoin(lines, "\n"));
}

absl::StatusOr<Stated> ParseStated(const std::string& m, size_t node, uint64_t epoch) {
  Stated st;
  if (m.empty()) return st;
  st.kind = m[0];
  if (m == "J") return st;
  const size_t nl = m.find('\n');
  if (st.kind == 'S' && nl != std::string::npos) {
    std::vector<absl::string_view> f = absl::StrSplit(absl::string_view(m).substr(1, nl - 1), '\t');
    int flag = -1;
    if (f.size() == 2 && absl::SimpleAtoi(f[0], &st.confirmed) && absl::SimpleAtoi(f[1], &flag) &&
        (flag == 0 || flag == 1)) {
      st.unconfirmed = flag == 1;
      st.lines = m.substr(nl + 1);
      return st;
    }
  }
  return absl::DataLossError(absl::StrCat("node ", node, " of epoch ", epoch,
                                          " sent a bad statement of its state: '",
                                          absl::CEscape(m.substr(0, 64)), "'"));
}

std::string Shown(const Stated& st) {
  return absl::StrCat(
      st.lines.empty() ? "no bucket state" : absl::StrReplaceAll(st.lines, {{"\n", "; "}}), "; ",
      st.confirmed, " step(s) confirmed");
}

// One round (`slot`): what every node states.
absl::Status StateRound(transport::Transport& t, const control::Membership& m, bool joining,
                        absl::Duration timeout, uint32_t slot, StateHolder& holder,
                        std::vector<Stated>* stated) {
  std::vector<std::string> from;
  transport::CollectiveOptions o;
  o.tag = transport::MakeTag(slot, transport::TagKind::kControl);
  o.deadline = absl::Now() + timeout;
  RETURN_IF_ERROR(t.ExchangeRound(Statement(holder, joining), &from, o));
  stated->clear();
  for (size_t r = 0; r < from.size(); ++r) {
    ASSIGN_OR_RETURN(Stated st, ParseStated(from[r], r, m.epoch));
    stated->push_back(std::move(st));
  }
  return absl::OkStatus();
}

// Some node passed Confirm only if every node reached it, each holding
// every transfer of the step: then whoever did not commits it now. Else no
// node committed it, and whoever holds it drops it.
void SettleUnconfirmed(const std::vector<Stated>& stated, const control::Membership& m,
                       StateHolder& holder) {
  uint64_t most = 0;
  for (const Stated& st : stated) {
    if (st.kind == 'S') most = std::max(most, st.confirmed);
  }
  const bool commit = most > holder.Confirmed();
  holder.Settle(commit);
  if (commit) {
    MICROD_LOG(Warning,
               "node %d: the step whose confirmation failed here was committed by the other "
               "nodes: rolled forward",
               m.node_rank);
  } else {
    MICROD_LOG(Warning,
               "node %d: no node committed the step whose confirmation failed here: dropped "
               "(its submissions are taken again)",
               m.node_rank);
  }
}

// A joining node takes the state of node `source`.
absl::Status Adopt(const Stated& stated, int source, const control::Membership& m,
                   StateHolder& holder) {
  std::map<std::string, BucketStated> adopted;
  for (absl::string_view line : absl::StrSplit(stated.lines, '\n', absl::SkipEmpty())) {
    std::vector<absl::string_view> f = absl::StrSplit(line, '\t');
    BucketStated b;
    if (f.size() != 3 || !absl::CUnescape(f[0], &b.name) || !absl::SimpleAtoi(f[1], &b.step)) {
      return absl::DataLossError(
          absl::StrCat("node ", source, " sent a bad line of the job's state: '", line, "'"));
    }
    b.controller = absl::HexStringToBytes(f[2]);
    std::string name = b.name;
    adopted[name] = std::move(b);
  }
  MICROD_LOG(Info, "node %d of %d: joined at epoch %llu with the job's state of %zu bucket(s)",
             m.node_rank, m.node_count, static_cast<unsigned long long>(m.epoch), adopted.size());
  holder.Adopt(std::move(adopted), stated.confirmed);  // this node confirmed none
  return absl::OkStatus();
}

}  // namespace

absl::Status AgreeOnState(transport::Transport& t, const control::Membership& m, bool joining,
                          absl::Duration timeout, StateHolder& holder) {
  std::vector<Stated> stated;
  RETURN_IF_ERROR(StateRound(t, m, joining, timeout, 1, holder, &stated));
  // A step left unconfirmed somewhere: settled alike on every node, then
  // stated again.
  if (std::any_of(stated.begin(), stated.end(),
                  [](const Stated& st) { return st.kind == 'S' && st.unconfirmed; })) {
    if (!joining && holder.HasUnconfirmed()) SettleUnconfirmed(stated, m, holder);
    RETURN_IF_ERROR(StateRound(t, m, joining, timeout, 7, holder, &stated));
  }
  // Every node that was in the job must hold the same; a step the lost
  // node's data reached on some nodes only (its last round) cannot be
  // undone, and the job fails, naming it.
  int source = -1;
  for (size_t r = 0; r < stated.size(); ++r) {
    if (stated[r].kind != 'S') continue;
    if (source < 0) source = static_cast<int>(r);
    const Stated& ours = stated[joining ? source : m.node_rank];
    if (stated[r].confirmed == ours.confirmed && stated[r].lines == ours.lines) continue;
    return absl::FailedPreconditionError(absl::StrCat(
        "node ", r, " of epoch ", m.epoch, " holds its buckets at other steps than node ",
        joining ? source : m.node_rank,
        " (the lost node's last step reached only some nodes); there: ", Shown(stated[r]),
        "; here: ", Shown(ours)));
  }
  if (!joining) return absl::OkStatus();
  if (source < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("no node of epoch ", m.epoch, " holds the job's state"));
  }
  return Adopt(stated[source], source, m, holder);
}

}  // namespace microd::engine
