// SPDX-License-Identifier: Apache-2.0
// The Coordinator and Admin services against a real gRPC server on port 0.
#include "daemon/control/coordinator.h"

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <set>
#include <thread>

#include "absl/strings/match.h"
#include "daemon/common/log.h"
#include "daemon/control/coordinator_client.h"
#include "daemon/control/services.h"
#include "daemon/join_options.h"
#include "gtest/gtest.h"
#include "microd/v1/admin.grpc.pb.h"

namespace microd::control {
namespace {

// The job token `token` stretches to (each once: scrypt takes a while).
std::shared_ptr<const JobToken> Token(const std::string& token) {
  static absl::Mutex mu(absl::kConstInit);
  static auto* cache = new std::map<std::string, std::shared_ptr<const JobToken>>();
  absl::MutexLock lock(&mu);
  auto& t = (*cache)[token];
  if (t == nullptr) t = *JobToken::FromToken(token);
  return t;
}

// The members' link salts are the epoch's: one per link, the same at both
// ends, 32 bytes, none at a node's own rank, every link's its own.
void ExpectLinkSaltsAgree(const std::vector<const Membership*>& m) {
  std::set<std::string> seen;
  for (size_t i = 0; i < m.size(); ++i) {
    ASSERT_EQ(m[i]->link_salts.size(), m.size()) << "node " << i;
    EXPECT_TRUE(m[i]->link_salts[i].empty()) << "node " << i;
    for (size_t j = i + 1; j < m.size(); ++j) {
      EXPECT_EQ(m[i]->link_salts[j].size(), 32u);
      EXPECT_EQ(m[i]->link_salts[j], m[j]->link_salts[i]) << "link " << i << "-" << j;
      seen.insert(m[i]->link_salts[j]);
    }
  }
  EXPECT_EQ(seen.size(), m.size() * (m.size() - 1) / 2) << "links share a salt";
}

// No salt of one membership is in the other (a new epoch's are fresh).
bool NoSaltShared(const Membership& a, const Membership& b) {
  for (const std::string& x : a.link_salts) {
    for (const std::string& y : b.link_salts) {
      if (!x.empty() && x == y) return false;
    }
  }
  return true;
}

// What a node holding `token` sends as job `job`'s node `name`.
std::string Proof(const std::string& token, const std::string& job, const std::string& name) {
  return Token(token)->JoinProof(job, name);
}

class CoordinatorTest : public ::testing::Test {
 protected:
  void Start(int nodes, absl::Duration peer_timeout = absl::Seconds(10),
             std::string token = "secret", int min_nodes = 0) {
    CoordinatorOptions o;
    o.job_id = "job";
    if (!token.empty()) o.token = Token(token);
    o.expected_nodes = nodes;
    o.peer_timeout = peer_timeout;
    o.min_nodes = min_nodes;
    coordinator_ = *Coordinator::Create(o);
    service_ = std::make_unique<CoordinatorService>(coordinator_.get());
    admin_ = std::make_unique<AdminService>(
        [this](const microd::v1::GetStatusRequest&, microd::v1::GetStatusResponse* r) {
          r->set_node_name("test");
          FillJobStatus(coordinator_->Snapshot(), r);
        });
    auto server = ControlServer::Start("127.0.0.1:0", {service_.get(), admin_.get()});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(server).value();
    ASSERT_GT(server_->port(), 0);
    channel_ = grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials());
    stub_ = microd::v1::Coordinator::NewStub(channel_);
  }

  std::unique_ptr<CoordinatorClient> Client(const std::string& name, int local_size = 1,
                                            int rank = -1, std::string token = "secret",
                                            absl::Duration peer_timeout = absl::Seconds(10)) {
    CoordinatorClientOptions o;
    o.address = server_->address();
    o.job_id = "job";
    o.node_name = name;
    o.token_proof = Proof(token, "job", name);
    o.local_size = local_size;
    o.requested_rank = rank;
    o.peer_timeout = peer_timeout;
    return *CoordinatorClient::Create(o);
  }

  // Joins all clients concurrently.
  std::vector<absl::StatusOr<Membership>> JoinAll(
      std::vector<std::unique_ptr<CoordinatorClient>>& clients) {
    std::vector<absl::StatusOr<Membership>> out(clients.size(), absl::UnknownError(""));
    std::vector<std::thread> threads;
    for (size_t i = 0; i < clients.size(); ++i) {
      threads.emplace_back([&, i] {
        // Stagger so join order is deterministic.
        std::this_thread::sleep_for(std::chrono::milliseconds(30 * i));
        out[i] = clients[i]->Join(absl::Now() + absl::Seconds(10));
      });
    }
    for (auto& t : threads) t.join();
    return out;
  }

