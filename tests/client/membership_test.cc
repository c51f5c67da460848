// SPDX-License-Identifier: Apache-2.0
// An elastic job's change of membership as a training process sees it: the
// daemon's LocalServer tells the process its new place (MEMBERSHIP), then
// completes its pending submission with MICROD_ERR_MEMBERSHIP; the C
// library's job info and epoch follow. A process whose library predates
// elastic jobs (no MICROD_WIRE_CAP_MEMBERSHIP in its hello) gets
// MICROD_ERR_JOB_FAILED instead, and no message it could not read.
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <optional>
#include <string>
#include <thread>

#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "daemon/common/status_map.h"
#include "daemon/local/local_server.h"
#include "gtest/gtest.h"
#include "microd/microd.h"
#include "microd/wire.h"
#include "tests/integration/process_util.h"

namespace microd {
namespace {

// Takes every submission and remembers the last one's client and ticket.
class Handler final : public local::LocalHandler {
 public:
  absl::StatusOr<local::ProcessInfo> OnHello(uint64_t, int, pid_t) override {
    local::ProcessInfo info;
    info.local_rank = 0;
    info.local_size = 1;
    info.node_rank = 2;
    info.node_count = 4;
    info.rank = 2;
    info.world_size = 4;
    return info;
  }
  absl::Status OnRegister(uint64_t, uint32_t, const std::string&, bool,
                          std::shared_ptr<local::ProcessBuffer>) override {
    return absl::OkStatus();
  }
  absl::Status OnSubmit(uint64_t client, uint32_t buffer_id, uint64_t ticket,
                        std::optional<uint32_t> changes_seen) override {
    absl::MutexLock lock(&mu);
    last = {client, buffer_id, ticket, changes_seen};
    ++submits;
    return absl::OkStatus();
  }
  void OnDisconnect(uint64_t, bool, const std::string&) override {}

  struct Submission {
    uint64_t client = 0;
    uint32_t buffer_id = 0;
    uint64_t ticket = 0;
    std::optional<uint32_t> changes_seen;  // what the library said it had read
  };
  absl::Mutex mu;
  Submission last;
  int submits = 0;

  Submission WaitForSubmit(int n) {
    absl::MutexLock lock(&mu);
    auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return submits >= n; };
    mu.AwaitWithTimeout(absl::Condition(&done), absl::Seconds(10));
    return last;
  }
};

class MembershipTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = microd::testing::MakeTempDir("membership");
    local::LocalServerOptions o;
    o.socket_path = dir_ + "/microd.sock";
    auto s = local::LocalServer::Start(o, &handler_);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(s).value();
  }
  void TearDown() override { server_->Stop(); }

  local::ProcessInfo Survivor() const {
    local::ProcessInfo info;
    info.local_rank = 0;
    info.local_size = 1;
    info.node_rank = 1;
    info.node_count = 3;
    info.rank = 1;
    info.world_size = 3;
    return info;
  }

  std::string dir_;
  Handler handler_;
  std::unique_ptr<local::LocalServer> server_;
};

