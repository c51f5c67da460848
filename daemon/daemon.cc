// SPDX-License-Identifier: Apache-2.0
#include "daemon/daemon.h"

#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "daemon/common/log.h"
#include "daemon/common/memory_limit.h"
#include "daemon/common/status_macros.h"
#include "daemon/common/unix_socket.h"
#include "daemon/control/address.h"
#include "daemon/control/coordinator.h"
#include "daemon/control/coordinator_client.h"
#include "daemon/control/services.h"
#include "daemon/control/tls.h"
#include "daemon/engine/checkpoint.h"
#include "daemon/engine/engine.h"
#include "daemon/engine/engine_status.h"
#include "daemon/engine/metrics.h"
#include "daemon/engine/timeline.h"
#include "daemon/join_options.h"
#include "daemon/local/local_server.h"
#include "daemon/test_hooks.h"
#include "daemon/transport/gloo/gloo_transport.h"
#include "microd/config.h"
#if MICROD_HAVE_NCCL
#include "daemon/transport/nccl/nccl_transport.h"
#include "kernels/cuda/cuda_ops.h"
#endif

namespace microd {
namespace {

// The grpc.health.v1 service name that is SERVING once the node joined the
// job and serves its socket (deploy/README.md, the Kubernetes probes).
constexpr char kHealthService[] = "microd";

std::string HostName() {
  char buf[256] = {0};
  if (gethostname(buf, sizeof buf - 1) != 0) return "node";
  return buf;
}

// The engine's options, from the configuration and the data plane chosen.
engine::EngineOptions EngineOptionsOf(const DaemonConfig& c, uint64_t memory_budget,
                                      const std::string& memory_budget_source) {
  engine::EngineOptions eo;
  eo.job_id = c.job_id;
  eo.state_key = engine::DeriveStateKey(c.state_secret);
  eo.state_budget = memory_budget;
  eo.state_budget_source = memory_budget_source;
  eo.local_size = c.local_size;
  eo.sparsify = c.sparsify;
  eo.dense_floor = c.dense_floor;
  eo.skip_nonfinite = c.skip_nonfinite;
  eo.stats_history = c.stats_history;
  eo.wire_bucket_dtype = c.wire_bucket_dtype;
  eo.response_cache = c.response_cache;
  eo.cycle_floats = c.cycle_floats;
  eo.op_timeout = c.op_timeout;
  eo.peer_timeout = c.peer_timeout;
  if (c.stall_abort_s > 0) {
    eo.peer_wait = absl::Seconds(c.stall_abort_s) + c.peer_timeout + c.op_timeout;
  }
  eo.device_resident = c.transport == "nccl";
  eo.device = c.cuda_device;
  eo.elastic = c.elastic();
  eo.seal_failure_step = c.seal_failure == "step";
  // Long enough for the coordinator's verdict: the peer timeout, its grace
  // for a reported data-plane failure, and a heartbeat to bring it.
  eo.membership_wait =
      2 * c.peer_timeout + control::Coordinator::kDataPlaneGrace + absl::Seconds(5);
  return eo;
}

}  // namespace

// One node's daemon: the coordinator (node 0), the Admin service, the
// membership in the job, the data plane, the engine and the local socket.
// Start brings them up in that order; Stop (or any early return: the members
// are declared so) takes them down in the reverse one.
class DaemonImpl {
 public:
  DaemonImpl(DaemonConfig config, std::vector<std::string> remedies, uint64_t memory_budget,
             std::string memory_budget_source)
      : config_(std::move(config)),
        remedies_(std::move(remedies)),
        memory_budget_(memory_budget),
        memory_budget_source_(std::move(memory_budget_source)) {}
  ~DaemonImpl() {
    absl::MutexLock lock(&mu_);
    // The heartbeats' failure callback calls into the engine (a Start that
    // failed half-way has not left the job).
    if (client_ != nullptr) client_->StopHeartbeats();
    engine_.reset();
    local_server_.reset();
  }

  absl::Status Start(const std::function<void()>& serving);
  void Stop(const std::string& why);

  const DaemonConfig& config() const { return config_; }
  const std::vector<std::string>& remedies() const { return remedies_; }
  int coordinator_port() const {
    return coordinator_server_ != nullptr ? coordinator_server_->port() : 0;
  }
  int admin_port() const { return admin_ != nullptr ? admin_->port() : 0; }
  int metrics_port() const { return metrics_ != nullptr ? metrics_->port() : 0; }
  int node_rank() {
    absl::MutexLock lock(&mu_);
    return membership_.session != 0 ? membership_.node_rank : -1;
  }

