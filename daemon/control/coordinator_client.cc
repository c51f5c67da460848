// SPDX-License-Identifier: Apache-2.0
#include "daemon/control/coordinator_client.h"

#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/common/grpc_status.h"
#include "daemon/common/log.h"

namespace microd::control {
namespace {

constexpr absl::Duration kAnswerGrace = absl::Seconds(2);

// A server-side wait bound in milliseconds (at least 1: 0 means "no wait").
int64_t ServerTimeoutMs(absl::Time deadline) {
  return std::max<int64_t>(1, absl::ToInt64Milliseconds(deadline - absl::Now()));
}

}  // namespace

CoordinatorClient::CoordinatorClient(CoordinatorClientOptions options)
    : options_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<CoordinatorClient>> CoordinatorClient::Create(
    CoordinatorClientOptions options) {
  if (options.address.empty()) return absl::InvalidArgumentError("no coordinator address");
  if (options.node_name.empty()) return absl::InvalidArgumentError("empty node name");
  if (options.peer_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("peer timeout must be positive");
  }
  std::unique_ptr<CoordinatorClient> c(new CoordinatorClient(std::move(options)));
  // No gRPC keepalive: heartbeats detect a dead coordinator, and pings more
  // frequent than the server allows make it close the connection.
  grpc::ChannelArguments args;
  AddTlsChannelArgs(c->options_.tls, &args);
  c->channel_ =
      grpc::CreateCustomChannel(c->options_.address, ChannelCredentialsFor(c->options_.tls), args);
  c->stub_ = microd::v1::Coordinator::NewStub(c->channel_);
  return c;
}

CoordinatorClient::~CoordinatorClient() { StopHeartbeats(); }

void CoordinatorClient::StopHeartbeats() {
  if (!stop_.HasBeenNotified()) stop_.Notify();
  if (heartbeat_.joinable()) heartbeat_.join();
}

std::unique_ptr<grpc::ClientContext> CoordinatorClient::Context(absl::Time deadline) const {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(absl::ToChronoTime(deadline));
  // Wait for the coordinator to come up rather than failing at once.
  ctx->set_wait_for_ready(true);
  return ctx;
}

namespace {

// A membership as the coordinator sent it, checked.
absl::StatusOr<Membership> FromProto(const microd::v1::JoinResponse& resp) {
  Membership m;
  m.node_rank = resp.node_rank();
  m.node_count = resp.node_count();
  m.local_sizes.assign(resp.local_sizes().begin(), resp.local_sizes().end());
  m.node_names.assign(resp.node_names().begin(), resp.node_names().end());
  m.world_size = resp.world_size();
  m.session = resp.session();
  m.epoch = resp.epoch();
  m.first_batch = resp.first_batch();
  m.graceful = resp.graceful();
  m.link_salts.assign(resp.link_salts().begin(), resp.link_salts().end());
  if (m.node_rank < 0 || m.node_rank >= m.node_count ||
      static_cast<int>(m.local_sizes.size()) != m.node_count ||
      static_cast<int>(m.node_names.size()) != m.node_count) {
    return absl::InternalError("inconsistent membership from the coordinator");
  }
  // Checked where they key the data plane (SealKeys): an older
  // coordinator's membership has none, which a node that seals refuses.
  return m;
}

}  // namespace

void CoordinatorClient::Answered() {
  absl::MutexLock lock(&mu_);
  last_answer_ = absl::Now();
}

absl::Status CoordinatorClient::Unreachable(const grpc::Status& s, const char* what) {
  absl::Duration silent;
  {
    absl::MutexLock lock(&mu_);
    silent = absl::Now() - last_answer_;
  }
  const bool transient = s.error_code() == grpc::StatusCode::UNAVAILABLE ||
                         s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
  if (transient && silent <= options_.peer_timeout) return absl::OkStatus();
  const absl::Status st = FromGrpcStatus(s);
  if (!transient) return st;  // the coordinator's own answer (e.g. the job failed)
  return absl::UnavailableError(absl::StrCat(
      "node ", Identity().second, " ('", options_.node_name, "') lost the coordinator (node 0 at ",
      options_.address, "): no answer to its ", what, " for ",
      absl::FormatDuration(absl::Trunc(silent, absl::Milliseconds(1))), " (peer timeout ",
      absl::FormatDuration(options_.peer_timeout), "): ", st.message()));
}

Membership CoordinatorClient::membership() const {
  absl::MutexLock lock(&mu_);
  return membership_;
}

std::pair<uint64_t, int> CoordinatorClient::Identity() const {
  absl::MutexLock lock(&mu_);
  return {membership_.session, membership_.node_rank};
}

void CoordinatorClient::SetMembershipCallback(MembershipCallback callback) {
  absl::MutexLock lock(&mu_);
  on_membership_ = std::move(callback);
}

absl::Status CoordinatorClient::job_status() const {
  absl::MutexLock lock(&mu_);
  return failed_;
}

void CoordinatorClient::SetFailureCallback(std::function<void(const absl::Status&)> callback) {
  absl::MutexLock lock(&mu_);
  on_failure_ = std::move(callback);
}

void CoordinatorClient::SetWaitingProvider(std::function<std::vector<BucketWait>()> provider) {
  absl::MutexLock lock(&mu_);
  waiting_ = std::move(provider);
}

std::vector<std::string> CoordinatorClient::stalls() const {
  absl::MutexLock lock(&mu_);
  return stalls_;
}

std::vector<std::string> CoordinatorClient::Reports() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> all = stalls_;
  all.insert(all.end(), waits_.begin(), waits_.end());
  return all;
}

