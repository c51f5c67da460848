// SPDX-License-Identifier: Apache-2.0
// The coordinator's membership: joins (of the forming job and of a running
// elastic one), credentials, ranks and the epochs a loss or a join begins.
#include <algorithm>
#include <random>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/common/crypto.h"
#include "daemon/common/log.h"
#include "daemon/common/status_macros.h"
#include "daemon/control/coordinator.h"

namespace microd::control {
namespace {

uint64_t RandomSession() {
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd() ^ 1;
}

// The salt of the link between nodes `a` and `b` in `epoch`, from the
// epoch's secret (which no node gets: each its own links' salts only).
std::string LinkSaltOf(const std::string& epoch_secret, uint64_t epoch, int a, int b) {
  auto salt = crypto::Hkdf(
      epoch_secret, "",
      absl::StrCat("microd link salt\n", epoch, "\n", std::min(a, b), "\n", std::max(a, b)));
  if (!salt.ok()) {
    MICROD_LOG(Error, "coordinator: %s", std::string(salt.status().message()).c_str());
    std::abort();  // no key may come from a salt that is not the epoch's
  }
  return *std::move(salt);
}

}  // namespace

// 32 bytes from the kernel's random source: an epoch's seal salt.
std::string Coordinator::FreshSealSalt() {
  auto salt = crypto::RandomBytes(32);
  if (!salt.ok()) {
    MICROD_LOG(Error, "coordinator: %s", std::string(salt.status().message()).c_str());
    std::abort();  // no key may come from a salt that is not random
  }
  return *std::move(salt);
}

absl::StatusOr<Membership> Coordinator::Join(const std::string& job_id,
                                             const std::string& node_name, int local_size,
                                             const std::string& token_proof, int requested_rank,
                                             absl::Time deadline, const std::string& peer_host,
                                             const std::string& options,
                                             const std::vector<std::string>& certificate_uris) {
  // The token (and the job its certificate names, if any) first: an
  // unauthenticated caller learns nothing of the job (not even the number
  // of nodes, from a rank out of range).
  RETURN_IF_ERROR(admission_.Admit(token_proof, job_id, node_name, peer_host, certificate_uris));
  if (absl::Status s = CheckName("job id", job_id); !s.ok()) return s;
  if (absl::Status s = CheckName("node name", node_name); !s.ok()) return s;
  if (local_size < 1 || local_size > kMaxLocalSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("local size must be in [1, ", kMaxLocalSize, "], got ", local_size));
  }
  if (requested_rank < -1 || requested_rank >= std::max(options_.expected_nodes, max_nodes())) {
    return absl::InvalidArgumentError(
        absl::StrCat("requested rank ", requested_rank, " out of range [0, ",
                     std::max(options_.expected_nodes, max_nodes()), ") (or -1 for any)"));
  }
  if (job_id != options_.job_id) {
    return absl::FailedPreconditionError(absl::StrCat("node '", node_name, "' belongs to job '",
                                                      job_id, "' but this coordinator serves '",
                                                      options_.job_id, "'"));
  }

  absl::MutexLock lock(&mu_);
  if (absl::Status s = JobError(); !s.ok()) return s;
  if (state_ != JobState::kForming) {
    if (!elastic()) {
      return absl::FailedPreconditionError(
          absl::StrCat("job already has its ", options_.expected_nodes, " nodes"));
    }
    return JoinRunningLocked(node_name, local_size, options, deadline);
  }
  if (absl::Status s = CheckOptions(node_name, options, /*running=*/false); !s.ok()) return s;
  for (const Node& n : nodes_) {
    if (n.name == node_name) {
      return absl::AlreadyExistsError(absl::StrCat("node name '", node_name, "' already joined"));
    }
    if (requested_rank >= 0 && n.requested_rank == requested_rank) {
      return absl::AlreadyExistsError(
          absl::StrCat("rank ", requested_rank, " already taken by node '", n.name, "'"));
    }
  }
  Node self;
  self.name = node_name;
  self.local_size = local_size;
  self.requested_rank = requested_rank;
  self.options = options;
  nodes_.push_back(self);
  if (static_cast<int>(nodes_.size()) == options_.expected_nodes) {
    AssignRanks();
    state_ = JobState::kRunning;
  }
  auto formed = [this]()
                    ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return state_ != JobState::kForming; };
  mu_.AwaitWithDeadline(absl::Condition(&formed), deadline);
  if (state_ == JobState::kForming) {
    std::vector<std::string> names;
    for (const Node& n : nodes_) names.push_back(n.name);
    const std::string arrived = absl::StrJoin(names, ", ");
    nodes_.erase(std::remove_if(nodes_.begin(), nodes_.end(),
                                [&](const Node& n) { return n.name == node_name; }),
                 nodes_.end());
    return absl::DeadlineExceededError(
        absl::StrCat("join: ", names.size(), " of ", options_.expected_nodes,
                     " nodes arrived before the deadline (", arrived, ")"));
  }
  if (absl::Status s = JobError(); !s.ok()) return s;
  for (const Node& n : nodes_) {
    if (n.name == node_name) return MembershipOf(n.rank);
  }
  return absl::InternalError(absl::StrCat("join: node '", node_name, "' not in the job"));
}