 private:
  // The coordinator's TLS: the files given, else the TLS the job token
  // derives (job_token.h), else none (loopback, or --insecure).
  control::TlsFiles CoordinatorTls() const;
  absl::Status StartCoordinator();
  absl::Status StartAdmin();
  absl::Status StartMetrics();
  absl::Status StartTimeline();
  // microctl timeline: records for the request's window (or takes what the
  // ring keeps), then answers with the trace.
  grpc::Status Timeline(grpc::ServerContext* ctx, const v1::GetTimelineRequest& req,
                        v1::GetTimelineResponse* resp);
  // `options`: what the coordinator checks when this node joins a running job.
  absl::Status Join(const std::string& options);
  absl::Status StartDataPlane(const engine::EngineOptions& eo);
  // An elastic job's next epoch: the data plane among its nodes, under a
  // rendezvous prefix of its own, with the links' model of the first one.
  absl::StatusOr<std::unique_ptr<transport::Transport>> NextDataPlane(const control::Membership& m);
  // This epoch's data-plane keys (null where the node does not seal).
  absl::StatusOr<std::shared_ptr<const transport::SealKeys>> SealKeysOf(
      const control::Membership& m) const;
  absl::Status Serve(const engine::EngineOptions& eo);
  // `buckets` (optional): the engine's per-bucket statistics of the same
  // snapshot (the metrics' histograms).
  void FillStatus(const v1::GetStatusRequest& req, v1::GetStatusResponse* r,
                  std::vector<engine::BucketStats>* buckets = nullptr);

