// SPDX-License-Identifier: Apache-2.0
// The coordinator's logic, independent of gRPC: membership (join), the
// rendezvous key-value store, the schedule log (negotiation) and liveness. Served by
// node 0's daemon through CoordinatorService. Thread-safe; every blocking
// call takes a deadline, and a job failure wakes every waiter at once.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "daemon/control/admission.h"
#include "daemon/control/job_token.h"
#include "daemon/control/schedule_log.h"
#include "daemon/control/stall_inspector.h"
#include "daemon/control/types.h"
#include "daemon/rendezvous/kv_store.h"

namespace microd::control {

struct CoordinatorOptions {
  std::string job_id = "microd";
  // The job token (null: none required): a join must prove it holds it.
  std::shared_ptr<const JobToken> token;
  // Mutual TLS admits the nodes and there is no token: a join's
  // certificate must name this job (tls.h, kJobUriPrefix).
  bool certificate_names_job = false;
  // Whether a joining node's options (opaque "--flag=value" lines) fit the
  // job's first node's: the daemon's rule (daemon/join_options.h), which
  // the coordinator does not read. `running`: the job runs already. Null:
  // any options fit.
  std::function<absl::Status(const std::string& node, const std::string& options,
                             const std::string& first, const std::string& first_options,
                             bool running)>
      check_options;
  int expected_nodes = 1;  // n
  absl::Duration peer_timeout = absl::Seconds(10);
  // The stall inspector: a bucket waiting this long on some node is
  // reported (log, heartbeat answers, Admin), naming what it waits for...
  absl::Duration stall_warning = absl::Seconds(60);
  // ...and this long (zero: never) fails the job with that text.
  absl::Duration stall_abort = absl::ZeroDuration();
  // Elastic membership: while at least this many nodes remain, the loss of
  // nodes (silent past the peer timeout) forms the next membership epoch of
  // the survivors instead of failing the job. 0 or expected_nodes: not
  // elastic. Node 0, which serves the coordinator, is never dropped: its
  // silence fails the job.
  int min_nodes = 0;
  // ...and while fewer than this many nodes take part, a node may join the
  // running job (a replacement): it is admitted at once, as the last rank of
  // the next epoch, which begins after the batches scheduled so far (the
  // others cut nothing in flight). 0: expected_nodes.
  int max_nodes = 0;
  // An elastic job that loses nodes below min_nodes forms the epoch of the
  // survivors anyway and schedules nothing until nodes join it back up to
  // min_nodes; after this long without, the job fails, naming what it waited
  // for. Zero: it fails at once.
  absl::Duration elastic_timeout = absl::Minutes(10);
  // Node 0's daemon serves this coordinator (its silence is this process's,
  // and it is never dropped). False: a coordinator of its own
  // (--coordinator_only), and an elastic job may lose any node.
  bool served_by_node0 = true;
  // An elastic job answers a refused transfer (--seal_failure=step), and a
  // data-plane failure with no node lost (a connection reset on the path),
  // with a new epoch of the same members; more than this many of either
  // within the window fail the job, naming the last and the count.
  int max_refusal_epochs = 3;
  absl::Duration refusal_window = absl::Minutes(10);
};

// One change of an elastic job's membership.
struct MembershipChange {
  uint64_t epoch = 0;  // the epoch it formed
  absl::Time at;
  std::string cause;  // which nodes were lost, and why
  int nodes = 0;      // nodes in the new epoch
};

struct HeartbeatAnswer {
  JobState state = JobState::kForming;
  std::string failure;
  std::vector<std::string> stalls;  // the stall inspector's current reports
  uint64_t epoch = 0;               // the job's membership epoch
  // Set when the heartbeat came with an earlier epoch's session: the node's
  // membership now (new rank, node count, session), and what changed.
  std::optional<Membership> membership;
  std::string change;
  std::vector<std::string> waits;  // the stall inspector's buckets waiting, not stalled yet
};

struct NodeSnapshot {
  int rank = -1;
  std::string name;
  int local_size = 0;
  double seconds_since_heartbeat = -1;
  bool left = false;
};

struct JobSnapshot {
  JobState state = JobState::kForming;
  std::string failure;
  int expected_nodes = 0;
  std::vector<NodeSnapshot> nodes;  // by rank once running, join order before
  uint64_t epoch = 0;
  int min_nodes = 0;                      // elastic when below expected_nodes
  int max_nodes = 0;                      // ... or this above them (nodes may join)
  std::vector<MembershipChange> changes;  // oldest first (the last kKeptChanges)
  size_t rendezvous_keys = 0;             // in the key-value store
  size_t old_credentials = 0;             // earlier epochs' credentials still known
};

// The data plane's rendezvous keys of epoch E begin with kRendezvousPrefix E "/".
inline constexpr char kRendezvousPrefix[] = "gloo/e";
// What a node may write to the rendezvous in one epoch.
constexpr size_t kMaxKeysPerNode = 256;
constexpr size_t kMaxKeyBytesPerNode = size_t{16} << 20;
// The change records and the credentials of earlier epochs kept (a node
// that missed more changes than that is no member any more).
constexpr size_t kKeptChanges = 256;
constexpr size_t kKeptCredentials = 8;

// Limits on what a request may carry.
constexpr int kMaxLocalSize = 4096;
constexpr size_t kMaxBatchesPerPoll = 1024;
constexpr int kMaxNodes = 65536;

class Coordinator {
 public:
  explicit Coordinator(CoordinatorOptions options);
  ~Coordinator();
  Coordinator(const Coordinator&) = delete;
  Coordinator& operator=(const Coordinator&) = delete;

