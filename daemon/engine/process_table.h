// SPDX-License-Identifier: Apache-2.0
// The engine's table of local processes and buckets: who said hello with
// which local rank, which buffer each registered for which bucket, which
// submissions are in, the buckets ready on this node (every local process
// submitted) and, with the response cache, the buckets by cache id.
//
// Not synchronised: the engine keeps it under its mutex (EngineState).
// A scheduled bucket's submissions leave the table as a Work, which owns
// them until it is finished (once).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/control/control_plane.h"
#include "daemon/engine/answer.h"
#include "daemon/engine/stats.h"
#include "daemon/local/local_server.h"
#include "daemon/sparsify/bucket.h"

namespace microd::engine {

struct Bucket {
  std::string name;
  uint64_t count = 0;
  uint32_t dtype = 1;            // the buffers' element type (kernels::ElementType values)
  bool dense = false;            // below the size floor, or asked for by the processes
  bool requested_dense = false;  // the processes registered it with MICROD_BUFFER_DENSE
  std::vector<std::shared_ptr<local::ProcessBuffer>> buffers;  // by local rank
  std::vector<uint64_t> clients;                               // by local rank
  std::vector<uint32_t> buffer_ids;                            // by local rank
  std::vector<uint64_t> tickets;                               // by local rank, 0 = none
  int submitted = 0;
  absl::Time ready_at;    // when the last local process submitted
  absl::Time first_at;    // when the first local process submitted
  int64_t cache_id = -1;  // response cache id, once scheduled by the coordinator
  absl::Status poisoned;  // local processes disagree on it: every submission fails
  std::unique_ptr<sparsify::BucketState> state;  // created at its first sparse step
  // A dense bucket's velocity under momentum correction (the daemon applies
  // the momentum the training side left out), at its first step.
  sparsify::DeviceBuffer<float> velocity;
  // Submissions taken so far (the next Work's round), and, with several
  // local processes, 1 + the round whose local sum the first process's
  // buffer holds (0: none). The sum is made in place there, once a round:
  // the passes begun during a cycle and the step's own read the same sum.
  uint64_t rounds = 0;
  uint64_t summed = 0;
  BucketStats stats;
};

// One bucket's step in flight: its buffers, and the submissions it owes an
// answer (answer.h: given once, by whoever gets there first: the step's end
// or a failure of the job).
struct Work {
  Bucket* bucket = nullptr;
  std::vector<std::shared_ptr<local::ProcessBuffer>> buffers;
  std::shared_ptr<Answer> answer;
  absl::Time ready_at;  // the bucket's, when taken (the timeline's waiting)
  uint64_t round = 0;   // the bucket's submissions this is (Bucket::rounds)

  // True if some local process has gone since it submitted.
  bool missing_buffer() const;
  // Answers every submission with `status` through `complete`, the first
  // time only.
  void Finish(const absl::Status& status, const Answer::Complete& complete) const {
    answer->Finish(status, complete);
  }
};

// The daemon's memory for its buckets' state on this node: what a new
// bucket of `count` elements (reduced dense or not) costs, and the most all
// buckets may take together.
struct StateBudget {
  uint64_t bytes = 0;  // 0: no limit
  std::string source;  // where the limit comes from (messages)
  std::function<uint64_t(uint64_t count, bool dense)> cost;
};

class ProcessTable {
 public:
  ProcessTable(int local_size, uint64_t dense_floor) : L_(local_size), dense_floor_(dense_floor) {}

  // A new bucket whose state would take the buckets' state past the budget
  // is refused at registration (ResourceExhausted with the numbers), before
  // anything is allocated.
  void SetStateBudget(StateBudget budget) { budget_ = std::move(budget); }
  // The state of the buckets registered so far (StateBudget::cost).
  uint64_t state_bytes() const;

