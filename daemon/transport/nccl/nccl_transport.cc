// SPDX-License-Identifier: Apache-2.0
// NCCL backend (nccl_transport.h says what it adds to the contract). Written
// and compiled without a GPU.
//
// One call: [descriptor allgather, checked on the host] -> host inputs copied
// to the device -> the NCCL operations in one group -> device results copied
// to pinned host memory -> an event recorded -> polled (event and
// ncclCommGetAsyncError) until done, the deadline, or an abort request.
// Abort from another thread never touches the communicator while a call uses
// it: it marks the transport broken and the calling thread aborts the
// communicator when it sees the mark; with no call in progress Abort aborts
// it directly.
#include "daemon/transport/nccl/nccl_transport.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "daemon/common/status_macros.h"
#include "kernels/poll_pacer.h"

namespace microd::transport {
namespace {

constexpr int64_t kMagic = 0x6d6963726f64;  // "microd"
constexpr int kDescWords = 4;

enum class Kind : int64_t { kAllgather = 1, kAllgatherV = 2, kAllreduce = 3, kBarrier = 4 };

const char* KindName(int64_t kind) {
  switch (static_cast<Kind>(kind)) {
    case Kind::kAllgather:
      return "Allgather";
    case Kind::kAllgatherV:
      return "AllgatherV";
    case Kind::kAllreduce:
      return "AllreduceSum";
    case Kind::kBarrier:
      return "Barrier";
  }
  return "unknown";
}

absl::Status CudaStatus(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("nccl transport: ", what, ": ", cudaGetErrorString(e)));
}

absl::Status NcclStatus(ncclResult_t r, ncclComm_t comm, const char* what) {
  if (r == ncclSuccess) return absl::OkStatus();
  const char* last = ncclGetLastError(comm);
  const std::string msg =
      absl::StrCat("nccl transport: ", what, ": ", ncclGetErrorString(r),
                   last != nullptr && *last != '\0' ? " (" : "", last != nullptr ? last : "",
                   last != nullptr && *last != '\0' ? ")" : "");
  // A peer that failed or vanished shows up as a remote or system error.
  if (r == ncclRemoteError || r == ncclSystemError) return absl::UnavailableError(msg);
  return absl::InternalError(msg);
}

size_t AlignUp(size_t x) { return (x + 255) / 256 * 256; }

uint64_t HashSizes(absl::Span<const size_t> sizes) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (size_t s : sizes) {
    for (int i = 0; i < 8; ++i) {
      h ^= (static_cast<uint64_t>(s) >> (8 * i)) & 0xFF;
      h *= 1099511628211ull;
    }
  }
  return h;
}

// True for memory NCCL can use directly (device or managed memory).
bool IsDeviceMemory(const void* p) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();  // plain host memory on old runtimes: clear the error
    return false;
  }
  return attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
}

class NcclTransport final : public Transport {
 public:
  explicit NcclTransport(const NcclOptions& o)
      : rank_(o.rank),
        size_(o.size),
        device_(o.device),
        timeout_(o.timeout),
        check_(o.check_collectives),
        stream_(static_cast<cudaStream_t>(o.stream)) {}