void CoordinatorClient::MarkFailed(const absl::Status& status) {
  std::function<void(const absl::Status&)> callback;
  {
    absl::MutexLock lock(&mu_);
    if (!failed_.ok()) return;
    failed_ = status;
    callback = on_failure_;
  }
  MICROD_LOG(Error, "node '%s': %s", options_.node_name.c_str(),
             std::string(status.message()).c_str());
  if (callback) callback(status);
}

absl::StatusOr<Membership> CoordinatorClient::Join(absl::Time deadline) {
  if (absl::Status s = job_status(); !s.ok()) return s;
  microd::v1::JoinRequest req;
  req.set_job_id(options_.job_id);
  req.set_node_name(options_.node_name);
  req.set_local_size(options_.local_size);
  req.set_token_proof(options_.token_proof);
  req.set_requested_rank(options_.requested_rank);
  req.set_timeout_ms(ServerTimeoutMs(deadline));
  req.set_options(options_.options);
  microd::v1::JoinResponse resp;
  // The server answers by `deadline` with a precise error; the call itself
  // gets a little longer so that answer is not lost to the transport deadline.
  auto ctx = Context(deadline + kAnswerGrace);
  grpc::Status s = stub_->Join(ctx.get(), req, &resp);
  if (!s.ok()) {
    absl::Status st = FromGrpcStatus(s);
    std::string why;
    if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED &&
        channel_->GetState(false) != GRPC_CHANNEL_READY) {
      // Never connected: nothing listens there, or the handshake failed.
      if (options_.tls.files()) {
        why =
            " (no connection was made: the coordinator is down, or the TLS handshake "
            "failed: check that each side's certificate is signed by the CA the other "
            "trusts (--tls_ca), that the coordinator's names the address dialed "
            "(or --tls_server_name), and that the coordinator uses TLS)";
      } else if (options_.tls.enabled()) {
        why =
            " (no connection was made: the coordinator is down, or the TLS handshake its job "
            "token keys failed: the coordinator holds another token, no token, or "
            "certificates of its own; give every node the same --token_file)";
      } else {
        why =
            " (no connection was made: the coordinator is down, or it uses TLS and this "
            "node does not: give --token_file if the job has a token, or --tls_ca, and "
            "--tls_cert/--tls_key for mutual TLS)";
      }
    }
    return absl::Status(st.code(),
                        absl::StrCat("join ", options_.address, ": ", st.message(), why));
  }
  Answered();
  absl::StatusOr<Membership> m = FromProto(resp);
  if (!m.ok()) return absl::InternalError(absl::StrCat("join: ", m.status().message()));
  m->observed_host = resp.observed_host();
  {
    absl::MutexLock lock(&mu_);
    membership_ = *m;
  }
  heartbeat_ = std::thread([this] { HeartbeatLoop(); });
  return *m;
}

