// SPDX-License-Identifier: Apache-2.0
// The daemon's side of CUDA buffers without a GPU: one node (coordinator,
// engine, local server) in this process, with a fake CudaIpcRegistry whose
// "device memory" is host memory of the test and whose ready event is a
// flag. A training process speaks the wire protocol on the socket. Checked:
// REGISTER_CUDA reaches the registry with its fields, a CUDA bucket gets the
// very update a host bucket gets from the same gradient (sparse and dense),
// the engine reads the buffer only once the ready event fired, an event that
// never fires fails the job by the deadline with the bucket named, and the
// registry hears when the process leaves. Last, the C API's CUDA buffers end
// to end over a fake CUDA driver (fake_libcuda.c). The real registry
// (daemon/local/cuda/) and driver need a GPU: tests/integration/daemon_cuda_test.cc.
#include <dlfcn.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "daemon/common/status_map.h"
#include "daemon/control/control_plane.h"
#include "daemon/control/coordinator.h"
#include "daemon/engine/engine.h"
#include "daemon/local/cuda_ipc.h"
#include "daemon/local/local_server.h"
#include "daemon/transport/inproc/inproc_transport.h"
#include "gtest/gtest.h"
#include "kernels/sparse_ops.h"
#include "microd/microd.h"
#include "microd/wire.h"
#include "tests/integration/process_util.h"
extern "C" {
#include "tests/integration/e2e_grad.h"
}

namespace microd::engine {
namespace {

// What the fake registry saw and controls.
struct FakeGpu {
  std::atomic<bool> ready{true};  // the ready event "fired"
  std::atomic<int> copies_in{0}, copies_out{0}, opened{0}, forgotten{0}, abandoned{0};
  std::atomic<int> waiting{0};  // waits that found the event not fired yet
  std::atomic<int> ready_waits{0};
  int ordinal = 0;  // the GPU the buffers are on
  absl::Mutex mu;
  std::vector<local::CudaIpcRequest> requests ABSL_GUARDED_BY(mu);
};

class FakeBuffer final : public local::DeviceMemory {
 public:
  FakeBuffer(FakeGpu* gpu, float* device, uint64_t count)
      : gpu_(gpu), device_(device), staging_(count) {}
  float* staging() const override { return const_cast<float*>(staging_.data()); }
  uint64_t count() const override { return staging_.size(); }
  float* mapped() const override { return device_; }
  int ordinal() const override { return gpu_->ordinal; }
  absl::Status WaitReady(absl::Time deadline, const std::function<bool()>& abandoned) override {
    ++gpu_->ready_waits;
    if (!gpu_->ready.load()) ++gpu_->waiting;
    while (!gpu_->ready.load()) {
      if (absl::Now() >= deadline) {
        return WithClientStatus(absl::DeadlineExceededError("the gradient was not ready in time"),
                                ClientStatus::kTimeout);
      }
      if (abandoned()) {
        ++gpu_->abandoned;
        return absl::AbortedError("abandoned");
      }
      absl::SleepFor(absl::Milliseconds(1));
    }
    return absl::OkStatus();
  }
  absl::Status BeginCopyIn(absl::Time deadline, const std::function<bool()>& abandoned) override {
    if (absl::Status s = WaitReady(deadline, abandoned); !s.ok()) return s;
    std::memcpy(staging_.data(), device_, staging_.size() * sizeof(float));
    ++gpu_->copies_in;
    return absl::OkStatus();
  }
  absl::Status BeginCopyOut() override {
    std::memcpy(device_, staging_.data(), staging_.size() * sizeof(float));
    ++gpu_->copies_out;
    return absl::OkStatus();
  }
  absl::Status Finish(absl::Time) override { return absl::OkStatus(); }
  std::string Describe() const override { return "fake CUDA buffer"; }