  // A new local process: its local rank (the one asked for, or the lowest free).
  absl::StatusOr<int> Hello(uint64_t client, int requested_local_rank, pid_t pid);
  // Submissions of a bucket whose processes disagree on it (its size or
  // dense flag) are refused: they go to `refused`, to be answered with the
  // returned error.
  absl::Status Register(uint64_t client, uint32_t buffer_id, const std::string& name, bool dense,
                        std::shared_ptr<local::ProcessBuffer> buffer, std::vector<Work>* refused);
  enum class Ready { kNo, kNew, kCached };
  // kNew: ready here and not cached (to report to the coordinator); kCached:
  // ready here and cached (to negotiate in the next cycle).
  absl::StatusOr<Ready> Submit(uint64_t client, uint32_t buffer_id, uint64_t ticket);
  // Forgets the process; the reason to end the job when it leaves work
  // undone (empty when not: it registered nothing, or left cleanly, idle).
  std::string Disconnect(uint64_t client, bool clean, const std::string& why, int node_rank);

  // The bucket's submissions as a Work; the bucket waits for the next ones.
  Work Take(Bucket& bucket);
  // Every bucket with a submission, as Works (the job failed).
  std::vector<Work> TakeAllSubmitted();
  // The buckets newly ready and not cached, to report to the coordinator.
  std::vector<control::BucketInfo> TakeNewlyReady();
  bool has_newly_ready() const { return !newly_ready_.empty(); }
  void DropNewlyReady() { newly_ready_.clear(); }

  Bucket& bucket(const std::string& name) { return buckets_[name]; }
  // The bucket, or null when no process registered it.
  Bucket* find(const std::string& name);
  // Buckets with a sparsifier state or a dense velocity, by name.
  std::vector<Bucket*> WithState();
  // How many buckets are registered, and their elements in all.
  size_t bucket_count() const { return buckets_.size(); }
  uint64_t total_elements() const;
  // The local rank of a connected process.
  absl::StatusOr<int> LocalRankOf(uint64_t client) const;
  // The name of a process's buffer ("" if unknown).
  std::string BufferName(uint64_t client, uint32_t buffer_id) const;
  // Local ranks whose process registered buffers and left, and no process
  // took the rank again since: they will not take part in what comes.
  const std::set<int>& departed() const { return departed_; }
  static control::BucketInfo InfoOf(const Bucket& b);

  // The response cache: a bucket scheduled once gets the next cache id.
  void Cache(Bucket& bucket);
  size_t cached_count() const { return cached_.size(); }
  Bucket& cached(size_t id) { return *cached_[id]; }
  bool cached_ready(size_t id) const { return cached_ready_[id]; }
  bool any_cached_ready() const;
  // An elastic job's next epoch (after TakeAllSubmitted): no bucket is
  // cached any more, nothing is newly ready; the coordinator schedules each
  // bucket once again, which caches it anew, in the new epoch's order.
  void ResetCache();
  // The connected processes that said hello: (client, local rank).
  std::vector<std::pair<uint64_t, int>> Clients() const;

  // Buckets some local process submitted at least `at_least` before `now`
  // that have not run, longest first (at most `limit`).
  // What a process's submitted buffer waits for, in words, as this node
  // (`node`: "node 2 (name)") sees it: its bucket's name in *name; *others
  // set when the bucket is ready here and waits for the other nodes.
  std::string WaitingFor(uint64_t client, uint32_t buffer_id, absl::Time now,
                         const std::string& node, std::string* name, bool* others) const;
  std::vector<control::BucketWait> Waiting(absl::Time now, absl::Duration at_least,
                                           size_t limit) const;
  std::vector<BucketStats> Stats(bool with_history) const;

 private:
  // The local processes that have not submitted b: (local rank, pid; 0 when
  // not connected).
  std::vector<std::pair<int, int>> Missing(const Bucket& b) const;
  struct Process {
    int local_rank = -1;
    pid_t pid = 0;
    std::map<uint32_t, std::string> buffers;  // buffer id -> bucket name
  };

  const int L_;
  const uint64_t dense_floor_;
  StateBudget budget_;
  uint64_t bucket_state_bytes_ = 0;  // sum of budget_.cost over the buckets
  std::map<uint64_t, Process> processes_;
  std::map<std::string, Bucket> buckets_;
  std::vector<std::string> newly_ready_;
  std::set<int> departed_;
  std::vector<Bucket*> cached_;  // by cache id
  std::vector<bool> cached_ready_;
};

}  // namespace microd::engine
