// SPDX-License-Identifier: Apache-2.0
// The gRPC services: thin translations between proto messages and the
// Coordinator (coordinator.h), plus the Admin service and the server start-up.
#pragma once

#include <grpcpp/grpcpp.h>
#include <grpcpp/support/server_interceptor.h>

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/control/coordinator.h"
#include "microd/v1/admin.grpc.pb.h"
#include "microd/v1/coordinator.grpc.pb.h"

namespace microd::control {

// The longest a server-side wait lasts when the client set no deadline.
constexpr absl::Duration kMaxServerWait = absl::Minutes(10);

class CoordinatorService final : public microd::v1::Coordinator::Service {
 public:
  explicit CoordinatorService(Coordinator* coordinator) : coordinator_(coordinator) {}

  grpc::Status Join(grpc::ServerContext* ctx, const microd::v1::JoinRequest* req,
                    microd::v1::JoinResponse* resp) override;
  grpc::Status KeySet(grpc::ServerContext* ctx, const microd::v1::KeySetRequest* req,
                      microd::v1::KeySetResponse* resp) override;
  grpc::Status KeyGet(grpc::ServerContext* ctx, const microd::v1::KeyGetRequest* req,
                      microd::v1::KeyGetResponse* resp) override;
  grpc::Status Report(grpc::ServerContext* ctx, const microd::v1::ReportRequest* req,
                      microd::v1::ReportResponse* resp) override;
  grpc::Status Poll(grpc::ServerContext* ctx, const microd::v1::PollRequest* req,
                    microd::v1::PollResponse* resp) override;
  grpc::Status Heartbeat(grpc::ServerContext* ctx, const microd::v1::HeartbeatRequest* req,
                         microd::v1::HeartbeatResponse* resp) override;
  grpc::Status Leave(grpc::ServerContext* ctx, const microd::v1::LeaveRequest* req,
                     microd::v1::LeaveResponse* resp) override;
  grpc::Status Fail(grpc::ServerContext* ctx, const microd::v1::FailRequest* req,
                    microd::v1::FailResponse* resp) override;

 private:
  Coordinator* const coordinator_;
};

// Admin: the daemon fills the status; the service only serves it.
class AdminService final : public microd::v1::Admin::Service {
 public:
  using StatusSource =
      std::function<void(const microd::v1::GetStatusRequest&, microd::v1::GetStatusResponse*)>;
  using TimelineSource =
      std::function<grpc::Status(grpc::ServerContext*, const microd::v1::GetTimelineRequest&,
                                 microd::v1::GetTimelineResponse*)>;
  explicit AdminService(StatusSource source, TimelineSource timeline = nullptr)
      : source_(std::move(source)), timeline_(std::move(timeline)) {}
  grpc::Status GetStatus(grpc::ServerContext* ctx, const microd::v1::GetStatusRequest* req,
                         microd::v1::GetStatusResponse* resp) override;
  grpc::Status GetTimeline(grpc::ServerContext* ctx, const microd::v1::GetTimelineRequest* req,
                           microd::v1::GetTimelineResponse* resp) override;

 private:
  StatusSource source_;
  TimelineSource timeline_;
};

microd::v1::JobState ToProto(JobState state);
// Fills the coordinator's view of the job into an Admin status.
void FillJobStatus(const JobSnapshot& job, microd::v1::GetStatusResponse* resp);

struct ControlServerOptions {
  // Plaintext when null (tls.h: ServerCredentialsFor).
  std::shared_ptr<grpc::ServerCredentials> credentials;
  // gRPC server reflection (grpcurl and the like): on for Admin, off for
  // the coordinator.
  bool reflection = false;
  // Server threads at most (0: gRPC's default, unbounded); calls beyond
  // them are refused (RESOURCE_EXHAUSTED) rather than queued.
  int max_threads = 0;
  // Interceptors of every call (tests look at what crosses the wire).
  std::function<
      std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>()>
      interceptors;
};

// A gRPC server on `address` ("host:port"; port 0 picks one) serving the given
// services, with gRPC health checking.
class ControlServer {
 public:
  static absl::StatusOr<std::unique_ptr<ControlServer>> Start(
      const std::string& address, std::vector<grpc::Service*> services,
      const ControlServerOptions& options = {});
  ~ControlServer();
  int port() const { return port_; }  // 0 for a unix: address
  std::string address() const { return address_; }
  // Stops accepting calls and waits for running ones until `deadline`
  // (then cancels them).
  void Shutdown(absl::Time deadline);
  // What grpc.health.v1.Health/Check answers for `service` (the server as a
  // whole, "", is SERVING from Start on). Thread-safe.
  void SetServing(const std::string& service, bool serving);

 private:
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::string address_;
};

}  // namespace microd::control
