// SPDX-License-Identifier: Apache-2.0
// One rank of the NCCL contract test (see nccl_rank_protocol.h): creates the
// NCCL transport, reports ready, then serves calls from fd 3 until told to
// exit; an abort request on fd 4 calls Abort from a second thread, as a
// daemon's watchdog would. With --device_buffers every call's buffers are
// device memory (NCCL used in place); otherwise host memory (the transport
// stages it).
//
// Usage: microd-test-nccl-rank RANK SIZE PREFIX STORE_DIR DEVICE_BUFFERS(0|1)
#include <cuda_runtime_api.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "daemon/transport/nccl/nccl_transport.h"
#include "tests/transport/nccl_rank_protocol.h"

namespace microd::transport::testing {
namespace {

// A buffer in host or device memory holding `bytes` bytes.
class Buffer {
 public:
  Buffer(bool device, size_t bytes) : device_(device), bytes_(bytes), host_(bytes) {
    if (device_ && bytes_ > 0 && cudaMalloc(&dev_, bytes_) != cudaSuccess) dev_ = nullptr;
  }
  ~Buffer() {
    if (dev_ != nullptr) cudaFree(dev_);
  }
  bool ok() const { return !device_ || bytes_ == 0 || dev_ != nullptr; }
  void* get() { return device_ && bytes_ > 0 ? dev_ : static_cast<void*>(host_.data()); }
  void Fill(const std::vector<char>& data) {
    if (data.empty()) return;
    std::copy(data.begin(), data.begin() + std::min(data.size(), bytes_), host_.begin());
    if (device_) {
      // A copy from pageable memory may return before it landed, and the
      // transport's non-blocking stream does not wait for the legacy stream.
      if (cudaMemcpy(dev_, host_.data(), bytes_, cudaMemcpyHostToDevice) != cudaSuccess ||
          cudaDeviceSynchronize() != cudaSuccess) {
        std::fprintf(stderr, "nccl_rank_worker: copy to the device failed\n");
        std::exit(3);
      }
    }
  }
  const std::vector<char>& Read() {
    if (device_ && bytes_ > 0) cudaMemcpy(host_.data(), dev_, bytes_, cudaMemcpyDeviceToHost);
    return host_;
  }

 private:
  const bool device_;
  const size_t bytes_;
  std::vector<char> host_;
  void* dev_ = nullptr;
};

int Main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: %s RANK SIZE PREFIX STORE_DIR DEVICE_BUFFERS\n", argv[0]);
    return 2;
  }
  NcclOptions o;
  o.rank = std::atoi(argv[1]);
  o.size = std::atoi(argv[2]);
  o.prefix = argv[3];
  FileKeyValueStore store(argv[4]);
  o.store = &store;
  o.timeout = absl::Seconds(60);
  const bool device_buffers = std::atoi(argv[5]) != 0;

  auto created = CreateNcclTransport(o);
  if (!WriteResponse(kWorkerCallFd, created.status(), nullptr, 0)) return 3;
  if (!created.ok()) return 0;
  std::unique_ptr<Transport> t = std::move(created).value();

  std::thread aborter([&t] {
    uint32_t len = 0;
    if (!ReadAll(kWorkerAbortFd, &len, sizeof len) || len > 4096) return;
    std::string reason(len, '\0');
    if (!ReadAll(kWorkerAbortFd, reason.data(), len)) return;
    t->Abort(absl::CancelledError(reason));
  });

  for (;;) {
    WorkerRequest req;
    if (!ReadAll(kWorkerCallFd, &req, sizeof req)) break;
    if (req.op == static_cast<uint32_t>(WorkerOp::kExit)) break;
    std::vector<size_t> sizes(req.num_sizes);
    std::vector<char> in(req.payload_bytes);
    if (req.num_sizes > 1024 ||
        !ReadAll(kWorkerCallFd, sizes.data(), sizes.size() * sizeof(size_t)) ||
        !ReadAll(kWorkerCallFd, in.data(), in.size())) {
      break;
    }
    CollectiveOptions co;
    co.tag = req.tag;
    co.deadline = FromWireDeadline(req.deadline_unix_ns);
    co.shape_agreed = (req.flags & kShapeAgreed) != 0;
    const bool null_in = req.flags & kNullIn, null_out = req.flags & kNullOut;
    absl::Status s;
    std::vector<char> out;
    switch (static_cast<WorkerOp>(req.op)) {
      case WorkerOp::kAllgather: {
        Buffer bin(device_buffers, req.a), bout(device_buffers, req.a * o.size);
        if (!bin.ok() || !bout.ok()) {
          s = absl::ResourceExhaustedError("worker: cudaMalloc failed");
          break;
        }
        bin.Fill(in);
        s = t->Allgather(null_in ? nullptr : bin.get(), req.a, null_out ? nullptr : bout.get(), co);
        if (s.ok()) out = bout.Read();
        break;
      }
      case WorkerOp::kAllgatherV: {
        size_t total = 0;
        for (size_t b : sizes) total += b;
        Buffer bin(device_buffers, in.size()), bout(device_buffers, total);
        if (!bin.ok() || !bout.ok()) {
          s = absl::ResourceExhaustedError("worker: cudaMalloc failed");
          break;
        }
        bin.Fill(in);
        s = t->AllgatherV(null_in ? nullptr : bin.get(), sizes, null_out ? nullptr : bout.get(),
                          co);
        if (s.ok()) out = bout.Read();
        break;
      }
      case WorkerOp::kAllreduce: {
        const DataType type = static_cast<DataType>(req.type);
        Buffer data(device_buffers, in.size());
        if (!data.ok()) {
          s = absl::ResourceExhaustedError("worker: cudaMalloc failed");
          break;
        }
        data.Fill(in);
        s = t->AllreduceSum(null_in ? nullptr : data.get(), req.a, type, co);
        if (s.ok()) out = data.Read();
        break;
      }
      case WorkerOp::kBarrier:
        s = t->Barrier(co);
        break;
      default:
        s = absl::InvalidArgumentError("worker: unknown op");
    }
    if (!WriteResponse(kWorkerCallFd, s, out.data(), out.size(), t->host_waits())) break;
  }
  // Wake the aborter (blocked in read) before the transport goes.
  ::shutdown(kWorkerAbortFd, SHUT_RDWR);
  aborter.join();
  t.reset();
  return 0;
}

}  // namespace
}  // namespace microd::transport::testing

int main(int argc, char** argv) { return microd::transport::testing::Main(argc, argv); }