absl::StatusOr<Membership> Coordinator::JoinRunningLocked(const std::string& node_name,
                                                          int local_size,
                                                          const std::string& options,
                                                          absl::Time deadline) {
  // A running elastic job: one change at a time.
  auto settled = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return state_ != JobState::kRunning || !DrainingLocked();
  };
  mu_.AwaitWithDeadline(absl::Condition(&settled), deadline);
  if (absl::Status s = JobError(); !s.ok()) return s;
  if (DrainingLocked()) {
    return absl::DeadlineExceededError(
        "join: the job's last change of membership was still in progress at the deadline");
  }
  if (static_cast<int>(nodes_.size()) >= max_nodes()) {
    return absl::FailedPreconditionError(absl::StrCat("the job runs with ", nodes_.size(),
                                                      " nodes, the most it takes (", max_nodes(),
                                                      ", --max_nodes)"));
  }
  for (const Node& n : nodes_) {
    if (n.name == node_name) {
      return absl::AlreadyExistsError(
          absl::StrCat("node name '", node_name, "' is node ", n.rank,
                       " of the running job (a replacement may take a lost node's name once it is "
                       "found lost, after the peer timeout)"));
    }
  }
  if (absl::Status s = CheckOptions(node_name, options, /*running=*/true); !s.ok()) {
    MICROD_LOG(Warning, "coordinator: refused node '%s' joining the running job: %s",
               node_name.c_str(), std::string(s.message()).c_str());
    return s;
  }
  Node self;
  self.name = node_name;
  self.local_size = local_size;
  self.options = options;
  return AdmitLocked(std::move(self));
}

Membership Coordinator::MembershipOf(int rank) const {
  Membership m;
  m.node_rank = rank;
  m.node_count = static_cast<int>(nodes_.size());
  m.session = nodes_[rank].credential;
  m.epoch = epoch_;
  m.first_batch = epoch_first_batch_;
  m.graceful = marker_batch_ != UINT64_MAX;
  m.link_salts.resize(nodes_.size());
  for (int p = 0; p < m.node_count; ++p) {
    if (p != rank) m.link_salts[p] = LinkSaltOf(seal_salt_, epoch_, rank, p);
  }
  for (const Node& n : nodes_) {
    m.local_sizes.push_back(n.local_size);
    m.node_names.push_back(n.name);
    m.world_size += n.local_size;
  }
  return m;
}

std::set<uint64_t> Coordinator::CredentialsGivenLocked() const {
  std::set<uint64_t> given;
  for (const Node& n : nodes_) {
    given.insert(n.credential);
    given.insert(n.next_credential);
    given.insert(n.old_credentials.begin(), n.old_credentials.end());
  }
  return given;
}

uint64_t Coordinator::FreshCredential(std::set<uint64_t>* given) {
  uint64_t c;
  do {
    c = RandomSession();
  } while (!given->insert(c).second);
  return c;
}

void Coordinator::FormEpochLocked(const std::vector<int>& lost, const std::string& cause) {
  std::vector<Node> next;
  std::vector<std::string> kept;
  std::set<uint64_t> given = CredentialsGivenLocked();  // no credential is ever given twice
  for (Node& n : nodes_) {
    if (std::find(lost.begin(), lost.end(), n.rank) != lost.end()) continue;
    kept.push_back(absl::StrCat(n.name, " (node ", next.size(), ", was ", n.rank, ")"));
    n.rank = static_cast<int>(next.size());
    n.old_credentials.push_back(n.credential);
    if (n.next_credential != 0) {
      // Lost while a node joined: the joined epoch is skipped.
      n.old_credentials.push_back(n.next_credential);
      n.next_credential = 0;
    }
    n.credential = FreshCredential(&given);
    n.waiting.clear();
    next.push_back(std::move(n));
  }
  nodes_ = std::move(next);
  // The schedule starts afresh at the next index: what was reported and
  // not scheduled is dropped, and every node reports again.
  schedule_.Restart();
  for (Node& n : nodes_) n.polled = schedule_.base();
  stalls_.Clear();
  epoch_first_batch_ = schedule_.base();
  marker_batch_ = UINT64_MAX;
  BeginEpochLocked(cause);
  MICROD_LOG(Warning, "coordinator: membership epoch %llu: %s; %zu nodes go on: %s",
             static_cast<unsigned long long>(epoch_), cause.c_str(), nodes_.size(),
             absl::StrJoin(kept, ", ").c_str());
}