  const DaemonConfig config_;
  const std::vector<std::string> remedies_;
  const uint64_t memory_budget_;
  const std::string memory_budget_source_;
  bool stopped_ = false;
  const absl::Time started_ = absl::Now();
  std::string coordinator_address_ = config_.coordinator;
  std::shared_ptr<const control::JobToken> job_token_;  // null: the job has no token
  std::unique_ptr<control::Coordinator> coordinator_;
  std::unique_ptr<control::CoordinatorService> coordinator_service_;
  std::unique_ptr<control::ControlServer> coordinator_server_;
  // Destroyed in this order's reverse: the local server before the engine
  // before the transport before the coordinator client. The Admin service,
  // declared after them, stops first.
  control::Membership membership_;
  std::unique_ptr<control::CoordinatorClient> client_;
  std::unique_ptr<transport::Transport> transport_;  // until the engine adopts it
  std::optional<transport::LinkModel> first_link_model_;
  transport::GlooOptions gloo_options_;  // the first data plane's (NextDataPlane)
  std::unique_ptr<kernels::SparseOps> ops_;
  std::unique_ptr<engine::Engine> engine_;
  std::unique_ptr<local::LocalServer> local_server_;
  absl::Mutex mu_;  // guards the pointers above against the Admin thread
  engine::Timeline timeline_{{config_.timeline_steps, config_.timeline_every}};
  std::unique_ptr<engine::TimelineFile> timeline_file_;
  std::atomic<bool> capturing_{false};  // a timeline capture holds its window
  control::AdminService admin_service_{
      [this](const v1::GetStatusRequest& req, v1::GetStatusResponse* r) { FillStatus(req, r); },
      [this](grpc::ServerContext* ctx, const v1::GetTimelineRequest& req,
             v1::GetTimelineResponse* resp) { return Timeline(ctx, req, resp); }};
  std::unique_ptr<control::ControlServer> admin_;
  std::unique_ptr<engine::MetricsServer> metrics_;  // stops before the Admin service
};

control::TlsFiles DaemonImpl::CoordinatorTls() const {
  control::TlsFiles tls = config_.tls;
  if (!tls.files() && job_token_ != nullptr) {
    tls.job = std::make_shared<control::TlsIdentity>(job_token_->tls());
  }
  return tls;
}

absl::Status DaemonImpl::StartCoordinator() {
  const std::string listen = config_.coordinator_listen;
  if (!listen.empty()) {
    control::CoordinatorOptions co;
    co.job_id = config_.job_id;
    co.token = job_token_;
    co.certificate_names_job =
        config_.tls.files() && !config_.tls.ca.empty() && job_token_ == nullptr;
    co.check_options = CheckJoinOptions;
    co.expected_nodes = config_.nodes;
    co.min_nodes = config_.min_nodes;
    co.max_nodes = config_.max_nodes;
    co.elastic_timeout = absl::Seconds(config_.elastic_timeout_s);
    co.peer_timeout = config_.peer_timeout;
    co.stall_warning = absl::Seconds(config_.stall_warning_s);
    co.stall_abort = absl::Seconds(config_.stall_abort_s);
    co.served_by_node0 = !config_.coordinator_only;
    auto c = control::Coordinator::Create(co);
    if (!c.ok()) return FlagError("coordinator", c.status());
    coordinator_ = std::move(c).value();
    coordinator_service_ = std::make_unique<control::CoordinatorService>(coordinator_.get());
    RETURN_IF_ERROR(config_.CheckExposure("--coordinator_listen", listen, /*token_counts=*/true));
    control::ControlServerOptions so;
    so.credentials = control::ServerCredentialsFor(CoordinatorTls());
    so.reflection = false;  // nothing to browse on the job's own port
    auto server = control::ControlServer::Start(listen, {coordinator_service_.get()}, so);
    if (!server.ok()) return FlagError("coordinator", server.status());
    coordinator_server_ = std::move(server).value();
    if (coordinator_address_.empty()) {
      // Where this node reaches the coordinator it serves: its listen
      // address (on a multi-homed host that may not be loopback).
      auto self = control::SelfDialAddress(listen, coordinator_server_->port());
      if (!self.ok()) return FlagError("--coordinator_listen", self.status());
      coordinator_address_ = *self;
    }
    MICROD_LOG(Info, "coordinator listening on %s for %d nodes%s",
               coordinator_server_->address().c_str(), co.expected_nodes,
               config_.coordinator_only ? " (this daemon serves it alone: no training)" : "");
    if (const std::string f = config_.coordinator_port_file; !f.empty()) {
      std::ofstream(f) << coordinator_server_->port() << "\n";
    }
  }
  if (coordinator_address_.empty()) {
    return FlagError("--coordinator",
                     absl::InvalidArgumentError("give --coordinator or --coordinator_listen"));
  }
  return absl::OkStatus();
}

void DaemonImpl::FillStatus(const v1::GetStatusRequest& req, v1::GetStatusResponse* r,
                            std::vector<engine::BucketStats>* buckets) {
  const sparsify::SparsifyOptions& sparsify = config_.sparsify;
  r->set_version(MICROD_VERSION_STRING);
  r->set_node_name(config_.node_name);
  r->set_transport(config_.transport);
  r->set_sparsifier(sparsify::SparsifierName(sparsify.sparsifier));
  r->set_controller(sparsify::ControllerName(sparsify.controller));
  r->set_density(sparsify.density);
  r->set_momentum_correction(sparsify.momentum);
  r->set_warmup_steps(sparsify.warmup_steps);
  r->set_warmup_density(sparsify.warmup_density);
  r->set_warmup_decay_steps(sparsify.warmup_decay_steps);
  r->set_warmup_dense_above(sparsify.warmup_dense_above);
  r->set_clip_norm(sparsify.clip_norm);
  r->set_min_k(sparsify.min_k);
  for (const std::string& line : remedies_) r->add_remedies(line);
  r->set_response_cache(config_.response_cache);
  r->set_local_size(config_.local_size);
  r->set_socket(config_.socket);
  r->set_uptime_seconds(absl::ToDoubleSeconds(absl::Now() - started_));
  r->set_node_rank(-1);
  r->set_job_state(v1::JOB_STATE_FORMING);
  if (coordinator_ != nullptr) control::FillJobStatus(coordinator_->Snapshot(), r);
  absl::MutexLock lock(&mu_);
  if (membership_.session != 0) {
    r->set_node_rank(membership_.node_rank);
    r->set_node_count(membership_.node_count);
    r->set_world_size(membership_.world_size);
    if (coordinator_ == nullptr) r->set_job_state(v1::JOB_STATE_RUNNING);
  }
  if (client_ != nullptr && !client_->job_status().ok()) {
    r->set_job_state(client_->job_status().code() == absl::StatusCode::kFailedPrecondition
                         ? v1::JOB_STATE_FINISHED
                         : v1::JOB_STATE_FAILED);
    if (r->failure().empty()) r->set_failure(std::string(client_->job_status().message()));
  }
  if (client_ != nullptr) {
    for (const std::string& s : client_->stalls()) r->add_stalls(s);
  }
  if (local_server_ != nullptr) {
    for (const auto& c : local_server_->Clients()) {
      auto* p = r->add_processes();
      p->set_local_rank(c.local_rank);
      p->set_pid(c.pid);
      p->set_buffers(c.buffers);
      p->set_bytes(c.bytes);
    }
  }
  if (engine_ != nullptr) {
    engine::EngineSnapshot snapshot = engine_->Snapshot(req.include_history());
    engine::FillEngineStatus(snapshot, r);
    if (buckets != nullptr) *buckets = std::move(snapshot.buckets);
  }
}

absl::Status DaemonImpl::StartAdmin() {
  const std::string address = config_.admin;
  RETURN_IF_ERROR(config_.CheckExposure("--admin", address, /*token_counts=*/false));
  control::ControlServerOptions so;
  so.reflection = true;
  // Status calls are short; a timeline capture holds one thread for its
  // window (one capture at a time). More callers than this are refused.
  so.max_threads = 16;
  // Plaintext where only this machine reaches it (probes, microctl in the
  // pod); TLS where the network does.
  if (!control::IsLocalOnly(address)) {
    so.credentials = control::ServerCredentialsFor(config_.tls);
  }
  const bool unix_socket = absl::StartsWith(address, "unix:");
  const std::string path = unix_socket ? address.substr(5) : "";
  if (unix_socket) {
    std::string warning;
    if (absl::Status s = PrepareSocketPath(path, SOCK_STREAM, &warning); !s.ok()) {
      return FlagError("--admin", s);
    }
    if (!warning.empty()) MICROD_LOG(Warning, "%s", warning.c_str());
  } else if (control::IsLocalOnly(address)) {
    MICROD_LOG(Info,
               "--admin %s: every local user can read this daemon's "
               "status and timeline (unix:PATH admits only this uid)",
               address.c_str());
  }
  // gRPC binds with the process's umask: the socket is never more open than
  // RestrictSocket makes it.
  const int allow_gid = config_.allow_gid;
  const mode_t old_umask = unix_socket ? umask(SocketUmask(allow_gid)) : 0;
  auto admin = control::ControlServer::Start(address, {&admin_service_}, so);
  if (unix_socket) umask(old_umask);
  if (!admin.ok()) return FlagError("--admin", admin.status());
  if (unix_socket) {
    if (absl::Status s = RestrictSocket(path, allow_gid); !s.ok()) return FlagError("--admin", s);
  }
  admin_ = std::move(admin).value();
  // Health: "" is SERVING while the process answers (liveness); "microd"
  // only once this node joined and serves its training processes (startup
  // and readiness: a trainer started earlier would wait for the socket).
  admin_->SetServing(kHealthService, false);
  MICROD_LOG(Info, "admin listening on %s", admin_->address().c_str());
  if (const std::string f = config_.admin_port_file; !f.empty()) {
    std::ofstream(f) << admin_->port() << "\n";
  }
#if MICROD_HAVE_NCCL
  if (config_.transport == "nccl") {
    // Before joining: a node without a usable GPU must not hold the job up.
    std::string why;
    auto gpu_ops = kernels::CreateCudaSparseOps(config_.cuda_device, &why);
    if (gpu_ops == nullptr) {
      return FlagError("--transport=nccl", absl::FailedPreconditionError(absl::StrCat(
                                               "no usable GPU ", config_.cuda_device, ": ", why)));
    }
    absl::MutexLock lock(&mu_);
    ops_ = std::move(gpu_ops);
  }
#endif
  return absl::OkStatus();
}

absl::Status DaemonImpl::StartMetrics() {
  const std::string address = config_.metrics;
  if (address.empty()) return absl::OkStatus();
  auto collector = std::make_shared<engine::MetricsCollector>(
      [this](v1::GetStatusResponse* r, std::vector<engine::BucketStats>* b) {
        FillStatus({}, r, b);
      });
  auto server = engine::MetricsServer::Start(address, std::move(collector));
  if (!server.ok()) return FlagError("--metrics", server.status());
  metrics_ = std::move(server).value();
  MICROD_LOG(Info, "metrics on http://%s:%d/metrics", address.substr(0, address.rfind(':')).c_str(),
             metrics_->port());
  if (const std::string f = config_.metrics_port_file; !f.empty()) {
    std::ofstream(f) << metrics_->port() << "\n";
  }
  return absl::OkStatus();
}

absl::Status DaemonImpl::StartTimeline() {
  const std::string path = config_.timeline;
  if (path.empty()) return absl::OkStatus();
  auto file =
      engine::TimelineFile::Start(&timeline_, path, absl::Seconds(config_.timeline_flush_s));
  if (!file.ok()) return FlagError("--timeline", file.status());
  timeline_file_ = std::move(file).value();
  MICROD_LOG(Info, "timeline of the last %llu steps in %s",
             static_cast<unsigned long long>(config_.timeline_steps), path.c_str());
  return absl::OkStatus();
}

grpc::Status DaemonImpl::Timeline(grpc::ServerContext* ctx, const v1::GetTimelineRequest& req,
                                  v1::GetTimelineResponse* resp) {
  absl::Time since = absl::InfinitePast();
  // One capture at a time: each holds a server thread for its window.
  bool capturing = false;
  if (req.seconds() > 0 && !capturing_.compare_exchange_strong(capturing, true)) {
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        "timeline: another capture is running; one at a time");
  }
  struct EndCapture {
    std::atomic<bool>* flag;
    bool active;
    ~EndCapture() {
      if (active) flag->store(false);
    }
  } end_capture{&capturing_, req.seconds() > 0};
  if (req.seconds() > 0) {
    since = absl::Now();
    const absl::Time until = since + absl::Seconds(req.seconds());
    timeline_.Hold();
    // Bounded by the window; a client that gives up (or a shutdown) ends it early.
    while (absl::Now() < until && !ctx->IsCancelled()) {
      absl::SleepFor(std::min(absl::Milliseconds(100), until - absl::Now()));
    }
    timeline_.Release();
    if (ctx->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "timeline: cancelled");
  }
  uint64_t steps = 0;
  resp->set_trace_json(timeline_.ChromeJson(since, &steps));
  resp->set_steps(steps);
  return grpc::Status::OK;
}