grpc::Status CoordinatorClient::HeartbeatOnce(absl::Duration timeout) {
  microd::v1::HeartbeatRequest req;
  const auto [session, rank] = Identity();
  req.set_session(session);
  req.set_node_rank(rank);
  std::function<std::vector<BucketWait>()> provider;
  {
    absl::MutexLock lock(&mu_);
    provider = waiting_;
  }
  if (provider) {
    for (const BucketWait& w : provider()) {
      auto* out = req.add_waiting();
      out->set_name(w.name);
      out->set_seconds(w.seconds);
      for (const auto& [local_rank, pid] : w.missing) {
        auto* m = out->add_missing();
        m->set_local_rank(local_rank);
        m->set_pid(pid);
      }
    }
  }
  microd::v1::HeartbeatResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  grpc::Status s = stub_->Heartbeat(&ctx, req, &resp);
  if (s.ok()) {
    Answered();
    {
      absl::MutexLock lock(&mu_);
      stalls_.assign(resp.stalls().begin(), resp.stalls().end());
      waits_.assign(resp.waits().begin(), resp.waits().end());
    }
    // A new epoch: this node survived a change of membership.
    if (resp.has_membership()) TakeMembership(resp.membership(), resp.change());
    if (resp.state() == microd::v1::JOB_STATE_FAILED) {
      MarkFailed(absl::AbortedError(absl::StrCat("job failed: ", resp.failure())));
    } else if (resp.state() == microd::v1::JOB_STATE_FINISHED) {
      MarkFailed(absl::FailedPreconditionError(absl::StrCat("job finished: ", resp.failure())));
    }
    return s;
  }
  if (s.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED &&
      s.error_code() != grpc::StatusCode::UNAVAILABLE) {
    MarkFailed(absl::AbortedError(
        absl::StrCat("job failed: coordinator refused heartbeat: ", s.error_message())));
  }
  return s;
}

void CoordinatorClient::TakeMembership(const microd::v1::JoinResponse& resp,
                                       const std::string& change) {
  absl::StatusOr<Membership> m = FromProto(resp);
  if (!m.ok()) {
    MarkFailed(absl::InternalError(
        absl::StrCat("job failed: a bad membership from the coordinator: ", m.status().message())));
    return;
  }
  MembershipCallback callback;
  {
    absl::MutexLock lock(&mu_);
    // Each epoch's membership is taken once: the same one again (a stale
    // heartbeat's answer after the poll's marker brought it) or an older one
    // changes nothing.
    if (m->epoch <= membership_.epoch) return;
    m->observed_host = membership_.observed_host;
    membership_ = *m;
    callback = on_membership_;
  }
  MICROD_LOG(Warning, "node '%s': membership epoch %llu: node %d of %d (%s)",
             options_.node_name.c_str(), static_cast<unsigned long long>(m->epoch), m->node_rank,
             m->node_count, change.c_str());
  if (callback) callback(*m, change);
}

absl::Status CoordinatorClient::RefreshJobStatus() {
  if (Identity().first != 0 && job_status().ok()) HeartbeatOnce(absl::Seconds(1));
  return job_status();
}

void CoordinatorClient::HeartbeatLoop() {
  const absl::Duration interval = options_.heartbeat_interval > absl::ZeroDuration()
                                      ? options_.heartbeat_interval
                                      : options_.peer_timeout / 10;
  do {
    const grpc::Status s = HeartbeatOnce(std::max(interval, absl::Milliseconds(200)));
    if (!job_status().ok()) return;
    if (s.ok()) continue;
    // Either side may be the one cut off: the message names both.
    if (absl::Status lost = Unreachable(s, "heartbeats"); !lost.ok()) {
      MarkFailed(absl::Status(lost.code(), absl::StrCat("job failed: ", lost.message())));
      return;
    }
  } while (!stop_.WaitForNotificationWithTimeout(interval));
}

absl::Status CoordinatorClient::Set(const std::string& key, const std::string& value) {
  if (absl::Status s = job_status(); !s.ok()) return s;
  microd::v1::KeySetRequest req;
  req.set_session(Identity().first);
  req.set_key(key);
  req.set_value(value);
  microd::v1::KeySetResponse resp;
  auto ctx = Context(absl::Now() + options_.call_timeout);
  return FromGrpcStatus(stub_->KeySet(ctx.get(), req, &resp));
}

absl::StatusOr<std::vector<std::string>> CoordinatorClient::Get(absl::Span<const std::string> keys,
                                                                absl::Time deadline) {
  if (absl::Status s = job_status(); !s.ok()) return s;
  microd::v1::KeyGetRequest req;
  req.set_session(Identity().first);
  for (const auto& k : keys) req.add_keys(k);
  const absl::Time now = absl::Now();
  req.set_timeout_ms(deadline <= now ? 0 : ServerTimeoutMs(deadline));
  microd::v1::KeyGetResponse resp;
  auto ctx = Context(std::max(deadline, now) + kAnswerGrace);
  grpc::Status s = stub_->KeyGet(ctx.get(), req, &resp);
  if (!s.ok()) return FromGrpcStatus(s);
  return std::vector<std::string>(resp.values().begin(), resp.values().end());
}