  // Validates options (n >= 1, positive peer timeout); starts the liveness watchdog.
  static absl::StatusOr<std::unique_ptr<Coordinator>> Create(CoordinatorOptions options);

  // Blocks until n nodes joined or `deadline` (then this node is removed again
  // and the error says how many arrived). requested_rank -1 takes a free rank.
  // `token_proof`: the node's JobToken::JoinProof (the token itself never
  // travels). `peer_host`: where the call came from (wrong proofs are
  // counted per host: after Admission::kFreeTries in a row, that host's joins are
  // refused (Unavailable) for 1 s, then 2 s, ... up to 64 s, without a look
  // at the proof).
  // An elastic job that runs with fewer than max_nodes admits the node at
  // once (its membership has epoch > 0), if its `options` ("--flag=value"
  // lines) are node 0's (else InvalidArgument naming each that differs); a
  // change in progress is waited for, up to `deadline`.
  absl::StatusOr<Membership> Join(const std::string& job_id, const std::string& node_name,
                                  int local_size, const std::string& token_proof,
                                  int requested_rank, absl::Time deadline,
                                  const std::string& peer_host = "",
                                  const std::string& options = "",
                                  const std::vector<std::string>& certificate_uris = {});
  absl::Status KeySet(uint64_t session, const std::string& key, const std::string& value);
  absl::StatusOr<std::vector<std::string>> KeyGet(uint64_t session,
                                                  const std::vector<std::string>& keys,
                                                  absl::Time deadline);
  // Node `rank` has these buckets ready. Buckets every node has now
  // reported are appended to the schedule as one batch. Never blocks.
  // `seq` > 0: the node's report number; one at or below the last taken is
  // a resend after a lost answer, answered OK and not taken again. A node
  // that joined a running job and reports a bucket the job has with
  // another shape is refused (InvalidArgument, naming both) and dropped
  // from the job. A report of the epoch before a node joined (sent before
  // the node polled the change) is dropped: its submissions are answered
  // MICROD_ERR_MEMBERSHIP by its engine.
  absl::Status Report(uint64_t session, int rank, const std::vector<BucketInfo>& ready,
                      uint64_t seq = 0);
  // The batches from index `next` on, waiting until there is one or
  // `deadline` (then an empty list). Fails at once when the job failed.
  absl::StatusOr<std::vector<ScheduleBatch>> Poll(uint64_t session, int rank, uint64_t next,
                                                  absl::Time deadline);
  // Records liveness; returns the job state (and the failure, if any).
  // `waiting`: the node's long-waiting buckets, replacing what it sent before.
  absl::StatusOr<HeartbeatAnswer> Heartbeat(uint64_t session, int rank,
                                            std::vector<BucketWait> waiting = {});
  // An elastic job goes on without a node that leaves (but node 0, when it
  // serves the coordinator): the
  // next epoch forms at once, as for a lost node. Otherwise the job ends.
  absl::Status Leave(uint64_t session, int rank);
  // A node reports that the job failed; the reason is kept with its name.
  // `data_plane`: a collective failed, which is how a lost peer looks to the
  // others; in an elastic job that verdict waits for the watchdog (the peer
  // timeout and a grace of kDataPlaneGrace): if nodes are found lost, the
  // next epoch forms instead; else (the data plane broke between live
  // nodes) the next epoch of the same members connects it afresh, within
  // the allowance of max_refusal_epochs.
  // `refused_transfer`: a sealed transfer failed verification there
  // (--seal_failure=step): an elastic job's next epoch forms at once, of the
  // same members (fresh keys and connections); the step fails everywhere.
  absl::Status ReportFailure(uint64_t session, int rank, const std::string& reason,
                             bool data_plane = false, bool refused_transfer = false);
  static constexpr absl::Duration kDataPlaneGrace = absl::Seconds(2);

