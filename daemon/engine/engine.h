// The daemon's background loop. A bucket is ready on this node when every
// local process submitted it; ready buckets are reported to the coordinator,
// which appends the buckets every node reported to a schedule log; a second
// thread reads that log, and the batches run in log order on every node:
// local sum, the sparsified step (the small buckets of a batch fused into one
// dense allreduce), write-back into every local buffer, completions.
//
// CUDA buffers (local::HostBuffer::device()) are staged through host memory:
// before the local sum each one's ready event is awaited and its bytes are
// copied in; after the write-back the update is copied out and the copy
// awaited before the completion goes out. The step itself runs on `ops` and
// `transport` as for host buffers.
//
// Response cache (EngineOptions::response_cache): a bucket the coordinator
// scheduled once gets a cache id, the same on every node (ids follow the
// schedule log). Later submissions of it skip the coordinator: the engine
// thread runs cycles, each an allgather over the transport of how many
// schedule batches this node has received and a bit vector of its ready
// cached buckets; every node then runs the schedule batches up to the least
// received, then the cached buckets ready everywhere, in id order. Buckets
// not cached yet are reported to the coordinator by a thread of their own.
// A node enters a cycle only with work pending; a cycle waits for the other
// nodes as long as the job lives (peer failures end it through Fail()).
// Small dense buckets ride in the cycle (EngineOptions::cycle_floats): each
// node puts its local sum of the ones ready here into its cycle message, so
// a bucket every node sent is reduced by the cycle's allgather itself (the
// sum in node order, the very bits of the fused dense allreduce), one round
// instead of two. A bucket ready everywhere that some node could not send
// (a NaN/Inf there, a CUDA buffer) takes the usual path (a fused dense
// allreduce after the cycle). Under --nonfinite=skip this means a NaN/Inf
// skips only its own bucket's step where the fused path would skip every
// bucket fused with it.
//
// Failure model: a process that vanishes, a step that breaks the transport,
// or a failure the coordinator reports ends the job: every pending and later
// submission completes with MICROD_ERR_JOB_FAILED and the reason. A NaN/Inf
// in a gradient fails only that step (MICROD_ERR_NONFINITE on every node).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/control/coordinator_client.h"
#include "daemon/engine/answer.h"
#include "daemon/local/local_server.h"
#include "daemon/sparsify/bucket.h"
#include "daemon/transport/transport.h"
#include "kernels/sparse_ops.h"

namespace microd::engine {

struct EngineOptions {
  int local_size = 1;
  sparsify::SparsifyOptions sparsify;
  // Buckets with fewer elements go dense, fused into one allreduce per batch.
  uint64_t dense_floor = 65536;
  absl::Duration op_timeout = absl::Seconds(60);
  // How long a response-cache cycle waits for the other nodes to enter it
  // (a node enters only with work pending: its trainer may be busy, e.g.
  // saving a checkpoint). The stall inspector reports such waits long before.
  absl::Duration peer_wait = absl::Minutes(30);
  // A NaN/Inf in some node's gradient: fail the step (MICROD_ERR_NONFINITE on
  // every node) or skip it (every process gets a zero update, counted).
  bool skip_nonfinite = false;
  // Sparse steps kept per bucket for the per-step history (0: none).
  size_t stats_history = 1024;
  // Negotiate buckets scheduled once over the data plane (see above).
  bool response_cache = true;
  // Response cache: room in a cycle's message for small dense buckets, in
  // floats per node (0: none). The cached dense buckets, in cache id order,
  // that fit in it ride in the cycle (see above).
  uint64_t cycle_floats = 4096;
  // The step runs on the GPU (ops are a GPU backend on CUDA ordinal
  // `device`, the transport takes device memory): CUDA buffers are read and
  // written in place (no host staging), after their ready event; every
  // buffer must be a CUDA buffer on that GPU (others are refused at
  // registration). Off: the step runs on host memory and CUDA buffers are
  // staged through it.
  bool device_resident = false;
  int device = 0;
};

// One sparse step of one bucket.
struct StepSample {
  uint64_t step = 0;
  uint64_t selected = 0;
  uint64_t budget = 0;
  double threshold = 0;
  double cre = 0;
};

// Per-bucket statistics (cumulative since start).
struct BucketStats {
  std::string name;
  uint64_t count = 0;
  bool dense = false;
  uint64_t steps = 0;
  uint64_t failures = 0;
  uint64_t skipped = 0;  // steps skipped for a NaN/Inf (--nonfinite=skip)
  uint64_t last_selected = 0;
  uint64_t budget = 0;
  double last_threshold = 0;
  double last_cre = 0;
  double sum_cre = 0;  // over steps >= 2
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
  // From ready on this node (every local process submitted) to the start of
  // its step: the other nodes, the coordinator's answer, earlier batches.
  double negotiate_seconds = 0;
  double local_sum_seconds = 0;
  double select_seconds = 0;
  double exchange_seconds = 0;
  double writeback_seconds = 0;
  std::deque<StepSample> history;  // the last EngineOptions::stats_history steps

