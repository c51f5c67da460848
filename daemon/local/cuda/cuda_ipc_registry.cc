// SPDX-License-Identifier: Apache-2.0
// CUDA IPC buffers over the CUDA runtime. Written and compiled without a GPU
// (see the GPU test tests/integration/daemon_cuda_test.cc): every CUDA call
// is checked and every wait polls against a deadline, so that a stuck GPU or
// a process whose ready event never fires ends in an error, not a hang.
//
// Life cycle: a Device (one non-blocking stream per GPU) is shared by the
// allocations opened on it; an Allocation (one cudaIpcOpenMemHandle per
// process and allocation) is shared by the buffers in it and by the
// registry's cache until the process leaves; a Buffer owns its ready event
// (opened from the process's handle), its copy-done event and its pinned
// staging memory. Whatever is destroyed last closes.
#include "daemon/local/cuda/cuda_ipc_registry.h"

#include <cuda.h>  // driver types, for the entry points below (no link to libcuda)
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "daemon/common/log.h"
#include "daemon/common/status_macros.h"
#include "daemon/common/status_map.h"

namespace microd::local::cuda {
namespace {

// The driver functions the runtime does not offer, fetched through the
// runtime (cudaGetDriverEntryPointByVersion) so that the daemon does not link
// libcuda and still starts on machines without a driver.
using MemGetAddressRangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
using DeviceGetFn = CUresult (*)(CUdevice*, int);
using DeviceGetUuidFn = CUresult (*)(CUuuid*, CUdevice);

constexpr unsigned kDriverApiVersion = 12000;  // the _v2 ABIs of these symbols
constexpr absl::Duration kMaxNap = absl::Milliseconds(1);

// A failed runtime call as a Status with the client code to answer with.
absl::Status CudaError(cudaError_t e, const std::string& what,
                       ClientStatus code = ClientStatus::kInternal) {
  // Clears a non-sticky error so that it does not surface in a later,
  // unrelated cudaGetLastError on this thread.
  (void)cudaGetLastError();
  return WithClientStatus(absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorName(e), " (",
                                                           cudaGetErrorString(e), ")")),
                          code);
}

// As nvidia-smi -L prints it.
std::string UuidString(const uint8_t* u) {
  char out[48];
  std::snprintf(out, sizeof out,
                "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0],
                u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13],
                u[14], u[15]);
  return out;
}

template <typename Fn>
absl::Status EntryPoint(const char* symbol, unsigned version, Fn* fn) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t e =
      cudaGetDriverEntryPointByVersion(symbol, &p, version, cudaEnableDefault, &found);
  if (e != cudaSuccess) {
    return CudaError(e, absl::StrCat("cudaGetDriverEntryPointByVersion(", symbol, ")"),
                     ClientStatus::kUnsupported);
  }
  if (found != cudaDriverEntryPointSuccess || p == nullptr) {
    return absl::UnimplementedError(
        absl::StrCat("the CUDA driver has no ", symbol, " (ABI ", version, "): too old"));
  }
  *fn = reinterpret_cast<Fn>(p);
  return absl::OkStatus();
}

// Resources handed over when a copy may still be running at destruction:
// freeing them could let the GPU write into freed memory, so they are kept
// for the life of the process (deliberately never destroyed, not even at exit
// when the CUDA runtime may be gone).
void KeepForever(std::shared_ptr<void> what) {
  static absl::Mutex mu(absl::kConstInit);
  static auto* kept = new std::vector<std::shared_ptr<void>>();  // never deleted, on purpose
  absl::MutexLock lock(&mu);
  kept->push_back(std::move(what));
}

// One GPU of this daemon: the stream every staging copy to or from it runs on.
class Device {
 public:
  static absl::StatusOr<std::shared_ptr<Device>> Create(int ordinal) {
    cudaError_t e = cudaSetDevice(ordinal);
    if (e != cudaSuccess) return CudaError(e, absl::StrCat("cudaSetDevice(", ordinal, ")"));
    cudaStream_t stream = nullptr;
    e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
      return CudaError(e, absl::StrCat("cudaStreamCreateWithFlags on GPU ", ordinal));
    }
    return std::make_shared<Device>(ordinal, stream);
  }
  Device(int ordinal, cudaStream_t stream) : ordinal_(ordinal), stream_(stream) {}
  ~Device() {
    if (cudaSetDevice(ordinal_) == cudaSuccess) (void)cudaStreamDestroy(stream_);
    (void)cudaGetLastError();
  }
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;
  int ordinal() const { return ordinal_; }
  cudaStream_t stream() const { return stream_; }
  // Makes this GPU current on the calling thread.
  absl::Status Use() const {
    const cudaError_t e = cudaSetDevice(ordinal_);
    if (e != cudaSuccess) return CudaError(e, absl::StrCat("cudaSetDevice(", ordinal_, ")"));
    return absl::OkStatus();
  }

 private:
  const int ordinal_;
  const cudaStream_t stream_;
};