absl::Status DaemonImpl::Join(const std::string& options) {
  control::CoordinatorClientOptions cco;
  cco.address = coordinator_address_;
  cco.job_id = config_.job_id;
  cco.node_name = config_.node_name;
  if (job_token_ != nullptr) {
    cco.token_proof = job_token_->JoinProof(config_.job_id, config_.node_name);
  }
  cco.local_size = config_.local_size;
  cco.requested_rank = config_.node_rank;
  cco.peer_timeout = config_.peer_timeout;
  cco.options = options;
  // Node 0 dials the coordinator it serves like any node; over loopback
  // (a coordinator listening on every interface) with TLS the certificate
  // must name 127.0.0.1 too, or --tls_server_name.
  cco.tls = CoordinatorTls();
  auto created = control::CoordinatorClient::Create(cco);
  if (!created.ok()) return FlagError("coordinator client", created.status());
  {
    absl::MutexLock lock(&mu_);
    client_ = std::move(created).value();
  }
  auto joined = client_->Join(absl::Now() + config_.join_timeout);
  if (!joined.ok()) return FlagError("join", joined.status());
  {
    absl::MutexLock lock(&mu_);
    membership_ = *joined;
  }
  log::SetRank(membership_.node_rank);
  MICROD_LOG(Info, "node '%s' is rank %d of %d (world size %d)%s", config_.node_name.c_str(),
             membership_.node_rank, membership_.node_count, membership_.world_size,
             membership_.epoch > 0
                 ? absl::StrCat(", joining the running job at epoch ", membership_.epoch).c_str()
                 : "");
  return absl::OkStatus();
}