  std::unique_ptr<Coordinator> coordinator_;
  std::unique_ptr<CoordinatorService> service_;
  std::unique_ptr<AdminService> admin_;
  std::unique_ptr<ControlServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<microd::v1::Coordinator::Stub> stub_;
};

TEST_F(CoordinatorTest, JoinAssignsRanksAndReportsTheJob) {
  Start(3);
  std::vector<std::unique_ptr<CoordinatorClient>> c;
  c.push_back(Client("a", 1));
  c.push_back(Client("b", 2, /*rank=*/0));
  c.push_back(Client("c", 3));
  auto m = JoinAll(c);
  for (auto& r : m) ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(m[1]->node_rank, 0);  // requested
  EXPECT_EQ(m[0]->node_rank, 1);  // first free, in join order
  EXPECT_EQ(m[2]->node_rank, 2);
  for (auto& r : m) {
    EXPECT_EQ(r->node_count, 3);
    EXPECT_EQ(r->world_size, 6);
    EXPECT_EQ(r->local_sizes, (std::vector<int>{2, 1, 3}));
    EXPECT_EQ(r->node_names, (std::vector<std::string>{"b", "a", "c"}));
    // Where the coordinator saw the join come from (clients on loopback).
    EXPECT_EQ(r->observed_host, "127.0.0.1");
  }
  // Each node its own credential.
  EXPECT_NE(m[0]->session, m[1]->session);
  EXPECT_NE(m[1]->session, m[2]->session);
  EXPECT_NE(m[0]->session, m[2]->session);
}

TEST_F(CoordinatorTest, JoinTimesOutSayingHowManyArrivedAndCanBeRetried) {
  Start(3);
  auto a = Client("a");
  auto m = a->Join(absl::Now() + absl::Milliseconds(300));
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(absl::StrContains(m.status().message(), "1 of 3")) << m.status();
  // The timed-out node was removed: the same name may join again.
  std::vector<std::unique_ptr<CoordinatorClient>> c;
  c.push_back(Client("a"));
  c.push_back(Client("b"));
  c.push_back(Client("c"));
  for (auto& r : JoinAll(c)) EXPECT_TRUE(r.ok()) << r.status();
}

TEST_F(CoordinatorTest, WrongTokenDuplicateNameAndTakenRankAreRefused) {
  Start(2);
  auto bad = Client("x", 1, -1, "wrong");
  auto m = bad->Join(absl::Now() + absl::Seconds(2));
  EXPECT_EQ(m.status().code(), absl::StatusCode::kUnauthenticated) << m.status();

  std::thread first([&] {
    auto a = Client("a", 1, 1);
    EXPECT_EQ(a->Join(absl::Now() + absl::Milliseconds(1500)).status().code(),
              absl::StatusCode::kDeadlineExceeded);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  auto same_name = Client("a");
  EXPECT_EQ(same_name->Join(absl::Now() + absl::Seconds(1)).status().code(),
            absl::StatusCode::kAlreadyExists);
  auto same_rank = Client("b", 1, 1);
  EXPECT_EQ(same_rank->Join(absl::Now() + absl::Seconds(1)).status().code(),
            absl::StatusCode::kAlreadyExists);
  first.join();
}

// An unauthenticated caller learns nothing of the job (before: a rank out of
// range was refused naming --nodes before the token was looked at), and
// guessing is slowed: after 5 wrong tokens in a row a host's joins are
// refused for a while, the right token included.
TEST_F(CoordinatorTest, WrongTokensComeFirstAndAreRateLimitedPerHost) {
  Start(2);
  auto join = [&](const std::string& token, int rank, std::string* message = nullptr) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    microd::v1::JoinRequest req;
    req.set_job_id("job");
    req.set_node_name("guesser");
    req.set_local_size(1);
    req.set_token_proof(Proof(token, "job", "guesser"));
    req.set_requested_rank(rank);
    req.set_timeout_ms(200);
    microd::v1::JoinResponse resp;
    grpc::Status s = stub_->Join(&ctx, req, &resp);
    if (message != nullptr) *message = s.error_message();
    return s.error_code();
  };
  std::string message;
  EXPECT_EQ(join("guess", 99, &message), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_FALSE(absl::StrContains(message, "[0, 2)")) << message;
  for (int i = 1; i < 5; ++i) EXPECT_EQ(join("guess", -1), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(join("secret", -1, &message), grpc::StatusCode::UNAVAILABLE);
  EXPECT_TRUE(absl::StrContains(message, "too many wrong job tokens from 127.0.0.1")) << message;
  // The pause ends; the right token then works (and clears the count).
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  EXPECT_EQ(join("secret", -1), grpc::StatusCode::DEADLINE_EXCEEDED);  // 1 of 2 nodes came
  EXPECT_EQ(join("guess", -1), grpc::StatusCode::UNAUTHENTICATED);
}

TEST_F(CoordinatorTest, MalformedRequestsGetInvalidArgument) {
  Start(1);
  auto call_join = [&](const microd::v1::JoinRequest& req) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    microd::v1::JoinResponse resp;
    microd::v1::JoinRequest proved = req;
    proved.set_token_proof(Proof("secret", req.job_id(), req.node_name()));
    return stub_->Join(&ctx, proved, &resp).error_code();
  };
  microd::v1::JoinRequest req;
  req.set_job_id("job");
  req.set_local_size(1);
  req.set_requested_rank(-1);
  EXPECT_EQ(call_join(req), grpc::StatusCode::INVALID_ARGUMENT);  // empty name
  req.set_node_name(std::string(300, 'n'));
  EXPECT_EQ(call_join(req), grpc::StatusCode::INVALID_ARGUMENT);  // name too long
  req.set_node_name("n");
  req.set_local_size(-3);
  EXPECT_EQ(call_join(req), grpc::StatusCode::INVALID_ARGUMENT);  // negative size
  req.set_local_size(1);
  req.set_requested_rank(5);
  EXPECT_EQ(call_join(req), grpc::StatusCode::INVALID_ARGUMENT);  // rank out of range
  req.set_requested_rank(-1);
  req.set_job_id("");
  EXPECT_EQ(call_join(req), grpc::StatusCode::INVALID_ARGUMENT);  // empty job

  auto a = Client("a");
  auto m = a->Join(absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(m.ok()) << m.status();
  auto report = [&](int64_t count, const std::string& name, uint64_t session, int rank) {
    microd::v1::ReportRequest rr;
    rr.set_session(session);
    rr.set_node_rank(rank);
    auto* b = rr.add_ready();
    b->set_name(name);
    b->set_dtype(microd::v1::DATA_TYPE_FLOAT32);
    b->set_count(count);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    microd::v1::ReportResponse resp;
    return stub_->Report(&ctx, rr, &resp).error_code();
  };
  EXPECT_EQ(report(-5, "w", m->session, 0), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(report(0, "w", m->session, 0), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(report(int64_t{1} << 32, "w", m->session, 0), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(report(5, "", m->session, 0), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(report(5, "w", m->session, 7), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(report(5, "w", m->session, -1), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(report(5, "w", m->session + 1, 0), grpc::StatusCode::PERMISSION_DENIED);
  // Still serving: a well-formed report is scheduled.
  ASSERT_TRUE(a->Report({{"w", 1, 5}}).ok());
  auto r = a->Poll(0, absl::Now() + absl::Seconds(2));
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->size(), 1u);
  ASSERT_EQ((*r)[0].scheduled.size(), 1u);
  // Reporting it again before it ran, or polling a batch that does not exist, is refused.
  ASSERT_TRUE(a->Report({{"v", 1, 5}, {"v2", 1, 5}}).ok());
  EXPECT_EQ(a->Report({{"u", 1, 5}, {"u", 1, 5}}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(a->Poll(99, absl::Now() + absl::Seconds(2)).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Nothing new: the poll waits until its deadline and returns empty.
  r = a->Poll(2, absl::Now() + absl::Milliseconds(100));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->empty());
}

TEST_F(CoordinatorTest, KeyValueStoreSetGetWait) {
  Start(2);
  std::vector<std::unique_ptr<CoordinatorClient>> c;
  c.push_back(Client("a"));
  c.push_back(Client("b"));
  for (auto& r : JoinAll(c)) ASSERT_TRUE(r.ok()) << r.status();
  const std::string k1 = "k1", k2 = "k2";
  ASSERT_TRUE(c[0]->Set(k1, std::string("v\0 1", 4)).ok());
  auto v = c[1]->Get({&k1, 1}, absl::Now());
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ((*v)[0], std::string("v\0 1", 4));
  EXPECT_EQ(c[1]->Get({&k2, 1}, absl::Now()).status().code(), absl::StatusCode::kNotFound);
  std::thread later([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    EXPECT_TRUE(c[0]->Set(k2, "two").ok());
  });
  const std::vector<std::string> both = {k1, k2};
  v = c[1]->Get(both, absl::Now() + absl::Seconds(5));
  later.join();
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ((*v)[1], "two");
  const std::string missing = "never";
  auto t = c[1]->Get({&missing, 1}, absl::Now() + absl::Milliseconds(200));
  EXPECT_EQ(t.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(absl::StrContains(t.status().message(), "never")) << t.status();
  EXPECT_EQ(c[0]->Set("", "x").code(), absl::StatusCode::kInvalidArgument);
}

// A member used to be able to act as any node with the one session of the
// job: report, poll, heartbeat, leave or write Gloo's rendezvous entries as
// another rank. Each node's credential now speaks for that node only; the
// refused calls change nothing.
TEST_F(CoordinatorTest, ACredentialSpeaksOnlyForItsOwnRank) {
  Start(2);
  std::vector<std::unique_ptr<CoordinatorClient>> c;
  c.push_back(Client("a", 1, 0));
  c.push_back(Client("b", 1, 1));
  auto m = JoinAll(c);
  for (auto& r : m) ASSERT_TRUE(r.ok()) << r.status();
  const uint64_t mallory = m[1]->session;  // node 1's credential, acting for node 0
  auto code = [](const grpc::Status& s) { return s.error_code(); };
  {
    grpc::ClientContext ctx;
    microd::v1::ReportRequest req;
    microd::v1::ReportResponse resp;
    req.set_session(mallory);
    req.set_node_rank(0);
    auto* b = req.add_ready();
    b->set_name("w");
    b->set_dtype(microd::v1::DATA_TYPE_FLOAT32);
    b->set_count(10);
    EXPECT_EQ(code(stub_->Report(&ctx, req, &resp)), grpc::StatusCode::PERMISSION_DENIED);
  }
  {
    grpc::ClientContext ctx;
    microd::v1::HeartbeatRequest req;
    microd::v1::HeartbeatResponse resp;
    req.set_session(mallory);
    req.set_node_rank(0);
    EXPECT_EQ(code(stub_->Heartbeat(&ctx, req, &resp)), grpc::StatusCode::PERMISSION_DENIED);
  }
  {
    grpc::ClientContext ctx;
    microd::v1::PollRequest req;
    microd::v1::PollResponse resp;
    req.set_session(mallory);
    req.set_node_rank(0);
    req.set_timeout_ms(1);
    EXPECT_EQ(code(stub_->Poll(&ctx, req, &resp)), grpc::StatusCode::PERMISSION_DENIED);
  }
  {
    grpc::ClientContext ctx;
    microd::v1::LeaveRequest req;
    microd::v1::LeaveResponse resp;
    req.set_session(mallory);
    req.set_node_rank(0);
    EXPECT_EQ(code(stub_->Leave(&ctx, req, &resp)), grpc::StatusCode::PERMISSION_DENIED);
  }
  // Gloo's rendezvous entry of node 0, and a key node 0 wrote.
  auto key_set = [&](uint64_t session, const std::string& key, const std::string& value) {
    grpc::ClientContext ctx;
    microd::v1::KeySetRequest req;
    microd::v1::KeySetResponse resp;
    req.set_session(session);
    req.set_key(key);
    req.set_value(value);
    return code(stub_->KeySet(&ctx, req, &resp));
  };
  EXPECT_EQ(key_set(mallory, "gloo/e0/0", "evil:1"), grpc::StatusCode::PERMISSION_DENIED);
  // A job-wide key is node 0's even before node 0 writes it (before: the
  // first writer owned it, and node 0's own write was refused).
  EXPECT_EQ(key_set(mallory, "nccl/unique_id", "first"), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(key_set(m[0]->session, "gloo/e0/0", "node0:1"), grpc::StatusCode::OK);
  EXPECT_EQ(key_set(m[0]->session, "gloo/e0/0", "node0:2"), grpc::StatusCode::OK);  // its own
  EXPECT_EQ(key_set(m[0]->session, "nccl/unique_id", "id"), grpc::StatusCode::OK);
  EXPECT_EQ(key_set(mallory, "nccl/unique_id", "evil"), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(key_set(mallory, "gloo/e0/1", "node1:1"), grpc::StatusCode::OK);
  EXPECT_EQ(key_set(mallory, "gloo/e0/rank_1", "node1:1"), grpc::StatusCode::OK);
  EXPECT_EQ(key_set(mallory, "gloo/e0/rank_0", "evil:1"), grpc::StatusCode::PERMISSION_DENIED);
  const std::vector<std::string> keys = {"gloo/e0/0", "nccl/unique_id"};
  auto v = c[1]->Get(keys, absl::Now());
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ((*v)[0], "node0:2");
  EXPECT_EQ((*v)[1], "id");
  // The job is unaffected: both nodes run, node 0 did not leave.
  const JobSnapshot job = coordinator_->Snapshot();
  EXPECT_EQ(job.state, JobState::kRunning) << job.failure;
  ASSERT_EQ(job.nodes.size(), 2u);
  EXPECT_FALSE(job.nodes[0].left);
  // Each node's own calls still work.
  EXPECT_TRUE(c[0]->Report({{"w", 1, 10}}).ok());
  EXPECT_TRUE(c[1]->Report({{"w", 1, 10}}).ok());
}

TEST_F(CoordinatorTest, EveryNodeGetsTheSameScheduleAndMismatchErrors) {
  Start(3);
  std::vector<std::unique_ptr<CoordinatorClient>> c;
  for (const char* n : {"a", "b", "c"}) c.push_back(Client(n));
  for (auto& r : JoinAll(c)) ASSERT_TRUE(r.ok()) << r.status();
  std::vector<CoordinatorClient*> by_rank(3);
  for (auto& cl : c) by_rank[cl->membership().node_rank] = cl.get();
  // Node 0 and 2 report a, b, x; node 1 reports b and x with another size.
  ASSERT_TRUE(by_rank[0]->Report({{"a", 1, 10}, {"b", 1, 20}, {"x", 1, 100}}).ok());
  ASSERT_TRUE(by_rank[1]->Report({{"b", 1, 20}, {"x", 1, 200}}).ok());
  ASSERT_TRUE(by_rank[2]->Report({{"b", 1, 20}, {"a", 1, 10}, {"x", 1, 100}}).ok());
  // Later node 1 reports a and c: a completes, c waits for the others.
  ASSERT_TRUE(by_rank[1]->Report({{"a", 1, 10}, {"c", 1, 5}}).ok());
  std::vector<std::vector<ScheduleBatch>> got(3);
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      uint64_t next = 0;
      while (got[r].size() < 2) {
        auto b = by_rank[r]->Poll(next, absl::Now() + absl::Seconds(10));
        ASSERT_TRUE(b.ok()) << b.status();
        for (auto& x : *b) got[r].push_back(x);
        next = got[r].size();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 3; ++r) {
    ASSERT_EQ(got[r].size(), 2u);
    // Batch 0: "b" ready everywhere; "x" disagrees (node 1 says 200).
    ASSERT_EQ(got[r][0].scheduled.size(), 1u);
    EXPECT_EQ(got[r][0].scheduled[0].name, "b");
    ASSERT_EQ(got[r][0].errors.size(), 1u);
    EXPECT_EQ(got[r][0].errors[0].first, "x");
    EXPECT_TRUE(absl::StrContains(got[r][0].errors[0].second, "node 1"))
        << got[r][0].errors[0].second;
    // Batch 1: "a".
    ASSERT_EQ(got[r][1].scheduled.size(), 1u);
    EXPECT_EQ(got[r][1].scheduled[0].name, "a");
    EXPECT_TRUE(got[r][1].errors.empty());
  }
}

TEST_F(CoordinatorTest, SilentNodeFailsTheJobForEveryoneWithinThePeerTimeout) {
  Start(3, absl::Milliseconds(600));
  std::vector<std::unique_ptr<CoordinatorClient>> c;
  for (const char* n : {"a", "b", "c"})
    c.push_back(Client(n, 1, -1, "secret", absl::Milliseconds(600)));
  for (auto& r : JoinAll(c)) ASSERT_TRUE(r.ok()) << r.status();
  const auto start = std::chrono::steady_clock::now();
  // Node 0 waits for a batch that node 2 never completes.
  std::thread waiter([&] {
    ASSERT_TRUE(c[0]->Report({{"w", 1, 10}}).ok());
    auto r = c[0]->Poll(0, absl::Now() + absl::Seconds(30));
    EXPECT_FALSE(r.ok());
    EXPECT_TRUE(absl::StrContains(r.status().message(), "node 2")) << r.status();
  });
  c[2].reset();  // node 2 dies: no more heartbeats
  waiter.join();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  // The survivors learn it from their heartbeats.
  for (int i = 0; i < 50 && c[1]->job_status().ok(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_FALSE(c[1]->job_status().ok());
  EXPECT_TRUE(absl::StrContains(c[1]->job_status().message(), "silent")) << c[1]->job_status();
  // Afterwards nothing blocks.
  const std::string k = "k";
  EXPECT_FALSE(c[1]->Get({&k, 1}, absl::Now() + absl::Seconds(30)).ok());
}

// Issue Z: node 0's coordinator heard no heartbeat from any node, its own
// included, for 23 s, then failed the job naming them
// (docs/runs/2026-12-03-dense-stall.md). A coordinator whose lock a slow
// call holds past the peer timeout (or whose process is held) could not
// hear the nodes meanwhile: it no longer counts that silence against them,
// and a sentinel that takes no lock says what held its watchdog.
TEST_F(CoordinatorTest, ACoordinatorHeldPastThePeerTimeoutDoesNotBlameTheNodes) {
  std::vector<std::string> lines;
  absl::Mutex mu;
  log::SetSink([&](log::Level, const std::string& line) {
    absl::MutexLock lock(&mu);
    lines.push_back(line);
  });
  Start(3, absl::Milliseconds(600));
  std::vector<std::unique_ptr<CoordinatorClient>> c;
  // The nodes' own peer timeout is longer: their heartbeats ride it out.
  for (const char* n : {"a", "b", "c"}) c.push_back(Client(n, 1, -1, "secret", absl::Seconds(5)));
  for (auto& r : JoinAll(c)) ASSERT_TRUE(r.ok()) << r.status();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  coordinator_->HoldLockForTest(absl::Milliseconds(1500));
  std::this_thread::sleep_for(std::chrono::milliseconds(1000));
  EXPECT_EQ(coordinator_->Snapshot().state, JobState::kRunning) << coordinator_->Snapshot().failure;
  for (auto& client : c) EXPECT_TRUE(client->job_status().ok()) << client->job_status();
  log::SetSink(nullptr);
  bool sentinel = false, credited = false;
  for (const std::string& l : lines) {
    sentinel = sentinel || (absl::StrContains(l, "coordinator: its watchdog has not run for") &&
                            absl::StrContains(l, "for the coordinator's lock: a call holds it"));
    credited = credited || absl::StrContains(l,
                                             "late (this process, or the coordinator's lock, "
                                             "was held): the nodes' silence");
  }
  EXPECT_TRUE(sentinel);
  EXPECT_TRUE(credited);
}

// Issue Z's other suspect for the 23 s stall: long polls taking gRPC's
// server threads. 200 key reads that wait 3 s for a key no one writes
// (far more calls than gRPC's 64 pollers) hold the coordinator's threads
// while the nodes' heartbeats go on: no node is called silent (the peer
// timeout passes 4 times over), and a write and a read between two nodes
// are answered at once. The coordinator's server sets no thread limit:
// each call gets a thread, none waits for another's.
TEST_F(CoordinatorTest, LongPollsHoldingServerThreadsDoNotSilenceTheNodes) {
  Start(3, absl::Milliseconds(600));
  std::vector<std::unique_ptr<CoordinatorClient>> c;
  for (const char* n : {"a", "b", "c"}) {
    c.push_back(Client(n, 1, -1, "secret", absl::Milliseconds(600)));
  }
  for (auto& r : JoinAll(c)) ASSERT_TRUE(r.ok()) << r.status();
  constexpr int kPolls = 200;
  std::atomic<int> waited{0};
  std::vector<std::thread> polls;
  for (int i = 0; i < kPolls; ++i) {
    polls.emplace_back([&, i] {
      const std::string never = "never";
      auto r = c[i % 3]->Get({&never, 1}, absl::Now() + absl::Seconds(3));
      if (r.status().code() == absl::StatusCode::kDeadlineExceeded) ++waited;
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  EXPECT_EQ(coordinator_->Snapshot().state, JobState::kRunning) << coordinator_->Snapshot().failure;
  for (auto& client : c) EXPECT_TRUE(client->job_status().ok()) << client->job_status();
  const auto before = std::chrono::steady_clock::now();
  const std::string k = "k";
  ASSERT_TRUE(c[0]->Set(k, "v").ok());
  auto v = c[1]->Get({&k, 1}, absl::Now() + absl::Seconds(2));
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_LT(std::chrono::steady_clock::now() - before, std::chrono::seconds(1));
  for (auto& t : polls) t.join();
  EXPECT_EQ(waited.load(), kPolls);  // every poll held its thread to its end
  EXPECT_EQ(coordinator_->Snapshot().state, JobState::kRunning) << coordinator_->Snapshot().failure;
}

// Over gRPC, an elastic job: node 2 stops (no more heartbeats); the
// survivors' heartbeats bring them the next epoch (their callbacks called
// once, with the change's cause), every later call presents the new
// session and rank, and the schedule runs with the 3 of them.
TEST_F(CoordinatorTest, SurvivorsLearnTheNextEpochFromTheirHeartbeats) {
  Start(4, absl::Milliseconds(600), "secret", /*min_nodes=*/2);
  std::vector<std::unique_ptr<CoordinatorClient>> c;
  for (const char* n : {"a", "b", "c", "d"}) {
    c.push_back(Client(n, 1, -1, "secret", absl::Milliseconds(600)));
  }
  for (auto& r : JoinAll(c)) ASSERT_TRUE(r.ok()) << r.status();
  absl::Mutex mu;
  std::vector<std::pair<Membership, std::string>> told[4];
  for (int i : {0, 1, 3}) {
    c[i]->SetMembershipCallback([&, i](const Membership& m, const std::string& change) {
      absl::MutexLock lock(&mu);
      told[i].push_back({m, change});
    });
  }
  c[2].reset();
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  auto all_told = [&] {
    absl::MutexLock lock(&mu);
    return !told[0].empty() && !told[1].empty() && !told[3].empty();
  };
  while (!all_told() && absl::Now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_TRUE(all_told());
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // no second call
  const int want_rank[] = {0, 1, -1, 2};
  for (int i : {0, 1, 3}) {
    absl::MutexLock lock(&mu);
    ASSERT_EQ(told[i].size(), 1u) << "node " << i;
    const Membership& m = told[i][0].first;
    EXPECT_EQ(m.epoch, 1u);
    EXPECT_EQ(m.node_rank, want_rank[i]);
    EXPECT_EQ(m.node_count, 3);
    EXPECT_TRUE(absl::StrContains(told[i][0].second, "node 2 (c) silent")) << told[i][0].second;
    EXPECT_EQ(c[i]->membership().node_rank, want_rank[i]);
    EXPECT_TRUE(c[i]->job_status().ok()) << c[i]->job_status();
  }
  const uint64_t first = c[0]->membership().first_batch;
  for (int i : {0, 1, 3}) ASSERT_TRUE(c[i]->Report({{"w", 1, 10}}).ok());
  auto batches = c[3]->Poll(first, absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(batches.ok()) << batches.status();
  ASSERT_EQ(batches->size(), 1u);
  EXPECT_EQ((*batches)[0].scheduled[0].name, "w");
}

TEST_F(CoordinatorTest, AdminStatusAndHealthCheck) {
  Start(1);
  auto a = Client("solo", 4);
  ASSERT_TRUE(a->Join(absl::Now() + absl::Seconds(5)).ok());
  auto admin = microd::v1::Admin::NewStub(channel_);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  microd::v1::GetStatusResponse resp;
  ASSERT_TRUE(admin->GetStatus(&ctx, {}, &resp).ok());
  EXPECT_EQ(resp.job_state(), microd::v1::JOB_STATE_RUNNING);
  ASSERT_EQ(resp.nodes_size(), 1);
  EXPECT_EQ(resp.nodes(0).name(), "solo");
  EXPECT_EQ(resp.nodes(0).local_size(), 4);

  // grpc.health.v1.Health/Check with an empty request: SERVING is field 1 = 1.
  grpc::GenericStub generic(channel_);
  grpc::ClientContext hctx;
  hctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  grpc::ByteBuffer request, response;
  grpc::Slice empty;
  request = grpc::ByteBuffer(&empty, 1);
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  grpc::Status status;
  generic.UnaryCall(&hctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                    [&](grpc::Status s) {
                      std::lock_guard<std::mutex> l(mu);
                      status = s;
                      done = true;
                      cv.notify_all();
                    });
  std::unique_lock<std::mutex> l(mu);
  ASSERT_TRUE(cv.wait_for(l, std::chrono::seconds(5), [&] { return done; }));
  ASSERT_TRUE(status.ok()) << status.error_message();
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(response.Dump(&slices).ok());
  std::string bytes;
  for (auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  EXPECT_EQ(bytes, std::string("\x08\x01", 2));
}

TEST_F(CoordinatorTest, LeaveEndsTheJobCleanly) {
  Start(2);
  std::vector<std::unique_ptr<CoordinatorClient>> c;
  c.push_back(Client("a"));
  c.push_back(Client("b"));
  for (auto& r : JoinAll(c)) ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(c[1]->Leave().ok());
  auto r = c[0]->Poll(0, absl::Now() + absl::Seconds(10));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_TRUE(absl::StrContains(r.status().message(), "left")) << r.status();
}

}  // namespace
}  // namespace microd::control

namespace microd::control {
namespace {

// A report sent again after a lost answer (same number) is taken once: the
// bucket is not pending twice, and the next step's report schedules again.
// Every node seals its data plane or none does: a node that differs from
// the first is refused at the join, naming both (its data plane would not
// connect). Each job has a salt of its own.
TEST(CoordinatorSeal, ANodeThatDiffersOnSealingIsRefusedAtTheJoin) {
  CoordinatorOptions o;
  o.job_id = "job";
  o.expected_nodes = 2;
  o.check_options = CheckJoinOptions;  // the daemon's rule
  auto c = *Coordinator::Create(o);
  std::vector<absl::StatusOr<Membership>> m(2, absl::UnknownError(""));
  std::thread t0([&] {
    m[0] = c->Join("job", "a", 1, "", 0, absl::Now() + absl::Seconds(5), "", "--seal=on\n");
  });
  absl::SleepFor(absl::Milliseconds(200));
  auto refused = c->Join("job", "b", 1, "", 1, absl::Now() + absl::Seconds(1), "", "--seal=off\n");
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(refused.status().message(),
                                "node 'b' may not join: it does not seal its data plane and node "
                                "'a' does"))
      << refused.status();
  m[1] = c->Join("job", "b", 1, "", 1, absl::Now() + absl::Seconds(5), "", "--seal=on\n");
  t0.join();
  ASSERT_TRUE(m[0].ok()) << m[0].status();
  ASSERT_TRUE(m[1].ok()) << m[1].status();
  ExpectLinkSaltsAgree({&*m[0], &*m[1]});
  o.expected_nodes = 1;
  auto other = *Coordinator::Create(o);
  auto lone = other->Join("job", "a", 1, "", 0, absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(lone.ok()) << lone.status();
  EXPECT_EQ(lone->link_salts, std::vector<std::string>{""}) << "a node alone has no link";
}

// Issue X, finding 8: the job a join's certificate names (mutual TLS: its
// URI subjectAltNames) is checked, whatever the job id it sends says; with
// no token the certificate must name the job.
TEST(CoordinatorCertificates, ACertificateMustNameTheJobWhereItAdmitsTheNode) {
  for (const bool required : {false, true}) {
    SCOPED_TRACE(required ? "mutual TLS, no token" : "a token or no mutual TLS");
    CoordinatorOptions o;
    o.job_id = "job";
    o.expected_nodes = 1;
    o.certificate_names_job = required;
    auto c = *Coordinator::Create(o);
    auto join = [&](const std::vector<std::string>& uris) {
      return c->Join("job", "a", 1, "", 0, absl::Now() + absl::Seconds(5), "10.0.0.9", "", uris);
    };
    auto other = join({"spiffe://x/y", "microd://job/other"});
    ASSERT_FALSE(other.ok());
    EXPECT_EQ(other.status().code(), absl::StatusCode::kPermissionDenied);
    EXPECT_TRUE(absl::StrContains(other.status().message(),
                                  "node 'a' (10.0.0.9): its certificate is for job(s) 'other', "
                                  "not job 'job'"))
        << other.status();
    auto none = join({"spiffe://x/y"});
    EXPECT_EQ(none.ok(), !required) << none.status();
    if (required) {
      EXPECT_TRUE(absl::StrContains(none.status().message(),
                                    "its certificate names no job, and job 'job' has no job "
                                    "token: it admits only certificates that name it (a URI "
                                    "subjectAltName microd://job/job)"))
          << none.status();
    }
  }
  CoordinatorOptions o;
  o.job_id = "job";
  o.expected_nodes = 1;
  o.certificate_names_job = true;
  auto c = *Coordinator::Create(o);
  auto named = c->Join("job", "a", 1, "", 0, absl::Now() + absl::Seconds(5), "", "",
                       {"microd://job/other", "microd://job/job"});
  EXPECT_TRUE(named.ok()) << named.status();
}

TEST(CoordinatorReports, AResentReportIsTakenOnce) {
  CoordinatorOptions o;
  o.job_id = "job";
  o.expected_nodes = 2;
  auto c = *Coordinator::Create(o);
  std::vector<absl::StatusOr<Membership>> m(2, absl::UnknownError(""));
  std::thread t0([&] { m[0] = c->Join("job", "a", 1, "", 0, absl::Now() + absl::Seconds(10)); });
  std::thread t1([&] { m[1] = c->Join("job", "b", 1, "", 1, absl::Now() + absl::Seconds(10)); });
  t0.join();
  t1.join();
  ASSERT_TRUE(m[0].ok()) << m[0].status();
  ASSERT_TRUE(m[1].ok()) << m[1].status();
  const uint64_t session = m[0]->session, session1 = m[1]->session;
  const std::vector<BucketInfo> w = {{"w", 1, 10}};
  ASSERT_TRUE(c->Report(session, 0, w, 1).ok());
  EXPECT_TRUE(c->Report(session, 0, w, 1).ok()) << "a resend is answered OK";
  ASSERT_TRUE(c->Report(session1, 1, w, 1).ok());
  auto batches = c->Poll(session, 0, 0, absl::Now() + absl::Seconds(1));
  ASSERT_TRUE(batches.ok()) << batches.status();
  ASSERT_EQ(batches->size(), 1u);
  // Nothing pending from the resend: the next reports schedule "w" again.
  ASSERT_TRUE(c->Report(session, 0, w, 2).ok());
  ASSERT_TRUE(c->Report(session1, 1, w, 2).ok());
  batches = c->Poll(session, 0, 1, absl::Now() + absl::Seconds(1));
  ASSERT_TRUE(batches.ok()) << batches.status();
  EXPECT_EQ(batches->size(), 1u);
  // A number out of order is an error.
  EXPECT_EQ(c->Report(session, 0, w, 5).code(), absl::StatusCode::kInvalidArgument);
}

// A job of `names.size()` nodes (ranks in that order) on the coordinator's
// own API, for the elastic tests.
std::vector<Membership> JoinDirect(Coordinator& c, const std::vector<std::string>& names) {
  std::vector<absl::StatusOr<Membership>> m(names.size(), absl::UnknownError(""));
  std::vector<std::thread> threads;
  for (size_t i = 0; i < names.size(); ++i) {
    threads.emplace_back([&, i] {
      m[i] = c.Join("job", names[i], 1, "", static_cast<int>(i), absl::Now() + absl::Seconds(10));
    });
  }
  for (auto& t : threads) t.join();
  std::vector<Membership> out;
  for (auto& x : m) {
    EXPECT_TRUE(x.ok()) << x.status();
    out.push_back(x.ok() ? *x : Membership{});
  }
  return out;
}

std::unique_ptr<Coordinator> ElasticCoordinator(
    int nodes, int min_nodes, absl::Duration timeout = absl::Milliseconds(500), int max_nodes = 0,
    absl::Duration elastic_timeout = absl::ZeroDuration(), int max_refusal_epochs = 3) {
  CoordinatorOptions o;
  o.max_refusal_epochs = max_refusal_epochs;
  o.job_id = "job";
  o.expected_nodes = nodes;
  o.min_nodes = min_nodes;
  o.max_nodes = max_nodes;
  o.elastic_timeout = elastic_timeout;
  o.peer_timeout = timeout;
  o.check_options = CheckJoinOptions;  // the daemon's rule
  return *Coordinator::Create(o);
}

// Heartbeats of the nodes `alive` (by session) every 50 ms until `until`.
void BeatUntil(Coordinator& c, const std::vector<Membership*>& alive, absl::Time until,
               const std::function<bool()>& done) {
  while (absl::Now() < until && !done()) {
    for (Membership* m : alive) {
      auto a = c.Heartbeat(m->session, m->node_rank);
      ASSERT_TRUE(a.ok()) << a.status();
      if (a->membership.has_value()) *m = *a->membership;  // a survivor's new membership
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

// An elastic job (4 nodes, at least 2) loses node 2: the coordinator forms
// epoch 1 of nodes 0, 1 and 3, renumbered 0, 1, 2 in the order of their
// ranks, each told by its next heartbeat (a new session); the old sessions
// are refused elsewhere, naming the epoch; the lost node's is unknown; the
// new epoch's schedule works with 3 nodes; the job never failed.
// A sealed transfer refused on a node (--seal_failure=step): the next epoch
// forms at once, of the same nodes in the same order, with fresh sessions
// and a fresh seal salt; a second report of it (an old session) changes
// nothing.
TEST(CoordinatorSeal, ARefusedTransferFormsTheNextEpochOfTheSameNodes) {
  auto c = ElasticCoordinator(3, 2);
  std::vector<Membership> m = JoinDirect(*c, {"a", "b", "c"});
  const std::vector<Membership> before = m;
  ASSERT_TRUE(c->ReportFailure(m[2].session, 2, "the sealed transfer from node 0 to node 2 failed",
                               /*data_plane=*/true, /*refused_transfer=*/true)
                  .ok());
  const JobSnapshot snap = c->Snapshot();
  EXPECT_EQ(snap.state, JobState::kRunning);
  EXPECT_EQ(snap.epoch, 1u);
  ASSERT_EQ(snap.changes.size(), 1u);
  EXPECT_TRUE(absl::StrContains(snap.changes[0].cause, "node 2 (c): the sealed transfer"))
      << snap.changes[0].cause;
  EXPECT_TRUE(absl::StrContains(snap.changes[0].cause, "keyed afresh")) << snap.changes[0].cause;
  BeatUntil(*c, {&m[0], &m[1], &m[2]}, absl::Now() + absl::Seconds(10),
            [&] { return m[0].epoch == 1 && m[1].epoch == 1 && m[2].epoch == 1; });
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(m[i].node_rank, i);
    EXPECT_EQ(m[i].node_count, 3);
    EXPECT_NE(m[i].session, before[i].session);
    EXPECT_TRUE(NoSaltShared(m[i], before[i])) << i;
  }
  ExpectLinkSaltsAgree({&m[0], &m[1], &m[2]});
  EXPECT_FALSE(
      c->ReportFailure(before[1].session, 1, "the same refusal seen late", true, true).ok());
  EXPECT_EQ(c->Snapshot().epoch, 1u);
}

TEST(CoordinatorElastic, ALostNodeFormsTheNextEpochOfTheSurvivors) {
  auto c = ElasticCoordinator(4, 2);
  std::vector<Membership> m = JoinDirect(*c, {"a", "b", "c", "d"});
  const std::vector<Membership> before = m;
  const std::vector<BucketInfo> w = {{"w", 1, 10}};
  ASSERT_TRUE(c->Report(m[0].session, 0, w).ok());  // dropped by the change
  std::thread poller([&] {
    // A poll waiting across the change ends with it.
    auto r = c->Poll(before[1].session, 1, 0, absl::Now() + absl::Seconds(30));
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  });
  const absl::Time start = absl::Now();
  BeatUntil(*c, {&m[0], &m[1], &m[3]}, start + absl::Seconds(10),
            [&] { return m[0].epoch == 1 && m[1].epoch == 1 && m[3].epoch == 1; });
  poller.join();
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  const Membership* survivors[] = {&m[0], &m[1], &m[3]};
  for (int i = 0; i < 3; ++i) {
    const Membership& s = *survivors[i];
    EXPECT_EQ(s.epoch, 1u);
    EXPECT_EQ(s.node_rank, i);
    EXPECT_EQ(s.node_count, 3);
    EXPECT_EQ(s.world_size, 3);
    EXPECT_EQ(s.node_names, (std::vector<std::string>{"a", "b", "d"}));
    EXPECT_NE(s.session, before[&s - &m[0]].session);
    // The epoch's link salts: fresh.
    EXPECT_TRUE(NoSaltShared(s, before[&s - &m[0]]));
  }
  ExpectLinkSaltsAgree({&m[0], &m[1], &m[3]});
  ExpectLinkSaltsAgree({&before[0], &before[1], &before[2], &before[3]});
  const JobSnapshot snap = c->Snapshot();
  EXPECT_EQ(snap.state, JobState::kRunning);
  EXPECT_EQ(snap.epoch, 1u);
  ASSERT_EQ(snap.changes.size(), 1u);
  EXPECT_TRUE(absl::StrContains(snap.changes[0].cause, "node 2 (c) silent"))
      << snap.changes[0].cause;
  // An old session elsewhere: refused, naming the epoch; the lost node's: unknown.
  const absl::Status stale = c->Report(before[3].session, 3, w);
  EXPECT_EQ(stale.code(), absl::StatusCode::kFailedPrecondition) << stale;
  EXPECT_TRUE(absl::StrContains(stale.message(), "epoch 1")) << stale;
  EXPECT_EQ(c->Heartbeat(before[2].session, 2).status().code(),
            absl::StatusCode::kPermissionDenied);
  // The new epoch schedules what its 3 nodes report, from its first batch.
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(c->Report(survivors[i]->session, i, w).ok());
  }
  auto batches = c->Poll(m[3].session, 2, m[3].first_batch, absl::Now() + absl::Seconds(1));
  ASSERT_TRUE(batches.ok()) << batches.status();
  ASSERT_EQ(batches->size(), 1u);
  EXPECT_EQ((*batches)[0].scheduled[0].name, "w");
}

// Fewer survivors than --min_nodes, or node 0 (the coordinator's own) lost:
// the job fails, saying why it could not go on.
TEST(CoordinatorElastic, BelowTheMinimumOrWithoutNodeZeroTheJobFails) {
  {
    auto c = ElasticCoordinator(4, 3);
    std::vector<Membership> m = JoinDirect(*c, {"a", "b", "c", "d"});
    BeatUntil(*c, {&m[0], &m[1]}, absl::Now() + absl::Seconds(10),
              [&] { return c->Snapshot().state != JobState::kRunning; });
    const JobSnapshot snap = c->Snapshot();
    EXPECT_EQ(snap.state, JobState::kFailed);
    EXPECT_TRUE(absl::StrContains(snap.failure, "fewer than the minimum of 3 (--min_nodes)"))
        << snap.failure;
    EXPECT_EQ(snap.epoch, 0u);
  }
  {
    auto c = ElasticCoordinator(3, 2);
    std::vector<Membership> m = JoinDirect(*c, {"a", "b", "c"});
    BeatUntil(*c, {&m[1], &m[2]}, absl::Now() + absl::Seconds(10),
              [&] { return c->Snapshot().state != JobState::kRunning; });
    const JobSnapshot snap = c->Snapshot();
    EXPECT_EQ(snap.state, JobState::kFailed);
    EXPECT_TRUE(absl::StrContains(snap.failure, "node 0 serves the coordinator")) << snap.failure;
  }
}

// A collective's failure reported by a node (how a lost peer looks to the
// others) waits for the watchdog in an elastic job: with a node then found
// lost, the next epoch forms and the job goes on; with none (issue Z: a
// connection reset between live nodes failed the elastic job), the next
// epoch forms of the same members once the peer timeout and the grace have
// passed (the data plane connected afresh), within the allowance; past it,
// the job fails naming the count.
TEST(CoordinatorElastic, ADataPlaneFailureWaitsForThePeerTimeout) {
  {
    auto c = ElasticCoordinator(3, 2);
    std::vector<Membership> m = JoinDirect(*c, {"a", "b", "c"});
    ASSERT_TRUE(c->ReportFailure(m[1].session, 1, "gloo: connection reset", true).ok());
    EXPECT_EQ(c->Snapshot().state, JobState::kRunning);
    BeatUntil(*c, {&m[0], &m[1]}, absl::Now() + absl::Seconds(10),
              [&] { return m[0].epoch == 1 && m[1].epoch == 1; });
    // Past the grace too: the held failure was dropped with the change.
    BeatUntil(*c, {&m[0], &m[1]},
              absl::Now() + absl::Milliseconds(500) + Coordinator::kDataPlaneGrace,
              [] { return false; });
    EXPECT_EQ(c->Snapshot().state, JobState::kRunning) << c->Snapshot().failure;
    EXPECT_EQ(c->Snapshot().epoch, 1u);
    EXPECT_EQ(c->Snapshot().changes.back().nodes, 2);
  }
  {
    const absl::Duration peer_timeout = absl::Milliseconds(500);
    auto c = ElasticCoordinator(3, 2, peer_timeout, 0, absl::ZeroDuration(),
                                /*max_refusal_epochs=*/2);
    std::vector<Membership> m = JoinDirect(*c, {"a", "b", "c"});
    for (uint64_t e = 1; e <= 2; ++e) {
      const absl::Time start = absl::Now();
      ASSERT_TRUE(c->ReportFailure(m[1].session, 1, "gloo: connection reset", true).ok());
      BeatUntil(*c, {&m[0], &m[1], &m[2]}, start + absl::Seconds(10),
                [&] { return m[0].epoch == e && m[1].epoch == e && m[2].epoch == e; });
      const JobSnapshot snap = c->Snapshot();
      ASSERT_EQ(snap.state, JobState::kRunning) << snap.failure;
      ASSERT_EQ(snap.epoch, e);
      EXPECT_GE(absl::Now() - start, peer_timeout + Coordinator::kDataPlaneGrace);
      EXPECT_EQ(snap.changes.back().nodes, 3);  // the same members, ranks kept
      EXPECT_EQ(m[1].node_rank, 1);
      EXPECT_TRUE(
          absl::StrContains(snap.changes.back().cause, "node 1 (b): gloo: connection reset"))
          << snap.changes.back().cause;
      EXPECT_TRUE(absl::StrContains(snap.changes.back().cause, "connected afresh"))
          << snap.changes.back().cause;
    }
    ASSERT_TRUE(c->ReportFailure(m[1].session, 1, "gloo: connection reset", true).ok());
    BeatUntil(*c, {&m[0], &m[1], &m[2]}, absl::Now() + absl::Seconds(10),
              [&] { return c->Snapshot().state != JobState::kRunning; });
    const JobSnapshot snap = c->Snapshot();
    EXPECT_EQ(snap.state, JobState::kFailed);
    EXPECT_TRUE(absl::StrContains(snap.failure, "node 1 (b): gloo: connection reset"))
        << snap.failure;
    EXPECT_TRUE(absl::StrContains(snap.failure, "broke between live nodes 3 times within"))
        << snap.failure;
    EXPECT_EQ(snap.epoch, 2u);
  }
  {
    // Not elastic: at once, as before.
    auto c = ElasticCoordinator(3, 0);
    std::vector<Membership> m = JoinDirect(*c, {"a", "b", "c"});
    ASSERT_TRUE(c->ReportFailure(m[1].session, 1, "gloo: connection reset", true).ok());
    EXPECT_EQ(c->Snapshot().state, JobState::kFailed);
  }
}

constexpr char kOptions[] = "--density=0.01\n--sparsifier=micro\n";

// A node that joins the running job (up to --max_nodes): it is the last
// rank of the next epoch, which begins after the batches logged so far; a
// marker batch ends the old epoch, and each node takes its new session when
// it polls it; what was reported and not scheduled is dropped; the next
// epoch schedules what its 3 nodes report.
TEST(CoordinatorElastic, ANodeJoinsTheRunningJobAfterAMarkerBatch) {
  auto c = ElasticCoordinator(2, 0, absl::Seconds(10), /*max_nodes=*/3);
  std::vector<Membership> m = JoinDirect(*c, {"a", "b"});
  const std::vector<BucketInfo> w = {{"w", 1, 10}};
  ASSERT_TRUE(c->Report(m[0].session, 0, w).ok());
  ASSERT_TRUE(c->Report(m[1].session, 1, w).ok());  // batch 0
  ASSERT_TRUE(c->Report(m[0].session, 0, w).ok());  // pending, dropped by the change
  auto joined = c->Join("job", "c", 2, "", -1, absl::Now() + absl::Seconds(1), "", kOptions);
  ASSERT_TRUE(joined.ok()) << joined.status();
  EXPECT_EQ(joined->epoch, 1u);
  EXPECT_TRUE(joined->graceful);
  EXPECT_EQ(joined->node_rank, 2);
  EXPECT_EQ(joined->node_count, 3);
  EXPECT_EQ(joined->world_size, 4);
  EXPECT_EQ(joined->first_batch, 2u);  // batch 1 marks the change
  EXPECT_EQ(joined->node_names, (std::vector<std::string>{"a", "b", "c"}));
  // Before it polls the marker, b still speaks with its old session (what
  // it reports now is of the old epoch: dropped).
  ASSERT_TRUE(c->Report(m[1].session, 1, w).ok());
  const std::vector<Membership> before = m;
  for (int r = 0; r < 2; ++r) {
    auto batches = c->Poll(m[r].session, r, 0, absl::Now() + absl::Seconds(1));
    ASSERT_TRUE(batches.ok()) << batches.status();
    ASSERT_EQ(batches->size(), 2u) << "node " << r;
    EXPECT_EQ((*batches)[0].scheduled.size(), 1u);
    const ScheduleBatch& marker = (*batches)[1];
    EXPECT_EQ(marker.index, 1u);
    EXPECT_EQ(marker.change_epoch, 1u);
    EXPECT_TRUE(marker.scheduled.empty());
    ASSERT_TRUE(marker.membership.has_value());
    EXPECT_EQ(marker.membership->node_rank, r);
    EXPECT_EQ(marker.membership->node_count, 3);
    EXPECT_EQ(marker.membership->epoch, 1u);
    EXPECT_EQ(marker.membership->first_batch, 2u);
    EXPECT_NE(marker.membership->session, m[r].session);
    EXPECT_TRUE(absl::StrContains(marker.change, "'c' joined as node 2")) << marker.change;
    // The answer lost: the old session asks again, and is answered the same.
    auto again = c->Poll(m[r].session, r, 1, absl::Now() + absl::Seconds(1));
    ASSERT_TRUE(again.ok()) << again.status();
    ASSERT_EQ(again->size(), 1u);
    ASSERT_TRUE((*again)[0].membership.has_value());
    EXPECT_EQ((*again)[0].membership->session, marker.membership->session);
    m[r] = *marker.membership;
  }
  // The old sessions are of the old epoch now.
  const absl::Status stale = c->Report(before[0].session, 0, w);
  EXPECT_EQ(stale.code(), absl::StatusCode::kFailedPrecondition) << stale;
  EXPECT_TRUE(absl::StrContains(stale.message(), "epoch 1")) << stale;
  // The new epoch: batch 2 is what all three report.
  m.push_back(*joined);
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(c->Report(m[r].session, r, w).ok());
  }
  auto none = c->Poll(m[2].session, 2, 2, absl::Now() + absl::Milliseconds(100));
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_TRUE(none->empty()) << "scheduled before the new node reported";
  ASSERT_TRUE(c->Report(m[2].session, 2, w).ok());
  for (int r = 0; r < 3; ++r) {
    auto batches = c->Poll(m[r].session, r, 2, absl::Now() + absl::Seconds(1));
    ASSERT_TRUE(batches.ok()) << batches.status();
    ASSERT_EQ(batches->size(), 1u) << "node " << r;
    EXPECT_EQ((*batches)[0].index, 2u);
    EXPECT_EQ((*batches)[0].scheduled[0].name, "w");
  }
  const JobSnapshot snap = c->Snapshot();
  EXPECT_EQ(snap.epoch, 1u);
  EXPECT_EQ(snap.max_nodes, 3);
  ASSERT_EQ(snap.changes.size(), 1u);
  EXPECT_EQ(snap.changes[0].nodes, 3);
  // The job is full now.
  auto full = c->Join("job", "d", 1, "", -1, absl::Now() + absl::Seconds(1), "", kOptions);
  EXPECT_EQ(full.status().code(), absl::StatusCode::kFailedPrecondition) << full.status();
  EXPECT_TRUE(absl::StrContains(full.status().message(), "the most it takes (3, --max_nodes)"))
      << full.status();
}

// What a running job refuses: a node whose options differ from the job's
// (each named), a name a member has, any node when the job is not elastic
// upward; a second node waits for the first one's change to be taken by
// every member, up to its deadline.
TEST(CoordinatorElastic, WhatAJoiningNodeIsRefused) {
  {
    auto c = ElasticCoordinator(2, 0, absl::Seconds(10), /*max_nodes=*/4);
    std::vector<absl::StatusOr<Membership>> m(2, absl::UnknownError(""));
    std::thread t0([&] {
      m[0] = c->Join("job", "a", 1, "", 0, absl::Now() + absl::Seconds(10), "", kOptions);
    });
    std::thread t1([&] {
      m[1] = c->Join("job", "b", 1, "", 1, absl::Now() + absl::Seconds(10), "", kOptions);
    });
    t0.join();
    t1.join();
    ASSERT_TRUE(m[0].ok() && m[1].ok());
    auto differs = c->Join("job", "c", 1, "", -1, absl::Now() + absl::Seconds(1), "",
                           "--density=0.001\n--sparsifier=micro\n--clip_norm=1\n");
    ASSERT_EQ(differs.status().code(), absl::StatusCode::kInvalidArgument) << differs.status();
    EXPECT_TRUE(
        absl::StrContains(differs.status().message(), "--density is 0.001 there, 0.01 in the job"))
        << differs.status();
    EXPECT_TRUE(
        absl::StrContains(differs.status().message(), "--clip_norm is 1 there, not set in the job"))
        << differs.status();
    auto clash = c->Join("job", "b", 1, "", -1, absl::Now() + absl::Seconds(1), "", kOptions);
    EXPECT_EQ(clash.status().code(), absl::StatusCode::kAlreadyExists) << clash.status();
    EXPECT_EQ(c->Snapshot().epoch, 0u) << "nothing refused changed the job";
    // One change at a time: d waits until a and b took c's.
    ASSERT_TRUE(c->Join("job", "c", 1, "", -1, absl::Now() + absl::Seconds(1), "", kOptions).ok());
    auto early =
        c->Join("job", "d", 1, "", -1, absl::Now() + absl::Milliseconds(200), "", kOptions);
    EXPECT_EQ(early.status().code(), absl::StatusCode::kDeadlineExceeded) << early.status();
    absl::StatusOr<Membership> d = absl::UnknownError("");
    std::thread joiner(
        [&] { d = c->Join("job", "d", 1, "", -1, absl::Now() + absl::Seconds(10), "", kOptions); });
    for (int r = 0; r < 2; ++r) {
      ASSERT_TRUE(c->Poll(m[r]->session, r, 0, absl::Now() + absl::Seconds(1)).ok());
    }
    joiner.join();
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_EQ(d->epoch, 2u);
    EXPECT_EQ(d->node_rank, 3);
  }
  {
    auto c = ElasticCoordinator(2, 0, absl::Seconds(10));  // not elastic
    JoinDirect(*c, {"a", "b"});
    auto late = c->Join("job", "c", 1, "", -1, absl::Now() + absl::Seconds(1));
    EXPECT_EQ(late.status().code(), absl::StatusCode::kFailedPrecondition) << late.status();
    EXPECT_TRUE(absl::StrContains(late.status().message(), "already has its 2 nodes"))
        << late.status();
  }
}

// A node that joined and reports a bucket the job has with another shape
// is refused, naming both, and dropped: the others go on in the next epoch.
TEST(CoordinatorElastic, AJoinedNodeWithAnotherBucketLayoutIsDropped) {
  auto c = ElasticCoordinator(2, 0, absl::Seconds(10), /*max_nodes=*/3);
  std::vector<Membership> m = JoinDirect(*c, {"a", "b"});
  const std::vector<BucketInfo> w = {{"w", 1, 10}};
  ASSERT_TRUE(c->Report(m[0].session, 0, w).ok());
  ASSERT_TRUE(c->Report(m[1].session, 1, w).ok());
  auto joined = c->Join("job", "c", 1, "", -1, absl::Now() + absl::Seconds(1));
  ASSERT_TRUE(joined.ok()) << joined.status();
  const absl::Status refused = c->Report(joined->session, 2, {{"w", 1, 11}});
  ASSERT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_TRUE(absl::StrContains(refused.message(),
                                "node 2 ('c'), which joined at epoch 1, has "
                                "bucket 'w' as float32 x 11"))
      << refused;
  EXPECT_TRUE(absl::StrContains(refused.message(), "the job has it as float32 x 10")) << refused;
  const JobSnapshot snap = c->Snapshot();
  EXPECT_EQ(snap.state, JobState::kRunning);
  EXPECT_EQ(snap.epoch, 2u);
  EXPECT_EQ(snap.nodes.size(), 2u);
  EXPECT_EQ(c->Heartbeat(joined->session, 2).status().code(), absl::StatusCode::kPermissionDenied);
  // a and b: told by their heartbeats, a change that cut the job (not graceful).
  auto beat = c->Heartbeat(m[0].session, 0);
  ASSERT_TRUE(beat.ok()) << beat.status();
  ASSERT_TRUE(beat->membership.has_value());
  EXPECT_EQ(beat->membership->epoch, 2u);
  EXPECT_EQ(beat->membership->node_count, 2);
  EXPECT_FALSE(beat->membership->graceful);
}

// Fewer nodes left than --min_nodes, with an elastic timeout: the epoch of
// the survivors forms, nothing is scheduled (what every node waits for is
// nodes, it says), and a node that joins within the timeout brings the job
// back to its minimum and the schedule goes on; without one, the job fails
// once the timeout has passed, naming what it waited for and why.
TEST(CoordinatorElastic, BelowTheMinimumTheJobWaitsForNodesToJoin) {
  const std::vector<BucketInfo> w = {{"w", 1, 10}};
  for (const bool join : {true, false}) {
    SCOPED_TRACE(join ? "a node joins" : "none joins");
    auto c = ElasticCoordinator(3, 2, absl::Milliseconds(500), 0, absl::Seconds(2));
    std::vector<Membership> m = JoinDirect(*c, {"a", "b", "c"});
    const absl::Time start = absl::Now();
    BeatUntil(*c, {&m[0]}, start + absl::Seconds(10), [&] { return m[0].epoch == 1; });
    ASSERT_EQ(m[0].epoch, 1u);
    EXPECT_EQ(m[0].node_count, 1);
    ASSERT_TRUE(c->Report(m[0].session, 0, w).ok());
    auto none = c->Poll(m[0].session, 0, m[0].first_batch, absl::Now() + absl::Milliseconds(200));
    ASSERT_TRUE(none.ok()) << none.status();
    EXPECT_TRUE(none->empty()) << "scheduled below the minimum";
    auto beat = c->Heartbeat(m[0].session, 0);
    ASSERT_TRUE(beat.ok()) << beat.status();
    EXPECT_EQ(beat->state, JobState::kRunning);
    ASSERT_EQ(beat->stalls.size(), 1u);
    EXPECT_TRUE(absl::StrContains(beat->stalls[0],
                                  "fewer than its minimum of 2 (--min_nodes): "
                                  "nothing runs until nodes join"))
        << beat->stalls[0];
    if (join) {
      auto d = c->Join("job", "d", 1, "", -1, absl::Now() + absl::Seconds(1));
      ASSERT_TRUE(d.ok()) << d.status();
      EXPECT_EQ(d->epoch, 2u);
      EXPECT_EQ(d->node_rank, 1);
      auto marker = c->Poll(m[0].session, 0, m[0].first_batch, absl::Now() + absl::Seconds(1));
      ASSERT_TRUE(marker.ok()) << marker.status();
      ASSERT_EQ(marker->size(), 1u);
      ASSERT_TRUE((*marker)[0].membership.has_value());
      m[0] = *(*marker)[0].membership;
      ASSERT_TRUE(c->Report(m[0].session, 0, w).ok());
      ASSERT_TRUE(c->Report(d->session, 1, w).ok());
      auto batches = c->Poll(d->session, 1, d->first_batch, absl::Now() + absl::Seconds(1));
      ASSERT_TRUE(batches.ok()) << batches.status();
      ASSERT_EQ(batches->size(), 1u);
      EXPECT_EQ((*batches)[0].scheduled[0].name, "w");
      // Past the timeout, the job runs on.
      Membership& joined = *d;
      BeatUntil(*c, {&m[0], &joined}, start + absl::Seconds(3), [] { return false; });
      EXPECT_EQ(c->Snapshot().state, JobState::kRunning) << c->Snapshot().failure;
      EXPECT_TRUE(c->Heartbeat(m[0].session, 0)->stalls.empty());
    } else {
      BeatUntil(*c, {&m[0]}, start + absl::Seconds(10),
                [&] { return c->Snapshot().state != JobState::kRunning; });
      const JobSnapshot snap = c->Snapshot();
      EXPECT_EQ(snap.state, JobState::kFailed);
      EXPECT_TRUE(absl::StrContains(snap.failure,
                                    "the job waited 2s (--elastic_timeout_s) for nodes to join "
                                    "and has 1 node(s), fewer than its minimum of 2"))
          << snap.failure;
      EXPECT_TRUE(absl::StrContains(snap.failure, "node 1 (b) silent")) << snap.failure;
      EXPECT_GE(absl::Now() - start, absl::Seconds(2));
      EXPECT_LT(absl::Now() - start, absl::Seconds(4));
    }
  }
}

TEST(CoordinatorElastic, AMinimumAboveTheNodeCountIsRefused) {
  CoordinatorOptions o;
  o.job_id = "job";
  o.expected_nodes = 3;
  o.min_nodes = 4;
  const auto c = Coordinator::Create(o);
  ASSERT_FALSE(c.ok());
  EXPECT_TRUE(absl::StrContains(c.status().message(), "minimum node count")) << c.status();
}

}  // namespace
}  // namespace microd::control

namespace microd::control {
namespace {

// Issue X, finding 6: rendezvous keys were checked by their last component
// alone, so a member could write "gloo/e<later epoch>/<its rank>" for an
// epoch where that rank is another node's (ranks are renumbered after a
// loss) and sit between two others once it connects; and a node could
// write without limit into node 0's memory. Now the current epoch's
// namespace alone, and a bounded amount a node.
TEST(CoordinatorRendezvous, OnlyTheCurrentEpochsKeysAndABoundedAmountANode) {
  auto c = ElasticCoordinator(3, 2);
  std::vector<Membership> m = JoinDirect(*c, {"a", "b", "c"});
  auto set = [&](int node, const std::string& key, size_t bytes = 8) {
    return c->KeySet(m[node].session, key, std::string(bytes, 'v'));
  };
  EXPECT_TRUE(set(2, "gloo/e0/2").ok());
  EXPECT_TRUE(set(2, "gloo/e0/lane1/rank_2").ok());
  for (const char* later : {"gloo/e1/2", "gloo/e1/lane1/rank_2", "gloo/2", "gloo/e01/2"}) {
    const absl::Status s = set(2, later);
    EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << later << ": " << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "epoch 0")) << s;
  }
  // 10,000 keys of 1 MiB each: refused once past the cap (16 MiB a node).
  int taken = 0;
  absl::Status refused;
  for (int i = 0; i < 10000 && refused.ok(); ++i) {
    refused = set(1, absl::StrCat("gloo/e0/big", i, "/1"), size_t{1} << 20);
    if (refused.ok()) ++taken;
  }
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_TRUE(absl::StrContains(refused.message(), "node 1 wrote")) << refused;
  EXPECT_LE(taken, 16);
  EXPECT_TRUE(set(0, "gloo/e0/0").ok()) << "another node's writes are its own";
  // The next epoch: its namespace, a fresh allowance, the old keys gone.
  ASSERT_TRUE(c->ReportFailure(m[0].session, 0, "the sealed transfer ... failed", true, true).ok());
  BeatUntil(*c, {&m[0], &m[1], &m[2]}, absl::Now() + absl::Seconds(10),
            [&] { return m[0].epoch == 1 && m[1].epoch == 1 && m[2].epoch == 1; });
  EXPECT_EQ(set(2, "gloo/e0/2").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(set(1, "gloo/e1/1", size_t{1} << 20).ok());
  EXPECT_EQ(c->Snapshot().rendezvous_keys, 1u);
}

// Issue X, finding 4: every epoch left its credentials, change records and
// rendezvous keys behind, and epochs can be driven without limit. 50
// epochs later the coordinator holds a bounded few of each.
TEST(CoordinatorEpochs, FiftyEpochsLeaveABoundedState) {
  CoordinatorOptions o;
  o.job_id = "job";
  o.expected_nodes = 3;
  o.min_nodes = 2;
  o.peer_timeout = absl::Seconds(5);
  o.max_refusal_epochs = 1000;
  auto c = *Coordinator::Create(o);
  std::vector<Membership> m = JoinDirect(*c, {"a", "b", "c"});
  for (uint64_t e = 1; e <= 50; ++e) {
    for (int r = 0; r < 3; ++r) {
      ASSERT_TRUE(c->KeySet(m[r].session, absl::StrCat("gloo/e", e - 1, "/", r), "addr").ok());
      ASSERT_TRUE(c->KeySet(m[r].session, absl::StrCat("gloo/e", e - 1, "/rank_", r), "h").ok());
    }
    ASSERT_TRUE(c->ReportFailure(m[1].session, 1, "refused", true, true).ok());
    BeatUntil(*c, {&m[0], &m[1], &m[2]}, absl::Now() + absl::Seconds(10),
              [&] { return m[0].epoch == e && m[1].epoch == e && m[2].epoch == e; });
    ASSERT_EQ(m[0].epoch, e);
  }
  const JobSnapshot s = c->Snapshot();
  EXPECT_EQ(s.state, JobState::kRunning) << s.failure;
  EXPECT_EQ(s.epoch, 50u);
  EXPECT_EQ(s.rendezvous_keys, 0u) << "the earlier epochs' keys";
  EXPECT_LE(s.old_credentials, 3 * kKeptCredentials);
  EXPECT_EQ(s.changes.size(), 50u);  // under kKeptChanges: all kept
  EXPECT_EQ(s.changes.back().epoch, 50u);
}

// --seal_failure=step: refusals that keep coming (someone alters a byte
// every step) formed epoch after epoch without end. Past the allowance the
// job fails, naming the link and the count.
TEST(CoordinatorEpochs, RefusalsPastTheAllowanceFailTheJob) {
  CoordinatorOptions o;
  o.job_id = "job";
  o.expected_nodes = 3;
  o.min_nodes = 2;
  o.peer_timeout = absl::Seconds(5);
  o.max_refusal_epochs = 3;
  auto c = *Coordinator::Create(o);
  std::vector<Membership> m = JoinDirect(*c, {"a", "b", "c"});
  for (uint64_t e = 1; e <= 3; ++e) {
    ASSERT_TRUE(c->ReportFailure(m[2].session, 2,
                                 "the sealed transfer from node 0 to node 2 failed verification",
                                 true, true)
                    .ok());
    BeatUntil(*c, {&m[0], &m[1], &m[2]}, absl::Now() + absl::Seconds(10),
              [&] { return m[2].epoch == e; });
    ASSERT_EQ(c->Snapshot().state, JobState::kRunning);
  }
  ASSERT_TRUE(c->ReportFailure(m[2].session, 2,
                               "the sealed transfer from node 0 to node 2 failed verification",
                               true, true)
                  .ok());
  const JobSnapshot s = c->Snapshot();
  EXPECT_EQ(s.state, JobState::kFailed);
  EXPECT_EQ(s.epoch, 3u);
  EXPECT_TRUE(absl::StrContains(s.failure, "from node 0 to node 2")) << s.failure;
  EXPECT_TRUE(absl::StrContains(s.failure, "refused 4 times within 10m")) << s.failure;
}

// Issue X, finding 8: a poll that waited across a change of membership
// took the caller's rank of before the wait; after a shrink (fewer nodes)
// that rank indexed past the nodes (ASan: heap-buffer-overflow). Now the
// caller is found again, and a session of an older epoch is told so.
TEST(CoordinatorEpochs, APollWaitingAcrossAShrinkIsToldTheMembershipChanged) {
  auto c = ElasticCoordinator(4, 2, absl::Milliseconds(400));
  std::vector<Membership> m = JoinDirect(*c, {"a", "b", "c", "d"});
  absl::StatusOr<std::vector<ScheduleBatch>> polled;
  std::thread poller(
      [&] { polled = c->Poll(m[3].session, 3, 0, absl::Now() + absl::Seconds(20)); });
  // Nodes 1 and 2 go silent: epoch 1 of nodes 0 and 3 (now 0 and 1).
  BeatUntil(*c, {&m[0], &m[3]}, absl::Now() + absl::Seconds(10),
            [&] { return m[0].epoch == 1 && m[3].epoch == 1; });
  poller.join();
  ASSERT_FALSE(polled.ok());
  EXPECT_EQ(polled.status().code(), absl::StatusCode::kFailedPrecondition) << polled.status();
  EXPECT_EQ(m[3].node_rank, 1);
  EXPECT_EQ(m[3].node_count, 2);
  EXPECT_TRUE(c->Poll(m[3].session, 1, m[3].first_batch, absl::Now()).ok());
}

// Issue X, finding 8: a node that joined a running job with no options
// skipped their check.
TEST(CoordinatorElastic, AJoinerWithoutOptionsIsRefused) {
  CoordinatorOptions o;
  o.job_id = "job";
  o.expected_nodes = 2;
  o.max_nodes = 3;
  o.peer_timeout = absl::Seconds(5);
  auto c = *Coordinator::Create(o);
  const std::string kOptions = "--density=0.01\n--seal=on\n";
  std::vector<absl::StatusOr<Membership>> m(2, absl::UnknownError(""));
  std::thread a(
      [&] { m[0] = c->Join("job", "a", 1, "", 0, absl::Now() + absl::Seconds(10), "", kOptions); });
  m[1] = c->Join("job", "b", 1, "", 1, absl::Now() + absl::Seconds(10), "", kOptions);
  a.join();
  ASSERT_TRUE(m[0].ok() && m[1].ok());
  auto bare = c->Join("job", "c", 1, "", -1, absl::Now() + absl::Seconds(2), "", "");
  ASSERT_FALSE(bare.ok());
  EXPECT_EQ(bare.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(bare.status().message(), "it sent no options")) << bare.status();
  EXPECT_TRUE(c->Join("job", "c", 1, "", -1, absl::Now() + absl::Seconds(2), "", kOptions).ok());
}

}  // namespace
}  // namespace microd::control
