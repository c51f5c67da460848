// SPDX-License-Identifier: Apache-2.0
#include "daemon/control/services.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/resource_quota.h>

#include <algorithm>
#include <chrono>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/common/grpc_status.h"
#include "daemon/control/address.h"

namespace microd::control {
namespace {

// The server-side bound of a blocking call: the client's deadline, the
// request's own timeout when given, and never more than kMaxServerWait.
absl::Time Deadline(const grpc::ServerContext* ctx, int64_t timeout_ms = 0) {
  const absl::Time now = absl::Now();
  absl::Time d = now + kMaxServerWait;
  const auto client = ctx->deadline();
  if (client != std::chrono::system_clock::time_point::max()) {
    d = std::min(d, absl::FromChrono(client));
  }
  if (timeout_ms > 0) d = std::min(d, now + absl::Milliseconds(timeout_ms));
  return d;
}

}  // namespace

microd::v1::JobState ToProto(JobState state) {
  switch (state) {
    case JobState::kForming:
      return microd::v1::JOB_STATE_FORMING;
    case JobState::kRunning:
      return microd::v1::JOB_STATE_RUNNING;
    case JobState::kFailed:
      return microd::v1::JOB_STATE_FAILED;
    case JobState::kFinished:
      return microd::v1::JOB_STATE_FINISHED;
  }
  return microd::v1::JOB_STATE_UNSPECIFIED;
}

static void ToProto(const Membership& m, microd::v1::JoinResponse* resp) {
  resp->set_node_rank(m.node_rank);
  resp->set_node_count(m.node_count);
  for (int s : m.local_sizes) resp->add_local_sizes(s);
  for (const auto& n : m.node_names) resp->add_node_names(n);
  resp->set_world_size(m.world_size);
  resp->set_session(m.session);
  resp->set_epoch(m.epoch);
  resp->set_first_batch(m.first_batch);
  resp->set_graceful(m.graceful);
  for (const std::string& s : m.link_salts) resp->add_link_salts(s);
}

grpc::Status CoordinatorService::Join(grpc::ServerContext* ctx, const microd::v1::JoinRequest* req,
                                      microd::v1::JoinResponse* resp) {
  if (req->timeout_ms() < 0) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "timeout_ms is negative");
  }
  // The URIs of the client's certificate (mutual TLS), where it names its job.
  std::vector<std::string> uris;
  if (const std::shared_ptr<const grpc::AuthContext> auth = ctx->auth_context(); auth != nullptr) {
    for (const grpc::string_ref& v : auth->FindPropertyValues(GRPC_PEER_URI_PROPERTY_NAME)) {
      uris.emplace_back(v.data(), v.size());
    }
  }
  auto m = coordinator_->Join(
      req->job_id(), req->node_name(), req->local_size(), req->token_proof(), req->requested_rank(),
      Deadline(ctx, req->timeout_ms()), HostOfGrpcPeer(ctx->peer()), req->options(), uris);
  if (!m.ok()) return ToGrpcStatus(m.status());
  ToProto(*m, resp);
  resp->set_observed_host(HostOfGrpcPeer(ctx->peer()));
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::KeySet(grpc::ServerContext*, const microd::v1::KeySetRequest* req,
                                        microd::v1::KeySetResponse*) {
  return ToGrpcStatus(coordinator_->KeySet(req->session(), req->key(), req->value()));
}

grpc::Status CoordinatorService::KeyGet(grpc::ServerContext* ctx,
                                        const microd::v1::KeyGetRequest* req,
                                        microd::v1::KeyGetResponse* resp) {
  if (req->timeout_ms() < 0) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "timeout_ms is negative");
  }
  const std::vector<std::string> keys(req->keys().begin(), req->keys().end());
  const absl::Time deadline =
      req->timeout_ms() == 0 ? absl::Now() : Deadline(ctx, req->timeout_ms());
  auto values = coordinator_->KeyGet(req->session(), keys, deadline);
  if (!values.ok()) return ToGrpcStatus(values.status());
  for (auto& v : *values) resp->add_values(std::move(v));
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::Report(grpc::ServerContext*, const microd::v1::ReportRequest* req,
                                        microd::v1::ReportResponse*) {
  std::vector<BucketInfo> ready;
  ready.reserve(req->ready_size());
  for (const auto& b : req->ready()) ready.push_back({b.name(), b.dtype(), b.count(), b.dense()});
  return ToGrpcStatus(coordinator_->Report(req->session(), req->node_rank(), ready, req->seq()));
}