void Coordinator::BeginEpochLocked(const std::string& cause) {
  ++epoch_;
  seal_salt_ = FreshSealSalt();
  changes_.push_back({epoch_, absl::Now(), cause, static_cast<int>(nodes_.size())});
  // What an epoch leaves behind goes with it: however many epochs a job
  // goes through, the coordinator holds a bounded few.
  if (changes_.size() > kKeptChanges) changes_.erase(changes_.begin());
  for (Node& n : nodes_) {
    if (n.old_credentials.size() > kKeptCredentials) {
      n.old_credentials.erase(n.old_credentials.begin(),
                              n.old_credentials.end() - kKeptCredentials);
    }
  }
  // The rendezvous of earlier epochs' data planes (the nodes connect this
  // epoch's now), and what each node wrote there.
  const std::string current = absl::StrCat(kRendezvousPrefix, epoch_, "/");
  store_.EraseIf([&](const std::string& key) {
    return absl::StartsWith(key, kRendezvousPrefix) && !absl::StartsWith(key, current);
  });
  written_.clear();
}

void Coordinator::NoteShortLocked(const std::string& cause) {
  if (ShortLocked() || static_cast<int>(nodes_.size()) >= min_nodes()) return;
  short_since_ = absl::Now();
  short_cause_ = cause;
  MICROD_LOG(Warning,
             "coordinator: the job has %zu node(s), fewer than its minimum of %d (--min_nodes): "
             "nothing runs until nodes join, for up to %s (--elastic_timeout_s)",
             nodes_.size(), min_nodes(), absl::FormatDuration(options_.elastic_timeout).c_str());
}

bool Coordinator::DrainingLocked() const {
  for (const Node& n : nodes_) {
    if (n.next_credential != 0) return true;
  }
  return false;
}

Membership Coordinator::AdmitLocked(Node joiner) {
  std::set<uint64_t> given = CredentialsGivenLocked();  // no credential is ever given twice
  for (Node& n : nodes_) {
    n.next_credential = FreshCredential(&given);
    n.waiting.clear();
  }
  // The old epoch ends after what is logged: the marker is its last batch.
  ScheduleBatch marker;
  marker.index = schedule_.end();
  marker.change_epoch = epoch_ + 1;
  schedule_.Append(marker);
  marker_batch_ = marker.index;
  epoch_first_batch_ = marker.index + 1;
  // What was reported and not scheduled is dropped: each node answers it
  // MICROD_ERR_MEMBERSHIP at the change, and its processes submit it again.
  schedule_.DropPending();
  stalls_.Clear();
  joiner.rank = static_cast<int>(nodes_.size());
  joiner.credential = FreshCredential(&given);
  joiner.last_seen = absl::Now();
  joiner.polled = epoch_first_batch_;
  const std::string cause = absl::StrCat("node '", joiner.name, "' joined as node ", joiner.rank);
  nodes_.push_back(std::move(joiner));
  BeginEpochLocked(cause);
  nodes_.back().joined_epoch = epoch_;
  if (ShortLocked() && static_cast<int>(nodes_.size()) >= min_nodes()) {
    MICROD_LOG(Warning, "coordinator: the job has its minimum of %d nodes again, after %s",
               min_nodes(),
               absl::FormatDuration(absl::Trunc(absl::Now() - short_since_, absl::Milliseconds(1)))
                   .c_str());
    short_since_ = absl::InfiniteFuture();
  }
  MICROD_LOG(Warning,
             "coordinator: membership epoch %llu: %s; %zu nodes from schedule batch %llu on",
             static_cast<unsigned long long>(epoch_), cause.c_str(), nodes_.size(),
             static_cast<unsigned long long>(epoch_first_batch_));
  return MembershipOf(nodes_.back().rank);
}

void Coordinator::AssignRanks() {
  std::vector<bool> taken(nodes_.size(), false);
  for (Node& n : nodes_) {
    if (n.requested_rank >= 0) {
      n.rank = n.requested_rank;
      taken[n.rank] = true;
    }
  }
  int next = 0;
  for (Node& n : nodes_) {
    if (n.rank >= 0) continue;
    while (taken[next]) ++next;
    n.rank = next;
    taken[next] = true;
  }
  std::sort(nodes_.begin(), nodes_.end(),
            [](const Node& a, const Node& b) { return a.rank < b.rank; });
  const absl::Time now = absl::Now();
  std::set<uint64_t> given;
  for (Node& n : nodes_) {
    n.last_seen = now;
    n.credential = FreshCredential(&given);
  }
}

}  // namespace microd::control