  // A dense step of this bucket's `count` elements, with its share of the
  // times of the fused allreduce or cycle it rode in.
  void AddDense(double local_sum, double exchange, double writeback);
  // A sparse step, as the bucket's state reported it; `history` sparse
  // steps kept at most.
  void AddSparse(const sparsify::StepStats& st, double local_sum, double writeback,
                 size_t history_limit);
};

struct EngineSnapshot {
  std::string failure;  // empty while healthy
  std::vector<BucketStats> buckets;
  uint64_t batches = 0;        // schedule batches run
  uint64_t cache_batches = 0;  // batches of cached buckets agreed over the data plane
  uint64_t cycle_reductions = 0;  // bucket steps reduced by the cycle itself
};

// Every node must run with the same step options (the collectives' sizes
// and the results depend on them): one fixed-size allgather of this node's
// options over `transport`; InvalidArgument naming the first option that
// differs and the nodes it differs on. Call before the engine starts (it
// uses the control tag), on every node.
absl::Status CheckOptionsAgree(transport::Transport& transport, const EngineOptions& options,
                               absl::Time deadline);

class Engine final : public local::LocalHandler {
 public:
  // `client` (negotiation), `transport` and `ops` must outlive the engine.
  Engine(EngineOptions options, control::Membership membership, control::CoordinatorClient* client,
         transport::Transport* transport, kernels::SparseOps* ops);
  ~Engine() override;

  // Where completions go; set before Start.
  void SetServer(local::LocalServer* server) { server_ = server; }
  void Start();
  // Fails everything pending and stops the loop.
  void Stop(const absl::Status& reason);
  // Ends the job on this node (and tells the coordinator when `report`).
  void Fail(const absl::Status& reason, bool report);

  absl::StatusOr<local::ProcessInfo> OnHello(uint64_t client, int requested_local_rank,
                                             pid_t pid) override;
  absl::Status OnRegister(uint64_t client, uint32_t buffer_id, const std::string& name, bool dense,
                          std::shared_ptr<local::HostBuffer> buffer) override;
  absl::Status OnSubmit(uint64_t client, uint32_t buffer_id, uint64_t ticket) override;
  void OnDisconnect(uint64_t client, bool clean, const std::string& why) override;

  // Statistics of every bucket; the per-step histories only if asked for.
  EngineSnapshot Snapshot(bool with_history = false) const;
  // Buckets some local process submitted at least `at_least` ago that have
  // not run, longest first (at most `limit`), with the local processes that
  // have not submitted them: what the heartbeats tell the stall inspector.
  std::vector<control::BucketWait> Waiting(absl::Duration at_least, size_t limit = 64) const;

 private:
  struct Process {
    int local_rank = -1;
    pid_t pid = 0;
    std::map<uint32_t, std::string> buffers;  // buffer id -> bucket name
  };
  struct Bucket {
    std::string name;
    uint64_t count = 0;
    bool dense = false;            // below the size floor, or asked for by the processes
    bool requested_dense = false;  // the processes registered it with MICROD_BUFFER_DENSE
    std::vector<std::shared_ptr<local::HostBuffer>> buffers;  // by local rank
    std::vector<uint64_t> clients;                            // by local rank
    std::vector<uint32_t> buffer_ids;                         // by local rank
    std::vector<uint64_t> tickets;                            // by local rank, 0 = none
    int submitted = 0;
    absl::Time ready_at;    // when the last local process submitted
    absl::Time first_at;    // when the first local process submitted
    int64_t cache_id = -1;  // response cache id, once scheduled by the coordinator
    absl::Status poisoned;  // local processes disagree on it: every submission fails
    uint32_t slot = 0;      // transport tag slot, assigned at first schedule
    std::unique_ptr<sparsify::BucketState> state;
    BucketStats stats;
  };
  // What a scheduled bucket needs while it runs (taken under the lock):
  // its buffers, and the answer owed to its submissions (answer.h: given
  // once, by whoever gets there first).
  struct Work {
    Bucket* bucket;
    std::vector<std::shared_ptr<local::HostBuffer>> buffers;
    std::shared_ptr<Answer> answer;
  };

