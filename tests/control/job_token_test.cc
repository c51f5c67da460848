// SPDX-License-Identifier: Apache-2.0
// The job token (job_token.h): proved, never sent. The TLS it derives
// admits the nodes that hold it and nobody else, and no control message
// carries the token or the data plane's secret (issue X, finding 1: the
// token crossed the wire in clear in every join, and the data plane's keys
// followed from it and the salt, which crossed in clear too).
#include "daemon/control/job_token.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/support/server_interceptor.h>

#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "daemon/control/coordinator.h"
#include "daemon/control/coordinator_client.h"
#include "daemon/control/services.h"
#include "daemon/control/tls.h"
#include "gtest/gtest.h"

namespace microd::control {
namespace {

constexpr char kToken[] = "the job's token, 32 bytes or so.";

std::shared_ptr<const JobToken> Stretch(const std::string& token) {
  auto t = JobToken::FromToken(token);
  EXPECT_TRUE(t.ok()) << t.status();
  return *std::move(t);
}

TEST(JobTokenTest, EveryNodeDerivesTheSameIdentityAndOnlyFromTheSameToken) {
  auto a = Stretch(kToken), b = Stretch(kToken), other = Stretch("another token");
  EXPECT_EQ(a->tls().cert, b->tls().cert);
  EXPECT_EQ(a->tls().key, b->tls().key);
  EXPECT_EQ(a->data_plane_secret(), b->data_plane_secret());
  EXPECT_NE(a->tls().key, other->tls().key);
  EXPECT_NE(a->data_plane_secret(), other->data_plane_secret());
  EXPECT_TRUE(absl::StrContains(a->tls().cert, "BEGIN CERTIFICATE")) << a->tls().cert;
  EXPECT_TRUE(absl::StrContains(a->tls().key, "PRIVATE KEY"));
  // Nothing derived shows the token.
  for (const std::string& s :
       {a->tls().cert, a->tls().key, a->data_plane_secret(), a->JoinProof("job", "node")}) {
    EXPECT_FALSE(absl::StrContains(s, kToken));
  }
  EXPECT_EQ(JobToken::FromToken("").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(JobTokenTest, AProofNamesItsJobAndNode) {
  auto t = Stretch(kToken);
  const std::string proof = t->JoinProof("job", "node-1");
  EXPECT_EQ(proof.size(), 32u);
  EXPECT_TRUE(t->Proves(proof, "job", "node-1"));
  EXPECT_FALSE(t->Proves(proof, "job", "node-2")) << "replayed as another node";
  EXPECT_FALSE(t->Proves(proof, "job2", "node-1")) << "replayed into another job";
  EXPECT_FALSE(t->Proves(proof, "jobn", "ode-1")) << "the same bytes cut elsewhere";
  EXPECT_FALSE(t->Proves("", "job", "node-1"));
  EXPECT_FALSE(Stretch("another token")->Proves(proof, "job", "node-1"));
}

// Every message of the coordinator's service, as the server read or wrote it.
class Recorder {
 public:
  void Add(const std::string& method, const google::protobuf::Message& m) {
    absl::MutexLock lock(&mu_);
    seen_.push_back({method, m.SerializeAsString()});
  }
  std::vector<std::pair<std::string, std::string>> seen() {
    absl::MutexLock lock(&mu_);
    return seen_;
  }

 private:
  absl::Mutex mu_;
  std::vector<std::pair<std::string, std::string>> seen_ ABSL_GUARDED_BY(mu_);
};

class RecordingInterceptor final : public grpc::experimental::Interceptor {
 public:
  RecordingInterceptor(Recorder* r, std::string method) : r_(r), method_(std::move(method)) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* m) override {
    using grpc::experimental::InterceptionHookPoints;
    if (m->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_MESSAGE) &&
        m->GetRecvMessage() != nullptr) {
      r_->Add(method_, *static_cast<const google::protobuf::Message*>(m->GetRecvMessage()));
    }
    if (m->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_MESSAGE) &&
        m->GetSendMessage() != nullptr) {
      r_->Add(method_, *static_cast<const google::protobuf::Message*>(m->GetSendMessage()));
    }
    m->Proceed();
  }

 private:
  Recorder* const r_;
  const std::string method_;
};

class RecordingFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit RecordingFactory(Recorder* r) : r_(r) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new RecordingInterceptor(r_, info->method());
  }

 private:
  Recorder* const r_;
};

class JobTlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    token_ = Stretch(kToken);
    CoordinatorOptions o;
    o.job_id = "job";
    o.token = token_;
    o.expected_nodes = 2;
    coordinator_ = *Coordinator::Create(o);
    service_ = std::make_unique<CoordinatorService>(coordinator_.get());
    ControlServerOptions so;
    so.credentials = ServerCredentialsFor(Tls(token_));
    so.interceptors = [this] {
      std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> v;
      v.push_back(std::make_unique<RecordingFactory>(&recorder_));
      return v;
    };
    auto server = ControlServer::Start("127.0.0.1:0", {service_.get()}, so);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(server).value();
  }

  static TlsFiles Tls(const std::shared_ptr<const JobToken>& t) {
    TlsFiles f;
    if (t != nullptr) f.job = std::make_shared<TlsIdentity>(t->tls());
    return f;
  }

  std::unique_ptr<CoordinatorClient> Client(const std::string& name,
                                            const std::shared_ptr<const JobToken>& t) {
    CoordinatorClientOptions o;
    o.address = server_->address();
    o.job_id = "job";
    o.node_name = name;
    if (t != nullptr) o.token_proof = t->JoinProof("job", name);
    o.tls = Tls(t);
    return *CoordinatorClient::Create(o);
  }

  std::shared_ptr<const JobToken> token_;
  Recorder recorder_;
  std::unique_ptr<Coordinator> coordinator_;
  std::unique_ptr<CoordinatorService> service_;
  std::unique_ptr<ControlServer> server_;
};

// Two nodes that hold the token join over the TLS it derives and use every
// kind of call; no message any of them exchanged carries the token, its
// stretched secrets or anything else a capture could key the data plane
// from (the epoch's salt travels, but only inside that TLS).
TEST_F(JobTlsTest, NodesWithTheTokenJoinAndNoMessageCarriesIt) {
  auto a = Client("a", token_), b = Client("b", token_);
  absl::StatusOr<Membership> ma, mb;
  std::thread t([&] { mb = b->Join(absl::Now() + absl::Seconds(20)); });
  ma = a->Join(absl::Now() + absl::Seconds(20));
  t.join();
  ASSERT_TRUE(ma.ok()) << ma.status();
  ASSERT_TRUE(mb.ok()) << mb.status();
  EXPECT_EQ(ma->link_salts.at(1 - ma->node_rank).size(), 32u);
  ASSERT_TRUE(a->Set(absl::StrCat("gloo/e0/", ma->node_rank), "address").ok());
  ASSERT_TRUE(
      b->Get({absl::StrCat("gloo/e0/", ma->node_rank)}, absl::Now() + absl::Seconds(5)).ok());
  ASSERT_TRUE(a->Report({{"grad", 1, 1000}}).ok());
  ASSERT_TRUE(b->Report({{"grad", 1, 1000}}).ok());
  auto batches = a->Poll(0, absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(batches.ok()) << batches.status();
  ASSERT_TRUE(a->Leave().ok());
  ASSERT_TRUE(b->Leave().ok());

  const auto seen = recorder_.seen();
  std::set<std::string> methods;
  for (const auto& [method, bytes] : seen) methods.insert(method);
  for (const char* m : {"Join", "KeySet", "KeyGet", "Report", "Poll", "Leave"}) {
    EXPECT_EQ(methods.count(absl::StrCat("/microd.v1.Coordinator/", m)), 1u) << m;
  }
  for (const auto& [method, bytes] : seen) {
    EXPECT_FALSE(absl::StrContains(bytes, kToken)) << method;
    EXPECT_FALSE(absl::StrContains(bytes, token_->data_plane_secret())) << method;
    EXPECT_FALSE(absl::StrContains(bytes, "PRIVATE KEY")) << method;
  }
}

// Without the token there is no control plane to speak to: a node with
// another token, or none (plaintext), never gets through the handshake,
// and the error says what to check.
TEST_F(JobTlsTest, WithoutTheTokenNoHandshakeCompletes) {
  for (const auto& t : {Stretch("another token"), std::shared_ptr<const JobToken>()}) {
    auto c = Client("stranger", t);
    auto m = c->Join(absl::Now() + absl::Seconds(2));
    ASSERT_FALSE(m.ok());
    EXPECT_TRUE(absl::StrContains(m.status().message(), "no connection was made")) << m.status();
    EXPECT_TRUE(absl::StrContains(m.status().message(), t != nullptr ? "token" : "TLS"))
        << m.status();
  }
  // The coordinator saw no message at all.
  EXPECT_TRUE(recorder_.seen().empty());
}

}  // namespace
}  // namespace microd::control