// One allocation of one process, mapped into the daemon.
class Allocation {
 public:
  Allocation(std::shared_ptr<Device> device, void* base, size_t bytes, pid_t pid)
      : device_(std::move(device)), base_(base), bytes_(bytes), pid_(pid) {}
  ~Allocation() {
    if (device_->Use().ok()) {
      const cudaError_t e = cudaIpcCloseMemHandle(base_);
      if (e != cudaSuccess) {
        MICROD_LOG(Warning, "closing the CUDA IPC mapping of process %d: %s",
                   static_cast<int>(pid_), cudaGetErrorString(e));
      }
    }
    (void)cudaGetLastError();
  }
  Allocation(const Allocation&) = delete;
  Allocation& operator=(const Allocation&) = delete;
  const std::shared_ptr<Device>& device() const { return device_; }
  char* base() const { return static_cast<char*>(base_); }
  size_t bytes() const { return bytes_; }

 private:
  const std::shared_ptr<Device> device_;
  void* const base_;
  const size_t bytes_;
  const pid_t pid_;
};

// Polls `event` until it completed, `deadline` passed or `abandoned()`.
absl::Status WaitForEvent(cudaEvent_t event, absl::Time deadline, const std::string& what,
                          const std::function<bool()>& abandoned = nullptr) {
  absl::Duration nap = absl::Microseconds(10);
  for (;;) {
    const cudaError_t e = cudaEventQuery(event);
    if (e == cudaSuccess) return absl::OkStatus();
    if (e != cudaErrorNotReady) return CudaError(e, absl::StrCat(what, ": cudaEventQuery"));
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(what, ": not done by the deadline"));
    }
    if (abandoned && abandoned()) {
      return absl::AbortedError(absl::StrCat(what, ": no longer waited for (the job failed)"));
    }
    absl::SleepFor(nap);
    nap = std::min(nap * 2, kMaxNap);
  }
}

class Buffer final : public DeviceMemory {
 public:
  Buffer(std::shared_ptr<Allocation> allocation, uint64_t offset, uint64_t count, cudaEvent_t ready,
         cudaEvent_t done, float* staging, std::string description)
      : allocation_(std::move(allocation)),
        offset_(offset),
        count_(count),
        ready_(ready),
        done_(done),
        staging_(staging),
        description_(std::move(description)) {}

  ~Buffer() override {
    const Device& dev = *allocation_->device();
    const bool current = dev.Use().ok();
    if (in_flight_ && !(current && cudaEventQuery(done_) == cudaSuccess)) {
      // A copy may still read or write the staging memory or the mapping.
      MICROD_LOG(Warning,
                 "%s: a copy is still in flight; its staging memory, events and "
                 "mapping stay allocated until the daemon exits",
                 description_.c_str());
      KeepForever(allocation_);
      (void)cudaGetLastError();
      return;
    }
    if (current) {
      (void)cudaEventDestroy(done_);
      (void)cudaEventDestroy(ready_);  // also how an opened IPC event is released
      (void)cudaFreeHost(staging_);
    }
    (void)cudaGetLastError();
  }

  float* staging() const override { return staging_; }
  uint64_t count() const override { return count_; }
  std::string Describe() const override { return description_; }

  float* mapped() const override { return reinterpret_cast<float*>(allocation_->base() + offset_); }
  int ordinal() const override { return allocation_->device()->ordinal(); }

  absl::Status WaitReady(absl::Time deadline, const std::function<bool()>& abandoned) override {
    RETURN_IF_ERROR(allocation_->device()->Use());
    RETURN_IF_ERROR(CanStart());
    // Host-side wait: when the event does not fire in time nothing has been
    // queued, so giving up leaves no work behind.
    absl::Status ready = WaitForEvent(ready_, deadline, "the process's ready event", abandoned);
    if (absl::IsDeadlineExceeded(ready)) {
      return WithClientStatus(
          absl::DeadlineExceededError(absl::StrCat(
              description_,
              ": the gradient was not ready in time (the CUDA work the process queued before "
              "submitting did not finish by the deadline)")),
          ClientStatus::kTimeout);
    }
    return WithContext(ready);
  }