  // Ends the job: every pending and later call fails with `reason`.
  void Fail(const std::string& reason);
  JobSnapshot Snapshot() const;
  // Tests: holds the coordinator's lock for `d`, as a slow call would.
  void HoldLockForTest(absl::Duration d);

 private:
  struct Node {
    std::string name;
    int local_size = 0;
    int requested_rank = -1;
    int rank = -1;
    absl::Time last_seen;
    bool left = false;
    uint64_t polled = 0;              // the node has seen every batch below this index
    uint64_t report_seq = 0;          // the last numbered report taken
    std::vector<BucketWait> waiting;  // from its last heartbeat
    // What this node presents in every later call (Membership::session):
    // random, its own, given once the job formed, and anew in each epoch.
    uint64_t credential = 0;
    // Its credentials of earlier epochs: a call with one is told that the
    // membership changed (a heartbeat gets the new one).
    std::vector<uint64_t> old_credentials;
    // A node joined: this node's credential of the next epoch, taken once it
    // polls the batch that marks the change (until then it is of the old).
    uint64_t next_credential = 0;
    std::string options;        // what it joined with ("--flag=value" lines)
    uint64_t joined_epoch = 0;  // > 0: it joined the running job then
  };

  // The call presents `session` and speaks for node `rank` (-1: a call that
  // names no rank): the session must be the credential of that node, or of
  // some node for -1. `caller` (optional): the rank whose credential it is.
  // `stale` (optional): a session of an earlier epoch is accepted (its
  // rank not checked) and *stale set; without it such a call is refused
  // with FailedPrecondition naming the epoch.
  absl::Status CheckMember(uint64_t session, int rank, int* caller = nullptr, bool* stale = nullptr)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool elastic() const {
    return (options_.min_nodes > 0 && options_.min_nodes < options_.expected_nodes) ||
           max_nodes() > options_.expected_nodes;
  }
  int max_nodes() const {
    return options_.max_nodes > 0 ? options_.max_nodes : options_.expected_nodes;
  }
  int min_nodes() const {
    return options_.min_nodes > 0 ? options_.min_nodes : options_.expected_nodes;
  }
  // A node joins the running job: the next epoch, of every node and it
  // (the last rank), begins after the batches logged so far (a marker
  // batch); each node takes its new credential when it polls the marker.
  Membership AdmitLocked(Node joiner) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Join's running-job half: one change at a time, within --max_nodes, a
  // name not taken, options the job's (then AdmitLocked).
  absl::StatusOr<Membership> JoinRunningLocked(const std::string& node_name, int local_size,
                                               const std::string& options, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Every credential any node holds or held (none is ever given twice), and
  // a random one not among `given` (added to it).
  std::set<uint64_t> CredentialsGivenLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static uint64_t FreshCredential(std::set<uint64_t>* given);
  // Some node has not polled the marker of the last change yet.
  bool DrainingLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The membership of node `rank` in the current epoch.
  Membership MembershipOf(int rank) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The next epoch, of every node but `lost` (ranks), renumbered in the
  // order of their ranks, each with a new credential; the schedule starts
  // afresh (what was reported and not scheduled is dropped: the nodes
  // report again).
  void FormEpochLocked(const std::vector<int>& lost, const std::string& cause)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The next epoch of the same members for `text` (what a node reported;
  // the change's cause adds `done`), counted in `recent`; "" when it
  // formed, else the job's failure: more than max_refusal_epochs of them
  // within the refusal window (`what`: the kind, as the failure names it).
  std::string ReformLocked(std::deque<absl::Time>* recent, const std::string& text,
                           const std::string& what, const std::string& done)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A rank may write its own rendezvous entries only ("<prefix>/<rank>",
  // "<prefix>/rank_<rank>"), the data plane's in the current epoch's
  // namespace only (kRendezvousPrefix<epoch>/), and at most kMaxKeysPerNode
  // keys and kMaxKeyBytesPerNode bytes an epoch; every other key is
  // job-wide and node 0's alone.
  absl::Status CheckKeyWrite(int caller, const std::string& key, size_t bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A joining node sent its options ("--flag=value" lines) if the job's
  // first node did (the in-process control plane's nodes send none), and
  // check_options takes them (`running`: a running job's joiner).
  absl::Status CheckOptions(const std::string& node_name, const std::string& options,
                            bool running) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // The next epoch's bookkeeping: its secret, its change record; earlier
  // epochs' rendezvous keys, old credentials and change records past the
  // few kept are dropped.
  void BeginEpochLocked(const std::string& cause) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // 32 bytes from the kernel's random source: an epoch's seal salt (the
  // process ends if there are none: no key may come from a salt that is
  // not random).
  static std::string FreshSealSalt();
  absl::Status JobError() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FailLocked(const std::string& reason, bool log = true) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AssignRanks() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void TrimSchedule() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A node that joined the running job reported a bucket unlike the job's:
  // the error, the node dropped (or the job failed below its minimum).
  absl::Status JoinerDiffers(int rank, const std::vector<BucketInfo>& ready)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Watchdog();
  // The watchdog ran `late` past its tick (this process, or the lock, was
  // held): the nodes could not be heard meanwhile; their silence over it
  // is not counted.
  void CreditLocked(absl::Time now, absl::Duration late) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Watches the watchdog without taking any lock: says when it has not run
  // for half the peer timeout, and what holds it.
  void Sentinel();
  // The stall inspector, once per watchdog tick (stall_inspector.h); fails
  // the job past the abort limit.
  void InspectStalls(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const CoordinatorOptions options_;
  rendezvous::InMemoryKeyValueStore store_;
  Admission admission_;  // the token, the certificate, the pause of wrong guessers

  mutable absl::Mutex mu_;
  JobState state_ ABSL_GUARDED_BY(mu_) = JobState::kForming;
  std::string failure_ ABSL_GUARDED_BY(mu_);
  std::vector<Node> nodes_ ABSL_GUARDED_BY(mu_);  // join order; by rank once running
  ScheduleLog schedule_ ABSL_GUARDED_BY(mu_);     // negotiation (schedule_log.h)
  StallInspector stalls_ ABSL_GUARDED_BY(mu_);
  // Since when the job has had fewer than min_nodes (InfiniteFuture: not),
  // and the change that made it so.
  absl::Time short_since_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  std::string short_cause_ ABSL_GUARDED_BY(mu_);
  // Fewer nodes than the job's minimum: nothing is scheduled.
  bool ShortLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return short_since_ != absl::InfiniteFuture();
  }
  // After a loss (`cause`): below min_nodes, the job waits for nodes from now.
  void NoteShortLocked(const std::string& cause) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;
  // This epoch's secret (random, fresh per epoch), which each node's link
  // salts come from (Membership::link_salts); no node gets it.
  std::string seal_salt_ ABSL_GUARDED_BY(mu_);
  std::vector<MembershipChange> changes_ ABSL_GUARDED_BY(mu_);  // the last kKeptChanges
  // What each node wrote to the rendezvous in this epoch, by rank.
  struct Written {
    size_t keys = 0;
    size_t bytes = 0;
  };
  std::map<int, Written> written_ ABSL_GUARDED_BY(mu_);
  // Epochs of the same members formed for refusals and for data planes
  // broken between live nodes, within the refusal window.
  std::deque<absl::Time> refusals_ ABSL_GUARDED_BY(mu_);
  std::deque<absl::Time> breaks_ ABSL_GUARDED_BY(mu_);
  // A data-plane failure held for the watchdog (elastic jobs): its reason,
  // its epoch, and when it becomes the job's failure.
  std::string held_failure_ ABSL_GUARDED_BY(mu_);
  uint64_t held_epoch_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time held_until_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  // The log index of the batch that marks the last change, if a node joined
  // (UINT64_MAX: the last change, if any, was a loss).
  uint64_t marker_batch_ ABSL_GUARDED_BY(mu_) = UINT64_MAX;
  uint64_t epoch_first_batch_ ABSL_GUARDED_BY(mu_) = 0;  // where this epoch's log begins

  absl::Notification stop_;
  std::thread watchdog_;
  // The watchdog's progress, for the sentinel: when it last ran, and since
  // when it waits for mu_ (0: it does not); Unix microseconds.
  std::atomic<int64_t> watchdog_ran_us_{0};
  std::atomic<int64_t> watchdog_waiting_us_{0};
  std::thread sentinel_;
};

}  // namespace microd::control
