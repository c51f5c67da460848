// SPDX-License-Identifier: Apache-2.0
// The transport contract suite against the NCCL transport, twice: with host
// buffers (staged by the transport) and with device buffers. NCCL refuses two
// ranks of one communicator on one GPU in one process, so every rank is a
// worker process (nccl_rank_worker.cc) with its own NCCL_HOSTID, which makes
// NCCL treat the ranks as hosts talking over loopback sockets; the suite
// talks to proxies that forward each call. Several ranks share one GPU by
// time-slicing: fine for correctness, meaningless for timing. Without a GPU
// every test is skipped with CUDA's reason (nothing touches CUDA before a
// test runs, so listing the tests works anywhere).
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cuda/device_info.h"
#include "tests/helper_path.h"
#include "tests/transport/nccl_rank_protocol.h"
#include "tests/transport/nccl_test_env.h"
#include "tests/transport/transport_contract.h"

#ifndef MICROD_NCCL_RANK_WORKER
#error "MICROD_NCCL_RANK_WORKER (path of microd-test-nccl-rank) must be defined"
#endif

namespace microd::transport::testing {
namespace {

// Empty when a GPU is usable; otherwise why not (CUDA's message).
std::string NoGpuReason() {
  std::vector<kernels::cuda::DeviceInfo> devices;
  std::string reason;
  if (!kernels::cuda::ListDevices(&devices, &reason)) return "no GPU: " + reason;
  return "";
}

// Waits for `fd` to be readable until `deadline`.
bool WaitReadable(int fd, absl::Time deadline) {
  for (;;) {
    const int64_t ms =
        deadline == absl::InfiniteFuture()
            ? -1
            : std::max<int64_t>(0, absl::ToInt64Milliseconds(deadline - absl::Now()));
    pollfd p{fd, POLLIN, 0};
    const int r = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(ms, 1 << 30)));
    if (r > 0) return true;
    if (r == 0) return false;
    if (errno != EINTR) return false;
  }
}

// One rank: a worker process and the two sockets to it.
class ProcessTransport final : public Transport {
 public:
  ProcessTransport(int rank, int size, pid_t pid, int call_fd, int abort_fd)
      : rank_(rank), size_(size), pid_(pid), call_fd_(call_fd), abort_fd_(abort_fd) {}

  ~ProcessTransport() override {
    WorkerRequest req;
    req.op = static_cast<uint32_t>(WorkerOp::kExit);
    WriteAll(call_fd_, &req, sizeof req);
    ::close(call_fd_);
    ::close(abort_fd_);
    Reap(pid_, absl::Seconds(20));
  }

  // Waits for the worker's exit; kills it after `grace`.
  static void Reap(pid_t pid, absl::Duration grace) {
    const absl::Time end = absl::Now() + grace;
    int status = 0;
    while (::waitpid(pid, &status, WNOHANG) == 0) {
      if (absl::Now() > end) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, &status, 0);
        return;
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
  }