  ~NcclTransport() override {
    cudaSetDevice(device_);
    {
      absl::MutexLock lock(&mu_);
      // Abort rather than destroy: ncclCommDestroy may wait for peers.
      AbortCommLocked();
    }
    if (event_ != nullptr) cudaEventDestroy(event_);
    if (dev_stage_ != nullptr) cudaFree(dev_stage_);
    if (host_stage_ != nullptr) cudaFreeHost(host_stage_);
    if (desc_dev_ != nullptr) cudaFree(desc_dev_);
    if (desc_host_ != nullptr) cudaFreeHost(desc_host_);
    if (owns_stream_ && stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  absl::Status Init(const ncclUniqueId& id, absl::Time deadline) {
    RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
    if (stream_ == nullptr) {
      // A blocking stream: its work starts after what the caller queued on
      // the legacy default stream (the SparseOps calls of a step), and the
      // legacy stream's later work waits for it.
      RETURN_IF_ERROR(
          CudaStatus(cudaStreamCreateWithFlags(&stream_, cudaStreamDefault), "cudaStreamCreate"));
      owns_stream_ = true;
    }
    RETURN_IF_ERROR(
        CudaStatus(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), "cudaEventCreate"));
    const size_t desc_bytes = sizeof(int64_t) * kDescWords * (size_ + 1);
    RETURN_IF_ERROR(CudaStatus(cudaMalloc(&desc_dev_, desc_bytes), "cudaMalloc"));
    RETURN_IF_ERROR(CudaStatus(cudaMallocHost(&desc_host_, desc_bytes), "cudaMallocHost"));

    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // init and group ends return ncclInProgress; we poll
    const ncclResult_t r = ncclCommInitRankConfig(&comm_, size_, id, rank_, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
      absl::Status s = NcclStatus(r, comm_, "ncclCommInitRankConfig");
      absl::MutexLock lock(&mu_);
      AbortCommLocked();
      return s;
    }
    absl::Status s = Poll(deadline, "communicator init", /*wait_event=*/false);
    if (!s.ok()) {
      absl::MutexLock lock(&mu_);
      AbortCommLocked();
      broken_ = s;
      return s;
    }
    return absl::OkStatus();
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* name() const override { return "nccl"; }
  uint64_t host_waits() const override { return host_waits_.load(std::memory_order_relaxed); }

  absl::Status Allgather(const void* in, size_t bytes, void* out,
                         const CollectiveOptions& o) override {
    RETURN_IF_ERROR(CheckBuffers("Allgather", bytes, in, out));
    absl::Time deadline;
    RETURN_IF_ERROR(Begin(o, &deadline));
    absl::Status s = [&]() -> absl::Status {
      RETURN_IF_ERROR(CheckDescriptor(Kind::kAllgather, o, bytes, 0, deadline));
      if (bytes == 0) return absl::OkStatus();
      return Execute(in, bytes, out, bytes * size_, /*in_place=*/false, deadline, "Allgather",
                     [&](const void* din, void* dout) {
                       return ncclAllGather(din, dout, bytes, ncclUint8, comm_, stream_);
                     });
    }();
    return End(std::move(s));
  }

  absl::Status AllgatherV(const void* in, absl::Span<const size_t> recv_bytes, void* out,
                          const CollectiveOptions& o) override {
    RETURN_IF_ERROR(CheckAllgatherV(rank_, size_, in, recv_bytes, out));
    std::vector<size_t> offset(size_ + 1, 0);
    for (int r = 0; r < size_; ++r) offset[r + 1] = offset[r] + recv_bytes[r];
    const size_t total = offset[size_];
    absl::Time deadline;
    RETURN_IF_ERROR(Begin(o, &deadline));
    absl::Status s = [&]() -> absl::Status {
      RETURN_IF_ERROR(CheckDescriptor(Kind::kAllgatherV, o, static_cast<int64_t>(total),
                                      static_cast<int64_t>(HashSizes(recv_bytes)), deadline));
      if (total == 0) return absl::OkStatus();
      // No all-gather-v in NCCL: one broadcast per contributing root, grouped.
      return Execute(in, recv_bytes[rank_], out, total, /*in_place=*/false, deadline, "AllgatherV",
                     [&](const void* din, void* dout) {
                       char* base = static_cast<char*>(dout);
                       for (int r = 0; r < size_; ++r) {
                         if (recv_bytes[r] == 0) continue;
                         const void* send = r == rank_ ? din : base + offset[r];
                         const ncclResult_t res = ncclBroadcast(
                             send, base + offset[r], recv_bytes[r], ncclUint8, r, comm_, stream_);
                         if (res != ncclSuccess && res != ncclInProgress) return res;
                       }
                       return ncclSuccess;
                     });
    }();
    return End(std::move(s));
  }

  absl::Status AllreduceSum(void* data, size_t count, DataType type,
                            const CollectiveOptions& o) override {
    if (count > 0 && data == nullptr) return absl::InvalidArgumentError("AllreduceSum: null data");
    ncclDataType_t dt;
    switch (type) {
      case DataType::kFloat32:
        dt = ncclFloat32;
        break;
      case DataType::kInt32:
        dt = ncclInt32;
        break;
      case DataType::kInt64:
        dt = ncclInt64;
        break;
      default:
        return absl::InvalidArgumentError(
            absl::StrCat("AllreduceSum: ", kernels::ElementTypeName(type),
                         " is not summed over NCCL (bf16/fp16 sums: the host backends only)"));
    }
    const size_t bytes = count * kernels::ElementBytes(type);
    absl::Time deadline;
    RETURN_IF_ERROR(Begin(o, &deadline));
    absl::Status s = [&]() -> absl::Status {
      RETURN_IF_ERROR(CheckDescriptor(Kind::kAllreduce, o, static_cast<int64_t>(count),
                                      static_cast<int64_t>(type), deadline));
      if (count == 0) return absl::OkStatus();
      return Execute(data, bytes, data, bytes, /*in_place=*/true, deadline, "AllreduceSum",
                     [&](const void* din, void* dout) {
                       return ncclAllReduce(din, dout, count, dt, ncclSum, comm_, stream_);
                     });
    }();
    return End(std::move(s));
  }

  // The descriptor round alone: every rank must arrive.
  absl::Status Barrier(const CollectiveOptions& o) override {
    absl::Time deadline;
    RETURN_IF_ERROR(Begin(o, &deadline));
    absl::Status s = ExchangeDescriptor(Kind::kBarrier, o.tag, 0, 0, deadline);
    return End(std::move(s));
  }

  void Abort(const absl::Status& reason) override {
    absl::MutexLock lock(&mu_);
    if (broken_.ok()) {
      broken_ = absl::AbortedError(absl::StrCat("nccl transport aborted: ", reason.message()));
    }
    abort_requested_.store(true);
    // A call in progress aborts the communicator itself when it sees the
    // request; otherwise nobody uses it now.
    if (!in_call_) AbortCommLocked();
  }

 private:
  absl::Status Begin(const CollectiveOptions& o, absl::Time* deadline) {
    absl::MutexLock lock(&mu_);
    if (!broken_.ok()) return broken_;
    const absl::Time now = absl::Now();
    *deadline = o.deadline == absl::InfiniteFuture() ? now + timeout_ : o.deadline;
    if (*deadline <= now) {
      broken_ = absl::DeadlineExceededError(
          absl::StrCat("nccl transport: deadline already passed (tag ", o.tag, ")"));
      AbortCommLocked();
      return broken_;
    }
    if (cudaSetDevice(device_) != cudaSuccess) {
      broken_ = absl::InternalError("nccl transport: cudaSetDevice failed");
      AbortCommLocked();
      return broken_;
    }
    in_call_ = true;
    return absl::OkStatus();
  }

  // Ends a call: any failure (or an Abort during the call) breaks the transport.
  absl::Status End(absl::Status s) {
    absl::MutexLock lock(&mu_);
    in_call_ = false;
    if (!s.ok() && broken_.ok()) broken_ = s;
    if (!broken_.ok()) {
      AbortCommLocked();
      return broken_;
    }
    return s;
  }

  void AbortCommLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (comm_ != nullptr) {
      ncclCommAbort(comm_);
      comm_ = nullptr;
    }
  }

  // Polls until the group's operations are enqueued (wait_event false) or the
  // work up to event_ is done (true).
  absl::Status Poll(absl::Time deadline, const char* what, bool wait_event) {
    const kernels::PollPacer pacer;
    for (;;) {
      if (abort_requested_.load()) {
        return absl::AbortedError(absl::StrCat("nccl transport: aborted during ", what));
      }
      ncclResult_t async = ncclSuccess;
      const ncclResult_t r = ncclCommGetAsyncError(comm_, &async);
      if (r != ncclSuccess) return NcclStatus(r, comm_, "ncclCommGetAsyncError");
      if (async != ncclSuccess && async != ncclInProgress) {
        return NcclStatus(async, comm_, what);
      }
      bool done = async == ncclSuccess;
      if (wait_event && done) {
        const cudaError_t e = cudaEventQuery(event_);
        if (e != cudaSuccess && e != cudaErrorNotReady) return CudaStatus(e, what);
        done = e == cudaSuccess;
      }
      if (done) return absl::OkStatus();
      if (absl::Now() >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat("nccl transport: ", what,
                                                        " did not complete by its deadline (rank ",
                                                        rank_, " of ", size_, ")"));
      }
      pacer.Pause();
    }
  }