  absl::Status RegisterBuffer(uint64_t client, uint32_t buffer_id, const std::string& name,
                              bool dense, std::shared_ptr<local::HostBuffer> buffer,
                              std::vector<Work>* refused);
  void Loop();
  void PollLoop();
  // With the response cache: the engine thread's cycles, and the reporting of
  // buckets not cached yet.
  void CacheLoop();
  void ReportLoop();
  // One cycle: agree with every node on what to run, then run it. False if
  // nothing ran.
  bool Cycle();
  // The buckets a cycle reduced itself (cache ids, in order): node r's local
  // sum of bucket i is at area[r * floats + slot[i]].
  void RunInCycle(const std::vector<size_t>& ids, const std::vector<uint64_t>& slot,
                  const std::vector<float>& area, uint64_t floats, double local_sum_seconds,
                  double exchange_seconds, bool count_batch);
  // `cached`: a batch of cached buckets agreed in a cycle, not from the log.
  void RunBatch(const control::ScheduleBatch& batch, bool cached = false);
  void CompleteWork(const Work& w, const absl::Status& status);
  // Completes work of the running batch unless Fail() already did.
  void FinishWork(const Work& w, const absl::Status& status);
  // A step hit a NaN/Inf: answers the work per --nonfinite (fail or skip).
  void NonFinite(const Work& w, const absl::Status& status);
  // A step failed here: prefer the reason another node gave the coordinator.
  absl::Status WithRootCause(const absl::Status& local);
  void RunSparse(Work& w);
  // Staging of CUDA buffers: all copies are queued, then awaited (deadline:
  // the step's). A failure names the bucket and the local rank.
  // Device-resident: StageIn waits for the ready events, StageOut for the
  // step's GPU work (the update is then in place).
  absl::Status StageIn(const Work& w, absl::Time deadline);
  absl::Status StageOut(const Work& w, absl::Time deadline);
  // Where the step reads a process's gradient and writes its update: the
  // mapped device memory (device-resident) or host memory.
  float* Data(const local::HostBuffer& b) const {
    return options_.device_resident ? b.device()->mapped() : b.data();
  }
  // Copies `count` floats in ops_'s memory; fills with zeros when `src` is null.
  absl::Status CopyFloats(float* dst, const float* src, uint64_t count);
  absl::Status KernelCall(kernels::KernelStatus k, const char* what) const;
  // A staging failure fails the job (the other nodes are in the step).
  void StagingFailed(const std::vector<const Work*>& works, const absl::Status& s);
  void StagingFailed(const std::vector<Work>& works, const absl::Status& s);
  void RunFusedDense(std::vector<Work>& works);
  Work TakeWork(Bucket& b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static control::BucketInfo InfoOf(const Bucket& b);
  // What to report to the coordinator: the buckets newly ready, not cached.
  std::vector<control::BucketInfo> TakeNewlyReady() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status FailedStatus() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const EngineOptions options_;
  const control::Membership membership_;
  control::CoordinatorClient* const client_;
  transport::Transport* const transport_;
  kernels::SparseOps* const ops_;
  local::LocalServer* server_ = nullptr;

  mutable absl::Mutex mu_;
  absl::Status failed_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::map<uint64_t, Process> processes_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Bucket> buckets_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> newly_ready_ ABSL_GUARDED_BY(mu_);
  std::deque<control::ScheduleBatch> schedule_ ABSL_GUARDED_BY(mu_);  // read, not yet run
  std::vector<Work> in_flight_ ABSL_GUARDED_BY(mu_);  // the running batch, not yet answered
  uint64_t batches_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t cache_batches_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t cycle_reductions_ ABSL_GUARDED_BY(mu_) = 0;
  // Response cache: buckets by cache id, the ids ready on this node, and
  // whether anything changed since the last cycle.
  std::vector<Bucket*> cached_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> cached_ready_ ABSL_GUARDED_BY(mu_);
  bool changed_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t log_run_ ABSL_GUARDED_BY(mu_) = 0;  // schedule batches taken from schedule_
  uint32_t next_slot_ = 1;  // engine thread only; slot 0 is the fused dense buffer

  // Buffers whose GPU work never ended: kept mapped, never released.
  std::vector<std::shared_ptr<local::HostBuffer>> kept_buffers_ ABSL_GUARDED_BY(mu_);
  // Engine-thread scratch buffers (device memory of ops_).
  sparsify::DeviceBuffer<float> grad_, update_, fusion_;
  sparsify::DeviceBuffer<kernels::StepScalars> scalars_;
  std::thread thread_;
  std::thread poll_thread_;
  std::thread report_thread_;  // response cache only
};

}  // namespace microd::engine