 private:
  FakeGpu* const gpu_;
  float* const device_;
  std::vector<float> staging_;
};

// The "IPC handle" is the allocation's address in this process.
class FakeRegistry final : public local::CudaIpcRegistry {
 public:
  explicit FakeRegistry(FakeGpu* gpu) : gpu_(gpu) {}
  absl::StatusOr<std::unique_ptr<local::DeviceMemory>> Open(
      const local::CudaIpcRequest& r) override {
    {
      absl::MutexLock lock(&gpu_->mu);
      gpu_->requests.push_back(r);
    }
    float* base;
    std::memcpy(&base, r.mem_handle.data(), sizeof base);
    ++gpu_->opened;
    return std::unique_ptr<local::DeviceMemory>(
        std::make_unique<FakeBuffer>(gpu_, base + r.offset / sizeof(float), r.count));
  }
  void ForgetClient(uint64_t) override { ++gpu_->forgotten; }

 private:
  FakeGpu* const gpu_;
};

// One node of a job, in this process, as microd_main.cc assembles it.
class Node {
 public:
  Node(FakeGpu* gpu, absl::Duration op_timeout, bool device_resident = false, int local_size = 1)
      : dir_(testing::MakeTempDir("staging")) {
    control::CoordinatorOptions co;
    co.expected_nodes = 1;
    coordinator_ = std::move(control::Coordinator::Create(co)).value();
    // The control plane in this process: no gRPC server, no sockets.
    control_ = std::make_unique<control::InProcessControlPlane>(
        std::move(control::InProcessControlPlane::Join(coordinator_.get(), "microd", "node0",
                                                       local_size, absl::Now() + absl::Seconds(20)))
            .value());
    const control::Membership membership = control_->membership();
    transports_ = transport::CreateInprocGroup(1);
    ops_ = kernels::CreateCpuSparseOps();
    EngineOptions eo;
    eo.op_timeout = op_timeout;
    eo.device_resident = device_resident;
    eo.local_size = local_size;
    engine_ =
        std::make_unique<Engine>(eo, membership, control_.get(), transports_[0].get(), ops_.get());
    local::LocalServerOptions lo;
    lo.socket_path = dir_ + "/microd.sock";
    lo.cuda_registry = [gpu]() -> absl::StatusOr<std::unique_ptr<local::CudaIpcRegistry>> {
      return std::unique_ptr<local::CudaIpcRegistry>(std::make_unique<FakeRegistry>(gpu));
    };
    local_ = std::move(local::LocalServer::Start(lo, engine_.get())).value();
    engine_->SetServer(local_.get());
    engine_->Start();
  }
  ~Node() {
    local_->Stop();
    engine_->Stop(absl::CancelledError("test over"));
    engine_.reset();
    local_.reset();
  }
  std::string socket() const { return dir_ + "/microd.sock"; }
  Engine& engine() { return *engine_; }