grpc::Status CoordinatorService::Poll(grpc::ServerContext* ctx, const microd::v1::PollRequest* req,
                                      microd::v1::PollResponse* resp) {
  if (req->timeout_ms() < 0) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "timeout_ms is negative");
  }
  auto batches = coordinator_->Poll(req->session(), req->node_rank(), req->next(),
                                    Deadline(ctx, req->timeout_ms()));
  if (!batches.ok()) return ToGrpcStatus(batches.status());
  uint64_t next = req->next();
  for (const ScheduleBatch& b : *batches) {
    auto* out = resp->add_batches();
    out->set_index(b.index);
    for (const auto& info : b.scheduled) {
      auto* s = out->add_scheduled();
      s->set_name(info.name);
      s->set_dtype(static_cast<microd::v1::DataType>(info.dtype));
      s->set_count(info.count);
      s->set_dense(info.dense);
    }
    for (const auto& [name, message] : b.errors) {
      auto* e = out->add_errors();
      e->set_name(name);
      e->set_message(message);
    }
    out->set_change_epoch(b.change_epoch);
    if (b.membership.has_value()) ToProto(*b.membership, out->mutable_membership());
    out->set_change(b.change);
    next = b.index + 1;
  }
  resp->set_next(next);
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::Heartbeat(grpc::ServerContext*,
                                           const microd::v1::HeartbeatRequest* req,
                                           microd::v1::HeartbeatResponse* resp) {
  std::vector<BucketWait> waiting;
  for (const auto& w : req->waiting()) {
    BucketWait b{w.name(), w.seconds(), {}};
    for (const auto& m : w.missing()) b.missing.push_back({m.local_rank(), m.pid()});
    waiting.push_back(std::move(b));
  }
  auto r = coordinator_->Heartbeat(req->session(), req->node_rank(), std::move(waiting));
  if (!r.ok()) return ToGrpcStatus(r.status());
  resp->set_state(ToProto(r->state));
  resp->set_failure(r->failure);
  for (const std::string& s : r->stalls) resp->add_stalls(s);
  for (const std::string& s : r->waits) resp->add_waits(s);
  resp->set_epoch(r->epoch);
  if (r->membership.has_value()) ToProto(*r->membership, resp->mutable_membership());
  resp->set_change(r->change);
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::Leave(grpc::ServerContext*, const microd::v1::LeaveRequest* req,
                                       microd::v1::LeaveResponse*) {
  return ToGrpcStatus(coordinator_->Leave(req->session(), req->node_rank()));
}

grpc::Status CoordinatorService::Fail(grpc::ServerContext*, const microd::v1::FailRequest* req,
                                      microd::v1::FailResponse*) {
  return ToGrpcStatus(coordinator_->ReportFailure(req->session(), req->node_rank(), req->reason(),
                                                  req->data_plane(), req->refused_transfer()));
}

grpc::Status AdminService::GetStatus(grpc::ServerContext*, const microd::v1::GetStatusRequest* req,
                                     microd::v1::GetStatusResponse* resp) {
  source_(*req, resp);
  return grpc::Status::OK;
}

grpc::Status AdminService::GetTimeline(grpc::ServerContext* ctx,
                                       const microd::v1::GetTimelineRequest* req,
                                       microd::v1::GetTimelineResponse* resp) {
  if (timeline_ == nullptr) return grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "no timeline");
  if (!(req->seconds() >= 0 && req->seconds() <= 3600)) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "timeline: seconds must be in [0, 3600]");
  }
  return timeline_(ctx, *req, resp);
}