  absl::Status BeginCopyIn(absl::Time deadline, const std::function<bool()>& abandoned) override {
    RETURN_IF_ERROR(WaitReady(deadline, abandoned));
    return Queue(cudaMemcpyDeviceToHost);
  }

  absl::Status BeginCopyOut() override {
    RETURN_IF_ERROR(allocation_->device()->Use());
    RETURN_IF_ERROR(CanStart());
    return Queue(cudaMemcpyHostToDevice);
  }

  absl::Status Finish(absl::Time deadline) override {
    if (!in_flight_) return absl::OkStatus();
    RETURN_IF_ERROR(allocation_->device()->Use());
    absl::Status s = WaitForEvent(done_, deadline, "the staging copy");
    if (!s.ok()) {
      // Still in flight, or failed in an unknown state: never reuse.
      broken_ = true;
      return WithContext(s);
    }
    in_flight_ = false;
    return absl::OkStatus();
  }

 private:
  // With this buffer's device current.
  absl::Status CanStart() {
    if (broken_) {
      return absl::InternalError(
          absl::StrCat(description_, ": an earlier copy failed or timed out; not reused"));
    }
    if (in_flight_) {
      // A copy nobody awaited (normally Finish() comes first): done by now?
      if (cudaEventQuery(done_) != cudaSuccess) {
        (void)cudaGetLastError();
        return absl::InternalError(absl::StrCat(description_, ": a copy is still in flight"));
      }
      in_flight_ = false;
    }
    return absl::OkStatus();
  }

  absl::Status WithContext(const absl::Status& s) const {
    if (s.ok()) return s;
    return WithMessage(s, absl::StrCat(description_, ": ", s.message()));
  }

  absl::Status Queue(cudaMemcpyKind kind) {
    if (staging_ == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat(description_, ": no staging memory (a device-resident daemon)"));
    }
    const bool in = kind == cudaMemcpyDeviceToHost;
    char* device = allocation_->base() + offset_;
    const size_t bytes = count_ * sizeof(float);
    cudaStream_t stream = allocation_->device()->stream();
    cudaError_t e = in ? cudaMemcpyAsync(staging_, device, bytes, kind, stream)
                       : cudaMemcpyAsync(device, staging_, bytes, kind, stream);
    if (e != cudaSuccess) {
      // Nothing was queued; a sticky error would fail every later call too.
      broken_ = true;
      return WithContext(
          CudaError(e, in ? "cudaMemcpyAsync device -> host" : "cudaMemcpyAsync host -> device"));
    }
    in_flight_ = true;
    e = cudaEventRecord(done_, stream);
    if (e != cudaSuccess) {
      broken_ = true;  // the copy is queued but cannot be waited for
      return WithContext(CudaError(e, "cudaEventRecord after the staging copy"));
    }
    return absl::OkStatus();
  }

  const std::shared_ptr<Allocation> allocation_;
  const uint64_t offset_;
  const uint64_t count_;
  const cudaEvent_t ready_;
  const cudaEvent_t done_;
  float* const staging_;
  const std::string description_;
  // Engine thread only (one step at a time uses a buffer).
  bool in_flight_ = false;
  bool broken_ = false;
};

struct DeviceIds {
  std::array<uint8_t, 16> uuid_v2{};
  std::array<uint8_t, 16> uuid_v1{};
  bool has_v1 = false;
};

class Registry final : public CudaIpcRegistry {
 public:
  Registry(MemGetAddressRangeFn mem_get_address_range, std::vector<DeviceIds> ids,
           int resident_device)
      : mem_get_address_range_(mem_get_address_range),
        ids_(std::move(ids)),
        resident_device_(resident_device) {}