 private:
  const std::string dir_;
  std::unique_ptr<control::Coordinator> coordinator_;
  std::unique_ptr<control::InProcessControlPlane> control_;
  std::vector<std::unique_ptr<transport::Transport>> transports_;
  std::unique_ptr<kernels::SparseOps> ops_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<local::LocalServer> local_;
};

// A training process on the wire protocol.
class Process {
 public:
  explicit Process(const std::string& socket) {
    fd_ = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strcpy(addr.sun_path, socket.c_str());
    EXPECT_EQ(connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
    timeval tv{30, 0};
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    microd_wire_hello hello{};
    microd_wire_header_init(&hello.h, MICROD_MSG_HELLO, sizeof hello);
    hello.local_rank = -1;
    EXPECT_EQ(send(fd_, &hello, sizeof hello, 0), static_cast<ssize_t>(sizeof hello));
    microd_wire_hello_ack ack{};
    EXPECT_EQ(recv(fd_, &ack, sizeof ack, 0), static_cast<ssize_t>(sizeof ack));
    EXPECT_EQ(ack.status, 0);
    EXPECT_NE(ack.h.reserved & MICROD_WIRE_CAP_REGISTER_CUDA, 0u);
  }
  ~Process() { Leave(); }
  // Gone without a goodbye, as a crashed process.
  void Vanish() {
    close(fd_);
    fd_ = -1;
  }
  void Leave() {
    if (fd_ < 0) return;
    microd_wire_goodbye bye{};
    microd_wire_header_init(&bye.h, MICROD_MSG_GOODBYE, sizeof bye);
    (void)send(fd_, &bye, sizeof bye, MSG_NOSIGNAL);
    close(fd_);
    fd_ = -1;
    for (auto& [p, bytes] : maps_) munmap(p, bytes);
    maps_.clear();
  }

  // A host buffer (memfd) of `count` floats; returns its mapping. The
  // daemon's answer goes to `status` when given, else it must be OK.
  float* RegisterHost(uint32_t id, const std::string& name, uint64_t count, int* status = nullptr) {
    const size_t bytes = count * sizeof(float);
    const int mfd = memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
    EXPECT_GE(mfd, 0);
    EXPECT_EQ(ftruncate(mfd, bytes), 0);
    EXPECT_EQ(fcntl(mfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, mfd, 0);
    EXPECT_NE(p, MAP_FAILED);
    maps_.push_back({p, bytes});
    microd_wire_register reg{};
    microd_wire_header_init(&reg.h, MICROD_MSG_REGISTER, sizeof reg);
    reg.buffer_id = id;
    reg.kind = MICROD_BUFFER_HOST;
    reg.dtype = MICROD_WIRE_DTYPE_FLOAT32;
    reg.count = count;
    std::strcpy(reg.name, name.c_str());
    const int answer = Registered(&reg, sizeof reg, mfd);
    if (status != nullptr) {
      *status = answer;
    } else {
      EXPECT_EQ(answer, 0) << last_message_;
    }
    close(mfd);
    return static_cast<float*>(p);
  }

  // A "CUDA" buffer: `count` floats at `offset` bytes into `alloc`.
  int RegisterCuda(uint32_t id, const std::string& name, float* alloc, uint64_t alloc_bytes,
                   uint64_t offset, uint64_t count) {
    microd_wire_register_cuda reg{};
    microd_wire_header_init(&reg.h, MICROD_MSG_REGISTER_CUDA, sizeof reg);
    reg.buffer_id = id;
    reg.dtype = MICROD_WIRE_DTYPE_FLOAT32;
    reg.device_ordinal = 0;
    reg.count = count;
    std::strcpy(reg.name, name.c_str());
    std::memcpy(reg.mem_handle, &alloc, sizeof alloc);
    reg.alloc_bytes = alloc_bytes;
    reg.offset = offset;
    reg.event_handle[0] = 0xE7;
    return Registered(&reg, sizeof reg, -1);
  }

  const std::string& last_message() const { return last_message_; }

  void Submit(uint32_t id, uint64_t ticket) {
    microd_wire_submit sub{};
    microd_wire_header_init(&sub.h, MICROD_MSG_SUBMIT, sizeof sub);
    sub.buffer_id = id;
    sub.ticket = ticket;
    EXPECT_EQ(send(fd_, &sub, sizeof sub, 0), static_cast<ssize_t>(sizeof sub));
  }

  // The next completion within `timeout`; status -1 when none came.
  microd_wire_completion Completion(std::chrono::milliseconds timeout) {
    timeval tv{static_cast<time_t>(timeout.count() / 1000),
               static_cast<suseconds_t>(timeout.count() % 1000 * 1000)};
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    microd_wire_completion done{};
    const ssize_t n = recv(fd_, &done, sizeof done, 0);
    if (n != static_cast<ssize_t>(sizeof done) || done.h.type != MICROD_MSG_COMPLETION) {
      done.status = -1;
    }
    done.message[MICROD_WIRE_MESSAGE_BYTES - 1] = '\0';
    return done;
  }

 private:
  int Registered(const void* msg, size_t len, int pass_fd) {
    EXPECT_EQ(microd_wire_send(fd_, msg, len, pass_fd), 0);
    microd_wire_register_ack ack{};
    EXPECT_EQ(recv(fd_, &ack, sizeof ack, 0), static_cast<ssize_t>(sizeof ack));
    ack.message[MICROD_WIRE_MESSAGE_BYTES - 1] = '\0';
    last_message_ = ack.message;
    return ack.status;
  }

  int fd_ = -1;
  std::vector<std::pair<void*, size_t>> maps_;
  std::string last_message_;
};

TEST(CudaStaging, CudaBucketsGetTheUpdateHostBucketsGet) {
  FakeGpu gpu;
  Node node(&gpu, absl::Seconds(20));
  Process p(node.socket());
  const std::vector<uint64_t> counts = {100003, 1000};  // sparse, dense (fused)
  // Both "CUDA" buckets in one allocation, at offsets.
  std::vector<float> alloc(64 + counts[0] + 64 + counts[1] + 64);
  const std::vector<uint64_t> offsets = {64 * 4, (64 + counts[0] + 64) * 4};
  std::vector<float*> host;
  for (uint32_t b = 0; b < 2; ++b) {
    host.push_back(p.RegisterHost(2 * b, absl::StrCat("host", b), counts[b]));
    ASSERT_EQ(p.RegisterCuda(2 * b + 1, absl::StrCat("cuda", b), alloc.data(),
                             alloc.size() * sizeof(float), offsets[b], counts[b]),
              0);
  }
  {
    absl::MutexLock lock(&gpu.mu);
    ASSERT_EQ(gpu.requests.size(), 2u);
    EXPECT_EQ(gpu.requests[1].name, "cuda1");
    EXPECT_EQ(gpu.requests[1].count, counts[1]);
    EXPECT_EQ(gpu.requests[1].offset, offsets[1]);
    EXPECT_EQ(gpu.requests[1].alloc_bytes, alloc.size() * sizeof(float));
    EXPECT_EQ(gpu.requests[1].event_handle[0], 0xE7);
  }
  uint64_t ticket = 0;
  for (uint64_t t = 0; t < 4; ++t) {
    for (uint32_t b = 0; b < 2; ++b) {
      e2e_fill(host[b], counts[b], 0, static_cast<int>(b), t);
      e2e_fill(alloc.data() + offsets[b] / 4, counts[b], 0, static_cast<int>(b), t);
      p.Submit(2 * b, ++ticket);
      p.Submit(2 * b + 1, ++ticket);
    }
    for (int i = 0; i < 4; ++i) {
      const auto done = p.Completion(std::chrono::seconds(30));
      ASSERT_EQ(done.status, 0) << done.message;
    }
    for (uint32_t b = 0; b < 2; ++b) {
      ASSERT_EQ(std::memcmp(host[b], alloc.data() + offsets[b] / 4, counts[b] * sizeof(float)), 0)
          << "bucket " << b << " step " << t;
    }
  }
  // The guard cells around the buckets are untouched.
  for (size_t i = 0; i < 64; ++i) EXPECT_EQ(alloc[i], 0.0f);
  EXPECT_EQ(gpu.copies_in.load(), 8);
  EXPECT_EQ(gpu.copies_out.load(), 8);
  EXPECT_EQ(gpu.forgotten.load(), 0);
  p.Leave();
  for (int i = 0; i < 200 && gpu.forgotten.load() == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(gpu.forgotten.load(), 1);
  EXPECT_TRUE(node.engine().Snapshot().failure.empty()) << node.engine().Snapshot().failure;
}

TEST(CudaStaging, TheStepWaitsForTheReadyEvent) {
  FakeGpu gpu;
  Node node(&gpu, absl::Seconds(20));
  Process p(node.socket());
  std::vector<float> alloc(1000, 1.0f);
  ASSERT_EQ(p.RegisterCuda(0, "g", alloc.data(), alloc.size() * 4, 0, alloc.size()), 0);
  gpu.ready = false;
  p.Submit(0, 1);
  for (int k = 0; k < 1000 && gpu.waiting.load() == 0; ++k) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_EQ(gpu.waiting.load(), 1) << "the engine never waited for the event";
  EXPECT_EQ(p.Completion(std::chrono::milliseconds(300)).status, -1) << "completed early";
  EXPECT_EQ(gpu.copies_in.load(), 0);
  gpu.ready = true;
  const auto done = p.Completion(std::chrono::seconds(20));
  EXPECT_EQ(done.status, 0) << done.message;
  EXPECT_EQ(alloc[0], 1.0f);  // one process of one node: the average is itself
}

TEST(CudaStaging, AReadyEventThatNeverFiresFailsTheJobByTheDeadline) {
  FakeGpu gpu;
  Node node(&gpu, absl::Seconds(1));
  Process p(node.socket());
  std::vector<float> alloc(1000, 1.0f);
  ASSERT_EQ(p.RegisterCuda(0, "stuck", alloc.data(), alloc.size() * 4, 0, alloc.size()), 0);
  gpu.ready = false;
  const auto start = std::chrono::steady_clock::now();
  p.Submit(0, 1);
  const auto done = p.Completion(std::chrono::seconds(20));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  EXPECT_EQ(done.status, static_cast<int>(ClientStatus::kJobFailed)) << done.message;
  EXPECT_TRUE(absl::StrContains(done.message, "'stuck'")) << done.message;
  EXPECT_TRUE(absl::StrContains(done.message, "not ready in time")) << done.message;
  // The completion goes out first, then the engine records the failure.
  for (int i = 0; i < 500 && node.engine().Snapshot().failure.empty(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(absl::StrContains(node.engine().Snapshot().failure, "CUDA staging"))
      << node.engine().Snapshot().failure;
}

TEST(CudaStaging, AProcessThatVanishesEndsTheWaitForItsReadyEvent) {
  FakeGpu gpu;
  const auto start = std::chrono::steady_clock::now();
  {
    Node node(&gpu, absl::Seconds(60));
    Process p(node.socket());
    std::vector<float> alloc(1000, 1.0f);
    ASSERT_EQ(p.RegisterCuda(0, "g", alloc.data(), alloc.size() * 4, 0, alloc.size()), 0);
    gpu.ready = false;
    p.Submit(0, 1);
    for (int i = 0; i < 1000 && gpu.waiting.load() == 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ASSERT_EQ(gpu.waiting.load(), 1) << "the engine never waited for the event";
    p.Vanish();
    for (int i = 0; i < 500 && gpu.abandoned.load() == 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    EXPECT_EQ(gpu.abandoned.load(), 1);
    EXPECT_EQ(gpu.copies_in.load(), 0);
    EXPECT_TRUE(absl::StrContains(node.engine().Snapshot().failure, "disconnected"))
        << node.engine().Snapshot().failure;
  }
  // Not the 60 s deadline.
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(15));
}

// Device-resident (the GPU engine, here over the CPU backend: the "device
// memory" is host memory): CUDA buffers are reduced where they lie, with no
// staging copies, after their ready event; the update is bit-equal to what
// the staging engine gives host buckets from the same gradients.
TEST(DeviceResident, CudaBucketsAreReducedInPlace) {
  const std::vector<uint64_t> counts = {100003, 1000};  // sparse, dense (fused)
  constexpr int kSteps = 4;
  for (int local : {1, 2}) {
    SCOPED_TRACE(absl::StrCat(local, " local processes"));
    // Reference: host buckets through the staging engine.
    std::vector<std::vector<std::vector<float>>> want(kSteps);  // [step][bucket]
    {
      FakeGpu gpu;
      Node node(&gpu, absl::Seconds(20), /*device_resident=*/false, local);
      std::vector<std::unique_ptr<Process>> procs;
      std::vector<std::vector<float*>> host(local);
      for (int l = 0; l < local; ++l) {
        procs.push_back(std::make_unique<Process>(node.socket()));
        for (uint32_t b = 0; b < 2; ++b) {
          host[l].push_back(procs[l]->RegisterHost(b, absl::StrCat("g", b), counts[b]));
        }
      }
      uint64_t ticket = 0;
      for (int t = 0; t < kSteps; ++t) {
        for (int l = 0; l < local; ++l) {
          for (uint32_t b = 0; b < 2; ++b) {
            e2e_fill(host[l][b], counts[b], l, static_cast<int>(b), t);
            procs[l]->Submit(b, ++ticket);
          }
        }
        for (int l = 0; l < local; ++l) {
          for (int i = 0; i < 2; ++i) {
            const auto done = procs[l]->Completion(std::chrono::seconds(30));
            ASSERT_EQ(done.status, 0) << done.message;
          }
        }
        for (uint32_t b = 0; b < 2; ++b) want[t].emplace_back(host[0][b], host[0][b] + counts[b]);
      }
    }
    FakeGpu gpu;
    Node node(&gpu, absl::Seconds(20), /*device_resident=*/true, local);
    std::vector<std::unique_ptr<Process>> procs;
    // Each process's two buckets in one allocation, with guard cells.
    std::vector<std::vector<float>> alloc(local,
                                          std::vector<float>(64 + counts[0] + 64 + counts[1] + 64));
    const std::vector<uint64_t> offsets = {64 * 4, (64 + counts[0] + 64) * 4};
    for (int l = 0; l < local; ++l) {
      procs.push_back(std::make_unique<Process>(node.socket()));
      for (uint32_t b = 0; b < 2; ++b) {
        ASSERT_EQ(procs[l]->RegisterCuda(b, absl::StrCat("g", b), alloc[l].data(),
                                         alloc[l].size() * sizeof(float), offsets[b], counts[b]),
                  0)
            << procs[l]->last_message();
      }
    }
    uint64_t ticket = 0;
    for (int t = 0; t < kSteps; ++t) {
      for (int l = 0; l < local; ++l) {
        for (uint32_t b = 0; b < 2; ++b) {
          e2e_fill(alloc[l].data() + offsets[b] / 4, counts[b], l, static_cast<int>(b), t);
          procs[l]->Submit(b, ++ticket);
        }
      }
      for (int l = 0; l < local; ++l) {
        for (int i = 0; i < 2; ++i) {
          const auto done = procs[l]->Completion(std::chrono::seconds(30));
          ASSERT_EQ(done.status, 0) << done.message;
        }
      }
      for (int l = 0; l < local; ++l) {
        for (uint32_t b = 0; b < 2; ++b) {
          ASSERT_EQ(std::memcmp(want[t][b].data(), alloc[l].data() + offsets[b] / 4,
                                counts[b] * sizeof(float)),
                    0)
              << "bucket " << b << " step " << t << " process " << l;
        }
      }
    }
    for (int l = 0; l < local; ++l) {
      for (size_t i = 0; i < 64; ++i) EXPECT_EQ(alloc[l][i], 0.0f);
      EXPECT_EQ(alloc[l].back(), 0.0f);
    }
    EXPECT_EQ(gpu.copies_in.load(), 0) << "staged although device-resident";
    EXPECT_EQ(gpu.copies_out.load(), 0) << "staged although device-resident";
    EXPECT_EQ(gpu.ready_waits.load(), kSteps * 2 * local) << "a ready event was not awaited";
    EXPECT_TRUE(node.engine().Snapshot().failure.empty()) << node.engine().Snapshot().failure;
  }
}

TEST(DeviceResident, HostBuffersAndBuffersOnAnotherGpuAreRefused) {
  FakeGpu gpu;
  Node node(&gpu, absl::Seconds(20), /*device_resident=*/true);
  Process p(node.socket());
  int status = 0;
  p.RegisterHost(0, "host", 1000, &status);
  EXPECT_EQ(status, MICROD_ERR_UNSUPPORTED);
  EXPECT_TRUE(absl::StrContains(p.last_message(), "only CUDA buffers")) << p.last_message();
  EXPECT_TRUE(absl::StrContains(p.last_message(), "host memory")) << p.last_message();
  std::vector<float> alloc(1000, 1.0f);
  gpu.ordinal = 1;  // the engine reduces on GPU 0
  EXPECT_EQ(p.RegisterCuda(1, "other_gpu", alloc.data(), alloc.size() * 4, 0, alloc.size()),
            MICROD_ERR_UNSUPPORTED);
  EXPECT_TRUE(absl::StrContains(p.last_message(), "on GPU 1")) << p.last_message();
  // Nothing was lost: a buffer on the right GPU still registers and reduces.
  gpu.ordinal = 0;
  ASSERT_EQ(p.RegisterCuda(2, "g", alloc.data(), alloc.size() * 4, 0, alloc.size()), 0)
      << p.last_message();
  p.Submit(2, 1);
  const auto done = p.Completion(std::chrono::seconds(20));
  EXPECT_EQ(done.status, 0) << done.message;
  EXPECT_EQ(alloc[0], 1.0f);  // one process of one node: the average is itself
  EXPECT_TRUE(node.engine().Snapshot().failure.empty()) << node.engine().Snapshot().failure;
}

// fake_libcuda.c's event.
struct FakeEvent {
  int records;
  int destroyed;
  void* last_stream;
};

// The C API with CUDA buffers over a fake driver: what the library sends,
// when it records the ready event and on which stream, what it refuses, and
// that it releases the event at close.
TEST(CudaStaging, TheCApiOverAFakeDriver) {
  ASSERT_EQ(setenv("MICROD_LIBCUDA", MICROD_FAKE_LIBCUDA, 1), 0);
  void* fake = dlopen(MICROD_FAKE_LIBCUDA, RTLD_NOW);
  ASSERT_NE(fake, nullptr) << dlerror();
  auto add_allocation =
      reinterpret_cast<void (*)(void*, size_t, int)>(dlsym(fake, "fake_cuda_add_allocation"));
  auto context_depth = reinterpret_cast<int (*)()>(dlsym(fake, "fake_cuda_context_depth"));
  ASSERT_NE(add_allocation, nullptr);
  ASSERT_NE(context_depth, nullptr);

  FakeGpu gpu;
  Node node(&gpu, absl::Seconds(20));
  microd_options o;
  microd_options_init(&o);
  const std::string socket = node.socket();
  o.socket_path = socket.c_str();
  microd_client* c = nullptr;
  ASSERT_EQ(microd_connect(&o, &c), MICROD_OK) << microd_last_error(nullptr);

  const uint64_t n = 100003;
  std::vector<float> device(64 + n + 64);
  add_allocation(device.data(), device.size() * sizeof(float), 0);
  float* d = device.data() + 64;
  int32_t cuda_id = -1, host_id = -1;
  ASSERT_EQ(microd_register_cuda_buffer(c, "cuda", d, n, nullptr, &cuda_id), MICROD_OK)
      << microd_last_error(c);
  float* h = nullptr;
  ASSERT_EQ(microd_register_host_buffer(c, "host", n, &h, &host_id), MICROD_OK)
      << microd_last_error(c);
  FakeEvent* event = nullptr;
  {
    absl::MutexLock lock(&gpu.mu);
    ASSERT_EQ(gpu.requests.size(), 1u);
    const local::CudaIpcRequest& r = gpu.requests[0];
    EXPECT_EQ(r.name, "cuda");
    EXPECT_EQ(r.count, n);
    EXPECT_EQ(r.offset, 64 * sizeof(float));
    EXPECT_EQ(r.alloc_bytes, device.size() * sizeof(float));
    EXPECT_EQ(std::memcmp(r.device_uuid.data(), "FAKE-GPU-0000000", 16), 0);
    float* base = nullptr;
    std::memcpy(&base, r.mem_handle.data(), sizeof base);
    EXPECT_EQ(base, device.data());
    std::memcpy(&event, r.event_handle.data(), sizeof event);
  }
  ASSERT_NE(event, nullptr);
  EXPECT_EQ(event->records, 0);

  void* const stream = reinterpret_cast<void*>(0x5);
  for (uint64_t t = 0; t < 3; ++t) {
    e2e_fill(h, n, 0, 0, t);
    e2e_fill(d, n, 0, 0, t);
    uint64_t t1 = 0, t2 = 0;
    ASSERT_EQ(microd_allreduce_cuda_async(c, cuda_id, stream, &t1), MICROD_OK)
        << microd_last_error(c);
    EXPECT_EQ(event->records, static_cast<int>(t) + 1);
    EXPECT_EQ(event->last_stream, stream);
    ASSERT_EQ(microd_allreduce_async(c, host_id, &t2), MICROD_OK) << microd_last_error(c);
    ASSERT_EQ(microd_wait(c, t1, 30000), MICROD_OK) << microd_last_error(c);
    ASSERT_EQ(microd_wait(c, t2, 30000), MICROD_OK) << microd_last_error(c);
    ASSERT_EQ(std::memcmp(h, d, n * sizeof(float)), 0) << "step " << t;
  }
  // Without a stream: the legacy default stream.
  ASSERT_EQ(microd_allreduce(c, cuda_id, 30000), MICROD_OK) << microd_last_error(c);
  EXPECT_EQ(event->last_stream, nullptr);
  EXPECT_EQ(event->records, 4);
  // A stream the driver refuses: nothing is submitted, the buffer stays usable.
  uint64_t ticket = 0;
  EXPECT_EQ(microd_allreduce_cuda_async(c, cuda_id, reinterpret_cast<void*>(0xBAD), &ticket),
            MICROD_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(microd_last_error(c), "stream")) << microd_last_error(c);
  ASSERT_EQ(microd_allreduce(c, cuda_id, 30000), MICROD_OK) << microd_last_error(c);

  // Memory legacy CUDA IPC cannot share, each with its reason.
  std::vector<float> pool(1024), managed(1024), vmm(1024), small(1000), pageable(1024);
  add_allocation(pool.data(), 4096, 1);
  add_allocation(managed.data(), 4096, 2);
  add_allocation(vmm.data(), 4096, 3);
  add_allocation(small.data(), 4000, 0);
  int32_t id = -1;
  EXPECT_EQ(microd_register_cuda_buffer(c, "x", pool.data(), 1024, nullptr, &id),
            MICROD_ERR_UNSUPPORTED);
  EXPECT_TRUE(absl::StrContains(microd_last_error(c), "cudaMallocAsync")) << microd_last_error(c);
  EXPECT_EQ(microd_register_cuda_buffer(c, "x", managed.data(), 1024, nullptr, &id),
            MICROD_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(microd_last_error(c), "managed")) << microd_last_error(c);
  EXPECT_EQ(microd_register_cuda_buffer(c, "x", vmm.data(), 1024, nullptr, &id),
            MICROD_ERR_UNSUPPORTED);
  EXPECT_TRUE(absl::StrContains(microd_last_error(c), "expandable_segments"))
      << microd_last_error(c);
  EXPECT_EQ(microd_register_cuda_buffer(c, "x", pageable.data(), 1024, nullptr, &id),
            MICROD_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(microd_last_error(c), "cudaMalloc")) << microd_last_error(c);
  EXPECT_EQ(microd_register_cuda_buffer(c, "x", small.data() + 500, 600, nullptr, &id),
            MICROD_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(microd_last_error(c), "past the end")) << microd_last_error(c);
  EXPECT_EQ(id, -1);
  EXPECT_EQ(context_depth(), 0) << "context pushes and pops unbalanced";
  {
    absl::MutexLock lock(&gpu.mu);
    EXPECT_EQ(gpu.requests.size(), 1u) << "a refused buffer reached the daemon";
  }

  EXPECT_TRUE(node.engine().Snapshot().failure.empty()) << node.engine().Snapshot().failure;

  // Closed with a submission of a second buffer in flight: that buffer's
  // event stays (the daemon may still wait on it), the other one goes.
  std::vector<float> device2(1000);
  add_allocation(device2.data(), device2.size() * sizeof(float), 0);
  ASSERT_EQ(microd_register_cuda_buffer(c, "cuda2", device2.data(), 1000, nullptr, &id), MICROD_OK)
      << microd_last_error(c);
  FakeEvent* event2 = nullptr;
  {
    absl::MutexLock lock(&gpu.mu);
    ASSERT_EQ(gpu.requests.size(), 2u);
    std::memcpy(&event2, gpu.requests[1].event_handle.data(), sizeof event2);
  }
  ASSERT_EQ(microd_allreduce_async(c, id, &ticket), MICROD_OK) << microd_last_error(c);
  EXPECT_EQ(microd_close(c), MICROD_OK);
  EXPECT_EQ(event->destroyed, 1);
  EXPECT_EQ(event2->destroyed, 0);
  for (int i = 0; i < 200 && gpu.forgotten.load() == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(gpu.forgotten.load(), 1);
  unsetenv("MICROD_LIBCUDA");
  // The fake driver's events outlive cuEventDestroy (which only marks
  // them), so that the checks above can read them.
  std::free(event);
  std::free(event2);
}

}  // namespace
}  // namespace microd::engine