void FillJobStatus(const JobSnapshot& job, microd::v1::GetStatusResponse* resp) {
  resp->set_job_state(ToProto(job.state));
  resp->set_failure(job.failure);
  resp->set_is_coordinator(true);
  for (const NodeSnapshot& n : job.nodes) {
    auto* s = resp->add_nodes();
    s->set_rank(n.rank);
    s->set_name(n.name);
    s->set_local_size(n.local_size);
    s->set_seconds_since_heartbeat(n.seconds_since_heartbeat);
    s->set_left(n.left);
  }
  resp->set_min_nodes(job.min_nodes < job.expected_nodes ? job.min_nodes : 0);
  resp->set_max_nodes(
      job.max_nodes > job.expected_nodes || job.min_nodes < job.expected_nodes ? job.max_nodes : 0);
  const absl::Time now = absl::Now();
  for (const MembershipChange& c : job.changes) {
    auto* m = resp->add_membership_changes();
    m->set_epoch(c.epoch);
    m->set_seconds_ago(absl::ToDoubleSeconds(now - c.at));
    m->set_cause(c.cause);
    m->set_nodes(c.nodes);
  }
}

namespace {

// Reflection on one server's builder, or off. Linking gRPC's reflection
// library registers its plugin for every server (a static initializer), so
// the option removes it where it is not wanted and adds it only if missing.
class ReflectionOption final : public grpc::ServerBuilderOption {
 public:
  explicit ReflectionOption(bool on) : on_(on) {}
  void UpdateArguments(grpc::ChannelArguments*) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    const std::string name = grpc::reflection::ProtoServerReflectionPlugin().name();
    auto it = std::find_if(plugins->begin(), plugins->end(),
                           [&](const auto& p) { return p->name() == name; });
    if (!on_ && it != plugins->end()) plugins->erase(it);
    if (on_ && it == plugins->end()) {
      plugins->push_back(std::make_unique<grpc::reflection::ProtoServerReflectionPlugin>());
    }
  }

 private:
  const bool on_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ControlServer>> ControlServer::Start(
    const std::string& address, std::vector<grpc::Service*> services,
    const ControlServerOptions& options) {
  static const bool once = [] {
    grpc::EnableDefaultHealthCheckService(true);
    return true;
  }();
  (void)once;
  auto server = std::unique_ptr<ControlServer>(new ControlServer());
  grpc::ServerBuilder builder;
  builder.SetOption(std::make_unique<ReflectionOption>(options.reflection));
  // Long polls hold a server thread each; keep enough polling threads around
  // that a new call never waits for one to be created.
  builder.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::MIN_POLLERS, 4);
  builder.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::MAX_POLLERS, 64);
  if (options.max_threads > 0) {
    grpc::ResourceQuota quota("microd-control");
    quota.SetMaxThreads(options.max_threads);
    builder.SetResourceQuota(quota);
  }
  builder.AddListeningPort(
      address, options.credentials ? options.credentials : grpc::InsecureServerCredentials(),
      &server->port_);
  for (grpc::Service* s : services) builder.RegisterService(s);
  if (options.interceptors) builder.experimental().SetInterceptorCreators(options.interceptors());
  server->server_ = builder.BuildAndStart();
  // A unix: address has no port (gRPC reports a placeholder for it).
  const bool unix_socket = absl::StartsWith(address, "unix:");
  if (server->server_ == nullptr || (!unix_socket && server->port_ == 0)) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", address));
  }
  if (unix_socket) {
    server->port_ = 0;
    server->address_ = address;
    return server;
  }
  const std::string host = address.substr(0, address.rfind(':'));
  server->address_ = absl::StrCat(host, ":", server->port_);
  return server;
}

ControlServer::~ControlServer() { Shutdown(absl::Now() + absl::Seconds(1)); }

void ControlServer::SetServing(const std::string& service, bool serving) {
  if (server_ == nullptr) return;
  if (grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService()) {
    health->SetServingStatus(service, serving);
  }
}

void ControlServer::Shutdown(absl::Time deadline) {
  if (server_ == nullptr) return;
  server_->Shutdown(absl::ToChronoTime(deadline));
  server_->Wait();
  server_.reset();
}

}  // namespace microd::control