absl::Status DaemonImpl::StartDataPlane(const engine::EngineOptions& eo) {
  if (!eo.device_resident) {
    auto data_address = control::ChooseDataPlaneAddress(
        config_.hostname, config_.coordinator_listen, coordinator_address_,
        membership_.observed_host, absl::Now() + config_.join_timeout);
    if (!data_address.ok()) return FlagError("--hostname", data_address.status());
    MICROD_LOG(Info, "data plane on %s (%s)", data_address->address.c_str(),
               data_address->why.c_str());
    transport::GlooOptions& go = gloo_options_;
    go.rank = membership_.node_rank;
    go.size = membership_.node_count;
    go.store = client_.get();
    go.hostname = data_address->address;
    go.timeout = config_.op_timeout;
    go.io_nice = config_.gloo_io_nice;
    go.connections = config_.data_connections;
    // Every step ends with a Confirm round where a step could otherwise be
    // applied on some nodes and not others: a refused transfer that fails
    // the step only, and a node lost in an elastic job (docs/design.md).
    go.confirm = config_.seal_failure == "step" || config_.elastic();
    go.on_collective = ExitAtFromEnvironment();
    if (!config_.link_model.empty()) {
      ASSIGN_OR_RETURN(go.link_model, transport::ParseLinkModel(config_.link_model));
    }
    transport::GlooOptions first = go;
    // Every epoch's rendezvous under a prefix of its own (the coordinator
    // takes no other data-plane keys).
    first.prefix = absl::StrCat(control::kRendezvousPrefix, membership_.epoch);
    if (membership_.epoch > 0) {
      // Joined a running job: its epoch's data plane, whose other nodes
      // bring the links' model they measured (the slowest of each wins).
      first.connect_timeout = config_.peer_timeout + control::Coordinator::kDataPlaneGrace;
      if (!first.link_model.has_value()) {
        first.link_model = transport::LinkModel{};
        first.link_model->round_seconds = 0;
        first.link_model->posted_round_seconds = 0;
        first.link_model->bytes_per_second = std::numeric_limits<double>::max();
      }
    }
    ASSIGN_OR_RETURN(first.seal, SealKeysOf(membership_));
    if (first.seal != nullptr) {
      MICROD_LOG(Info,
                 "data plane sealed: every connection authenticated by its link's key and every "
                 "record encrypted (AES-256-GCM, keys fresh per epoch, link and connection)");
    } else {
      const char* why =
          config_.seal == "off" ? "--seal=off" : "no TLS and no --token_file to key it from";
      if (control::IsLoopbackAddress(first.hostname)) {
        MICROD_LOG(Info, "data plane not sealed (%s; on loopback: this host's alone)", why);
      } else {
        MICROD_LOG(Warning,
                   "data plane NOT sealed (%s): anyone who reaches its ports can read and alter "
                   "gradients",
                   why);
      }
    }
    auto created = transport::CreateGlooTransport(first);
    if (!created.ok()) return FlagError("transport", created.status());
    transport_ = std::move(created).value();
    ops_ = kernels::CreateCpuSparseOps();
    if (const transport::LinkModel* m = transport_->link_model(); m != nullptr && m->ranks > 1) {
      MICROD_LOG(Info,
                 "data plane links (the slowest of every node's, %s): %s (--link_model "
                 "takes this form); %d connection(s) per pair",
                 config_.link_model.empty() ? "measured" : "this node's given by --link_model",
                 transport::FormatLinkModel(*m).c_str(), m->connections);
    }
    return absl::OkStatus();
  }
#if MICROD_HAVE_NCCL
  // The GPU path: kernels and collectives on --cuda_device, in place on the
  // processes' CUDA buffers. The kernels queue on the legacy default stream;
  // the transport's own stream is ordered after them.
  transport::NcclOptions no;
  no.rank = membership_.node_rank;
  no.size = membership_.node_count;
  no.device = eo.device;
  no.store = client_.get();
  no.timeout = config_.op_timeout;
  auto created = transport::CreateNcclTransport(no);
  if (!created.ok()) return FlagError("transport", created.status());
  transport_ = std::move(created).value();
  MICROD_LOG(Info, "reducing on GPU %d over NCCL (CUDA buffers only)", eo.device);
  return absl::OkStatus();
#else
  return FlagError("--transport", absl::UnimplementedError("nccl needs a CUDA build"));
#endif
}