  // Reads the worker's start-up report.
  absl::Status WaitReady(absl::Time deadline) {
    std::vector<char> none;
    return ReadResponse(deadline, &none);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* name() const override { return "nccl"; }
  // The worker's count, as of its last answer.
  uint64_t host_waits() const override { return host_waits_; }

  absl::Status Allgather(const void* in, size_t bytes, void* out,
                         const CollectiveOptions& o) override {
    WorkerRequest req = Request(WorkerOp::kAllgather, o, in, out);
    req.a = bytes;
    std::vector<char> result;
    absl::Status s = Call(req, {}, in, in ? bytes : 0, o.deadline, &result);
    if (s.ok() && !result.empty()) std::memcpy(out, result.data(), result.size());
    return s;
  }

  absl::Status AllgatherV(const void* in, absl::Span<const size_t> recv_bytes, void* out,
                          const CollectiveOptions& o) override {
    WorkerRequest req = Request(WorkerOp::kAllgatherV, o, in, out);
    const size_t mine = rank_ < static_cast<int>(recv_bytes.size()) ? recv_bytes[rank_] : 0;
    std::vector<char> result;
    absl::Status s = Call(req, std::vector<size_t>(recv_bytes.begin(), recv_bytes.end()), in,
                          in ? mine : 0, o.deadline, &result);
    if (s.ok() && !result.empty()) std::memcpy(out, result.data(), result.size());
    return s;
  }

  absl::Status AllreduceSum(void* data, size_t count, DataType type,
                            const CollectiveOptions& o) override {
    WorkerRequest req = Request(WorkerOp::kAllreduce, o, data, data);
    req.a = count;
    req.type = static_cast<uint32_t>(type);
    std::vector<char> result;
    absl::Status s =
        Call(req, {}, data, data ? count * kernels::ElementBytes(type) : 0, o.deadline, &result);
    if (s.ok() && !result.empty()) std::memcpy(data, result.data(), result.size());
    return s;
  }

  absl::Status Barrier(const CollectiveOptions& o) override {
    WorkerRequest req = Request(WorkerOp::kBarrier, o, this, this);
    std::vector<char> result;
    return Call(req, {}, nullptr, 0, o.deadline, &result);
  }

  void Abort(const absl::Status& reason) override {
    const std::string msg(reason.message());
    const uint32_t len = static_cast<uint32_t>(msg.size());
    WriteAll(abort_fd_, &len, sizeof len);
    WriteAll(abort_fd_, msg.data(), msg.size());
  }

 private:
  static WorkerRequest Request(WorkerOp op, const CollectiveOptions& o, const void* in,
                               const void* out) {
    WorkerRequest req;
    req.op = static_cast<uint32_t>(op);
    req.tag = o.tag;
    req.deadline_unix_ns = ToWireDeadline(o.deadline);
    req.flags = (in == nullptr ? kNullIn : 0) | (out == nullptr ? kNullOut : 0) |
                (o.shape_agreed ? kShapeAgreed : 0);
    return req;
  }

  absl::Status Call(WorkerRequest req, const std::vector<size_t>& sizes, const void* in,
                    size_t in_bytes, absl::Time deadline, std::vector<char>* result) {
    req.num_sizes = sizes.size();
    req.payload_bytes = in_bytes;
    if (!WriteAll(call_fd_, &req, sizeof req) ||
        !WriteAll(call_fd_, sizes.data(), sizes.size() * sizeof(size_t)) ||
        (in_bytes > 0 && !WriteAll(call_fd_, in, in_bytes))) {
      return absl::UnavailableError(absl::StrCat("rank ", rank_, ": worker gone"));
    }
    // The worker honours the deadline itself; the margin covers an abort.
    return ReadResponse(
        deadline == absl::InfiniteFuture() ? deadline : deadline + absl::Seconds(30), result);
  }

  absl::Status ReadResponse(absl::Time deadline, std::vector<char>* payload) {
    if (!WaitReadable(call_fd_, deadline)) {
      return absl::DeadlineExceededError(absl::StrCat("rank ", rank_, ": worker did not answer"));
    }
    WorkerResponse r;
    if (!ReadAll(call_fd_, &r, sizeof r) || r.message_bytes > (1u << 20)) {
      return absl::UnavailableError(absl::StrCat("rank ", rank_, ": worker gone"));
    }
    std::string msg(r.message_bytes, '\0');
    payload->resize(r.payload_bytes);
    if (!ReadAll(call_fd_, msg.data(), msg.size()) ||
        !ReadAll(call_fd_, payload->data(), payload->size())) {
      return absl::UnavailableError(absl::StrCat("rank ", rank_, ": worker gone"));
    }
    host_waits_ = r.host_waits;
    return absl::Status(static_cast<absl::StatusCode>(r.code), msg);
  }

  const int rank_;
  const int size_;
  const pid_t pid_;
  const int call_fd_;
  const int abort_fd_;
  uint64_t host_waits_ = 0;
};

std::vector<std::unique_ptr<Transport>> CreateGroup(int size, bool device_buffers) {
  static std::atomic<int> group_id{0};
  const int id = group_id++;
  const std::string prefix = absl::StrCat("group", id);
  char dir_template[] = "/tmp/microd-nccl-test-XXXXXX";
  const char* dir = ::mkdtemp(dir_template);
  if (dir == nullptr) {
    ADD_FAILURE() << "mkdtemp failed";
    return {};
  }
  std::vector<std::unique_ptr<ProcessTransport>> procs;
  const std::string worker = microd::testing::HelperPath(MICROD_NCCL_RANK_WORKER);
  for (int r = 0; r < size; ++r) {
    int call[2], abort_pair[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM, 0, call) != 0 ||
        ::socketpair(AF_UNIX, SOCK_STREAM, 0, abort_pair) != 0) {
      ADD_FAILURE() << "socketpair failed";
      return {};
    }
    // Everything the child needs is built before fork: between fork and exec
    // it only calls async-signal-safe functions (CUDA's threads may hold locks).
    const std::string rank_s = std::to_string(r), size_s = std::to_string(size);
    const char* argv[] = {worker.c_str(),
                          rank_s.c_str(),
                          size_s.c_str(),
                          prefix.c_str(),
                          dir,
                          device_buffers ? "1" : "0",
                          nullptr};
    std::vector<std::string> env = microd::testing::NcclRankEnvironment(
        absl::StrCat("microd-nccl-test-", ::getpid(), "-", id, "-", r));
    std::vector<const char*> envp;
    for (const std::string& e : env) envp.push_back(e.c_str());
    envp.push_back(nullptr);
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::dup2(call[1], kWorkerCallFd);
      ::dup2(abort_pair[1], kWorkerAbortFd);
      for (int fd = kWorkerAbortFd + 1; fd < 1024; ++fd) ::close(fd);
      ::execve(worker.c_str(), const_cast<char* const*>(argv),
               const_cast<char* const*>(envp.data()));
      ::_exit(127);
    }
    ::close(call[1]);
    ::close(abort_pair[1]);
    if (pid < 0) {
      ADD_FAILURE() << "fork failed";
      ::close(call[0]);
      ::close(abort_pair[0]);
      return {};
    }
    procs.push_back(std::make_unique<ProcessTransport>(r, size, pid, call[0], abort_pair[0]));
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(90);
  bool all_ready = true;
  for (auto& p : procs) {
    const absl::Status s = p->WaitReady(deadline);
    if (!s.ok()) {
      ADD_FAILURE() << "rank " << p->rank() << " of " << size << ": " << s;
      all_ready = false;
    }
  }
  if (!all_ready) return {};
  std::vector<std::unique_ptr<Transport>> group;
  for (auto& p : procs) group.push_back(std::move(p));
  return group;
}