absl::Status CoordinatorClient::Report(const std::vector<BucketInfo>& ready) {
  if (absl::Status s = job_status(); !s.ok()) return s;
  microd::v1::ReportRequest req;
  const auto [session, rank] = Identity();
  req.set_session(session);
  req.set_node_rank(rank);
  for (const BucketInfo& b : ready) {
    auto* r = req.add_ready();
    r->set_name(b.name);
    r->set_dtype(static_cast<microd::v1::DataType>(b.dtype));
    r->set_count(b.count);
    r->set_dense(b.dense);
  }
  // Numbered, so that a resend after a lost answer is taken once.
  req.set_seq(++report_seq_);
  for (;;) {
    microd::v1::ReportResponse resp;
    auto ctx = Context(absl::Now() + std::min(options_.call_timeout, options_.peer_timeout));
    grpc::Status s = stub_->Report(ctx.get(), req, &resp);
    if (s.ok()) {
      Answered();
      return absl::OkStatus();
    }
    if (absl::Status failed = job_status(); !failed.ok()) return failed;
    if (absl::Status lost = Unreachable(s, "report"); !lost.ok()) return lost;
    if (stop_.WaitForNotificationWithTimeout(absl::Milliseconds(100))) {
      return absl::CancelledError("report: the node is stopping");
    }
  }
}

absl::StatusOr<std::vector<ScheduleBatch>> CoordinatorClient::Poll(uint64_t next,
                                                                   absl::Time deadline) {
  if (absl::Status s = job_status(); !s.ok()) return s;
  microd::v1::PollRequest req;
  const auto [session, rank] = Identity();
  req.set_session(session);
  req.set_node_rank(rank);
  req.set_next(next);
  req.set_timeout_ms(ServerTimeoutMs(deadline));
  microd::v1::PollResponse resp;
  auto ctx = Context(deadline + kAnswerGrace);
  grpc::Status s = stub_->Poll(ctx.get(), req, &resp);
  std::vector<ScheduleBatch> out;
  if (!s.ok()) {
    if (absl::Status failed = job_status(); !failed.ok()) return failed;
    if (absl::Status lost = Unreachable(s, "poll"); !lost.ok()) return lost;
    // No news yet: the caller polls again (not at once if it failed early).
    const absl::Duration left = deadline - absl::Now();
    if (left > absl::ZeroDuration()) {
      stop_.WaitForNotificationWithTimeout(std::min(left, absl::Milliseconds(100)));
    }
    return out;
  }
  Answered();
  uint64_t expect = next;
  for (const auto& b : resp.batches()) {
    if (b.index() != expect) return absl::InternalError("poll: batches out of order");
    ScheduleBatch batch;
    batch.index = b.index();
    for (const auto& r : b.scheduled()) {
      batch.scheduled.push_back({r.name(), r.dtype(), r.count(), r.dense()});
    }
    for (const auto& e : b.errors()) batch.errors.push_back({e.name(), e.message()});
    batch.change_epoch = b.change_epoch();
    batch.change = b.change();
    if (b.has_membership()) {
      // The marker of a change: this node's membership in the next epoch.
      absl::StatusOr<Membership> m = FromProto(b.membership());
      if (!m.ok()) return absl::InternalError(absl::StrCat("poll: ", m.status().message()));
      batch.membership = *m;
      TakeMembership(b.membership(), b.change());
    }
    out.push_back(std::move(batch));
    ++expect;
  }
  return out;
}

absl::Status CoordinatorClient::Leave() {
  StopHeartbeats();
  const auto [session, rank] = Identity();
  if (session == 0) return absl::OkStatus();
  microd::v1::LeaveRequest req;
  req.set_session(session);
  req.set_node_rank(rank);
  microd::v1::LeaveResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
  return FromGrpcStatus(stub_->Leave(&ctx, req, &resp));
}

}  // namespace microd::control

namespace microd::control {

absl::Status CoordinatorClient::ReportFailure(const std::string& reason) {
  return SendFailure(reason, /*data_plane=*/false);
}

absl::Status CoordinatorClient::ReportDataPlaneFailure(const std::string& reason) {
  return SendFailure(reason, /*data_plane=*/true);
}

absl::Status CoordinatorClient::ReportRefusedTransfer(const std::string& reason) {
  return SendFailure(reason, /*data_plane=*/true, /*refused_transfer=*/true);
}

absl::Status CoordinatorClient::SendFailure(const std::string& reason, bool data_plane,
                                            bool refused_transfer) {
  const auto [session, rank] = Identity();
  if (session == 0) return absl::FailedPreconditionError("not joined");
  microd::v1::FailRequest req;
  req.set_session(session);
  req.set_node_rank(rank);
  req.set_reason(reason);
  req.set_data_plane(data_plane);
  req.set_refused_transfer(refused_transfer);
  microd::v1::FailResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
  return FromGrpcStatus(stub_->Fail(&ctx, req, &resp));
}

}  // namespace microd::control