absl::StatusOr<std::unique_ptr<transport::Transport>> DaemonImpl::NextDataPlane(
    const control::Membership& m) {
  transport::GlooOptions go = gloo_options_;
  go.rank = m.node_rank;
  go.size = m.node_count;
  go.prefix = absl::StrCat(control::kRendezvousPrefix, m.epoch);
  // A member lost meanwhile is found within this: the next epoch's then.
  go.connect_timeout = config_.peer_timeout + control::Coordinator::kDataPlaneGrace;
  if (first_link_model_.has_value()) {
    go.link_model = *first_link_model_;  // no need to measure the same links again
    go.link_model->ranks = m.node_count;
  }
  ASSIGN_OR_RETURN(go.seal, SealKeysOf(m));
  return transport::CreateGlooTransport(go);
}

absl::StatusOr<std::shared_ptr<const transport::SealKeys>> DaemonImpl::SealKeysOf(
    const control::Membership& m) const {
  if (!config_.SealsDataPlane()) return nullptr;
  // The epoch's salt (a secret: the control plane has TLS) and what the
  // job token derives for the data plane.
  auto keys = transport::SealKeys::Derive(
      m.node_rank, m.link_salts, job_token_ != nullptr ? job_token_->data_plane_secret() : "",
      config_.job_id, m.epoch);
  if (!keys.ok()) {
    return FlagError("--seal",
                     absl::FailedPreconditionError(absl::StrCat(
                         "no keys for epoch ", m.epoch, " of the data plane (",
                         keys.status().message(), "): is the coordinator older than this node?")));
  }
  return std::shared_ptr<const transport::SealKeys>(std::move(keys).value());
}