  absl::StatusOr<std::unique_ptr<DeviceMemory>> Open(const CudaIpcRequest& r) override {
    const std::string who =
        absl::StrCat("buffer '", r.name, "' of process ", r.pid, " (its GPU ", r.client_device,
                     ", ", UuidString(r.device_uuid.data()), ")");
    int ordinal = -1;
    for (size_t i = 0; i < ids_.size() && ordinal < 0; ++i) {
      if (ids_[i].uuid_v2 == r.device_uuid ||
          (ids_[i].has_v1 && ids_[i].uuid_v1 == r.device_uuid)) {
        ordinal = static_cast<int>(i);
      }
    }
    if (ordinal < 0) {
      return WithClientStatus(absl::FailedPreconditionError(absl::StrCat(
                                  who, ": that GPU is not visible to microd (it sees ", ids_.size(),
                                  " GPUs): give the trainer and the sidecar the same GPUs")),
                              ClientStatus::kUnsupported);
    }
    if (resident_device_ >= 0 && ordinal != resident_device_) {
      // Refused before anything opens (no CUDA context on that GPU).
      return WithClientStatus(
          absl::FailedPreconditionError(absl::StrCat(
              who, ": it is GPU ", ordinal, " here; this daemon reduces on GPU ", resident_device_,
              " (--cuda_device) and takes only CUDA buffers on that GPU")),
          ClientStatus::kUnsupported);
    }
    absl::MutexLock lock(&mu_);
    ASSIGN_OR_RETURN(std::shared_ptr<Device> device, GetDevice(ordinal));
    RETURN_IF_ERROR(device->Use());
    ASSIGN_OR_RETURN(std::shared_ptr<Allocation> allocation, GetAllocation(r, device, who));
    const uint64_t bytes = r.count * sizeof(float);
    if (r.offset > allocation->bytes() || bytes > allocation->bytes() - r.offset) {
      return WithClientStatus(absl::InvalidArgumentError(absl::StrCat(
                                  who, ": ", bytes, " bytes at offset ", r.offset,
                                  " run past its allocation, which has ", allocation->bytes(),
                                  " bytes here (the process said ", r.alloc_bytes, ")")),
                              ClientStatus::kInvalidArgument);
    }

    cudaIpcEventHandle_t event_handle;
    static_assert(sizeof event_handle == 64, "cudaIpcEventHandle_t");
    std::memcpy(&event_handle, r.event_handle.data(), sizeof event_handle);
    cudaEvent_t ready = nullptr;
    cudaError_t e = cudaIpcOpenEventHandle(&ready, event_handle);
    if (e != cudaSuccess) {
      return CudaError(e, absl::StrCat(who, ": cudaIpcOpenEventHandle of its ready event"),
                       ClientStatus::kInvalidArgument);
    }
    cudaEvent_t done = nullptr;
    e = cudaEventCreateWithFlags(&done, cudaEventDisableTiming);
    if (e != cudaSuccess) {
      (void)cudaEventDestroy(ready);
      return CudaError(e, absl::StrCat(who, ": cudaEventCreateWithFlags"));
    }
    void* staging = nullptr;
    if (resident_device_ < 0)
      e = cudaHostAlloc(&staging, std::max<size_t>(bytes, 1), cudaHostAllocPortable);
    if (e != cudaSuccess) {
      (void)cudaEventDestroy(done);
      (void)cudaEventDestroy(ready);
      return CudaError(e,
                       absl::StrCat(who, ": cudaHostAlloc of ", bytes, " bytes of staging memory"),
                       ClientStatus::kResource);
    }
    const std::string description =
        absl::StrCat("CUDA buffer '", r.name, "' of process ", r.pid, " (", bytes,
                     " bytes at offset ", r.offset, " of an allocation on GPU ", ordinal, ")");
    return std::unique_ptr<DeviceMemory>(
        std::make_unique<Buffer>(std::move(allocation), r.offset, r.count, ready, done,
                                 static_cast<float*>(staging), description));
  }

  void ForgetClient(uint64_t client) override {
    std::map<std::array<uint8_t, 64>, std::shared_ptr<Allocation>> gone;
    {
      absl::MutexLock lock(&mu_);
      auto it = allocations_.find(client);
      if (it == allocations_.end()) return;
      gone.swap(it->second);
      allocations_.erase(it);
    }
    // `gone` closes here, outside the lock, each mapping whose buffers are gone.
  }