// The host's waits per collective: its completion, and one more for the
// descriptor round unless the call's shape is agreed.
TEST(NcclTransport, ShapeAgreedCallsSkipTheDescriptorRound) {
  if (const std::string reason = NoGpuReason(); !reason.empty()) GTEST_SKIP() << reason;
  for (bool device_buffers : {false, true}) {
    auto group = CreateGroup(2, device_buffers);
    ASSERT_EQ(group.size(), 2u);
    RunRanks(group, [&](int r, Transport& t) {
      CollectiveOptions o;
      o.tag = 21;
      o.deadline = absl::Now() + absl::Seconds(60);
      int64_t v = r;
      ASSERT_TRUE(t.AllreduceSum(&v, 1, DataType::kInt64, o).ok());
      const uint64_t before = t.host_waits();
      ASSERT_TRUE(t.AllreduceSum(&v, 1, DataType::kInt64, o).ok());
      EXPECT_EQ(t.host_waits() - before, 2u) << "checked, rank " << r;
      o.shape_agreed = true;
      ASSERT_TRUE(t.AllreduceSum(&v, 1, DataType::kInt64, o).ok());
      EXPECT_EQ(t.host_waits() - before, 3u) << "agreed, rank " << r;
      EXPECT_EQ(v, 4);  // 0 + 1, then doubled twice
    });
  }
}

}  // namespace

INSTANTIATE_TEST_SUITE_P(
    Nccl, TransportContractTest,
    // At most 4 ranks: each is a process with a CUDA context and a
    // communicator on the one GPU.
    ::testing::Values(TransportBackend{"nccl_host_buffers",
                                       [](int n) { return CreateGroup(n, false); },
                                       NoGpuReason,
                                       /*rank_order_sums=*/false,
                                       {1, 2, 4}},
                      TransportBackend{"nccl_device_buffers",
                                       [](int n) { return CreateGroup(n, true); },
                                       NoGpuReason,
                                       /*rank_order_sums=*/false,
                                       {1, 2, 4}}),
    [](const auto& info) { return info.param.name; });

}  // namespace microd::transport::testing