TEST_F(MembershipTest, TheLibraryFollowsTheNewMembership) {
  microd_options o;
  microd_options_init(&o);
  const std::string path = dir_ + "/microd.sock";
  o.socket_path = path.c_str();
  o.timeout_ms = 5000;
  microd_client* c = nullptr;
  ASSERT_EQ(microd_connect(&o, &c), MICROD_OK) << microd_last_error(nullptr);
  microd_job_info info;
  uint64_t epoch = 99;
  ASSERT_EQ(microd_job_info_get(c, &info), MICROD_OK);
  ASSERT_EQ(microd_job_epoch(c, &epoch), MICROD_OK);
  EXPECT_EQ(info.rank, 2);
  EXPECT_EQ(info.world_size, 4);
  EXPECT_EQ(epoch, 0u);
  float* data = nullptr;
  int32_t id = -1;
  ASSERT_EQ(microd_register_host_buffer(c, "grads.0", 16, &data, &id), MICROD_OK)
      << microd_last_error(c);
  uint64_t ticket = 0;
  ASSERT_EQ(microd_allreduce_async(c, id, &ticket), MICROD_OK) << microd_last_error(c);
  const Handler::Submission s = handler_.WaitForSubmit(1);
  ASSERT_EQ(s.ticket, ticket);
  EXPECT_EQ(s.changes_seen, std::optional<uint32_t>(0)) << "the fence: no change read yet";
  server_->NotifyMembership(s.client, 1, Survivor(), "node 2 (c) lost");
  server_->Complete(s.client, s.ticket, s.buffer_id,
                    WithClientStatus(absl::AbortedError("bucket 'grads.0': step 7 not applied"),
                                     ClientStatus::kMembership));
  EXPECT_EQ(microd_wait(c, ticket, 5000), MICROD_ERR_MEMBERSHIP);
  EXPECT_TRUE(absl::StrContains(microd_last_error(c), "step 7 not applied"))
      << microd_last_error(c);
  ASSERT_EQ(microd_job_info_get(c, &info), MICROD_OK);
  ASSERT_EQ(microd_job_epoch(c, &epoch), MICROD_OK);
  EXPECT_EQ(epoch, 1u);
  EXPECT_EQ(info.rank, 1);
  EXPECT_EQ(info.world_size, 3);
  EXPECT_EQ(info.node_rank, 1);
  EXPECT_EQ(info.node_count, 3);
  // The connection goes on: the step is submitted again, saying it read
  // the change.
  ASSERT_EQ(microd_allreduce_async(c, id, &ticket), MICROD_OK) << microd_last_error(c);
  const Handler::Submission again = handler_.WaitForSubmit(2);
  EXPECT_EQ(again.changes_seen, std::optional<uint32_t>(1));
  // The same epoch told twice (a process that connected while the change
  // was being told hears it at its hello and again): not an error.
  server_->NotifyMembership(again.client, 1, Survivor(), "node 2 (c) lost");
  server_->Complete(again.client, again.ticket, again.buffer_id, absl::OkStatus());
  EXPECT_EQ(microd_wait(c, ticket, 5000), MICROD_OK) << microd_last_error(c);
  ASSERT_EQ(microd_allreduce_async(c, id, &ticket), MICROD_OK) << microd_last_error(c);
  const Handler::Submission third = handler_.WaitForSubmit(3);
  server_->Complete(third.client, third.ticket, third.buffer_id, absl::OkStatus());
  EXPECT_EQ(microd_wait(c, ticket, 5000), MICROD_OK) << microd_last_error(c);
  ASSERT_EQ(microd_job_epoch(c, &epoch), MICROD_OK);
  EXPECT_EQ(epoch, 1u);
  EXPECT_EQ(microd_close(c), MICROD_OK);
}

// A library without the capability: no MEMBERSHIP message, and the status
// it could not act on arrives as MICROD_ERR_JOB_FAILED, saying why.
TEST_F(MembershipTest, AnOlderLibraryGetsJobFailed) {
  const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  ASSERT_GE(fd, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const std::string path = dir_ + "/microd.sock";
  std::snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path.c_str());
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  microd_wire_hello hello{};
  microd_wire_header_init(&hello.h, MICROD_MSG_HELLO, sizeof hello);  // reserved 0
  hello.local_rank = -1;
  hello.pid = static_cast<uint32_t>(getpid());
  ASSERT_EQ(microd_wire_send(fd, &hello, sizeof hello, -1), 0);
  microd_wire_hello_ack ack{};
  ASSERT_EQ(recv(fd, &ack, sizeof ack, 0), static_cast<ssize_t>(sizeof ack));
  ASSERT_EQ(ack.status, 0);
  // Its client id: the one connection the server has.
  const std::vector<local::ClientSnapshot> clients = server_->Clients();
  ASSERT_EQ(clients.size(), 1u);
  server_->NotifyMembership(clients[0].id, 1, Survivor(), "node 2 (c) lost");
  server_->Complete(clients[0].id, 5, 0,
                    WithClientStatus(absl::AbortedError("bucket 'grads.0': step 7 not applied"),
                                     ClientStatus::kMembership));
  microd_wire_completion done{};
  ASSERT_EQ(recv(fd, &done, sizeof done, 0), static_cast<ssize_t>(sizeof done))
      << "the first message after the hello answer is the completion";
  EXPECT_EQ(done.h.type, MICROD_MSG_COMPLETION);
  EXPECT_EQ(done.ticket, 5u);
  EXPECT_EQ(done.status, MICROD_ERR_JOB_FAILED);
  EXPECT_TRUE(absl::StrContains(done.message, "cannot follow a change")) << done.message;
  EXPECT_TRUE(absl::StrContains(done.message, "step 7 not applied")) << done.message;
  close(fd);
}

}  // namespace
}  // namespace microd