 private:
  absl::StatusOr<std::shared_ptr<Device>> GetDevice(int ordinal)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = devices_.find(ordinal);
    if (it != devices_.end()) return it->second;
    ASSIGN_OR_RETURN(std::shared_ptr<Device> device, Device::Create(ordinal));
    devices_[ordinal] = device;
    return device;
  }

  absl::StatusOr<std::shared_ptr<Allocation>> GetAllocation(const CudaIpcRequest& r,
                                                            const std::shared_ptr<Device>& device,
                                                            const std::string& who)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto& mine = allocations_[r.client];
    auto it = mine.find(r.mem_handle);
    if (it != mine.end()) {
      if (it->second->device() != device) {
        return WithClientStatus(absl::InvalidArgumentError(absl::StrCat(
                                    who, ": the allocation was registered before on another GPU")),
                                ClientStatus::kInvalidArgument);
      }
      return it->second;
    }
    cudaIpcMemHandle_t handle;
    static_assert(sizeof handle == 64, "cudaIpcMemHandle_t");
    std::memcpy(&handle, r.mem_handle.data(), sizeof handle);
    void* base = nullptr;
    cudaError_t e = cudaIpcOpenMemHandle(&base, handle, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
      return CudaError(e,
                       absl::StrCat(who,
                                    ": cudaIpcOpenMemHandle (is the allocation still alive, and "
                                    "from cudaMalloc?)"),
                       ClientStatus::kInvalidArgument);
    }
    // The mapping's real size, not the one the process claims.
    CUdeviceptr range_base = 0;
    size_t range_bytes = 0;
    const CUresult cr =
        mem_get_address_range_(&range_base, &range_bytes, reinterpret_cast<CUdeviceptr>(base));
    if (cr != CUDA_SUCCESS || range_base != reinterpret_cast<CUdeviceptr>(base)) {
      (void)cudaIpcCloseMemHandle(base);
      (void)cudaGetLastError();
      return WithClientStatus(
          absl::InternalError(absl::StrCat(
              who, ": cuMemGetAddressRange of the opened mapping: ",
              cr != CUDA_SUCCESS ? absl::StrCat("CUDA error ", cr) : "not at the mapping's start")),
          ClientStatus::kInternal);
    }
    auto allocation = std::make_shared<Allocation>(device, base, range_bytes, r.pid);
    mine[r.mem_handle] = allocation;
    return allocation;
  }

  const MemGetAddressRangeFn mem_get_address_range_;
  const std::vector<DeviceIds> ids_;  // by this daemon's device ordinal
  // The GPU of a device-resident engine: buffers there only, no pinned
  // staging copies. -1: any GPU, each buffer with its staging copy.
  const int resident_device_;
  absl::Mutex mu_;
  std::map<int, std::shared_ptr<Device>> devices_ ABSL_GUARDED_BY(mu_);
  // By process, then by the allocation's IPC handle.
  std::map<uint64_t, std::map<std::array<uint8_t, 64>, std::shared_ptr<Allocation>>> allocations_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<CudaIpcRegistry>> CreateRegistry(int resident_device) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    // e.g. "CUDA driver version is insufficient for CUDA runtime version": no GPU.
    return absl::UnimplementedError(absl::StrCat("no usable CUDA device: ", cudaGetErrorString(e)));
  }
  if (count <= 0) return absl::UnimplementedError("no usable CUDA device: none found");
  MemGetAddressRangeFn mem_get_address_range = nullptr;
  DeviceGetFn device_get = nullptr;
  DeviceGetUuidFn uuid_v2 = nullptr, uuid_v1 = nullptr;
  RETURN_IF_ERROR(EntryPoint("cuMemGetAddressRange", kDriverApiVersion, &mem_get_address_range));
  RETURN_IF_ERROR(EntryPoint("cuDeviceGet", kDriverApiVersion, &device_get));
  RETURN_IF_ERROR(EntryPoint("cuDeviceGetUuid", kDriverApiVersion, &uuid_v2));
  // The pre-MIG UUID as well, for clients whose driver lacks the _v2 one.
  if (!EntryPoint("cuDeviceGetUuid", 9020, &uuid_v1).ok()) uuid_v1 = nullptr;
  std::vector<DeviceIds> ids(count);
  for (int i = 0; i < count; ++i) {
    CUdevice dev = 0;
    CUresult r = device_get(&dev, i);
    if (r != CUDA_SUCCESS) {
      return absl::UnimplementedError(absl::StrCat("cuDeviceGet(", i, "): CUDA error ", r));
    }
    CUuuid u{};
    r = uuid_v2(&u, dev);
    if (r != CUDA_SUCCESS) {
      return absl::UnimplementedError(absl::StrCat("cuDeviceGetUuid(", i, "): CUDA error ", r));
    }
    std::memcpy(ids[i].uuid_v2.data(), u.bytes, 16);
    if (uuid_v1 != nullptr && uuid_v1(&u, dev) == CUDA_SUCCESS) {
      std::memcpy(ids[i].uuid_v1.data(), u.bytes, 16);
      ids[i].has_v1 = true;
    }
  }
  return std::unique_ptr<CudaIpcRegistry>(
      std::make_unique<Registry>(mem_get_address_range, std::move(ids), resident_device));
}

}  // namespace microd::local::cuda