absl::Status DaemonImpl::Serve(const engine::EngineOptions& eo) {
  local::LocalServerOptions lo;
  lo.socket_path = config_.socket;
  lo.allow_gid = config_.allow_gid;
  lo.max_clients = config_.max_processes;
  lo.max_buffers_per_client = config_.max_buffers_per_process;
  lo.max_bytes_per_client = config_.max_bytes_per_process;
  if (lo.max_bytes_per_client == 0) {
    lo.max_bytes_per_client = memory_budget_ > 0 ? memory_budget_ : uint64_t{1} << 40;
  }
  lo.hello_timeout = config_.hello_timeout;
  // A process that reads none of its completions for a whole operation's
  // deadline is not coming back.
  lo.stuck_after = config_.op_timeout;
  lo.cuda_resident_device = eo.device_resident ? eo.device : -1;
  auto server = local::LocalServer::Start(lo, engine_.get());
  if (!server.ok()) return FlagError("--socket", server.status());
  {
    absl::MutexLock lock(&mu_);
    local_server_ = std::move(server).value();
  }
  engine_->SetServer(local_server_.get());
  engine_->SetTimeline(&timeline_);
  client_->SetFailureCallback([e = engine_.get()](const absl::Status& s) { e->Fail(s, false); });
  client_->SetMembershipCallback([this](const control::Membership& m, const std::string& change) {
    {
      absl::MutexLock lock(&mu_);
      membership_ = m;
    }
    log::SetRank(m.node_rank);
    timeline_.SetNode(m.node_rank, config_.node_name);
    engine_->OnMembership(m, change);
  });
  // Buckets waiting a second or more go to the stall inspector: past the
  // warning time it reports them as stalls, before that as waits (what a
  // trainer whose wait timed out is told).
  client_->SetWaitingProvider(
      [e = engine_.get(),
       at_least = std::min(absl::Seconds(1), absl::Seconds(config_.stall_warning_s) / 2)] {
        return e->Waiting(at_least);
      });
  engine_->Start();
  admin_->SetServing(kHealthService, true);
  MICROD_LOG(Info, "serving %d local process(es) on %s", config_.local_size,
             lo.socket_path.c_str());
  for (const std::string& line : remedies_) {
    MICROD_LOG(Info, "remedy at density %g: %s", config_.sparsify.density, line.c_str());
  }
  if (memory_budget_ > 0) {
    MICROD_LOG(Info, "the buckets' state may take %llu bytes (%s)",
               static_cast<unsigned long long>(memory_budget_), memory_budget_source_.c_str());
  }
  return absl::OkStatus();
}

absl::Status DaemonImpl::Start(const std::function<void()>& serving) {
  if (!config_.token.empty()) {
    auto token = control::JobToken::FromToken(config_.token);
    if (!token.ok()) return FlagError("--token_file", token.status());
    job_token_ = *std::move(token);
    if (config_.token.size() < 16) {
      MICROD_LOG(Warning,
                 "the job token has %zu bytes: whoever can try guesses (offline, from one "
                 "handshake with the coordinator) needs few; make one of 32 random bytes "
                 "(head -c 32 /dev/urandom | base64)",
                 config_.token.size());
    }
  }
  RETURN_IF_ERROR(StartCoordinator());
  RETURN_IF_ERROR(StartAdmin());
  RETURN_IF_ERROR(StartMetrics());
  if (config_.coordinator_only) {
    if (serving) serving();
    admin_->SetServing(kHealthService, true);
    return absl::OkStatus();
  }
  RETURN_IF_ERROR(StartTimeline());
  engine::EngineOptions eo = EngineOptionsOf(config_, memory_budget_, memory_budget_source_);
  // Not an engine option, but every node must agree on it before the data
  // plane connects: the coordinator checks it at the join.
  RETURN_IF_ERROR(Join(absl::StrCat(engine::OptionsText(eo),
                                    "--seal=", config_.SealsDataPlane() ? "on" : "off", "\n")));
  timeline_.SetNode(membership_.node_rank, config_.node_name);
  RETURN_IF_ERROR(StartDataPlane(eo));
  if (eo.elastic)
    eo.new_transport = [this](const control::Membership& m) { return NextDataPlane(m); };
  // A node that joins a running job was checked by the coordinator (the
  // others run no such round now).
  if (absl::Status s =
          membership_.epoch > 0
              ? absl::OkStatus()
              : engine::CheckOptionsAgree(*transport_, eo, absl::Now() + config_.op_timeout);
      !s.ok()) {
    return FlagError("options", s);
  }
  {
    absl::MutexLock lock(&mu_);
    engine_ = std::make_unique<engine::Engine>(eo, membership_, client_.get(), transport_.get(),
                                               ops_.get());
    // The next epochs' data planes measure no links again: the first's model.
    if (const transport::LinkModel* m = transport_->link_model(); m != nullptr) {
      first_link_model_ = *m;
    }
    // An elastic job's engine releases data planes as epochs pass: the first
    // one too.
    if (eo.elastic) engine_->AdoptTransport(std::move(transport_));
  }
  // From here on a stop is the orderly shutdown (Stop).
  if (serving) serving();
  return Serve(eo);
}