  // Runs `enqueue` (NCCL calls) inside one group.
  absl::Status Group(const std::function<ncclResult_t()>& enqueue, absl::Time deadline,
                     const char* what) {
    RETURN_IF_ERROR(NcclStatus(ncclGroupStart(), comm_, "ncclGroupStart"));
    const ncclResult_t r1 = enqueue();
    const ncclResult_t r2 = ncclGroupEnd();  // always closes the group
    if (r1 != ncclSuccess && r1 != ncclInProgress) return NcclStatus(r1, comm_, what);
    if (r2 == ncclInProgress) return Poll(deadline, what, /*wait_event=*/false);
    return NcclStatus(r2, comm_, what);
  }

  // The host's wait for the call's work on the stream: one per collective,
  // one more for its descriptor round.
  absl::Status RecordAndWait(absl::Time deadline, const char* what) {
    RETURN_IF_ERROR(CudaStatus(cudaEventRecord(event_, stream_), "cudaEventRecord"));
    host_waits_.fetch_add(1, std::memory_order_relaxed);
    return Poll(deadline, what, /*wait_event=*/true);
  }

  absl::Status ExchangeDescriptor(Kind kind, uint32_t tag, int64_t a, int64_t b,
                                  absl::Time deadline) {
    ++calls_;
    int64_t* mine = desc_host_;
    mine[0] = kMagic;
    mine[1] = static_cast<int64_t>(kind) << 32 | tag;
    mine[2] = a;
    mine[3] = b ^ static_cast<int64_t>(calls_ << 40);
    const size_t bytes = sizeof(int64_t) * kDescWords;
    RETURN_IF_ERROR(CudaStatus(
        cudaMemcpyAsync(desc_dev_, mine, bytes, cudaMemcpyHostToDevice, stream_), "copy"));
    RETURN_IF_ERROR(Group(
        [&] {
          return ncclAllGather(desc_dev_, desc_dev_ + kDescWords, kDescWords, ncclInt64, comm_,
                               stream_);
        },
        deadline, "descriptor exchange"));
    RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(desc_host_ + kDescWords, desc_dev_ + kDescWords,
                                               bytes * size_, cudaMemcpyDeviceToHost, stream_),
                               "copy"));
    RETURN_IF_ERROR(RecordAndWait(deadline, KindName(static_cast<int64_t>(kind))));
    for (int r = 0; r < size_; ++r) {
      const int64_t* theirs = desc_host_ + kDescWords * (r + 1);
      if (std::memcmp(theirs, mine, bytes) != 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "nccl transport: collective mismatch: rank ", rank_, " called ",
            KindName(static_cast<int64_t>(kind)), " tag ", tag, " size ", a, ", rank ", r,
            " called ", theirs[0] == kMagic ? KindName(theirs[1] >> 32) : "garbage", " tag ",
            static_cast<uint32_t>(theirs[1]), " size ", theirs[2],
            (theirs[1] == mine[1] && theirs[2] == mine[2]) ? " (other sizes or call count)" : ""));
      }
    }
    return absl::OkStatus();
  }

  // The descriptor round, unless checks are off or the caller says every
  // rank agrees on this call's shape (CollectiveOptions::shape_agreed).
  absl::Status CheckDescriptor(Kind kind, const CollectiveOptions& o, int64_t a, int64_t b,
                               absl::Time deadline) {
    if (!check_ || o.shape_agreed) return absl::OkStatus();
    return ExchangeDescriptor(kind, o.tag, a, b, deadline);
  }

  // Grows the staging buffers to `bytes` each.
  absl::Status ReserveStaging(size_t bytes) {
    if (bytes <= stage_bytes_) return absl::OkStatus();
    if (dev_stage_ != nullptr) cudaFree(dev_stage_);
    if (host_stage_ != nullptr) cudaFreeHost(host_stage_);
    dev_stage_ = nullptr;
    host_stage_ = nullptr;
    stage_bytes_ = 0;
    const size_t grown = AlignUp(bytes + bytes / 2);
    RETURN_IF_ERROR(CudaStatus(cudaMalloc(&dev_stage_, grown), "cudaMalloc staging"));
    RETURN_IF_ERROR(CudaStatus(cudaMallocHost(&host_stage_, grown), "cudaMallocHost staging"));
    stage_bytes_ = grown;
    return absl::OkStatus();
  }

  // Runs enqueue(device in, device out) with host buffers staged.
  absl::Status Execute(const void* in, size_t in_bytes, void* out, size_t out_bytes, bool in_place,
                       absl::Time deadline, const char* what,
                       const std::function<ncclResult_t(const void*, void*)>& enqueue) {
    const bool in_host = in_bytes > 0 && !IsDeviceMemory(in);
    const bool out_host = out_bytes > 0 && !IsDeviceMemory(out);
    const size_t in_off = 0;
    const size_t out_off = in_place ? 0 : AlignUp(in_bytes);
    if (in_host || out_host) RETURN_IF_ERROR(ReserveStaging(out_off + out_bytes));
    char* dstage = static_cast<char*>(dev_stage_);
    char* hstage = static_cast<char*>(host_stage_);
    const void* din = in;
    void* dout = out;
    if (in_place) {
      if (in_host) din = dout = dstage;
    } else {
      if (in_host) din = dstage + in_off;
      if (out_host) dout = dstage + out_off;
    }
    if (in_host) {
      std::memcpy(hstage + in_off, in, in_bytes);
      RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(dstage + in_off, hstage + in_off, in_bytes,
                                                 cudaMemcpyHostToDevice, stream_),
                                 "copy to device"));
    }
    RETURN_IF_ERROR(Group([&] { return enqueue(din, dout); }, deadline, what));
    if (out_host) {
      RETURN_IF_ERROR(CudaStatus(
          cudaMemcpyAsync(hstage + out_off, dout, out_bytes, cudaMemcpyDeviceToHost, stream_),
          "copy to host"));
    }
    RETURN_IF_ERROR(RecordAndWait(deadline, what));
    if (out_host) std::memcpy(out, hstage + out_off, out_bytes);
    return absl::OkStatus();
  }

  const int rank_;
  const int size_;
  const int device_;
  const absl::Duration timeout_;
  const bool check_;
  cudaStream_t stream_;
  bool owns_stream_ = false;
  cudaEvent_t event_ = nullptr;
  int64_t* desc_dev_ = nullptr;   // kDescWords mine, then kDescWords per rank
  int64_t* desc_host_ = nullptr;  // pinned, same layout
  void* dev_stage_ = nullptr;
  void* host_stage_ = nullptr;  // pinned
  size_t stage_bytes_ = 0;
  uint64_t calls_ = 0;

  absl::Mutex mu_;
  // Written under mu_; read without it only by the thread in a call (in_call_),
  // which Abort leaves alone.
  ncclComm_t comm_ = nullptr;
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
  bool in_call_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<bool> abort_requested_{false};
  std::atomic<uint64_t> host_waits_{0};
};

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> CreateNcclTransport(const NcclOptions& o) {
  if (o.size < 1 || o.rank < 0 || o.rank >= o.size || o.store == nullptr ||
      o.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("nccl transport: bad options (rank ", o.rank, " of ", o.size, ")"));
  }
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    cudaGetLastError();
    return absl::FailedPreconditionError(
        absl::StrCat("nccl transport: no usable CUDA device: ",
                     err != cudaSuccess ? cudaGetErrorString(err) : "no CUDA device"));
  }
  if (o.device < 0 || o.device >= count) {
    return absl::FailedPreconditionError(
        absl::StrCat("nccl transport: CUDA device ", o.device, " out of range (", count, ")"));
  }
  const absl::Time deadline = absl::Now() + o.timeout;
  const std::string key = absl::StrCat(o.prefix, "/unique_id");
  ncclUniqueId id;
  if (o.rank == 0) {
    const ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess) return NcclStatus(r, nullptr, "ncclGetUniqueId");
    RETURN_IF_ERROR(o.store->Set(key, std::string(id.internal, sizeof(id.internal))));
  } else {
    auto v = o.store->Get({&key, 1}, deadline);
    if (!v.ok()) return v.status();
    if ((*v)[0].size() != sizeof(id.internal)) {
      return absl::InvalidArgumentError(absl::StrCat("nccl transport: unique id under '", key,
                                                     "' has ", (*v)[0].size(), " bytes, want ",
                                                     sizeof(id.internal)));
    }
    std::memcpy(id.internal, (*v)[0].data(), sizeof(id.internal));
  }
  auto t = std::make_unique<NcclTransport>(o);
  RETURN_IF_ERROR(t->Init(id, deadline));
  return std::unique_ptr<Transport>(std::move(t));
}

}  // namespace microd::transport