void DaemonImpl::Stop(const std::string& why) {
  if (stopped_) return;
  stopped_ = true;
  MICROD_LOG(Info, "%s: shutting down", why.c_str());
  // Whatever Start brought up (all of it, unless it failed half-way).
  if (admin_ != nullptr) admin_->SetServing(kHealthService, false);
  // An elastic job goes on without this node: it leaves first, so that what
  // its stop breaks (its processes' connections, its data plane) is not the
  // job's failure.
  const bool leave_first = config_.elastic() && client_ != nullptr && membership_.session != 0;
  if (leave_first) (void)client_->Leave();
  if (local_server_ != nullptr) local_server_->Stop();  // no new work; removes the socket
  if (engine_ != nullptr) {
    engine_->Stop(absl::CancelledError(
        absl::StrCat("microd on node ", membership_.node_rank, " is shutting down")));
  }
  timeline_file_.reset();  // its last write, with every step run
  if (!leave_first && client_ != nullptr && membership_.session != 0) (void)client_->Leave();
  if (admin_ != nullptr) admin_->Shutdown(absl::Now() + absl::Seconds(1));
  if (const std::string& a = config_.admin; absl::StartsWith(a, "unix:") && admin_ != nullptr) {
    unlink(a.c_str() + 5);
  }
  if (coordinator_server_ != nullptr) coordinator_server_->Shutdown(absl::Now() + absl::Seconds(1));
}

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Create(DaemonConfig c) {
  // A dense job has no velocity to correct.
  if (c.sparsify.sparsifier == sparsify::SparsifierKind::kDense) c.sparsify.momentum = 0.0;
  RETURN_IF_ERROR(c.Validate());
  std::vector<std::string> remedies = sparsify::ApplyRemedies(c.remedies, &c.sparsify);
  if (c.sparsify.warmup_dense_above > 0 && c.sparsify.warmup_density == 0.0) {
    return FlagError(
        "--warmup_dense_above",
        absl::InvalidArgumentError(
            "marks which steps of the warm-up's density decay run dense, and there is no "
            "decay: give the warm-up's flags, or --remedies=warmup,min_k for the default "
            "one"));
  }
  if (c.sparsify.momentum > 0) {
    remedies.push_back(absl::StrFormat(
        "momentum correction %g with momentum factor masking (the velocity is zeroed where "
        "values are sent)",
        c.sparsify.momentum));
  }
  // Over NCCL a cycle would wait for the other nodes inside an NCCL kernel,
  // spinning on the GPU the training shares: the coordinator negotiates.
  if (c.response_cache && c.transport == "nccl") {
    c.response_cache = false;
    MICROD_LOG(Info,
               "--transport=nccl: the response cache is off (every step through the "
               "coordinator)");
  }
  if (c.state_secret.empty()) c.state_secret = c.token;
  if (c.node_name.empty()) c.node_name = HostName();
  log::SetIdentity(c.node_name, -1);
  uint64_t budget = 0;
  std::string source;
  if (c.max_state_bytes > 0) {
    budget = c.max_state_bytes;
    source = "--max_state_bytes";
  } else if (c.transport != "nccl") {
    const MemoryLimit limit = DetectMemoryLimit();
    budget = limit.bytes / 10 * 8;
    source = absl::StrCat("80% of ", limit.bytes, " bytes, ", limit.source);
  }
  return std::unique_ptr<Daemon>(new Daemon(
      std::make_unique<DaemonImpl>(std::move(c), std::move(remedies), budget, std::move(source))));
}

Daemon::Daemon(std::unique_ptr<DaemonImpl> impl) : impl_(std::move(impl)) {}
Daemon::~Daemon() = default;

absl::Status Daemon::Start(const std::function<void()>& serving) { return impl_->Start(serving); }
void Daemon::Stop(const std::string& why) { impl_->Stop(why); }
const DaemonConfig& Daemon::config() const { return impl_->config(); }
const std::vector<std::string>& Daemon::remedies() const { return impl_->remedies(); }
int Daemon::coordinator_port() const { return impl_->coordinator_port(); }
int Daemon::admin_port() const { return impl_->admin_port(); }
int Daemon::metrics_port() const { return impl_->metrics_port(); }
int Daemon::node_rank() const { return impl_->node_rank(); }

}  // namespace microd
